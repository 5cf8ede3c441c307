"""Every command the docs show runs, in a smoke form, through the real `baton` console script.

The commands are read from the docs and the README: every line of a code block and every code span that
starts with `baton ` or `python benchmarks/`, `python examples/`, `python tools/` (a script that exists).
Each gets the smoke form its kind has in `FORMS` (a command of a kind without one fails
`test_every_documented_command_has_a_smoke_form`, which is not `long`):

- `baton run CONFIG [--set ...]`: the documented line with `--set steps=2` and a run folder in a temporary
  directory; a config that needs the math example's model and data (`# needs: ... make_math_example.py`)
  gets the one the documented `make_math_example.py` command made; one on SGLang or vLLM is skipped, with
  the reason, where that server's environment does not exist.
- `baton run --resume RUN_DIR`: resumes a finished 6-version quickstart run from its end (version 6) to 8.
- `baton check ...`: as documented, expecting the exit code the docs show (2 for an invalid example).
- `baton faults ...`: the documented line with one fault kind (`engine.crash`) and one seed.
- `baton simulate ...`: the documented line with `--steps 20`; `--calibrate` reads a real quickstart run.
- `baton watch RUN_DIR`, `baton ledger RUN_DIR`: on a finished quickstart run.
- `baton export RUN_DIR OUT`: that run's latest checkpoint (its last version, 6), into a new folder.
- `baton mooncake-master`: started on a free port, its address read, stopped with SIGTERM (exit 0).
- `baton scale RUN_DIR --engines N`: on a quickstart run started with `rollout.max_engines = 2`, once it
  serves its control endpoint; the fleet must reach 2 live engines; the run is then stopped (SIGTERM).
- `baton serve MODEL_DIR`: on a tiny model folder, `--port 0`, until it writes its service.json and answers
  `healthz` with its key's folder holding a `tml-` key; stopped by SIGTERM (exit 0).
- `python benchmarks/...`: `--help` (each runs for minutes; their figures are in docs/results).
- `python examples/math_dsl.py`: really, 2 versions; `python examples/openai_agent.py`: `--help` (it needs a
  run serving the gateway; `configs/agent-gateway.toml` runs it in process).
- `python tools/make_math_example.py OUT [--tool-warmup N | --answer-warmup N]`: really, warm-ups of 2
  steps; `python tools/answer_positions.py probe RUN_DIR | fit ...`: really, small; `python
  tools/gen_reference.py`: `--check` (the bare form would rewrite the committed pages).

Subprocesses get this checkout first on PYTHONPATH, so the console script runs this tree's code, and show
their DeprecationWarnings: a command that sets one off from the project's own code (a moved module path,
tests/docs/deprecations.py) fails.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docs.deprecations import WARNINGS_ENV, project_deprecations_in
from tests.docs.pages import PAGES, ROOT, blocks, prose

PREFIX = re.compile(r"^(baton\s|python (benchmarks|examples|tools)/)")
SMOKE_SETS = ["--set", "steps=2", "--set", "telemetry.progress=false"]


@dataclass(frozen=True)
class Documented:
    """One command as the docs write it, the pages that show it, and the exit code they show for it."""

    line: str
    pages: tuple[str, ...]
    expect: int = 0

    @property
    def argv(self) -> list[str]:
        line = re.sub(r"\s*\[[^\]]*\]", "", self.line)  # `[--port N]`: optional, left out
        try:
            return shlex.split(line)
        except ValueError:  # a synopsis line: the command, then prose ("follow a run's progress")
            return line.split()

    @property
    def key(self) -> str | None:
        """The kind of command: `baton <subcommand>` (`baton run --resume`), or the script's path (with
        its subcommand for tools/answer_positions.py); None for a line that only looks like a command."""
        argv = self.argv
        if argv[0] == "baton":
            if len(argv) < 2 or argv[1] not in subcommands():
                return None
            return "baton run --resume" if argv[1:3] == ["run", "--resume"] else f"baton {argv[1]}"
        if len(argv) < 2 or not (ROOT / argv[1]).is_file():
            return None
        sub = argv[2] if len(argv) > 2 and argv[2] in ("fit", "probe") else ""  # tools/answer_positions.py
        return f"{argv[1]} {sub}".strip()


def subcommands() -> set[str]:
    from baton.cli import _parser

    parser = _parser()
    return {name for action in parser._actions if hasattr(action, "choices") and isinstance(action.choices, dict)
            for name in action.choices}


def command_lines(page: Path) -> list[tuple[str, int]]:
    """(command, exit code the page shows) for every command-looking line of the page. In a block that
    shows a session (`$ ` lines and their output) only the `$ ` lines are commands, and one whose output
    says the config is invalid exits 2."""
    found = []
    for block in blocks(page):
        lines = block.text.splitlines()
        if not any(line.startswith("$ ") for line in lines):
            found += [(line, 0) for line in lines]
            continue
        for i, line in enumerate(lines):
            if line.startswith("$ "):
                output = "\n".join(itertools.takewhile(lambda x: not x.startswith("$ "), lines[i + 1:]))
                found.append((line[2:], 2 if "is invalid" in output else 0))
    found += [(" ".join(span.split()), 0) for span in re.findall(r"`([^`]+)`", prose(page))]
    commands = []
    for text, expect in found:
        for part in text.split("&&"):
            part = part.split(" #")[0].strip()
            if PREFIX.match(part):
                commands.append((part, expect))
    return commands


def documented() -> list[Documented]:
    """Every documented command whose kind is known, each line once."""
    seen: dict[str, tuple[set[str], int]] = {}
    for page in PAGES:
        for line, expect in command_lines(page):
            pages, code = seen.setdefault(line, (set(), expect))
            pages.add(str(page.relative_to(ROOT)))
    commands = [Documented(line, tuple(sorted(pages)), code) for line, (pages, code) in sorted(seen.items())]
    return [c for c in commands if c.key is not None]


def concrete(command: Documented) -> bool:
    """Does the line say enough to be run (a config, or a run folder to stand in for)? `baton run`,
    `baton check CONFIG` and usage lines only name the command."""
    configs = [a for a in command.argv if a.endswith(".toml") and (ROOT / a).is_file()]
    if command.key in ("baton run", "baton check", "baton faults"):
        return bool(configs)
    if command.key == "baton simulate":
        return bool(configs) or any(a.startswith("runs/") for a in command.argv)  # a run to calibrate from
    return True


def cases() -> list[Documented]:
    """What to run: each concrete documented line of a kind whose smoke form follows the line (`BY_LINE`);
    for every other documented kind, or one the docs only name, one line of its own (`DEFAULTS`)."""
    commands = documented()
    runnable = [c for c in commands if c.key in BY_LINE and concrete(c)]
    others = sorted({c.key for c in commands} - {c.key for c in runnable})
    for key in others:
        pages = tuple(sorted({p for c in commands if c.key == key for p in c.pages}))
        runnable.append(Documented(DEFAULTS.get(key) or next(c.line for c in commands if c.key == key), pages))
    return runnable


FORMS = {
    "baton run": "steps=2, a temporary run folder",
    "baton run --resume": "resumes a finished 6-version run from its end (version 6) to 8",
    "baton check": "as documented",
    "baton faults": "one fault kind, one seed",
    "baton simulate": "--steps 20",
    "baton watch": "a finished run",
    "baton ledger": "a finished run",
    "baton export": "the latest checkpoint of a finished run, into a new folder",
    "baton mooncake-master": "started, its address read, stopped by SIGTERM",
    "baton scale": "a running quickstart that may grow to 2 engines: scaled to 2, waited for, then stopped",
    "baton serve": "a tiny model, --port 0: started, healthz answered, stopped by SIGTERM",
    "examples/math_dsl.py": "2 versions",
    "examples/openai_agent.py": "--help",
    "examples/tinker/sft.py": "--help",  # it needs the tinker SDK; tests/examples/test_tinker_examples.py runs it
    "examples/tinker/rl.py": "--help",
    "examples/tinker/dpo.py": "--help",
    "tools/make_math_example.py": "really; warm-ups of 2 steps",
    "tools/answer_positions.py": "--help",
    "tools/answer_positions.py probe": "a finished run, 16 samples",
    "tools/answer_positions.py fit": "2 digits, 3 steps",
    "tools/gen_reference.py": "--check",
}


BY_LINE = {"baton run", "baton check", "baton faults", "baton simulate", "tools/make_math_example.py"}
DEFAULTS = {  # the line a kind runs when its smoke form does not follow the documented line
    "baton run": "baton run configs/quickstart.toml",
    "baton check": "baton check configs/quickstart.toml",
    "baton faults": "baton faults configs/faults.toml",
    "baton simulate": "baton simulate configs/qwen7b-sim.toml",
    "baton watch": "baton watch RUN_DIR",
    "baton ledger": "baton ledger RUN_DIR",
    "baton export": "baton export RUN_DIR OUT",
    "baton run --resume": "baton run --resume RUN_DIR",
    "baton mooncake-master": "baton mooncake-master",
    "baton scale": "baton scale RUN_DIR --engines 2 --wait 120",
    "baton serve": "baton serve MODEL_DIR",
    "tools/answer_positions.py probe": "python tools/answer_positions.py probe RUN_DIR",
    "tools/answer_positions.py fit": "python tools/answer_positions.py fit",
    "tools/gen_reference.py": "python tools/gen_reference.py --check",
}


def form_of(key: str) -> str | None:
    return FORMS.get(key) or ("--help" if key.startswith("benchmarks/") else None)


DOCUMENTED = documented()
CASES = cases()


def test_every_documented_command_has_a_smoke_form() -> None:
    keys = {c.key for c in DOCUMENTED}
    assert {"baton run", "baton check", "baton simulate", "tools/make_math_example.py"} <= keys, "the reader broke"
    missing = sorted(f"{c.line} ({', '.join(c.pages)})" for c in DOCUMENTED if form_of(c.key) is None)
    assert not missing, f"documented commands with no smoke form in tests/docs/test_commands.py FORMS: {missing}"


# -- running them ---------------------------------------------------------------------------------------


def environment() -> dict[str, str]:
    """This checkout first on the path: the console script then runs this tree's code, not the installed one;
    DeprecationWarnings shown (`WARNINGS_ENV`), so that `ran` sees the project's."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "NO_MKDOCS_2_WARNING": "1", **WARNINGS_ENV}


