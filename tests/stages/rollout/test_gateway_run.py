"""The gateway inside a run: `baton run` with `[gateway]` trains an agent written against the `openai`
package (examples/openai_agent.py) on the real engine, with the run's gate, ledger and store."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from stages.data.tasks import Prompt
from stages.environments.tokens import EpisodeTokens
from stages.gateway.host import OverBudget
from stages.rollout import Room
from stages.rollout.episode import Episode, EpisodeFailed
from stages.rollout.gateway_worker import RolloutHost
from tests import ROOT
from tests.helpers.engines import VLLM_MISSING
from tests.helpers.ledger_checks import check_ledger
from tests.helpers.runs import RUN_TIMEOUT_S, baton_run
from tools.make_math_example import make_math_data, make_qwen_like_model

# vLLM's CPU attention takes head sizes 32, 64, ... only: its model has 2 heads at hidden size 64; and vLLM refuses a
# prompt beyond the model's context (the agent's tool prompt alone is ~620 tokens of this tokenizer, its episodes
# grow per turn), where the torch engine runs past it
SHAPES = {"torch": {"hidden_size": 32, "layers": 1},
          "vllm": {"hidden_size": 64, "layers": 1, "heads": 2, "kv_heads": 1, "max_positions": 2048}}


@pytest.mark.slow
@pytest.mark.long  # CI time: in the long suite (tests/stages/gateway keeps the gateway in the suite)
@pytest.mark.parametrize(("engine", "crash"), [
    ("torch", False), ("torch", True),
    pytest.param("vllm", False, marks=[pytest.mark.vllm, pytest.mark.timeout(900),
                                       pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING)]),
], ids=["clean", "engine-crash", "vllm"])
def test_an_openai_agent_trains_through_the_gateway(tmp_path: Path, engine: str, crash: bool) -> None:
    model = make_qwen_like_model(tmp_path / "math-model", **SHAPES[engine])
    train, _ = make_math_data(tmp_path / "data", train=32, eval=8)
    faults = ["faults=[{kind='engine.crash', at=[4, 9]}]"] if crash else []
    s = baton_run(tmp_path, "agent-gateway.toml", "steps=3", f"model.path='{model}'", f"task.path='{train}'",
                  "task.max_new_tokens=16", "gateway.agents=64", "learner.groups_per_step=8",
                  f"engine.kind='{engine}'", *faults)
    run_dir = Path(s["run_dir"])
    assert s["version"] == 3 and s["ledger_balanced"]
    assert s["samples"]["trained"] == 3 * 8 * 4  # 64 agents at once; the gate admits 24 groups of 4
    served = json.loads((run_dir / f"gateway-{engine}-0.json").read_text())
    assert served["base_url"].startswith("http://127.0.0.1:")
    token = Path(served["token_file"])
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text().strip()) >= 32
    records = check_ledger(run_dir, bound=2)  # nothing trained twice, nothing lost uncounted
    assert sum(r["fate"] == "trained" for r in records) == s["samples"]["trained"]
    if crash:  # the agents heard 503 and resent (the openai client retries); each failure is a run event
        assert s["events"]["gateway.engine_failed"] == 2



async def broken_agent(sample, base_url: str, api_key: str) -> float:
    """An agent that fails before its first request (a user's bug)."""
    raise RuntimeError("agent bug: no such tool")


@pytest.mark.slow
@pytest.mark.long  # CI time: a whole run (the rule itself: tests/stages/rollout/test_episodes.py)
def test_a_gateway_run_whose_agents_always_fail_ends_naming_why(tmp_path: Path) -> None:
    """Every episode fails: the run ends with an error naming the agent's failure and the key, instead of
    dropping every group forever without training (what a gateway run whose prompts overflowed vLLM's context did)."""
    model = make_qwen_like_model(tmp_path / "math-model", **SHAPES["torch"])
    train, _ = make_math_data(tmp_path / "data", train=16, eval=4)
    sets = [f"run_root='{tmp_path}'", f"model.path='{model}'", f"task.path='{train}'", "steps=3",
            f"gateway.agent='{__name__}:broken_agent'", "gateway.agents=8", "rollout.max_failed_in_a_row=16"]
    proc = subprocess.run([sys.executable, "-m", "baton.cli", "run", str(ROOT / "configs" / "agent-gateway.toml"),
                           *(x for s in sets for x in ("--set", s))],
                          capture_output=True, text=True, cwd=ROOT, timeout=RUN_TIMEOUT_S)
    assert proc.returncode != 0
    assert "episodes in a row failed" in proc.stderr and "agent bug: no such tool" in proc.stderr, proc.stderr[-3000:]
    assert "rollout.max_failed_in_a_row" in proc.stderr


class Gate:
    def __init__(self, slots: int) -> None:
        self.slots = slots

    async def acquire_many(self, max_units: int) -> int:
        while not self.slots:
            await anyio.sleep(3600)
        self.slots -= 1
        return 1


class Worker:
    """What RolloutHost uses of a rollout worker."""

    def __init__(self, name: str, free: int, gate: Gate) -> None:
        self.engine = SimpleNamespace(name=name)
        self.maker = SimpleNamespace(failing=False)  # its groups' episodes do not all fail
        self.room, self.ctx = Room(free), SimpleNamespace(gate=gate)
        self.admitted, self.groups = 0, []
        self.prompts = SimpleNamespace(next=self._next_prompts, admit=self._admit)

    async def _next_prompts(self, n: int):
        return [Prompt(text=f"q{self.admitted}", answer="1")]

    def _admit(self, prompt) -> int:
        self.admitted += 1
        return self.admitted

    async def finish_outside_group(self, admission, prompt, results) -> None:
        self.groups.append((admission, prompt.text, results))


@pytest.mark.anyio
async def test_the_run_host_forms_groups_on_the_least_loaded_engine_and_refuses_over_budget() -> None:
    gate = Gate(slots=2)
    busy, idle = Worker("busy", 2, gate), Worker("idle", 8, gate)
    host = RolloutHost([busy, idle], group_size=2, stop_token_ids=(0,))
    first, second, third = await host.open(True), await host.open(True), await host.open(True)
    assert first.group == second.group != third.group and first.sample == second.sample
    assert first.id.startswith("idle.") and idle.room.free == 8 - 3, "new groups form on the engine with room"
    await host.open(True)  # the fourth fills the second group; the gate has no third slot
    with pytest.raises(OverBudget):
        await host.open(False)
    await host.finish(first.id, [EpisodeTokens([1, 2])], 1.0, None)
    await host.finish(second.id, [], None, "reward timeout")
    (admission, _, results), = idle.groups
    assert admission == 1 and isinstance(results[0], Episode) and results[0].reward == 1.0
    assert isinstance(results[1], EpisodeFailed) and results[1].reason == "reward timeout"
    assert idle.room.free == 8 - 2, "finished episodes give their room back"
