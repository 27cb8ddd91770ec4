"""docs/bakeoff.md's runs read as its design declares: the tuning (§3, §6: each arm's learning rate,
C*, the gate's T), the confirmation's order (§4), its verdicts, gate and secondary analyses (§5,
§6), the staleness dose (§7) and the chaos floor (§8).

    python tools/bakeoff.py --out=runs/bakeoff   # after `bash tools/bakeoff.sh tune`: the table
    python tools/bakeoff.py --step=order --builds="41 42"   # the confirmation's points per build
    python tools/bakeoff.py --step=confirm       # after `bash tools/bakeoff.sh confirm`: §5, §6
    python tools/bakeoff.py --step=dose          # after `bash tools/bakeoff.sh dose`: §7
    python tools/bakeoff.py --step=chaos         # after `bash tools/bakeoff.sh chaos`: §8's floor

Reads the finished runs of tools/bakeoff.sh tune (<out>/tune/lr<lr>/build<b>/seed0/<label>-mu<μ>/,
run_stages.sh runs). Per arm and lr: the mean over the tuning builds of the final `test` avg@1
(after 256 updates); the arm's lr the highest (an exact tie to three decimals: the lr nearer 3e-5);
whether that is an end of the grid (one more point beyond it is then due); C*, the best of the
families; T = 2 × GRPO μ = 4's share of response tokens beyond its clip at its lr. Held-out rows are
never read. Writes <out>/tune.json and prints the markdown the page takes.
"""
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
from mu_grpo import common, records, tracking  # noqa: E402
import plot  # noqa: E402  (the t test's p)
import verdicts  # noqa: E402  (§5's statistics and verdict tables)
from verdicts import FAMILY_ALPHA  # noqa: E402

# ----------------------------------------------------------------------------- hyperparameters
out = "runs/bakeoff"        # tools/bakeoff.sh's OUT
step = "tune"               # tune (§3, §6) | order (§4) | confirm (§5, §6) | dose (§7) | chaos (§8)
builds = ""                 # --step=order: the builds, space-separated
experiment = "confirm"      # --step=order: confirm (§4) | dose (§7)
# -----------------------------------------------------------------------------
# the arms, in §2's table order; C*'s candidates (§3)
ARMS = ("mu-grpo-d1e-4:64", "relaxed-no-nav:64", "grpo:64", "m2po:64", "topr:64", "cispo:64",
        "cispo-nav-d1e-4:64", "oapl:64", "dppo-tv:64", "vespo:64", "gspo:64", "grpo:4")
MU_GRPO, RELAXED, GRPO_CLIP, GRPO_4 = ARMS[0], ARMS[1], ARMS[2], ARMS[-1]
FAMILIES = ("m2po", "topr", "cispo", "oapl", "dppo-tv", "vespo", "gspo")
GRID_MIDDLE = 3e-5
GATE_ALPHA = 0.025          # gate (a)'s one-sided level (§6)
STAGE_UPDATES = 64          # μ of the stale arms: a stage's updates, the evaluation grid
FALL = 0.02                 # a fall: held-out down by more than this at the next evaluation (§5e)
# the stage line's KL threshold (0.0237) over a stage's last 16 updates: tracking.fall_kl(_updates)
# the dose's arms (§7), each at the tuned lr of the arm it stretches
DOSE = {"mu-grpo-d1e-4:256": MU_GRPO, "grpo:256": GRPO_CLIP, "grpo:4": GRPO_4}
DOSE_ARMS = tuple(DOSE)
# a run the trainer stopped (optimize.py max_nonfinite): its last evaluation is its final
TRAINER_STOP = "non-finite updates in a row"


def final_test(run_dir):
    """A run's final `test` avg@1 (amendment 1: finished, or stopped by the trainer), else None."""
    record = run_record(run_dir, "test")
    return final(record) if record else None


def clip_share(run_dir):
    """The mean over a run's updates of the share of response tokens beyond its clip (clip/upper +
    clip/lower)."""
    return share([row for _, stage in records.stage_dirs(run_dir)
                  for row in common.read_jsonl(stage / records.METRICS, missing_ok=True)], "clip")


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


