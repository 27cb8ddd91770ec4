"""docs/multistage.md's analysis of bench/multistage_runs.sh's runs (2026-12-02), from their records only:

    python bench/multistage.py --command=evaluate     # held-out avg@1 of the policies saved within stages (SAVE_POLICY_EVERY)
    python bench/multistage.py                        # the tables (stdout, <out>/multistage.json) and the figures

1. each method's lr chosen on the test split (the mean over builds of its final test accuracy), every method then
   reported at its own lr on held-out;
2. the nine comparisons declared before the runs (docs/multistage.md): per build the difference of final held-out
   accuracy, its mean over builds with a t interval (df = builds − 1) and p, Holm over the nine;
3. at each stage boundary of the four-stage runs: the Adam step's RMS over lr and Σg²/Σv̂ per parameter group and the
   KL to the behaviour policy, mean of a stage's first 16 updates against the previous stage's last 16;
4. held-out accuracy within a stage (the policies saved every 16 updates);
5. the candidate signals' AUC for a fall of held-out accuracy at the next evaluation, with a bootstrap interval over
   builds.
"""
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
from mu_grpo import common, records  # noqa: E402
import plot  # noqa: E402

command = "report"              # report | evaluate
out = "runs/multistage"         # bench/multistage_runs.sh's OUT
data = "data"                   # where the runs' lab builds are (data/lab_fork_build<b>)
lrs = "1e-4,3e-5,1e-5"          # the grid (more points as they are run)
arms = "reset,relaxed-high,relaxed-low,beta2-0.95,stage-warmup-16"
fall = 0.02                     # a fall: held-out accuracy down by more than this at the next evaluation (2 SE)
bootstrap = 4000                # resamples of the builds for the AUC's interval
figures_dir = "docs"            # where the figures go
within_runs = "mu-grpo-d1e-4-mu64"   # --command=evaluate: the runs whose within-stage policies are evaluated
within_stages = "1"             # ... and their stages (the first stage after which the lr-1e-4 runs fall)
common.apply_overrides(globals(), sys.argv[1:] if __name__ == "__main__" else [])

METHODS = {"GRPO μ = 4": "grpo-mu4", "GRPO μ = 64": "grpo-mu64", "μ-GRPO μ = 64": "mu-grpo-d1e-4-mu64"}
ARM_RUN = {"reset": "mu-grpo-d1e-4-mu64", "relaxed-high": "relaxed-high-d1e-4-mu64",
           "relaxed-low": "relaxed-low-d1e-4-mu64", "beta2-0.95": "mu-grpo-d1e-4-mu64",
           "stage-warmup-16": "mu-grpo-d1e-4-mu64"}
GROUPS = ("attn", "mlp", "embed", "head", "norm", "all")


def runs_of(directory, name):
    """{build: run directory} of the finished runs named `name` under a frontier's directory."""
    found = {}
    for d in sorted(Path(directory).glob(f"build*/seed0/{name}")):
        if (d / ".done" / "all").exists():
            found[int(d.parent.parent.name[len("build"):])] = d
    return found


def accuracy(run, benchmark):
    """[(run updates, avg@1)] of a run's evaluations on one benchmark, in order (the initial policy at 0)."""
    rows = [r for r in records.load_run(run)["results"] if r["benchmark"] == benchmark]
    return sorted({r["updates"]: r["avg_at_k"] for r in rows}.items())


def final(run, benchmark):
    return accuracy(run, benchmark)[-1][1]


def configurations():
    """{label: {build: run}} of every configuration: 'GRPO μ = 4 @ 1e-4', ..., and each arm's."""
    found = {}
    for lr in lrs.split(","):
        for method, name in METHODS.items():
            found[f"{method} @ {lr}"] = runs_of(Path(out) / "fair" / f"lr{lr}", name)
    for arm in arms.split(","):
        found[f"μ-GRPO μ = 64 @ 1e-4, {arm}"] = runs_of(Path(out) / "arms" / arm, ARM_RUN[arm])
    return found


def chosen_lrs(configs):
    """{method: (its lr, {lr: mean final test accuracy over builds})}: the lr with the highest mean, on the builds
    every lr of the method has."""
    chosen = {}
    for method in METHODS:
        per_lr = {lr: configs[f"{method} @ {lr}"] for lr in lrs.split(",")}
        builds = sorted(set.intersection(*(set(r) for r in per_lr.values()))) if per_lr else []
        if not builds:
            continue
        means = {lr: sum(final(runs[b], "test") for b in builds) / len(builds) for lr, runs in per_lr.items()}
        chosen[method] = (max(means, key=means.get), means, builds)
    return chosen


