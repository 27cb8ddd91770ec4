"""mu_grpo/records.py, the run's records in one place: run_stages.sh's timeline rows through its one writer, a resident attempt's
row (at its end, or at the next start when it was killed) and the one wall-clock rule (time_split with pauses) on
hand-made timelines (fast)."""
import sys

import pytest

from conftest import ROOT
from test_launch import TOY, run_launch

sys.path.insert(0, str(ROOT))
from mu_grpo import common  # noqa: E402
from mu_grpo import records  # noqa: E402


def test_run_stages_rows_are_written_by_records_one_writer(tmp_path):
    # run_stages.sh's rows: an attempt's zero-length start, then each phase (its kind: the name before its last _)
    env = {**TOY, "RUN": str(tmp_path)}
    assert run_launch("--command=attempt", env=env).returncode == 0
    for name, stage, start, end in (("eval_init", -1, 100.25, 110.5), ("generate_0", 0, 110.5, 130.75)):
        proc = run_launch("--command=row", f"--name={name}", f"--stage={stage}", f"--start={start}", f"--end={end}",
                          env=env)
        assert proc.returncode == 0, proc.stderr
    attempt, *rows = records.read(tmp_path)
    assert (attempt["phase"], attempt["stage"], attempt["seconds"], attempt["process"]) == ("attempt", -1, 0, "run_stages.sh")
    assert attempt["start"] == attempt["end"] > 1.7e9
    assert rows == [{"phase": "eval", "name": "eval_init", "stage": -1, "start": 100.25, "end": 110.5, "seconds": 10.25},
                    {"phase": "generate", "name": "generate_0", "stage": 0, "start": 110.5, "end": 130.75,
                     "seconds": 20.25}]


def test_an_evaluation_inside_a_generate_phase_is_evaluation_time_counted_once():
    # per phase: generate_0 (0-30 s) evaluated the initial policy first (20-25 s, its part row), optimize_0 (30-50 s),
    # the last policy evaluated alone (eval_0, 50-60 s); generation 12 s, training 8 s of compute
    row = lambda phase, name, start, end, **more: {"phase": phase, "name": name, "stage": 0, "start": start,  # noqa: E731
                                                  "end": end, "seconds": end - start, **more}
    run = {"timeline": [row("eval", "eval_-1", 20, 25, process="generate"), row("generate", "generate_0", 0, 30),
                        row("optimize", "optimize_0", 30, 50), row("eval", "eval_0", 50, 60)],
           "manifests": {0: {"generation_seconds": 12}}, "metrics": [{"seconds": 8}]}
    per_kind, total, generation, training, overhead = records.phase_summary(run)
    assert per_kind == {"generate": 25, "eval": 15, "optimize": 20} and (total, generation, training) == (60, 12, 8)
    assert overhead == pytest.approx((60 - 15 - 12 - 8) / (60 - 15))
    split = records.time_split(run)
    assert (split["wall"], split["evaluation"], split["switching"], split["idle"]) == (60, 15, 25, 0)


