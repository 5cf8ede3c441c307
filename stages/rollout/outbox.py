"""A finished GRPO group on its way out of the producer: encoded, stored, recorded, sent.

`encode_group` turns the group's episodes into one `RolloutBatch` (a row per episode: its tokens
token-in token-out, logprobs, loss mask and per-token versions, and with distillation the teacher's
logprobs, `teacher_logprobs`, 0 where the mask is; per row the reward, the model turns, each number an
environment reported and, with model scorers, the group's scoring seconds `scoring_s`). `GroupOutbox`
batches the control traffic of all the groups a producer process finishes: whatever finished while the
previous ledger call and channel send were in flight goes in the next one, so each costs one round trip
however many episodes run (on Ray each is a call to another process).

Invariant, as before the episode model: a group is recorded as produced only once its payload is
stored, and its Ref is sent downstream only after it was recorded. After each batch, one line of the
run folder's generation log (`stages.runfiles.GENERATION_FILE`) says what the batch cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

from buffers.codec import RolloutBatch
from pipeline.refs import Produced, Ref
from stages.engines.base import Engine
from stages.rollout.episode import Episode
from stages.runfiles import GENERATION_FILE

INFO_PREFIX = "info/"  # row fields holding an environment's per-episode numbers (NaN where absent)
LINGER_S = 0.005  # how long a finished group waits for others before its batch is recorded and sent


def version_span(episodes: list[Episode], fallback: int) -> tuple[int, int]:
    """(oldest, newest) weight version of the episodes' model tokens (`fallback` if there are none)."""
    spans = [s for s in (e.tokens.version_span() for e in episodes) if s is not None]
    if not spans:
        return fallback, fallback
    return min(s[0] for s in spans), max(s[1] for s in spans)


def encode_group(episodes: list[Episode], rewards: list[float], span: tuple[int, int], meta: dict,
                 token_fields: dict[str, list[np.ndarray]] | None = None,
                 row_fields: dict[str, np.ndarray] | None = None) -> RolloutBatch:
    """One batch, a row per episode (see the module docstring); `token_fields` add a token column per name (one
    array per episode, as long as its tokens: `teacher_logprobs`), `row_fields` a value per episode."""
    rows = [e.tokens.row() for e in episodes]
    for name, arrays in (token_fields or {}).items():
        for row, values in zip(rows, arrays, strict=True):
            row[name] = values
    n = len(episodes)
    fields = {**(row_fields or {}),
        "rewards": np.asarray(rewards, dtype=np.float32),
        "prompt_lens": np.asarray([e.tokens.prompt_len for e in episodes], dtype=np.int32),
        "versions": np.asarray([span] * n, dtype=np.int32),
        "turns": np.asarray([e.turns for e in episodes], dtype=np.int32),
    }
    for key in sorted({k for e in episodes for k in e.info}):
        fields[INFO_PREFIX + key] = np.asarray([e.info.get(key, np.nan) for e in episodes], dtype=np.float32)
    return RolloutBatch.from_rows(rows, row_fields=fields, meta=meta)


@dataclass
class Finished:
    """What one group left: its ledger records (the stored group, and any dropped part), the Ref to send
    (None when nothing was stored), the ids to settle as dropped with their reason, and the admitted
    prompt (encoded) it came from."""

    records: list[Produced]
    ref: Ref | None
    dropped: list[tuple[list[str], str]] = field(default_factory=list)
    source: bytes = b""
    lengths: list[int] = field(default_factory=list)  # model tokens per stored episode
    put_s: float = 0.0
    scoring_s: float = 0.0  # its reward and teacher scoring
    started: float = 0.0  # when the group started (anyio time)
    gate_s: float = 0.0  # its admission's wait at the gate
    admission: int = 0  # the producer's admission number of its prompt