def tune_main():
    """§3, §6: the table, each arm's lr, C*, T (tune.json)."""
    finals, clips = collect(Path(out) / "tune")
    tuning = sorted({b for by_lr in finals.values() for v in by_lr.values() for b in v})
    chosen = choose(finals, tuning)
    star = c_star(chosen)
    grpo4 = chosen.get("grpo:4")
    t = (2 * sum(clips[grpo4[0]].values()) / len(clips[grpo4[0]]) if grpo4 and clips.get(grpo4[0])
         else None)
    lrs = sorted({lr for by_lr in finals.values() for lr in by_lr}, reverse=True)
    lines = [f"tuning builds {tuning}; mean final test avg@1 over them (— : not every build "
             "finished)", "",
             "| arm | " + " | ".join(f"lr {lr_text(lr)}" for lr in lrs) + " | chosen |",
             "|---|" + "---|" * (len(lrs) + 1)]
    for arm, by_lr in finals.items():
        cells = [f"{sum(by_lr[lr].values()) / len(by_lr[lr]):.3f}" if lr in by_lr
                 and set(by_lr[lr]) >= set(tuning)
                 else "—" for lr in lrs]
        pick = chosen.get(arm)
        end = " (an end: one more point)" if pick and pick[2] else ""
        choice = f"{lr_text(pick[0])}{end}" if pick else "—"
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {choice} |")
    if any(pick[2] for pick in chosen.values()) or len(chosen) < len(ARMS):
        lines += ["", "PROVISIONAL: an arm is at an end of the grid (one more point due) or has no "
                  "lr yet; C* and T below may change"]
    lines += ["", f"C*: {star or 'not yet (every family must have run on every tuning build)'}",
              f"T (the gate, §6): {t:.5f}" if t is not None
              else "T: not yet (GRPO μ = 4 at its lr)"]
    common.atomic_write_json(Path(out) / "tune.json",
                             {"builds": tuning, "chosen": {a: list(v) for a, v in chosen.items()},
                                                        "c_star": star, "gate_T": t})
    print("\n".join(lines))


# ----------------------------------------------------------------------------- §4: the order
def read_json(path):
    return json.loads(Path(path).read_text())


def lr_text(lr):
    """A learning rate as the grid spells it: 0.0001 → 1e-4, 3e-05 → 3e-5, 2.5e-05 → 2.5e-5."""
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def tuned(tune):
    """tune.json's choices, refused in one line until they are complete: {arm: its lr}, C*."""
    missing = [arm for arm in ARMS if arm not in tune["chosen"]]
    at_end = [arm for arm, (_, _, end) in tune["chosen"].items() if end]
    no_t = tune["gate_T"] is None or not math.isfinite(tune["gate_T"])
    if missing or at_end or tune["c_star"] is None or no_t:
        common.refuse(f"the tuning is not complete (docs/bakeoff.md §3): arms without an lr "
                      f"{missing or 'none'}, at an end of the grid {at_end or 'none'}, "
                      f"C* {tune['c_star']}, T {tune['gate_T']}")
    return {arm: tune["chosen"][arm][0] for arm in ARMS}, tune["c_star"]


def confirmation_order(build, star):
    """A build's arms in §4's order: the confirmatory five permuted by
    numpy.random.default_rng(78 + build).permutation(5), then the rest in §2's order (C* left out)
    permuted by the same generator's next permutation (amendment 1)."""
    rng = np.random.default_rng(78 + build)
    first = [MU_GRPO, RELAXED, GRPO_CLIP, star, GRPO_4]
    rest = [arm for arm in ARMS if arm not in first]
    return [first[i] for i in rng.permutation(len(first))] + [rest[i] for i in
                                                              rng.permutation(len(rest))]


def order_main():
    """One line per build: the build, how many of its runs the trainer stopped, then the points
    (label:μ@lr, frontier.sh's POINTS) of its runs without a final yet (amendment 1), in order."""
    lrs, star = tuned(read_json(Path(out) / "tune.json"))
    for b in map(int, builds.split()):
        tuned_as = ({a: a for a in confirmation_order(b, star)} if experiment == "confirm"
                    else DOSE)
        runs = Path(out) / experiment / f"build{b}" / "seed0"
        finals = {a: run_record(runs / run_name(a)) for a in tuned_as}
        print(b, sum(bool(r and r["stopped"]) for r in finals.values()),
              " ".join(f"{a}@{lr_text(lrs[arm])}" for a, arm in tuned_as.items() if not finals[a]))


# ----------------------------------------------------------------------------- a run's record
def run_name(arm):
    label, mu = arm.rsplit(":", 1)
    return f"{label}-mu{mu}"


