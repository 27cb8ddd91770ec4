"""frontier.sh and tools/frontier.py: a reduced frontier on the toy (μ = 2 resident, μ = 4 processes per phase, and
the drift rule), killed and resumed, whose table's numbers are the runs' own records."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, needs_vllm, read_lines, run_script


def frontier_env(toy, out):
    from test_loop import loop_env
    return {**loop_env(toy, out / "unused"), "PRESET": "toy", "OUT": str(out), "MUS": "2 4 drift", "TOTAL_UPDATES": "4",
            "EVAL_UPDATES": "2", "LOSSES": "grpo", "SEEDS": "0", "BUILDS": "0", "RESIDENT_MAX_MU": "2",
            "PROMPTS_PER_UPDATE": "8", "COSTS": "0,20", "DRIFT_FIRST": "2", "ESTIMATE": "false"}


def processes_with(variable):
    """The processes whose environment has `variable` ("NAME=value..." as a prefix of one of its entries)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and any(e.startswith(variable.encode())
                                            for e in (entry / "environ").read_bytes().split(b"\0")):
                found.append(int(entry.name))
        except OSError:
            continue       # gone meanwhile, or not ours to read
    return found


def run_frontier(env):
    proc = subprocess.run(["bash", "frontier.sh"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="session")
def killed_frontier(toy, tmp_path_factory):
    """frontier_env's frontier (GRPO at μ = 2, 4 and drift, 4 updates each), SIGTERMed once its first point has
    finished and while the second trains (every process of every run stops with it), its table drawn then, and
    resumed to its end: (its OUT, what was seen when it stopped: the finished points' results.jsonl, the log, the
    partial table). test_the_notebook_draws_a_frontier_from_its_records draws it too."""
    tmp_path = tmp_path_factory.mktemp("killed_frontier")
    out = tmp_path / "frontier"
    env = frontier_env(toy, out)
    first, second = out / "build0" / "seed0" / "grpo-mu2", out / "build0" / "seed0" / "grpo-mu4"
    # two runs at a time (JOBS=2, each worker on the one core of this test's worker), stopped with SIGTERM once the
    # first point (μ = 2, resident) has finished and while the second (μ = 4, processes per phase) trains its first
    # stage; every process of every run stops with it
    proc = subprocess.Popen(["bash", "frontier.sh"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**os.environ, **env, "JOBS": "2"})
    t0 = time.time()
    while not ((first / ".done" / "all").exists() and (second / "stage_0" / "metrics.jsonl").exists()):
        assert proc.poll() is None and time.time() - t0 < 600, "the frontier ended or took too long"
        time.sleep(0.05)
    finished = {p: (p / "results.jsonl").read_text() for p in (first, second) if (p / ".done" / "all").exists()}
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130 and "cores " in log, log[-3000:]
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for pid in processes_with(f"RUN={out}/")
            if Path(f"/proc/{pid}/cmdline").exists()}
    assert not left, f"a run's process outlived the stopped frontier: {left}"
    partial = run_script("tools/frontier.py", f"--runs_dir={out}", "--baseline=grpo:2", f"--out={tmp_path / 'partial'}")
    stopped = {"finished": finished, "partial": partial.stdout,
               "partial_runs": set(json.loads((tmp_path / "partial" / "frontier.json").read_text())["runs"])}
    run_frontier(env)                                                    # resumed one run at a time (JOBS=1)
    return out, stopped


