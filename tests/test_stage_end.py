"""Stages that end on drift (optimize.py --stage_end=drift) and the next stage planned from where the last one ended
(stage_rules.StagePlan): the rule by hand, the records it leaves, and a run of them that resumes exactly."""
import dataclasses
import json
import math
import shutil
import sys

import pytest

from mu_grpo import records, stage_rules
from conftest import built_once, kill_when, needs_vllm, read_lines, run_script


def import_script(monkeypatch, name, *argv):
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    sys.modules.pop(name, None)
    return __import__(name)


def test_the_drift_warning_is_the_moving_average_of_one_minus_e_rho_given_a_negative(monkeypatch):
    end = stage_rules.StageEnd("drift", window=4, threshold=0.1, min_updates=5)
    # the last 4 updates with an A<0 token (None: a minibatch without one; NaN likewise): 1.0, 0.9, 0.8, 0.7 →
    # mean of 1 − E[ρ | A<0] = (0 + 0.1 + 0.2 + 0.3) / 4 = 0.15 > 0.1
    history = [0.5, 1.0, 0.9, None, 0.8, math.nan, 0.7]
    average, warned = end.warning(history)
    assert average == pytest.approx(0.15) and warned
    assert end.warning([1.0, 0.9, None, 0.8]) == (None, False)          # 3 values: no full window yet
    assert end.warning([1.0, 1.0, 0.95, 0.99])[1] is False              # (0 + 0 + 0.05 + 0.01) / 4 = 0.015
    # the stage ends before update u only from drift_min_updates on, and never with stage_end=fixed
    assert not end.ends_before(4, history) and end.ends_before(5, history)
    assert not stage_rules.StageEnd("fixed", window=4, threshold=0.1, min_updates=5).ends_before(7, history)
    # the record: ended on drift after 5 of 8 generated updates, the 3 minibatches left unused
    assert end.record(2, 5, 8, history, ["g5", "g6", "g7"]) == {
        "stage": 2, "reason": "drift", "updates": 5, "generated_updates": 8, "stage_end": "drift",
        "drift_signal": pytest.approx(0.15), "drift_warning": True, "drift_window": 4, "drift_threshold": 0.1,
        "drift_min_updates": 5, "unused_prompts": 3, "unused_groups": ["g5", "g6", "g7"]}
    # optimize.py's flags are the rule it applies
    opt = import_script(monkeypatch, "optimize", "--stage_end=drift", "--drift_window=4", "--drift_threshold=0.1",
                        "--drift_min_updates=5")
    assert opt.ending == end


def write_end(run_dir, s, reason, updates, generated, run_updates, min_updates=16):
    path = run_dir / f"stage_{s}" / records.STAGE_END
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"reason": reason, "updates": updates, "generated_updates": generated,
                                "run_updates": run_updates, "drift_min_updates": min_updates}))


def test_the_next_stage_is_planned_from_where_the_last_one_ended(tmp_path):
    plan = lambda s, **kw: stage_rules.StagePlan(**{  # noqa: E731
        "updates_per_stage": 64, "stages": 0, "stage_end": "drift", "drift_growth": 1.25, "drift_max_updates": 100,
        "total_updates": 1000, **kw}).stage(tmp_path, s).updates
    assert plan(0) == 64 and plan(0, total_updates=10) == 10
    with pytest.raises(FileNotFoundError, match="stage_0/stage_end.json is missing"):
        plan(1)
    write_end(tmp_path, 0, "drift", 47, 64, 47)
    assert plan(1) == 59                                  # ceil(1.25 · 47) = ceil(58.75)
    write_end(tmp_path, 1, "all minibatches", 59, 59, 106)
    assert plan(2) == 100                                 # 2 · 59 = 118, at most max_updates
    write_end(tmp_path, 2, "drift", 5, 100, 111, min_updates=16)
    assert plan(3) == 16                                  # ceil(6.25) = 7, at least μ_min
    write_end(tmp_path, 3, "drift", 16, 16, 995)
    assert plan(4) == 5 and plan(4, total_updates=995) == 0       # the run's updates left; none: the run is over


def test_a_fixed_plan_and_the_drift_defaults():
    fixed = stage_rules.StagePlan(updates_per_stage=8, stages=3)
    assert [fixed.stage("/nonexistent", s).updates for s in range(4)] == [8, 8, 8, 0]
    assert fixed.run_updates == 24
    drift = stage_rules.StagePlan(updates_per_stage=8, stages=3, stage_end="drift")
    assert (drift.total_updates, drift.drift_max_updates, drift.run_updates) == (24, 32, 24)   # 3 · 8, 4 · 8
    with pytest.raises(ValueError, match="stage_end"):
        stage_rules.StagePlan(updates_per_stage=8, stages=3, stage_end="early")