def run_record(run_dir, benchmark="heldout"):
    """A run's record once it has a final (amendment 1: finished, or stopped by the trainer), else
    None: {"curve": {updates: avg@1 on benchmark} of its own protocol, "stages": [the update rows
    of each stage it trained], "stopped": whether the trainer stopped it, "code" and "lr": the
    commit and learning rate its stage 0 trained at}."""
    log = Path(f"{run_dir}.log")
    stopped = (not (run_dir / ".done" / "all").exists() and log.exists()
               and TRAINER_STOP in log.read_text(errors="replace"))
    if not ((run_dir / ".done" / "all").exists() or stopped):
        return None
    rows = [r for r in records.own_results(common.read_jsonl(run_dir / records.RESULTS,
                                                             missing_ok=True))
            if r["benchmark"] == benchmark]
    curve = {r["updates"]: r["avg_at_k"] for r in sorted(rows, key=lambda r: r["updates"])}
    # the stages it trained (a resident run's engines may have sampled the next one's rollouts)
    stages = [rows for _, d in records.stage_dirs(run_dir)
              if (rows := common.read_jsonl(d / records.METRICS, missing_ok=True))]
    config = run_dir / "stage_0" / records.OPTIMIZE_CONFIG
    made = json.loads(config.read_text()) if config.exists() else {}
    return {"curve": curve, "stages": stages, "stopped": stopped,
            "code": made.get("versions", {}).get("code"),
            "lr": made.get("hyperparameters", {}).get("lr")} if curve else None


def final(record):
    """The final: the evaluation with the most updates (after update 256, or where it stopped)."""
    return record["curve"][max(record["curve"])]


def at_updates(record, updates):
    """The held-out accuracy after `updates` updates; a run stopped before: its last evaluation."""
    return record["curve"][max(u for u in record["curve"] if u <= updates)]


def area(record):
    """The area under the held-out curve over its evaluations (trapezoid), per update: the mean
    accuracy along the run."""
    xs = sorted(record["curve"])
    ys = [record["curve"][x] for x in xs]
    trapezoid = sum((xs[i + 1] - xs[i]) * (ys[i] + ys[i + 1]) / 2 for i in range(len(xs) - 1))
    return trapezoid / (xs[-1] - xs[0]) if len(xs) > 1 else ys[0]


def share(rows, key_prefix):
    """The mean over update rows of <prefix>/upper_frac + <prefix>/lower_frac (a side a row lacks:
    0; a row with a side null, a non-finite update: left out; NaN: no rows)."""
    values = [(r.get(f"{key_prefix}/upper_frac", 0.0), r.get(f"{key_prefix}/lower_frac", 0.0))
              for r in rows]
    values = [up + low for up, low in values if up is not None and low is not None]
    return sum(values) / len(values) if values else math.nan


def mean_finite(values):
    """The mean of the finite values (NaN: none)."""
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def stage_end_kl(rows):
    """A stage's KL(behaviour ‖ π) over its last updates (the stage line's signal)."""
    kl = [r["ratio/kl"] for r in rows[-tracking.fall_kl_updates:] if r.get("ratio/kl") is not None]
    return sum(kl) / len(kl) if kl else math.nan


def complete_builds(runs_dir, lr_of):
    """({build: {arm: record}} of the builds on which every arm of lr_of has a final (amendment 1),
    the builds with a run but not complete). Refused in one line unless every run trained at its
    arm's lr of lr_of, all at one commit (§4)."""
    found, incomplete, made = {}, [], {}
    for build_dir in sorted(Path(runs_dir).glob("build*"), key=lambda d: int(d.name[5:])):
        recs = {arm: run_record(build_dir / "seed0" / run_name(arm)) for arm in lr_of}
        b = int(build_dir.name[5:])
        made.update({(b, arm): (r["code"], r["lr"]) for arm, r in recs.items() if r})
        if all(recs.values()):
            found[b] = recs
        else:
            incomplete.append(b)
    wrong_lr = [f"build{b}/{arm} at {lr}" for (b, arm), (_, lr) in made.items()
                if lr is None or not math.isclose(lr, lr_of[arm], rel_tol=1e-9)]
    codes = sorted({str(code) for code, _ in made.values()})
    if wrong_lr or len(codes) > 1:
        common.refuse(f"{runs_dir}: runs not as declared: {', '.join(wrong_lr) or 'lrs as tuned'}; "
                      f"commits {', '.join(codes)}")
    return found, incomplete