def compare(a, b):
    """Final held-out a − b per build (the builds both have), its mean, t interval and p."""
    builds = sorted(set(a) & set(b))
    diffs = [final(a[x], "heldout") - final(b[x], "heldout") for x in builds]
    if not diffs:
        return None
    mean, low, high, p = plot.paired_test(diffs)
    return {"builds": builds, "differences": diffs, "mean": mean, "low": low, "high": high, "p": p}


def declared(configs, chosen):
    """The nine comparisons of docs/multistage.md, in its order, with Holm's adjusted p over those that ran."""
    at = {m: configs[f"{m} @ {chosen[m][0]}"] for m in chosen}
    base = configs["μ-GRPO μ = 64 @ 1e-4"]
    pairs = [("μ-GRPO 64 − GRPO 4, each at its lr", at.get("μ-GRPO μ = 64"), at.get("GRPO μ = 4")),
             ("μ-GRPO 64 − GRPO 64, each at its lr", at.get("μ-GRPO μ = 64"), at.get("GRPO μ = 64")),
             ("GRPO 64 − GRPO 4, each at its lr", at.get("GRPO μ = 64"), at.get("GRPO μ = 4"))]
    pairs += [(f"{arm} − base", configs[f"μ-GRPO μ = 64 @ 1e-4, {arm}"], base) for arm in arms.split(",")]
    pairs += [("μ-GRPO 64 at lr 3e-5 − base", configs.get("μ-GRPO μ = 64 @ 3e-5"), base)]
    rows = [(name, compare(a, b) if a and b else None) for name, a, b in pairs]
    ran = [r for _, r in rows if r and r["p"] is not None]
    for r, adjusted in zip(ran, plot.holm([r["p"] for r in ran])):
        r["p_holm"] = adjusted
        # while some of the nine have not run: Holm's adjusted p is at most len(pairs) · p whatever their p's are,
        # so a comparison that survives this bound survives the declared family's correction
        r["p_bound"] = min(1.0, len(pairs) * r["p"])
    return rows


def stage_metrics(run):
    """{stage: [metrics rows]} of a run."""
    return {s: common.read_jsonl(d / records.METRICS) for s, d in records.stage_dirs(run)
            if (d / records.METRICS).exists()}


def mean_of(rows, key):
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def boundaries(runs):
    """Per boundary s − 1 → s (s = 1, 2, 3), the mean over builds of: each parameter group's Adam step RMS over lr and
    Σg²/Σv̂, and the KL to the behaviour policy, in stage s's first 16 updates and stage s − 1's last 16."""
    table = {}
    for s in (1, 2, 3):
        for key in [f"adam/step_rms/{g}" for g in GROUPS] + [f"adam/g2_over_v/{g}" for g in GROUPS] + ["ratio/kl"]:
            before, after = [], []
            for run in runs.values():
                m = stage_metrics(run)
                if s in m and s - 1 in m:
                    before.append(mean_of(m[s - 1][-16:], key))
                    after.append(mean_of(m[s][:16], key))
            pairs = [(b, a) for b, a in zip(before, after) if b is not None and a is not None]
            if pairs:
                table[(s, key)] = (sum(b for b, _ in pairs) / len(pairs), sum(a for _, a in pairs) / len(pairs))
    return table


def evaluate_within_stages():
    """evaluate.py on every policy saved within a stage (policy_u<k>) of the runs that saved them, held-out at the
    runs' protocol; rows into <run>/within_stage.jsonl (done policies skipped)."""
    for run in sorted(r for name in within_runs.split(",") for r in Path(out).glob(f"fair/lr*/build*/seed0/{name}")):
        policies = sorted(str(p) for s in within_stages.split(",") for p in run.glob(f"stage_{s}/policy_u*")
                          if (p / "config.json").exists())
        results = run / "within_stage.jsonl"
        done = {r["policy"] for r in common.read_jsonl(results)} if results.exists() else set()
        policies = [p for p in policies if p not in done]
        if not policies:
            continue
        build = run.parent.parent.name[len("build"):]
        data_dir = Path(data) / ("lab_fork" + ("" if build == "0" else f"_build{build}"))
        print(f"{run}: {len(policies)} policies", flush=True)
        subprocess.run([sys.executable, "evaluate.py", f"--policy={','.join(policies)}", f"--data_dir={data_dir}",
                        "--benchmarks=heldout", "--k=1", "--temperature=1.0", "--top_p=1.0",
                        "--max_prompt_tokens=64", "--max_response_tokens=160", "--prompt_template={problem}",
                        f"--results={results}", "--stage=-2"], cwd=ROOT, check=True)


