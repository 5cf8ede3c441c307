"""[weights]: how each new version reaches the engines (independent of `store`, the rollout data)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ByteSize, Field

from baton.sections.base import Section, default_of
from stages.learner import GRPOLearner
from stages.weights import TRANSPORTS, make_transport
from stages.weights.base import WeightTransport
from stages.weights.mooncake_p2p import MooncakeP2PTransport


class WeightsSpec(Section):
    """How each new version reaches the engines; independent of `store` (rollout data)."""

    transport: Literal[tuple(TRANSPORTS)] = Field(default_of(GRPOLearner, "weights"),  # type: ignore[valid-type]
        description="how new versions reach the engines, independent of the store: inproc, mooncake_p2p, disk, "
                    "delta or broadcast (which needs runtime = 'ray')")
    protocol: str = Field(default_of(MooncakeP2PTransport, "protocol"),
                          description='mooncake_p2p: TransferEngine protocol, "tcp" or "rdma"')
    device: str = Field(default_of(MooncakeP2PTransport, "device"),
                        description="mooncake_p2p: RDMA device names (empty for tcp)")
    bucket_bytes: ByteSize = Field(ByteSize(default_of(MooncakeP2PTransport, "bucket_bytes")),
                                   description="mooncake_p2p: bytes per checksummed bucket")
    pace: ByteSize | None = Field(default_of(MooncakeP2PTransport, "pace_bytes_per_s"),
                                  description="mooncake_p2p: push at most this many bytes per second")
    retries: int = Field(default_of(MooncakeP2PTransport, "retries"), ge=0, description="re-sends of a refused "
                         "version before the run fails (mooncake_p2p, disk, broadcast)")
    root: str | None = Field(None, description="disk: folder every engine can read (default: a temporary one)")
    sparse: bool = Field(default_of(MooncakeP2PTransport, "sparse"), description="mooncake_p2p: send each version "
                         "as element-level deltas against what the engine holds (transport = 'delta' always does)")
    snapshot_every: int = Field(
        default_of(GRPOLearner, "snapshot_every"), ge=0,
        description="keep every n-th version in the store for engines that (re)start; 0: never",
    )

    @property
    def kind(self) -> str:
        """The registry key of this part (baton.builder): the transport's name."""
        return self.transport


# the WeightsSpec keys each transport takes (as its constructor's keywords); one not named here is made
# by the learner from its name alone, in the learner's process
TRANSPORT_OPTIONS: dict[str, tuple[str, ...]] = {
    "mooncake_p2p": ("protocol", "device", "bucket_bytes", "pace_bytes_per_s", "retries", "engine_dtype", "sparse"),
    "delta": ("engine_dtype",),
    "disk": ("root", "retries"),
    "broadcast": ("retries",),
}


def weight_transport(spec: WeightsSpec, cfg: Any) -> WeightTransport | str:
    """The transport with its config keys, or its name when it takes none (the learner makes it then)."""
    values = {"protocol": spec.protocol, "device": spec.device, "bucket_bytes": int(spec.bucket_bytes),
              "pace_bytes_per_s": float(spec.pace) if spec.pace else None, "retries": spec.retries, "root": spec.root,
              "sparse": spec.sparse,
              # the learner trains in float32; engines holding another dtype get (and are diffed in) theirs
              "engine_dtype": cfg.model.dtype if cfg.model.dtype != "float32" else None}
    options = {key: values[key] for key in TRANSPORT_OPTIONS.get(spec.transport, ())}
    if all(value is None for value in options.values()):  # e.g. delta in the learner's dtype
        return spec.transport
    return make_transport(spec.transport, **options)