def builds_line(runs_dir, runs, incomplete):
    """Which builds the analysis reads: the rule's (regimes/selection.json), complete, left out."""
    rule = Path(runs_dir).parent / "confirm" / "regimes" / "selection.json"
    kept = read_json(rule)["kept"] if rule.exists() else "—"
    return (f"the rule's builds {kept}; complete (every arm has a final) {list(runs)}; "
            f"left out (an arm without a final yet) {incomplete or 'none'}")


# ----------------------------------------------------------------------------- §5 (e)
def boundaries(runs):
    """[(configuration, stage s's end KL, fell)] over every stage boundary s → s + 1 of the stale
    arms' runs (GRPO μ = 4 is evaluated every 16 of its stages, so its boundaries have no
    evaluation on each side): fell when held-out after stage s + 1 is below that after stage s by
    more than FALL. A boundary without both evaluations or without a finite KL is not scored."""
    out_rows = []
    for recs in runs.values():
        for arm, rec in recs.items():
            if arm == GRPO_4:
                continue
            for s in range(len(rec["stages"]) - 1):
                after = [(s + k) * STAGE_UPDATES for k in (1, 2)]
                kl = stage_end_kl(rec["stages"][s])
                if all(u in rec["curve"] for u in after) and math.isfinite(kl):
                    fell = rec["curve"][after[1]] < rec["curve"][after[0]] - FALL
                    out_rows.append((arm, kl, fell))
    return out_rows


def kl_signal(rows):
    """§5 (e): the KL's AUC for a fall over all boundaries and within configurations (pairs of the
    same configuration only), and per configuration (flagged: above the threshold) the counts
    {"flagged", "flagged_fell", "unflagged", "unflagged_calm"}."""
    def counts(rs):
        flagged = [fell for _, kl, fell in rs if kl > tracking.fall_kl]
        calm = [fell for _, kl, fell in rs if not kl > tracking.fall_kl]
        return {"boundaries": len(rs), "falls": sum(f for *_, f in rs), "flagged": len(flagged),
                "flagged_fell": sum(flagged), "unflagged": len(calm),
                "unflagged_calm": len(calm) - sum(calm)}
    configs = sorted({c for c, *_ in rows}, key=ARMS.index)
    wins = pairs = 0
    for c in configs:
        fell = [kl for c2, kl, f in rows if c2 == c and f]
        calm = [kl for c2, kl, f in rows if c2 == c and not f]
        wins += verdicts.auc(fell, calm) * len(fell) * len(calm) if fell and calm else 0
        pairs += len(fell) * len(calm)
    return {"auc": verdicts.auc([kl for _, kl, f in rows if f], [kl for _, kl, f in rows if not f]),
            "auc_within": wins / pairs if pairs else math.nan, "overall": counts(rows),
            "per_configuration": {c: counts([r for r in rows if r[0] == c]) for c in configs}}


# ----------------------------------------------------------------------------- tables
def markdown(header, rows):
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def f3(x):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.3f}"


def per_build(runs, arms, value):
    """{arm: [value(record) per build]} over the complete builds, in build order."""
    return {arm: [value(recs[arm]) for recs in runs.values()] for arm in arms}


