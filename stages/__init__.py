"""What runs inside the actors: the rollout producer, engines, tasks, the learner, weight transports.

Exports load lazily, so `baton check` and `baton mooncake-master` do not pay for importing torch.
"""

from importlib import import_module

_EXPORTS = {
    "DatasetTask": "stages.datasets",
    "GRPOLearner": "stages.learner",
    "RewardFunction": "stages.rewards",
    "Rollout": "stages.rollout",
    "TorchEngine": "stages.engines.torch",
    "check_model_folder": "stages.model",
    "load_model": "stages.model",
    "load_tokenizer": "stages.model",
    "make_tiny_model": "stages.model",
    "tasks": "stages.tasks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'stages' has no attribute {name!r}")
    module = import_module(_EXPORTS[name])
    return module if name == "tasks" else getattr(module, name)