def test_a_killed_resident_attempt_gets_its_row_at_the_next_start_and_the_time_split_adds_up(tmp_path):
    # attempt 1 started at t = 100 and was SIGKILLed (no row of its own, its start marker left); its processes wrote
    # rows up to t = 150 (its engine's start 100-105, the initial evaluation 105-110, stage 0 generated 110-130 and
    # trained 130-150). Attempt 2 runs from t = 200 to 300 (stage 1: generated 210-240, trained 240-270, evaluated
    # 270-290). Records: generation 15 + 25 s (manifests), training 18 + 27 s (metrics), evaluation 5 + 20 s
    rows = [{"phase": "start", "name": "engine_start", "stage": 0, "start": 100, "end": 105, "process": "engine"},
            {"phase": "eval", "name": "eval_-1", "stage": -1, "start": 105, "end": 110, "seconds": 5, "process": "engine"},
            {"phase": "generate", "name": "generate_0", "stage": 0, "start": 110, "end": 130, "process": "engine"},
            {"phase": "optimize", "name": "optimize_0", "stage": 0, "start": 130, "end": 150, "process": "trainer"},
            {"phase": "generate", "name": "generate_1", "stage": 1, "start": 210, "end": 240, "process": "engine"},
            {"phase": "optimize", "name": "optimize_1", "stage": 1, "start": 240, "end": 270, "process": "trainer"},
            {"phase": "eval", "name": "eval_1", "stage": 1, "start": 270, "end": 290, "seconds": 20, "process": "engine"}]
    def attempt_marker(t):      # run_stages.sh's zero-length row, written before mu_grpo/launch.py starts the attempt
        common.append_jsonl(tmp_path / "timeline.jsonl", {"phase": "attempt", "name": "attempt", "stage": -1, "start": t,
                                                         "end": t, "seconds": 0, "process": "run_stages.sh"})
    attempt_marker(100)
    for r in rows[:4]:
        r.setdefault("seconds", r["end"] - r["start"])
        common.append_jsonl(tmp_path / "timeline.jsonl", r)
    common.atomic_write_json(tmp_path / "timeline.attempt.json", {"start": 100})
    for s, (generation, training) in enumerate(((15, [9, 9]), (25, [13, 14]))):
        (tmp_path / f"stage_{s}" / "rollouts").mkdir(parents=True)
        common.atomic_write_json(tmp_path / f"stage_{s}" / "rollouts" / "manifest.json", {"generation_seconds": generation})
        common.atomic_write_lines(tmp_path / f"stage_{s}" / "metrics.jsonl", [{"seconds": x} for x in training])
    attempt_marker(200)                            # the rerun: run_stages.sh's row, then mu_grpo/launch.py's resident_command,
    records.close_killed_attempt(tmp_path)          # which first closes the killed attempt at its own last row (150)
    for r in rows[4:]:
        common.append_jsonl(tmp_path / "timeline.jsonl", {**r, "seconds": r.get("seconds", r["end"] - r["start"])})
    records.attempt_row(tmp_path, 200, 300, "completed")
    tops = [r for r in common.read_jsonl(tmp_path / "timeline.jsonl") if "process" not in r]
    assert [(r["start"], r["end"], r["seconds"], r["ended"]) for r in tops] == [(100, 150, 50, "killed"),
                                                                              (200, 300, 100, "completed")]
    # wall: 100..300 less the 50 s from the killed attempt's last row to the rerun (150..200: what it lost after its
    # last row, and the wait) = 150 s, all covered by the attempts' rows (50 + 100 s): idle 0; switching: 150 −
    # evaluation 25 − generation 40 − training 45 = 40 s
    split = records.time_split(records.load_run(tmp_path))
    assert records.pauses(records.load_run(tmp_path)) == [(150, 200)]
    assert split == {"wall": 150, "generation": 40, "training": 45, "evaluation": 25, "switching": 40, "idle": 0,
                     "stages": 2}
    records.close_killed_attempt(tmp_path)          # no marker: nothing more
    assert len(common.read_jsonl(tmp_path / "timeline.jsonl")) == 11
    # a rerun after a completed attempt (more stages) at t = 1000 for 10 s: its wait is not timed either (wall 160)
    common.append_jsonl(tmp_path / "timeline.jsonl", {"phase": "resident", "name": "resident", "stage": 1,
                                                     "start": 1000, "end": 1010, "seconds": 10, "ended": "completed"})
    assert {k: records.time_split(records.load_run(tmp_path))[k] for k in ("wall", "idle")} == {"wall": 160, "idle": 0}


def test_the_time_before_a_rerun_is_not_the_runs_in_either_mode():
    def attempt(t):                 # run_stages.sh's row at each start
        return {"phase": "attempt", "name": "attempt", "stage": -1, "start": t, "end": t, "seconds": 0,
                "process": "run_stages.sh"}

    def row(phase, stage, start, end, **more):
        return {"phase": phase, "name": f"{phase}_{stage}", "stage": stage, "start": start, "end": end,
                "seconds": end - start, **more}
    # process per phase, killed during eval_0 (its row never written) at t = 60, rerun at t = 500: the 450 s from
    # optimize_0's end are not the run's; the phases cover 10 + 20 + 20 + 10 + 20 = 80 s of wall 530 − 450 = 80: idle 0
    run = {"timeline": [attempt(0), row("eval", -1, 0, 10), row("generate", 0, 10, 30), row("optimize", 0, 30, 50),
                        attempt(500), row("eval", 0, 500, 510), row("generate", 1, 510, 530)],
           "manifests": {0: {"generation_seconds": 18}, 1: {"generation_seconds": 19}}, "metrics": [{"seconds": 15}]}
    assert records.pauses(run) == [(50, 500)]
    split = records.time_split(run)
    assert (split["wall"], split["idle"], split["evaluation"], split["switching"]) == (80, 0, 20, 80 - 20 - 37 - 15)
    # resident, killed at t = 170 (its row ends at its last record, 150), rerun at 200 whose pair starts at 200.5 (the
    # script's checks before it): the attempt row's pause (150, 200) and the resident row's (150, 200.5) are one
    run = {"timeline": [attempt(100), row("generate", 0, 101, 130, process="engine"), row("optimize", 0, 130, 150,
                                                                                         process="trainer"),
                        row("resident", 0, 100, 150, ended="killed"), attempt(200),
                        row("generate", 1, 201, 240, process="engine"), row("resident", 1, 200.5, 300, ended="completed")],
           "manifests": {}, "metrics": []}
    assert records.pauses(run) == [(150, 200.5)]
    assert records.time_split(run)["wall"] == pytest.approx(300 - 100 - 50.5)
    # the first attempt, and a run never resumed: no pause
    assert records.pauses({"timeline": run["timeline"][:4]}) == []


