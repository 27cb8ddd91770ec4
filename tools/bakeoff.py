"""docs/bakeoff.md's tuning read as its design declares (§3, §6): each arm's learning rate, C*, the
gate's T.

    python tools/bakeoff.py --out=runs/bakeoff   # after `bash tools/bakeoff.sh tune`: the table
    python tools/bakeoff.py --step=chaos         # after `bash tools/bakeoff.sh chaos`: §8's floor

Reads the finished runs of tools/bakeoff.sh tune (<out>/tune/lr<lr>/build<b>/seed0/<label>-mu<μ>/,
run_stages.sh runs). Per arm and lr: the mean over the tuning builds of the final `test` avg@1
(after 256 updates); the arm's lr the highest (an exact tie to three decimals: the lr nearer 3e-5);
whether that is an end of the grid (one more point beyond it is then due); C*, the best of the
families; T = 2 × GRPO μ = 4's share of response tokens beyond its clip at its lr. Held-out rows are
never read. Writes <out>/tune.json and prints the markdown the page takes.
"""
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mu_grpo import common, records  # noqa: E402

# ----------------------------------------------------------------------------- hyperparameters
out = "runs/bakeoff"        # tools/bakeoff.sh's OUT
step = "tune"               # tune (§3, §6) | chaos (§8)
# -----------------------------------------------------------------------------
# C*'s candidates (docs/bakeoff.md §3)
FAMILIES = ("m2po", "topr", "cispo", "oapl", "dppo-tv", "vespo", "gspo")
GRID_MIDDLE = 3e-5


def final_test(run_dir):
    """A finished run's final `test` avg@1 (its own protocol's row with the most updates), None if
    unfinished."""
    if not (run_dir / ".done" / "all").exists():
        return None
    rows = [r for r in records.own_results(
        common.read_jsonl(run_dir / "results.jsonl", missing_ok=True))
            if r["benchmark"] == "test"]
    return max(rows, key=lambda r: r["updates"])["avg_at_k"] if rows else None


def clip_share(run_dir):
    """The mean over a run's updates of the share of response tokens beyond its clip (clip/upper +
    clip/lower)."""
    rows = [row for _, stage in records.stage_dirs(run_dir)
            for row in common.read_jsonl(stage / records.METRICS, missing_ok=True)]
    shares = [row.get("clip/upper_frac", 0.0) + row.get("clip/lower_frac", 0.0) for row in rows]
    return sum(shares) / len(shares) if shares else math.nan


def collect(tune_dir):
    """{arm: {lr: {build: final test}}} over the finished runs, and {lr: {build: clip share}} of
    grpo:4's."""
    finals, clips = {}, {}
    for run_dir in sorted(Path(tune_dir).glob("lr*/build*/seed0/*-mu*")):
        lr, build = float(run_dir.parents[2].name[2:]), int(run_dir.parents[1].name[5:])
        label, mu = run_dir.name.rsplit("-mu", 1)
        arm = f"{label}:{mu}"
        if (value := final_test(run_dir)) is not None:
            finals.setdefault(arm, {}).setdefault(lr, {})[build] = value
            if arm == "grpo:4":
                clips.setdefault(lr, {})[build] = clip_share(run_dir)
    return finals, clips


def choose(finals, builds):
    """{arm: (its lr, mean test there, at an end of the grid)} over the runs that cover every tuning
    build."""
    chosen = {}
    for arm, by_lr in finals.items():
        means = {lr: round(sum(v.values()) / len(v), 3) for lr, v in by_lr.items()
                 if set(v) >= set(builds)}
        if not means:
            continue
        best = max(means.values())
        lr = min((lr for lr, m in means.items() if m == best),
                 key=lambda x: abs(math.log(x / GRID_MIDDLE)))
        chosen[arm] = (lr, best, lr in (max(means), min(means)) and len(means) < 4)
    return chosen


def c_star(chosen):
    """The family with the highest tuned mean test accuracy (docs/bakeoff.md §3), or None before
    they all ran."""
    families = {arm: v for arm, v in chosen.items()
                if arm.rsplit(":", 1)[0].removesuffix("-d1e-4") in FAMILIES}
    if len(families) < len(FAMILIES):
        return None
    # a tie: the first (§2)
    in_order = sorted(families, key=lambda arm: FAMILIES.index(arm.rsplit(":", 1)[0]))
    return max(in_order, key=lambda arm: round(families[arm][1], 3))