def test_a_stage_is_decided_in_one_record(tmp_path):
    # 3 fixed stages of 8 updates × 16 prompts, evaluated every 2nd stage, saved at the end only (save_every 0)
    fixed = stage_rules.StagePlan(updates_per_stage=8, stages=3, prompts_per_update=16, eval_every=2, save_every=0)
    assert [dataclasses.astuple(fixed.stage(tmp_path, s)) for s in range(4)] == [
        (0, 8, 128, True, False),         # the initial policy is evaluated; not the last stage: not saved
        (1, 8, 128, False, False),        # trained on stage 0: 1 % 2 ≠ 0
        (2, 8, 128, True, True),          # trained on stage 1: 2 % 2 = 0; the last stage is saved
        (3, 0, 0, True, False)]           # the run is over: its last policy is evaluated
    assert [fixed.stage(tmp_path, s).save for s in range(4)] == [False, False, True, False]
    every = dataclasses.replace(fixed, save_every=1, eval_every=0)
    assert [(every.stage(tmp_path, s).save, every.stage(tmp_path, s).evaluate) for s in range(4)] == [
        (True, False)] * 3 + [(False, False)]
    # drift, 24 updates: a stage may be the last when the updates before it and its μ reach them
    drift = stage_rules.StagePlan(updates_per_stage=8, stages=3, stage_end="drift", save_every=0)
    write_end(tmp_path, 0, "drift", 4, 8, 4, min_updates=2)        # μ_1 = ceil(1.25 · 4) = 5: 4 + 5 < 24
    assert (drift.stage(tmp_path, 1).updates, drift.stage(tmp_path, 1).save) == (5, False)
    write_end(tmp_path, 0, "all minibatches", 8, 8, 16)            # μ_1 = min(2 · 8, 24 − 16) = 8: 16 + 8 = 24
    assert (drift.stage(tmp_path, 1).updates, drift.stage(tmp_path, 1).save) == (8, True)


def test_a_stages_prompts_follow_the_previous_stages_as_its_plan_records_them(monkeypatch, tmp_path):
    gen = import_script(monkeypatch, "generate", f"--run_dir={tmp_path}", "--prompts_per_stage=8")
    assert gen.prompt_offset(0) == 0 and gen.prompt_offset(3) == 24             # no records: s · P
    (tmp_path / "stage_0" / "rollouts").mkdir(parents=True)
    (tmp_path / "stage_0" / "rollouts" / records.PLAN).write_text(json.dumps({"prompt_offset": 0, "prompts_per_stage": 20}))
    assert gen.prompt_offset(1) == 20                     # after stage 0's 20 prompts, whatever this stage's P


ALWAYS_WARN = ["--stage_end=drift", "--drift_window=1", "--drift_threshold=-1"]   # 1 − E[ρ | A<0] > −1: always on


@pytest.mark.slow
def test_a_stage_that_ended_on_drift_resumes_to_the_same_end_and_weights(toy, tmp_path):
    # 4 minibatches of one group; the warning is always on and the stage may end from update 2: it ends before
    # update 2, the last two groups recorded as unused. Killed after its final train state, before the policy and
    # the record: the rerun ends at the same update, with the same weights and record
    from test_optimize import PROBLEMS, _weights, write_stage
    write_stage(tmp_path / "stage_0", toy / "model", PROBLEMS)
    args = [f"--stage_dir={tmp_path / 'stage_0'}", "--updates_per_stage=4", "--prompts_per_update=1", "--lr=1e-3",
            "--checkpoint_every=1", *ALWAYS_WARN, "--drift_min_updates=2"]
    run_script("optimize.py", *args)
    end = json.loads((tmp_path / "stage_0" / records.STAGE_END).read_text())
    assert (end["reason"], end["updates"], end["generated_updates"], end["run_updates"]) == ("drift", 2, 4, 2)
    assert end["unused_prompts"] == 2 and len(end["unused_groups"]) == 2
    metrics = read_lines(tmp_path / "stage_0" / "metrics.jsonl")
    assert [m["update"] for m in metrics] == [0, 1]
    assert sorted([*(g for m in metrics for g in m["groups"]), *end["unused_groups"]]) == [0, 1, 2, 3]
    weights = _weights(tmp_path / "stage_0" / "policy")
    shutil.rmtree(tmp_path / "stage_0" / "policy")
    (tmp_path / "stage_0" / records.STAGE_END).unlink()
    run_script("optimize.py", *args)
    again = _weights(tmp_path / "stage_0" / "policy")
    assert all(a.equal(again[k]) for k, a in weights.items())
    assert json.loads((tmp_path / "stage_0" / records.STAGE_END).read_text()) == end
    assert [m["update"] for m in read_lines(tmp_path / "stage_0" / "metrics.jsonl")] == [0, 1]


def drift_env(toy, run, **more):
    """A run_stages.sh run of stages that end on drift: UPDATES_PER_STAGE=4 for the first stage, 5 updates in all, the warning
    always on from update 2."""
    from test_loop import loop_env
    return {**loop_env(toy, run), "STAGE_END": "drift", "UPDATES_PER_STAGE": "4", "TOTAL_UPDATES": "5", "PROMPTS_PER_UPDATE": "4",
            "EVAL_EVERY": "2", "DRIFT_ARGS": " ".join([*ALWAYS_WARN[1:], "--drift_min_updates=2"]), **more}


