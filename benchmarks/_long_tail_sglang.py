"""The prefix-cache part of `benchmarks/long_tail.py --sglang`: two SGLang servers on CPU serve the same
long-tailed multi-turn episodes (`LongTailFeedback`, its step latency cut to milliseconds) twice:
routed sticky (every turn of an episode to the server that took its first turn, new episodes
alternating) and round robin (each engine call to the next server). Each server reports
`meta_info.cached_tokens` per request; the figure is cached prompt tokens over all prompt tokens.

Skipped (returns {"skipped": reason}) when no SGLang environment exists (BATON_SGLANG_PYTHON, or
the project's .venv-sglang).
"""

from __future__ import annotations

import itertools
import random
import tempfile
from pathlib import Path

import anyio

from benchmarks._long_tail_env import LongTailFeedback
from stages.data.model import load_tokenizer, make_tiny_model, stop_token_ids
from stages.data.tasks import ReverseDigits
from stages.engines.base import SamplingParams
from stages.engines.sglang import SGLangEngine
from stages.engines.sglang_server import SGLangUnavailable, sglang_python
from stages.environments.render import renderer_for
from stages.rollout.episode import EpisodeLimits, EpisodeSetup, run_episode


class CountingEngine(SGLangEngine):
    """An SGLangEngine that adds up each response's prompt tokens and the part its prefix cache served."""

    prompt_tokens = 0
    cached_tokens = 0

    async def generate(self, prompts, params: SamplingParams):
        completions = await super().generate(prompts, params)
        for completion in completions:  # SGLangEngine reports what the server's prefix cache served
            self.prompt_tokens += completion.meta.get("prompt_tokens", 0)
            self.cached_tokens += completion.meta.get("cached_tokens", 0)
        return completions


class RoundRobin:
    """Looks like one engine to an episode; sends each call to the next engine in turn."""

    def __init__(self, engines: list[SGLangEngine]) -> None:
        self.engines, self._next = engines, itertools.cycle(engines)
        self.version = 0

    async def generate(self, prompts, params):
        return await next(self._next).generate(prompts, params)


async def _episodes(routing: str, engines: list[SGLangEngine], setup: EpisodeSetup, samples: list,
                    group_size: int) -> None:
    """All `samples` (groups of `group_size` alike) as concurrent episodes: sticky sends episode i and
    all its turns to the server of its group; round robin sends each engine call to the next server."""
    LongTailFeedback.reset()
    robin = RoundRobin(engines)
    async with anyio.create_task_group() as tg:
        for i, sample in enumerate(samples):
            engine = engines[(i // group_size) % len(engines)] if routing == "sticky" else robin
            tg.start_soon(run_episode, engine, sample, setup)


async def _measure(seed: int, groups: int, group_size: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="long-tail-sglang-") as tmp:
        return await _measure_in(Path(tmp), seed, groups, group_size)


async def _measure_in(folder: Path, seed: int, groups: int, group_size: int) -> dict:
    model = make_tiny_model(folder / "tiny")
    tokenizer = load_tokenizer(model)
    stops = stop_token_ids(tokenizer)
    task = ReverseDigits(digits=3)
    sampling = SamplingParams(max_new_tokens=task.max_new_tokens, temperature=1.0, top_p=1.0, stop_token_ids=stops)
    environment = lambda: LongTailFeedback(seed=seed, latency_min_s=0.001, latency_max_s=0.01)  # noqa: E731
    setup = EpisodeSetup(renderer_for(tokenizer, False, stops), environment, sampling, EpisodeLimits(max_turns=16))
    rng = random.Random(seed)
    samples = [s for s in (task.sample(rng) for _ in range(groups)) for _ in range(group_size)]
    figures = {}
    for routing in ("sticky", "round_robin"):
        engines = [CountingEngine(model, name=f"sglang-{routing}-{i}", log_dir=folder) for i in range(2)]
        try:
            async with anyio.create_task_group() as tg:  # fresh servers: nothing cached from the other routing
                for engine in engines:
                    tg.start_soon(engine.start)
            await _episodes(routing, engines, setup, samples, group_size)
        finally:
            for engine in engines:
                await engine.stop()
        prompt, cached = sum(e.prompt_tokens for e in engines), sum(e.cached_tokens for e in engines)
        figures[routing] = {"prompt_tokens": prompt, "cached_tokens": cached,
                            "hit_fraction": round(cached / prompt, 4) if prompt else float("nan")}
    return figures


def prefix_cache_figures(seed: int, groups: int = 8, group_size: int = 8) -> dict:
    """{"sticky": {...}, "round_robin": {...}}: prompt tokens, cached tokens and their fraction per routing."""
    try:
        sglang_python()
    except SGLangUnavailable as exc:
        return {"skipped": str(exc)}
    return anyio.run(_measure, seed, groups, group_size)
