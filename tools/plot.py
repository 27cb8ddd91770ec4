"""Figures and a wall-clock summary of one or more runs (matplotlib, headless PNG).

    python tools/plot.py --run_dir=runs/toy-mu-grpo                       # figures into <run_dir>/plots/
    python tools/plot.py --run_dir=runs/a,runs/b --out_dir=plots/compare  # two runs on the same axes
    python tools/plot.py --run_dir=runs/toy-mu-grpo --summary=true        # also print time per phase
    python tools/plot.py --ablation_dir=runs/lab-ablation                 # ablate.sh: Fig. 2, Fig. 3, table.md

A run's records are read through mu_grpo/records.py (records.load_run(path): plain lists of dicts), as in
notebooks/results.ipynb.
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the repository's root: mu_grpo
from mu_grpo import common  # noqa: E402
from mu_grpo import records  # noqa: E402

# ----------------------------------------------------------------------------- hyperparameters
run_dir = "runs/toy-mu-grpo"    # one run directory, or several separated by commas
out_dir = ""                    # default: <first run_dir>/plots
summary = False                 # print time per phase, switching overhead and accuracy per stage
ablation_dir = ""               # an ablate.sh output directory: its figures and table instead of a run's
collapse_below = 0.5            # ablation table: a seed has collapsed once its accuracy < this × the initial one
# -----------------------------------------------------------------------------


def canvas(out):
    """(pyplot, save(fig, name): the figure written into out, the list of what was written) for a figure function."""
    import matplotlib  # matplotlib: only for figures (the notebook and bench/ also read its tables)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(out / name)
    return plt, save, written


def figures(runs, out):
    plt, save, written = canvas(out)
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        acc = records.accuracy_by_stage(run)
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
                pts = [(m["run_update"], m[key]) for m in run["metrics"] if m.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts), label=f"{run['name']}: {label}")
        for run in runs[:1]:
            for m in run["metrics"]:
                if m["update"] == 0 and m["stage"] > 0:
                    ax.axvline(m["run_update"] - 0.5, color="grey", alpha=0.3)
            for end in run["stage_ends"].values():     # a stage that ended on the drift warning, before its last
                if end["reason"] == "drift":           # generated minibatch
                    ax.axvline(end["run_updates"] - 0.5, color="red", linestyle="--", alpha=0.5)
        ax.set(xlabel="update (stages back to back; grey: a new stage's rollouts; red dashed: a stage ended on drift)",
               title=title)
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


# ----------------------------------------------------------------------------- ablate.sh


CLIP_VARIANTS = ("grpo", "relaxed-no-nav", "mu-grpo", "m2po", "dapo")            # Fig. 2
SCOPE_VARIANTS = ("relaxed-no-nav", "nav-none", "nav-T", "mu-grpo", "nav-S", "nav-seq")  # Fig. 3 (mu-grpo: H)
AGAINST = ("relaxed-no-nav", "grpo", "onpolicy-grpo")   # what every replay is compared with (the table's rows)
# (each a LOSS preset of loss.py, onpolicy-grpo ablate.sh's reference: tests/test_objectives.py checks them)


def load_ablation(path):
    """ablate.sh's outputs as {variant: {"curves": {seed: [(updates, accuracy)]}, "metrics": {seed: [rows]}}};
    the on-policy reference is the variant "onpolicy-<loss>", its curve the stage policies'. The initial
    policy (updates 0) starts every curve."""
    path = Path(path).resolve()
    rows = records.own_results(common.read_jsonl(path / records.RESULTS, missing_ok=True))     # (not a hand evaluation)
    initial = [r["avg_at_k"] for r in rows if path not in Path(r["policy"]).resolve().parents]
    out = {}
    for r in rows:
        p = Path(r["policy"]).resolve()
        if path not in p.parents:
            continue
        parts = p.relative_to(path).parts            # <variant>/seed<k>/policy[_u…] or …/seed<k>/stage_<s>/policy
        variant, seed = parts[0], int(parts[1].removeprefix("seed"))
        out.setdefault(variant, {"curves": {}, "metrics": {}})["curves"].setdefault(seed, []).append(
            (r["updates"], r["avg_at_k"]))
    for variant, v in out.items():
        for seed, curve in v["curves"].items():
            v["curves"][seed] = sorted(([(0, initial[0])] if initial else []) + curve)
            v["metrics"][seed] = common.read_jsonl(path / variant / f"seed{seed}" / records.METRICS, missing_ok=True)
    return out, (initial[0] if initial else float("nan"))


def mean_curve(curves):
    """[(updates, mean, min, max)] over seeds, at the updates every seed has."""
    common_updates = sorted(set.intersection(*(set(u for u, _ in c) for c in curves.values())))
    table = [{u: a for u, a in c} for c in curves.values()]
    return [(u, sum(t[u] for t in table) / len(table), min(t[u] for t in table), max(t[u] for t in table))
            for u in common_updates]


def metric_curve(metrics, key, window=8):
    """A per-update metric averaged over seeds, then a trailing moving average over `window` updates."""
    by_update = {}
    for rows in metrics.values():
        for m in rows:
            if m.get(key) is not None:
                by_update.setdefault(m["update"], []).append(m[key])
    xs = sorted(by_update)
    ys = [sum(by_update[x]) / len(by_update[x]) for x in xs]
    smooth = [sum(ys[max(0, i - window + 1):i + 1]) / len(ys[max(0, i - window + 1):i + 1]) for i in range(len(ys))]
    return xs, smooth


T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}   # Student's t, 97.5 % point, by df


def t_interval(values):
    """(mean, low, high): the 95 % t interval of the mean of values, df = n − 1 (the t point of the largest tabled df
    at or below it: never narrower than the exact one); low = high = None with fewer than two values."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = T975[max(df for df in T975 if df <= n - 1)] * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def t_two_sided_p(t, df):
    """P(|T| ≥ |t|) for Student's t with df degrees of freedom: the regularized incomplete beta I_x(df/2, 1/2) at
    x = df / (df + t²)."""
    return incomplete_beta(df / (df + t * t), df / 2.0, 0.5)