@pytest.mark.slow
@needs_vllm
def test_a_killed_frontier_resumes_and_its_table_is_the_runs_records(killed_frontier):
    out, stopped = killed_frontier
    first, second = out / "build0" / "seed0" / "grpo-mu2", out / "build0" / "seed0" / "grpo-mu4"
    finished = stopped["finished"]
    # the table of a stopped frontier leaves the unfinished runs out (their last evaluation is not their final)
    if second not in finished:
        assert "left out, not finished: build0/seed0/grpo-mu4" in stopped["partial"]
    assert stopped["partial_runs"] == {f"grpo:{p.name[-1]}" for p in finished}
    for p, results in finished.items():                                  # a finished point is not run again
        assert (p / "results.jsonl").read_text() == results
        assert "is complete; nothing to do" in p.with_suffix(".log").read_text()
    report = json.loads((out / "frontier.json").read_text())
    runs = {k: v["build0/seed0"] for k, v in report["runs"].items()}
    assert set(runs) == {"grpo:2", "grpo:4", "grpo:drift"}
    # the initial policy was evaluated once, by the run that came first (the two started together: the other waited
    # for it), and its rows reused by the others (EVAL_CACHE)
    initial = [next(r for r in read_lines(out / "build0" / "seed0" / name / "results.jsonl") if r["stage"] == -1)
               for name in ("grpo-mu2", "grpo-mu4", "grpo-mudrift")]
    assert sum("reused" not in r for r in initial) == 1 and len({(r["avg_at_k"], r["problems"]) for r in initial}) == 1
    assert len(list((out / "eval_cache").glob("*/rows.json"))) == 1
    # the drift point: its first stage of 2 updates ends without a warning (a 16-update window), the next is planned
    # at 2 · 2 = 4, cut to the 2 updates left
    drift = out / "build0" / "seed0" / "grpo-mudrift"
    ends = [json.loads((drift / f"stage_{s}" / "stage_end.json").read_text()) for s in (0, 1)]
    assert [(e["generated_updates"], e["reason"]) for e in ends] == [(2, "all minibatches"), (2, "all minibatches")]
    assert runs["grpo:drift"]["updates"] == 4 and runs["grpo:drift"]["split"]["stages"] == 2
    for key, run_dir in (("grpo:2", first), ("grpo:4", second)):
        r, results = runs[key], read_lines(run_dir / "results.jsonl")
        last = max(results, key=lambda x: x["stage"])
        assert r["final"] == last["avg_at_k"] and r["curve"][-1][0] == last["updates"] == 4 == r["updates"]
        assert r["final_stderr"] == last["avg_at_k_stderr"] > 0     # one benchmark: its row's standard error
        # evaluated every EVAL_UPDATES = 2 updates, or after every stage when μ is larger
        assert [u for u, _, _ in r["curve"]] == ([0, 2, 4] if key == "grpo:2" else [0, 4])
        split, timeline = r["split"], read_lines(run_dir / "timeline.jsonl")
        assert split["evaluation"] == pytest.approx(sum(t["seconds"] for t in timeline if t["phase"] == "eval"))
        manifests = [json.loads((run_dir / f"stage_{s}" / "rollouts" / "manifest.json").read_text())
                     for s in range(4 // int(key[-1]))]
        assert split["generation"] == pytest.approx(sum(m["generation_seconds"] for m in manifests))
        assert split["stages"] == len(manifests)
        parts = sum(split[k] for k in ("generation", "training", "switching", "evaluation", "idle"))
        assert parts == pytest.approx(split["wall"]) and r["seconds"] == pytest.approx(split["wall"] - split["evaluation"])
        # re-costed at the measured switching per stage, a point takes its measured time
        assert r["seconds"] - split["switching"] + split["switching"] / split["stages"] * split["stages"] == \
            pytest.approx(r["seconds"])
        metrics = [m for s in range(len(manifests)) for m in read_lines(run_dir / f"stage_{s}" / "metrics.jsonl")]
        assert r["staleness"]["max"] == int(key[-1]) - 1 == max(m["staleness"] for m in metrics)
    rows = {f"{p['label']}:{p['mu']}": p for p in report["points"]}
    base = rows["grpo:2"]["speedup"]
    assert base["equal_updates"]["mean"] == 1.0 and all(base["recost"][c]["mean"] == 1.0 for c in ("0.0", "20.0"))
    other = rows["grpo:4"]["speedup"]["equal_updates"]["mean"]
    assert other == pytest.approx(runs["grpo:2"]["seconds"] / runs["grpo:4"]["seconds"])
    assert rows["grpo:4"]["final_stderr"] == runs["grpo:4"]["final_stderr"]    # one run: its own error
    assert f"| grpo μ = 4 | 1 | {runs['grpo:4']['final']:.3f} " in (out / "frontier.md").read_text()
    assert {p.name for p in (out / "plots").iterdir()} == {"frontier_accuracy.png", "frontier_recost.png"}
    assert not (out / "preflight").exists()     # no preflight (the toy preset, ESTIMATE=false): the paper's, stubbed below


@pytest.mark.slow
@needs_vllm
def test_the_notebook_draws_a_frontier_from_its_records(killed_frontier, tmp_path, monkeypatch):
    # the notebook's cells, in order, in a kernel's stead: run from a notebooks/ folder beside bench/ (as in the
    # repository), with a Jupyter kernel's command line (tools/frontier.py must not read it as its own)
    out, _ = killed_frontier
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "tools").symlink_to(ROOT / "tools")
    monkeypatch.chdir(tmp_path / "notebooks")
    monkeypatch.setattr(sys, "argv", ["ipykernel_launcher.py", "-f", str(tmp_path / "kernel.json")])
    monkeypatch.setattr(sys, "path", list(sys.path))             # the cells' path setup is undone after the test
    monkeypatch.delitem(sys.modules, "frontier", raising=False)   # imported by the cells, not found imported
    nb = json.loads((ROOT / "notebooks" / "results.ipynb").read_text())
    settings = {"FRONTIER = '../runs/frontier-lab-fork'": f"FRONTIER = {str(out)!r}",
                "BASELINE = 'grpo:4'": "BASELINE = 'grpo:2'", "COSTS = [0, 2, 20, 180]": "COSTS = [0, 20]"}
    namespace = {}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            code = "".join(cell["source"])
            for default, toy_setting in settings.items():
                code = code.replace(default, toy_setting)
            exec(compile(code, "results.ipynb", "exec"), namespace)
    assert namespace["FRONTIER"] == str(out) and namespace["unfinished"] == []
    assert set(namespace["points"]) == {("grpo", 2), ("grpo", 4), ("grpo", "drift")}
    drawn = namespace["drawn"]
    assert sorted(p.name for p in (tmp_path / "notebooks" / "plots_frontier").iterdir()) == \
        ["frontier_accuracy.png", "frontier_recost.png"] == sorted(p.name for p in drawn)
    accuracy, recost = drawn.values()
    # accuracy against minutes (left) and against updates (right): per point its run's test accuracy at each
    # evaluation (before training, then every 2 updates or after every stage), as its results.jsonl has them, at the
    # seconds to each evaluation frontier.sh's own frontier.json has, in minutes
    report = json.loads((out / "frontier.json").read_text())
    by_minutes, by_updates = ({line.get_label(): line for line in ax.get_lines()} for ax in accuracy.axes)
    for mu, updates in ((2, [0, 2, 4]), (4, [0, 4])):
        results = sorted(read_lines(out / "build0" / "seed0" / f"grpo-mu{mu}" / "results.jsonl"),
                         key=lambda r: r["stage"])
        curve = report["runs"][f"grpo:{mu}"]["build0/seed0"]["curve"]        # [updates, seconds, accuracy]
        line = by_updates[f"grpo μ={mu}"]
        assert list(line.get_xdata()) == updates and list(line.get_ydata()) == [r["avg_at_k"] for r in results]
        line = by_minutes[f"grpo μ={mu}"]
        assert list(line.get_ydata()) == [r["avg_at_k"] for r in results]
        assert list(line.get_xdata()) == pytest.approx([c[1] / 60 for c in curve])
        assert 0 <= curve[0][1] < curve[1][1]
    # the re-costing: per point its speed-up over grpo:2 at c = 0 and 20 s (0 drawn at 0.1), as frontier.json has it
    lines = {line.get_label(): line for line in recost.axes[0].get_lines() if line.get_label().startswith("grpo")}
    speedup = {f"grpo μ={p['mu']}": p["speedup"]["recost"] for p in report["points"]}
    assert sorted(lines) == sorted(speedup) and len(lines) == 3 and list(lines["grpo μ=2"].get_ydata()) == [1.0, 1.0]
    for label, line in lines.items():
        assert list(line.get_xdata()) == [0.1, 20]
        assert list(line.get_ydata()) == pytest.approx([speedup[label]["0.0"]["mean"], speedup[label]["20.0"]["mean"]])


def test_the_estimate_is_the_preflights_compute_for_the_points_updates_plus_a_switch_per_stage(monkeypatch, tmp_path,
                                                                                               capsys):
    # the preflight's stage of 1024 updates: generation 1.0 h, optimization 0.5 h. 4096 updates: 4 such stages of
    # compute (6 h) at any μ; μ = 4 adds 1024 switches, μ = 1024 four: at 180 s each 51.2 h and 0.2 h
    sys.path.insert(0, str(ROOT / "tools"))
    import frontier                              # its --total_updates=4096 --costs=0,180
    monkeypatch.setattr(frontier, "total_updates", 4096)
    monkeypatch.setattr(frontier, "costs_s", [0.0, 180.0])
    hours = frontier.estimate({"estimated_hours_per_stage": {"generate": 1.0, "optimize": 0.5, "grade": 0.3}}, 1024,
                              [4, 1024, "drift"])
    assert hours[4] == {0.0: 6.0, 180.0: pytest.approx(6.0 + 51.2)}
    assert hours[1024] == {0.0: 6.0, 180.0: pytest.approx(6.2)}
    assert hours["drift"] == {0.0: None, 180.0: None}
    # its table: a row per point, its stages (the drift rule's unknown in advance) and hours at each cost
    report = tmp_path / "preflight.json"
    report.write_text(json.dumps({"figures": {"estimated_hours_per_stage": {"generate": 1.0, "optimize": 0.5}}}))
    for name, value in (("estimate_from", str(report)), ("estimate_points", "grpo:4 grpo:1024 grpo:drift"),
                        ("preflight_updates", 1024)):
        monkeypatch.setattr(frontier, name, value)
    frontier.print_estimate()
    assert capsys.readouterr().out.splitlines()[1:] == [
        "| point | stages | c = 0 s | c = 180 s |", "|---|---|---|---|", "| grpo:4 | 1024 | 6.00 | 57.20 |",
        "| grpo:1024 | 4 | 6.00 | 6.20 |", "| grpo:drift | ? | — | — |"]


STUB_RUN_STAGES = """#!/usr/bin/env bash
# records what frontier.sh asked of it; a preflight writes the report the estimate reads
echo "LOSS=$LOSS UPDATES_PER_STAGE=$UPDATES_PER_STAGE STAGES=${STAGES:-} RESIDENT=${RESIDENT:-} PREFLIGHT=${PREFLIGHT:-}" \\
     "PREFLIGHT_ONLY=${PREFLIGHT_ONLY:-} GPUS=${GPUS:-}" \\
     "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-} LR=${LR:-} RUN=$RUN" >> "$RECORD"
if [[ "${PREFLIGHT_ONLY:-}" == true ]]; then
  mkdir -p "$RUN"
  echo '{"passed": true, "figures": {"estimated_hours_per_stage": {"generate": 1, "optimize": 1, "grade": 1}}}' \\
    > "$RUN/preflight.json"
fi
"""


def stubbed_frontier(tmp_path, **env):
    """frontier.sh in a copy of the tree whose run_stages.sh only records its settings (and setup.sh does nothing):
    what frontier.sh asks of each run and preflight, in seconds."""
    tree = tmp_path / "tree"
    for d in ("tools", "mu_grpo", "data"):                      # (a second run: the same tree, its builds kept)
        (tree / d).mkdir(parents=True, exist_ok=True)
    for name in ("frontier.sh", "loss.py", *(str(p.relative_to(ROOT)) for p in (ROOT / "mu_grpo").glob("*.py")),
                 "tools/plot.py", "tools/frontier.py", "tools/regimes.py", "tools/sweep.py"):
        (tree / name).write_bytes((ROOT / name).read_bytes())
    (tree / "setup.sh").write_text("exit 0\n")
    (tree / "run_stages.sh").write_text(STUB_RUN_STAGES + STUB_PROBE)
    (tree / "data" / "lab_fork.py").write_text(STUB_BUILDER)
    record = tmp_path / "record"
    record.touch()
    proc = subprocess.run(["bash", "frontier.sh"], cwd=tree, capture_output=True, text=True, timeout=300, env={
        **os.environ, "MU_GRPO_VENV": str(Path(sys.executable).parents[1]), "RECORD": str(record), "PRESET": "paper",
        "OUT": str(tmp_path / "out"), "MUS": "4 1024", "LOSSES": "grpo mu-grpo", "NAV_DELTAS": "1e-4", "SEEDS": "0",
        **env})
    rows = [dict(kv.split("=", 1) for kv in line.split()) for line in record.read_text().splitlines()
            if line.startswith("LOSS=")]                           # (the stub builder's lines: BUILD=<b>)
    return proc, [r for r in rows if r["PREFLIGHT_ONLY"] == "true"], [r for r in rows if r["PREFLIGHT_ONLY"] != "true"]


def test_the_paper_frontier_runs_one_preflight_per_box_shape_and_splits_the_gpus_between_jobs(tmp_path):
    proc, preflights, runs = stubbed_frontier(tmp_path, GPUS="4", JOBS="2")
    assert "no finished run" in proc.stderr, proc.stderr[-2000:]               # it went on to the table
    # one preflight per LOSS on a worker's share of the box (2 of the 4 GPUs), at the settings of the loss's first
    # resident point (GRPO μ = 4: 1024 stages, resident), before any run; the runs do not run it again
    assert sorted((p["LOSS"], p["GPUS"], p["CUDA_VISIBLE_DEVICES"], p["UPDATES_PER_STAGE"], p["STAGES"], p["RESIDENT"])
                  for p in preflights) == [("grpo", "2", "0,1", "4", "1024", "true"),
                                           ("mu-grpo", "2", "0,1", "4", "1024", "true")]
    assert len(runs) == 4 and all(r["PREFLIGHT"] == "0" and r["GPUS"] == "2" for r in runs)
    # the estimate, from the first preflight's report (1 h + 1 h per stage of its 4 updates; the paper's 4096 updates)
    estimate = (tmp_path / "out" / "estimate.md").read_text().splitlines()
    assert estimate[3:5] == ["| grpo:4 | 1024 | 2048.00 | 2048.57 | 2053.69 | 2099.20 |",
                             "| grpo:1024 | 4 | 2048.00 | 2048.00 | 2048.02 | 2048.20 |"]
    assert {r["CUDA_VISIBLE_DEVICES"] for r in runs} <= {"0,1", "2,3"}
    proc, preflights, runs = stubbed_frontier(tmp_path / "three", GPUS="4", JOBS="3")
    assert proc.returncode == 2 and not preflights and not runs
    assert len(proc.stderr.strip().splitlines()) == 1 and "JOBS=3" in proc.stderr


def test_a_point_may_carry_its_learning_rate_and_runs_in_the_order_given(tmp_path):
    # POINTS in its order, each at its own LR (docs/bakeoff.md's arms); the environment's LR for a
    # point without one
    points = "mu-grpo-d1e-4:1024@1e-5 grpo:4@3e-5 grpo:1024"
    proc, _, runs = stubbed_frontier(tmp_path, POINTS=points, LR="7e-6", KEY_POINTS="", JOBS="1")
    assert "no finished run" in proc.stderr, proc.stderr[-2000:]    # it went on to the table
    asked = [(r["RUN"].rsplit("/", 1)[1], r["LOSS"], r["UPDATES_PER_STAGE"], r["LR"]) for r in runs]
    assert asked == [("mu-grpo-d1e-4-mu1024", "mu-grpo", "1024", "1e-5"),
                     ("grpo-mu4", "grpo", "4", "3e-5"), ("grpo-mu1024", "grpo", "1024", "7e-6")]


def test_a_points_learning_rate_is_a_positive_number_and_each_label_mu_runs_once(monkeypatch,
                                                                                 capsys):
    # refused in one line before any run: a learning rate that is no positive number; one label:μ
    # twice (one directory)
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import sweep
    for name, value in dict(losses="grpo", nav_deltas="1e-4", mus="4 64", baseline="grpo:4",
                            key_points="", total_updates="256", eval_updates="64",
                            resident_max_mu="64").items():
        monkeypatch.setattr(sweep, name, value)
    for points, named in (("grpo:4@fast", "'fast'"), ("grpo:4@-1e-5", "'-1e-5'"),
                          ("grpo:4@inf", "'inf'"),
                          ("grpo:4@1e-5 grpo:4@3e-5", "each label:μ once")):
        monkeypatch.setattr(sweep, "points", points)
        with pytest.raises(SystemExit) as refused:
            sweep.all_points()
        assert refused.value.code == 2 and named in capsys.readouterr().err
    monkeypatch.setattr(sweep, "points", "grpo:64@3e-5 grpo:4")
    assert sweep.all_points() == ["grpo:64@3e-5", "grpo:4"]
    assert sweep.point_env("grpo:64@3e-5")["LR"] == "3e-5" and "LR" not in sweep.point_env("grpo:4")


def test_the_gpus_are_split_evenly_between_jobs_or_refused():
    from mu_grpo import pool
    assert pool.gpu_slices(4, 2, None) == ["0,1", "2,3"]
    assert pool.gpu_slices(4, 4, "GPU-a,GPU-b,GPU-c,GPU-d") == ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
    assert pool.gpu_slices(2, 1, "3,5") == ["3,5"]
    for gpus, jobs in ((4, 3), (2, 4)):
        with pytest.raises(SystemExit, match=f"JOBS={jobs}"):
            pool.gpu_slices(gpus, jobs, None)


# ------------------------------------------------------------------ regimes, the rule over builds, paired intervals
STUB_BUILDER = """import json, os, sys
from pathlib import Path
args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
out = Path(args["out_dir"])
(out / "model").mkdir(parents=True, exist_ok=True)
(out / "model" / "config.json").write_text("{}")
(out / "heldout.jsonl").write_text("")
with open(os.environ["RECORD"], "a") as f:
    f.write(f"BUILD={args['seed']}\\n")
"""

# a probe's records, as run_stages.sh leaves them: the held-out accuracy before and after, the updates' metrics
STUB_PROBE = """
if [[ "$RUN" == */regimes/* ]]; then
  read -r initial final zero <<< "$(tr ' ' '\\n' <<< "$PROBE_TABLE" | sed -n "s|^${MODEL%/model}:||p" | tr : ' ')"
  mkdir -p "$RUN/stage_0" "$RUN/.done"
  printf '{"stage": -1, "updates": 0, "hours": 0, "avg_at_k": %s}\\n{"stage": 1, "updates": %s, "hours": 0.1, "avg_at_k": %s}\\n' \\
    "$initial" "$(( STAGES * UPDATES_PER_STAGE ))" "$final" > "$RUN/results.jsonl"
  for u in 1 2; do echo "{\\"minibatch/zero_variance_frac\\": $zero}" >> "$RUN/stage_0/metrics.jsonl"; done
  touch "$RUN/.done/all"
fi
"""


def probe_table_of(table):
    """STUB_PROBE's PROBE_TABLE: each build's task directory with its initial accuracy, its accuracy
    after the probe and its zero-variance fraction."""
    return " ".join(f"data/lab_fork{'' if b == 0 else f'_build{b}'}:{i}:{f}:{z}"
                    for b, (i, f, z) in table.items())


@pytest.mark.slow
def test_the_rule_builds_and_probes_candidates_until_it_has_enough_of_each_regime_and_the_sweep_runs_on_the_first(
        tmp_path):
    # build: initial accuracy, after the probe, zero-variance fraction → regime (climb_min 0.1, solves_most 0.5)
    table = {0: (0.02, 0.04, 0.9), 1: (0.05, 0.08, 0.8), 2: (0.14, 0.40, 0.5), 3: (0.60, 0.70, 0.3),
             4: (0.10, 0.15, 0.7), 5: (0.20, 0.50, 0.4)}    # stalls, stalls, learns, saturated, stalls, learns
    regimes = {0: "stalls", 1: "stalls", 2: "learns", 3: "saturated", 4: "stalls", 5: "learns"}
    probe_table = probe_table_of(table)
    env = {"PRESET": "lab-fork", "MUS": "4 256", "NAV_DELTAS": "1e-4", "SEEDS": "0 1", "JOBS": "2",
           "KEY_POINTS": "grpo:4 mu-grpo-d1e-4:256", "PROBE_UPDATES": "8", "PROBE_TABLE": probe_table,
           "REGIMES": "learns:2 stalls:2"}
    for attempt in ("first", "again"):
        proc, _, runs = stubbed_frontier(tmp_path, **env)
        assert "no finished run" in proc.stderr, proc.stderr[-3000:]                # it went on to the table
        record = (tmp_path / "record").read_text().splitlines()
        builds = [line for line in record if line.startswith("BUILD=")]
        probes = [r for r in runs if "/regimes/" in r["RUN"]]
        if attempt == "again":                                    # built and probed once: nothing again
            assert not builds and not probes
            break
        # candidates in order until 2 learn and 2 stall: 0 and 1 stall, 2 learns, 3 is saturated, 4 a third that
        # stalls, 5 learns: six looked at, four kept
        assert builds == [f"BUILD={b}" for b in range(6)]
        assert [(r["RUN"].rsplit("/", 1)[1], r["LOSS"], r["UPDATES_PER_STAGE"], r["STAGES"]) for r in probes] == \
            [(f"build{b}", "grpo", "4", "2") for b in range(6)]
        for b in range(6):
            measured = json.loads((tmp_path / "out" / "regimes" / f"build{b}.json").read_text())
            initial, final, zero = table[b]
            assert measured["regime"] == regimes[b] and measured["updates"] == 8
            assert (measured["initial"], measured["climb"], measured["groups_with_variance"]) == \
                pytest.approx((initial, final - initial, 1 - zero))
        selection = json.loads((tmp_path / "out" / "regimes" / "selection.json").read_text())
        assert selection["kept"] == [0, 1, 2, 5] and selection["candidates"] == list(range(6))
        assert "looked at 6 build(s) and kept 4" in proc.stderr
        # the key points on every kept build and seed; the rest of the sweep on the first build of each regime
        # (2 learns, 0 stalls), seed 0
        ran = sorted(r["RUN"].split("/out/", 1)[1] for r in runs if "/regimes/" not in r["RUN"])
        key = [f"build{b}/seed{s}/{p}" for b in (0, 1, 2, 5) for s in (0, 1) for p in ("grpo-mu4", "mu-grpo-d1e-4-mu256")]
        sweep = [f"build{b}/seed0/{p}" for b in (0, 2) for p in ("grpo-mu256", "mu-grpo-d1e-4-mu4")]
        assert ran == sorted(key + sweep)
        (tmp_path / "record").write_text("")


@pytest.mark.slow
def test_points_probes_builds_and_probes_the_rules_candidates_and_runs_nothing_else(tmp_path):
    # builds 0 and 1 stall, 2 learns (as above): REGIMES=learns:1 looks at three, keeps build 2, and
    # stops there
    table = {0: (0.02, 0.04, 0.9), 1: (0.05, 0.08, 0.8), 2: (0.14, 0.40, 0.5)}
    proc, _, runs = stubbed_frontier(tmp_path, PRESET="lab-fork", MUS="4 64", POINTS="probes",
                                     PROBE_UPDATES="8", PROBE_TABLE=probe_table_of(table),
                                     REGIMES="learns:1", MIN_BUILDS="1", CANDIDATES="0 1 2 3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["RUN"].split("/out/", 1)[1] for r in runs] == [f"regimes/build{b}" for b in range(3)]
    assert proc.stdout.splitlines()[-1] == "the rule's builds: 2 (POINTS=probes: no run)"
    assert json.loads((tmp_path / "out" / "regimes" / "selection.json").read_text())["kept"] == [2]
    assert not (tmp_path / "out" / "frontier.md").exists()


def test_the_clipped_share_is_the_clips_two_sides_and_none_for_a_loss_without_a_clip(monkeypatch):
    # (frontier.sh over CISPO, TOPR, ... stopped at its table: a KeyError on clip/upper_frac)
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import frontier
    rows = [{"clip/upper_frac": 0.1, "clip/lower_frac": 0.2},
            {"clip/upper_frac": 0.3, "clip/lower_frac": 0.1},
            {"clip/upper_frac": None, "clip/lower_frac": 0.5}]          # a non-finite update: out
    assert frontier.clipped_frac(rows) == pytest.approx(0.35)
    assert frontier.clipped_frac([{"cispo/truncated_frac": 0.2}]) is None


def test_the_t_tests_p_value_and_holms_correction_against_closed_forms(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import plot
    # closed forms: df 1 is Cauchy, p = 1 − (2/π)·atan|t|; df 2, p = 1 − |t|/√(t² + 2); the tabled 97.5 % points give 0.05
    for t in (0.3, 1.0, 2.5, 12.706):
        assert plot.t_two_sided_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), abs=1e-10)
        assert plot.t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(t * t + 2), abs=1e-10)
    for df, t in ((3, 3.182), (5, 2.571), (10, 2.228), (30, 2.042)):
        assert plot.t_two_sided_p(t, df) == pytest.approx(0.05, abs=2e-4)       # the table's 3 decimals
    # [1, 2, 3, 4] − 0: t = 2.5 / (1.2910 / 2) = 3.873, df 3 → p = 0.0305 (df 3: p = 1 − I, its own closed form
    # 1 − (2/π)(atan(t/√3) + (t/√3)/(1 + t²/3)))
    mean, low, high, p = plot.paired_test([1.0, 2.0, 3.0, 4.0])
    u = 3.8730 / math.sqrt(3)
    assert p == pytest.approx(1 - 2 / math.pi * (math.atan(u) + u / (1 + u * u)), abs=1e-4)
    # no spread: the same difference everywhere is p 0, none at all (two bit-identical arms) p 1
    assert plot.paired_test([0.5, 0.5, 0.5])[3] == 0.0
    assert plot.paired_test([0.0, 0.0, 0.0])[3] == 1.0
    # Holm over four: sorted 0.005, 0.01, 0.03, 0.04 × 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 → running max 0.06
    assert plot.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])