@pytest.fixture(scope="session")
def drift_run(toy, tmp_path_factory):
    """The process-per-phase run of drift_env, one engine and one process."""
    from test_loop import run_loop
    return built_once(tmp_path_factory, "drift", lambda out: run_loop(drift_env(toy, out / "whole"))) / "whole"


@pytest.mark.slow
@needs_vllm
def test_a_run_of_stages_that_end_on_drift_is_planned_from_its_records(drift_run):
    # stage 0 trains 2 of 4 updates, stage 1 is planned ceil(1.25 · 2) = 3 and trains 2, stage 2 has 1 update left
    # (fewer than μ_min: it trains it), and the run ends at 5. A kill and resume of these stages is the resident
    # test's below: both modes plan each stage with one function (stage_rules.StagePlan.stage) from the records
    whole = drift_run
    ends = [json.loads((whole / f"stage_{s}" / records.STAGE_END).read_text()) for s in range(3)]
    assert [(e["generated_updates"], e["updates"], e["run_updates"], e["reason"]) for e in ends] == \
        [(4, 2, 2, "drift"), (3, 2, 4, "drift"), (1, 1, 5, "all minibatches")]
    assert not (whole / "stage_3").exists()
    plans = [json.loads((whole / f"stage_{s}" / "rollouts" / records.PLAN).read_text()) for s in range(3)]
    assert [(p["prompt_offset"], p["prompts_per_stage"]) for p in plans] == [(0, 16), (16, 12), (28, 4)]
    runs = [m["run_update"] for s in range(3) for m in read_lines(whole / f"stage_{s}" / "metrics.jsonl")]
    assert runs == list(range(5))
    results = read_lines(whole / "results.jsonl")   # the start, after stage 1 (EVAL_EVERY=2), and after the last
    assert sorted({(r["stage"], r["updates"]) for r in results}) == [(-1, 0), (1, 4), (2, 5)]
    assert sorted(records.load_run(whole)["stage_ends"]) == [0, 1, 2]


@pytest.mark.slow
@needs_vllm
def test_resident_stages_that_end_on_drift_are_the_process_per_phase_ones_and_resume_exactly(toy, tmp_path, request):
    # the trainer plans each stage from where the last ended and tells the engines its size with the policy: two engine
    # processes (each reads the size from the flag) and one trainer rank, killed while stage 1 trains and rerun, give
    # the unbroken process-per-phase run's stage boundaries, rows (in two shards instead of one), metrics, weights and
    # evaluations, bit for bit
    from test_loop import run_loop
    from test_optimize import _weights
    resident = tmp_path / "resident"
    env = drift_env(toy, resident, RESIDENT="true", ENGINES="2", SAVE_EVERY="1")
    assert kill_when(["bash", "run_stages.sh"], lambda: (resident / "stage_1" / "metrics.jsonl").exists(), env=env,
                     timeout=600)
    run_loop(env)
    drift_run = request.getfixturevalue("drift_run")    # asked for here: this test runs beside its build (conftest)
    assert [r["ended"] for r in read_lines(resident / "timeline.jsonl") if r["name"] == "resident"] == \
        ["killed", "completed"]
    ends = lambda run: [json.loads((run / f"stage_{s}" / records.STAGE_END).read_text()) for s in range(3)]  # noqa: E731
    assert ends(resident) == ends(drift_run) and not (resident / "stage_3").exists()
    for s in range(3):
        rows = lambda run: "".join(p.read_text() for p in sorted((run / f"stage_{s}" / "rollouts").glob(  # noqa: E731
            "shard_*.jsonl"))).replace(str(run), "RUN")
        assert rows(resident) == rows(drift_run), s
        plan = lambda run: json.loads((run / f"stage_{s}" / "rollouts" / records.PLAN).read_text())  # noqa: E731
        assert {**plan(resident), "policy": 0, "shards": 0} == {**plan(drift_run), "policy": 0, "shards": 0}
        assert plan(resident)["shards"] == 2
        strip = lambda run: [{k: v for k, v in m.items() if k not in ("time", "seconds", "tokens_per_s")  # noqa: E731
                              and not k.startswith("memory/")} for m in read_lines(run / f"stage_{s}" / "metrics.jsonl")]
        assert strip(resident) == strip(drift_run), s
        final_weights = _weights(resident / f"stage_{s}" / "policy")
        assert all(w.equal(final_weights[k]) for k, w in _weights(drift_run / f"stage_{s}" / "policy").items()), s
    key = lambda run: sorted((r["stage"], r["updates"], r["avg_at_k"]) for r in read_lines(run / "results.jsonl"))  # noqa: E731
    assert key(resident) == key(drift_run) and [r[:2] for r in key(resident)] == [(-1, 0), (1, 4), (2, 5)]