def incomplete_beta(x, a, b):
    """The regularized incomplete beta I_x(a, b), by its continued fraction (Lentz's method), on the side where it
    converges fast (I_x(a, b) = 1 − I_{1−x}(b, a) on the other)."""
    if x <= 0.0 or x >= 1.0:
        return max(0.0, min(1.0, x))
    if x > (a + 1) / (a + b + 2):
        return 1.0 - incomplete_beta(1.0 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    f, c, d, tiny = 1.0, 1.0, 0.0, 1e-300
    for i in range(400):
        m = i // 2
        term = 1.0 if i == 0 else (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)) if i % 2 == 0 else
                                   -((a + m) * (a + b + m) * x) / ((a + 2 * m) * (a + 2 * m + 1)))
        d = 1.0 / (1.0 + term * d if abs(1.0 + term * d) > tiny else tiny)
        c = 1.0 + term / c if abs(1.0 + term / c) > tiny else tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-14:
            break
    return front * (f - 1.0)


def paired_test(differences):
    """(mean, 95 % t interval low, high, two-sided p) of the mean of paired differences, df = n − 1."""
    mean, low, high = t_interval(differences)
    n = len(differences)
    if n < 2:
        return mean, None, None, None
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    # no spread: the same difference on every pair, p 0 unless it is none (two arms bit-identical)
    p = (1.0 if mean == 0 else 0.0) if sd == 0 else t_two_sided_p(mean / (sd / math.sqrt(n)), n - 1)
    return mean, low, high, p


def holm(pvalues):
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest p times (m − i + 1), never below an
    earlier one's, at most 1. A comparison survives at level α when its adjusted p ≤ α."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def lowest_ratio_neg(rows):
    """A replay's lowest per-update E[ρ | A<0] (the paper's collapse warning; None: no update had an A<0 token)."""
    return min((m["ratio/mean_neg_adv"] for m in rows if m.get("ratio/mean_neg_adv") is not None), default=None)


ABLATION_STATISTICS = {         # what ablation_comparisons compares: a replay's (variant's, seed's) number
    "final accuracy": lambda v, seed: v["curves"][seed][-1][1],
    "lowest E[ρ | A<0]": lambda v, seed: lowest_ratio_neg(v["metrics"].get(seed, [])),
}


def ablation_comparisons(ablation, against=AGAINST):
    """Every variant against each variant of `against` (the relaxed clip alone, GRPO's clip on the same stale
    rollouts, GRPO at small μ with fresh rollouts), paired by seed, for each of ABLATION_STATISTICS (final accuracy;
    the lowest E[ρ | A<0], which the reference's records lack): the differences, their mean and 95 % t interval over
    the seeds. Replays of one seed share the stage's rollouts and their minibatch order."""
    rows = []
    for statistic, of in ABLATION_STATISTICS.items():
        for base in [b for b in against if b in ablation]:
            for variant, v in ablation.items():
                seeds = sorted(set(v["curves"]) & set(ablation[base]["curves"]))
                pairs = [(s, of(v, s), of(ablation[base], s)) for s in seeds]
                pairs = [(s, a, b) for s, a, b in pairs if a is not None and b is not None]
                if variant == base or variant.startswith("onpolicy-") or not pairs:
                    continue
                diffs = [a - b for _, a, b in pairs]
                mean, low, high = t_interval(diffs)
                rows.append({"statistic": statistic, "variant": variant, "against": base, "seeds": [s for s, _, _ in pairs],
                             "differences": diffs, "mean": mean, "low": low, "high": high})
    return rows


