"""[store]: where rollout payloads live (refs travel through the channels), one section per kind."""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Literal

from pydantic import ByteSize, Field

from baton.sections.base import BuildContext, Section, declared_defaults, kinds

if TYPE_CHECKING:
    from buffers import MemoryStore
    from buffers.mooncake import MooncakeStore
    from buffers.mooncake import MooncakeStoreSpec as MooncakeOpener
    from buffers.ray_store import RayStoreSpec as RayStoreOpener

MEMORY_STORE = declared_defaults("buffers:MemoryStore")
MOONCAKE_SETTINGS = declared_defaults("buffers.mooncake:MooncakeSettings")


class MemoryStoreSpec(Section):
    kind: Literal["memory"] = Field("memory", description="an in-process store: the local runtime only")
    capacity: ByteSize | None = Field(MEMORY_STORE("capacity_bytes", None),
        description="most payload bytes held at once (a put beyond it is refused with StoreFull); unset: no bound")

    def make(self, ctx: BuildContext) -> MemoryStore:
        from buffers import MemoryStore

        return MemoryStore(capacity_bytes=self.capacity)


class MooncakeStoreSpec(Section):
    """Mirrors Miles's `--mooncake-store-init-kwargs`; MOONCAKE_* environment variables give defaults."""

    kind: Literal["mooncake"] = Field("mooncake",
        description="Mooncake Store: the buffer's process mounts a segment, a mooncake_master coordinates")
    master: str = Field(
        default_factory=lambda: os.environ.get("MOONCAKE_MASTER_ADDR", "auto"),
        pattern=r"^(auto|[\w.-]+:\d+)$",
        description='"auto" starts a master on 127.0.0.1 for the run; "host:port" attaches',
    )
    protocol: str = Field(default_factory=lambda: os.environ.get("MOONCAKE_PROTOCOL", "tcp"),
        description='TransferEngine protocol, "tcp" or "rdma" (default: $MOONCAKE_PROTOCOL, else "tcp")')
    device: str = Field(default_factory=lambda: os.environ.get("MOONCAKE_DEVICE", ""),
        description="RDMA device names for protocol = 'rdma' (default: $MOONCAKE_DEVICE, else empty)")
    global_segment_size: ByteSize = Field(ByteSize(1 << 30),
        description="memory the buffer stage's process mounts into the store; must hold the buffer's byte bounds x "
                    "replicas below the master's 90 % eviction watermark (checked before the run)")
    local_buffer_size: ByteSize = Field(ByteSize(MOONCAKE_SETTINGS("local_buffer_size", 16777216)),
        description="each client's local transfer buffer registered with Mooncake")
    chunk_bytes: ByteSize = Field(ByteSize(MOONCAKE_SETTINGS("chunk_bytes", 67108864)),
        description="objects larger than this are stored as parts and reassembled on get (at least 1 MiB)")
    replicas: int = Field(MOONCAKE_SETTINGS("replicas", 1), ge=1,
        description="copies of each object on distinct segments; 2 survives one holder's death but needs two "
                    "processes holding segments")
    gather_puts: bool | None = Field(None,
        description="send a rollout batch from its arrays where they lie, registering them for the put (no copy); "
                    "unset: on for protocol tcp, off for rdma, where registering pins memory and the copy into "
                    "the store's registered pool is cheaper")

    def make(self, ctx: BuildContext) -> MooncakeStore | MooncakeOpener:
        """Locally, the store itself; on Ray, an opener: each process opens its own client (the buffer's holds
        the segment)."""
        from buffers.mooncake import MooncakeSettings, MooncakeStore
        from buffers.mooncake import MooncakeStoreSpec as MooncakeOpener

        settings = MooncakeSettings(
            protocol=self.protocol, device=self.device, global_segment_size=int(self.global_segment_size),
            local_buffer_size=int(self.local_buffer_size), chunk_bytes=int(self.chunk_bytes), replicas=self.replicas,
            gather_puts=self.gather_puts,
        )
        if ctx.runtime == "ray":
            return MooncakeOpener(settings, master=self.master)
        return MooncakeStore.open(settings, master=self.master)


class RayStoreSpec(Section):
    """Ray's object store (Miles's `--object-store-backend ray`): one numpy object per batch."""

    kind: Literal["ray"] = Field("ray",
        description="Ray's object store: one numpy object per batch, owned by the store's index actor")
    capacity: ByteSize | None = Field(None,
        description="most payload bytes held at once (a put beyond it is refused); unset: bounded by Ray's object "
                    "store only")

    def make(self, ctx: BuildContext) -> RayStoreOpener:
        """One index per run, so runs sharing a cluster never mix keys."""
        from buffers.ray_store import RayStoreSpec as RayStoreOpener

        capacity = int(self.capacity) if self.capacity else None
        return RayStoreOpener(name=f"ray-{ctx.name}-{uuid.uuid4().hex[:8]}", capacity_bytes=capacity)


StoreSection = kinds(MemoryStoreSpec, MooncakeStoreSpec, RayStoreSpec)  # the store kinds