def test_a_row_another_process_is_still_appending_is_not_read_yet(tmp_path):
    # the trainer's stage line reads timeline.jsonl while the engine process appends to it: before, a last line not
    # yet whole (a row crossing a page, or NFS) raised and stopped the trainer's rank 0
    from mu_grpo import tracking
    rows = [{"phase": "attempt", "name": "attempt", "stage": -1, "start": 1.0, "end": 1.0, "seconds": 0.0},
            {"phase": "eval", "name": "eval_-1", "stage": -1, "start": 1.0, "end": 3.0, "seconds": 2.0}]
    common.atomic_write_lines(tmp_path / records.TIMELINE, rows)
    with open(tmp_path / records.TIMELINE, "a") as f:
        f.write('{"phase": "generate", "na')
    assert records.read(tmp_path) == rows
    assert tracking.where_line(tmp_path, 10, 0).startswith("[stage 0] update 0 of 10")
    with pytest.raises(ValueError, match="truncated last line"):       # elsewhere a cut line is still an error
        common.read_jsonl(tmp_path / records.TIMELINE)
    (tmp_path / records.TIMELINE).write_text('{"a": 1}\n{"b\n{"c": 2}\n')  # a damaged line that is not the last
    with pytest.raises(ValueError, match=":2: not valid JSON"):
        records.read(tmp_path)


def test_what_a_run_has_finished_is_read_from_its_records_in_either_mode(tmp_path):
    # a resident run writes no phase markers: its trained stages are its stage_end.json and policy, its rollouts the
    # manifests; a stage older than the newest trained one is trained too (a resident run that saved only every
    # SAVE_EVERY-th stage has no policy there)
    assert records.finished_work(tmp_path) == [] and records.last_trained(tmp_path) == -1
    for s in (0, 1, 2):
        (tmp_path / f"stage_{s}" / "rollouts").mkdir(parents=True)
    for s in (0, 1):
        (tmp_path / f"stage_{s}" / "rollouts" / records.MANIFEST).write_text("{}")
        (tmp_path / f"stage_{s}" / records.STAGE_END).write_text("{}")
    (tmp_path / "stage_1" / "policy").mkdir()
    (tmp_path / "stage_1" / "policy" / common.POLICY_ID_FILE).write_text("{}")
    (tmp_path / "stage_2" / "rollouts" / "shard_00000.jsonl").write_text("{}\n")
    assert records.last_trained(tmp_path) == 1
    assert [records.phase_finished(tmp_path, f"{kind}_{s}") for kind in ("generate", "optimize") for s in (0, 1, 2)] \
        == [True, True, False, True, True, False]
    assert records.finished_work(tmp_path) == ["stage 0's rollouts", "stage 1's rollouts", "stage 1's training",
                                               "1 rollout shard(s) of stage 2"]
    assert not records.phase_finished(tmp_path, "eval_1")        # evaluate.py decides (benchmarks.evaluated)
    with pytest.raises(ValueError, match="no phase is named 'train_0'"):
        records.phase_finished(tmp_path, "train_0")


def test_an_append_after_a_writer_killed_mid_line_cuts_its_torn_line(tmp_path):
    path = tmp_path / records.TIMELINE
    path.write_text('{"a": 1}\n{"b": ')                        # its writer killed mid-line
    common.append_jsonl(path, {"c": 2})
    assert common.read_jsonl(path) == [{"a": 1}, {"c": 2}]    # before: '{"b": {"c":2}' mid-file, unreadable
    path.write_text('{"b": ')
    common.append_jsonl(path, {"c": 3})
    assert common.read_jsonl(path) == [{"c": 3}]