def comparisons_markdown(rows):
    lines = ["| statistic | variant − against | seeds | differences | mean | 95 % t interval |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ci = "—" if r["low"] is None else f"{r['low']:+.3f} to {r['high']:+.3f}"
        lines.append(f"| {r['statistic']} | {r['variant']} − {r['against']} | {len(r['seeds'])} | "
                     f"{', '.join(f'{d:+.3f}' for d in r['differences'])} | {r['mean']:+.3f} | {ci} |")
    return "\n".join(lines) + "\n"


def ablation_table(ablation, initial):
    """One row per variant: final and best mean accuracy (spread over seeds), the seeds that collapsed and
    the first update where one did, the lowest E[ρ | A<0], and the mean vetoed and clipped token fractions."""
    table = []
    for variant, v in ablation.items():
        curve = mean_curve(v["curves"])
        finals = [c[-1][1] for c in v["curves"].values()]
        collapsed = [next((u for u, a in c if a < collapse_below * initial), None) for c in v["curves"].values()]
        per_seed_min = [r for rows in v["metrics"].values() if (r := lowest_ratio_neg(rows)) is not None]

        # absent: a mask or clip the loss has not (0), a metric it did not log; NaN (an update
        # without such tokens): left out
        def mean_metric(key, absent=0.0):
            vals = [m.get(key) for rows in v["metrics"].values() for m in rows]
            vals = [x for x in (absent if x is None else x for x in vals) if x == x]
            return sum(vals) / len(vals) if vals else float("nan")
        best = max(curve, key=lambda c: c[1])
        table.append({
            "variant": variant, "seeds": len(finals), "final": sum(finals) / len(finals),
            "final_min": min(finals), "final_max": max(finals), "best": best[1], "best_at": best[0],
            "collapsed_seeds": sum(u is not None for u in collapsed),
            "collapse_at": min((u for u in collapsed if u is not None), default=None),
            "min_ratio_neg": sum(per_seed_min) / len(per_seed_min) if per_seed_min else float("nan"),
            "vetoed_frac": mean_metric("nav/vetoed_frac"),
            "clipped_frac": mean_metric("clip/upper_frac") + mean_metric("clip/lower_frac")
                            + mean_metric("m2po/masked_frac"),
            # every objective's: the share of each sign's tokens given no gradient (clipped, masked, vetoed, its own)
            "zero_pos": mean_metric("grad/zero_frac_pos", math.nan), "zero_neg": mean_metric("grad/zero_frac_neg", math.nan)})
    return table


def table_markdown(table, initial):
    def f(x, digits):      # the reference's metrics are not read (its stages are separate runs): "—"
        return "—" if x != x else f"{x:.{digits}f}"
    lines = [f"initial policy: {initial:.3f}; collapse: a seed's accuracy below {collapse_below:g} × the initial",
             "", "| variant | seeds | final (min–max) | best (at update) | collapsed seeds (first at) | "
             "lowest E[ρ \\| A<0] | vetoed tokens | clipped/masked tokens | no gradient, A>0 | no gradient, A<0 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        collapse = f"{r['collapsed_seeds']} ({r['collapse_at']})" if r["collapsed_seeds"] else "0"
        lines.append(f"| {r['variant']} | {r['seeds']} | {r['final']:.3f} ({r['final_min']:.3f}–{r['final_max']:.3f}) "
                     f"| {r['best']:.3f} ({r['best_at']}) | {collapse} | {f(r['min_ratio_neg'], 3)} | "
                     f"{f(r['vetoed_frac'], 4)} | {f(r['clipped_frac'], 4)} | {f(r['zero_pos'], 4)} | "
                     f"{f(r['zero_neg'], 4)} |")
    return "\n".join(lines) + "\n"


def ablation_figures(ablation, out):
    """Fig. 2: accuracy vs updates of the clip variants and their clipped-token fraction; Fig. 3: accuracy
    vs updates per NAV veto scope and E[ρ | A<0]. Lines: mean over seeds; bands: min–max."""
    plt, save, written = canvas(out)
    reference = [v for v in ablation if v.startswith("onpolicy-")]
    figs = [("fig2_clip.png", "clipping dilemma", CLIP_VARIANTS, "clipped (or M2PO-masked) token fraction",
             ("clip/upper_frac", "clip/lower_frac", "m2po/masked_frac")),
            ("fig3_nav_scope.png", "NAV veto scope", SCOPE_VARIANTS, "E[ρ | A<0] (collapse warning)",
             ("ratio/mean_neg_adv",))]
    for name, title, variants, right_label, keys in figs:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for variant in [v for v in variants if v in ablation] + reference:
            curve = mean_curve(ablation[variant]["curves"])
            label = "mu-grpo (NAV H)" if variant == "mu-grpo" else variant
            line, = left.plot([c[0] for c in curve], [c[1] for c in curve], marker="o", ms=3, label=label,
                              linestyle="--" if variant in reference else "-")
            left.fill_between([c[0] for c in curve], [c[2] for c in curve], [c[3] for c in curve],
                              color=line.get_color(), alpha=0.15)
            if variant in reference:
                continue
            series = [metric_curve(ablation[variant]["metrics"], k) for k in keys]
            xs = series[0][0]
            if xs:
                right.plot(xs, [sum(s[1][i] for s in series if len(s[1]) == len(xs)) for i in range(len(xs))],
                           color=line.get_color(), label=label)
        left.set(xlabel="updates on the same stale rollouts", ylabel="test accuracy (avg@k)",
                 title=f"{title}: accuracy vs updates")
        right.set(xlabel="update (= staleness of its minibatch)", ylabel=right_label,
                  title="per update: mean over seeds, 8-update moving average")
        if keys == ("ratio/mean_neg_adv",):      # a log axis with plain tick labels (0.1, 1, 5), not 1.4×10⁰
            from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # only for a log axis
            right.set_yscale("log")
            right.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            right.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
            right.yaxis.set_minor_formatter(NullFormatter())
        left.legend(fontsize=7)
        right.legend(fontsize=7)
        save(fig, name)
    return written


def main_ablation():
    ablation, initial = load_ablation(ablation_dir)
    if not ablation:
        sys.exit(f"{ablation_dir}/results.jsonl has no evaluated replay: run ablate.sh first")
    out = Path(out_dir or Path(ablation_dir) / "plots")
    for path in ablation_figures(ablation, out):
        print(f"wrote {path}")
    table, paired = ablation_table(ablation, initial), ablation_comparisons(ablation)
    common.atomic_write_json(out / "table.json", table)
    common.atomic_write_json(out / "comparisons.json", paired)
    text = (table_markdown(table, initial) + "\npaired by seed: final accuracy and the lowest E[ρ | A<0] (95 % t "
            "interval over the seeds, df = seeds − 1; a difference is shown where its interval excludes zero):\n\n"
            + comparisons_markdown(paired))
    (out / "table.md").write_text(text)
    print(f"wrote {out / 'table.md'}\n")
    print(text)


if __name__ == "__main__":
    common.apply_overrides(globals(), sys.argv[1:])
    if ablation_dir:
        main_ablation()
        sys.exit(0)
    try:
        runs = [records.load_run(p) for p in run_dir.split(",")]
    except ValueError as e:         # a record damaged from outside (the run writes whole lines): named, no traceback
        sys.exit(f"{e}: restore the file from a copy, or remove its damaged line (the figures leave that row out)")
    for path, run in zip(run_dir.split(","), runs):     # (figures of nothing would be five empty files)
        if not (run["results"] or run["metrics"] or run["timeline"]):
            sys.exit(f"--run_dir={path}: {'no such directory' if not Path(path).is_dir() else 'it holds no run'} "
                     f"(no results.jsonl, metrics.jsonl or timeline.jsonl): a run_stages.sh or optimize.py run directory")
    for path in figures(runs, out_dir or Path(run_dir.split(",")[0]) / "plots"):
        print(f"wrote {path}")
    if summary:
        for run in runs:
            per_kind, total, gen, train, overhead = records.phase_summary(run)
            print(f"\n{run['name']}: {total / 60:.1f} min in all; " +
                  ", ".join(f"{k} {v:.0f} s" for k, v in per_kind.items()))
            print(f"generation compute {gen:.0f} s, training compute {train:.0f} s; switching overhead (start-up, "
                  f"loading, saving, I/O, grading) {100 * overhead:.0f}% of the non-evaluation time")
            if "resident" in per_kind:
                parts = records.resident_parts(run)
                print("resident processes: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()))
            for stage, updates, hours, acc in records.accuracy_by_stage(run):
                print(f"  stage {stage:>2} ({updates:>5} updates, {hours * 60:6.1f} min): mean avg@k {acc:.3f}")
            for stage, end in sorted(run["stage_ends"].items()):
                if end["stage_end"] == "drift":
                    print(f"  stage {stage:>2} trained {end['updates']} of its {end['generated_updates']} minibatches "
                          f"({end['reason']}; drift signal {end['drift_signal'] if end['drift_signal'] is not None else 'n/a'}"
                          f"; {end['unused_prompts']} prompts unused)")
