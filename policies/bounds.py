"""Static bounds: the worst-case staleness a pipeline's shape allows, derived before anything runs.

`baton check` and `baton run` call `check(shape)` from config validation and refuse a config for which
it returns problems. Every number comes from the config; nothing here runs or measures anything.

The model (the one `tests/policies/test_staleness_properties.py` simulates, and whose worst case it checks this
derivation against exactly):

* Between the start of a group's generation and the learner step that trains it, the group waits in
  FIFO stages: the engines (`engines * batch_groups` groups generated per call), the produced channel,
  the buffer's index (`max_refs`), the ready channel, and the learner's prefetch of the next step
  (`groups_per_step`). Together they hold at most `capacity` groups. Byte bounds can only hold fewer,
  so item counts give an upper bound.
* The learner consumes `groups_per_step` groups per version; producers refill whatever it frees at the
  version current then. Reuse (`max_reuse > 1`) comes in two forms (stages.learner):
  - replays *ride along* (`replay.ride_along = true`): a step trains `groups_per_step` new groups plus
    the groups of its replay window that were trained before and have uses left. Every version still
    consumes exactly `groups_per_step` new groups, so reuse changes nothing below. A reused group is
    already inside the window: its extra age is bounded by the window's accept check (at most k, each
    use at a later version), not by the pipeline's depth again, and when it ages past k it has been
    trained already, so evicting it throws no generated work away;
  - replays *take a new group's place* (the default): as few as `groups_per_step / max_reuse` of a
    step's groups are new, and every group waiting in the queues ages by the replays ahead of it.
  A group started when the pipeline is full therefore reaches the learner after at most
  `queue_staleness = ceil(capacity * m / groups_per_step)` versions, with m = 1 when replays ride
  along and m = `max_reuse` when they take places.
* `admission = "pace"` caps live groups at `(v + lead + 1) * groups_per_step` (policies.staleness;
  `lead` = k unless set lower), so arrival staleness is at most `min(lead, queue_staleness)`; `"eager"`
  leaves only the queues, so it is `queue_staleness`. The pace rule's argument counts each version
  consuming `groups_per_step` new groups: when replays take places (the learner counts each as a started
  unit, which slows producers but cannot reorder what is already queued), only the queues bound arrival
  staleness, as with "eager" (conservative; the simulator shows groups then arriving older than k even
  under "pace"). Arrival staleness above k means the config relies on the accept check to throw
  generated work away, and dropping biases training (long rollouts are the ones that age): rejected.
* Engines finish in the order they started. A straggler (one engine far slower than the others) is
  not a property of the queues; the interrupt policy and the accept check bound it at run time.
* `epochs` optimizer steps per version compound staleness: a sample s versions old is, in its last
  epoch, `s * epochs + epochs - 1` optimizer steps older than the weights being trained. With
  `correction = "none"` the loss clips against that behaviour policy, so the bound k, stated in versions,
  would silently stand for more optimizer steps (miles #1697): rejected unless no trained sample is ever
  older than the step's own version (k = 0: PPO's epochs on on-policy data). A correction (every kind but
  `none`) clips against the step's proximal policy, so only the importance weight sees the versions.
* A group can be trained only at versions `oldest .. oldest + k`, so `max_reuse > k + 1` is unreachable.

Each problem names the keys to change and values that would pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Admission = Literal["pace", "eager"]


@dataclass(frozen=True)
class PipelineShape:
    """The numbers of a config that decide staleness (config key in brackets)."""

    k: int  # [staleness.k]
    groups_per_step: int  # [learner.groups_per_step]
    engines: int = 1  # [engine.count]
    batch_groups: int = 1  # [engine.batch_groups]
    produced_channel: int = 1  # [buffer.produced_channel]
    buffer_refs: int = 1  # [buffer.max_refs]
    ready_channel: int = 1  # [buffer.ready_channel]
    admission: Admission = "pace"  # [staleness.admission]
    max_reuse: int = 1  # [replay.max_reuse]
    replays_ride_along: bool = False  # [replay.ride_along]
    epochs: int = 1  # [learner.epochs]
    corrected: bool = False  # [correction.kind] != "none"
    lead: int | None = None  # [staleness.lead]; None: k

    def __post_init__(self) -> None:
        for name in ("groups_per_step", "engines", "batch_groups", "produced_channel", "buffer_refs",
                     "ready_channel", "max_reuse", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")
        if self.admission not in ("pace", "eager"):
            raise ValueError(f"admission must be 'pace' or 'eager', got {self.admission!r}")
        if self.lead is not None and not 0 <= self.lead <= self.k:
            raise ValueError(f"lead must be in 0..k = {self.k}, got {self.lead}")

    @property
    def queues(self) -> int:
        """Groups the channels and the buffer hold at most."""
        return self.produced_channel + self.buffer_refs + self.ready_channel

    @property
    def capacity(self) -> int:
        """Groups that can be started and not yet taken by a learner step, at most."""
        return self.engines * self.batch_groups + self.queues + self.groups_per_step


def _displacing_reuse(shape: PipelineShape) -> int:
    """How many of a step's slots one new group may take: its uses when replays take places, else 1."""
    return 1 if shape.replays_ride_along else shape.max_reuse


