"""The staleness–speed frontier from its runs' records (frontier.sh runs them; this reads them, no compute): per point
(loss, NAV δ, μ), over builds and seeds, accuracy against wall-clock and against updates, the time split, per-token
staleness and the importance weights' health, and the speed-ups against the baseline point: at equal updates, at
matched accuracy, and re-costed for a per-stage switching cost c.

    python tools/frontier.py --runs_dir=runs/frontier-lab-fork

Imported (notebooks/results.ipynb), its functions draw a frontier from its records: collect, speedups, accuracy_figure
and recost_figure, with the frontier's directory, baseline and costs as arguments (the command line is read only when
it runs as a script).

Reads <runs_dir>/build<b>/seed<s>/<label>-mu<μ>/ (label: the LOSS preset, with -d<δ> for a preset with NAV); writes
<out>/frontier.md (the table), frontier.json (every number, per run and per point) and plots/frontier_*.png.

The paper's comparisons (GRPO's clip fails at large μ, μ-GRPO learns where it stalls, μ-GRPO at large μ matches GRPO
at small μ) are paired differences per build regime, over builds (each build's seeds averaged) with 95 % t intervals
and Holm over the family (tools/regimes.py: each build's regime, the rule that chose the builds, the statistics); a
last table shows, per point and regime, where the ratio leaves GRPO's clip [0.8, 1.2] (loss.py's grpo_clip/ metrics:
the tokens on which a wider clip and GRPO's differ).

Time is the run's wall-clock with its evaluations taken out (points evaluate at different counts: μ = 256 cannot be
evaluated inside its one stage), split by records.time_split into generation, training, switching and idle. Re-costing
replaces each stage's measured switching by c: T(c) = T − switching + c · stages, so T(measured per-stage switching)
is T itself.
"""
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mu_grpo import common  # noqa: E402
import plot  # noqa: E402
from mu_grpo import records  # noqa: E402
import regimes  # noqa: E402  (bench/: the builds' regimes, the paired comparisons)

runs_dir = "runs/frontier-lab-fork"   # holds build<b>/seed<s>/<label>-mu<μ>/ run directories
baseline = "grpo:4"             # label:μ of the point the speed-ups are measured against (the paper's GRPO μ = 4)
costs = "0,2,20,180"            # per-stage switching costs c of the re-costing, seconds
key_points = ""                 # label:μ of the points the paper's claims rest on (frontier.sh's KEY_POINTS): the
                                # comparisons Holm corrects over are theirs, the rest described; empty: every point
out = ""                        # where frontier.md, frontier.json and plots/ go (default: runs_dir)
estimate_from = ""              # a preflight.json: print each point's estimated hours instead (no runs needed)
estimate_points = ""            # its points, label:μ space-separated (frontier.sh passes them)
total_updates = 0               # its updates per point, and the preflight's stage's (the μ it was run at)
preflight_updates = 0
common.apply_overrides(globals(), sys.argv[1:] if __name__ == "__main__" else [])  # imported: not our argv (a kernel's)
costs_s = [float(c) for c in costs.split(",")]


