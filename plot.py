"""Figures and a wall-clock summary of one or more runs (matplotlib, headless PNG).

    python plot.py --run_dir=runs/toy-mu-grpo                       # figures into <run_dir>/plots/
    python plot.py --run_dir=runs/a,runs/b --out_dir=plots/compare  # two runs on the same axes
    python plot.py --run_dir=runs/toy-mu-grpo --summary=true        # also print time per phase

The same functions are used by notebooks/results.ipynb: load_run(path) returns plain lists of dicts.
"""
import json
import sys
from pathlib import Path

import common

# ----------------------------------------------------------------------------- hyperparameters
run_dir = "runs/toy-mu-grpo"    # one run directory, or several separated by commas
out_dir = ""                    # default: <first run_dir>/plots
summary = False                 # print time per phase, switching overhead and accuracy per stage
# -----------------------------------------------------------------------------


def _rows(path):
    return common.read_jsonl(path) if Path(path).exists() else []


def load_run(path):
    """Everything a figure needs from a run directory: results, timeline, per-update metrics, manifests."""
    path = Path(path)
    metrics, manifests = [], {}
    for stage_dir in sorted(path.glob("stage_*"), key=lambda p: int(p.name.split("_")[1])):
        s = int(stage_dir.name.split("_")[1])
        for row in _rows(stage_dir / "metrics.jsonl"):
            metrics.append({**row, "stage": s})
        if (stage_dir / "rollouts" / "manifest.json").exists():
            manifests[s] = json.loads((stage_dir / "rollouts" / "manifest.json").read_text())
    for row in _rows(path / "metrics.jsonl"):   # an ablation replay: optimize.py --out=<path>/policy
        metrics.append(row)
    updates_per_stage = 1 + max((m["update"] for m in metrics), default=-1)
    for m in metrics:
        m["global_update"] = m["stage"] * updates_per_stage + m["update"]
    return {"name": path.name, "results": _rows(path / "results.jsonl"), "timeline": _rows(path / "timeline.jsonl"),
            "metrics": metrics, "manifests": manifests}


def accuracy_by_stage(run):
    """[(stage, updates, hours, mean avg@k over benchmarks)] in stage order."""
    by_stage = {}
    for r in run["results"]:
        by_stage.setdefault(r["stage"], []).append(r)
    return [(s, rows[0]["updates"], max(r["hours"] for r in rows),
             sum(r["avg_at_k"] for r in rows) / len(rows)) for s, rows in sorted(by_stage.items())]


def phase_summary(run):
    """Seconds per phase kind, total, and the share spent outside generation and training compute."""
    per_kind = {}
    for t in run["timeline"]:
        per_kind[t["phase"]] = per_kind.get(t["phase"], 0.0) + t["seconds"]
    total = sum(per_kind.values())
    generation = sum(m.get("generation_seconds", 0.0) for m in run["manifests"].values())
    training = sum(m.get("seconds") or 0.0 for m in run["metrics"])
    evaluation = per_kind.get("eval", 0.0)
    overhead = (total - evaluation - generation - training) / max(total - evaluation, 1e-9)
    return per_kind, total, generation, training, overhead


def figures(runs, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(out / name)

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        acc = accuracy_by_stage(run)
        line, = ax.plot([a[2] for a in acc], [a[3] for a in acc], marker="o", label=run["name"])
        for a in acc[1:]:
            ax.axvline(a[2], color=line.get_color(), alpha=0.15)
    ax.set(xlabel="wall-clock hours since run start", ylabel="mean avg@k over benchmarks",
           title="accuracy vs wall-clock (lines: stage ends)")
    ax.legend()
    save(fig, "accuracy_vs_hours.png")

    panels = [("training reward per update", [("reward/mean", "minibatch mean reward")]),
              ("NAV and the collapse warning", [("nav/vetoed_frac", "NAV vetoed fraction"),
                                                ("ratio/mean_neg_adv", "E[ratio | A<0]")]),
              ("clip fractions", [("clip/upper_frac", "upper (A>0, ratio>hi)"),
                                  ("clip/lower_frac", "lower (A<0, ratio<lo)")])]
    for title, series in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in runs:
            for key, label in series:
                pts = [(m["global_update"], m[key]) for m in run["metrics"] if m.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts), label=f"{run['name']}: {label}")
        for run in runs[:1]:
            for m in run["metrics"]:
                if m["update"] == 0 and m["stage"] > 0:
                    ax.axvline(m["global_update"] - 0.5, color="grey", alpha=0.3)
        ax.set(xlabel="update (stages back to back; grey: a new stage's rollouts)", title=title)
        ax.legend(fontsize=7)
        save(fig, title.split(" ")[0].lower() + "_" + title.split(" ")[-1] + ".png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        pts = [(m["stage"], m["mismatch/mean_abs_log_ratio"]) for m in run["metrics"]
               if m.get("mismatch/mean_abs_log_ratio") is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=run["name"])
    ax.set(xlabel="stage", ylabel="mean |log ratio| before the first update", title="engine/trainer mismatch")
    ax.legend()
    save(fig, "mismatch_per_stage.png")
    return written


if __name__ == "__main__":
    common.apply_overrides(globals(), sys.argv[1:])
    runs = [load_run(p) for p in run_dir.split(",")]
    for path in figures(runs, out_dir or Path(run_dir.split(",")[0]) / "plots"):
        print(f"wrote {path}")
    if summary:
        for run in runs:
            per_kind, total, gen, train, overhead = phase_summary(run)
            print(f"\n{run['name']}: {total / 60:.1f} min in all; " +
                  ", ".join(f"{k} {v:.0f} s" for k, v in per_kind.items()))
            print(f"generation compute {gen:.0f} s, training compute {train:.0f} s; switching overhead (start-up, "
                  f"loading, saving, I/O, grading) {100 * overhead:.0f}% of the non-evaluation time")
            for stage, updates, hours, acc in accuracy_by_stage(run):
                print(f"  stage {stage:>2} ({updates:>5} updates, {hours * 60:6.1f} min): mean avg@k {acc:.3f}")
