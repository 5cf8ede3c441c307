"""One episode: a coroutine that talks to one engine and, optionally, one environment.

An episode is the unit of work of the producer (docs/architecture.md, "The unit of work: an
episode"). `run_episode` drives it turn by turn, token-in token-out: the prompt's ids, then each model
turn exactly as the engine emitted it, then each environment reply rendered and tokenized alone
(`EpisodeTokens`). The history is never decoded and re-encoded; the environment sees decoded text only.

Without an environment an episode is one model turn (a single-turn task); its reward comes from the
group's reward function afterwards. With one, the episode's reward is the sum of its steps' rewards.

What ends an episode, and how it is reported:
- the environment says done, the turn limit or the token limit is reached: an `Episode`;
- the environment raises, or a step outlives `step_timeout_s`, or the whole episode `timeout_s`:
  `EpisodeFailed` with its reason (the group records the episode as failed; the run goes on);
- the engine fails (`EngineError`, including a request past `request_timeout_s`) or the staleness
  policy says the episode's earliest tokens are too old to go on (`EpisodeStale`): the caller starts
  the episode again from `start`, with a fresh environment, and counts it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from stages.data.tasks import Prompt
from stages.engines.base import Completion, Engine, EngineError, EnginePreempted, SamplingParams
from stages.engines.faulty import EngineTimeout
from stages.environments.base import Environment, Message
from stages.environments.render import Renderer
from stages.environments.tokens import EpisodeTokens
from stages.rollout.relay import Relay, preempted_before_start


@dataclass(frozen=True)
class EpisodeLimits:
    """Per-episode limits. `max_turns`: model turns; `max_tokens`: the whole episode's tokens (prompt,
    model and environment); `step_timeout_s`: one environment call; `timeout_s`: the whole episode;
    `request_timeout_s`: one engine call (past it the engine counts as failed). None: no limit."""

    max_turns: int = 8  # (an episode without an environment has one turn)
    max_tokens: int | None = None
    step_timeout_s: float | None = None
    timeout_s: float | None = None
    request_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"episode.max_turns must be >= 1, got {self.max_turns}")
        for name in ("max_tokens", "step_timeout_s", "timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"episode.{name} must be > 0 (or unset), got {value}")


class EpisodeFailed(Exception):
    """The environment failed the episode (raised, or timed out); `reason` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EpisodeStale(EngineError):
    """The episode's oldest model token is too old to continue under the engine's new weights (the
    staleness policy's `interrupt` said restart): it starts again from `start`."""


@dataclass
class Episode:
    """A finished episode: its tokens, the environment's total reward, per-turn info and how it ended
    ("done", "max_turns", "max_tokens", or "single" for one turn without an environment)."""

    tokens: EpisodeTokens
    reward: float = 0.0
    turns: int = 0
    ended: str = "done"
    info: dict[str, float] = field(default_factory=dict)
    last: Completion | None = None  # the last model turn (a single-turn reward scores it)
    carried: int = 0  # model tokens a preempted engine generated and another continued from (stages.rollout.relay)


@dataclass(frozen=True)
class EpisodeSetup:
    """What every episode of a rollout shares: how to render tokens, how to make an environment (None:
    single-turn), sampling, limits, and the staleness policy's `interrupt` (None: never interrupt)."""

    renderer: Renderer
    environment: Callable[[], Environment] | None
    sampling: SamplingParams
    limits: EpisodeLimits
    policy: Any = None
    relay: Relay | None = None  # where a preempted engine's requests continue (None: they fail with it)


def first_messages(sample: Prompt) -> list[Message]:
    """A task sample as chat messages: its own messages, else its text as one user message."""
    return list(sample.messages) if sample.messages is not None else [{"role": "user", "content": sample.text}]


def deadline(seconds: float | None):
    """`anyio.fail_after(seconds)`, or nothing at all when there is no limit (it costs per episode)."""
    return anyio.fail_after(seconds) if seconds is not None else contextlib.nullcontext()


async def run_episode(engine: Engine, sample: Prompt, setup: EpisodeSetup,
                      prompt_ids: list[int] | None = None) -> Episode:
    """Run one episode of `sample` on `engine` (see the module docstring for how it ends). Without an
    environment, `prompt_ids` may give the sample's rendered prompt (a group renders it once)."""
    env = setup.environment() if setup.environment is not None else None
    try:
        with deadline(setup.limits.timeout_s):
            return await _turns(engine, sample, setup, env, prompt_ids)
    except TimeoutError:
        raise EpisodeFailed(f"episode timed out after {setup.limits.timeout_s} s") from None
    finally:
        if env is not None:
            await _close(env)