def within_stage(runs):
    """{run updates: mean held-out accuracy over builds} of the stage-end evaluations and the policies saved within
    stages (the builds that have every point)."""
    per_build = {}
    for b, run in runs.items():
        points = dict(accuracy(run, "heldout"))
        path = run / "within_stage.jsonl"
        if path.exists():
            points.update({r["updates"]: r["avg_at_k"] for r in common.read_jsonl(path)})
        per_build[b] = points
    if not per_build:
        return {}
    common_updates = sorted(set.intersection(*(set(p) for p in per_build.values())))
    return {u: sum(p[u] for p in per_build.values()) / len(per_build) for u in common_updates}


def auc(scores, outcomes):
    """The Mann-Whitney AUC: the chance a fall's score exceeds a non-fall's (ties count half); None with one class."""
    pos = [s for s, o in zip(scores, outcomes) if o]
    neg = [s for s, o in zip(scores, outcomes) if not o]
    if not pos or not neg:
        return None
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


SIGNALS = {          # name → (the value at boundary s → s + 1, the sign that predicts a fall)
    "KL(behaviour ‖ π), stage s's last 16 updates": (lambda m, man, s: mean_of(m[s][-16:], "ratio/kl"), 1),
    "wrong-answer share of stage s + 1's rollouts": (
        lambda m, man, s: man[s + 1]["grader_reasons"].get("wrong", 0) / man[s + 1]["responses"], 1),
    "E[ρ | A<0], stage s's mean": (lambda m, man, s: mean_of(m[s], "ratio/mean_neg_adv"), -1),
    "vetoed share, stage s's mean": (lambda m, man, s: mean_of(m[s], "nav/vetoed_frac"), 1),
}


def signal_points(configs, labelled=False):
    """[(build, {signal: value}, fell)] over every boundary s → s + 1 (s = 0, 1, 2) of every four-stage run
    (labelled: (build, {signal: value}, fell, configuration))."""
    points = []
    for label, runs in configs.items():
        if "μ = 4 @" in label:
            continue
        for b, run in runs.items():
            m = stage_metrics(run)
            manifests = {s: json.loads((d / records.ROLLOUTS / records.MANIFEST).read_text())
                         for s, d in records.stage_dirs(run) if (d / records.ROLLOUTS / records.MANIFEST).exists()}
            acc = dict(accuracy(run, "heldout"))
            ends = {s: rows[-1]["run_update"] + 1 for s, rows in m.items()}
            for s in (0, 1, 2):
                if s + 1 not in m or ends.get(s) not in acc or ends.get(s + 1) not in acc:
                    continue
                values = {name: f(m, manifests, s) for name, (f, _) in SIGNALS.items()}
                points.append((b, values, acc[ends[s + 1]] < acc[ends[s]] - fall) + ((label,) if labelled else ()))
    return points


def signal_aucs(points):
    """{signal: (AUC, 2.5 %, 97.5 % of the AUCs of bootstrap resamples of the builds, falls, boundaries)}."""
    builds = sorted({b for b, _, _ in points})
    rng = random.Random(0)
    out_ = {}
    for name, (_, sign) in SIGNALS.items():
        usable = [(b, sign * v[name], fell) for b, v, fell in points if v[name] is not None]
        whole = auc([s for _, s, _ in usable], [f for _, _, f in usable])
        resampled = []
        for _ in range(bootstrap):
            pick = [rng.choice(builds) for _ in builds]
            sample = [(s, f) for b in pick for bb, s, f in usable if bb == b]
            a = auc([s for s, _ in sample], [f for _, f in sample])
            if a is not None:
                resampled.append(a)
        resampled.sort()
        ci = (resampled[int(0.025 * len(resampled))], resampled[int(0.975 * len(resampled)) - 1]) if resampled else \
            (None, None)
        out_[name] = (whole, *ci, sum(f for _, _, f in usable), len(usable))
    return out_


