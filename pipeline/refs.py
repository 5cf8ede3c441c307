"""Refs and versioned keys: the only things stages hand each other.

A `Ref` names a payload that already sits in an object store. It is small, immutable and
serialisable with msgspec (no pickle), so it can cross a channel, a process or a network and be
recorded in the ledger and the replay index. The payload itself never travels with it.

Invariant: `key` is unique for the run, and its version component is the *oldest* version whose
output is in the payload, so "everything older than v" is a key-range operation.
"""

from __future__ import annotations

import re

import msgspec

KEY_PATTERN = re.compile(r"^(?P<run>[^/]+)/v(?P<version>\d{8})/(?P<group>[^/]+)/(?P<sample>[^/]+)$")


class Ref(msgspec.Struct, frozen=True, kw_only=True):
    """A handle on one stored payload.

    store:       name of the store that holds it (so a consumer can refuse a foreign ref)
    key:         `run/v{version:08d}/{group}/{sample}` (see `make_key`)
    version:     oldest version that produced any of its contents
    version_max: newest such version (== version unless the payload spans a version change)
    rows:        number of items in the payload
    nbytes:      payload size in bytes (what byte-bounded channels count)
    checksum:    checksum of the payload body, as written by the codec
    group:       the group the payload belongs to (items of one group are trained together)
    """

    store: str
    key: str
    version: int
    version_max: int
    rows: int
    nbytes: int
    checksum: int
    group: str

    @property
    def item_ids(self) -> list[str]:
        """Stable ids of the items in the payload: `{group}/{row}`."""
        return [f"{self.group}/{i}" for i in range(self.rows)]


class HeldRef(msgspec.Struct, frozen=True, kw_only=True):
    """A ref the pipeline held at a checkpoint: `holder` says where ("channel:produced", "buffer",
    "learner" ...), `uses` how often the consumer had trained on it already (its replay window)."""

    ref: Ref
    holder: str
    uses: int = 0


class Produced(msgspec.Struct, frozen=True):
    """One produced group, as the ledger records it: its items, versions and what it was made from,
    and optionally named values with one number per item (for bias accounting; see pipeline.ledger)."""

    ids: list[str]
    group: str
    versions: tuple[int, int]
    source: bytes
    values: dict[str, list[float]] = msgspec.field(default_factory=dict)


class Redo(msgspec.Struct, frozen=True):
    """Feedback to the producer: the work unit `group` must be produced again (its result was
    lost, or refused by the policy). The producer remembers what each unit was made from."""

    group: str
    reason: str


def make_key(run: str, version: int, group: str, sample: str) -> str:
    """`run/v{version:08d}/{group}/{sample}`; no part may contain '/'."""
    for name, part in (("run", run), ("group", group), ("sample", sample)):
        if not part or "/" in part:
            raise ValueError(f"key part {name}={part!r} must be non-empty and contain no '/'")
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return f"{run}/v{version:08d}/{group}/{sample}"


def parse_key(key: str) -> tuple[str, int, str, str]:
    """Inverse of `make_key`: (run, version, group, sample). Raises ValueError on a foreign key."""
    m = KEY_PATTERN.match(key)
    if m is None:
        raise ValueError(f"not a versioned key: {key!r} (expected run/v00000000/group/sample)")
    return m["run"], int(m["version"]), m["group"], m["sample"]


def older_than_pattern(run: str, version: int) -> str:
    """A regex matching every key of `run` whose version is < `version` (for store.remove_matching)."""
    if version <= 0:
        return r"(?!)"  # matches nothing
    width = 8
    digits = f"{version:0{width}d}"
    # keys are zero-padded, so "less than" is a lexicographic prefix comparison, digit by digit
    alternatives = []
    for i, d in enumerate(digits):
        if d != "0":
            alternatives.append(re.escape(digits[:i]) + f"[0-{int(d) - 1}]" + r"\d" * (width - i - 1))
    return rf"^{re.escape(run)}/v(?:{'|'.join(alternatives)})/"
