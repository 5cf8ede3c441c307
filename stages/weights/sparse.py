"""Element-level weight deltas: a version sent as the elements that changed since the version the
receiving slot holds, bucket by bucket of a packed layout (`stages.weights.layout`).

Learner side, `Versions` keeps the last `KEEP` versions packed in the engine's dtype (the learner
may train in fp32 while its engines serve bf16: `pack_into` converts while packing), so whatever a
receiver's two slots hold, if at most two versions old, is at hand as a base. `Planner.patch`
diffs against the newest version either slot holds: the slot being rebuilt itself (two versions
behind) or the live one, which the receiver copies over first (a local copy costs less than a
second step's changes on the wire). `diff` picks per bucket the cheapest of three forms: `index`
(the changed elements' positions as byte gaps, then their new values), `bitmask` (one bit per
element, then the new values) or `full` (the bucket's bytes); an element is one word of the
bucket's narrowest dtype (a bf16 value in a bf16 bucket). A bucket holding fused expert tensors
([E, ...] under an `experts` module: `is_fused_experts`) has a fourth, expert-sparse form,
`experts`: one bit per block (each expert of a fused tensor, each other tensor: `expert_blocks`,
computed by both sides from the layout), set for the blocks with any changed element, then the
moved blocks' elements, concatenated, in the cheapest of the three forms (`Part.inner`); unchanged
experts cost one bit. Every form is only chosen when it is the cheapest, so a patch with it is
never larger than one without (`diff(..., experts=False)`).

Receiver side, `Slots` holds two packed receive slots and the version each holds. `rebuild`
applies a `Patch` only onto exactly its base, then verifies every bucket's xxh3 checksum against
the learner's; any failure marks the slot as holding nothing (its bytes are no longer a known
version). Bases are therefore never assumed: every reply says what each slot holds
(`SlotReply.holds`), and the learner sends the whole state when no slot holds a version it kept,
or after a refusal (counted in `full_sends` and one of the `fallback_*` stats).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from stages.weights.base import ApplyReply
from stages.weights.layout import DTYPES, Bucket, Layout, LayoutError, TensorEntry, bad_buckets, checksum, plan

INDEX, BITMASK, FULL = "index", "bitmask", "full"
EXPERTS = "experts"  # one bit per expert block (`expert_blocks`), then the moved blocks' elements in `inner` form
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
KEEP = 3  # versions a learner keeps packed: the new one and the two a receiver's slots may hold


class Part(msgspec.Struct, frozen=True):
    """How one bucket is rebuilt: its payload is `nbytes` at `offset` of the patch's payload."""

    bucket: int
    form: str
    offset: int
    nbytes: int
    changed: int  # elements that differ from the base (all of them for a `full` part without a base)
    inner: str = ""  # an `experts` part: the form of its moved blocks' elements (index, bitmask or full)


class Patch(msgspec.Struct, frozen=True):
    base: int  # the version the rebuild starts from; -1: none, every part is `full`
    source: int  # the slot holding `base`: the slot rebuilt, or the other one (copied over first)
    parts: tuple[Part, ...]


class SlotReply(ApplyReply, frozen=True):
    """An `ApplyReply` that says which slot the engines run on and which version each slot holds."""

    live: int = -1
    holds: tuple[int, ...] = ()


def word_of(layout: Layout, bucket: Bucket) -> Any:
    """The numpy word of a bucket's elements: its narrowest dtype's size (every bucket spans a
    multiple of 64 bytes, so any word size tiles it)."""
    sizes = [DTYPES[e.dtype].itemsize for e in layout.tensors[bucket.first : bucket.first + bucket.count]]
    return _WORDS[min(sizes)]