def weighted_percentile(values, weights, q):
    """The smallest value at or below which a fraction q of the total weight lies."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(np.asarray(weights, dtype=float)[order])
    return float(np.asarray(values)[order][np.searchsorted(cumulative, q * cumulative[-1])])


def mean_of(rows, key):
    """The mean of a metric over the updates that have a finite value of it (None: none has)."""
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(values) / len(values) if values else None


def mean_stderr(errors):
    """The standard error of the mean of independent estimates with these errors: in quadrature, over their number
    (None when one is unknown)."""
    return None if None in errors else math.sqrt(sum(e * e for e in errors)) / len(errors)


def clipped_frac(rows):
    """The mean over updates of the share of tokens beyond the loss's clip (clip/upper +
    clip/lower), over the updates that have both finite; None for a loss without a clip (CISPO,
    TOPR, OAPL, ...: no such metric)."""
    return mean_of([{"c": r["clip/upper_frac"] + r["clip/lower_frac"]} for r in rows
                    if isinstance(r.get("clip/upper_frac"), (int, float))
                    and isinstance(r.get("clip/lower_frac"), (int, float))], "c")


def summarize(run_dir):
    """One run's numbers: its accuracy curve [(updates, seconds to it with evaluations taken out, accuracy)], the
    time split, the staleness of its trained tokens and the mean over updates of the ratio statistics."""
    run = records.load_run(run_dir)
    split = records.time_split(run)
    if not run["results"] or not any("process" not in t for t in run["timeline"]) or not run["metrics"]:
        return None
    at = records.evaluation_seconds(run)      # stage → seconds to its evaluation, earlier evaluations and pauses out
    curve = [(updates, at.get(s, 0.0 if s < 0 else None), acc) for s, updates, _, acc in records.accuracy_by_stage(run)]
    last = [r for r in run["results"] if r["stage"] == max(x["stage"] for x in run["results"])]
    m = run["metrics"]
    stale, tokens = [r["staleness"] for r in m], [r["loss/tokens"] for r in m]
    return {"run": str(run_dir), "curve": curve, "final": curve[-1][2], "final_stderr": mean_stderr([r.get("avg_at_k_stderr") for r in last]),
            "initial": curve[0][2], "updates": len(m), "seconds": split["wall"] - split["evaluation"], "split": split,
            "staleness": {q: weighted_percentile(stale, tokens, f) for q, f in (("p50", 0.5), ("p95", 0.95))}
            | {"max": max(stale)},
            "ess_frac": mean_of(m, "ratio/ess_frac"), "kl_behavior": mean_of(m, "ratio/kl"),
            "ratio_neg_adv": mean_of(m, "ratio/mean_neg_adv"), "vetoed_frac": mean_of(m, "nav/vetoed_frac") or 0.0,
            "clipped_frac": clipped_frac(m),
            "grpo_clip_upper": mean_of(m, "grpo_clip/upper_frac"), "grpo_clip_lower": mean_of(m, "grpo_clip/lower_frac"),
            "grpo_clip_first_share": mean_of(m, "grpo_clip/first_token_share"),
            "first_token_base": mean_of(m, "grpo_clip/first_token_base"),
            "groups_with_variance": None if (z := mean_of(m, "minibatch/zero_variance_frac")) is None else 1 - z}


def recost(r, c):
    """The run's time with each stage's switching replaced by c seconds."""
    return r["seconds"] - r["split"]["switching"] + c * r["split"]["stages"]


def time_to(r, target):
    """Seconds (evaluations taken out) to the run's first evaluation after training at or above target; None: never."""
    return next((t for updates, t, acc in r["curve"] if updates > 0 and acc >= target and t is not None), None)


def spread(values):
    """mean, min, max, n and the mean's 95 % t interval (low, high: None below two values) of the values given."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    _, low, high = plot.t_interval(values)
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values), "low": low,
            "high": high}


def collect(runs_dir):
    """{point (label, μ): {(build, seed): summary}} of the finished runs under runs_dir (run_stages.sh's .done/all),
    and the unfinished run directories (a killed or running frontier: their last evaluation is not the point's
    final)."""
    points, unfinished = {}, []
    for run_dir in sorted(p for p in Path(runs_dir).glob("build*/seed*/*-mu*") if p.is_dir()):
        if not (run_dir / ".done" / "all").exists():
            unfinished.append(run_dir)
            continue
        label, mu = run_dir.name.rsplit("-mu", 1)
        r = summarize(run_dir)
        if r is not None:
            points.setdefault((label, int(mu) if mu.isdigit() else mu), {})[(run_dir.parents[1].name, run_dir.parent.name)] = r
    return points, unfinished


def diagnostics_markdown(points, measured):
    """Per point and regime, where the ratio leaves GRPO's clip [0.8, 1.2] in the direction that clip stops (A > 0
    above 1.2, A < 0 below 0.8: the tokens on which a wider clip and GRPO's differ), the share of those that are a
    response's first token (against the first tokens' share of all), vetoed and clipped fractions."""
    lines = ["| point | regime | runs | final accuracy | beyond GRPO's clip: A>0, ρ>1.2 | A<0, ρ<0.8 | first tokens among "
             "them (of all tokens) | clipped by its own clip | vetoed | KL(behaviour ‖ π) |", "|" + "---|" * 10]
    for key, runs in sorted(points.items(), key=lambda kv: order(kv[0])):
        for name in sorted({regimes.build_regime(measured, b) for b, _ in runs}):
            rs = [r for (b, _), r in runs.items() if regimes.build_regime(measured, b) == name]
            mean = lambda k: (sum(v) / len(v) if (v := [r[k] for r in rs if r.get(k) is not None]) else None)  # noqa: E731
            num = lambda k, d=4: "—" if mean(k) is None else f"{mean(k):.{d}f}"  # noqa: E731
            lines.append(f"| {key[0]} μ = {key[1]} | {name} | {len(rs)} | {num('final', 3)} | {num('grpo_clip_upper')} | "
                         f"{num('grpo_clip_lower')} | {num('grpo_clip_first_share', 2)} ({num('first_token_base', 2)}) | "
                         f"{num('clipped_frac')} | {num('vetoed_frac')} | {num('kl_behavior')} |")
    return "\n".join(lines)


def runs_markdown(points):
    """Every run's final accuracy: a row per point, a column per (build, seed)."""
    runs = sorted({k for r in points.values() for k in r}, key=lambda k: (int(k[0][5:]), int(k[1][4:])))
    lines = ["| point | " + " | ".join(f"{b} {s}" for b, s in runs) + " |", "|" + "---|" * (len(runs) + 1)]
    for key, rs in sorted(points.items(), key=lambda kv: order(kv[0])):
        lines.append(f"| {key[0]} μ = {key[1]} | " + " | ".join(f"{rs[k]['final']:.3f}" if k in rs else ""
                                                              for k in runs) + " |")
    return "\n".join(lines)