class GroupOutbox:
    """Records and sends finished groups in batches (one ledger call and one channel send per batch).

    `recording` and `sending` say what is between the ledger and the channel at any instant (a
    checkpoint cut reads them); `on_recording(batch)` hears which groups left "generating"."""

    def __init__(self, ctx: Any, outbox: Any, on_recording: Callable[[list[Finished]], None], engine: Engine,
                 group_size: int) -> None:
        self.ctx, self.outbox = ctx, outbox  # the run's ledger and gate, through its context
        self._on_recording, self.engine, self.group_size = on_recording, engine, group_size
        self._queue: list[Finished] = []
        self._flushing = 0  # flushes in progress (their groups recorded, perhaps not yet sent)
        self._ready = anyio.Event()
        self._last_ready = 0.0  # when the previous batch was ready (anyio time)
        self.recording: list[tuple[str, bytes]] = []
        self.sending: list[Ref] = []

    def put(self, finished: Finished) -> None:
        self._queue.append(finished)
        self._ready.set()

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            await anyio.sleep(LINGER_S)  # groups that finish together (one engine step) go in one batch
            self._ready = anyio.Event()
            await self.flush()

    async def drain(self) -> None:
        """Return once every group put so far is recorded and sent: what is queued is flushed, a flush in
        progress (its groups recorded, maybe not yet sent) is waited for. A leaving worker calls it before
        it stops its outbox, which may then be cancelled without leaving a group half-sent."""
        while self._queue or self._flushing:
            if self._queue:
                await self.flush()
            else:
                await anyio.sleep(0.005)

    async def flush(self) -> None:
        """Record and send every group finished so far (one ledger call, one channel send)."""
        batch, self._queue = self._queue, []
        if not batch:
            return
        self._flushing += 1
        try:
            await self._record_and_send(batch)
        finally:
            self._flushing -= 1

    async def _record_and_send(self, batch: list[Finished]) -> None:
        t0 = anyio.current_time()
        records = [r for f in batch for r in f.records]
        self.recording = [(r.group, r.source) for r in records]
        self._on_recording(batch)  # no longer "generating": a checkpoint now owes them via `recording`
        await self.ctx.ledger.produced(records)
        refs = [f.ref for f in batch if f.ref is not None]
        self.recording, self.sending = [], refs
        dropped = [d for f in batch for d in f.dropped]
        for ids, reason in dropped:
            await self.ctx.ledger.finished("dropped", ids, reason)
        whole_groups = sum(1 for f in batch if f.ref is None)
        if whole_groups:
            await self.ctx.gate.discard(whole_groups)
        await self.outbox.send_many(refs)
        self.sending = []
        # the engine's share of the wall time: since the previous batch was ready, or since the earliest of
        # these groups started when the engine was idle in between (`baton simulate --calibrate` reads it)
        engine_s = t0 - max(self._last_ready, min(f.started for f in batch))
        self._last_ready = t0
        self._log(batch, engine_s, anyio.current_time() - t0)

    def _log(self, batch: list[Finished], engine_s: float, record_s: float) -> None:
        """One line per recorded batch of groups in the generation log (`baton simulate --calibrate` reads
        it as an engine call): groups, the longest wait at the gate of their admissions, the engine's wall
        time for them (`gen_s`), the slowest put and the slowest scoring (`scoring_s`), the seconds to record
        and send them, response tokens and their lengths, bytes stored, and the engine's own counters."""
        lengths = [n for f in batch for n in f.lengths]
        self.ctx.folder.append_record(GENERATION_FILE, {
            "engine": self.engine.name, "t": round(time.time() - self.ctx.started_at, 4), "groups": len(batch),
            "group_size": self.group_size, "gate_s": round(max(f.gate_s for f in batch), 5),
            "gen_s": round(engine_s, 5), "put_s": round(max(f.put_s for f in batch), 5),
            "scoring_s": round(max(f.scoring_s for f in batch), 5),
            "send_s": round(record_s, 5), "tokens": int(sum(lengths)), "lengths": lengths,
            "nbytes": int(sum(f.ref.nbytes for f in batch if f.ref is not None)),
            **{f"engine/{k}": v for k, v in self.engine.stats.items()},
        })