# ----------------------------------------------------------------------------- §5, §6
def confirm_main():
    tune = read_json(Path(out) / "tune.json")
    (lrs, star), T = tuned(tune), tune["gate_T"]
    runs, incomplete = complete_builds(Path(out) / "confirm", lrs)
    if len(runs) < 2:
        common.refuse(f"{out}/confirm: {len(runs)} complete build(s); the intervals need two")
    finals = per_build(runs, ARMS, final)
    stage0 = per_build(runs, ARMS, lambda r: at_updates(r, STAGE_UPDATES))
    areas = per_build(runs, ARMS, area)
    minus = lambda a, b: [x - y for x, y in zip(a, b)]                         # noqa: E731
    claims = {}
    for name, x in (("C1", GRPO_CLIP), ("C2", RELAXED), ("C3", star), ("C4", GRPO_4)):
        mean, sd, low, high = verdicts.interval(minus(finals[MU_GRPO], finals[x]), FAMILY_ALPHA / 4)
        claims[name] = {"against": x, "mean": mean, "sd": sd, "low": low, "high": high,
                        "verdict": verdicts.verdict_matches(low, high) if name == "C4"
                        else verdicts.verdict_against(low, high, sd)}
    # §6: (a) GRPO's clip over 4 stages below GRPO μ = 4, one-sided at 0.025; (b) its clip binds
    mean, low, high, p = plot.paired_test(minus(finals[GRPO_CLIP], finals[GRPO_4]))
    one_sided = p / 2 if mean < 0 else 1 - p / 2
    clip = [share([r for rows in recs[GRPO_CLIP]["stages"][1:] for r in rows], "clip")
            for recs in runs.values()]
    gate = {"a": {"mean": mean, "low": low, "high": high, "p_one_sided": one_sided,
                  "passes": one_sided <= GATE_ALPHA},
            "b": {"clip_share": (c := sum(clip) / len(clip)), "T": T, "passes": c >= T}}
    stale = [arm for arm in ARMS if arm != GRPO_4]
    sets = {
        "(a) X − μ-GRPO, final": {a: minus(finals[a], finals[MU_GRPO]) for a in ARMS
                                  if a != MU_GRPO},
        "(b) X − GRPO μ = 4, final": {a: minus(finals[a], finals[GRPO_4]) for a in stale},
        "(c) X − μ-GRPO, after stage 0": {a: minus(stage0[a], stage0[MU_GRPO]) for a in stale
                                          if a != MU_GRPO},
        "(c) beside: X − GRPO μ = 4 after its 64 updates (16 stages of its own)": {
            a: minus(stage0[a], stage0[GRPO_4]) for a in stale},
        "(d) X − μ-GRPO, area under the held-out curve": {a: minus(areas[a], areas[MU_GRPO])
                                                          for a in ARMS if a != MU_GRPO}}
    secondaries = {name: verdicts.secondary(pairs) for name, pairs in sets.items()}
    bounds = boundaries(runs)
    signal = kl_signal(bounds)
    common.atomic_write_json(Path(out) / "confirm.json", {
        "builds": list(runs), "lrs": lrs, "c_star": star, "claims": claims, "gate": gate,
        "finals": finals, "after_stage_0": stage0, "areas": areas, "gate_clip_shares": clip,
        "stopped": {f"build{b}/{a}": True for b, recs in runs.items() for a, r in recs.items()
                    if r["stopped"]},
        "secondary": secondaries, "boundaries": bounds, "kl_signal": signal})
    lines = [builds_line(Path(out) / "confirm", runs, incomplete), f"C* {star}", "",
             "Final held-out avg@1 per build:", "",
             markdown(["arm", "lr", *map(str, runs)],
                      [(a, lr_text(lrs[a]), *(f"{v:.3f}" for v in finals[a])) for a in ARMS]), "",
             "C1–C4 (D = μ-GRPO − X; simultaneous Bonferroni 98.75 % t intervals):", "",
             markdown(["claim", "X", "mean D", "SD", "interval", "verdict"],
                      [(n, c["against"], f3(c["mean"]), f"{c['sd']:.3f}",
                        f"{f3(c['low'])} to {f3(c['high'])}", c["verdict"])
                       for n, c in claims.items()]), "",
             f"Gate (a): GRPO clip − GRPO μ = 4 {f3(mean)} (95 % {f3(low)} to {f3(high)}), "
             f"one-sided p {one_sided:.4f}: {'passes' if gate['a']['passes'] else 'fails'}",
             f"Gate (b): GRPO clip's clip share over stages 1–3 {gate['b']['clip_share']:.5f} "
             f"against T {T:.5f} (per build {', '.join(f'{c:.5f}' for c in clip)}): "
             f"{'passes' if gate['b']['passes'] else 'fails'}", ""]
    for name, rows in secondaries.items():
        lines += [f"Secondary {name} (95 % t intervals, Holm over the set):", "",
                  markdown(["X", "mean", "95 %", "p", "Holm p", "shown"],
                           [(x, f3(m), f"{f3(lo)} to {f3(hi)}", f"{p_:.4f}", f"{q:.4f}",
                             "yes" if ok else "no") for x, m, lo, hi, p_, q, ok in rows]), ""]
    o = signal["overall"]
    lines += [f"Secondary (e): the KL threshold {tracking.fall_kl:g} on {o['boundaries']} "
              f"boundaries ({o['falls']} falls): AUC {signal['auc']:.3f}, within configurations "
              f"{signal['auc_within']:.3f}; {o['flagged_fell']} of {o['flagged']} flagged fell, "
              f"{o['unflagged_calm']} of {o['unflagged']} unflagged did not", "",
              markdown(["configuration", "boundaries", "falls", "flagged fell / flagged",
                        "unflagged calm / unflagged"],
                       [(c, v["boundaries"], v["falls"], f"{v['flagged_fell']} / {v['flagged']}",
                         f"{v['unflagged_calm']} / {v['unflagged']}")
                        for c, v in signal["per_configuration"].items()])]
    print("\n".join(lines))


