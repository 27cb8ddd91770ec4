"""Which builds of a lab task can answer the paper's question, and the paper's comparisons with intervals, per regime.

A build's regime is measured when it is built, by a probe: GRPO at the frontier's smallest μ for a few updates (a
seed of its own), run as any frontier run, whose records give its initial held-out accuracy, the fraction of groups
whose rewards vary (the only ones GRPO learns from) and how far it climbs. The paper's setting is a base model that
solves some but not most problems at the start and that GRPO at small μ improves: "learns" here. frontier.sh builds
and probes candidate builds in order until the rule (select_builds) has each regime's quota of builds.

    python tools/regimes.py --regime_of=runs/frontier-lab-fork/regimes/build3     # → build3.json, one line
    python tools/regimes.py --select=runs/frontier-lab-fork/regimes --candidates="0 1 2 3" --regimes="learns:3 stalls:1"

tools/frontier.py reports each comparison the paper makes as a paired difference of final accuracy per regime, with
the build as the independent unit (seeds are nested in builds): each build's difference is the mean over its seeds of
the same-seed differences, with a 95 % t interval and a two-sided p over builds (df = builds − 1, plot.paired_test),
Holm-corrected over the family of the claims between frontier.sh's key points (the rest of the sweep is described,
not tested; plot.holm); a comparison is reproduced only where its Holm-adjusted p is at
most alpha and its interval excludes zero in the paper's direction.
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mu_grpo import common  # noqa: E402
import plot  # noqa: E402
from mu_grpo import records  # noqa: E402

regime_of = ""                  # a probe's run directory: write its build's regime (<dir>.json) from its records
select = ""                     # a directory of regimes (build<b>.json): print the builds the rule keeps, in order
candidates = ""                 # the builds select looks at, space-separated, in the order the rule takes them
regimes = "learns:3 stalls:1"   # the rule: the regimes it keeps builds of, each with its quota n (the first n
                                # candidates in it): the paper's setting three times, the lab's first builds' once
at_least = 4                    # with too few candidates in a regime, the next candidates of the kept regimes, in
                                # order, until this many builds are kept
solves_most = 0.5               # a build whose initial held-out accuracy is at least this: "saturated"
climb_min = 0.1                 # else GRPO at small μ gaining at least this (accuracy) in the probe: "learns"; else "stalls"
match_margin = 0.05             # "matches": the paired difference's interval lies above −match_margin (accuracy)
alpha = 0.05                    # a comparison is shown where its Holm-adjusted p (over the frontier's family) is ≤ this
common.apply_overrides(globals(), sys.argv[1:] if __name__ == "__main__" else [])  # imported: not our argv


def regime_name(initial, climb):
    """saturated: solves most problems at the start; learns: GRPO at small μ climbs at least climb_min in the probe;
    stalls: it does not (the lab's first two builds: their accuracy starts at 0.02–0.05 and barely moves)."""
    if initial >= solves_most:
        return "saturated"
    return "learns" if climb >= climb_min else "stalls"


def regime(probe_dir):
    """A build's regime from its probe's records: {initial, probe_accuracy, climb, groups_with_variance, updates,
    regime} (accuracies on the held-out set the frontier evaluates on, before and after the probe; the fraction of
    groups with reward variance over the probe's updates)."""
    if not (Path(probe_dir) / ".done" / "all").exists():
        sys.exit(f"{probe_dir}: the probe has not finished (no .done/all): run frontier.sh again to finish it")
    run = records.load_run(probe_dir)
    if any(r.get("benchmark") == "heldout" for r in run["results"]):   # the rule's set, where a frontier evaluates more
        run = {**run, "results": [r for r in run["results"] if r.get("benchmark") == "heldout"]}
    curve = records.accuracy_by_stage(run)               # [(stage, updates, hours, accuracy)]
    zero_variance = [m["minibatch/zero_variance_frac"] for m in run["metrics"] if "minibatch/zero_variance_frac" in m]
    if len(curve) < 2 or not zero_variance:
        sys.exit(f"{probe_dir}: the probe's records lack an evaluation before and after training, or its updates")
    initial, final = curve[0][3], curve[-1][3]
    return {"initial": initial, "probe_accuracy": final, "climb": final - initial,
            "groups_with_variance": 1 - sum(zero_variance) / len(zero_variance), "updates": curve[-1][1],
            "regime": regime_name(initial, final - initial), "probe": str(probe_dir)}


def build_regime(measured, build):
    """A build's regime name ("build<b>") from load_regimes' dict; "unmeasured" for a build given, not probed."""
    return measured.get(build, {}).get("regime", "unmeasured")


def load_regimes(regimes_dir):
    """{"build<b>": its regime} for every build<b>.json under regimes_dir (none: {})."""
    return {f.stem: json.loads(f.read_text()) for f in sorted(Path(regimes_dir).glob("build*.json"))}


REGIME_NAMES = ("saturated", "learns", "stalls")


def parse_quotas(text):
    """"learns:3 stalls:1" → {"learns": 3, "stalls": 1}, in order; one line naming what is allowed otherwise."""
    quotas = {}
    for item in text.split():
        name, _, n = item.partition(":")
        if name not in REGIME_NAMES or not n.isdigit() or int(n) < 1 or name in quotas:
            sys.exit(f"regimes: each is <regime>:<quota>, a regime of {', '.join(REGIME_NAMES)} once with a whole "
                     f"number >= 1, e.g. 'learns:3 stalls:1'; got '{item}'")
        quotas[name] = int(n)
    if not quotas:
        sys.exit("regimes: give at least one <regime>:<quota>, e.g. 'learns:3 stalls:1'")
    return quotas


def select_builds(measured, looked_at, quotas, least=0):
    """The rule: the candidates in the order given; of each regime of quotas ({regime: n}), the first n that are in
    it; if that is fewer than `least` builds (a regime with too few candidates), the next candidates in any of those
    regimes, in order, until there are `least`. measured: {"build<b>": {"regime": ...}}; returns (the kept builds in
    candidate order, {regime: the candidates in it})."""
    by_regime = {}
    for b in looked_at:
        by_regime.setdefault(measured[f"build{b}"]["regime"], []).append(b)
    kept = {b for name, n in quotas.items() for b in by_regime.get(name, [])[:n]}
    for b in looked_at:
        if len(kept) < least and measured[f"build{b}"]["regime"] in quotas:
            kept.add(b)
    return [b for b in looked_at if b in kept], by_regime


def selection_table(measured, looked_at, kept):
    """The candidates' regimes, in the order the rule looked at them, and which it kept: a markdown table."""
    rows = ["| build | initial accuracy | groups with reward variance | probe accuracy | climb | regime | kept |",
            "|---|---|---|---|---|---|---|"]
    for b in looked_at:
        g = measured[f"build{b}"]
        rows.append(f"| {b} | {g['initial']:.3f} | {g['groups_with_variance']:.2f} | {g['probe_accuracy']:.3f} | "
                    f"{g['climb']:+.3f} ({g['updates']} updates) | {g['regime']} | {'yes' if b in kept else ''} |")
    return "\n".join(rows)


def quota_phrase(name, n):
    """"the first 3 builds that learn", "the first build that stalls"."""
    verb = {"learns": ("learns", "learn"), "stalls": ("stalls", "stall"), "saturated": ("is saturated", "are saturated")}
    return f"the first {f'{n} builds' if n > 1 else 'build'} that {verb[name][n > 1]}"


def print_selection():
    """The rule applied to the candidates measured so far: the table and how many it kept on stderr (and in
    selection.json); on stdout three lines: the kept builds, the first kept build of each regime (frontier.sh's
    sweep), and "complete" once every regime has its quota of builds (frontier.sh looks no further), else "short"."""
    measured = load_regimes(select)
    looked_at = [int(b) for b in candidates.split()]
    missing = [b for b in looked_at if f"build{b}" not in measured]
    if missing:
        sys.exit(f"{select}: no regime measured for build(s) {missing} (build<b>.json): run their probes first")
    quotas = parse_quotas(regimes)
    kept, by_regime = select_builds(measured, looked_at, quotas, at_least)
    short = [f"{name}: {len(by_regime.get(name, []))} of {n}" for name, n in quotas.items()
             if len(by_regime.get(name, [])) < n]
    rule = ", ".join(quota_phrase(name, n) for name, n in quotas.items())
    summary = (f"the rule looked at {len(looked_at)} build(s) and kept {len(kept)}: {rule}"
               + (f" (too few candidates in {', '.join(short)}; then the next of those regimes, in order, up to "
                  f"{at_least} builds)" if short else ""))
    common.atomic_write_json(Path(select) / "selection.json", {
        "candidates": looked_at, "kept": kept, "quotas": quotas, "by_regime": by_regime, "at_least": at_least,
        "rule": {"solves_most": solves_most, "climb_min": climb_min}, "summary": summary})
    print(selection_table(measured, looked_at, kept) + "\n" + summary, file=sys.stderr)
    print(" ".join(map(str, kept)))                                           # the builds the frontier runs on
    print(" ".join(str(by_regime[name][0]) for name in quotas if by_regime.get(name)))   # the first of each
    print("short" if short else "complete")                     # whether every regime has its quota


def stages_of(points, key):
    """' (n stages)' for a fixed-μ point whose runs all trained n = updates / μ stages, else ''."""
    counts = {r["updates"] // key[1] for r in points.get(key, {}).values() if r.get("updates") and isinstance(key[1], int)}
    if len(counts) != 1:
        return ""
    n = counts.pop()
    return f" ({n} stage{'' if n == 1 else 's'})"


def claims(points):
    """The paper's comparisons the frontier's points can make: (claim, point, against, direction), each a difference
    of final accuracy point − against; direction "<" or ">": the paper's sign; "≥": not worse by match_margin. The
    large-μ claims are made at every μ above the smallest, each labelled with its runs' stage count: the paper trains
    μ-GRPO as 4 stages of μ = 1024 updates, and one stage at large μ (every update on the initial policy's rollouts) is
    a different experiment. Then every other loss against GRPO and μ-GRPO at each μ it ran at, with no paper's sign
    ("≠"; e.g. relaxed-low, relaxed-high: one side of μ-GRPO's clip); and a loss's stages that end on drift against
    each fixed μ it ran at."""
    mus = sorted({mu for _, mu in points if isinstance(mu, int)})
    if not mus:
        return []
    small = mus[0]
    deltas = sorted({label.split("-d", 1)[1] for label, _ in points if label.startswith("mu-grpo-d")}, key=float)
    out = []
    for big in mus[1:]:
        shape = next((t for k in [("grpo", big)] + [(f"mu-grpo-d{d}", big) for d in deltas] if (t := stages_of(points, k))), "")
        at = f"at μ = {big}{shape}"
        out += [(f"GRPO's clip fails {at}", ("grpo", big), ("grpo", small), "<")]
        for d in deltas:
            mg = f"mu-grpo-d{d}"
            out += [(f"μ-GRPO (δ {d}) learns where GRPO's clip stalls, {at}", (mg, big), ("grpo", big), ">"),
                    (f"μ-GRPO (δ {d}) {at} matches GRPO at μ = {small}", (mg, big), ("grpo", small), "≥")]
    for d in deltas:
        out += [(f"μ-GRPO (δ {d}) at small μ matches GRPO (the losses differ only in the clip)", (f"mu-grpo-d{d}", small),
                 ("grpo", small), "≥")]
    for label in sorted({label for label, mu in points if mu == "drift"}):    # the drift rule against fixed μ
        out += [(f"{label}: stages that end on drift against μ = {mu}", (label, "drift"), (label, mu), "≠")
                for mu in mus if (label, mu) in points]
    for label, mu in sorted((k for k in points if isinstance(k[1], int)), key=lambda k: (k[1], k[0])):
        if label != "grpo" and not label.startswith("mu-grpo-d"):
            at = f"at μ = {mu}{stages_of(points, (label, mu))}"
            out += [(f"{label} {at} against GRPO", (label, mu), ("grpo", mu), "≠")]
            if "-d" in label:
                out += [(f"{label} {at} against μ-GRPO", (label, mu), (f"mu-grpo-d{label.rsplit('-d', 1)[1]}", mu), "≠")]
    return [c for c in out if c[1] in points and c[2] in points and c[1] != c[2]]


def verdict(direction, low, high, p):
    """"reproduced" only where the interval excludes zero in the paper's direction (for "≥", excludes −match_margin
    from below); "reversed" where it excludes zero the other way; else "not shown". With no paper's sign ("≠"):
    "below" or "above" where the interval excludes zero, else "not shown". p: the comparison's (Holm-adjusted) p;
    above alpha it is "not shown" whatever its interval."""
    if low is None:
        return "—"
    if p is None or p > alpha:
        return "not shown"
    if direction == "≠":
        return "below" if high < 0 else "above" if low > 0 else "not shown"
    if direction == "<":
        return "reproduced" if high < 0 else "reversed" if low > 0 else "not shown"
    if direction == ">":
        return "reproduced" if low > 0 else "reversed" if high < 0 else "not shown"
    return "reproduced" if low > -match_margin else "reversed" if high < 0 else "not shown"


def paired_by_regime(runs_a, runs_b, measured, direction):
    """Runs of two points ({(build, seed): summary}) paired by build and seed, per regime and over all regimes (when
    there are several), the build the independent unit: {regime, builds, pairs (same-seed pairs), differences (each
    build's a − b of final accuracy, the mean over its seeds; in the builds' order), mean, low, high (95 % t interval
    over builds), p (two-sided, over builds, against 0; for "≥" against −match_margin, what "matches" rejects),
    verdict (unadjusted: comparisons adjusts it over its family)}."""
    pairs = sorted(k for k in runs_a if k in runs_b)
    names = sorted({build_regime(measured, k[0]) for k in pairs})
    shift = match_margin if direction == "≥" else 0.0
    rows = []
    for name in names + (["all"] if len(names) > 1 else []):    # one regime: "all" would be the same rows again
        chosen = [k for k in pairs if name == "all" or build_regime(measured, k[0]) == name]
        builds = sorted({k[0] for k in chosen})
        per_seed = {b: [runs_a[k]["final"] - runs_b[k]["final"] for k in chosen if k[0] == b] for b in builds}
        diffs = [sum(d) / len(d) for d in per_seed.values()]
        mean, low, high = plot.t_interval(diffs)
        p = plot.paired_test([d + shift for d in diffs])[3]
        rows.append({"regime": name, "builds": builds, "pairs": len(chosen), "differences": diffs, "mean": mean,
                     "low": low, "high": high, "p": p, "verdict": verdict(direction, low, high, p)})
    return rows


def comparisons(points, measured, key_points=None):
    """Per claim and regime (and all regimes together): paired_by_regime's row and its verdict at its p Holm-adjusted
    over the family ("holm"): the rows of the claims between two of key_points ({(label, μ)}: frontier.sh's
    KEY_POINTS, declared before the runs; None: every claim). A claim with a point of the rest of the sweep is
    described, not tested: verdict "not tested (sweep)", no Holm."""
    rows = []
    for claim, a, b, direction in claims(points):
        key = key_points is None or (a in key_points and b in key_points)
        rows += [{"claim": claim, "point": f"{a[0]}:{a[1]}", "against": f"{b[0]}:{b[1]}", "direction": direction,
                  "family": key, **row} for row in paired_by_regime(points[a], points[b], measured, direction)]
    tested = [r for r in rows if r["family"] and r["p"] is not None]
    for r, adjusted in zip(tested, plot.holm([r["p"] for r in tested])):
        r["holm"] = adjusted
    for r in rows:
        r.setdefault("holm", None)
        r["verdict"] = verdict(r["direction"], r["low"], r["high"], r["holm"]) if r["family"] else "not tested (sweep)"
    return rows


def comparisons_markdown(rows):
    if not rows:
        return "(none: the frontier has no pair of the points the comparisons need, e.g. grpo at its smallest and largest μ)"
    lines = ["| claim | difference | regime | builds × seeds | mean | 95 % CI over builds | Holm | paper's direction | "
             "verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = "—" if r["low"] is None else f"{r['low']:+.3f} to {r['high']:+.3f}"
        holm = "—" if r["holm"] is None else f"{r['holm']:.3f}"
        want = {"<": "< 0", ">": "> 0", "≥": f"> −{match_margin:g}", "≠": "(none)"}[r["direction"]]
        lines.append(f"| {r['claim']} | {r['point']} − {r['against']} | {r['regime']} | {len(r['builds'])} builds, "
                     f"{r['pairs']} pairs | {r['mean']:+.3f} | {ci} | {holm} | {want} | {r['verdict']} |")
    return "\n".join(lines)


def main():
    if regime_of:
        measured = regime(regime_of)
        common.atomic_write_json(Path(f"{regime_of}.json"), measured)
        print(f"{Path(regime_of).name}: initial accuracy {measured['initial']:.3f}, groups with reward variance "
              f"{measured['groups_with_variance']:.2f}, the probe's {measured['updates']} updates to "
              f"{measured['probe_accuracy']:.3f} ({measured['climb']:+.3f}): {measured['regime']}")
    elif select:
        print_selection()
    else:
        sys.exit("give --regime_of=<a probe's run directory> or --select=<a directory of regimes> --candidates=...")


if __name__ == "__main__":
    main()
