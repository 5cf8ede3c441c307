"""Weight pushes from a sharded learner: a pure transfer plan from the learner's placement to each
engine rank's layout, so that every learner rank writes its own bytes and no rank gathers the model.

* `SourcePlacement` (`placement`): which learner rank holds which box of each parameter (FSDP2's
  `Shard(0)`: `fsdp_dim0`; any DTensor placement on a 1-D mesh: `from_placements` / `from_boxes`).
* `EngineLayout` (`engine`): the tensors each engine rank holds, assembled from boxes of learner
  parameters (`full`: today's whole tensors; `tensor_parallel`: SGLang's TP layout with fused
  `qkv_proj` / `gate_up_proj`), and `receive_layout`, its receive buffer as a `layout.Layout`.
* `ExpertLayout`, `expert_parallel_source` (`experts`): a mixture-of-experts model's fused experts on
  the learner (whole, `Shard(0)`, or `ep` blocks of experts) and on the engine (TP-sharded,
  EP-sharded or both; stacked [E, ...] tensors or per-expert names), for `full` and `tensor_parallel`.
* `plan` / `check_plan` (`plan`): the `Piece`s (one contiguous write each) and their invariants.
* `make_buckets`, `sender_checksum`, `receiver_checksum`, `bad_buckets` (`buckets`): checksummed
  groups of one rank's pieces for one engine rank, verified by the receiver before it applies anything.

No I/O and no torch.distributed here: the transport (`stages.weights.mooncake_p2p`) moves the bytes.
Use (the placement and layouts do not change between versions: plan once, push every version):

    source = SourcePlacement.fsdp_dim0({n: p.shape for n, p in model.named_parameters()}, N, "torch.bfloat16")
    engine = EngineLayout.combine(*(EngineLayout.tensor_parallel(source.shapes, tp, TPConfig.from_hf(cfg),
                                                                 "torch.bfloat16") for _ in engines))
    offsets = [byte_offsets(receive_layout(engine, r)) for r in range(len(engine.ranks))]
    pieces = plan(source, engine, offsets)
    mine = [b for b in make_buckets(pieces, 32 << 20) if b.src_rank == rank]
    # every version, on every rank: locals = {n: p.to_local().to(torch.bfloat16)}; for each bucket, write
    # piece_bytes(p, locals[p.src_name], source) at p.dst_offset of engine rank p.dst_rank's slot; send
    # with_checksum(b, locals, source).check() to the committer. Receiver: zero padding_ranges once;
    # apply only if bad_buckets(slot, checks) == [] and unverified_bytes(checks, engine, r) == 0.
"""

from stages.weights.reshard.boxes import Box
from stages.weights.reshard.buckets import (
    BucketCheck,
    PieceBucket,
    bad_buckets,
    make_buckets,
    materialise,
    piece_bytes,
    receiver_checksum,
    sender_checksum,
    unverified_bytes,
    with_checksum,
    write_piece,
)
from stages.weights.reshard.engine import (
    EngineLayout,
    EngineTensor,
    Segment,
    TPConfig,
    byte_offsets,
    receive_layout,
    vocab_rows,
)
from stages.weights.reshard.experts import (
    ExpertLayout,
    expert_name,
    expert_parallel_source,
    expert_source_boxes,
    is_expert,
)
from stages.weights.reshard.placement import PlacementError, SourcePlacement
from stages.weights.reshard.plan import Piece, bytes_per_rank, check_plan, padding_ranges, plan

__all__ = [
    "Box", "BucketCheck", "EngineLayout", "ExpertLayout", "expert_name", "expert_parallel_source",
    "expert_source_boxes", "is_expert", "EngineTensor", "Piece", "PieceBucket", "PlacementError", "Segment",
    "SourcePlacement", "TPConfig", "bad_buckets", "byte_offsets", "bytes_per_rank", "check_plan", "make_buckets",
    "materialise", "padding_ranges", "piece_bytes", "plan", "receive_layout", "receiver_checksum", "sender_checksum",
    "unverified_bytes", "vocab_rows", "with_checksum", "write_piece",
]
