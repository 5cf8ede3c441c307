"""The composition root: the `baton` CLI, the config schema, the builder that wires the parts, resume,
the fault matrix and the simulator. It imports every layer below it; nothing imports it.

Imports nothing itself, so `baton mooncake-master` does not pay for torch.
"""

__version__ = "0.2.0"  # the one place the version is written: pyproject.toml reads it (dynamic)