def point_key(point):
    """A point's key (label, μ) from its label:μ (μ a whole number, or "drift")."""
    label, mu = point.rsplit(":", 1)
    return label, int(mu) if mu.isdigit() else mu


def baseline_key(points, baseline):
    """The baseline's key (label, μ), refused in one line when the frontier has no runs of it."""
    key = point_key(baseline)
    if key not in points:
        sys.exit(f"baseline {baseline}: no finished runs of it (points: "
                 f"{', '.join(f'{k[0]}:{k[1]}' for k in sorted(points, key=order))})")
    return key


def speedups(points, base_key, costs):
    """Per point, over the (build, seed) pairs it shares with the baseline: the baseline's time over the point's at
    equal updates, at matched accuracy (the time each first reaches the bottom of the baseline's final accuracies
    on that build), and re-costed at each switching cost c of costs (seconds)."""
    base = points.get(base_key, {})
    targets = {}
    for (build, _), r in base.items():
        targets[build] = min(targets.get(build, math.inf), r["final"])
    table = {}
    for key, runs in points.items():
        pairs = [(runs[k], base[k], targets[k[0]]) for k in runs if k in base]
        matched = [(time_to(b, target), time_to(r, target)) for r, b, target in pairs]
        table[key] = {
            "equal_updates": spread([b["seconds"] / r["seconds"] for r, b, _ in pairs]),
            "matched_accuracy": spread([tb / tp for tb, tp in matched if tb and tp]),
            "never": sum(tp is None for _, tp in matched), "pairs": len(pairs),
            "recost": {c: spread([recost(b, c) / recost(r, c) for r, b, _ in pairs]) for c in costs}}
    return table


def fmt(s, digits=2):
    return "—" if s is None else f"{s['mean']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def fmt_ci(s, digits=2):
    """mean [95 % t interval] (a speed-up over its pairs); one pair: its value."""
    if s is None:
        return "—"
    return f"{s['mean']:.{digits}f}" + ("" if s["low"] is None else f" [{s['low']:.{digits}f}, {s['high']:.{digits}f}]")


def order(key):
    """Points by label, then μ, the drift rule ("drift") after the fixed μ."""
    label, mu = key
    return label, mu if isinstance(mu, int) else math.inf


