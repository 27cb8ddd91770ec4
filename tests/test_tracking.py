"""Watching a run (issue 44): the trackers fed from the run's records (mu_grpo/tracking.py), read back with TensorBoard's own
reader and from W&B's offline run files; the missing-package refusal; the stage line with its ETA. A real run killed in
every phase and resumed, read back with the functions here: tests/test_loop.py (it shares box_run's run)."""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from mu_grpo import common, tracking
from conftest import ROOT


# ----------------------------------------------------------------------------- reading the trackers back


def tensorboard_scalars(run):
    """{tag: [steps]} of every scalar in <run>/tensorboard, in the order written (TensorBoard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(Path(run) / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(run):
    """Every record of the W&B offline run files under <run>/tracking/wandb, in order: W&B's transaction log (32 KiB
    blocks of [crc32c, length, type] records after a 7-byte ':W&B' header; types full, first, middle, last), each
    record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb
    out = []
    for path in sorted(Path(run, "tracking", "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, buf = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
            if kind == 0:                       # a block's zero padding
                pos += left
                continue
            buf = (b"" if kind in (1, 2) else buf) + data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = pb.Record()
                record.ParseFromString(buf)
                out.append(record)
    return out


def wandb_history(run):
    """[{metric: value}] of every W&B log call, and the runs' (id, group, config) as they were opened."""
    rows, runs = [], []
    for r in wandb_records(run):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        elif kind == "run":
            runs.append((r.run.run_id, r.run.run_group, {i.key: json.loads(i.value_json) for i in r.run.config.update}))
    return rows, runs


def steps_of(history, metric):
    return [row["run_update"] for row in history if metric in row]


# ----------------------------------------------------------------------------- a run's records, written by hand


def write_records(run, stages):
    """The records a run of `stages` stages of 2 updates leaves (the fields the phases write), 10 s per phase."""
    (run / ".done").mkdir(parents=True, exist_ok=True)
    common.atomic_write(run / ".done" / "start", "1000")
    t = 1000.0
    for s in range(stages):
        d = run / f"stage_{s}"
        (d / "rollouts").mkdir(parents=True, exist_ok=True)
        common.atomic_write_json(d / "rollouts" / "manifest.json", {
            "complete": True, "stage": s, "mean_reward": 0.25 * (s + 1), "frac_groups_zero_variance": 0.5,
            "truncation_rate": 0.0, "mean_response_tokens": 9.5, "wall_tokens_per_s": 100.0, "prompts": 8})
        common.atomic_write_lines(d / "metrics.jsonl", [
            {"update": u, "run_update": 2 * s + u, "stage": s, "staleness": u, "lr": 1e-3, "loss/policy": -0.1 * u,
             "ratio/mean_neg_adv": 1.0, "groups": [0, 1], "update_skipped": False, "time": t + 10 + u}
            for u in range(2)])
        common.atomic_write_json(d / "stage_end.json", {"stage": s, "run_updates": 2 * s + 2, "updates": 2})
        for phase in ("generate", "optimize"):
            common.append_jsonl(run / "timeline.jsonl", {"phase": phase, "name": f"{phase}_{s}", "stage": s,
                                                          "start": t, "end": t + 10, "seconds": 10.0})
            t += 10
        common.append_jsonl(run / "results.jsonl", {"stage": s, "updates": 2 * s + 2, "policy": str(d / "policy"),
                                                     "benchmark": "test", "k": 4, "avg_at_k": 0.5 + 0.1 * s,
                                                     "avg_at_k_stderr": 0.05, "pass_at_k": 0.9, "time": t})


def follow_once(run, report, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(tracking, "group", "frontier-x")
    tracking.follow(run, report, {"LOSS": "mu-grpo", "STAGES": "2"}, 0)


def test_every_record_reaches_both_trackers_once_at_its_recorded_update(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    write_records(run, 1)
    follow_once(run, "tensorboard,wandb", monkeypatch)
    # a resumed run: stage 0's optimize killed after its first update and resumed (its metrics.jsonl rewritten with
    # the same rows), stage 1 added; the follower too was killed and starts again
    write_records(run, 2)
    follow_once(run, "tensorboard,wandb", monkeypatch)
    scalars = tensorboard_scalars(run)
    assert scalars["train/loss/policy"] == [0, 1, 2, 3]             # each update once, at its run update
    assert scalars["train/staleness"] == [0, 1, 2, 3]
    assert scalars["rollout/mean_reward"] == [0, 2]                 # stage s at the updates its policy had
    assert scalars["eval/test/avg_at_4"] == [2, 4] and scalars["eval/test/avg_at_4_stderr"] == [2, 4]
    assert scalars["time/optimize_seconds"] == [2, 4] and scalars["time/generate_seconds"] == [0, 2]
    assert "train/groups" not in scalars and "train/update_skipped" not in scalars       # lists, flags
    history, runs = wandb_history(run)
    assert steps_of(history, "train/loss/policy") == [0, 1, 2, 3]
    assert steps_of(history, "eval/test/pass_at_4") == [2, 4] and steps_of(history, "rollout/mean_reward") == [0, 2]
    hours = [row["train/wall_hours"] for row in history if "train/wall_hours" in row]
    assert hours == pytest.approx([10 / 3600, 11 / 3600, 30 / 3600, 31 / 3600])        # beside the update, from start
    assert len({run_id for run_id, _, _ in runs}) == 1 and {g for _, g, _ in runs} == {"frontier-x"}   # one run
    assert runs[0][2]["run_stages"] == {"LOSS": "mu-grpo", "STAGES": "2"}


def test_an_evaluation_inside_a_generate_phase_counts_as_evaluation_time(tmp_path):
    # stage 1's engines evaluate stage 0's policy first (4 s of its 10 s generate phase): the totals count those 4 s
    # once, as evaluation, as records.phase_summary does
    run = tmp_path / "run"
    write_records(run, 2)
    rows = common.read_jsonl(run / "timeline.jsonl")
    rows.insert(2, {"phase": "eval", "name": "eval_0", "stage": 0, "start": 1020.0, "end": 1024.0, "seconds": 4.0,
                    "process": "generate"})
    common.atomic_write_lines(run / "timeline.jsonl", rows)
    totals = {k: v for *_, values in tracking.rows(run) for k, v in values.items() if k.endswith("_hours_total")}
    assert totals == {"time/generate_hours_total": pytest.approx(16 / 3600),
                      "time/optimize_hours_total": pytest.approx(20 / 3600),
                      "time/eval_hours_total": pytest.approx(4 / 3600)}


def test_with_no_tracker_nothing_is_written_or_imported(tmp_path):
    run = tmp_path / "run"
    write_records(run, 1)
    code = ("import sys; from mu_grpo import tracking; tracking.follow(sys.argv[1], 'none', {}, 0); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'tensorboard', 'torch')))")
    proc = subprocess.run([sys.executable, "-c", code, str(run)], cwd=ROOT, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"
    assert not (run / "tensorboard").exists() and not (run / "tracking").exists()


def test_a_tracker_whose_package_is_missing_is_refused_in_one_line(monkeypatch):
    # neither tracker's package installed (find_spec finds nothing): the first one named is refused, in one line
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    for report, package in (("wandb", "wandb"), ("tensorboard,wandb", "tensorboard")):
        with pytest.raises(SystemExit) as refused:
            tracking.check(report)
        assert "\n" not in str(refused.value)
        assert str(refused.value).startswith(f"REPORT_TO={report} needs the {package!r} package, which is not installed")
    assert tracking.trackers_of("none") == [] and tracking.trackers_of("wandb,tensorboard") == ["wandb", "tensorboard"]
    for bad in ("tensorbord", "wandb,wandb", "none,wandb,mlflow"):
        with pytest.raises(SystemExit, match="REPORT_TO must be none, tensorboard, wandb or a comma list"):
            tracking.trackers_of(bad)


def test_the_stage_line_says_the_updates_done_the_last_evaluation_and_an_eta_from_the_measured_phases(tmp_path):
    run = tmp_path / "run"
    assert tracking.where_line(run, 8, 0) == "[stage 0] update 0 of 8 · ETA after the first stage"
    write_records(run, 2)
    # 4 updates done in 4 phases of 10 s: 10 s per update, 4 updates left → 40 s, said as a minute
    assert tracking.where_line(run, 8, 2) == ("[stage 2] update 4 of 8 · last evaluation: avg@4 0.600 after 4 updates"
                                              " · ETA 1 min (1 min measured for 4 updates)")
    common.append_jsonl(run / "timeline.jsonl", {"phase": "eval", "name": "eval_x", "stage": 1, "start": 0, "end": 0,
                                                  "seconds": 14360.0})       # 4 h in all: 3 h 20 min per 4 updates
    assert tracking.where_line(run, 8, 2).endswith("ETA 4 h 00 min (4 h 00 min measured for 4 updates)")
    # resumed resident: a killed attempt's row (100 s) holds its processes' rows (60 s, before its end), the running
    # attempt's rows (20 s) count on their own: 4 h + 100 + 20 s = 14,520 s per 4 updates, 4 h 02 min
    for r in ({"phase": "generate", "start": 10, "end": 70, "seconds": 60, "process": "engine"},
              {"phase": "resident", "start": 0, "end": 100, "seconds": 100, "ended": "killed"},
              {"phase": "generate", "start": 200, "end": 220, "seconds": 20, "process": "engine"}):
        common.append_jsonl(run / "timeline.jsonl", {"name": r["phase"], "stage": 1, **r})
    assert tracking.where_line(run, 8, 2).endswith("ETA 4 h 02 min (4 h 02 min measured for 4 updates)")


def test_the_stage_line_shows_the_last_stages_kl_over_its_final_updates_and_warns_above_the_lab_threshold(
        tmp_path, monkeypatch):
    # stage 1's 20 updates: the first 4 at KL 1.0, the last 16 alternating 0.004 / 0.008 → 0.006 over the last 16
    # (over all 20 it would be 0.2048); one row without a KL (an update skipped) is not counted
    run = tmp_path / "run"
    write_records(run, 2)
    monkeypatch.setattr(tracking, "fall_kl", 0.01)
    kl = [1.0] * 4 + [0.004, 0.008] * 8
    common.atomic_write_lines(run / "stage_1" / "metrics.jsonl", [{"update": u, "run_update": 2 + u, "ratio/kl": k}
                                                                  for u, k in enumerate(kl)] + [{"update": 20}])
    line = tracking.where_line(run, 8, 2)
    assert "KL to its rollouts over stage 1's last 15 updates" in line     # the last 16 rows hold 15 KLs
    monkeypatch.setattr(tracking, "fall_kl_updates", 17)                 # the last 17 rows: 16 KLs, mean 0.006
    line = tracking.where_line(run, 8, 2)
    assert "over stage 1's last 16 updates 0.0060 ·" in line and "⚠" not in line
    common.atomic_write_lines(run / "stage_1" / "metrics.jsonl", [{"update": u, "ratio/kl": k}
                                                                  for u, k in enumerate([0.02, 0.03])])
    line = tracking.where_line(run, 8, 2)      # (0.02 + 0.03) / 2 = 0.025 > 0.01
    assert "over stage 1's last 2 updates 0.0250 ⚠ above 0.01, where the lab's falls" in line and "lab-calibrated" in line
    assert "KL" not in tracking.where_line(run, 8, 0)                   # before the first stage: nothing to show


def test_following_ends_after_a_last_pass_once_run_stages_sh_says_it_exits(tmp_path, monkeypatch):
    # run_stages.sh's exit creates the stop file and waits for the follower: a file, not a signal, since the exit may
    # come before the follower has set its handler (a rerun of a finished run exits at once). Rows written just before
    # the stop still go in
    import threading
    pytest.importorskip("tensorboard")
    run, stop = tmp_path / "run", tmp_path / "tracking.stop"
    write_records(run, 1)
    monkeypatch.setattr(tracking, "poll_s", 60.0)

    def finish():
        write_records(run, 2)
        stop.touch()
    threading.Timer(0.5, finish).start()
    tracking.follow(run, "tensorboard", {}, os.getpid(), str(stop))       # returns: the parent (this process) lives on
    assert tensorboard_scalars(run)["train/loss/policy"] == [0, 1, 2, 3]


def test_a_follower_reads_again_only_the_record_files_that_changed(tmp_path, monkeypatch):
    # a 1,024-stage run has ~4k record files and the follower passes over them every poll_s: the second pass of an
    # unchanged run opens none of them, and after one more update only the metrics file it went to
    import builtins
    import io
    run = tmp_path / "run"
    write_records(run, 2)
    opened, real_open = [], builtins.open

    def counting_open(file, mode="r", *args, **kwargs):
        if "r" in mode and Path(file).is_relative_to(run):
            opened.append(Path(file).relative_to(run).as_posix())
        return real_open(file, mode, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)            # Path.read_text's
    files = tracking.RecordFiles()
    first = tracking.rows(run, files)
    assert sorted(opened) == ["results.jsonl", "stage_0/metrics.jsonl", "stage_0/rollouts/manifest.json",
                              "stage_0/stage_end.json", "stage_1/metrics.jsonl", "stage_1/rollouts/manifest.json",
                              "stage_1/stage_end.json", "timeline.jsonl"]            # each once
    opened.clear()
    assert tracking.rows(run, files) == first and opened == []
    common.append_jsonl(run / "stage_1" / "metrics.jsonl", {"update": 2, "run_update": 4, "stage": 1, "loss/policy": 0.5,
                                                            "time": 1100.0})
    again = tracking.rows(run, files)
    assert opened == ["stage_1/metrics.jsonl"]
    assert again == first[:4] + [("train/4", 4, 1100.0, {"train/loss/policy": 0.5})] + first[4:]
    assert again == tracking.rows(run)                        # the same rows as a pass that reads everything


def test_closing_the_trackers_is_bounded_and_a_trackers_error_is_raised(tmp_path, capsys):
    # W&B's finish waits for its uploads, and run_stages.sh waits for the follower at its exit: a tracker that never
    # closes holds the follower 0.2 s (close_s) and no longer; one whose close fails raises its error
    import threading
    import time
    never = threading.Event()

    class Hangs:
        def close(self):
            never.wait()

    class Fails:
        def close(self):
            raise RuntimeError("upload refused")
    follower = object.__new__(tracking.Follower)
    follower.run = tmp_path
    follower.trackers = [Hangs()]
    t0 = time.monotonic()
    follower.close(0.2)
    assert time.monotonic() - t0 < 10.0                        # 0.2 s, with room for a slow machine
    assert "did not close within 0.2 s (close_s)" in capsys.readouterr().err
    follower.trackers = [Fails()]
    with pytest.raises(RuntimeError, match="upload refused"):
        follower.close(5.0)
    never.set()