async def _turns(engine: Engine, sample: Prompt, setup: EpisodeSetup, env: Environment | None,
                 prompt_ids: list[int] | None) -> Episode:
    limits = setup.limits
    tools = tuple(env.tools) if env is not None else ()
    if env is not None or prompt_ids is None:
        messages = await _env_call(env.start(sample), limits, "start") if env is not None else first_messages(sample)
        prompt_ids = setup.renderer.prompt_ids(messages, tools)
    episode = Episode(EpisodeTokens(prompt_ids), ended="single")
    for turn in range(1, limits.max_turns + 1):
        room = setup.sampling.max_new_tokens
        if limits.max_tokens is not None:
            room = min(room, limits.max_tokens - len(episode.tokens))
            if room <= 0:
                episode.ended = "max_tokens"
                return episode
        _check_fresh(engine, episode.tokens, setup.policy)
        completion = await _generate(engine, episode.tokens.ids(), replace(setup.sampling, max_new_tokens=room),
                                     limits.request_timeout_s, setup)
        episode.tokens.add_model(completion)
        episode.carried += int(completion.meta.get("carried_tokens", 0))
        episode.turns, episode.last = turn, completion
        if env is None:
            return episode
        said = setup.renderer.turn(completion.tokens, completion.finish_reason, tools)
        step = await _env_call(env.step(said), limits, f"step {turn}")
        episode.reward += float(step.reward)
        episode.info.update(step.info)
        if step.done:
            episode.ended = "done"
            return episode
        if step.messages and turn < limits.max_turns:
            after_stop = setup.renderer.ended_on_stop(completion.tokens)
            episode.tokens.add_env(setup.renderer.reply_ids(step.messages, after_stop=after_stop))
    episode.ended = "max_turns"
    return episode


async def run_single_turns(engine: Engine, prompt_ids: list[int], setup: EpisodeSetup, n: int) -> list[Episode]:
    """`n` single-turn episodes of one prompt (a group without an environment) as one engine call: they
    start together and the group waits for all of them anyway, so nothing waits that would not wait
    otherwise, and the engine sees one call instead of `n` (per-episode overhead dominates short turns)."""
    try:
        with deadline(setup.limits.timeout_s):
            completions = await _generate_many(engine, [prompt_ids] * n, setup.sampling,
                                               setup.limits.request_timeout_s, setup)
    except TimeoutError:
        raise EpisodeFailed(f"episode timed out after {setup.limits.timeout_s} s") from None
    episodes = []
    for completion in completions:
        tokens = EpisodeTokens(prompt_ids)
        tokens.add_model(completion)
        episodes.append(Episode(tokens, turns=1, ended="single", last=completion,
                                carried=int(completion.meta.get("carried_tokens", 0))))
    return episodes


def _check_fresh(engine: Engine, tokens: EpisodeTokens, policy: Any) -> None:
    """Between turns: raise EpisodeStale when the policy says the episode's oldest model token may not
    continue under the engine's current weights (within a turn, the engine asks the policy itself)."""
    span = tokens.version_span()
    if policy is None or span is None or engine.version <= span[0]:
        return
    if policy.interrupt(span[0], engine.version) == "restart":
        raise EpisodeStale(f"episode tokens from version {span[0]} may not continue at version {engine.version}")


async def _generate(engine: Engine, ids: list[int], params: SamplingParams, timeout_s: float | None,
                    setup: EpisodeSetup | None = None) -> Completion:
    (completion,) = await _generate_many(engine, [ids], params, timeout_s, setup)
    return completion


async def _generate_many(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                         timeout_s: float | None, setup: EpisodeSetup | None = None) -> list[Completion]:
    """The engine's completions; those a preempted engine gave back continue on another (`setup.relay`)."""
    relay = setup.relay if setup is not None else None
    try:
        with deadline(timeout_s):
            try:
                completions = await engine.generate(prompts, params)
            except EnginePreempted:  # a call made after the preemption: all of it goes elsewhere
                if relay is None:
                    raise
                completions = [preempted_before_start() for _ in prompts]
            if relay is None or all(c.finish_reason != "preempted" for c in completions):
                return completions
            return await _carried(engine, prompts, completions, params, setup)
    except TimeoutError:
        raise EngineTimeout(f"engine {engine.name} did not answer within {timeout_s} s") from None


async def _carried(engine: Engine, prompts: list[list[int]], completions: list[Completion], params: SamplingParams,
                   setup: EpisodeSetup) -> list[Completion]:
    """Each preempted completion continued on another engine at once (stages.rollout.relay)."""
    assert setup.relay is not None
    done, failed = list(completions), []

    async def carry(i: int) -> None:
        try:
            done[i] = await setup.relay.carry(engine, prompts[i], completions[i], params, setup.policy)
        except EngineError as exc:  # raised as itself below, not in a group: the caller's retries catch it
            failed.append(exc)

    async with anyio.create_task_group() as tg:
        for i, completion in enumerate(completions):
            if completion.finish_reason == "preempted":
                tg.start_soon(carry, i)
    if failed:
        raise failed[0]
    return done


async def _env_call(call: Any, limits: EpisodeLimits, what: str) -> Any:
    """Await an environment call under the step timeout; any failure becomes EpisodeFailed."""
    try:
        with deadline(limits.step_timeout_s):
            return await call
    except TimeoutError:
        raise EpisodeFailed(f"environment {what} timed out after {limits.step_timeout_s} s") from None
    except (anyio.get_cancelled_exc_class(), EngineError):
        raise
    except Exception as exc:  # a user's environment: any error fails its episode, never the run
        raise EpisodeFailed(f"environment {what} raised {type(exc).__name__}: {exc}") from exc


async def _close(env: Environment) -> None:
    """Close the environment whatever happened; a close that fails or hangs is ignored (bounded)."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(10):
        try:
            await env.close()
        except Exception:  # noqa: BLE001 - the episode's outcome is already decided
            pass
