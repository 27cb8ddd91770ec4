"""table1.sh and tools/table1.py: the plan (runs.txt), the table's arithmetic on runs timed by hand, the Slurm array's
command lines, and (slow) the toy standing in for a model, one run killed and resumed, every cell back to its row."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, kill_when, needs_vllm, read_lines

sys.path.insert(0, str(ROOT / "tools"))
import table1  # noqa: E402


def plan_with(monkeypatch, tmp_path, paper_hours=None, **knobs):
    settings = {"runs_dir": str(tmp_path), "preset": "paper", "models": "Qwen/Qwen2.5-Math-7B toy",
                "methods": "grpo:4 mu-grpo:1024", "total_updates": 4096, "eval_updates": 1024, "resident_max_mu": 64}
    for k, v in {**settings, **knobs}.items():
        monkeypatch.setattr(table1, k, v)
    return table1.plan(paper_hours)


def test_the_plan_is_every_model_by_every_method_at_equal_updates(monkeypatch, tmp_path, capsys):
    # GRPO μ = 4 on Qwen2.5-Math-7B took the paper 23.7 h: a resume point every 2 h of it is every
    # int(1024 stages · 2 / 23.7) = 86 stages; the toy has no paper hours: every 1024 / 32 = 32 stages
    prepares, runs = plan_with(monkeypatch, tmp_path, {("Qwen2.5-Math-7B", "grpo:4"): 23.7})
    table1.write_plan(prepares, runs)
    assert capsys.readouterr().out == "2 4\n"
    cache = f"EVAL_CACHE={tmp_path}/eval_cache"
    qwen = f"PRESET=paper MODEL=Qwen/Qwen2.5-Math-7B RUN={tmp_path}/Qwen2.5-Math-7B"
    assert (tmp_path / "runs.txt").read_text().splitlines() == [
        f"{qwen}/grpo-mu4 LOSS=grpo STAGES=1024 UPDATES_PER_STAGE=4 RESIDENT=true EVAL_EVERY=256 {cache} "
        f"SAVE_EVERY=86 PREFLIGHT=0 PREFLIGHT_REPORT={qwen[len('PRESET=paper MODEL=Qwen/Qwen2.5-Math-7B RUN='):]}"
        f"/prepare/preflight.json",     # 4096 / 4 stages, every 1024 updates; checked once, its preflight's decisions
        f"{qwen}/mu-grpo-mu1024 LOSS=mu-grpo STAGES=4 UPDATES_PER_STAGE=1024 RESIDENT=false EVAL_EVERY=1 {cache} "
        f"PREFLIGHT=0 PREFLIGHT_REPORT={tmp_path}/Qwen2.5-Math-7B/prepare/preflight.json",
        f"PRESET=toy RUN={tmp_path}/toy/grpo-mu4 LOSS=grpo STAGES=1024 UPDATES_PER_STAGE=4 RESIDENT=true "
        f"EVAL_EVERY=256 {cache} SAVE_EVERY=32",                 # a CPU preset stands in for a model: no preflight
        f"PRESET=toy RUN={tmp_path}/toy/mu-grpo-mu1024 LOSS=mu-grpo STAGES=4 UPDATES_PER_STAGE=1024 RESIDENT=false "
        f"EVAL_EVERY=1 {cache}"]
    # one preparation per model, at its first resident method's settings: the preflight, the initial evaluation
    assert (tmp_path / "prepare.txt").read_text().splitlines() == [
        f"{qwen}/prepare LOSS=grpo STAGES=1024 UPDATES_PER_STAGE=4 RESIDENT=true EVAL_EVERY=256 {cache} SAVE_EVERY=86 "
        f"PREFLIGHT_ONLY=true",
        f"PRESET=toy RUN={tmp_path}/toy/prepare LOSS=grpo STAGES=1024 UPDATES_PER_STAGE=4 RESIDENT=true EVAL_EVERY=256 "
        f"{cache} SAVE_EVERY=32 PREFLIGHT_ONLY=true"]
    assert table1.read_plan(tmp_path) == [
        ("Qwen/Qwen2.5-Math-7B", "grpo:4", f"{tmp_path}/Qwen2.5-Math-7B/grpo-mu4"),
        ("Qwen/Qwen2.5-Math-7B", "mu-grpo:1024", f"{tmp_path}/Qwen2.5-Math-7B/mu-grpo-mu1024"),
        ("toy", "grpo:4", f"{tmp_path}/toy/grpo-mu4"), ("toy", "mu-grpo:1024", f"{tmp_path}/toy/mu-grpo-mu1024")]


def test_every_papers_resident_run_saves_a_resume_point_every_two_of_its_hours(monkeypatch, tmp_path):
    numbers = json.loads((ROOT / "tools" / "table1_paper.json").read_text())["models"]
    hours = {(m, method): r["t_total_h"] for m, rows in numbers.items() for method, r in rows.items()}
    _, runs = plan_with(monkeypatch, tmp_path, hours, models=" ".join(
        ["meta-llama/Llama-3.2-3B-Instruct", "Qwen/Qwen2.5-Math-7B", "Qwen/Qwen3-1.7B-Base", "Qwen/Qwen3-8B-Base",
         "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"]), methods="grpo:4")
    for run, env in runs:
        paper_h = hours[(Path(run).parent.name, "grpo:4")]
        assert paper_h / 1024 * int(env["SAVE_EVERY"]) <= 2.0, (run, env["SAVE_EVERY"])     # ≤ 2 h between saves


@pytest.mark.parametrize("knobs,line", [
    ({"methods": "grpo:4 grpo"}, "METHODS: 'grpo' is not <LOSS preset>:<μ>"),
    ({"methods": "grpo:4 mu-grpo:3"}, "μ = 3 of 'mu-grpo:3' does not divide TOTAL_UPDATES=4096"),
    ({"methods": "gpro:4"}, "LOSS must be one of mu-grpo grpo"),
    ({"models": "toy toy"}, "names a run twice"),
])
def test_a_bad_plan_is_refused_in_one_line(monkeypatch, tmp_path, capsys, knobs, line):
    with pytest.raises(SystemExit) as e:
        plan_with(monkeypatch, tmp_path, **knobs)
    err = capsys.readouterr().err
    assert e.value.code == 2 and line in err and err.count("\n") == 1


def write_run(run, timeline, results, generation_seconds, finished=True):
    """A run's records, written by hand: its timeline, results rows and each stage's generation seconds."""
    run.mkdir(parents=True)
    (run / "timeline.jsonl").write_text("".join(json.dumps(t) + "\n" for t in timeline))
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    for s, g in enumerate(generation_seconds):
        (run / f"stage_{s}" / "rollouts").mkdir(parents=True)
        (run / f"stage_{s}" / "rollouts" / "manifest.json").write_text(json.dumps({"generation_seconds": g}))
    if finished:
        (run / ".done").mkdir()
        (run / ".done" / "all").touch()


def phase(name, kind, stage, start, end):
    return {"phase": kind, "name": name, "stage": stage, "start": start, "end": end, "seconds": end - start}


def result(stage, benchmark, avg, stderr, updates):
    return {"stage": stage, "updates": updates, "benchmark": benchmark, "k": 4, "avg_at_k": avg,
            "avg_at_k_stderr": stderr}


def test_the_tables_numbers_by_hand(tmp_path):
    runs = tmp_path / "runs"
    # the baseline: evaluations 10 + 20 s of a 220 s wall-clock, 72 s of sampling
    write_run(runs / "M" / "grpo-mu4", [phase("eval_init", "eval", -1, 0, 10), phase("generate_0", "generate", 0, 10, 110),
                                        phase("optimize_0", "optimize", 0, 110, 200), phase("eval_0", "eval", 0, 200, 220)],
              [result(-1, "b1", 0.1, 0.01, 0), result(-1, "b2", 0.2, 0.01, 0),
               result(0, "b1", 0.5, 0.03, 8), result(0, "b2", 0.3, 0.04, 8)], [72.0])
    # 105 s with a 5 s evaluation, 36 s of sampling: 2× the baseline's rollout speed, 190 / 100 its total's
    write_run(runs / "M" / "mu-grpo-mu8", [phase("generate_0", "generate", 0, 0, 40),
                                           phase("optimize_0", "optimize", 0, 40, 100), phase("eval_0", "eval", 0, 100, 105)],
              [result(0, "b1", 0.6, 0.03, 8), result(0, "b2", 0.5, 0.04, 8)], [36.0])
    # killed after its first stage's evaluation: unfinished, its latest evaluation shown
    write_run(runs / "M" / "m2po-mu4", [phase("generate_0", "generate", 0, 0, 30), phase("eval_0", "eval", 0, 30, 40)],
              [result(0, "b1", 0.2, 0.02, 4), result(0, "b2", 0.2, 0.02, 4)], [30.0], finished=False)
    (runs / "runs.txt").write_text("".join(
        f"PRESET=paper MODEL=org/M RUN={runs}/M/{loss}-mu{mu} LOSS={loss} UPDATES_PER_STAGE={mu}\n"
        for loss, mu in (("grpo", 4), ("mu-grpo", 8), ("m2po", 4), ("m2po", 8))))     # the last not started
    paper = tmp_path / "paper.json"
    paper.write_text(json.dumps({"source": "hand", "benchmarks": ["b1", "b2"], "models": {"M": {     # in percent
        "grpo:4": {"b1": 45.0, "b2": 25.0, "mean": 35.0, "t_rollout_h": 8.0, "t_total_h": 12.0},
        "mu-grpo:8": {"b1": 47.0, "b2": 27.0, "mean": 37.0, "t_rollout_h": 4.0, "t_total_h": 10.0}}}}))
    proc = subprocess.run([sys.executable, "tools/table1.py", f"--runs_dir={runs}", f"--paper={paper}"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((runs / "table1.json").read_text())["org/M"]
    base, mu8, m2po, not_started = (r["ours"] for r in rows)
    assert base["state"] == "finished" and base["updates"] == 8
    assert base["mean"] == pytest.approx(0.4) and base["mean_stderr"] == pytest.approx(0.025)   # √(.03² + .04²) / 2
    assert base["t_rollout_h"] == pytest.approx(72 / 3600) and base["t_total_h"] == pytest.approx(190 / 3600)
    assert base["speedup_rollout"] == pytest.approx(1.0) and base["speedup_total"] == pytest.approx(1.0)
    assert mu8["speedup_rollout"] == pytest.approx(2.0) and mu8["speedup_total"] == pytest.approx(1.9)
    assert base["benchmarks"]["b1"]["source"] == f"{runs}/M/grpo-mu4/results.jsonl:3"     # its row, by line
    assert mu8["benchmarks"]["b2"]["source"] == f"{runs}/M/mu-grpo-mu8/results.jsonl:2"
    assert m2po["state"] == "unfinished" and m2po["updates"] == 4 and m2po["mean"] == pytest.approx(0.2)
    assert not_started == {"state": "not started", "run": f"{runs}/M/m2po-mu8"}
    assert rows[0]["paper"]["mean"] == 0.35 and rows[2]["paper"] is None
    assert rows[1]["paper"]["speedup_rollout"] == 2.0 and rows[1]["paper"]["speedup_total"] == 1.2    # 8 / 4, 12 / 10
    md = (runs / "table1.md").read_text().splitlines()
    assert md[0] == ("| model | method | numbers | b1 | b2 | mean | T_rollout h | T_total h | rollout speed-up | total speed-up |")
    assert md[2] == "| M | GRPO μ = 4 | ours | 50.0 ± 3.0 | 30.0 ± 4.0 | 40.0 ± 2.5 | 0.02 | 0.053 | 1.00× | 1.00× |"
    assert md[3] == "| | | paper | 45.0 | 25.0 | 35.0 | 8.00 | 12.00 | 1.00× | 1.00× |"
    assert md[4] == "| M | μ-GRPO μ = 8 | ours | 60.0 ± 3.0 | 50.0 ± 4.0 | 55.0 ± 2.5 | 0.01 | 0.028 | 2.00× | 1.90× |"
    assert md[5] == "| | | paper | 47.0 | 27.0 | 37.0 | 4.00 | 10.00 | 2.00× | 1.20× |"
    assert md[6].startswith("| M | M2PO μ = 4 | ours, unfinished (4 updates) | 20.0 ± 2.0 |")
    assert md[6].endswith(" | 0.0083 | 0.0083 | — | — |")     # 30 s of sampling, 30 s without its evaluation: no speed-up
    assert md[7] == "| M | M2PO μ = 8 | ours, not started | — | — | — | — | — | — | — |"


def stub_sbatch(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/bash\necho \"$@\" >> {tmp_path}/sbatch.calls\necho 'Submitted batch job 7'\n")
    (bin_dir / "sbatch").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_on_a_cluster_the_runs_are_one_slurm_array_after_each_models_preparation(tmp_path):
    # from a login node: no venv is built there (each task's setup.sh builds its node's kind: on a GPU node a CPU venv
    # from the login node would be refused), and PRESET=auto, which would read the login node's GPUs, is refused
    out, venv = tmp_path / "t1", tmp_path / "venv"
    env = {**os.environ, **stub_sbatch(tmp_path), "PRESET": "paper", "OUT": str(out), "SCHEDULER": "slurm",
           "SBATCH_ARGS": "--partition=h200 --account=rl", "ARRAY_LIMIT": "5", "MU_GRPO_VENV": str(venv)}
    proc = subprocess.run(["bash", "table1.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "sbatch.calls").read_text() == (    # 5 models: their preparations; then 5 × 4 methods, 5 at once
        f"--parsable --array=0-4 --export=ALL,TABLE1_RUNS={out}/prepare.txt --partition=h200 --account=rl "
        f"slurm/table1.sbatch\n"
        f"--array=0-19%5 --dependency=afterok:7 --export=ALL,TABLE1_RUNS={out}/runs.txt --partition=h200 --account=rl "
        f"slurm/table1.sbatch\n")
    assert not venv.exists()
    auto = subprocess.run(["bash", "table1.sh"], cwd=ROOT, env={**env, "PRESET": "auto"}, capture_output=True,
                          text=True, timeout=300)
    assert auto.returncode == 2 and auto.stderr.startswith("SCHEDULER=slurm: give PRESET=paper (or lab)")
    assert not venv.exists()
    lines = (out / "runs.txt").read_text().splitlines()
    assert len(lines) == 20 and lines[19].startswith(
        f"PRESET=paper MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-7B RUN={out}/DeepSeek-R1-Distill-Qwen-7B/mu-grpo-mu1024 ")
    assert "\n#SBATCH --gpus-per-node=4" in (ROOT / "slurm" / "table1.sbatch").read_text()
    # every Slurm command the README shows names its preset (table1.sh refuses PRESET=auto there, above)
    readme = [line for line in (ROOT / "README.md").read_text().splitlines() if "SCHEDULER=slurm" in line]
    assert readme and all("PRESET=" in line.split("bash table1.sh")[0] for line in readme), readme


@pytest.mark.slow
@needs_vllm
def test_toy_models_table_killed_resumed_and_every_cell_traced(toy, tmp_path):
    # the toy standing in for a model, two methods (GRPO μ = 2 resident, μ-GRPO μ = 4 per phase): the Slurm array's
    # task 0 killed in its run and resubmitted, then table1.sh in turn (task 0's run done already, task 1's run made)
    out = tmp_path / "t1"
    env = {**os.environ, **stub_sbatch(tmp_path), "PRESET": "toy", "OUT": str(out), "MODEL": str(toy / "model"),
           "TRAIN_DATA": str(toy / "train.jsonl"), "EVAL_DATA_DIR": str(toy), "MAX_RESPONSE": "12",
           "SCHEDULER": "slurm"}
    subprocess.run(["bash", "table1.sh"], cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    task0 = {**env, "SLURM_ARRAY_TASK_ID": "0", "SLURM_SUBMIT_DIR": str(ROOT), "TABLE1_RUNS": str(out / "runs.txt")}
    run0 = out / "toy" / "grpo-mu2"
    assert kill_when(["bash", "slurm/table1.sbatch"], lambda: (run0 / "stage_0" / "metrics.jsonl").exists(),
                     env=task0, timeout=600)
    assert not (run0 / ".done" / "all").exists()
    subprocess.run(["bash", "slurm/table1.sbatch"], cwd=ROOT, env=task0, check=True, capture_output=True, timeout=600)
    proc = subprocess.run(["bash", "table1.sh"], cwd=ROOT, env={**env, "SCHEDULER": "local"}, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"run {run0} is complete; nothing to do" in proc.stdout
    rows = json.loads((out / "table1.json").read_text())["toy"]
    assert [r["method"] for r in rows] == ["grpo:2", "mu-grpo:4"]
    for r in rows:
        o = r["ours"]
        assert o["state"] == "finished" and o["updates"] == 4 and r["paper"] is None
        for cell in o["benchmarks"].values():         # each cell is its results row's
            path, line = cell["source"].rsplit(":", 1)
            row = read_lines(path)[int(line) - 1]
            assert (row["avg_at_k"], row["avg_at_k_stderr"], row["updates"]) == (cell["avg"], cell["stderr"], 4)
        assert 0 < o["t_rollout_h"] < o["t_total_h"]
        assert math.isclose(rows[0]["ours"]["t_total_h"] / o["t_total_h"], o["speedup_total"])
    assert "| toy | μ-GRPO μ = 4 | ours |" in (out / "table1.md").read_text()


def test_the_papers_numbers_are_its_table_and_text():
    # each AVG. is its five benchmarks' mean, to the table's rounding; the text's mean speed-ups of μ-GRPO μ = 1024 over
    # GRPO μ = 4 across the five models: 1.82× rollout, 1.53× total (arXiv 2605.17570v1)
    paper = json.loads((ROOT / "tools" / "table1_paper.json").read_text())
    models = paper["models"]
    assert list(models) == ["Llama-3.2-3B-Instruct", "Qwen2.5-Math-7B", "Qwen3-1.7B-Base", "Qwen3-8B-Base",
                            "DeepSeek-R1-Distill-Qwen-7B"]
    for rows in models.values():
        assert list(rows) == ["grpo:4", "grpo:1024", "m2po:1024", "mu-grpo:1024"]
        for r in rows.values():
            assert abs(sum(r[b] for b in paper["benchmarks"]) / 5 - r["mean"]) <= 0.05 + 1e-9
    for t, quoted in (("t_rollout_h", 1.82), ("t_total_h", 1.53)):
        ratios = [m["grpo:4"][t] / m["mu-grpo:1024"][t] for m in models.values()]
        assert abs(sum(ratios) / len(ratios) - quoted) < 0.01     # 1.825 and 1.527: the text's two digits
    assert models["Qwen2.5-Math-7B"]["mu-grpo:1024"]["mean"] == 48.0       # the text: 41.8 → 48.0 on Qwen2.5-Math-7B
    assert models["Qwen2.5-Math-7B"]["grpo:1024"]["mean"] == 41.8


def test_the_cost_estimate_from_a_preflights_throughputs(tmp_path):
    # the README's estimate: a preflight stage of 1024 updates generating 2 h and training 3 h, scaled to 4096 updates
    # (20 h for every μ), plus c per stage: GRPO μ = 4's 1024 stages at c = 20 s add 1024 × 20 / 3600 = 5.69 h
    report = tmp_path / "preflight.json"
    report.write_text(json.dumps({"figures": {"estimated_hours_per_stage": {"generate": 2.0, "optimize": 3.0}}}))
    out = subprocess.run([sys.executable, "tools/frontier.py", f"--estimate_from={report}", "--total_updates=4096",
                          "--preflight_updates=1024", "--estimate_points=grpo:4 mu-grpo:1024", "--costs=0,20"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[-2:] == ["| grpo:4 | 1024 | 20.00 | 25.69 |", "| mu-grpo:1024 | 4 | 20.00 | 20.02 |"]


def test_each_models_stage0_agreement_is_read_from_its_preparation(monkeypatch, tmp_path, capsys):
    prepares, runs = plan_with(monkeypatch, tmp_path)
    table1.write_plan(prepares, runs)
    capsys.readouterr()
    report = tmp_path / "Qwen2.5-Math-7B" / "prepare" / "preflight.json"
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({"figures": {"agreement": {
        "mean_abs_log_ratio": 0.0125, "p999_at_most": 0.5, "max_abs_log_ratio": 2.25, "entropy": 0.75,
        "mean_response_tokens": 812.0, "bound_mean": 0.05, "bound_p999": 1.0, "device": "cuda", "model": "q"}}}))
    rows = table1.agreement_rows(tmp_path)
    assert [m for m, _ in rows] == ["Qwen/Qwen2.5-Math-7B", "toy"] and rows[1][1] is None
    lines = table1.agreement_markdown(rows).splitlines()
    assert lines[2] == "| Qwen/Qwen2.5-Math-7B | 0.0125 | 0.05 | 25% | 0.5 | 2.250 | 0.750 | 812 |"   # 0.0125 / 0.05
    assert lines[3].startswith("| toy | not measured")