def point_rows(points, speed):
    """Per point, the mean over its runs of each measured number, with the speed-ups."""
    rows = []
    for (label, mu), runs in sorted(points.items(), key=lambda kv: order(kv[0])):
        rs = list(runs.values())
        mean = lambda f: sum(f(r) for r in rs) / len(rs)  # noqa: E731
        opt = lambda key: spread([r[key] for r in rs])  # noqa: E731
        wall = mean(lambda r: r["split"]["wall"])
        rows.append({"label": label, "mu": mu, "runs": len(rs), "final": spread([r["final"] for r in rs]),
                     "final_stderr": mean_stderr([r["final_stderr"] for r in rs]),
                     "minutes": mean(lambda r: r["seconds"]) / 60,
                     "split": {k: mean(lambda r: r["split"][k]) / max(wall, 1e-9)
                               for k in ("generation", "training", "switching", "evaluation", "idle")},
                     "stages": mean(lambda r: r["split"]["stages"]),
                     "switch_per_stage": spread([r["split"]["switching"] / r["split"]["stages"] for r in rs]),
                     "staleness": {q: mean(lambda r: r["staleness"][q]) for q in ("p50", "p95", "max")},
                     "ess_frac": opt("ess_frac"), "kl_behavior": opt("kl_behavior"),
                     "ratio_neg_adv": opt("ratio_neg_adv"), "vetoed_frac": opt("vetoed_frac"),
                     "clipped_frac": opt("clipped_frac"), "speedup": speed[(label, mu)]})
    return rows


def markdown(rows):
    cs = " | ".join(f"c = {c:g} s" for c in costs_s)
    lines = [f"| point | runs | final accuracy | ± SE | minutes | gen / train / switch / eval / idle % | switching per stage, s "
             f"| staleness p50 / p95 / max | ESS | KL(behaviour ‖ π) | E[ρ \\| A<0] | vetoed | clipped | speed-up, equal "
             f"updates | at matched accuracy | {cs} |", "|" + "---|" * (15 + len(costs_s))]
    for p in rows:
        sp = p["speedup"]
        split = " / ".join(f"{round(100 * p['split'][k]):d}" for k in ("generation", "training", "switching", "evaluation",
                                                                   "idle"))
        se = "—" if p["final_stderr"] is None else f"{p['final_stderr']:.3f}"
        matched = fmt_ci(sp["matched_accuracy"]) if sp["matched_accuracy"] else ""
        matched += f"{', ' if matched else ''}never in {sp['never']} of {sp['pairs']}" if sp["never"] else ""
        lines.append(
            f"| {p['label']} μ = {p['mu']} | {p['runs']} | {fmt(p['final'], 3)} | {se} | {p['minutes']:.1f} | {split} | "
            f"{fmt_ci(p['switch_per_stage'])} | "
            f"{p['staleness']['p50']:.0f} / {p['staleness']['p95']:.0f} / {p['staleness']['max']:.0f} | "
            f"{fmt(p['ess_frac'])} | {fmt(p['kl_behavior'], 4)} | {fmt(p['ratio_neg_adv'], 3)} | "
            f"{fmt(p['vetoed_frac'], 3)} | {fmt(p['clipped_frac'], 3)} | {fmt_ci(sp['equal_updates'])} | "
            f"{matched or '—'} | " + " | ".join(fmt_ci(sp["recost"][c]) for c in costs_s) + " |")
    return "\n".join(lines)


def point_styles(keys):
    """{(label, μ): plot keyword arguments}: a colour per μ, a line style and marker per loss."""
    labels = sorted({label for label, _ in keys})
    mus = sorted({mu for _, mu in keys}, key=lambda mu: order(("", mu)))
    return {(label, mu): dict(color=f"C{mus.index(mu) % 10}", ls=("-", "--", ":", "-.")[labels.index(label) % 4],
                              marker="osD^v*"[labels.index(label) % 6]) for label, mu in keys}


def point_curve(curves):
    """A point's runs' accuracy curves [(updates, seconds or None, accuracy)] averaged at every update count any of
    them was evaluated at, each run taken at its last evaluation at or before it (stages that end on drift are
    evaluated at other counts in every run; plot.mean_curve, for an ablation's replays, needs the same counts):
    [(updates, mean seconds, mean accuracy)], up to the fewest updates a run reached."""
    last = min(c[-1][0] for c in curves)
    out = []
    for u in sorted({e[0] for c in curves for e in c if e[0] <= last}):
        at = [max((e for e in c if e[0] <= u), key=lambda e: e[0]) for c in curves]
        out.append((u, float(np.mean([e[1] or 0.0 for e in at])), float(np.mean([e[2] for e in at]))))
    return out


