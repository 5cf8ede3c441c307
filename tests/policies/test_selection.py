"""policies.selection (admit / evict / select, the replay window) and policies.bounds (the static check),
as pure functions; and the check wired into config validation (`baton check` refuses before anything runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.cli import main
from baton.config import ConfigError, load_toml, validate
from baton.schema import RunConfig
from policies.bounds import PipelineShape, check
from policies.selection import Candidate, Fifo, Freshest, ReplayWindow, Uniform, has_signal, make_selection
from policies.staleness import MaxStaleness

ROOT = Path(__file__).resolve().parents[2]

CANDIDATES = [Candidate(version=3, uses=0, arrival=5), Candidate(version=5, uses=1, arrival=2),
              Candidate(version=5, uses=0, arrival=9), Candidate(version=4, uses=0, arrival=1)]


def test_fifo_takes_in_arrival_order() -> None:
    assert Fifo().select(CANDIDATES, version=6, n=3) == [3, 1, 0]


def test_freshest_takes_newest_version_then_fewest_uses() -> None:
    assert Freshest().select(CANDIDATES, version=6, n=3) == [2, 1, 3]


def test_uniform_is_seeded_distinct_and_within_the_candidates() -> None:
    picks = [Uniform(seed=1).select(CANDIDATES, 6, 2) for _ in range(2)]
    assert picks[0] == picks[1]  # same seed, same calls: same picks
    stream = Uniform(seed=1)
    seen = {tuple(stream.select(CANDIDATES, 6, 2)) for _ in range(40)}
    assert len(seen) > 3  # it does move (12 ordered pairs exist)
    for pair in seen:
        assert len(set(pair)) == 2 and all(0 <= i < len(CANDIDATES) for i in pair)
    assert sorted(Uniform(seed=3).select(CANDIDATES, 6, 10)) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("rewards", "signal"), [([0, 0, 0], False), ([1.0, 1.0], False), ([0, 0.5], True), ([], False)]
)
def test_a_group_has_signal_iff_its_rewards_differ(rewards, signal) -> None:
    assert has_signal(rewards) is signal
    assert Fifo(drop_zero_signal=True).admit(rewards) is signal
    assert Fifo(drop_zero_signal=False).admit(rewards)  # the filter is opt-in


def test_filter_budget() -> None:
    policy = Fifo(drop_zero_signal=True, max_filtered_batches=2)
    assert not policy.gave_up(filtered=8, groups_per_step=4)
    assert policy.gave_up(filtered=9, groups_per_step=4)


def test_make_selection_and_bad_options() -> None:
    assert isinstance(make_selection("freshest", max_reuse=2, seed=4), Freshest)
    assert make_selection("uniform", seed=4).seed == 4
    with pytest.raises(ValueError, match="replay.selection must be one of fifo, freshest, uniform"):
        make_selection("lifo")
    with pytest.raises(ValueError, match="replay.max_reuse must be >= 1"):
        Fifo(max_reuse=0)


def test_window_reuses_a_group_up_to_max_reuse_then_hands_it_back_for_freeing() -> None:
    window: ReplayWindow[str] = ReplayWindow(Fifo(max_reuse=2), MaxStaleness(k=3))
    window.add("a", version=0)
    window.add("b", version=0)
    first = window.take(0, 1)
    assert [t.item for t in first] == ["a"] and not first[0].reused
    assert window.returned(first, 0) == []  # one use left: back in, behind "b"
    assert [t.item for t in window.take(1, 2)] == ["b", "a"]
    assert len(window) == 0  # taken groups are out of the window until returned


def test_window_returns_used_up_groups_and_expires_stale_ones() -> None:
    window: ReplayWindow[str] = ReplayWindow(Fifo(max_reuse=2), MaxStaleness(k=1))
    window.add("a", version=0)
    window.add("b", version=0)
    taken = window.take(0, 2)
    assert window.returned(taken, 0) == []
    again = window.take(1, 2)
    assert all(t.reused for t in again)
    assert sorted(window.returned(again, 1)) == ["a", "b"]  # second use was the last
    window.add("c", version=1)
    window.add("d", version=3)
    with pytest.raises(ValueError, match="before expire"):
        window.take(3, 1)  # "c" is 2 versions old at 3 > k = 1
    expired = window.expire(3)
    assert [e.item for e in expired] == ["c"] and not expired[0].reused
    assert [t.item for t in window.take(3, 5)] == ["d"]


def test_window_refuses_a_selection_that_breaks_its_promise() -> None:
    class Twice(Fifo):
        def select(self, candidates, version, n):
            return [0, 0]

    window: ReplayWindow[str] = ReplayWindow(Twice(), MaxStaleness(k=1))
    window.add("a", 0)
    with pytest.raises(ValueError, match="invalid indices"):
        window.take(0, 2)


QUICKSTART = PipelineShape(k=2, groups_per_step=16, engines=1, batch_groups=16, produced_channel=64,
                           buffer_refs=256, ready_channel=16)


def test_pace_configs_pass_and_eager_with_deep_queues_is_refused_naming_the_keys() -> None:
    assert check(QUICKSTART) == []
    (problem,) = check(PipelineShape(**{**QUICKSTART.__dict__, "admission": "eager", "batch_groups": 4, "k": 4}))
    for words in ("staleness.admission = 'pace'", "buffer.max_refs = 256", "raise staleness.k to 23",
                  "shrink the queues to at most 44 groups"):
        assert words in problem, problem


def test_the_suggested_queue_sizes_pass_and_one_more_group_fails() -> None:
    base = dict(k=3, groups_per_step=8, engines=2, batch_groups=2, admission="eager")
    room = 3 * 8 - (2 * 2 + 8)  # k * B - (engines' batches + the learner's prefetch)
    assert check(PipelineShape(**base, produced_channel=3, buffer_refs=room - 5, ready_channel=2)) == []
    assert check(PipelineShape(**base, produced_channel=3, buffer_refs=room - 4, ready_channel=2)) != []


def test_epochs_compound_staleness_unless_corrected_or_on_policy() -> None:
    (problem,) = check(PipelineShape(**{**QUICKSTART.__dict__, "epochs": 2}))
    assert "learner.epochs = 1" in problem and "correction.kind = 'decoupled'" in problem
    assert "up to 5 optimizer steps" in problem  # 2 versions x 2 epochs + 1
    assert check(PipelineShape(**{**QUICKSTART.__dict__, "epochs": 2, "corrected": True})) == []
    assert check(PipelineShape(**{**QUICKSTART.__dict__, "epochs": 4, "k": 0})) == []


def test_unreachable_reuse_is_refused() -> None:
    problems = check(PipelineShape(k=1, groups_per_step=4, max_reuse=3))
    assert any("replay.max_reuse = 3 can never be reached" in p and "replay.max_reuse = 2" in p for p in problems)


def test_baton_check_refuses_before_anything_starts(capsys) -> None:
    code = main(["check", str(ROOT / "configs" / "quickstart.toml"), "--set", "staleness.admission='eager'"])
    err = capsys.readouterr().err
    assert code == 2
    assert "the queues alone can break the bound" in err and "staleness.admission = 'pace'" in err


def test_replay_keys_validate_and_reach_the_learner(tmp_path) -> None:
    from baton.builder import build_pipeline

    data = load_toml(ROOT / "configs" / "quickstart.toml")
    data.update(run_root=str(tmp_path), model={"path": str(tmp_path / "m")}, staleness={"k": 4})
    data["replay"] = {"max_reuse": 2, "selection": "uniform", "drop_zero_signal": True}
    data["buffer"] = {"produced_channel": 2, "max_refs": 4, "ready_channel": 2}
    data["engine"] = {"batch_groups": 2}
    data["learner"] = {"groups_per_step": 16}
    pipe = build_pipeline(validate(RunConfig, data))
    selection = pipe.consumer.selection
    assert isinstance(selection, Uniform) and selection.max_reuse == 2 and selection.drop_zero_signal
    assert pipe.max_uses == 2  # the ledger allows the reuse
    assert pipe.staleness.lead == 3  # derived from max_reuse: a group arrives with room for its second use


def test_staleness_lead_is_derived_from_reuse_and_checked_against_k() -> None:
    data = load_toml(ROOT / "configs" / "quickstart.toml")
    assert validate(RunConfig, data).staleness.lead is None  # no reuse: producers may run k ahead
    for k, reuse, lead in ((2, 2, 1), (4, 2, 3), (4, 3, 2), (2, 3, 0)):
        cfg = validate(RunConfig, {**data, "staleness": {"k": k}, "replay": {"max_reuse": reuse, "ride_along": True}})
        assert cfg.staleness.lead == lead
    replay = {"max_reuse": 2, "ride_along": True}
    kept = validate(RunConfig, {**data, "staleness": {"k": 4, "lead": 4}, "replay": replay})
    assert kept.staleness.lead == 4  # set by the user: kept (reuse then happens only in the warm-up)
    with pytest.raises(ConfigError, match=r"staleness.lead = 3 is more than staleness.k = 2.*at most 2"):
        validate(RunConfig, {**data, "staleness": {"lead": 3}})
    with pytest.raises(ConfigError, match="replay.selection"):
        validate(RunConfig, {"replay": {"selection": "lifo"}})
