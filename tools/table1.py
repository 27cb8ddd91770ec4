"""The paper's Table 1 (arXiv 2605.17570v1) from its runs' records, our numbers beside the paper's: per model and
method, each benchmark's avg@k with its standard error, their mean, T_rollout and T_total in hours and the speed-ups
against the model's first method (GRPO μ = 4). table1.sh runs the models × methods (one run_stages.sh run each) and
calls this; it reads records only, so it can be run any time, on finished and unfinished runs alike:

    python tools/table1.py --runs_dir=runs/table1-paper

Reads <runs_dir>/runs.txt (table1.sh's plan: one run per line, its run_stages.sh settings) and each run's
results.jsonl and timeline.jsonl; writes <out>/table1.md and table1.json (every cell with the results rows it came
from: file and line). A run not finished (no .done/all) shows its latest evaluation, marked; one not started, a
dash. The paper's numbers: tools/table1_paper.json (with their source).

Times: T_rollout is the engines' sampling (records.time_split's generation: manifests' generation_seconds), T_total
the run's wall-clock with its evaluations taken out (tools/frontier.py's), pauses of a resumed run excluded.

With --command=plan (table1.sh's first step) it writes runs.txt instead: every model × method's run directory and
settings, checked before anything runs.
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mu_grpo import common  # noqa: E402
from mu_grpo.model_cards import short_name  # noqa: E402  (a model's name under runs_dir and in the paper's numbers)
from mu_grpo import records  # noqa: E402
import sweep  # noqa: E402  (bench/: a LOSS preset's check)

command = "table"               # table: write the table from the runs' records | plan: write runs.txt (table1.sh) |
                                # agreement: each model's stage-0 engine/trainer agreement from its preparation
runs_dir = "runs/table1-paper"  # table1.sh's OUT: runs.txt, <model>/<loss>-mu<μ>/ run directories
out = ""                        # where table1.md and table1.json go (default: runs_dir)
paper = str(ROOT / "tools" / "table1_paper.json")   # the paper's numbers
# plan: table1.sh's knobs (their meaning is there)
preset = "paper"
models = ""
methods = ""
total_updates = 0
eval_updates = 0
resident_max_mu = 0
common.apply_overrides(globals(), sys.argv[1:] if __name__ == "__main__" else [])

RUNS_FILE = "runs.txt"
PREPARE_FILE = "prepare.txt"    # one line per model: its preflight and its initial policy's kept evaluation
SAVE_HOURS = 2.0                # a resident run saves a resume point at least every this many hours of the paper's
CPU_PRESETS = ("toy", "lab", "lab-fork")     # stand-in models: run_stages.sh's CPU presets, their own model and data
NAMES = {"grpo": "GRPO", "m2po": "M2PO", "mu-grpo": "μ-GRPO", "dapo": "DAPO"}


def parse_method(method):
    """'loss:μ' → (loss, μ), the LOSS a preset of loss.py and μ dividing total_updates, or one line refusing it."""
    loss, _, mu = method.partition(":")
    if not mu.isdigit() or int(mu) < 1:
        common.refuse(f"METHODS: '{method}' is not <LOSS preset>:<μ>, e.g. grpo:4 or mu-grpo:1024")
    sweep.check_loss(loss)          # an unknown preset: the line naming them
    if total_updates % int(mu):
        common.refuse(f"METHODS: μ = {mu} of '{method}' does not divide TOTAL_UPDATES={total_updates} (the runs compare at "
               f"equal updates)")
    return loss, int(mu)


def plan(paper_hours=None):
    """(prepares, runs): [(run directory, {run_stages.sh setting: value})] of each model's preparation (its preflight at
    its first resident method's settings, and its initial policy's evaluation kept in EVAL_CACHE, once: the runs then
    skip both, and an array's runs do not wait on one another) and of every model × method, in that order: the
    model's settings (a CPU preset by name, else PRESET with MODEL), the method's LOSS and μ over total_updates
    updates, evaluated every eval_updates updates (every stage when μ is larger), resident up to μ = resident_max_mu
    (stages too short to pay a process start each) and then saving a resume point every SAVE_HOURS of the paper's
    hours for that run (paper_hours: {(model, method): hours}), else every 32nd of its stages."""
    if not models.split() or not methods.split():
        common.refuse("MODELS and METHODS must each name at least one")
    paper_hours = paper_hours or {}
    prepares, runs = [], []
    for model in models.split():
        base = {"PRESET": model} if model in CPU_PRESETS else {"PRESET": preset, "MODEL": model}
        model_runs = []
        for method in methods.split():
            loss, mu = parse_method(method)
            stages, resident = total_updates // mu, mu <= resident_max_mu
            run = f"{runs_dir}/{short_name(model)}/{loss}-mu{mu}"
            env = {**base, "RUN": run, "LOSS": loss, "STAGES": str(stages), "UPDATES_PER_STAGE": str(mu),
                   "RESIDENT": str(resident).lower(), "EVAL_EVERY": str(eval_updates // mu if eval_updates > mu else 1),
                   "EVAL_CACHE": f"{runs_dir}/eval_cache"}
            if resident:
                hours = paper_hours.get((short_name(model), method))
                env["SAVE_EVERY"] = str(max(1, int(stages * SAVE_HOURS / hours) if hours else stages // 32))
            model_runs.append((run, env))
        first = next((env for _, env in model_runs if env["RESIDENT"] == "true"), model_runs[0][1])
        prepare = f"{runs_dir}/{short_name(model)}/prepare"
        prepares.append((prepare, {**first, "RUN": prepare, "PREFLIGHT_ONLY": "true"}))
        checked = preset == "paper" and model not in CPU_PRESETS      # its preflight ran (PREFLIGHT=auto: paper)
        # its runs follow that preflight's decisions (a hand-off that fell back to files: launch --command=handoff)
        runs += [(run, {**env, **({"PREFLIGHT": "0", "PREFLIGHT_REPORT": f"{prepare}/preflight.json"} if checked
                                  else {})}) for run, env in model_runs]
    if len({r for r, _ in runs}) < len(runs):
        common.refuse(f"MODELS={models!r} × METHODS={methods!r} names a run twice")
    return prepares, runs


def write_plan(prepares, runs):
    """prepare.txt and runs.txt: a run per line, its settings as `KEY=value ...` (table1.sh and slurm/table1.sbatch
    run line i as `env <line> bash run_stages.sh`); prints how many of each. A rerun with other knobs rewrites them;
    the runs already made stay."""
    Path(runs_dir).mkdir(parents=True, exist_ok=True)
    for name, entries in ((PREPARE_FILE, prepares), (RUNS_FILE, runs)):
        for run, env in entries:
            if any(c.isspace() for v in env.values() for c in v):
                common.refuse(f"{run}: a setting holds a space ({env}); {name} cannot carry it")
        common.atomic_write(Path(runs_dir) / name,
                            "".join(" ".join(f"{k}={v}" for k, v in env.items()) + "\n" for _, env in entries))
    print(len(prepares), len(runs))


def read_plan(directory):
    """[(model, method 'loss:μ', run directory)] of runs.txt, in its order."""
    found = []
    for i, line in enumerate((Path(directory) / RUNS_FILE).read_text().splitlines(), 1):
        env = dict(item.split("=", 1) for item in line.split())
        if not {"RUN", "LOSS", "UPDATES_PER_STAGE", "PRESET"} <= set(env):
            raise ValueError(f"{directory}/{RUNS_FILE}, line {i}: not a table1.sh run: {line!r}")
        found.append((env.get("MODEL", env["PRESET"]), f"{env['LOSS']}:{env['UPDATES_PER_STAGE']}", env["RUN"]))
    return found


def run_cells(run_dir):
    """One run's row: its latest evaluation's benchmarks (avg@k, its standard error, k, and where each came from:
    results.jsonl and line), their mean, the run's hours and its state (finished, unfinished: its updates so far,
    or not started)."""
    run_dir = Path(run_dir)
    results = run_dir / records.RESULTS
    rows = [(i, r) for i, r in enumerate(common.read_jsonl(results), 1)] if results.exists() else []
    own = records.own_results([r for _, r in rows])              # a hand evaluation's rows are not the run's
    trained = [(i, r) for i, r in rows if r["stage"] >= 0 and any(r is o for o in own)]
    if not trained:
        return {"state": "not started" if not rows else "running", "run": str(run_dir)}
    last = max(r["stage"] for _, r in trained)
    benchmarks = {r["benchmark"]: {"avg": r["avg_at_k"], "stderr": r.get("avg_at_k_stderr"), "k": r["k"],
                                   "source": f"{results}:{i}"} for i, r in trained if r["stage"] == last}
    split = records.time_split(records.load_run(run_dir))
    return {"state": "finished" if (run_dir / ".done" / "all").exists() else "unfinished", "run": str(run_dir),
            "updates": next(r["updates"] for _, r in trained if r["stage"] == last), "benchmarks": benchmarks,
            "mean": sum(b["avg"] for b in benchmarks.values()) / len(benchmarks),
            "mean_stderr": mean_stderr([b["stderr"] for b in benchmarks.values()]),
            "t_rollout_h": split["generation"] / 3600,
            "t_total_h": (split["wall"] - split["evaluation"]) / 3600}


def mean_stderr(stderrs):
    import frontier  # bench/ (numpy): the table's step, not the plan's, which runs where no venv is (a login node)
    return frontier.mean_stderr(stderrs)


def table(plan_rows, paper_numbers):
    """{model: [row]} in the plan's order: each method's cells (run_cells), the speed-ups of its T_rollout and
    T_total against the model's first method (both finished), and the paper's numbers for it (None when the paper has
    none)."""
    out_rows = {}
    for model, method, run in plan_rows:
        cells = run_cells(run)
        base = out_rows[model][0]["ours"] if model in out_rows else cells
        for t in ("rollout", "total"):      # finished runs only: an unfinished one's hours are not its run's
            if cells["state"] == base["state"] == "finished" and cells[f"t_{t}_h"] and base[f"t_{t}_h"]:
                cells[f"speedup_{t}"] = base[f"t_{t}_h"] / cells[f"t_{t}_h"]
        out_rows.setdefault(model, []).append({"method": method, "ours": cells,
                                               "paper": paper_row(paper_numbers, model, method, plan_rows)})
    return out_rows


def paper_row(paper_numbers, model, method, plan_rows):
    """The paper's numbers for a model's method (accuracies as fractions, as ours), its speed-ups against the paper's
    row of the model's first method; None where the paper has none."""
    numbers = paper_numbers.get("models", {}).get(short_name(model), {})
    if method not in numbers:
        return None
    row = {k: v / 100 if k in paper_numbers["benchmarks"] or k == "mean" else v for k, v in numbers[method].items()}
    base = numbers.get(next(m for mo, m, _ in plan_rows if mo == model), {})
    for t in ("rollout", "total"):
        if base.get(f"t_{t}_h"):
            row[f"speedup_{t}"] = base[f"t_{t}_h"] / row[f"t_{t}_h"]
    return row