def accuracy_figure(points, runs=None):
    """Accuracy against minutes, evaluations taken out, and against updates, each point's mean over the same runs
    (`runs`, (build, seed) pairs; default: every pair a point has; a point without all of them is left out, so no
    curve is an average over other builds than the next): a matplotlib Figure (made without pyplot: no backend is
    chosen, none is left open)."""
    from matplotlib.figure import Figure  # matplotlib: only for figures (the table and the estimate need none)
    runs = set(runs) if runs is not None else {k for rs in points.values() for k in rs}
    style = point_styles(points)
    fig = Figure(figsize=(12, 4.5))
    ax_t, ax_u = fig.subplots(1, 2)
    for (label, mu), point_runs in sorted(points.items(), key=lambda kv: order(kv[0])):
        if not runs <= set(point_runs):
            continue
        updates, minutes, acc = zip(*point_curve([point_runs[k]["curve"] for k in sorted(runs)]))
        ax_t.plot(np.array(minutes) / 60, acc, ms=3, label=f"{label} μ={mu}", **style[(label, mu)])
        ax_u.plot(updates, acc, ms=3, label=f"{label} μ={mu}", **style[(label, mu)])
    builds = sorted({b for b, _ in runs}, key=lambda b: int(b[5:]))
    ax_t.set(xlabel="minutes (evaluations taken out)", ylabel=f"test accuracy (mean over the same {len(runs)} runs)",
             title="accuracy against wall-clock")
    ax_u.set(xlabel="updates", ylabel=f"test accuracy (mean over the same {len(runs)} runs)",
             title=f"accuracy against updates ({', '.join(builds)})")
    ax_u.legend(fontsize=7)
    fig.tight_layout()
    return fig


def recost_figure(speed, baseline, costs):
    """Each point's speed-up over the baseline (label:μ) at equal updates, re-costed at each switching cost of costs
    (seconds per stage; speed from speedups at the same costs): a matplotlib Figure, as accuracy_figure's."""
    from matplotlib.figure import Figure  # matplotlib: only for figures
    style = point_styles(speed)
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    x = [max(c, 0.1) for c in costs]             # c = 0 drawn at 0.1 s on the log axis
    for (label, mu), sp in sorted(speed.items(), key=lambda kv: order(kv[0])):
        if all(sp["recost"][c] for c in costs):
            ax.plot(x, [sp["recost"][c]["mean"] for c in costs], ms=4, label=f"{label} μ={mu}",
                    **style[(label, mu)])
    ax.set_xscale("log")
    ax.set(xlabel="switching cost per stage c, seconds (0 at 0.1)", ylabel=f"speed-up over {baseline} at equal updates",
           title="the algorithm apart from the system")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def figures(points, speed, baseline, costs, where):
    """The accuracy and the re-costing figures, saved in where as frontier_accuracy.png (the points that ran on every
    build and seed the baseline did, over those runs) and frontier_recost.png, and, when some points ran on fewer
    runs (the sweep beside KEY_POINTS), frontier_sweep.png: every point over the runs they all have. {path: Figure}."""
    where = Path(where)
    where.mkdir(parents=True, exist_ok=True)
    base_runs = set(points[point_key(baseline)])
    shared = set.intersection(*(set(rs) for rs in points.values()))
    drawn = {where / "frontier_accuracy.png": accuracy_figure(points, base_runs),
             where / "frontier_recost.png": recost_figure(speed, baseline, costs)}
    if shared != base_runs and shared:
        drawn[where / "frontier_sweep.png"] = accuracy_figure(points, shared)
    for path, fig in drawn.items():
        fig.savefig(path, dpi=120)
    return drawn


