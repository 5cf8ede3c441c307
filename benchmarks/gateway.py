"""Samples/s of one multi-turn chat workload driven through the gateway by real `openai` clients and
driven directly through the host's `generate`, in one run, and the gateway's added latency per request.

The workload: `--concurrency` (64) episodes at a time, `--episodes` in all per path; each episode is
the tool task's chat (`configs/agent-tools.toml`, `examples/openai_agent.py`): the calculator's system
prompt and tool schema (`--tools`, the default; ~660 prompt tokens) and a word problem, then `--turns`
model turns (`--max-tokens` each, 64 like the example agent; temperature 1) on the byte-level BPE chat
model of tools/make_math_example.py, the user asking a fixed follow-up after each answer (a random-init
model makes no valid tool call to run). `--no-tools --max-tokens 16` is the stress shape: short prompts
and turns, where the per-request costs outside the engine weigh most. Both paths
do the same token work through the same `EngineHost` over the same started TorchEngine(s):
- direct: open through the host, render the prompt (`ChatRenderer.prompt_ids`), `host.generate`,
  append the reply (`reply_ids`) to the episode's `EpisodeTokens`, finish through the host;
- gateway: one `AsyncOpenAI` client per episode on its episode base URL: open over HTTP,
  `chat.completions.create` per turn with the whole conversation, post the reward.
The agents run in `--agent-procs` processes of their own, as outside agents do, and (`--pin`, the
default) on CPUs of their own: the run's process gets the first half of the CPUs on both paths, the
agents the other half. Outside agents run on their own machines; on a laptop they would otherwise
take CPU from the engine, since the openai client's own work (building requests, parsing responses:
~3 ms per request here) costs more than the gateway's (~0.7 ms). The CPU seconds of the run's
process per sample on each path (`run_cpu_ms_per_sample_*`) and of the agents are reported too.
The two paths alternate (`--rounds` of direct then gateway) so drift in the machine's load hits both.
Added latency (`added_latency_ms_*`): a chat request's time in the gateway (from its body read to its
response made) minus the host's `generate` time for it; `client_seen_added_ms_*`: the same from the
agent's side (adds HTTP, both processes' scheduling and the client's own work).

Prints a table to stderr and, as the last stdout line, one JSON object:
{"figures": {...}, "ratios": {"gateway_vs_direct": samples/s through the gateway over direct}}.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openai import AsyncOpenAI, DefaultAsyncHttpxClient  # noqa: E402

from stages.data.model import load_tokenizer  # noqa: E402
from stages.data.tasks import Prompt  # noqa: E402
from stages.engines.torch import TorchEngine  # noqa: E402
from stages.environments.calculator import CALCULATOR, SYSTEM_PROMPT  # noqa: E402
from stages.environments.render import ChatRenderer  # noqa: E402
from stages.environments.tokens import EpisodeTokens  # noqa: E402
from stages.gateway import EngineHost, Gateway, Limits  # noqa: E402
from tools.make_math_example import make_math_data, make_qwen_like_model  # noqa: E402

FOLLOW_UP = {"role": "user", "content": "Check that again and give the number."}
KEY = "benchmark-key"


class MathQuestions:
    """The math example's word problems as chat samples."""

    name, max_new_tokens = "math-questions", 16

    def __init__(self, rows: list[dict], tools: bool) -> None:
        self.rows, self.system = rows, [{"role": "system", "content": SYSTEM_PROMPT}] if tools else []

    def sample(self, rng) -> Prompt:
        row = rng.choice(self.rows)
        return Prompt(row["question"], row["answer"],
                      messages=[*self.system, {"role": "user", "content": row["question"]}])