def final_heldout_and_policy(run_dir):
    """A finished run's final `heldout` avg@1 and the fingerprint of its last stage's policy (None,
    None if unfinished)."""
    if not (run_dir / ".done" / "all").exists():
        return None, None
    rows = [r for r in records.own_results(
        common.read_jsonl(run_dir / "results.jsonl", missing_ok=True))
            if r["benchmark"] == "heldout"]
    stages = [d for _, d in records.stage_dirs(run_dir) if (d / records.POLICY).is_dir()]
    last = common.policy_fingerprint(stages[-1] / records.POLICY) if stages else None
    return (max(rows, key=lambda r: r["updates"])["avg_at_k"] if rows else None), last


COPIES = ("original", "repeat", "split")


def chaos_floor(chaos_dir):
    """§8: per lr, each (build, arm)'s triple of final held-out accuracies (the original, a repeat,
    the micro-batch split halved), whether the repeat's final policy is the original's bit for bit,
    the pooled within-triple SD (the mean of the complete triples' sample variances, square-rooted)
    and twice it, the smallest difference the lab resolves. Returns {lr: {"triples": {(build, arm):
    [accuracies]}, "identical": {(build, arm): bool}, "sd": ..., "resolvable": ...}}."""
    out = {}
    for lr_dir in sorted(Path(chaos_dir).glob("lr*")):
        triples, identical = {}, {}
        for run_dir in sorted((lr_dir / COPIES[0]).glob("build*/seed0/*-mu*")):
            build, arm = int(run_dir.parents[1].name[5:]), run_dir.name
            found = [final_heldout_and_policy(lr_dir / copy
                                              / run_dir.relative_to(lr_dir / COPIES[0]))
                     for copy in COPIES]
            if all(acc is not None for acc, _ in found):
                triples[(build, arm)] = [acc for acc, _ in found]
                identical[(build, arm)] = found[0][1] == found[1][1]
        variances = [sum((x - sum(t) / 3) ** 2 for x in t) / 2 for t in triples.values()]
        sd = math.sqrt(sum(variances) / len(variances)) if variances else math.nan
        out[float(lr_dir.name[2:])] = {"triples": triples, "identical": identical, "sd": sd,
                                       "resolvable": 2 * sd}
    return out


def chaos_main():
    floor = chaos_floor(Path(out) / "chaos")
    lines = []
    for lr, f in floor.items():
        lines += [f"lr {lr:g}: pooled within-triple SD {f['sd']:.4f} over {len(f['triples'])} "
                  f"triple(s); the smallest resolvable difference {f['resolvable']:.4f}", "",
                  "| build | arm | original | repeat | split | repeat bit-identical |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {b} | {arm} | " + " | ".join(f"{x:.3f}" for x in t)
                  + f" | {f['identical'][(b, arm)]} |"
                  for (b, arm), t in f["triples"].items()] + [""]
    common.atomic_write_json(Path(out) / "chaos.json", {f"{lr:g}": {
        "sd": f["sd"], "resolvable": f["resolvable"],
        "triples": {f"build{b}/{arm}": t for (b, arm), t in f["triples"].items()},
        "identical": {f"build{b}/{arm}": v for (b, arm), v in f["identical"].items()}}
        for lr, f in floor.items()})
    print("\n".join(lines))


def main():
    common.apply_overrides(globals(), sys.argv[1:])
    common.check_choice("step", step, ("tune", "chaos"))
    if step == "chaos":
        return chaos_main()
    finals, clips = collect(Path(out) / "tune")
    builds = sorted({b for by_lr in finals.values() for v in by_lr.values() for b in v})
    chosen = choose(finals, builds)
    star = c_star(chosen)
    grpo4 = chosen.get("grpo:4")
    t = (2 * sum(clips[grpo4[0]].values()) / len(clips[grpo4[0]]) if grpo4 and clips.get(grpo4[0])
         else None)
    lrs = sorted({lr for by_lr in finals.values() for lr in by_lr}, reverse=True)
    lines = [f"tuning builds {builds}; mean final test avg@1 over them (— : not every build "
             "finished)", "",
             "| arm | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen |",
             "|---|" + "---|" * (len(lrs) + 1)]
    for arm, by_lr in finals.items():
        cells = [f"{sum(by_lr[lr].values()) / len(by_lr[lr]):.3f}" if lr in by_lr
                 and set(by_lr[lr]) >= set(builds)
                 else "—" for lr in lrs]
        pick = chosen.get(arm)
        end = " (an end: one more point)" if pick and pick[2] else ""
        choice = f"{pick[0]:g}{end}" if pick else "—"
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {choice} |")
    lines += ["", f"C*: {star or 'not yet (every family must have run on every tuning build)'}",
              f"T (the gate, §6): {t:.5f}" if t is not None
              else "T: not yet (GRPO μ = 4 at its lr)"]
    common.atomic_write_json(Path(out) / "tune.json",
                             {"builds": builds, "chosen": {a: list(v) for a, v in chosen.items()},
                                                        "c_star": star, "gate_T": t})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