# ----------------------------------------------------------------------------- §7


def dose_main():
    lrs, _ = tuned(read_json(Path(out) / "tune.json"))
    runs, incomplete = complete_builds(Path(out) / "dose", {a: lrs[arm] for a, arm in DOSE.items()})
    if len(runs) < 2:
        common.refuse(f"{out}/dose: {len(runs)} complete build(s); the intervals need two")
    finals = per_build(runs, DOSE_ARMS, final)
    # per run: its stages' end KL (mean over stages) and GRPO's clip share over its stages after
    # the first (the same axes a GPU run is placed on)
    kl = per_build(runs, DOSE_ARMS, lambda r: mean_finite(map(stage_end_kl, r["stages"])))
    clip = per_build(runs, DOSE_ARMS, lambda r: share([x for rows in r["stages"][1:] for x in rows],
                                                      "grpo_clip"))
    confirm = Path(out) / "confirm.json"
    claims = read_json(confirm)["claims"] if confirm.exists() else {}
    contrasts = {}
    for name, x in (("C1", "grpo:256"), ("C4", "grpo:4")):
        d = [a - b for a, b in zip(finals[DOSE_ARMS[0]], finals[x])]
        mean, low, high, _ = plot.paired_test(d)
        sign = verdicts.verdict_sign(claims[name]["verdict"]) if name in claims else None
        contrasts[name] = {"against": x, "mean": mean, "low": low, "high": high,
                           "verdict": claims.get(name, {}).get("verdict"),
                           "holds_in_direction": None if sign is None else mean * sign > 0}
    common.atomic_write_json(Path(out) / "dose.json", {"builds": list(runs), "finals": finals,
                                                       "stage_end_kl": kl, "grpo_clip_share": clip,
                                                       "contrasts": contrasts})
    cols = [str(b) for b in runs]
    lines = [builds_line(Path(out) / "dose", runs, incomplete),
             "1,024 updates (stages of μ = 256; GRPO μ = 4: 256 stages)", "",
             markdown(["arm", "per build: final held-out / stage-end KL / GRPO clip share", *cols],
                      [(a, "", *(f"{f:.3f} / {k:.4f} / {c:.4f}" for f, k, c in
                                 zip(finals[a], kl[a], clip[a]))) for a in DOSE_ARMS]), "",
             markdown(["contrast", "mean", "95 %", "§5's verdict", "holds in direction"],
                      [(f"μ-GRPO − {c['against']} ({n})", f3(c["mean"]),
                        f"{f3(c['low'])} to {f3(c['high'])}", c["verdict"] or "—",
                        {None: "— (no direction)", True: "yes", False: "no"}[
                            c["holds_in_direction"]]) for n, c in contrasts.items()])]
    print("\n".join(lines))


# ----------------------------------------------------------------------------- §8
def final_heldout_and_policy(run_dir):
    """A run's final `heldout` avg@1 (run_record's rule) and the fingerprint of its last stage's
    policy; None, None before it has a final."""
    if not (record := run_record(run_dir)):
        return None, None
    stages = [d for _, d in records.stage_dirs(run_dir) if (d / records.POLICY).is_dir()]
    return final(record), (common.policy_fingerprint(stages[-1] / records.POLICY) if stages
                           else None)


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
        lines += [f"lr {lr_text(lr)}: pooled within-triple SD {f['sd']:.4f} over "
                  f"{len(f['triples'])} triple(s); the smallest resolvable difference "
                  f"{f['resolvable']:.4f}", "",
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
    common.check_choice("step", step, ("tune", "order", "confirm", "dose", "chaos"))
    common.check_choice("experiment", experiment, ("confirm", "dose"))
    {"tune": tune_main, "order": order_main, "confirm": confirm_main, "dose": dose_main,
     "chaos": chaos_main}[step]()


if __name__ == "__main__":
    main()