def engine_tensors(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Shapes and dtypes as the engine holds them (floating tensors in `dtype`), for `plan`: no copy."""
    if dtype is None:
        return tensors
    return {n: torch.empty((), dtype=dtype).expand(t.shape) if t.is_floating_point() else t for n, t in tensors.items()}


def pack_into(buffer: np.ndarray, tensors: dict[str, torch.Tensor], layout: Layout) -> Layout:
    """Copy `tensors` into `buffer` as laid out, converting to each entry's dtype in the same pass
    (alignment gaps zeroed); returns the layout with every bucket's checksum."""
    flat = torch.from_numpy(buffer)
    end = 0
    for e in layout.tensors:
        flat[end : e.offset] = 0
        flat[e.offset : e.offset + e.nbytes].view(DTYPES[e.dtype]).view(e.shape).copy_(tensors[e.name].detach())
        end = e.offset + e.nbytes
    flat[end : layout.total] = 0
    sums = tuple(msgspec.structs.replace(b, checksum=checksum(buffer, layout, b)) for b in layout.buckets)
    return msgspec.structs.replace(layout, buckets=sums)


@dataclass
class Versions:
    """The last `KEEP` versions, packed (uint8 buffers of one layout); buffers are reused."""

    packed: dict[int, np.ndarray] = field(default_factory=dict)
    layout: Layout | None = None

    def add(self, version: int, tensors: dict[str, torch.Tensor], layout: Layout) -> np.ndarray:
        if self.layout is not None and (self.layout.total, self.layout.tensors) != (layout.total, layout.tensors):
            self.packed.clear()  # another shape of state: no old version is a base any more
        spare = None
        while len(self.packed) >= KEEP:
            spare = self.packed.pop(min(self.packed))
        buffer = spare if spare is not None else np.empty(layout.total, dtype=np.uint8)
        self.layout = pack_into(buffer, tensors, layout)
        self.packed[version] = buffer
        return buffer

    def get(self, version: int) -> np.ndarray | None:
        return self.packed.get(version)


def _gaps(where: np.ndarray) -> tuple[np.ndarray, int]:
    """Increasing element indices as byte gaps (the first from 0): a gap `d` is `d // 255` bytes of
    255, then `d % 255`; decoded by a running sum, keeping the sums at bytes other than 255."""
    gaps = np.diff(where, prepend=0)
    skips = gaps // 255
    return gaps, int(skips.sum())


def _element_forms(mask: np.ndarray, values: np.ndarray) -> dict[str, tuple[int, Any]]:
    """Each element form's (bytes, builder of its payload pieces) for the elements `mask` marks
    changed among `values` (the new words); the builders run only for the form chosen."""
    where = np.flatnonzero(mask)
    changed, size = where.size, values.dtype.itemsize
    gaps, skips = _gaps(where)

    def index() -> list[np.ndarray]:
        head = np.full(changed + skips, 255, dtype=np.uint8)
        head[np.cumsum(gaps // 255 + 1) - 1] = gaps % 255
        return [head, values[where].view(np.uint8)]

    return {
        INDEX: (changed + skips + changed * size, index),
        BITMASK: (-(-values.size // 8) + changed * size, lambda: [np.packbits(mask), values[where].view(np.uint8)]),
        FULL: (values.nbytes, lambda: [values.view(np.uint8)]),
    }


def _encode(base: np.ndarray, new: np.ndarray, word: Any, bounds: np.ndarray | None) -> tuple[Part, list[np.ndarray]]:
    """The cheapest form of one bucket's change (a Part without bucket or offset yet) and its payload
    pieces. `bounds`: the bucket's expert blocks (`expert_blocks`), None when it holds no fused experts."""
    b, n = base.view(word), new.view(word)
    mask = b != n
    changed = int(np.count_nonzero(mask))
    forms = _element_forms(mask, n)
    form, (nbytes, build) = min(forms.items(), key=lambda f: f[1][0])
    if bounds is not None:
        moved = _moved_blocks(mask, bounds)
        keep = np.repeat(moved, np.diff(bounds))
        head = np.packbits(moved)
        inner, (inner_bytes, inner_build) = min(_element_forms(mask[keep], n[keep]).items(), key=lambda f: f[1][0])
        if head.nbytes + inner_bytes < nbytes:
            pieces = [head, *inner_build()]
            return Part(0, EXPERTS, 0, sum(p.nbytes for p in pieces), changed, inner), pieces
    return Part(0, form, 0, nbytes, changed), build()


def _moved_blocks(mask: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """One bool per block: whether any of its elements changed (an empty block never has)."""
    running = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    return running[bounds[1:]] > running[bounds[:-1]]


def is_fused_experts(entry: TensorEntry) -> bool:
    """A fused expert tensor: [E, ...] (3 dims or more) with the experts along dim 0, under an
    `experts` module (transformers' `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`)."""
    return len(entry.shape) >= 3 and entry.shape[0] > 0 and "experts" in entry.name.split(".")


def expert_blocks(layout: Layout, bucket: Bucket, word: Any) -> np.ndarray | None:
    """The bucket cut into blocks, as word boundaries from 0 to its size: one block per expert of
    each fused expert tensor, one per other tensor, each alignment gap joined to the block before.
    Both sides compute it from the layout alone. None when the bucket holds no fused experts."""
    tensors = layout.tensors[bucket.first : bucket.first + bucket.count]
    if not any(is_fused_experts(e) for e in tensors):
        return None
    size, starts = np.dtype(word).itemsize, []
    for e in tensors:
        first, experts = (e.offset - bucket.offset) // size, e.shape[0] if is_fused_experts(e) else 1
        starts += [first + i * (e.nbytes // size // experts) for i in range(experts)]
    starts[0] = 0
    return np.array([*starts, bucket.nbytes // size], dtype=np.int64)


def diff(
    layout: Layout, new: np.ndarray, base: np.ndarray | None, base_version: int = -1, source: int = -1,
    experts: bool = True,
) -> tuple[Patch, list[np.ndarray]]:
    """A patch from `base` (packed version `base_version`, held in slot `source`; None: no base,
    every bucket full) to `new`, with its payload pieces in order (at the parts' `offset`s).
    `experts`: a bucket with fused expert tensors may skip its unchanged experts (`EXPERTS`)."""
    parts, pieces, offset = [], [], 0
    for i, bucket in enumerate(layout.buckets):
        span = slice(bucket.offset, bucket.offset + bucket.nbytes)
        word = word_of(layout, bucket)
        if base is None:
            part, chunks = Part(i, FULL, 0, bucket.nbytes, bucket.nbytes // np.dtype(word).itemsize), [new[span]]
        else:
            bounds = expert_blocks(layout, bucket, word) if experts else None
            part, chunks = _encode(base[span], new[span], word, bounds)
        parts.append(msgspec.structs.replace(part, bucket=i, offset=offset))
        pieces += chunks
        offset += part.nbytes
    return Patch(base_version if base is not None else -1, source, tuple(parts)), pieces


def count(stats: dict[str, float], layout: Layout, patch: Patch) -> None:
    """Add one send's element counts and chosen forms to a transport's `stats`."""
    stats["elements"] += sum(b.nbytes // np.dtype(word_of(layout, b)).itemsize for b in layout.buckets)
    stats["changed"] += sum(p.changed for p in patch.parts)
    stats["full_bytes"] += layout.total
    for p in patch.parts:
        stats[f"buckets_{p.inner or p.form}"] += 1  # an expert-sparse bucket counts as its inner form


def _apply(span: np.ndarray, part: Part, payload: np.ndarray, word: Any, bounds: np.ndarray | None) -> None:
    data = payload[part.offset : part.offset + part.nbytes]
    if data.nbytes != part.nbytes:
        raise LayoutError(f"the payload of bucket {part.bucket} is cut short")
    target = span.view(word)
    if part.form != EXPERTS:
        _apply_elements(target, part.form, data, part.changed, part.bucket)
        return
    if bounds is None or part.inner == EXPERTS:
        raise LayoutError(f"bucket {part.bucket}: an experts part for a bucket without fused experts")
    head = -(-(bounds.size - 1) // 8)
    if head > data.nbytes:
        raise LayoutError(f"bucket {part.bucket}: an experts part of {part.nbytes} bytes")
    moved = np.unpackbits(data[:head], count=bounds.size - 1).view(bool)
    keep = np.repeat(moved, np.diff(bounds))
    blocks = target[keep]  # a copy: the moved blocks' elements, rebuilt, then written back
    _apply_elements(blocks, part.inner, data[head:], part.changed, part.bucket)
    target[keep] = blocks


def _apply_elements(target: np.ndarray, form: str, data: np.ndarray, changed: int, bucket: int) -> None:
    """Rebuild `target` (words) from one element form's payload `data`; LayoutError if it does not fit."""
    size = target.dtype.itemsize
    if form == FULL:
        if data.nbytes != target.nbytes:
            raise LayoutError(f"a full bucket {bucket} of {data.nbytes} bytes for {target.nbytes}")
        target[:] = data.view(target.dtype)
        return
    head = data.nbytes - changed * size if form == INDEX else -(-target.size // 8)
    if form not in (INDEX, BITMASK) or head < 0 or head + changed * size != data.nbytes:
        raise LayoutError(f"bucket {bucket}: a {form!r} part of {data.nbytes} bytes")
    values = data[head:].view(target.dtype)
    if form == INDEX:
        gaps = data[:head]
        where = np.cumsum(gaps, dtype=np.int64)[gaps != 255]
        if where.size != changed or (changed and int(where[-1]) >= target.size):
            raise LayoutError(f"bucket {bucket}: element indices that do not fit it")
    else:
        where = np.unpackbits(data[:head], count=target.size).view(bool)
        if int(np.count_nonzero(where)) != changed:
            raise LayoutError(f"bucket {bucket}: the bitmask does not mark {changed} elements")
    target[where] = values


class Slots:
    """Two receive slots (uint8 numpy arrays or torch tensors, e.g. shared memory), the version each
    holds (-1: none known) and the one the engines run on (`live`, never rebuilt)."""

    def __init__(self, slots: list[Any]) -> None:
        self.slots, self.holds, self.live = slots, [-1] * len(slots), -1

    def reply(self, answer: ApplyReply) -> bytes:
        return msgspec.msgpack.encode(SlotReply(answer.ok, answer.version, answer.reason, self.live, tuple(self.holds)))

    def rebuild(self, slot: int, layout: Layout, patch: Patch | None, payload: np.ndarray | None) -> Any:
        """Apply `patch` (None: the bytes were written whole) into `slot` and verify it; returns the
        slot. Raises LayoutError, leaving the slot marked as holding nothing, when it does not check out."""
        if not 0 <= slot < len(self.slots) or slot == self.live:
            raise LayoutError(f"slot {slot} cannot take a version (live: {self.live})")
        base, self.holds[slot] = self.holds[slot], -1  # from here on its bytes are not a known version
        buffer = self.slots[slot]
        if buffer.nbytes < layout.total:
            raise LayoutError(f"slot of {buffer.nbytes} bytes for a layout of {layout.total}")
        if patch is not None:
            data = _numpy(buffer)
            if patch.base != -1:
                held = base if patch.source == slot else self._held(patch.source)
                if patch.base != held:
                    raise LayoutError(f"a delta against version {patch.base}, but slot {patch.source} holds {held}")
                if patch.source != slot:  # start from the other slot's version (read only: it may be live)
                    data[: layout.total] = _numpy(self.slots[patch.source])[: layout.total]
            for part in patch.parts:
                if not 0 <= part.bucket < len(layout.buckets) or (patch.base == -1 and part.form != FULL):
                    raise LayoutError(f"bad part {part}")
                b, word = layout.buckets[part.bucket], word_of(layout, layout.buckets[part.bucket])
                bounds = expert_blocks(layout, b, word) if part.form == EXPERTS else None
                _apply(data[b.offset : b.offset + b.nbytes], part, payload, word, bounds)
        if bad := bad_buckets(buffer, layout):
            raise LayoutError(f"buckets {bad} of version {layout.version} fail their checksum")
        self.holds[slot] = layout.version
        return buffer

    def take_shards(self, slot: int, layout: Layout, checks: tuple) -> Any:
        """A version the learner's ranks wrote into `slot` piece by piece (`stages.weights.mooncake_shards`):
        verify their checks; returns the slot. Raises LayoutError, leaving the slot holding nothing."""
        from stages.weights.mooncake_shards import verify_shards

        if not 0 <= slot < len(self.slots) or slot == self.live:
            raise LayoutError(f"slot {slot} cannot take a version (live: {self.live})")
        self.holds[slot] = -1
        buffer = self.slots[slot]
        if buffer.nbytes < layout.total:
            raise LayoutError(f"slot of {buffer.nbytes} bytes for a layout of {layout.total}")
        verify_shards(buffer, layout, checks)
        self.holds[slot] = layout.version
        return buffer

    def applied(self, slot: int) -> None:
        self.live = slot

    def _held(self, slot: int) -> int:
        return self.holds[slot] if 0 <= slot < len(self.slots) else -1


def _numpy(buffer: Any) -> np.ndarray:
    return buffer.numpy() if isinstance(buffer, torch.Tensor) else buffer


class Planner:
    """Learner side: the kept versions (`Versions`, in the engine's `dtype`) and, per send, the patch
    from what the receiver's slots hold (`holds`, as its last reply said) to the staged version.
    Counts into `stats` (the keys of `base.STATS`) what each send changed and why one went whole."""

    def __init__(self, dtype: str | None, stats: dict[str, float], experts: bool = True) -> None:
        self.dtype = getattr(torch, dtype.removeprefix("torch.")) if dtype else None
        self.versions, self.stats, self.staged, self.experts = Versions(), stats, -1, experts
        self._patches: dict[tuple[int, int], tuple[Patch, list[np.ndarray]]] = {}

    def stage(self, version: int, tensors: dict[str, torch.Tensor], bucket_bytes: int) -> np.ndarray:
        """Pack `version` (converted to the engine dtype); returns its buffer (`versions.layout` is its layout)."""
        layout = plan(version, engine_tensors(tensors, self.dtype), bucket_bytes)
        self._patches, self.staged = {}, version
        return self.versions.add(version, tensors, layout)

    def patch(self, holds: tuple[int, ...], slot: int, refused: bool) -> tuple[Patch, list[np.ndarray]]:
        """Against the newest kept version either slot holds (the other slot's is copied over by the
        receiver first: a local copy is cheaper than the second step's changes on the wire), else
        the whole state; after a refusal always the whole state."""
        layout, new = self.versions.layout, self.versions.get(self.staged)
        assert layout is not None and new is not None
        sources = [] if refused else [s for s in (slot, 1 - slot) if 0 <= s < len(holds)]
        kept = [(holds[s], s) for s in sources if self.versions.get(holds[s]) is not None]
        base = max(kept, key=lambda held: (held[0], held[1] == slot), default=(-1, -1))
        if base[0] == -1 and len(self.versions.packed) > 1:  # a delta was possible: a fallback
            self.stats["full_sends"] += 1
            lost = any(h >= 0 for h in holds)
            self.stats["fallback_refused" if refused else "fallback_lost" if lost else "fallback_new"] += 1
        if base not in self._patches:
            found = self.versions.get(base[0]) if base[0] >= 0 else None
            self._patches[base] = diff(layout, new, found, *base, experts=self.experts)
        patch, pieces = self._patches[base]
        count(self.stats, layout, patch)
        return patch, pieces