def within_configuration_auc(points, name):
    """The AUC counting only pairs (a fall, a non-fall) of the same configuration: whether the signal tells a fall
    from a calm boundary beyond telling the configurations apart (labelled points); None without such pairs."""
    _, sign = SIGNALS[name]
    hits = pairs = 0.0
    for label in {p[3] for p in points}:
        pos = [sign * v[name] for _, v, f, lab in points if lab == label and f and v[name] is not None]
        neg = [sign * v[name] for _, v, f, lab in points if lab == label and not f and v[name] is not None]
        hits += sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
        pairs += len(pos) * len(neg)
    return hits / pairs if pairs else None


def youden_threshold(points, name):
    """The signal's threshold that maximizes sensitivity + specificity − 1 on these boundaries (the lab's)."""
    _, sign = SIGNALS[name]
    usable = [(v[name], fell) for _, v, fell in points if v[name] is not None]
    best = (None, -1.0)
    for t, _ in usable:
        flagged = [(sign * v >= sign * t, fell) for v, fell in usable]
        falls = sum(f for _, f in flagged) or 1
        calm = sum(not f for _, f in flagged) or 1
        j = sum(x and f for x, f in flagged) / falls + sum(not x and not f for x, f in flagged) / calm - 1
        if j > best[1]:
            best = (t, j)
    return best


def fmt(x, digits=3):
    return "—" if x is None else f"{x:.{digits}f}"


def signed(x):
    return "—" if x is None else f"{x:+.3f}"


def report():
    configs = configurations()
    chosen = chosen_lrs(configs)
    builds = sorted({b for r in configs.values() for b in r})
    lines = ["## Final accuracy per build (test | held-out), after 256 updates", "",
             "| configuration | " + " | ".join(f"b{b}" for b in builds) + " | mean test | mean held-out |",
             "|---|" + "---|" * (len(builds) + 2)]
    for label, runs in configs.items():
        if not runs:
            continue
        cells = [f"{final(runs[b], 'test'):.3f} \\| {final(runs[b], 'heldout'):.3f}" if b in runs else "—" for b in builds]
        mt = sum(final(r, "test") for r in runs.values()) / len(runs)
        mh = sum(final(r, "heldout") for r in runs.values()) / len(runs)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {mt:.3f} | {mh:.3f} |")
    lines += ["", "## Each method's lr, chosen on test", "", "| method | " + " | ".join(lrs.split(",")) +
              " | chosen | at an end of the grid |", "|---|" + "---|" * (len(lrs.split(",")) + 2)]
    for method, (lr, means, used) in chosen.items():
        end = lr in (lrs.split(",")[0], lrs.split(",")[-1])
        lines.append(f"| {method} | " + " | ".join(f"{means[x]:.3f}" for x in lrs.split(",")) + f" | {lr} | "
                     f"{'yes' if end else 'no'} |")
    rows = declared(configs, chosen)
    lines += ["", "## The declared comparisons (final held-out accuracy, per build; Holm over those that ran)", "",
              "| comparison | builds | mean | 95 % t interval | p | p (Holm over those run) | Holm's bound over the "
              "nine | verdict |", "|---|---|---|---|---|---|---|---|"]
    complete = all(r is not None for _, r in rows)
    for name, r in rows:
        if r is None:
            lines.append(f"| {name} | — | not run | | | | | |")
            continue
        shown = r.get("p_holm") is not None and (r["p_holm"] if complete else r["p_bound"]) <= 0.05
        lines.append(f"| {name} | {len(r['builds'])} | {r['mean']:+.3f} | {signed(r['low'])} to {signed(r['high'])} | "
                     f"{fmt(r['p'])} | {fmt(r.get('p_holm'))} | {fmt(r.get('p_bound'))} | "
                     f"{'shown' if shown else 'not shown'} |")
    lines += ["", "## At the stage boundaries (mean over builds: stage s − 1's last 16 updates → stage s's first 16)", ""]
    lines += ["| configuration | boundary | " + " | ".join(f"step RMS/lr {g}" for g in ("attn", "mlp", "all")) +
              " | " + " | ".join(f"g²/v̂ {g}" for g in ("attn", "mlp", "embed")) + " | KL |",
              "|---|---|" + "---|" * 7]
    for label, runs in configs.items():
        if "μ = 4 @" in label or not runs:
            continue
        table = boundaries(runs)
        for s in (1, 2, 3):
            keys = [f"adam/step_rms/{g}" for g in ("attn", "mlp", "all")] + \
                   [f"adam/g2_over_v/{g}" for g in ("attn", "mlp", "embed")] + ["ratio/kl"]
            if (s, keys[0]) not in table:
                continue
            lines.append(f"| {label} | {s - 1} → {s} | " + " | ".join(
                f"{table[(s, k)][0]:.3g} → {table[(s, k)][1]:.3g}" if (s, k) in table else "—" for k in keys) + " |")
    lines += ["", "## Held-out accuracy within stages (mean over builds; policies saved every 16 updates)", ""]
    for label in ("μ-GRPO μ = 64 @ 1e-4", "GRPO μ = 64 @ 1e-4"):
        curve = within_stage(configs.get(label, {}))
        if curve:
            lines.append(f"- {label}: " + ", ".join(f"{u}: {a:.3f}" for u, a in curve.items()))
    points = signal_points(configs)
    aucs = signal_aucs(points) if points else {}
    lines += ["", f"## The signals ({len(points)} boundaries, {sum(f for _, _, f in points)} falls of more than "
              f"{fall} at the next evaluation)", "", "| signal | AUC | bootstrap 95 % over builds | lab threshold "
              "(Youden) | J | AUC within configurations |", "|---|---|---|---|---|---|"]
    labelled = signal_points(configs, labelled=True)
    for name, (a, low, high, falls, n) in aucs.items():
        t, j = youden_threshold(points, name)
        lines.append(f"| {name} | {fmt(a)} | {fmt(low)} to {fmt(high)} | {fmt(t, 4)} | {fmt(j)} | "
                     f"{fmt(within_configuration_auc(labelled, name))} |")
    falls_by = {}
    for _, _, f, label in labelled:
        falls_by.setdefault(label, [0, 0])[0 if f else 1] += 1
    lines += ["", "Falls per configuration (falls / boundaries): " + "; ".join(
        f"{label} {n_f}/{n_f + n_c}" for label, (n_f, n_c) in falls_by.items())]
    text = "\n".join(lines)
    print(text)
    common.atomic_write_json(Path(out) / "multistage.json", {
        "chosen": {m: {"lr": lr, "mean_test": means, "builds": used} for m, (lr, means, used) in chosen.items()},
        "comparisons": [{"name": n, **(r or {})} for n, r in rows],
        "signals": {n: dict(zip(("auc", "low", "high", "falls", "boundaries"), v)) for n, v in aucs.items()},
        "points": [{"build": b, "values": v, "fell": f} for b, v, f in points]})
    draw(configs, chosen)


