"""The rollout batch in memory: `RolloutBatch`, a columnar, typed-ragged batch of rollouts whose
invariants are checked at construction, the dtypes and meta values it may hold, and `to_torch` for
zero-copy tensors. Its wire format is `buffers.codec`'s.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["ALLOWED_DTYPES", "MetaValue", "RolloutBatch", "to_torch"]

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
MetaValue = str | int | float | bool

ALLOWED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(name).newbyteorder("<")
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64",
    )
)  # fmt: skip
_WIRE_DTYPES: dict[str, np.dtype] = {dt.str: dt for dt in ALLOWED_DTYPES}
_ALLOWED_NAMES = ", ".join(dt.name for dt in ALLOWED_DTYPES)


@functools.cache
def _wire_dtype(dtype: np.dtype) -> np.dtype | None:
    """The little-endian wire dtype for `dtype`, or None when it is not in the allow-list."""
    if dtype.kind not in "biuf" or dtype.fields is not None:
        return None
    return _WIRE_DTYPES.get(dtype.newbyteorder("<").str)


def _check_array(name: object, arr: object, what: str) -> np.ndarray:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} name must be a non-empty str, got {name!r}")
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{what} {name!r}: expected a numpy array, got {type(arr).__name__}")
    if _wire_dtype(arr.dtype) is None:
        raise ValueError(f"{what} {name!r}: dtype {arr.dtype} is not allowed (allowed: {_ALLOWED_NAMES})")
    return arr


def _check_meta(meta: Mapping[str, MetaValue]) -> dict[str, MetaValue]:
    out: dict[str, MetaValue] = {}
    for key, value in meta.items():
        if not isinstance(key, str):
            raise ValueError(f"meta key {key!r}: expected str, got {type(key).__name__}")
        if type(value) not in (str, int, float, bool):
            raise ValueError(f"meta {key!r}: expected str, int, float or bool, got {type(value).__name__}")
        if type(value) is int and not _I64_MIN <= value <= _I64_MAX:
            raise ValueError(f"meta {key!r}: int {value} does not fit in int64")
        out[key] = value
    return out


@dataclass(frozen=True, eq=False)
class RolloutBatch:
    """A columnar, typed-ragged batch of rollouts.

    Invariants (checked at construction, ValueError naming the field otherwise):
    * `offsets` is int64 of shape (rows + 1,), starts at 0 and never decreases; row i's tokens
      are `[offsets[i]:offsets[i + 1]]` of every token field;
    * every token field has `shape[0] == offsets[-1]` (one entry per token: 1-D, or with trailing dims
      for a per-token array such as an MoE token's routed experts, [tokens, layers, top_k]); every row
      field has `shape[0] == rows`;
    * field names are non-empty, unique across token and row fields, and not "offsets";
    * every dtype is in `ALLOWED_DTYPES` (any byte order; encoded little-endian);
    * meta values are str, int (int64 range), float or bool.
    """

    offsets: np.ndarray
    token_fields: dict[str, np.ndarray]
    row_fields: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, MetaValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        offsets = self.offsets
        if not isinstance(offsets, np.ndarray) or offsets.dtype.kind not in "iu":
            raise ValueError(
                f"offsets: expected an int64 numpy array, got {getattr(offsets, 'dtype', offsets)!r}"
            )
        if offsets.ndim != 1 or offsets.shape[0] < 1:
            raise ValueError(f"offsets: expected shape (rows + 1,), got {offsets.shape}")
        if offsets.dtype != np.int64:
            offsets = offsets.astype(np.int64)
            object.__setattr__(self, "offsets", offsets)
        if offsets[0] != 0:
            raise ValueError(f"offsets: must start at 0, starts at {offsets[0]}")
        if offsets.shape[0] > 1 and bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError("offsets: must be non-decreasing")
        rows, tokens = offsets.shape[0] - 1, int(offsets[-1])
        token_fields = {n: _check_array(n, a, "token field") for n, a in dict(self.token_fields).items()}
        row_fields = {n: _check_array(n, a, "row field") for n, a in dict(self.row_fields).items()}
        for name, arr in token_fields.items():
            if arr.ndim < 1 or arr.shape[0] != tokens:
                raise ValueError(f"token field {name!r}: expected shape ({tokens}, ...) (one entry per token), "
                                 f"got {arr.shape}")
        for name, arr in row_fields.items():
            if arr.ndim < 1 or arr.shape[0] != rows:
                raise ValueError(f"row field {name!r}: expected shape ({rows}, ...), got {arr.shape}")
        if clash := token_fields.keys() & row_fields.keys():
            raise ValueError(f"field names used as both token and row fields: {sorted(clash)}")
        if "offsets" in token_fields or "offsets" in row_fields:
            raise ValueError("field name 'offsets' is reserved for the row offsets")
        object.__setattr__(self, "token_fields", token_fields)
        object.__setattr__(self, "row_fields", row_fields)
        object.__setattr__(self, "meta", _check_meta(self.meta))

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[Mapping[str, np.ndarray]],
        row_fields: Mapping[str, np.ndarray] | None = None,
        meta: Mapping[str, MetaValue] | None = None,
    ) -> RolloutBatch:
        """Build a batch from per-row token arrays (every row has the same field names; each array's first
        dimension is the row's tokens, its trailing ones the same in every row)."""
        names = list(rows[0]) if rows else []
        lengths = np.zeros(len(rows) + 1, dtype=np.int64)
        for i, row in enumerate(rows):
            if list(row) != names:
                raise ValueError(f"row {i}: fields {list(row)} differ from row 0's {names}")
            row_lengths = {np.shape(v)[0] if np.ndim(v) >= 1 else -1 for v in row.values()}
            if len(row_lengths) > 1 or -1 in row_lengths:
                raise ValueError(f"row {i}: token fields must have one length (their first dimension), "
                                 f"got {dict(row)!r}")
            lengths[i + 1] = row_lengths.pop() if row_lengths else 0
        token_fields = {name: np.concatenate([np.asarray(row[name]) for row in rows]) for name in names}
        return cls(np.cumsum(lengths), token_fields, dict(row_fields or {}), dict(meta or {}))

    @classmethod
    def _trusted(
        cls,
        offsets: np.ndarray,
        token_fields: dict[str, np.ndarray],
        row_fields: dict[str, np.ndarray],
        meta: dict[str, MetaValue],
    ) -> RolloutBatch:
        """Construct without validation, for `decode`, which has checked the same invariants."""
        batch = object.__new__(cls)
        object.__setattr__(batch, "offsets", offsets)
        object.__setattr__(batch, "token_fields", token_fields)
        object.__setattr__(batch, "row_fields", row_fields)
        object.__setattr__(batch, "meta", meta)
        return batch

    @property
    def rows(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def nbytes(self) -> int:
        """Bytes of array data (offsets included); the encoded payload adds header and padding."""
        return sum(arr.nbytes for _, _, arr in self._columns())

    def row(self, i: int) -> dict[str, np.ndarray]:
        """Views of row i: its slice of every token field and `field[i, ...]` of every row field."""
        if not -self.rows <= i < self.rows:
            raise IndexError(f"row {i} out of range for a batch of {self.rows} rows")
        i %= self.rows
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        out = {name: arr[start:stop] for name, arr in self.token_fields.items()}
        out.update({name: arr[i, ...] for name, arr in self.row_fields.items()})
        return out

    def _columns(self) -> Iterator[tuple[str, Literal["offsets", "token", "row"], np.ndarray]]:
        yield "offsets", "offsets", self.offsets
        for name, arr in self.token_fields.items():
            yield name, "token", arr
        for name, arr in self.row_fields.items():
            yield name, "row", arr


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing `array`'s memory (no copy), also for read-only views from `decode`.

    A tensor made from a read-only array must not be written to; torch's warning about that is
    silenced here because decoded payloads are read-only by design.
    """
    import torch

    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="The given NumPy array is not writable", category=UserWarning
        )
        return torch.from_numpy(array)