class TimedHost(EngineHost):
    """An EngineHost that keeps each request's generate time per episode, in order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.generate_s: dict[str, list[float]] = {}

    async def generate(self, episode_id, prompt_ids, params):
        t0 = time.perf_counter()
        completion = await super().generate(episode_id, prompt_ids, params)
        self.generate_s.setdefault(episode_id, []).append(time.perf_counter() - t0)
        return completion


async def direct_episode(host: TimedHost, renderer: ChatRenderer, args) -> None:
    from stages.engines.base import SamplingParams

    opened = await host.open(wait=True)
    params = SamplingParams(args.max_tokens, 1.0, 1.0, renderer.stop_ids)
    tools = (CALCULATOR,) if args.tools else ()
    tokens = EpisodeTokens(renderer.prompt_ids(opened.sample.messages, tools))
    for turn in range(args.turns):
        completion = await host.generate(opened.id, tokens.ids(), params)
        tokens.add_model(completion)
        renderer.turn(completion.tokens, completion.finish_reason, tools)
        if turn + 1 < args.turns:
            tokens.add_env(renderer.reply_ids([FOLLOW_UP], renderer.ended_on_stop(completion.tokens)))
    await host.finish(opened.id, [tokens], 0.0, None)


async def gateway_episode(base_url: str, key: str, http: aiohttp.ClientSession, client: DefaultAsyncHttpxClient,
                          args, seen_s: dict) -> None:
    """One episode as an outside agent runs it: open, `--turns` chat requests, post the reward."""
    async with http.post(f"{base_url}/episodes") as response:
        opened = await response.json()
    agent = AsyncOpenAI(base_url=opened["base_url"], api_key=key, max_retries=0, http_client=client)
    messages = list(opened["sample"]["messages"])
    tools = {"tools": [CALCULATOR.schema()]} if args.tools else {}
    for _ in range(args.turns):
        t0 = time.perf_counter()
        reply = await agent.chat.completions.create(model="baton", messages=messages, max_tokens=args.max_tokens,
                                                    **tools)
        seen_s.setdefault(opened["id"], []).append(time.perf_counter() - t0)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), FOLLOW_UP]
    async with http.post(f"{base_url}/episodes/{opened['id']}/reward", json={"reward": 0.0}) as response:
        assert response.status == 200, await response.text()


async def agent_process(args) -> None:
    """An agent process: for each "go" line on stdin, run `--episodes` episodes `--concurrency` at a
    time against the gateway at `--agent-of`, then print the client-seen request times as JSON."""
    key = os.environ["BATON_GATEWAY_KEY"]
    if os.environ.get("BATON_AGENT_CPUS"):
        os.sched_setaffinity(0, {int(c) for c in os.environ["BATON_AGENT_CPUS"].split(",")})
    headers = {"Authorization": f"Bearer {key}"}
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0)) as http, \
            DefaultAsyncHttpxClient() as client:
        print("ready", flush=True)
        while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "go":
            seen_s: dict[str, list[float]] = {}
            cpu = time.process_time()
            await pool(functools.partial(gateway_episode, args.agent_of, key, http, client, args, seen_s),
                       args.episodes, args.concurrency)
            print(json.dumps({"seen_s": seen_s, "cpu_s": time.process_time() - cpu}), flush=True)


async def pool(make_episode, episodes: int, concurrency: int) -> float:
    """Run `episodes` episodes, `concurrency` at a time; the seconds it took."""
    left = iter(range(episodes))

    async def worker() -> None:
        for _ in left:
            await make_episode()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0


class TimedGateway(Gateway):
    """A Gateway that keeps, per episode and in order, each chat request's time in the gateway: from
    its body read (the agent's sending is not the gateway's time) to its response made."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handled_s: dict[str, list[float]] = {}

    async def _body(self, request, kind):
        body = await super()._body(request, kind)
        request["read_at"] = time.perf_counter()
        return body

    async def _chat(self, request):
        response = await super()._chat(request)
        spent = time.perf_counter() - request["read_at"]
        self.handled_s.setdefault(request.match_info["episode"], []).append(spent)
        return response


async def start_agents(args, gateway: Gateway) -> list[asyncio.subprocess.Process]:
    """`--agent-procs` agent processes, each running its share of the episodes, ready to go."""
    agents = []
    for i in range(args.agent_procs):
        episodes, concurrency = (total // args.agent_procs + (i < total % args.agent_procs)
                                 for total in (args.episodes, args.concurrency))
        agents.append(await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--agent-of", gateway.base_url, "--episodes", str(episodes),
            "--concurrency", str(concurrency), "--turns", str(args.turns),
            "--max-tokens", str(args.max_tokens), "--tools" if args.tools else "--no-tools",
            env={**os.environ, "BATON_GATEWAY_KEY": KEY},
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE))
    for agent in agents:
        assert (await agent.stdout.readline()).strip() == b"ready"
    return agents


async def run_agents(agents: list[asyncio.subprocess.Process], seen_s: dict, cpu_s: dict) -> float:
    """One round of the agents; the seconds it took (`seen_s`, `cpu_s["agents"]` get their reports)."""
    t0 = time.perf_counter()
    for agent in agents:
        agent.stdin.write(b"go\n")
    for agent in agents:
        report = json.loads(await agent.stdout.readline())
        seen_s.update(report["seen_s"])
        cpu_s["agents"] += report["cpu_s"]
    return time.perf_counter() - t0


async def timed(path: str, seconds: dict, cpu_s: dict, work, engines: list, passes: dict) -> None:
    """Run `work`, adding its wall seconds, this process's CPU seconds (all threads) and the engines'
    forward passes of each kind under `path`."""
    cpu = time.process_time()
    before = [dict(engine.stats) for engine in engines]
    seconds[path] += await work
    cpu_s[path] += time.process_time() - cpu
    for engine, counts in zip(engines, before, strict=True):
        for kind in ("prefills", "decode_steps"):
            passes[f"{kind}_{path}"] += engine.stats[kind] - counts[kind]