def queue_staleness(shape: PipelineShape) -> int:
    """Versions a group can wait behind a full pipeline when only the queues limit producers."""
    return -(-shape.capacity * _displacing_reuse(shape) // shape.groups_per_step)


def arrival_staleness(shape: PipelineShape) -> int:
    """Worst staleness of a group when the learner first sees it (before the accept check)."""
    waited = queue_staleness(shape)
    lead = shape.k if shape.lead is None else shape.lead
    return min(lead, waited) if shape.admission == "pace" and _displacing_reuse(shape) == 1 else waited


def trained_staleness(shape: PipelineShape) -> int:
    """Worst staleness, in versions, of a group trained on (the accept check caps it at k; reuse can
    take a group up to k)."""
    return min(shape.k, arrival_staleness(shape) + shape.max_reuse - 1)


def optimizer_lag(shape: PipelineShape) -> int:
    """Worst distance, in optimizer steps, between the weights a trained token was sampled with and
    the weights the loss's clip is centred on, in the step's last epoch."""
    if shape.corrected:  # the clip is centred on the step's proximal policy
        return shape.epochs - 1
    return trained_staleness(shape) * shape.epochs + shape.epochs - 1


def live_groups(shape: PipelineShape) -> int:
    """Groups that can exist at once between their admission and their last training step: the pipeline's
    capacity, and under pace admission at most `(lead + 1) * groups_per_step` of them (live groups are
    capped at `(v + lead + 1) * groups_per_step` while `v * groups_per_step` were consumed); plus, with
    reuse, the replay window's trained groups with uses left (at most k versions' worth)."""
    lead = shape.k if shape.lead is None else shape.lead
    live = shape.capacity
    if shape.admission == "pace":
        live = min(live, (lead + 1) * shape.groups_per_step)
    return live + (shape.k * shape.groups_per_step if shape.max_reuse > 1 else 0)


def check(shape: PipelineShape) -> list[str]:
    """Every way this shape can break the staleness contract, as a sentence naming keys and values
    that fix it; empty when it holds for every interleaving of the model above."""
    problems: list[str] = []
    k = shape.k
    if shape.max_reuse > k + 1:
        problems.append(
            f"replay.max_reuse = {shape.max_reuse} can never be reached: a group may be trained only at the "
            f"k + 1 = {k + 1} versions within staleness.k = {k} of its own; set replay.max_reuse = {k + 1} "
            f"or raise staleness.k to {shape.max_reuse - 1}"
        )
    waited = arrival_staleness(shape)
    if waited > k:
        problems.append(_queue_problem(shape, waited))
    lag = optimizer_lag(shape)
    if shape.epochs > 1 and lag > max(k, shape.epochs - 1):
        s = trained_staleness(shape)
        problems.append(
            f"learner.epochs = {shape.epochs} takes {shape.epochs} optimizer steps per version, so a sample "
            f"{s} version(s) old (staleness.k = {k}) is up to {lag} optimizer steps older than the weights "
            f"its loss is clipped against: staleness compounds (more than k = {k}); set learner.epochs = 1, "
            "or correction.kind = 'decoupled' (or 'tis') so the clip is centred on the step's own weights, "
            "or staleness.k = 0 with replay.max_reuse = 1 (PPO epochs on on-policy data)"
        )
    return problems


def _queue_problem(shape: PipelineShape, waited: int) -> str:
    k, b, m = shape.k, shape.groups_per_step, _displacing_reuse(shape)
    fixed = shape.capacity - shape.queues  # engines' batches + the learner's prefetch
    room = k * b // m - fixed  # groups the three queues may hold together for arrival staleness <= k
    terms = (
        f"engine.count x engine.batch_groups = {shape.engines * shape.batch_groups}, "
        f"buffer.produced_channel = {shape.produced_channel}, buffer.max_refs = {shape.buffer_refs}, "
        f"buffer.ready_channel = {shape.ready_channel}, learner.groups_per_step = {b}"
    )
    reuse = f" x replay.max_reuse = {m}" if m > 1 else ""
    fixes = (
        ["set staleness.admission = 'pace' (producers wait instead of making work that ages past k)"]
        if shape.admission == "eager"
        else ["set replay.ride_along = true (replays train on top of a step's new groups, not in their place) "
              "or replay.max_reuse = 1"]
    )
    if room >= 3:
        ready = min(shape.ready_channel, max(1, room // 4))
        produced = min(shape.produced_channel, max(1, room // 4))
        fixes.append(
            f"shrink the queues to at most {room} groups together, e.g. buffer.max_refs = {room - ready - produced}, "
            f"buffer.produced_channel = {produced}, buffer.ready_channel = {ready}"
        )
    else:
        fixes.append(
            f"no queue sizes fit, since the engines' batches and the learner's prefetch alone hold {fixed} groups "
            "(lower engine.batch_groups)"
        )
    fixes.append(f"raise staleness.k to {waited}")
    mode = f"staleness.admission = '{shape.admission}'" + (f" and replay.max_reuse = {m}" if m > 1 else "")
    return (
        f"with {mode} the queues alone can break the bound: the pipeline holds "
        f"up to {shape.capacity} groups ({terms}){reuse}, i.e. {waited} steps of {b} groups, so a group can "
        f"reach the learner {waited} versions old, more than staleness.k = {k}, and be thrown away; "
        + "; or ".join(fixes)
    )
