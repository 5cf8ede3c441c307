"""GRPOLearner: the consumer stage. Refs in -> accepted groups -> one optimizer step per version.

Each step:
1. receive and load refs into the replay window until it holds `groups_per_step` groups that may be
   trained at the current version, then let the selection policy (`policies.selection`: fifo,
   freshest, uniform) pick them. With `max_reuse` > 1 the window also holds groups trained before with
   uses left: by default a replay takes a new group's place (and counts as a started unit at the
   admission gate); with `replays_ride_along` the step trains `groups_per_step` new groups plus every
   such replay, so each version consumes exactly `groups_per_step` new groups and the admission gate's
   pace argument (policies.bounds) holds with reuse as without it. Groups whose rewards are all equal
   are filtered on the way in (with `drop_zero_signal`; they give GRPO no gradient, and a producer
   makes another in their place), groups the staleness policy refuses are dropped or requeued, and
   all of it is counted; the next step's groups are received and loaded while this step computes,
   and judged once their version is known;
2. get + decode their payloads (checksum verified), compute group-centred advantages (divided by the
   group's std with `norm_adv_by_std`) and the PPO-clip loss with the configured off-policy
   correction (`policies.correction`: none clips
   against each token's behaviour logprob; tis and decoupled clip against the learner's own logprobs
   at the step's start and weight tokens by pi_prox / pi_behav), aggregated over the loss mask as
   `loss_agg_mode` says, minus `entropy_coef` x entropy (of every row, or with `entropy_scope =
   "zero-variance"` only of the rows of groups without signal), plus `kl_coef` x the k3 KL to the initial
   weights (stages.losses); clip gradients, take an AdamW step at the scheduled learning rate;
3. bump the version, publish the weights through the transport, advance the clock, and only
   then mark the groups trained (at the version they were trained at). A group with uses left
   (`max_reuse`) goes back into the window, to be trained again while the staleness policy accepts
   it; a payload is freed only after its group's last use;
4. every `checkpoint.every` versions, write a checkpoint (pipeline.checkpoint): the run's state plus
   this learner's model, optimizer and RNG states (stages.learner_state) and the refs of its window. A
   resumed learner starts from those, publishes the checkpoint's weights to the engines before any
   generation, and takes back the reusable groups of its window whose payloads still exist.
Compute runs in a worker thread so the engine can decode at the same time.

Each metrics record carries what shows a collapse early: `entropy` (mask-averaged, of the step's last
forward), `zero_var_frac` (groups whose rewards are all equal), `clip_frac_low` / `clip_frac_high`
(tokens whose ratio lies below / above the clip range) and `lr`. When the entropy falls below
`warn_entropy_below` while the trailing mean reward (last `warn_window` versions) is still below
`warn_reward_below`, the run reports a `learner.entropy_collapse` event (once per run).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from buffers.codec import CodecError, RolloutBatch, decode
from buffers.retry import with_retries
from buffers.store import ObjectStore, StoreError
from pipeline.actor import BaseActor
from pipeline.channel import Channel, ChannelClosed
from pipeline.checkpoint import CheckpointError
from pipeline.context import RunContext, free, redo, refuse
from pipeline.events import EventCounts
from pipeline.faults import plan_of
from pipeline.refs import HeldRef, Ref
from pipeline.telemetry import Panel, sliding_rate
from policies.correction import Correction
from policies.selection import Fifo, NoSignalError, ReplayWindow, Selection, Taken
from policies.staleness import staleness
from stages.bias import outcome_panels, run_outcomes, step_outcomes
from stages.evaluation import read_evaluations
from stages.learner_state import read_learner_state, write_learner_state
from stages.losses import (
    AGGREGATIONS,
    ENTROPY_SCOPES,
    LR_DECAYS,
    EntropyScope,
    LossAggregation,
    LrDecay,
    aggregate,
    entropy_bonus_rows,
    group_advantages,
    kl_k3,
    lr_scheduler,
    staleness_lr_factor,
    token_entropy,
    zero_variance_fraction,
)
from stages.model import load_model
from stages.timeline import timeline_panel
from stages.weights import make_transport
from stages.weights.base import WeightTransport
from stages.weights.faulty import with_weight_faults
from stages.weights.snapshot import save_snapshot, snapshot_key


def episode_metrics(batches) -> dict[str, float]:
    """Multi-turn episodes' numbers over a step's batches: `turns_mean`, and per number an environment
    reported (row fields `info/<name>`, NaN where an episode had none) its mean as `episode/<name>`."""
    turns = [b.row_fields["turns"] for b in batches if "turns" in b.row_fields]
    if not turns:
        return {}
    out = {"turns_mean": round(float(np.mean(np.concatenate(turns))), 4)}
    for name in sorted({f for b in batches for f in b.row_fields if f.startswith("info/")}):
        values = np.concatenate([b.row_fields[name] for b in batches if name in b.row_fields])
        if np.isfinite(values).any():
            out[f"episode/{name[len('info/'):]}"] = round(float(np.nanmean(values)), 4)
    return out


@dataclass
class GRPOLearner:
    """The DSL/config object: `GRPOLearner(model_path, lr=4e-4, groups_per_step=16)`. The defaults are the
    learning defaults measured in README "Learning defaults" (every built-in task at every seed tried)."""

    model_path: str | Path
    lr: float = 4e-4  # 1.5e-3 learns reverse-digits sooner but locks addition (README "Learning defaults")
    groups_per_step: int = 16
    clip_eps: float = 0.2  # PPO clip, low side (and the high side unless clip_eps_high is set)
    clip_eps_high: float | None = 0.28  # PPO clip, high side (DAPO's clip-higher); None: clip_eps
    loss_agg_mode: LossAggregation = "token-mean"  # stages.losses.aggregate
    loss_max_tokens: int | None = None  # seq-mean-token-sum-norm's constant divisor; None: the batch's width
    norm_adv_by_std: bool = False  # False: Dr. GRPO advantages (r - group mean, no std scaling)
    entropy_coef: float = 0.01  # entropy bonus: loss -= coef x aggregated entropy
    entropy_scope: EntropyScope = "all"  # "zero-variance": the bonus counts only rows of groups without signal
    kl_coef: float = 0.0  # k3 KL penalty to the initial weights (kept in memory only when > 0)
    lr_warmup_steps: int = 0  # linear warmup over this many versions
    lr_decay: LrDecay = "constant"  # after warmup: constant, linear or cosine to min_lr_ratio x lr at the last step
    min_lr_ratio: float = 0.0
    # the staleness lr was chosen at: a staler step's lr x ((this + 1) / (staleness + 1)) ** lr_staleness_power
    lr_tuned_staleness: float = 5.0  # with lr 4e-4: a staleness-8 step takes 0.44 x lr (README "Learning defaults")
    lr_staleness_power: float = 2.0  # 0: the same lr at every staleness
    warn_entropy_below: float = 0.05  # a learner.entropy_collapse event when entropy falls below this ...
    warn_reward_below: float = 0.5  # ... while the trailing mean reward is below this
    warn_window: int = 20  # versions in the trailing reward
    replays_ride_along: bool = False  # reuse: replays train on top of groups_per_step new groups, not in their place
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    epochs: int = 1  # optimizer passes over each step's batch (PPO epochs)
    temperature: float = 1.0
    weights: str | WeightTransport = "inproc"
    snapshot_every: int = 1  # keep every n-th version in the store for engine processes that (re)start; 0: never
    device: str = "auto"  # "auto": cuda when a GPU is visible, else cpu
    correction: Correction = Correction()  # off-policy correction of the loss (policies.correction)
    selection: Selection = Fifo()  # which groups a step trains on, reuse, zero-signal filter (policies.selection)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"learner.lr must be > 0, got {self.lr}")
        if self.groups_per_step < 1:
            raise ValueError(f"learner.groups_per_step must be >= 1, got {self.groups_per_step}")
        if self.epochs < 1:
            raise ValueError(f"learner.epochs must be >= 1, got {self.epochs}")
        if self.loss_agg_mode not in AGGREGATIONS:
            raise ValueError(
                f"learner.loss_agg_mode must be one of {', '.join(AGGREGATIONS)}, got {self.loss_agg_mode!r}"
            )
        if self.lr_decay not in LR_DECAYS:
            raise ValueError(f"learner.lr_decay must be one of {', '.join(LR_DECAYS)}, got {self.lr_decay!r}")
        if self.entropy_scope not in ENTROPY_SCOPES:
            raise ValueError(f"learner.entropy_scope must be one of {', '.join(ENTROPY_SCOPES)}, "
                             f"got {self.entropy_scope!r}")
        if self.lr_tuned_staleness < 0:
            raise ValueError(f"learner.lr_tuned_staleness must be >= 0, got {self.lr_tuned_staleness}")
        if self.lr_staleness_power < 0:
            raise ValueError(f"learner.lr_staleness_power must be >= 0, got {self.lr_staleness_power}")
        if self.clip_eps_high is not None and self.clip_eps_high <= 0:
            raise ValueError(f"learner.clip_eps_high must be > 0, got {self.clip_eps_high}")

    @property
    def units_per_version(self) -> int:
        return self.groups_per_step

    @property
    def max_uses(self) -> int:
        """Most times one sample is trained on (the run's ledger enforces it)."""
        return self.selection.max_reuse

    def actors(self, ctx: RunContext, inbox: Channel | None, outbox: Channel | None):
        assert inbox is not None
        transport = make_transport(self.weights) if isinstance(self.weights, str) else self.weights
        transport = with_weight_faults(transport, plan_of(ctx))  # itself unless weights.push_fail is planned
        for receiver in ctx.services.weight_receivers:  # engines in this process
            transport.subscribe(receiver)
        peers = ctx.services.producers
        remote = [transport.remote_receiver(peer, f"producer-{i}") for i, peer in enumerate(peers)]
        for receiver in remote:  # engines in other processes (Ray runtime)
            transport.subscribe(receiver)
        # a restarted producer process catches up from the latest version at once
        ctx.services.on_producer_restart = lambda index: remote[index].resend()
        # snapshots serve engine processes that (re)start; engines in this process never need one
        snapshot_every = self.snapshot_every if remote else 0
        actor = LearnerActor(self, ctx, inbox, transport, snapshot_every)
        ctx.add_status(actor.status)
        return [actor]

    # -- what the pipeline shows and returns -------------------------------------------------
    def summary(self, records: list[dict], run_dir: Path | None = None) -> dict[str, Any]:
        """reward_start / reward_end: mean train reward of the first / last few steps (a quarter of
        the run, at most 5); max_staleness_trained: over every trained group; outcomes: response
        length and reward of the samples trained vs dropped (stages.bias); eval: the first and last
        evaluation, each tagged with the weight version it measured, when the run evaluated."""
        window = max(1, min(5, len(records) // 4))
        mean = lambda rows: round(float(np.mean([r["reward"] for r in rows])), 4) if rows else None  # noqa: E731
        evaluations = read_evaluations(run_dir)
        return {
            "reward_start": mean(records[:window]),
            "reward_end": mean(records[-window:]),
            "max_staleness_trained": max((r["staleness_max"] for r in records), default=None),
            "outcomes": run_outcomes(records),
            **({"eval": {"first": evaluations[0], "last": evaluations[-1]}} if evaluations else {}),
        }

    def progress(self, last: dict | None) -> dict[str, Any]:
        if not last:
            return {}
        return {"reward": last["reward"], "staleness": last["staleness_mean"], "samples/s": last["samples_per_s"]}

    def report_panels(self, records: list[dict], run_dir: Path | None = None) -> list[Panel]:
        """Reward, staleness (integer bins), throughput over a sliding window, the learner's time per
        version, eval metrics (`eval...` keys), the filtered fraction (when anything was filtered), trained
        vs dropped (when anything was dropped) and the timeline of the first minutes (stages.timeline)."""
        stale = Counter(s for r in records for s in r.get("staleness_hist", []))
        evaluations = read_evaluations(run_dir)
        evals = {key: ([e["version"] for e in evaluations], [e[key] for e in evaluations])
                 for key in ("eval/reward_mean", "eval/pass_rate")}
        timeline = timeline_panel(run_dir, records)
        return [
            Panel("mean reward per step", "line", x="version", y=["reward"]),
            Panel("staleness of trained groups", "hist", xlabel="staleness (versions behind the learner)",
                  counts={"trained groups": {str(k): stale[k] for k in range(max(stale, default=-1) + 1)}}),
            _throughput_panel(records),
            Panel("learner time per version (s)", "line", x="version",
                  y=["version_s", "step_s", "collect_s", "push_s"]),
            *([Panel("eval at the version measured", "line", series=evals)] if evaluations else []),
            *([Panel("groups without signal: filtered fraction", "line", x="version", y=["filtered_frac"])]
              if any(r.get("filtered_frac") for r in records) else []),
            *outcome_panels(records),
            *([timeline] if timeline is not None else []),
        ]


def _throughput_panel(records: list[dict]) -> Panel:
    """Trained samples per second over a sliding window (a tenth of the run, at most 60 s): a stall
    shows as a dip, which a cumulative average hides."""
    rows = [r for r in records if "t" in r and "trained" in (r.get("outcomes") or {})]
    span = rows[-1]["t"] if rows else 0.0
    window_s = min(60.0, span / 10) or 1.0
    ts = [r["t"] for r in rows]
    rates = sliding_rate(ts, [r["outcomes"]["trained"]["n"] for r in rows], window_s)
    return Panel(f"throughput: trained samples/s over the last {window_s:.2g} s", "line",
                 series={"samples/s": (ts, rates)}, xlabel="seconds since the run started")


class LearnerActor(BaseActor):
    name = "learner"

    def __init__(
        self, spec: GRPOLearner, ctx: RunContext, inbox: Channel, transport: WeightTransport, snapshot_every: int = 0
    ) -> None:
        self.spec, self.ctx, self.inbox, self.transport = spec, ctx, inbox, transport
        self.snapshot_every = snapshot_every
        self.log = ctx.log("learner")
        self.model: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None  # the initial weights, for the KL penalty (kl_coef > 0)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self._rewards: deque[float] = deque(maxlen=spec.warn_window)  # trailing step rewards
        self._warned = False  # the entropy-collapse event is reported once per run
        self._frees: anyio.abc.TaskGroup | None = None
        self._fetched: list[tuple[Ref, RolloutBatch]] = []  # received and loaded, not yet judged
        # groups this learner may train on: admitted (with signal), within the bound, uses left
        self._window: ReplayWindow[tuple[Ref, RolloutBatch]] = ReplayWindow(spec.selection, ctx.policy)
        self._examined = self._filtered = 0  # groups judged by the signal filter during the current step
        self._version = 0  # the version this learner's weights are at (kept by _train)
        self._load_s, self._loads = 0.0, 0  # store gets since the last metrics record (time, count)
        self._events = EventCounts(ctx.folder.path)  # run events (pipeline.events) so far, for the metrics

    @property
    def store(self) -> ObjectStore:
        return self.ctx.services.store

    async def start(self) -> None:
        device = self.spec.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model = (await anyio.to_thread.run_sync(load_model, self.spec.model_path)).to(self.device)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.spec.lr, weight_decay=self.spec.weight_decay
        )
        version = 0
        resume = self.ctx.resume
        if resume is not None:
            version = await anyio.to_thread.run_sync(
                read_learner_state, resume.consumer_dir, self.model, self.optimizer, self.spec.selection
            )
            if version != resume.version:
                raise CheckpointError(f"checkpoint {resume.checkpoint}: learner state of version {version}, "
                                      f"run state of version {resume.version}")
            kept = await self._restore_reusable(resume.reusable, version)
            self.log.info("learner restored", version=version, checkpoint=str(resume.checkpoint), reusable_groups=kept)
        self._schedule(version)
        if self.spec.kl_coef > 0:  # the model folder holds the initial weights, also on resume
            self.reference = (await anyio.to_thread.run_sync(load_model, self.spec.model_path)).to(self.device)
            self.reference.requires_grad_(False)
        # every engine starts from exactly the learner's weights of the run's first version (0 or the checkpoint's)
        await self._publish(version)
        if resume is not None and self.snapshot_every:  # replaces a snapshot of a rolled-back version
            await save_snapshot(self.store, snapshot_key(self.ctx.run, self.ctx.folder.path.name), version,
                                self.model.state_dict())

    def _schedule(self, version: int) -> None:
        """The learning-rate schedule, at `version` (0, or a checkpoint's): a function of the version alone."""
        spec = self.spec
        for group in self.optimizer.param_groups:
            group["initial_lr"] = spec.lr
        self.scheduler = lr_scheduler(self.optimizer, spec.lr_warmup_steps, self.ctx.steps, spec.lr_decay,
                                      spec.min_lr_ratio, start=version)

    def _watch_collapse(self, version: int, reward: float, entropy: float) -> None:
        """Report `learner.entropy_collapse` (once) when entropy is below its floor while the trailing
        reward is still low: the policy stopped exploring before it learned the task."""
        spec = self.spec
        self._rewards.append(reward)
        trailing = float(np.mean(self._rewards))
        if not self._warned and entropy < spec.warn_entropy_below and trailing < spec.warn_reward_below:
            self._warned = True
            self.ctx.event("learner.entropy_collapse", version=version, entropy=round(entropy, 4),
                           trailing_reward=round(trailing, 4))

    async def _restore_reusable(self, held: list[HeldRef], version: int) -> int:
        """Put the checkpoint's trained groups with uses left back into the window: those the staleness policy
        still accepts at `version` and whose payload the store still holds (the others' payloads are freed;
        their fate stays trained either way); returns how many came back."""
        kept = 0
        for h in held:
            if self.ctx.policy.accept(version, h.ref.version) != "train":
                await free(self.ctx, h.ref, self.store)
                continue
            try:
                batch = decode(await self.store.get(h.ref.key, size_hint=h.ref.nbytes))
            except (StoreError, CodecError):
                continue
            self._window.add((h.ref, batch), h.ref.version, uses=h.uses)
            kept += 1
        return kept

    def held_refs(self) -> list[HeldRef]:
        """The refs this learner holds between steps: loaded and not yet judged, then its window (with use
        counts); what a checkpoint records of it."""
        held = [HeldRef(ref=ref, holder=self.name) for ref, _ in self._fetched]
        held.extend(HeldRef(ref=e.item[0], holder=self.name, uses=e.candidate.uses) for e in self._window.entries())
        return held

    def write_state(self, folder: Path) -> None:
        """The learner's part of a checkpoint (stages.learner_state); called between steps, in a worker thread."""
        assert self.model is not None and self.optimizer is not None
        write_learner_state(folder, self._version, self.model, self.optimizer, self.spec.selection)

    def status(self) -> str:
        """A line for hang reports: what the learner holds and waits for."""
        return (
            f"learner: version {self._version}, window {len(self._window)}/{self.spec.groups_per_step} groups, "
            f"{len(self._fetched)} loaded and not yet judged"
        )

    async def stop(self) -> None:
        await self.transport.close()

    async def run(self) -> None:
        async with anyio.create_task_group() as frees:
            self._frees = frees
            await self._train()
        self._frees = None

    async def _train(self) -> None:
        ctx = self.ctx
        t_start = time.perf_counter()
        trained_samples = 0
        version = self._version = await ctx.clock.current()  # the learner is the clock's only writer
        last = time.perf_counter()
        while version < ctx.steps:
            ctx.note(self.name, f"collecting {self.spec.groups_per_step} groups for version {version + 1}")
            taken = await self._collect(version)
            ctx.note(self.name, f"training version {version + 1} on {len(taken)} groups")
            refs, batches = [t.item[0] for t in taken], [t.item[1] for t in taken]
            t0 = time.perf_counter()
            collect_s = t0 - last
            async with anyio.create_task_group() as tg:
                if version + 1 < ctx.steps:  # fetch the next step's groups while this one computes
                    tg.start_soon(self._prefetch, version)
                stale = [staleness(version, r.version) for r in refs]
                stats = await anyio.to_thread.run_sync(self._step, batches, float(np.mean(stale)))
                tg.cancel_scope.cancel()  # a prefetch still waiting for groups must not hold up the version
            step_s = time.perf_counter() - t0
            push_s, pushed = await self._publish(version + 1)
            if self.snapshot_every and (version + 1) % self.snapshot_every == 0:
                key = snapshot_key(ctx.run, ctx.folder.path.name)
                await save_snapshot(self.store, key, version + 1, self.model.state_dict())
            await ctx.clock.advance_to(version + 1)
            await ctx.ledger.trained([i for ref in refs for i in ref.item_ids], at_version=version)
            settled = await ctx.ledger.take_settled()  # trained now, and dropped since the last step
            for ref, _ in self._window.returned(taken, version):  # their last use is over
                await free(ctx, ref, self.store, self._frees)
            trained_samples += sum(r.rows for r in refs)
            elapsed = time.perf_counter() - t_start
            ctx.folder.log_metrics({
                "version": version + 1,
                "t": round(time.time() - ctx.started_at, 3),
                "staleness_mean": round(float(np.mean(stale)), 3),
                "staleness_max": int(max(stale)),
                "staleness_hist": stale,
                "outcomes": step_outcomes(settled),
                "groups_reused": sum(t.reused for t in taken),  # trained before, trained again now
                "groups_filtered": self._filtered,  # refused for equal rewards while collecting this step
                "filtered_frac": round(self._filtered / self._examined, 4) if self._examined else 0.0,
                "samples_per_s": round(trained_samples / elapsed, 1),
                "step_s": round(step_s, 4),  # compute (forward, backward, optimizer)
                "collect_s": round(collect_s, 4),  # waiting for and loading accepted groups
                "push_s": round(push_s, 4),  # publishing the new version's weights to the engines
                "weights": pushed,  # the transport's counters (stages.weights.base.STATS) for this version
                "load_s": round(self._load_s, 4), "loads": self._loads,  # store gets since the last record
                "tokens": int(sum(b.tokens for b in batches)),  # prompt + response tokens trained on
                "version_s": round(time.perf_counter() - last, 4),  # this version, end to end
                **stats,
                **{f"events/{kind}": n for kind, n in self._events.update().items()},  # pipeline.events
            })
            self._watch_collapse(version + 1, stats["reward"], stats["entropy"])
            last = time.perf_counter()
            self._load_s, self._loads = 0.0, 0
            version = self._version = version + 1
            ctx.note(self.name, f"trained version {version}")
            if ctx.checkpoint is not None and ctx.checkpoint.due(version):
                written = await ctx.checkpoint.save(version, self)
                ctx.note(self.name, f"checkpoint of version {version} {'written' if written else 'skipped'}")

    async def _publish(self, version: int) -> tuple[float, dict[str, float]]:
        """Publish `version`'s weights: the seconds it took and the transport's counters for it. Refusals
        and unreachable engines the transport handled are reported as run events (`weights.refused`,
        `weights.unreachable`)."""
        started, before = time.perf_counter(), dict(self.transport.stats)
        await self.transport.publish(version, self.model.state_dict())
        counted = {k: round(v - before.get(k, 0), 4) for k, v in self.transport.stats.items()}
        for key in ("refused", "unreachable"):
            if counted.get(key):
                self.ctx.event(f"weights.{key}", count=int(counted[key]), version=version)
        return time.perf_counter() - started, counted

    async def _prefetch(self, version: int) -> None:
        """Receive and load up to one step of groups (whatever is there, waiting for the first). One
        receive only: the groups being trained come back into the window after the step, and a prefetch
        that filled a whole step ahead of them would let them age out unused (max_reuse). They are
        judged by the policy only once the version they would be trained at is known.
        Cancelled while waiting, it takes nothing (channel receives are cancellation-safe); once it
        holds refs, it finishes loading them (shielded), so no received ref is ever dropped."""
        refs = await self._receive(version + 1, self.spec.groups_per_step - len(self._fetched) - self._counted())
        with anyio.CancelScope(shield=True):
            for ref in refs:
                batch = await self._load(ref)
                if batch is not None:
                    self._fetched.append((ref, batch))

    async def _receive(self, version: int, wanted: int) -> list[Ref]:
        try:  # as many as are there, up to `wanted`: one round trip
            refs = await self.inbox.receive_many(max(wanted, 1))
        except anyio.EndOfStream:
            raise ChannelClosed(
                f"channel {self.inbox.name!r} closed and drained before the groups for version {version + 1} "
                "were complete: the stage feeding it stopped"
            ) from None
        for ref in refs:
            if ref.store != self.store.name:
                raise ValueError(f"ref {ref.key} comes from store {ref.store!r}, not {self.store.name!r}")
        return refs

    def _counted(self) -> int:
        """Groups in the window that count towards `groups_per_step`: all, or with replays riding along, the
        ones never trained."""
        if not self.spec.replays_ride_along:
            return len(self._window)
        return sum(not entry.reused for entry in self._window.entries())

    async def _collect(self, version: int) -> list[Taken[tuple[Ref, RolloutBatch]]]:
        """The groups to train on at `version`, picked by the selection policy from the replay window:
        `groups_per_step` of the loaded groups (prefetched ones first) that have signal and the groups
        trained before with uses left; with `replays_ride_along`, `groups_per_step` new ones plus every
        reusable one. Before they cost a step, groups without signal are filtered, groups the staleness
        policy refuses are dropped or requeued, and used-up or too old reused ones are freed."""
        wanted, ctx = self.spec.groups_per_step, self.ctx
        self._examined = self._filtered = 0
        while True:
            await self._admit_fetched(version)
            for entry in self._window.expire(version):
                ref = entry.item[0]
                if entry.reused:  # trained already (its fate stays trained): only its payload goes
                    await free(ctx, ref, self.store, self._frees)
                else:
                    await refuse(ctx, ref, version, self.store, self._frees)
            counted = self._counted()
            if counted >= wanted:
                break
            for ref in await self._receive(version, wanted - counted):
                batch = await self._load(ref)
                if batch is not None:
                    self._fetched.append((ref, batch))
        taken = self._window.take(version, wanted + len(self._window) - counted)  # + replays riding along
        replays = sum(t.reused for t in taken)
        if replays and not self.spec.replays_ride_along:  # it fills a new group's slot: producers must not run ahead
            await ctx.gate.replayed(replays)
        return taken

    async def _admit_fetched(self, version: int) -> None:
        """Move loaded groups into the window; those the selection refuses (rewards all equal) are
        recorded as filtered, their slots freed (a producer makes another) and their payloads removed.
        Raises `NoSignalError` once this step has filtered more than the selection's budget."""
        selection, ctx = self.spec.selection, self.ctx
        fetched, self._fetched = self._fetched, []
        for ref, batch in fetched:
            self._examined += 1
            rewards = batch.row_fields["rewards"]
            if selection.admit(rewards):
                self._window.add((ref, batch), ref.version)
                continue
            self._filtered += 1
            await ctx.ledger.finished("dropped", ref.item_ids, f"filtered: rewards all equal ({float(rewards[0]):g})")
            await ctx.gate.discard(1)
            await free(ctx, ref, self.store, self._frees)
            if selection.gave_up(self._filtered, self.spec.groups_per_step):
                raise NoSignalError(
                    f"the step for version {version + 1} filtered {self._filtered} groups whose rewards were all "
                    f"equal and still lacks {self.spec.groups_per_step - self._counted()} of "
                    f"learner.groups_per_step = {self.spec.groups_per_step} groups with signal: the policy may have "
                    "collapsed (see the entropy metric) or the task is solved or hopeless for it; raise "
                    f"replay.max_filtered_batches (now {selection.max_filtered_batches}) to wait longer, or set "
                    "replay.drop_zero_signal = false"
                )

    async def _load(self, ref: Ref) -> RolloutBatch | None:
        """The decoded payload, or None when it is gone or corrupt: then its samples are counted as
        lost, the slot is freed and the group's prompt goes back to the producer to be redone."""
        t0 = time.perf_counter()
        try:
            payload = await with_retries(lambda: self.store.get(ref.key, size_hint=ref.nbytes))
            self._load_s += time.perf_counter() - t0
            self._loads += 1
            return decode(payload)
        except (StoreError, CodecError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self.log.warning("payload lost", key=ref.key, error=reason)
            await redo(self.ctx, ref, "lost", reason, self.store, self._frees)
            return None

    def _step(self, batches: list[RolloutBatch], mean_staleness: float = 0.0) -> dict[str, float]:
        """One version's optimizer step(s) on `batches`, at the scheduled lr scaled for the batch's mean
        staleness (`staleness_lr_factor`); the loss and the diagnostics for the metrics."""
        model, opt, spec = self.model, self.optimizer, self.spec
        assert model is not None and opt is not None
        ids, old, mask, attn, rewards, group_index = _batch_tensors(batches)
        ids, old, mask, attn = (t.to(self.device) for t in (ids, old, mask, attn))
        adv = group_advantages(rewards, group_index, scale_by_std=spec.norm_adv_by_std)[:, None].to(self.device)
        reduce = partial(aggregate, mode=spec.loss_agg_mode, max_tokens=spec.loss_max_tokens)
        m = mask[:, 1:]
        reference = self._reference_logprobs(ids, attn) if self.reference is not None else None
        bonus_rows = entropy_bonus_rows(rewards, group_index, spec.entropy_scope)[:, None].to(self.device)
        proximal: torch.Tensor | None = None
        lr_scale = staleness_lr_factor(mean_staleness, spec.lr_tuned_staleness, spec.lr_staleness_power)
        for group in opt.param_groups:  # the scheduler sets each step's lr afresh, so this lasts one step
            group["lr"] *= lr_scale
        lr = opt.param_groups[0]["lr"]
        for epoch in range(spec.epochs):  # PPO epochs: later passes see ratios move away from 1, and clip
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / spec.temperature
            logp_all = torch.log_softmax(logits, -1)
            logp = logp_all.gather(2, ids[:, 1:, None]).squeeze(-1)
            if epoch == 0:  # the proximal policy: the weights at the step's start, before any update of them;
                proximal = logp.detach()  # epoch 0's forward runs on exactly those, so it costs no extra forward
            loss, info = spec.correction.loss(logp, old[:, 1:], proximal, adv, m, spec.clip_eps,
                                              spec.clip_eps_high, reduce)
            entropy = token_entropy(logp_all) if spec.entropy_coef > 0 else token_entropy(logp_all.detach())
            if spec.entropy_coef > 0:
                loss = loss - spec.entropy_coef * reduce(entropy * bonus_rows, m)
            if reference is not None:
                kl = reduce(kl_k3(logp, reference), m)
                loss = loss + spec.kl_coef * kl
                info["kl_ref"] = float(kl.detach())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
            opt.step()
        self.scheduler.step()
        info["entropy"] = float((entropy.detach() * m).sum() / m.sum().clamp(min=1))
        info["reward"] = round(float(np.mean([b.row_fields["rewards"].mean() for b in batches])), 4)  # per group
        info["zero_var_frac"] = round(zero_variance_fraction(rewards, group_index), 4)
        info["lr"] = lr
        info["lr_staleness_factor"] = round(lr_scale, 4)
        return {"loss": round(loss.item(), 5), "grad_norm": round(float(grad_norm), 4), **info,
                **episode_metrics(batches)}

    def _reference_logprobs(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Each token's logprob under the initial weights (the KL penalty's reference), without gradient."""
        with torch.no_grad():
            logits = self.reference(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / self.spec.temperature
            return torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).squeeze(-1)


def _batch_tensors(batches: list[RolloutBatch]) -> tuple[torch.Tensor, ...]:
    """The step's rows, padded to the longest: token ids, behaviour logprobs, loss mask, attention mask
    ([rows, T] each), and per row its reward and the index of its group ([rows] each)."""
    width = max(int(np.diff(b.offsets).max()) for b in batches)
    n = sum(b.rows for b in batches)
    ids = torch.zeros((n, width), dtype=torch.long)
    old, mask = torch.zeros((n, width)), torch.zeros((n, width))
    attn = torch.zeros((n, width), dtype=torch.long)
    rewards, group_index = torch.zeros(n), torch.zeros(n, dtype=torch.long)
    i = 0
    for g, b in enumerate(batches):
        for j in range(b.rows):
            row = b.row(j)
            k = len(row["tokens"])
            ids[i, :k] = torch.from_numpy(row["tokens"].astype(np.int64))
            old[i, :k] = torch.from_numpy(row["logprobs"].copy())
            mask[i, :k] = torch.from_numpy(row["loss_mask"].astype(np.float32))
            attn[i, :k] = 1
            rewards[i] = float(b.row_fields["rewards"][j])
            group_index[i] = g
            i += 1
    return ids, old, mask, attn, rewards, group_index