async def run(args, model: Path, rows: list[dict]) -> dict:
    tokenizer = load_tokenizer(model)
    renderer = ChatRenderer(tokenizer)
    engines = [TorchEngine(model, name=f"torch-{i}", seed=i) for i in range(args.engines)]
    for engine in engines:
        await engine.start()
    host = TimedHost(engines, MathQuestions(rows, args.tools), group_size=4, max_open=args.concurrency, seed=args.seed)
    gateway = TimedGateway(host, KEY, limits=Limits(max_tokens=args.max_tokens), tokenizer=tokenizer)
    await gateway.start()
    agents = await start_agents(args, gateway)
    seconds = {"direct": 0.0, "gateway": 0.0}
    cpu_s = {"direct": 0.0, "gateway": 0.0, "agents": 0.0}
    seen_s: dict[str, list[float]] = {}
    passes: Counter[str] = Counter()
    try:
        await pool(lambda: direct_episode(host, renderer, args), args.concurrency, args.concurrency)  # warm-up
        for _ in range(args.rounds):
            direct = pool(lambda: direct_episode(host, renderer, args), args.episodes, args.concurrency)
            await timed("direct", seconds, cpu_s, direct, engines, passes)
            await timed("gateway", seconds, cpu_s, run_agents(agents, seen_s, cpu_s), engines, passes)
    finally:
        for agent in agents:
            agent.stdin.close()
            await agent.wait()
        await gateway.stop()
    samples = args.episodes * args.rounds
    assert len(seen_s) == samples and all(c == 1 for c in host.finish_calls.values())
    return {
        "samples_per_s_direct": samples / seconds["direct"],
        "samples_per_s_gateway": samples / seconds["gateway"],
        "requests": sum(len(t) for t in seen_s.values()),
        "run_cpu_ms_per_sample_direct": 1e3 * cpu_s["direct"] / samples,
        "run_cpu_ms_per_sample_gateway": 1e3 * cpu_s["gateway"] / samples,
        "agent_cpu_ms_per_sample": 1e3 * cpu_s["agents"] / samples,
        **_latencies("added_latency_ms", gateway.handled_s, host.generate_s),
        **_latencies("client_seen_added_ms", seen_s, host.generate_s),
        "gateway_segments": gateway.stats["segments"],
        **{f"engine_{kind}_per_sample": count / samples for kind, count in sorted(passes.items())},
    }


def _latencies(name: str, total_s: dict[str, list[float]], generate_s: dict[str, list[float]]) -> dict[str, float]:
    """Median and p99 of (a request's time - its generate time) over every gateway request, in ms."""
    added = sorted(1e3 * (t - generate_s[episode][i]) for episode, times in total_s.items()
                   for i, t in enumerate(times))
    p99 = added[min(len(added) - 1, int(0.99 * len(added)))]
    return {f"{name}_median": statistics.median(added), f"{name}_p99": p99}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=128, help="episodes per path per round")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tools", action=argparse.BooleanOptionalAction, default=True,
                        help="the calculator's system prompt and tool schema in every request (the tool task)")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--agent-procs", type=int, default=2, help="processes the openai agents run in")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="run's process on half the CPUs, agent processes on the other half")
    parser.add_argument("--agent-of", help=argparse.SUPPRESS)  # run as an agent process of this gateway
    args = parser.parse_args(argv)
    if args.agent_of:
        asyncio.run(agent_process(args))
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) >= 2:  # the run's process on the first half of the CPUs, the agents on the rest
        os.sched_setaffinity(0, cpus[: len(cpus) // 2])
        os.environ["BATON_AGENT_CPUS"] = ",".join(map(str, cpus[len(cpus) // 2:]))
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_qwen_like_model(Path(tmp) / "model", seed=args.seed)
        train, _ = make_math_data(Path(tmp) / "data", train=200, eval=10, seed=args.seed)
        rows = [json.loads(line) for line in train.read_text().splitlines()]
        figures = asyncio.run(run(args, model, rows))
    figures.update(load_average_1m=os.getloadavg()[0], run_cpus=len(os.sched_getaffinity(0)),
                   episodes=args.episodes * args.rounds, concurrency=args.concurrency, turns=args.turns,
                   max_tokens=args.max_tokens, tools=args.tools, engines=args.engines)
    ratios = {"gateway_vs_direct": figures["samples_per_s_gateway"] / figures["samples_per_s_direct"],
              "run_cpu_gateway_vs_direct": figures["run_cpu_ms_per_sample_gateway"]
              / figures["run_cpu_ms_per_sample_direct"]}
    for name, value in figures.items():
        print(f"{name:>30}: {value:.3f}" if isinstance(value, float) else f"{name:>30}: {value}", file=sys.stderr)
    for name, value in ratios.items():
        print(f"{'ratios.' + name:>30}: {value:.3f}", file=sys.stderr)
    outcome = {"figures": figures, "ratios": ratios}
    print(json.dumps(outcome))
    return outcome


if __name__ == "__main__":
    main()
