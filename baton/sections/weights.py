"""[weights]: how each new version reaches the engines (independent of `store`, the rollout data)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ByteSize, Field, field_validator

from baton.sections.base import BuildContext, Section, declared_defaults
from stages.weights import TRANSPORTS, make_transport, transport_class, transport_options

if TYPE_CHECKING:
    from stages.weights.base import WeightTransport

GRPO_LEARNER = declared_defaults("stages.learner:GRPOLearner")
MOONCAKE_P2P = declared_defaults("stages.weights.mooncake_p2p:MooncakeP2PTransport")


class WeightsSpec(Section):
    """How each new version reaches the engines; independent of `store` (rollout data)."""

    transport: str = Field(GRPO_LEARNER("weights", "inproc"), description="how new versions reach the engines, "
                           f"independent of the store: {', '.join(TRANSPORTS)} (which needs runtime = 'ray'), or "
                           "a plug-in's 'pkg.module:Class' (stages.weights)")
    protocol: str = Field(MOONCAKE_P2P("protocol", "tcp"),
                          description='mooncake_p2p: TransferEngine protocol, "tcp" or "rdma"')
    device: str = Field(MOONCAKE_P2P("device", ""),
                        description="mooncake_p2p: RDMA device names (empty for tcp)")
    bucket_bytes: ByteSize | None = Field(None, description="bytes per checksummed bucket (mooncake_p2p, delta); "
                                          "default: the transport's own")
    pace: ByteSize | None = Field(MOONCAKE_P2P("pace_bytes_per_s", None),
                                  description="mooncake_p2p: push at most this many bytes per second")
    retries: int | None = Field(None, ge=0, description="re-sends of a refused version before the run fails "
                                "(inproc, mooncake_p2p, disk, delta, broadcast); default: the transport's own")
    root: str | None = Field(None, description="disk: folder every engine can read (default: a temporary one)")
    sparse: bool = Field(MOONCAKE_P2P("sparse", False), description="mooncake_p2p: send each version "
                         "as element-level deltas against what the engine holds (transport = 'delta' always does)")
    snapshot_every: int = Field(
        GRPO_LEARNER("snapshot_every", 1), ge=0,
        description="keep every n-th version in the store for engines that (re)start; 0: never",
    )

    @field_validator("transport")
    @classmethod
    def _transport_resolves(cls, transport: str) -> str:
        if transport not in TRANSPORTS:  # an importable plug-in (ValueError naming the built-ins); a built-in's
            transport_class(transport)  # module is imported when the run makes it
        return transport

    def make(self, ctx: BuildContext) -> WeightTransport | str:
        """The transport (a built-in or a plug-in's path) with the config keys its constructor takes, those set
        (unset: its own default), or its name when it gets none (the learner makes it then)."""
        values = {"protocol": self.protocol, "device": self.device,
                  "bucket_bytes": int(self.bucket_bytes) if self.bucket_bytes else None,
                  "pace_bytes_per_s": float(self.pace) if self.pace else None, "retries": self.retries,
                  "root": self.root, "sparse": self.sparse,
                  # the learner trains in float32; engines holding another dtype get (and are diffed in) theirs
                  "engine_dtype": ctx.dtype if ctx.dtype != "float32" else None}
        options = {key: values[key] for key in transport_options(self.transport) if values.get(key) is not None}
        return make_transport(self.transport, **options) if options else self.transport