def method_name(method):
    loss, mu = method.split(":")
    return f"{NAMES.get(loss, loss)} μ = {mu}"


def pct(value, stderr=None):
    if value is None:
        return "—"
    return f"{100 * value:.1f}" + ("" if stderr is None else f" ± {100 * stderr:.1f}")


def hours(value):
    """Two decimals, or two significant digits below one hour (a CPU run's minutes)."""
    return "—" if value is None else f"{value:.2f}" if value >= 1 else f"{value:.2g}"


def speed(value):
    return "—" if value is None else f"{value:.2f}×"


def markdown(rows, paper_numbers):
    """The paper's layout: a block per model, each method's row of ours (avg@k ± SE, in %) and the paper's below."""
    has_paper = any(r["paper"] for model_rows in rows.values() for r in model_rows)
    benchmarks = list(paper_numbers["benchmarks"]) if has_paper else []      # the paper's columns where it has rows
    for model_rows in rows.values():
        for r in model_rows:
            benchmarks += [b for b in r["ours"].get("benchmarks", {}) if b not in benchmarks]
    head = ["model", "method", "numbers", *benchmarks, "mean", "T_rollout h", "T_total h", "rollout speed-up",
            "total speed-up"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, model_rows in rows.items():
        for r in model_rows:
            o, p = r["ours"], r["paper"] or {}
            state = {"finished": "ours", "unfinished": f"ours, unfinished ({o.get('updates')} updates)",
                     "running": "ours, running (no trained policy evaluated yet)", "not started": "ours, not started"}
            b = o.get("benchmarks", {})
            lines.append(f"| {short_name(model)} | {method_name(r['method'])} | {state[o['state']]} | "
                         + " | ".join(pct(b[n]["avg"], b[n]["stderr"]) if n in b else "—" for n in benchmarks)
                         + f" | {pct(o.get('mean'), o.get('mean_stderr'))} | {hours(o.get('t_rollout_h'))} | "
                         f"{hours(o.get('t_total_h'))} | {speed(o.get('speedup_rollout'))} | "
                         f"{speed(o.get('speedup_total'))} |")
            if r["paper"] is not None:
                lines.append("| | | paper | " + " | ".join(pct(p.get(n)) for n in benchmarks)
                             + f" | {pct(p.get('mean'))} | {hours(p.get('t_rollout_h'))} | {hours(p.get('t_total_h'))}"
                             f" | {speed(p.get('speedup_rollout'))} | {speed(p.get('speedup_total'))} |")
    ks = sorted({c["k"] for rs in rows.values() for r in rs for c in r["ours"].get("benchmarks", {}).values()})
    lines += ["", f"Ours: avg@{'/'.join(map(str, ks)) or 'k'} ± its standard error, in %, from each run's last "
              f"evaluation; the mean's error in quadrature. Hours: T_rollout the engines' sampling, T_total the "
              f"wall-clock without evaluations; speed-ups against each model's first method. "
              f"Paper: {paper_numbers.get('source', 'none')}. Every cell's results row: table1.json."]
    return "\n".join(lines)


def agreement_rows(directory):
    """[(model, its preflight's stage-0 agreement record or None)] of prepare.txt's models (mu_grpo/preflight.py
    agreement_record)."""
    found = []
    for line in (Path(directory) / PREPARE_FILE).read_text().splitlines():
        env = dict(item.split("=", 1) for item in line.split())
        report = Path(env["RUN"]) / "preflight.json"
        record = json.loads(report.read_text()).get("figures", {}).get("agreement") if report.exists() else None
        found.append((env.get("MODEL", env["PRESET"]), record))
    return found


def agreement_markdown(rows):
    lines = ["| model | mean \\|Δ log p\\| | bound | of the bound | p99.9 level | max | entropy | response tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for model, r in rows:
        if r is None:
            lines.append(f"| {model} | not measured (its preparation has not run) | | | | | | |")
            continue
        share = r["mean_abs_log_ratio"] / r["bound_mean"] if r["bound_mean"] else None
        lines.append(f"| {model} | {r['mean_abs_log_ratio']:.4f} | {r['bound_mean']:g} | "
                     f"{'—' if share is None else f'{share:.0%}'} | {r['p999_at_most']} | "
                     f"{r['max_abs_log_ratio']:.3f} | {r['entropy']:.3f} | {r['mean_response_tokens']:.0f} |")
    return "\n".join(lines)


def main():
    if command == "agreement":
        print(agreement_markdown(agreement_rows(runs_dir)))
        return
    if command == "plan":
        numbers = json.loads(Path(paper).read_text())["models"] if paper else {}
        write_plan(*plan({(m, method): r["t_total_h"] for m, rows in numbers.items() for method, r in rows.items()}))
        return
    if command != "table":
        common.refuse(f"--command must be table, plan or agreement, got {command!r}")
    plan_rows = read_plan(runs_dir)
    paper_numbers = json.loads(Path(paper).read_text()) if paper else {"benchmarks": [], "models": {}}
    rows = table(plan_rows, paper_numbers)
    where = Path(out or runs_dir)
    where.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, paper_numbers)
    common.atomic_write(where / "table1.md", text + "\n")
    common.atomic_write_json(where / "table1.json", rows)
    print(text)
    print(f"\n{where}/table1.md, {where}/table1.json")


if __name__ == "__main__":
    main()
