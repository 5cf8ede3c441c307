"""Light helpers for the checkpoint tests (no torch), importable by a subprocess that kills itself mid-write."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from pipeline.actor import BaseActor
from pipeline.admission import AdmissionGate
from pipeline.channel import Channel
from pipeline.checkpoint import Checkpointer, LocalCut
from pipeline.ledger import Ledger
from pipeline.refs import HeldRef, Redo, Ref
from pipeline.versions import VersionClock
from policies.staleness import MaxStaleness

K = 2
GROUPS = 4


def ref(group: str, version: int = 0, nbytes: int = 10) -> Ref:
    return Ref(store="memory", key=f"run/v{version:08d}/{group}/0-1", version=version, version_max=version, rows=2,
               nbytes=nbytes, checksum=0, group=group)


class FileConsumer:
    """A consumer whose state is one file; `fail_after` bytes into it, it stops (raises, or is SIGKILLed)."""

    def __init__(self, payload: bytes, fail_after: int | None = None, kill: bool = False) -> None:
        self.payload, self.fail_after, self.kill = payload, fail_after, kill

    def held_refs(self) -> list[HeldRef]:
        return [HeldRef(ref=ref("window-0"), holder="consumer", uses=1)]

    def write_state(self, folder: Path) -> None:
        with open(folder / "state.bin", "wb") as f:
            if self.fail_after is None:
                f.write(self.payload)
                return
            f.write(self.payload[: self.fail_after])
            f.flush()
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError("disk full (injected)")


def make_checkpointer(folder: Path) -> tuple[Checkpointer, VersionClock, Ledger]:
    """A checkpointer over a real clock, ledger, gate and channels holding two groups and a redo request."""
    clock, ledger = VersionClock(), Ledger.create(folder)  # its store in the run folder, as a run's
    gate = AdmissionGate(clock, MaxStaleness(k=K), GROUPS)
    produced, ready, feedback = Channel("produced", 8), Channel("ready", 8), Channel("feedback", 64)
    cut = LocalCut("unit", 100, clock, ledger, gate, {"produced": produced, "ready": ready}, feedback)
    ckpt = Checkpointer(folder, every=1, run="unit", steps=100, cut=cut)
    ledger.produced(["a/0", "a/1"], "a", (0, 0), b"prompt-a")
    ledger.produced(["b/0", "b/1"], "b", (0, 0), b"prompt-b")
    produced.send_nowait(ref("a"))
    ready.send_nowait(ref("b"))
    feedback.send_nowait(Redo("x", "lost"))
    return ckpt, clock, ledger


class CrashAt(BaseActor):
    """Raises once the version clock reaches `version` (a learner crash after that step)."""

    name = "crash"

    def __init__(self, ctx, version: int) -> None:
        self.ctx, self.version = ctx, version

    async def run(self) -> None:
        await self.ctx.clock.wait_until(self.version)
        raise RuntimeError(f"injected crash at version {self.version}")
