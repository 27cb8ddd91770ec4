"""Paired differences of final accuracy between points of two frontiers (e.g. the same loss at another learning
rate, which frontier.sh runs as a second frontier: `LR=3e-5 OUT=runs/frontier-lr3e-5 bash frontier.sh`).

    python tools/paired.py --a=runs/frontier-lr3e-5:mu-grpo-d1e-4:64 --b=runs/frontier-lab-fork:mu-grpo-d1e-4:64

Each side is <runs_dir>:<label>:<μ>. The runs are paired by (build, seed); per regime (the regimes of b's frontier,
else a's) and over all of them: each build's difference a − b (its seeds averaged), their mean over builds, its 95 % t
interval and p over builds (regimes.paired_by_regime, as the frontier's comparisons; one comparison: no Holm), "above"
or "below" where the interval excludes zero and p ≤ alpha, else "not shown".
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from mu_grpo import common  # noqa: E402
import frontier  # noqa: E402
import regimes  # noqa: E402

a = ""      # <runs_dir>:<label>:<μ>
b = ""
common.apply_overrides(globals(), sys.argv[1:] if __name__ == "__main__" else [])


def side(spec):
    """(runs_dir, {(build, seed): summary}) of one side, refused in one line when it has no finished run."""
    runs_dir, point = spec.split(":", 1)
    points, _ = frontier.collect(runs_dir)
    key = frontier.point_key(point)
    if key not in points:
        sys.exit(f"{runs_dir}: no finished run of {point} (points there: "
                 f"{', '.join(f'{k[0]}:{k[1]}' for k in sorted(points, key=str)) or 'none'})")
    return Path(runs_dir), points[key]


def main():
    if not a or not b:
        sys.exit("give --a=<runs_dir>:<label>:<μ> and --b=<runs_dir>:<label>:<μ>")
    dir_a, runs_a = side(a)
    dir_b, runs_b = side(b)
    measured = regimes.load_regimes(dir_b / "regimes") or regimes.load_regimes(dir_a / "regimes")
    rows = regimes.paired_by_regime(runs_a, runs_b, measured, "≠")
    if not rows:
        sys.exit(f"{a} and {b} share no (build, seed)")
    print(f"| {a} − {b} | builds | pairs | mean over builds | 95 % CI over builds | p | verdict |\n"
          f"|---|---|---|---|---|---|---|")
    for r in rows:
        ci = "—" if r["low"] is None else f"{r['low']:+.3f} to {r['high']:+.3f}"
        p = "—" if r["p"] is None else f"{r['p']:.3f}"
        print(f"| {r['regime']} | {len(r['builds'])} | {r['pairs']} | {r['mean']:+.3f} | {ci} | {p} | {r['verdict']} |")


if __name__ == "__main__":
    main()