def test_a_95_percent_t_interval_and_the_verdicts_by_hand(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import plot
    import regimes
    # [1, 2, 3, 4]: mean 2.5, sd √(5/3) = 1.2910, t(0.975, df 3) = 3.182: half-width 3.182 · 1.2910 / 2 = 2.0540
    mean, low, high = plot.t_interval([1.0, 2.0, 3.0, 4.0])
    assert (mean, low, high) == pytest.approx((2.5, 0.4460, 4.5540), abs=1e-4)
    # [0.1, 0.3]: sd 0.1414, df 1: t 12.706, half-width 12.706 · 0.1414 / √2 = 1.2706
    assert plot.t_interval([0.1, 0.3]) == pytest.approx((0.2, -1.0706, 1.4706), abs=1e-4)
    # df 35 is read at the tabled df 30 (2.042: wider than the exact 2.030)
    values = [0.0, 1.0] * 18
    half = 2.042 * math.sqrt(sum((v - 0.5) ** 2 for v in values) / 35) / 6
    assert plot.t_interval(values) == pytest.approx((0.5, 0.5 - half, 0.5 + half))
    assert plot.t_interval([0.3]) == (0.3, None, None)
    assert [regimes.verdict("<", *ci, 0.01) for ci in ((-0.2, -0.1), (-0.2, 0.1), (0.1, 0.2))] == \
        ["reproduced", "not shown", "reversed"]
    assert [regimes.verdict(">", *ci, 0.01) for ci in ((0.1, 0.2), (-0.2, 0.1), (-0.2, -0.1))] == \
        ["reproduced", "not shown", "reversed"]
    # "matches" (margin 0.05): the interval above −0.05, however far up; below zero entirely: reversed
    assert [regimes.verdict("≥", *ci, 0.01) for ci in ((-0.04, 0.3), (-0.06, 0.01), (-0.2, -0.01), (-0.04, -0.01))] == \
        ["reproduced", "not shown", "reversed", "reproduced"]
    assert regimes.verdict("<", None, None, None) == "—"
    # an interval that excludes zero is not enough: its Holm-adjusted p above alpha (0.05) is "not shown"
    assert [regimes.verdict("<", -0.2, -0.1, p) for p in (0.05, 0.06)] == ["reproduced", "not shown"]


def test_the_comparisons_are_over_builds_with_seeds_averaged_within_each_and_holm_over_the_family(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import regimes
    # grpo 256 − grpo 4 per seed: build0 (stalls) −0.06, −0.09; build1 −0.50, −0.40; build2 −0.55, −0.45; build3
    # −0.35, −0.45 (learn); build7 has no μ = 256 run: in no pair
    diffs = {"build0": (-0.06, -0.09), "build1": (-0.50, -0.40), "build2": (-0.55, -0.45), "build3": (-0.35, -0.45)}
    points = {("grpo", 4): {(b, f"seed{s}"): {"final": 0.6} for b in diffs for s in (0, 1)},
              ("grpo", 256): {(b, f"seed{s}"): {"final": 0.6 + d[s]} for b, d in diffs.items() for s in (0, 1)}}
    points[("grpo", 4)][("build7", "seed0")] = {"final": 0.5}
    # a point of the rest of the sweep (not a key point), on two of the builds: described, not in Holm's family
    points[("grpo", 16)] = {(b, "seed0"): {"final": f} for b, f in (("build0", 0.5), ("build1", 0.3))}
    measured = {"build0": {"regime": "stalls"}, **{f"build{b}": {"regime": "learns"} for b in (1, 2, 3)}}
    compared = regimes.comparisons(points, measured, {("grpo", 4), ("grpo", 256)})
    sweep = {r["regime"]: r for r in compared if r["point"] == "grpo:16"}
    assert sweep["all"]["p"] is not None and (sweep["all"]["holm"], sweep["all"]["verdict"]) == (None, "not tested (sweep)")
    rows = {r["regime"]: r for r in compared if r["point"] == "grpo:256"}
    assert sorted(rows) == ["all", "learns", "stalls"]
    stalls, learns, both = rows["stalls"], rows["learns"], rows["all"]
    assert stalls["claim"] == "GRPO's clip fails at μ = 256"
    # one build per difference, the mean of its seeds': learns −0.45, −0.50, −0.40 (not the six seeds' pairs)
    assert learns["differences"] == pytest.approx([-0.45, -0.50, -0.40]) and learns["pairs"] == 6
    # over builds: mean −0.45, sd 0.05, df 2: half-width 4.303 · 0.05 / √3 = 0.1242; t = −0.45 / (0.05 / √3) =
    # −15.588, df 2: p = 1 − |t| / √(t² + 2) = 0.00410
    assert (learns["mean"], learns["low"], learns["high"]) == pytest.approx((-0.45, -0.5742, -0.3258), abs=1e-4)
    t = 0.45 / (0.05 / math.sqrt(3))
    assert learns["p"] == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-6)
    # the stalling regime has one build: no interval, no p, no verdict
    assert stalls["differences"] == pytest.approx([-0.075]) and (stalls["p"], stalls["verdict"]) == (None, "—")
    # all four builds: −0.075, −0.45, −0.50, −0.40: mean −0.35625, sd 0.19493, t = −3.6552, df 3: p = 1 − (2/π)(atan u
    # + u / (1 + u²)), u = |t| / √3
    values = [-0.075, -0.45, -0.50, -0.40]
    sd = math.sqrt(sum((v + 0.35625) ** 2 for v in values) / 3)
    u = 0.35625 / (sd / 2) / math.sqrt(3)
    assert both["mean"] == pytest.approx(-0.35625) and both["pairs"] == 8
    assert both["p"] == pytest.approx(1 - 2 / math.pi * (math.atan(u) + u / (1 + u * u)), rel=1e-6)
    # Holm over the family's two p values (grpo 16's is not in it): the smaller × 2, the larger × 1 but never below
    # the first
    small, large = sorted((learns["p"], both["p"]))
    assert sorted((learns["holm"], both["holm"])) == pytest.approx([2 * small, max(2 * small, large)])
    assert learns["verdict"] == "reproduced" and stalls["holm"] is None


def test_the_papers_claims_are_made_at_each_large_mu_and_say_how_many_stages_it_ran(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import regimes
    # 256 updates each: μ = 64 is four stages (the paper's shape), μ = 256 one stage on the initial policy's rollouts
    final = {("grpo", 4): [0.6, 0.7], ("grpo", 64): [0.5, 0.4], ("grpo", 256): [0.2, 0.3],
             ("mu-grpo-d1e-4", 64): [0.1, 0.2], ("mu-grpo-d1e-4", 256): [0.7, 0.6]}
    points = {k: {(f"build{b + 1}", "seed0"): {"final": f, "updates": 256} for b, f in enumerate(v)} for k, v in final.items()}
    learning = {"build1": {"regime": "learns"}, "build2": {"regime": "learns"}}
    rows = {(r["point"], r["against"]): r for r in regimes.comparisons(points, learning)}
    assert rows["grpo:64", "grpo:4"]["claim"] == "GRPO's clip fails at μ = 64 (4 stages)"
    assert rows["grpo:256", "grpo:4"]["claim"] == "GRPO's clip fails at μ = 256 (1 stage)"
    four = rows["mu-grpo-d1e-4:64", "grpo:4"]
    assert four["claim"] == "μ-GRPO (δ 1e-4) at μ = 64 (4 stages) matches GRPO at μ = 4"
    assert four["differences"] == pytest.approx([-0.5, -0.5]) and four["verdict"] == "reversed"
    assert rows["mu-grpo-d1e-4:64", "grpo:64"]["differences"] == pytest.approx([-0.4, -0.2])
    assert rows["mu-grpo-d1e-4:256", "grpo:256"]["verdict"] != "—" and len(rows) == 6   # no μ-GRPO at μ = 4
    assert regimes.stages_of(points, ("grpo", 4)) == " (64 stages)" and regimes.stages_of({}, ("grpo", 4)) == ""


def test_the_rule_keeps_the_first_builds_of_each_regime_in_candidate_order(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import regimes
    assert [regimes.regime_name(i, c) for i, c in ((0.02, 0.03), (0.14, 0.1), (0.14, 0.099), (0.5, 0.3))] == \
        ["stalls", "learns", "stalls", "saturated"]
    measured = {f"build{b}": {"regime": r} for b, r in enumerate(["stalls", "learns", "stalls", "stalls", "learns"])}
    kept, by_regime = regimes.select_builds(measured, [4, 3, 2, 1, 0], {"learns": 2, "stalls": 2})
    assert kept == [4, 3, 2, 1] and by_regime == {"learns": [4, 1], "stalls": [3, 2, 0]}
    assert regimes.select_builds(measured, [0, 1, 2], {"learns": 2})[0] == [1]
    # quotas per regime: the first learning build and the first two stalling ones
    assert regimes.select_builds(measured, [0, 1, 2, 3, 4], {"learns": 1, "stalls": 2})[0] == [0, 1, 2]
    # one build stalls in five: the quotas give three, the next candidate of a kept regime (not a saturated one) a fourth
    measured = {f"build{b}": {"regime": r} for b, r in enumerate(["saturated", "learns", "learns", "stalls", "learns"])}
    assert regimes.select_builds(measured, [0, 1, 2, 3, 4], {"learns": 2, "stalls": 2}, least=4)[0] == [1, 2, 3, 4]
    assert regimes.select_builds(measured, [0, 1, 2, 3, 4], {"learns": 2, "stalls": 2})[0] == [1, 2, 3]
    assert regimes.select_builds(measured, [0, 1, 2, 3, 4], {"learns": 1, "stalls": 1}, least=4)[0] == [1, 2, 3, 4]
    # the default: three that learn, one that stalls; four candidates suffice when the fourth is the one that stalls
    assert regimes.parse_quotas(regimes.regimes) == {"learns": 3, "stalls": 1}
    assert regimes.select_builds(measured, [1, 2, 3, 4], regimes.parse_quotas("learns:3 stalls:1"), 4)[0] == [1, 2, 3, 4]
    for bad in ("learns", "learns:0", "learns:2 learns:1", "fast:2", "learns:x", ""):
        with pytest.raises(SystemExit, match="regimes: "):
            regimes.parse_quotas(bad)


def test_other_losses_at_small_mu_are_compared_with_grpo_and_mu_grpo_there_without_a_papers_sign(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import regimes
    # relaxed-low (μ-GRPO's lower clip alone) against grpo and μ-GRPO at μ = 4: differences −0.05, −0.07 (mean −0.06,
    # sd 0.01414, df 1: half-width 12.706 · 0.01414 / √2 = 0.1271) and +0.01, −0.01 (mean 0: not shown)
    final = {("grpo", 4): [0.30, 0.40], ("mu-grpo-d1e-4", 4): [0.24, 0.34], ("relaxed-low-d1e-4", 4): [0.25, 0.33],
             ("grpo", 256): [0.1, 0.2], ("relaxed-low-d1e-4", 256): [0.5, 0.5]}
    points = {k: {(f"build{b + 1}", "seed0"): {"final": f} for b, f in enumerate(v)} for k, v in final.items()}
    learning = {"build1": {"regime": "learns"}, "build2": {"regime": "learns"}}
    rows = {(r["point"], r["against"]): r for r in regimes.comparisons(points, learning)}
    low = rows["relaxed-low-d1e-4:4", "grpo:4"]
    assert (low["direction"], low["verdict"]) == ("≠", "not shown")
    assert (low["mean"], low["low"], low["high"]) == pytest.approx((-0.06, -0.1871, 0.0671), abs=1e-4)
    assert rows["relaxed-low-d1e-4:4", "mu-grpo-d1e-4:4"]["mean"] == pytest.approx(0.0)
    # at every μ it ran at: relaxed-low μ = 256 against grpo μ = 256 (0.5 − 0.1, 0.5 − 0.2), no μ-GRPO there
    assert rows["relaxed-low-d1e-4:256", "grpo:256"]["differences"] == pytest.approx([0.4, 0.3])
    assert ("relaxed-low-d1e-4:256", "mu-grpo-d1e-4:256") not in rows
    # the drift rule against each fixed μ of its loss: 0.5 − 0.1, 0.5 − 0.2 against grpo μ = 256 (+0.35)
    points[("grpo", "drift")] = {(f"build{b}", "seed0"): {"final": 0.5} for b in (1, 2)}
    listed = [(r["point"], r["against"]) for r in regimes.comparisons(points, learning)]
    assert len(listed) == len(set(listed)) == 7     # each once: grpo 256 − 4, μ-GRPO 4 − grpo 4, drift − 4 and − 256,
                                                    # relaxed-low − 2 at μ = 4, − grpo at μ = 256
    rows = {(r["point"], r["against"]): r for r in regimes.comparisons(points, learning)}
    assert rows["grpo:drift", "grpo:256"]["differences"] == pytest.approx([0.4, 0.3])
    assert rows["grpo:drift", "grpo:256"]["direction"] == "≠" and ("grpo:drift", "grpo:4") in rows
    assert [regimes.verdict("≠", *ci, 0.01) for ci in ((-0.2, -0.1), (-0.1, 0.1), (0.1, 0.2))] == \
        ["below", "not shown", "above"]


def test_runs_evaluated_at_other_update_counts_are_averaged_at_each_runs_last_evaluation_before_it(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import frontier
    # two drift runs evaluated at their stage ends: (updates, seconds, accuracy)
    a = [(0, 0.0, 0.1), (37, 50.0, 0.2), (72, 100.0, 0.3), (256, 300.0, 0.5)]
    b = [(0, None, 0.1), (64, 80.0, 0.4), (256, 280.0, 0.6)]
    assert frontier.point_curve([a, b]) == [pytest.approx(e) for e in
                                           ((0, 0.0, 0.1), (37, 25.0, 0.15), (64, 65.0, 0.3), (72, 90.0, 0.35), (256, 290.0, 0.55))]
    # runs evaluated at the same counts: the mean at each; a run that stopped early bounds the curve
    assert frontier.point_curve([a[:3], a]) == [pytest.approx(e) for e in a[:3]]


def test_the_points_are_each_loss_at_each_mu_and_a_preset_with_nav_once_per_delta(monkeypatch):
    # a preset has NAV when its row in loss.PRESETS has a NAV δ, whatever its name; drift runs every stage's
    # evaluation from DRIFT_FIRST; a fixed μ is evaluated every EVAL_UPDATES updates, after every stage when larger
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import sweep
    for name, value in dict(losses="grpo mu-grpo relaxed-no-nav nav-T", nav_deltas="1e-4 0.1", mus="4 64 drift",
                            points="", baseline="grpo:4", key_points="", total_updates="128", eval_updates="32",
                            drift_first="16", resident_max_mu="16").items():
        monkeypatch.setattr(sweep, name, value)
    labels = ["grpo", "mu-grpo-d1e-4", "mu-grpo-d0.1", "relaxed-no-nav", "nav-T-d1e-4", "nav-T-d0.1"]
    assert sweep.all_points() == [f"{label}:{mu}" for label in labels for mu in ("4", "64", "drift")]
    assert sweep.point_env("nav-T-d0.1:4") == {"LOSS": "nav-T", "NAV_DELTA": "0.1", "RESIDENT": "true",
                                               "STAGE_END": "fixed", "STAGES": "32", "UPDATES_PER_STAGE": "4",
                                               "EVAL_EVERY": "8", "DRIFT_ARGS": "", "DRIFT_MAX_UPDATES": ""}   # (drift's)
    assert sweep.point_env("grpo:64")["EVAL_EVERY"] == "1" and sweep.point_env("grpo:64")["RESIDENT"] == "false"
    assert sweep.point_env("mu-grpo-d1e-4:drift") == {
        "LOSS": "mu-grpo", "NAV_DELTA": "1e-4", "RESIDENT": "true", "STAGE_END": "drift", "UPDATES_PER_STAGE": "16",
        "TOTAL_UPDATES": "128", "DRIFT_MAX_UPDATES": "128", "EVAL_EVERY": "1"}
    monkeypatch.setattr(sweep, "key_points", "grpo:8")
    with pytest.raises(SystemExit) as refused:
        sweep.all_points()
    assert refused.value.code == 2


def test_the_runs_are_the_key_points_everywhere_then_the_sweep_on_its_builds(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import sweep
    monkeypatch.setattr(sweep, "seeds", "0 1")
    monkeypatch.setattr(sweep, "sweep_seeds", "0")
    monkeypatch.setattr(sweep, "key_points", "a:4 b:64")
    order = sweep.runs_in_order(["a:4", "a:64", "b:64"], kept=[3, 5], sweep=[5, 7])
    assert order == [(3, "0", "a:4"), (5, "0", "a:4"), (3, "0", "b:64"), (5, "0", "b:64"), (5, "0", "a:64"),
                     (3, "1", "a:4"), (5, "1", "a:4"), (3, "1", "b:64"), (5, "1", "b:64")]