def estimate(figures, stage_updates, mus):
    """{μ: {c: hours}}: every point generates and trains on the same prompts, so its compute is the preflight's
    hours per stage of stage_updates updates (generation and optimization; grading overlaps generation) scaled to
    total_updates; each of its total_updates / μ stages adds a switching cost c. The drift rule's stage count is not
    known in advance (None)."""
    hours = figures["estimated_hours_per_stage"]
    compute = (hours["generate"] + hours["optimize"]) * total_updates / stage_updates
    return {mu: {c: compute + total_updates // mu * c / 3600 if isinstance(mu, int) else None for c in costs_s}
            for mu in mus}


def print_estimate():
    report = json.loads(Path(estimate_from).read_text())
    keys = [point_key(p) for p in estimate_points.split()]
    hours = estimate(report["figures"], preflight_updates, {mu for _, mu in keys})
    print(f"ESTIMATE from the preflight's throughputs ({estimate_from}), hours per run: compute, plus a switching cost "
          f"c per stage (resident stages cost seconds, processes per phase minutes). It scales one stage's measured "
          f"throughput: smaller stages fill the engines' batches less (their generation is slower), larger ones more")
    print("| point | stages | " + " | ".join(f"c = {c:g} s" for c in costs_s) + " |")
    print("|" + "---|" * (2 + len(costs_s)))
    for label, mu in sorted(keys, key=order):
        stages = total_updates // mu if isinstance(mu, int) else "?"
        print(f"| {label}:{mu} | {stages} | " + " | ".join("—" if hours[mu][c] is None else f"{hours[mu][c]:.2f}"
                                                         for c in costs_s) + " |")


def main():
    if estimate_from:
        return print_estimate()
    points, unfinished = collect(runs_dir)
    if unfinished:
        print(f"left out, not finished: {', '.join(str(p.relative_to(runs_dir)) for p in unfinished)}\n")
    if not points:
        sys.exit(f"{runs_dir}: no finished run under build*/seed*/*-mu*: run frontier.sh first")
    speed = speedups(points, baseline_key(points, baseline), costs_s)
    rows = point_rows(points, speed)
    measured = regimes.load_regimes(Path(runs_dir) / "regimes")
    compared = regimes.comparisons(points, measured, {point_key(p) for p in key_points.split()} or None)
    where = Path(out or runs_dir)
    where.mkdir(parents=True, exist_ok=True)
    selection = Path(runs_dir) / "regimes" / "selection.json"
    chosen = json.loads(selection.read_text()) if selection.exists() else None
    regimes_part = ["The builds' regimes (each measured by its probe when built)", regimes.selection_table(
        measured, chosen["candidates"], chosen["kept"]) + "\n\n" + chosen["summary"]] if chosen else []
    chosen = chosen["summary"] if chosen else "builds given (BUILDS), not chosen by the rule"
    table = "\n\n".join([markdown(rows)] + regimes_part + [
        f"The paper's comparisons, paired (same build, same seed), the build the unit: final accuracy differences "
        f"(each build's seeds averaged), 95 % t intervals over builds (df = builds − 1) and p Holm-adjusted over "
        f"the comparisons between {'the key points ' + key_points if key_points else 'any points'}, per regime "
        f"({chosen})", regimes.comparisons_markdown(compared),
        "Where the ratio leaves GRPO's clip, per regime", diagnostics_markdown(points, measured),
        "Every run's final accuracy", runs_markdown(points)])
    common.atomic_write_json(where / "frontier.json", {
        "baseline": baseline, "costs": costs_s, "points": rows, "comparisons": compared, "regimes": measured,
        "runs": {f"{k[0]}:{k[1]}": {f"{b}/{s}": r for (b, s), r in runs.items()} for k, runs in points.items()}})
    common.atomic_write(where / "frontier.md", table + "\n")
    figures(points, speed, baseline, costs_s, where / "plots")
    print(table)
    print("\n± SE: the final accuracy's test-set standard error (each run's avg@k over its problems, in quadrature "
          "over the point's runs); min–max: over builds and seeds.")
    print(f"speed-ups against {baseline} over the (build, seed) pairs both ran: mean [95 % t interval over the pairs]; "
          f"other columns: mean (min–max) over the runs; matched accuracy: "
          f"each run's first evaluation at or above the lowest final accuracy of {baseline}'s seeds on that build; "
          f"c: each stage's switching re-costed at c seconds. → {where}/frontier.md, frontier.json, plots/")
    print(f"verdicts: reproduced only where the Holm-adjusted p is at most {regimes.alpha:g} and the interval "
          f"excludes zero in the paper's direction (\"matches\": excludes −{regimes.match_margin:g}, a margin of "
          f"accuracy); regimes: tools/regimes.py")


if __name__ == "__main__":
    main()
