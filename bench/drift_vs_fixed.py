"""Stages that end on drift against fixed μ, from the runs' own records (results.jsonl, timeline.jsonl, the
manifests, stage_end.json): no compute, a table. The runs are run_stages.sh runs at equal total updates, one
directory per point and seed (README, "Stages that end on drift: does it help?"):

    python bench/drift_vs_fixed.py --runs_dir=runs/drift-exp

<runs_dir>/seed<k>/<loss>-<point>/, where point is `drift` or a fixed μ. Per loss and point, over seeds: the final
and best accuracy, the accuracy at a few update budgets (the last evaluation at or before each), the seeds that
collapsed (accuracy below half the initial policy's at any later evaluation), the stages, the
prompts generated per prompt trained on (what ending early costs in generation), and the wall-clock.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import records  # noqa: E402

runs_dir = "runs/drift-exp"     # holds seed<k>/<loss>-<point>/ run directories
budgets = "64,128,192,256"      # update budgets at which accuracy is read (the last evaluation at or before each)
prompts_per_update = 4          # to count the prompts trained on
common.apply_overrides(globals(), sys.argv[1:])


def summarize(run_dir):
    run = records.load_run(run_dir)
    points = sorted((updates, acc) for _, updates, _, acc in records.accuracy_by_stage(run))   # (run updates, avg@k)
    if not points or points[0][0] != 0:
        return None
    initial = points[0][1]
    trained = len(run["metrics"])                            # one metrics line per update
    generated = sum(m.get("prompts", 0) for m in run["manifests"].values())
    _, total, generation, training, _ = records.phase_summary(run)
    at = {b: next((a for u, a in reversed(points) if u <= b), None) for b in map(int, budgets.split(","))}
    return {"initial": initial, "final": points[-1][1], "best": max(a for _, a in points[1:]),
            "collapsed": any(a < initial / 2 for u, a in points[1:]), "at": at, "stages": len(run["manifests"]),
            "generated_per_trained": generated / max(1, trained * prompts_per_update),
            "minutes": total / 60, "generation_minutes": generation / 60}


def main():
    rows = {}
    for run_dir in sorted(Path(runs_dir).glob("seed*/*")):
        loss, point = run_dir.name.rsplit("-", 1)
        s = summarize(run_dir)
        if s is not None:
            rows.setdefault((loss, point), []).append(s)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    head = " | ".join(f"@{b}" for b in budgets.split(","))
    print(f"| loss | point | seeds | final (min–max) | best | {head} | collapsed | stages | generated / trained | "
          f"minutes (generation) |")
    print("|" + "---|" * (10 + len(budgets.split(","))))
    order = lambda key: (key[0], key[1] != "drift", int(key[1]) if key[1].isdigit() else 0)  # noqa: E731
    for (loss, point), ss in sorted(rows.items(), key=lambda kv: order(kv[0])):
        finals = [s["final"] for s in ss]
        at = " | ".join(f"{mean([s['at'][b] for s in ss if s['at'][b] is not None]):.3f}"
                        if any(s["at"][b] is not None for s in ss) else "—" for b in map(int, budgets.split(",")))
        print(f"| {loss} | {'drift' if point == 'drift' else 'μ = ' + point} | {len(ss)} | {mean(finals):.3f} "
              f"({min(finals):.3f}–{max(finals):.3f}) | {mean([s['best'] for s in ss]):.3f} | {at} | "
              f"{sum(s['collapsed'] for s in ss)} | {mean([s['stages'] for s in ss]):.1f} | "
              f"{mean([s['generated_per_trained'] for s in ss]):.2f} | {mean([s['minutes'] for s in ss]):.1f} "
              f"({mean([s['generation_minutes'] for s in ss]):.1f}) |")
    print(f"\ninitial accuracy {mean([s['initial'] for ss in rows.values() for s in ss]):.3f}; accuracy: avg@k of the "
          f"test set at the last evaluation at or before each budget, mean over seeds")


if __name__ == "__main__":
    main()