def draw(configs, chosen):
    """docs/multistage_fair.png: held-out accuracy against run updates, each method at its chosen lr and μ-GRPO's arms
    (mean over builds)."""
    import matplotlib  # matplotlib: only for the figure
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, labels, title in ((left, [f"{m} @ {chosen[m][0]}" for m in chosen] + ["μ-GRPO μ = 64 @ 1e-4"],
                               "each method at its lr (chosen on test)"),
                              (right, ["μ-GRPO μ = 64 @ 1e-4"] + [f"μ-GRPO μ = 64 @ 1e-4, {a}" for a in arms.split(",")],
                               "μ-GRPO μ = 64 × 4 stages, lr 1e-4: one change each")):
        for label in dict.fromkeys(labels):
            runs = configs.get(label, {})
            curves = [accuracy(r, "heldout") for r in runs.values()]
            if not curves:
                continue
            updates = sorted(set.intersection(*(set(u for u, _ in c) for c in curves)))
            mean = [sum(dict(c)[u] for c in curves) / len(curves) for u in updates]
            ax.plot(updates, mean, marker="o", label=f"{label} ({len(curves)} builds)")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("run updates")
        ax.legend(fontsize=7)
    left.set_ylabel("held-out avg@1 (mean over builds)")
    fig.tight_layout()
    Path(figures_dir).mkdir(parents=True, exist_ok=True)
    fig.savefig(Path(figures_dir) / "multistage_fair.png", dpi=120)


if __name__ == "__main__":
    common.check_choice("command", command, ("report", "evaluate"))
    evaluate_within_stages() if command == "evaluate" else report()
