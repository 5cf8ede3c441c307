"""The CLI: config errors each name the key, the value and the fix, and nothing starts; a kill reaches a
run as Ctrl-C does."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from baton.builder import make_part
from baton.cli import _sigterm_as_ctrl_c, _take_ctrl_c_back, main
from baton.config import ConfigError, apply_override, load_toml, resolve, validate
from baton.schema import RunConfig

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.toml"


def check(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("learner.lrr=1e-3", "unknown key 'learner.lrr'"),
        ("stepz=3", "unknown key 'stepz'"),
        ("learner.lr=-1", "learner.lr = -1: Input should be greater than 0"),
        ("task.kind=nope", "task.kind = \"nope\": unknown kind; allowed: 'reverse-digits', 'addition'"),
        ("staleness.on_stale=later", "staleness.on_stale = \"later\": Input should be 'drop' or 'requeue'"),
        ("mode=sync", "mode = 'sync' means staleness.k = 0, but staleness.k = 2"),
        ("steps=many", "steps = \"many\": Input should be a valid integer"),
        ("store.capacity='12 parsecs'", "store.capacity = \"12 parsecs\""),
        ("task.digits=99", "task.digits = 99: Input should be less than or equal to 16"),
    ],
)
def test_bad_values_are_named(capsys, override: str, expected: str) -> None:
    code, out, err = check(capsys, str(QUICKSTART), "--set", override)
    assert code == 2
    assert out == ""
    assert expected in err, err


def test_missing_model_folder(capsys, tmp_path: Path) -> None:
    code, _, err = check(
        capsys, str(QUICKSTART), "--set", f"model.path='{tmp_path / 'nope'}'", "--set", "model.create=false"
    )
    assert code == 2
    assert "holds no model" in err and "model.create = true" in err


def test_missing_config_file(capsys, tmp_path: Path) -> None:
    code, _, err = check(capsys, str(tmp_path / "absent.toml"))
    assert code == 2 and "does not exist" in err


def test_malformed_toml(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n[learner\n")
    code, _, err = check(capsys, str(bad))
    assert code == 2 and "not valid TOML" in err


def test_check_prints_the_resolved_config(capsys) -> None:
    code, out, _ = check(capsys, str(QUICKSTART), "--set", "learner.lr=1e-3")
    assert code == 0
    resolved = validate(RunConfig, __import__("tomllib").loads(out))
    assert resolved.learner.lr == 1e-3
    assert resolved.staleness.k == 2


def test_sync_mode_defaults_k_to_zero(tmp_path: Path) -> None:
    cfg = validate(RunConfig, {"mode": "sync"})
    assert cfg.staleness.k == 0
    assert validate(RunConfig, {}).staleness.k == 2


def test_overrides_parse_toml_values() -> None:
    data: dict = {}
    apply_override(data, "learner.lr=1e-3")
    apply_override(data, "name=plain-string")
    apply_override(data, "engine.count=2")
    assert data == {"learner": {"lr": 1e-3}, "name": "plain-string", "engine": {"count": 2}}
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_override(data, "novalue")


def test_plugin_kinds_resolve_by_dotted_path() -> None:
    cfg = validate(RunConfig, {"task": {"kind": "stages.data.tasks:ReverseDigits", "digits": 3}})
    task = make_part("task", cfg)
    assert type(task).__name__ == "ReverseDigits" and task.digits == 3
    with pytest.raises(ConfigError, match="cannot import"):
        resolve("no_such_module:Thing")
    with pytest.raises(ConfigError, match="has no 'Nope'"):
        resolve("stages.data.tasks:Nope")


def test_quickstart_configs_are_valid() -> None:
    for name in ("quickstart.toml", "quickstart-sync.toml", "quickstart-lora.toml", "quickstart-mooncake.toml",
                 "ray-mooncake.toml"):
        validate(RunConfig, load_toml(ROOT / "configs" / name))


def test_sglang_engine_without_a_server_environment_names_the_key_and_the_fix(capsys) -> None:
    config = str(ROOT / "configs" / "sglang-cpu.toml")
    code, _, err = check(capsys, config, "--set", "engine.python='/nonexistent/python'")
    assert code == 2
    assert "engine.python = '/nonexistent/python' does not exist" in err and "tools/sglang-cpu/install.sh" in err


@pytest.mark.parametrize("transport", ["inproc", "mooncake_p2p", "disk", "delta", "broadcast"])
def test_each_weight_transport_builds_from_config(transport: str, tmp_path: Path) -> None:
    from baton.builder import build_pipeline

    data = load_toml(QUICKSTART)
    data.update(run_root=str(tmp_path), runtime="ray" if transport == "broadcast" else "local")
    data["store"] = {"kind": "ray"} if transport == "broadcast" else data["store"]
    data["weights"] = {"transport": transport}
    data["model"]["path"] = str(tmp_path / "model")
    learner = build_pipeline(validate(RunConfig, data)).consumer
    built = learner.weights if isinstance(learner.weights, str) else learner.weights.name
    assert built == transport


def test_broadcast_needs_engine_processes(capsys) -> None:
    code, _, err = check(capsys, str(QUICKSTART), "--set", "weights.transport='broadcast'")
    assert code == 2 and "use weights.transport = 'inproc' or runtime = 'ray'" in err


def test_sglang_urls_and_count_must_agree(capsys) -> None:
    code, _, err = check(
        capsys, str(ROOT / "configs" / "sglang-cpu.toml"),
        "--set", "engine.urls=['http://127.0.0.1:30000']", "--set", "engine.count=2",
    )
    assert code == 2 and "engine.urls has 1 entries but engine.count = 2" in err


def test_console_script_reports_config_errors() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "baton.cli", "run", str(QUICKSTART), "--set", "learner.lr=0"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert proc.returncode == 2
    assert "learner.lr = 0" in proc.stderr
    assert proc.stdout == ""


def test_sigterm_reaches_a_running_loop_as_cancellation_like_ctrl_c() -> None:
    """`baton run`'s SIGTERM handler cancels the run's main task (asyncio's Ctrl-C path), so the run sees
    CancelledError where it awaits, and `anyio.run` then raises KeyboardInterrupt; a KeyboardInterrupt
    raised at whatever line the signal lands on could land in a weakref callback, which drops it."""
    seen: list[type[BaseException]] = []

    async def run() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await anyio.sleep(30)
        except BaseException as exc:
            seen.append(type(exc))
            raise

    previous = signal.getsignal(signal.SIGINT), signal.signal(signal.SIGTERM, _sigterm_as_ctrl_c)
    _take_ctrl_c_back()  # `stop_on_sigterm`'s first step, without its escalation thread
    try:
        with pytest.raises(KeyboardInterrupt):
            anyio.run(run)
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
    assert seen == [asyncio.CancelledError]


STUBBORN_RUN = """
import os, signal, anyio
import baton.cli as cli
cli.SIGTERM_GRACE_S = cli.SIGTERM_REPEAT_S = 0.5
cli.stop_on_sigterm()

async def stubborn():  # swallows every cancellation: an orderly stop that never ends
    while True:
        try:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(3600)
        except BaseException:
            pass

async def main():
    async with anyio.create_task_group() as tg:
        tg.start_soon(stubborn)
        await anyio.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)
        await anyio.sleep(3600)

try:
    anyio.run(main)
except KeyboardInterrupt:
    raise SystemExit(130)
"""


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["foreground", "background-job"])
def test_a_kill_ends_a_run_whose_orderly_stop_hangs(sigint_ignored: bool) -> None:
    """Past the grace after SIGTERM, `baton run` interrupts itself again (Ctrl-C twice), and again, until
    the run is gone; a stop that swallows every cancellation still ends. Also when the run was started with
    SIGINT ignored, as a non-interactive shell starts a background job (`baton run ... &` in a script)."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    proc = subprocess.run([sys.executable, "-c", STUBBORN_RUN], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, preexec_fn=ignore)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "interrupting again" in proc.stderr