def run(argv: list[str], cwd: Path = ROOT, timeout: float = 280) -> subprocess.CompletedProcess:
    program = shutil.which("baton") if argv[0] == "baton" else sys.executable
    assert program, "the `baton` console script is not installed (pip install -e .)"
    done = subprocess.run([program, *argv[1:]], cwd=cwd, env=environment(), capture_output=True, text=True,
                          timeout=timeout)
    return done


def ran(argv: list[str], expect: int = 0, **kwargs) -> subprocess.CompletedProcess:
    done = run(argv, **kwargs)
    assert done.returncode == expect, (
        f"`{shlex.join(argv)}` exited {done.returncode}, not {expect}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    deprecated = project_deprecations_in(done.stderr)
    assert not deprecated, f"`{shlex.join(argv)}` set off the project's own DeprecationWarning:\n" + "\n".join(
        deprecated)
    return done


def summary_of(done: subprocess.CompletedProcess) -> dict:
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("commands")


@pytest.fixture(scope="module")
def math_example(work: Path) -> Path:
    """What `python tools/make_math_example.py runs/math-example` makes, made by it."""
    ran(["python", "tools/make_math_example.py", str(work / "math-example")], timeout=280)
    return work / "math-example"


def quickstart(work: Path, name: str) -> Path:
    folder = work / name
    done = ran(["baton", "run", "configs/quickstart.toml", "--set", "steps=6", "--set", "checkpoint.every=2",
                "--set", f"run_root={json.dumps(str(folder))}", "--set", "telemetry.progress=false"])
    return Path(summary_of(done)["run_dir"])


@pytest.fixture(scope="module")
def finished_run(work: Path) -> Path:
    return quickstart(work, "finished")


def needs_server_environment(argv: list[str]) -> None:
    """A command on SGLang or vLLM is skipped, with the reason, where that server's environment is missing."""
    config = next((a for a in argv if a.endswith(".toml")), None)
    text = " ".join(argv) + ((ROOT / config).read_text() if config else "")
    if re.search(r"""kind\s*=\s*['"]*sglang""", text):
        from stages.engines.sglang_server import SGLangUnavailable, sglang_python

        try:
            sglang_python()
        except SGLangUnavailable as exc:
            pytest.skip(f"no SGLang server environment: {exc}")
    if re.search(r"""kind\s*=\s*['"]*vllm""", text):
        from stages.engines.vllm_server import VLLMUnavailable, vllm_python

        try:
            vllm_python()
        except VLLMUnavailable as exc:
            pytest.skip(str(exc))  # it names what is missing


def with_made_example(argv: list[str], example: Path) -> list[str]:
    """A config that needs the math example's model and data gets the one made here."""
    config = ROOT / next(a for a in argv if a.endswith(".toml"))
    if "make_math_example.py" not in "".join(re.findall(r"^# needs: .*$", config.read_text(), re.M)):
        return argv
    paths = {"model.path": example / "model", "task.path": example / "data" / "train.jsonl",
             "task.eval_path": example / "data" / "eval.jsonl"}
    sets = [x for key, path in paths.items() for x in ("--set", f"{key}={json.dumps(str(path))}")]
    return argv + sets


def substitute(argv: list[str], values: dict[str, str]) -> list[str]:
    return [values.get(a, a) for a in argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smoke_baton(command: Documented, request) -> None:
    argv, work = command.argv, request.getfixturevalue("work")
    runs = ["--set", f"run_root={json.dumps(str(work / 'runs'))}"]
    if command.key == "baton run":
        needs_server_environment(argv)
        ran(with_made_example(argv, request.getfixturevalue("math_example")) + SMOKE_SETS + runs)
    elif command.key == "baton run --resume":
        resumable = quickstart(work, "resumable")  # finished: its last version (6) is checkpointed; train on to 8
        done = ran(substitute(argv, {"RUN_DIR": str(resumable)}) + ["--set", "telemetry.progress=false",
                                                                     "--set", "steps=8"])
        assert summary_of(done)["resume"]["from_version"] == 6
    elif command.key == "baton check":
        ran(argv, expect=command.expect)
    elif command.key == "baton faults":
        kept, skip = [], False
        for a in argv:  # the documented kinds and seeds give way to one kind, one seed
            if skip or a in ("--kinds", "--seeds"):
                skip = not skip
                continue
            kept.append(a)
        # 60 versions, not the config's 40: its reward-rise check (+0.02) then holds on a loaded machine too
        # (40 versions rose +0.028 on a quiet one, +0.013 on one loaded by a benchmark beside the suite)
        ran(kept + ["--kinds", "engine.crash", "--seeds", "1", "--set", "steps=60"] + runs, timeout=290)
    elif command.key == "baton simulate":
        calibrated = {a: str(request.getfixturevalue("finished_run")) for a in argv if a.startswith("runs/")}
        ran(substitute(argv, calibrated) + ["--steps", "20"] + runs)
    elif command.key in ("baton watch", "baton ledger"):
        done = ran(substitute(argv, {"RUN_DIR": str(request.getfixturevalue("finished_run"))}))
        assert done.stdout.strip()
    elif command.key == "baton export":
        out = work / f"export-{uuid.uuid4().hex[:8]}"
        done = ran(substitute(argv, {"RUN_DIR": str(request.getfixturevalue("finished_run")), "OUT": str(out)}))
        assert summary_of(done)["version"] == 6 and (out / "config.json").is_file()
    elif command.key == "baton mooncake-master":
        smoke_mooncake_master(argv)
    elif command.key == "baton scale":
        smoke_scale(argv, work)
    elif command.key == "baton serve":
        smoke_serve(argv, work)


def smoke_serve(argv: list[str], work: Path) -> None:
    """The documented line on a tiny model folder with `--port 0` and its own folder, until it writes its
    service.json and answers healthz; then SIGTERM, which it exits 0 from."""
    from urllib.request import urlopen

    from stages.data.model import make_tiny_model

    model, folder = make_tiny_model(work / "serve-model"), work / f"serve-{uuid.uuid4().hex[:8]}"
    line = substitute(argv, {"MODEL_DIR": str(model)}) + ["--port", "0", "--dir", str(folder)]
    serving = subprocess.Popen([shutil.which("baton"), *line[1:]], cwd=ROOT, env=environment(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (folder / "service.json").exists() and time.monotonic() < deadline and serving.poll() is None:
            time.sleep(0.2)
        info = json.loads((folder / "service.json").read_text())
        assert Path(info["key_file"]).read_text().startswith("tml-")
        with urlopen(f"{info['base_url']}/api/v1/healthz", timeout=30) as answer:
            assert json.loads(answer.read())["status"] == "ok"
    finally:
        serving.send_signal(signal.SIGTERM)
        code = serving.wait(timeout=60)
    assert code == 0, serving.stderr.read()


def smoke_scale(argv: list[str], work: Path) -> None:
    """A quickstart that may grow to 2 engines, running; the documented line once it serves its control
    endpoint (control.json); then the run is stopped by SIGTERM."""
    root = work / f"elastic-{uuid.uuid4().hex[:8]}"
    running = subprocess.Popen(
        [shutil.which("baton"), "run", "configs/quickstart.toml", "--set", "rollout.max_engines=2", "--set",
         f"run_root={json.dumps(str(root))}", "--set", "telemetry.progress=false"], cwd=ROOT, env=environment(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(root.glob("*/control.json")) and time.monotonic() < deadline and running.poll() is None:
            time.sleep(0.2)
        run_dir = next(iter(root.glob("*/control.json"))).parent
        done = ran(substitute(argv, {"RUN_DIR": str(run_dir)}))
        assert json.loads(done.stdout.strip().splitlines()[-1])["live"] == 2
    finally:
        running.send_signal(signal.SIGTERM)
        running.wait(timeout=120)


def smoke_mooncake_master(argv: list[str]) -> None:
    port = free_port()
    master = subprocess.Popen([shutil.which("baton"), *argv[1:], "--port", str(port)], env=environment(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = json.loads(master.stdout.readline())
        assert started["master"].endswith(f":{port}")
        said = []
        for line in master.stderr:  # the master's own log lines may come first
            said.append(line)
            if "Ctrl-C stops it" in line:
                break
        assert "Ctrl-C stops it" in said[-1], said
        time.sleep(2.0)  # `baton mooncake-master` takes over SIGTERM only after saying so
    finally:
        master.send_signal(signal.SIGTERM)
        code = master.wait(timeout=60)
    assert code == 0, master.stderr.read()


def smoke_script(command: Documented, request) -> None:
    argv, work, key = command.argv, request.getfixturevalue("work"), command.key
    if form_of(key) == "--help":
        assert "usage:" in ran([argv[0], argv[1], "--help"]).stdout
    elif key == "examples/math_dsl.py":
        example = request.getfixturevalue("math_example")
        ran(["python", str(ROOT / argv[1]), str(example), "2"], cwd=work)
    elif key == "tools/make_math_example.py":
        smaller = {"150": "2", "300": "2"}  # warm-up steps
        out = str(work / "made" / Path(argv[2]).name)
        ran([*argv[:2], out, *substitute(argv[3:], smaller)])
    elif key == "tools/answer_positions.py probe":
        ran([*argv[:3], str(request.getfixturevalue("finished_run")), "--samples", "16"])
    elif key == "tools/answer_positions.py fit":
        ran([*argv[:3], "--digits", "2", "--steps", "3"])
    elif key == "tools/gen_reference.py":
        ran([*argv[:2], "--check"])


# Documented runs whose whole path a `long` test already runs (on a real SGLang server, or the same config on a
# Ray cluster): their smoke forms (a minute each, mostly a server's or a cluster's start) run nightly, not in CI's
# `long` suite (its 45 minutes).
COVERED_BY_LONG = {
    "baton run configs/ray-mooncake.toml": "tests/e2e/test_multi_node.py (the config's whole run, two ranks, three "
                                           "nodes) and tests/e2e/test_mooncake_pipeline.py (its master's lifetime)",
    "baton run configs/sglang-cpu.toml": "tests/stages/engines/test_sglang.py::test_sglang_run_learns",
    "baton run configs/quickstart-moe.toml --set engine.kind=sglang":
        "tests/stages/engines/test_sglang_moe.py::test_a_short_moe_run_with_routing_replay_on_sglang",
}


def tier(command: Documented) -> pytest.MarkDecorator:
    """`nightly` for a documented run another long test covers (COVERED_BY_LONG), else `long`."""
    covered = any(command.line.startswith(line) for line in COVERED_BY_LONG)
    return pytest.mark.nightly if covered else pytest.mark.long


@pytest.mark.timeout(900)
@pytest.mark.parametrize("command", [pytest.param(c, marks=tier(c)) for c in CASES], ids=[c.line[:90] for c in CASES])
def test_documented_command_runs(command: Documented, request) -> None:
    if command.argv[0] == "baton":
        smoke_baton(command, request)
    else:
        smoke_script(command, request)
