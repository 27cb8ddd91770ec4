"""tools/bakeoff.py and tools/verdicts.py: docs/bakeoff.md's readings as its design declares them
(the tuning's choices, the confirmation's order, verdicts, gate and secondaries, the dose, the chaos
floor), on runs written here by hand; tools/bakeoff.sh's calls of frontier.sh."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import bakeoff  # noqa: E402
import verdicts  # noqa: E402


def fake_run(root, lr, build, arm, final, clip=None):
    label, mu = arm.rsplit(":", 1)
    run = root / "tune" / f"lr{lr}" / f"build{build}" / "seed0" / f"{label}-mu{mu}"
    (run / ".done").mkdir(parents=True)
    (run / ".done" / "all").write_text("")
    rows = [{"stage": -1, "updates": 0, "benchmark": "test", "avg_at_k": 0.1, "k": 1, "time": 1.0},
            {"stage": 3, "updates": 256, "benchmark": "test", "avg_at_k": final, "k": 1,
             "time": 2.0},
            {"stage": 3, "updates": 256, "benchmark": "heldout", "avg_at_k": 0.99, "k": 1,
             "time": 3.0}]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if clip is not None:
        (run / "stage_0").mkdir()
        (run / "stage_0" / "metrics.jsonl").write_text("".join(json.dumps(
            {"update": u, "clip/upper_frac": clip[u],
             "clip/lower_frac": 0.0}) + "\n" for u in range(2)))


def test_each_arms_lr_is_its_best_mean_test_accuracy_and_heldout_is_never_read(tmp_path,
                                                                              monkeypatch):
    # grpo:4: means 0.30 (1e-4), 0.40 (3e-5), 0.35 (1e-5) → 3e-5, inside the grid. mu-grpo: 0.50 at
    # 1e-5, an end: one more point due. grpo:4's clip share scales with the lr's place (k)
    for k, (lr, (g1, g2)) in enumerate({"1e-4": (0.2, 0.4), "3e-5": (0.35, 0.45),
                                        "1e-5": (0.3, 0.4)}.items(), 1):
        fake_run(tmp_path, lr, 1, "grpo:4", g1, clip=[0.001 * k, 0.003 * k])
        fake_run(tmp_path, lr, 2, "grpo:4", g2, clip=[0.002 * k, 0.002 * k])
    for lr, m in {"1e-4": 0.1, "3e-5": 0.3, "1e-5": 0.5}.items():
        for b in (1, 2):
            fake_run(tmp_path, lr, b, "mu-grpo-d1e-4:64", m)
    finals, clips = bakeoff.collect(tmp_path / "tune")
    # the test rows, never held-out's 0.99
    assert finals["grpo:4"][3e-5] == {1: 0.35, 2: 0.45}
    chosen = bakeoff.choose(finals, [1, 2])
    assert chosen["grpo:4"] == (3e-5, 0.4, False)
    assert chosen["mu-grpo-d1e-4:64"] == (1e-5, 0.5, True)
    # the gate's T: twice grpo:4's mean clip share at its lr (3e-5, k = 2): builds' means 0.004 and
    # 0.004 → T = 0.008; written with the choices (mu-grpo at an end: the tuning not complete)
    monkeypatch.setattr(bakeoff, "out", bakeoff.out)             # (main sets it: restored after)
    monkeypatch.setattr(sys, "argv", ["tools/bakeoff.py", f"--out={tmp_path}"])
    bakeoff.main()
    tune = json.loads((tmp_path / "tune.json").read_text())
    assert tune["gate_T"] == pytest.approx(0.008)
    assert tune["chosen"]["mu-grpo-d1e-4:64"] == [1e-5, 0.5, True]
    # a run missing on a build leaves that lr out of the choice
    del finals["grpo:4"][3e-5][2]
    assert bakeoff.choose(finals, [1, 2])["grpo:4"] == (1e-5, 0.35, True)


def test_c_star_is_the_best_family_and_waits_for_all_of_them():
    chosen = {f"{f}:64": (3e-5, 0.1 * i, False) for i, f in enumerate(bakeoff.FAMILIES)}
    # not a candidate, however good
    chosen["mu-grpo-d1e-4:64"] = (3e-5, 0.99, False)
    chosen["cispo-nav-d1e-4:64"] = (3e-5, 0.98, False)
    assert bakeoff.c_star(chosen) == "gspo:64"                          # the last family: 0.6
    # a tie with gspo: the first of §2's table
    chosen["topr:64"] = (3e-5, 0.6, False)
    assert bakeoff.c_star(chosen) == "topr:64"
    del chosen["topr:64"]
    assert bakeoff.c_star(chosen) is None


def fake_chaos_run(root, lr, copy, build, arm, heldout, fingerprint):
    run = root / "chaos" / f"lr{lr}" / copy / f"build{build}" / "seed0" / arm
    (run / ".done").mkdir(parents=True)
    (run / ".done" / "all").write_text("")
    rows = [{"stage": -1, "updates": 0, "benchmark": "heldout", "avg_at_k": 0.1, "k": 1,
             "time": 1.0},
            {"stage": 3, "updates": 256, "benchmark": "heldout", "avg_at_k": heldout, "k": 1,
             "time": 2.0},
            {"stage": 3, "updates": 256, "benchmark": "test", "avg_at_k": 0.99, "k": 1,
             "time": 3.0}]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for s, fp in ((0, "early"), (3, fingerprint)):
        (run / f"stage_{s}" / "policy").mkdir(parents=True)
        (run / f"stage_{s}" / "policy"
         / "policy_id.json").write_text(json.dumps({"fingerprint": fp}))


def test_the_chaos_floor_pools_the_triples_spread_and_checks_the_repeat_bit_for_bit(tmp_path):
    # build 1, mu-grpo: 0.30, 0.30 (the same final policy), 0.36 (the split): mean 0.32, sample
    # variance (0.0004 + 0.0004 + 0.0016) / 2 = 0.0012; build 2, grpo: 0.5 three times (variance 0),
    # its repeat a different policy. Pooled: √(0.0006) = 0.02449, resolvable 0.04899. A triple
    # missing its split is left out
    for copy, (a, fa), (b, fb) in [("original", (0.30, "x"), (0.5, "y")),
                                   ("repeat", (0.30, "x"), (0.5, "z")),
                                   ("split", (0.36, "w"), (0.5, "v"))]:
        fake_chaos_run(tmp_path, "1e-4", copy, 1, "mu-grpo-d1e-4-mu64", a, fa)
        fake_chaos_run(tmp_path, "1e-4", copy, 2, "grpo-mu64", b, fb)
    for copy in ("original", "repeat"):
        fake_chaos_run(tmp_path, "1e-4", copy, 3, "grpo-mu64", 0.9, "q")
    floor = bakeoff.chaos_floor(tmp_path / "chaos")[1e-4]
    assert floor["triples"] == {(1, "mu-grpo-d1e-4-mu64"): [0.30, 0.30, 0.36],
                                (2, "grpo-mu64"): [0.5] * 3}
    assert floor["identical"] == {(1, "mu-grpo-d1e-4-mu64"): True, (2, "grpo-mu64"): False}
    assert floor["sd"] == pytest.approx(0.0006 ** 0.5, rel=1e-9)
    assert floor["resolvable"] == pytest.approx(2 * 0.0006 ** 0.5, rel=1e-9)


# ----------------------------------------------------------------------------- §4–§7
def test_the_t_quantile_against_closed_forms_and_the_builds_a_difference_would_need():
    # df 1 (Cauchy): P(|T| ≥ t) = 1 − 2 atan(t)/π; df 2: 1 − t/√(2 + t²)
    for alpha in (0.05, 0.0125):
        assert verdicts.t_quantile(alpha, 1) == pytest.approx(math.tan(math.pi * (1 - alpha) / 2),
                                                              rel=1e-7)
        c = (1 - alpha) ** 2
        assert verdicts.t_quantile(alpha, 2) == pytest.approx(math.sqrt(2 * c / (1 - c)), rel=1e-7)
    # Bonferroni's t over 4 (α 0.0125): n = 2 resolves m/2 = 0.025 while t₁ · s/√2 ≤ 0.025, i.e.
    # s ≤ 0.000694; n = 3 while t₂ · s/√3 ≤ 0.025 (t₂ = 8.8602), s ≤ 0.004887
    assert verdicts.builds_needed(0.0006) == 2
    assert verdicts.builds_needed(0.004) == 3
    assert verdicts.builds_needed(0.0049) > 3


def test_a_stages_end_kl_is_its_last_16_updates_and_a_share_leaves_out_non_finite_updates():
    rows = [{"ratio/kl": 1.0}] * 4 + [{"ratio/kl": 0.5}] * 15 + [{"ratio/kl": None}]
    assert bakeoff.stage_end_kl(rows) == 0.5                   # the last 16, the null one left out
    assert math.isnan(bakeoff.stage_end_kl([{"ratio/kl": None}]))
    rows = [{"clip/upper_frac": 0.1, "clip/lower_frac": 0.2}, {"clip/upper_frac": 0.3},
            {"clip/upper_frac": None, "clip/lower_frac": 0.5}]
    assert bakeoff.share(rows, "clip") == pytest.approx((0.3 + 0.3) / 2)
    assert bakeoff.mean_finite([1.0, math.nan, 3.0]) == 2.0


def test_the_verdicts_are_the_first_row_of_the_declared_tables_that_holds():
    v = verdicts.verdict_against
    assert v(-0.03, -0.01, 0.01) == "X better"              # within m too, but the first row holds
    assert v(0.05, 0.09, 0.01) == "needed"                  # lo ≥ m, at the edge
    assert v(0.01, 0.04, 0.01) == "μ-GRPO better, by less than m"
    assert v(0.01, 0.07, 0.01) == "μ-GRPO better, size not determined"
    assert v(-0.02, 0.03, 0.01) == "not needed (X within m)"
    assert v(-0.06, 0.03, 0.004) == "not determined (3 builds would resolve it)"
    m = verdicts.verdict_matches
    assert m(-0.03, 0.01) == "matches"
    assert m(-0.04, -0.01) == "matches, a deficit under m"
    assert m(-0.09, -0.06) == "a deficit"
    assert m(-0.07, 0.02) == "not determined"


def write_tune(root, star="topr:64", t=0.015, at_end=()):
    chosen = {arm: [1e-5 if arm == "grpo:4" else 3e-5, 0.3, arm in at_end]
              for arm in bakeoff.ARMS}
    (root / "tune.json").write_text(json.dumps({"builds": [1, 2, 3], "chosen": chosen,
                                                "c_star": star, "gate_T": t}))


def fake_record_run(root, experiment, build, arm, curve, stages, stopped=False, lr=None,
                    code="c0de"):
    """A run as run_stages.sh leaves it: held-out rows at curve's updates, stage s's update rows
    stages[s], stage 0's commit and lr (write_tune's, unless given); finished (.done/all), or
    stopped by the trainer (its log says so)."""
    run = root / experiment / f"build{build}" / "seed0" / bakeoff.run_name(arm)
    (run / "stage_0").mkdir(parents=True)
    lr = lr or (1e-5 if arm == "grpo:4" else 3e-5)
    (run / "stage_0" / "optimize_config.json").write_text(json.dumps(
        {"versions": {"code": code}, "hyperparameters": {"lr": lr}}))
    if stopped:
        (root / experiment / f"build{build}" / "seed0" / f"{run.name}.log").write_text(
            f"SystemExit: 3 {bakeoff.TRAINER_STOP} (at update 100)\n")
    else:
        (run / ".done").mkdir()
        (run / ".done" / "all").write_text("")
    rows = [{"stage": u // 64 - 1, "updates": u, "benchmark": b,
             "avg_at_k": v if b == "heldout" else 0.99, "k": 1, "time": 1.0 + u}
            for u, v in curve.items() for b in ("heldout", "test")]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for s, rows in enumerate(stages):
        (run / f"stage_{s}").mkdir(exist_ok=True)
        (run / f"stage_{s}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                                  for r in rows))


def test_the_order_is_the_declared_draw_at_each_arms_tuned_lr_leaving_out_a_stopped_run(
        tmp_path, monkeypatch, capsys):
    order = bakeoff.confirmation_order(41, "topr:64")
    confirmatory = ["mu-grpo-d1e-4:64", "relaxed-no-nav:64", "grpo:64", "topr:64", "grpo:4"]
    assert sorted(order[:5]) == sorted(confirmatory) and "topr:64" not in order[5:]
    assert sorted(order) == sorted(bakeoff.ARMS)
    import numpy as np                                    # the declared generator, drawn by hand
    rng = np.random.default_rng(78 + 41)
    first, rest = rng.permutation(5), rng.permutation(7)
    others = [a for a in bakeoff.ARMS if a not in confirmatory]
    assert order == [confirmatory[i] for i in first] + [others[i] for i in rest]
    assert bakeoff.confirmation_order(42, "topr:64") != order
    monkeypatch.setattr(bakeoff, "out", str(tmp_path))
    monkeypatch.setattr(bakeoff, "builds", "41 42")
    for tune in (dict(star=None), dict(at_end=("gspo:64",)), dict(t=None)):
        write_tune(tmp_path, **tune)
        with pytest.raises(SystemExit) as refused:
            bakeoff.order_main()
        assert refused.value.code == 2
    write_tune(tmp_path)
    # on build 42 grpo:64 stopped by the trainer and topr:64 finished: both have their final
    fake_record_run(tmp_path, "confirm", 42, "grpo:64", {0: 0.1, 64: 0.2}, [[]], stopped=True)
    fake_record_run(tmp_path, "confirm", 42, "topr:64", {0: 0.1, 256: 0.2}, [[]])
    bakeoff.order_main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "41 0 " + " ".join(f"{a}@{'1e-5' if a == 'grpo:4' else '3e-5'}"
                                          for a in order)
    assert lines[1].split()[:2] == ["42", "1"] and len(lines[1].split()) == 12
    assert "grpo:64@" not in lines[1] and "topr:64@" not in lines[1]
    monkeypatch.setattr(bakeoff, "experiment", "dose")
    bakeoff.order_main()
    assert capsys.readouterr().out.splitlines()[0] == \
        "41 0 mu-grpo-d1e-4:256@3e-5 grpo:256@3e-5 grpo:4@1e-5"
    # the grid's spelling
    assert [bakeoff.lr_text(x) for x in (1e-4, 3e-5, 3e-4, 2.5e-5)] == ["1e-4", "3e-5", "3e-4",
                                                                       "2.5e-5"]


def kl_rows(*kls, clip=0.0):
    return [[{"ratio/kl": kl, "clip/upper_frac": clip} for _ in range(2)] for kl in kls]


def test_the_confirmation_reads_c1_to_c4_the_gate_and_the_secondaries_by_hand(
        tmp_path, monkeypatch, capsys):
    write_tune(tmp_path)                                  # C* topr:64, T 0.015
    finals = {"mu-grpo-d1e-4:64": (0.40, 0.50, 0.60), "relaxed-no-nav:64": (0.30, 0.40, 0.50),
              "grpo:64": (0.30, 0.42, 0.48), "topr:64": (0.41, 0.50, 0.60),
              "grpo:4": (0.42, 0.52, 0.62)}
    for b in (1, 2, 3):
        for arm in bakeoff.ARMS:
            f = finals.get(arm, (0.2, 0.3, 0.4))[b - 1]
            curve = {0: 0.1, 64: f, 128: f, 192: f, 256: f}
            stages = kl_rows(0.001, 0.001, 0.001, 0.001)
            if arm == "mu-grpo-d1e-4:64":   # falls after stage 0 (0.45 → 0.40), both flagged
                curve.update({64: 0.45, 128: 0.40, 192: 0.41})
                stages = kl_rows(0.05, 0.01, 0.03, 0.001)
            if arm == "relaxed-no-nav:64":  # flagged, calm
                stages = kl_rows(0.06, 0.001, 0.001, 0.001)
            if arm == "grpo:64":            # clip share 0.5 in stage 0; 0.01, 0.02, 0.03 after
                stages = [rows for s, c in enumerate((0.5, 0.01, 0.02, 0.03))
                          for rows in kl_rows(0.001, clip=c)]
            stopped = arm == "gspo:64" and b == 3   # stopped by the trainer after update 128
            if stopped:
                curve = {0: 0.1, 64: 0.35, 128: 0.34}
            fake_record_run(tmp_path, "confirm", b, arm, curve, stages, stopped=stopped)
    fake_record_run(tmp_path, "confirm", 4, "grpo:4", {0: 0.1, 256: 0.5}, [[]])  # incomplete
    monkeypatch.setattr(bakeoff, "out", str(tmp_path))
    bakeoff.confirm_main()
    result = json.loads((tmp_path / "confirm.json").read_text())
    assert result["builds"] == [1, 2, 3]
    assert result["finals"]["gspo:64"] == [0.2, 0.3, 0.34]             # the last evaluation
    assert result["stopped"] == {"build3/gspo:64": True}
    c = result["claims"]
    # C1: D = 0.10, 0.08, 0.12: mean 0.10, SD 0.02, half-width t₂(0.0125) · 0.02/√3 = 0.10231
    c2 = 0.9875 ** 2
    half = math.sqrt(2 * c2 / (1 - c2)) * 0.02 / math.sqrt(3)
    assert (c["C1"]["mean"], c["C1"]["sd"]) == pytest.approx((0.10, 0.02))
    assert (c["C1"]["low"], c["C1"]["high"]) == pytest.approx((0.10 - half, 0.10 + half),
                                                              rel=1e-5)
    assert c["C1"]["verdict"].startswith("not determined (")
    assert c["C2"]["verdict"] == "needed"                   # 0.10 on every build
    # C3 against C* (topr): D = −0.01, 0, 0: mean −0.00333, SD 0.005774, half 0.029535
    assert c["C3"]["against"] == "topr:64"
    assert (c["C3"]["low"], c["C3"]["high"]) == pytest.approx((-0.032868, 0.026202), abs=1e-5)
    assert c["C3"]["verdict"] == "not needed (X within m)"
    assert c["C4"]["verdict"] == "matches, a deficit under m"      # −0.02 on every build
    # the gate: (a) grpo:64 − grpo:4 = −0.12, −0.10, −0.14: t = −0.12/(0.02/√3), df 2, one-sided
    # p = (1 − |t|/√(2 + t²))/2; (b) clip share over stages 1–3 0.02 ≥ T 0.015
    t = 0.12 / (0.02 / math.sqrt(3))
    assert result["gate"]["a"]["p_one_sided"] == pytest.approx((1 - t / math.sqrt(2 + t * t)) / 2,
                                                               rel=1e-6)
    assert result["gate"]["a"]["passes"] and result["gate"]["b"]["passes"]
    assert result["gate"]["b"]["clip_share"] == pytest.approx(0.02)
    # (d): μ-GRPO's area on build 1: (0.275 + 0.425 + 0.405 + 0.405)/4 = 0.3775
    assert result["areas"]["mu-grpo-d1e-4:64"][0] == pytest.approx(0.3775)
    sets = result["secondary"]
    assert [len(rows) for rows in sets.values()] == [11, 11, 10, 11, 11]
    relaxed = next(r for r in sets["(a) X − μ-GRPO, final"] if r[0] == "relaxed-no-nav:64")
    assert relaxed[1] == pytest.approx(-0.10)
    # (e): 11 stale arms × 3 builds × 3 boundaries, less 2 of gspo's on build 3 (evaluated after
    # 128 updates only): 97. μ-GRPO's 3 falls (stage 0, KL 0.05, flagged), 3 flagged calm (stage
    # 2, KL 0.03); relaxed's 3 flagged calm (0.06); the other 88 unflagged calm. AUC: each fall
    # beats every calm boundary but relaxed's three: 91/94
    signal = result["kl_signal"]
    assert signal["overall"] == {"boundaries": 97, "falls": 3, "flagged": 9, "flagged_fell": 3,
                                 "unflagged": 88, "unflagged_calm": 88}
    assert signal["auc"] == pytest.approx(91 / 94)
    assert signal["auc_within"] == pytest.approx(1.0)
    assert signal["per_configuration"]["relaxed-no-nav:64"]["flagged"] == 3
    assert "grpo:4" not in signal["per_configuration"]
    assert "| C1 | grpo:64 | +0.100 | 0.020 |" in capsys.readouterr().out


def test_the_dose_reads_its_two_contrasts_and_their_direction_against_the_confirmation(
        tmp_path, monkeypatch):
    write_tune(tmp_path)
    (tmp_path / "confirm.json").write_text(json.dumps({"claims": {
        "C1": {"verdict": "μ-GRPO better, by less than m"}, "C4": {"verdict": "a deficit"}}}))
    for b, (mu, clip, on) in {1: (0.5, 0.4, 0.45), 2: (0.6, 0.4, 0.5)}.items():
        for arm, f in (("mu-grpo-d1e-4:256", mu), ("grpo:256", clip), ("grpo:4", on)):
            fake_record_run(tmp_path, "dose", b, arm, {0: 0.1, 1024: f},
                            [[{"ratio/kl": 0.2, "grpo_clip/upper_frac": 0.3}],
                             [{"ratio/kl": 0.4, "grpo_clip/upper_frac": 0.1}]])
    monkeypatch.setattr(bakeoff, "out", str(tmp_path))
    bakeoff.dose_main()
    result = json.loads((tmp_path / "dose.json").read_text())
    # μ-GRPO − GRPO clip: 0.1, 0.2: mean 0.15, half-width 12.706 · 0.0707/√2 = 0.6353
    c1, c4 = result["contrasts"]["C1"], result["contrasts"]["C4"]
    assert (c1["mean"], c1["low"], c1["high"]) == pytest.approx((0.15, 0.15 - 0.6353,
                                                                 0.15 + 0.6353), abs=1e-3)
    assert c1["holds_in_direction"] is True
    assert c4["mean"] == pytest.approx(0.075) and c4["holds_in_direction"] is False
    # a verdict's direction (amendment 2): none for "matches", "not needed", "not determined"
    assert [verdicts.verdict_sign(v) for v in ("needed", "μ-GRPO better, size not determined",
                                              "X better", "matches, a deficit under m",
                                              "matches", "not needed (X within m)",
                                              "not determined (12 builds would resolve it)")] == \
        [1, 1, -1, -1, None, None, None]
    # refused in one line: a run at another lr than its arm's tuned one; runs of two commits
    for build, changed in ((3, dict(lr=1e-4)), (4, dict(code="other"))):
        for arm in ("mu-grpo-d1e-4:256", "grpo:256", "grpo:4"):
            fake_record_run(tmp_path, "dose", build, arm, {0: 0.1, 1024: 0.5}, [[]],
                            **(changed if arm == "grpo:256" else {}))
        with pytest.raises(SystemExit) as refused:
            bakeoff.dose_main()
        assert refused.value.code == 2
        shutil.rmtree(tmp_path / "dose" / f"build{build}")
    # the mean of the stages' end KL (0.3) and GRPO's clip share after the first stage (0.1)
    assert result["stage_end_kl"]["grpo:4"] == pytest.approx([0.3, 0.3])
    assert result["grpo_clip_share"]["grpo:256"] == pytest.approx([0.1, 0.1])


STUB_FRONTIER = """#!/usr/bin/env bash
# records what tools/bakeoff.sh asks of frontier.sh and finishes each point's run in turn; the rule
# keeps STUB_KEPT; the point STUB_STOP on build STUB_STOP_BUILD is stopped by the trainer (its run's
# log says so, exit 1); on build STUB_FAIL_BUILD frontier.sh fails otherwise (exit 3)
echo "BUILDS=${BUILDS// /,} POINTS=${POINTS// /,} LR=${LR:-} REGIMES=${REGIMES:-}" \\
     "MIN_BUILDS=${MIN_BUILDS:-} JOBS=$JOBS OPTIMIZER_BOUNDARY=$OPTIMIZER_BOUNDARY" \\
     "CANDIDATES=${CANDIDATES// /,} MUS=${MUS// /,} TOTAL_UPDATES=${TOTAL_UPDATES:-}" \\
     "EVAL_UPDATES=$EVAL_UPDATES LOSSES=${LOSSES// /,} BASELINE=${BASELINE:-} OUT=$OUT" \\
     "MICRO_BATCH_TOKENS=${MICRO_BATCH_TOKENS:-}" >> "$RECORD"
if [[ $POINTS == probes ]]; then
  mkdir -p "$OUT/regimes"
  echo "{\\"kept\\": [${STUB_KEPT// /, }]}" > "$OUT/regimes/selection.json"
  exit 0
fi
[[ $BUILDS != "${STUB_FAIL_BUILD:-}" ]] || exit 3
for p in $POINTS; do
  label=${p%:*}; mu=${p#*:}; run=$OUT/build$BUILDS/seed0/$label-mu${mu%@*}
  mkdir -p "$run"
  echo '{"updates": 64, "benchmark": "heldout", "avg_at_k": 0.3, "k": 1, "time": 1}' \\
    > "$run/results.jsonl"
  if [[ ${p%@*} == "$STUB_STOP" && $BUILDS == "$STUB_STOP_BUILD" ]]; then
    echo "SystemExit: 3 non-finite updates in a row (at update 70)" > "$run.log"
    exit 1
  fi
  mkdir -p "$run/.done" && touch "$run/.done/all"
done
"""


@pytest.mark.slow
def test_the_confirmation_the_dose_and_the_chaos_floor_ask_frontier_sh_for_their_runs(tmp_path):
    tree = tmp_path / "tree"
    (tree / "tools").mkdir(parents=True)
    for name in ("tools/bakeoff.sh", "tools/bakeoff.py", "tools/verdicts.py", "tools/plot.py"):
        (tree / name).write_bytes((ROOT / name).read_bytes())
    (tree / "mu_grpo").symlink_to(ROOT / "mu_grpo")
    (tree / "frontier.sh").write_text(STUB_FRONTIER)
    out = tree / "runs" / "bakeoff"
    out.mkdir(parents=True)
    record = tmp_path / "record"
    record.touch()
    env = {**os.environ, "MU_GRPO_VENV": str(Path(sys.executable).parents[1]),
           "RECORD": str(record), "STUB_KEPT": "41 43 44 45 46 47 48", "STUB_STOP": "grpo:64",
           "STUB_STOP_BUILD": "43"}

    def bakeoff_sh(step, **more):
        proc = subprocess.run(["bash", "tools/bakeoff.sh", step], cwd=tree, env={**env, **more},
                              text=True, capture_output=True, timeout=300)
        calls = [dict(kv.split("=", 1) for kv in line.split()) for line in
                 record.read_text().splitlines()]
        record.write_text("")
        return proc, calls

    write_tune(out, star=None)                  # the tuning not complete: one line, no frontier
    proc, calls = bakeoff_sh("confirm")
    assert proc.returncode == 2 and not calls and len(proc.stderr.strip().splitlines()) == 1
    write_tune(out)
    # a failure other than the trainer's, on build 44: the step ends with its code, no retry
    proc, calls = bakeoff_sh("confirm", STUB_FAIL_BUILD="44")
    assert proc.returncode == 3 and [c["BUILDS"] for c in calls] == ["", "41", "43", "43", "44"]
    # the rule: ten learning builds of candidates 40–99, probed at lr 1e-4; every call two runs at
    # a time, AdamW's state carried
    assert calls[0]["POINTS"] == "probes" and calls[0]["LR"] == "1e-4"
    assert (calls[0]["REGIMES"], calls[0]["MIN_BUILDS"]) == ("learns:10", "10")
    assert calls[0]["CANDIDATES"] == ",".join(map(str, range(40, 100)))
    assert calls[0]["OUT"] == "runs/bakeoff/confirm"
    assert {(c["JOBS"], c["OPTIMIZER_BOUNDARY"]) for c in calls} == {("2", "carry")}
    # then build by build, each arm at its lr in the declared order; build 43's grpo:64 stopped by
    # the trainer: the build goes on with the runs after it
    lr = {a: "1e-5" if a == "grpo:4" else "3e-5" for a in bakeoff.ARMS}
    order = {b: [f"{a}@{lr[a]}" for a in bakeoff.confirmation_order(b, "topr:64")]
             for b in (41, 43, 44)}
    after = order[43][order[43].index("grpo:64@3e-5") + 1:]
    assert [(c["BUILDS"], c["POINTS"]) for c in calls[1:4]] == [
        ("41", ",".join(order[41])), ("43", ",".join(order[43])), ("43", ",".join(after))]
    assert all(c["BASELINE"] == "mu-grpo-d1e-4:64" and c["MUS"] == "4,64" for c in calls[1:])
    # resumed: the rule again (its probes kept), build 44 whole, then the rest; a rerun after that:
    # the rule only
    proc, calls = bakeoff_sh("confirm")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(c["BUILDS"], c["POINTS"].split(",")[0]) for c in calls[:2]] == [
        ("", "probes"), ("44", order[44][0])]
    assert [c["BUILDS"] for c in calls[2:]] == ["45", "46", "47", "48"]
    proc, calls = bakeoff_sh("confirm")
    assert proc.returncode == 0 and [c["POINTS"] for c in calls] == ["probes"]
    # the dose: the first six builds, 1,024 updates, stages of 256
    proc, calls = bakeoff_sh("dose")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [c["BUILDS"] for c in calls[1:]] == ["41", "43", "44", "45", "46", "47"]
    assert {(c["POINTS"], c["MUS"], c["TOTAL_UPDATES"], c["EVAL_UPDATES"], c["OUT"])
            for c in calls[1:]} == {("mu-grpo-d1e-4:256@3e-5,grpo:256@3e-5,grpo:4@1e-5", "4,256",
                                     "1024", "256", "runs/bakeoff/dose")}
    # the chaos floor: μ-GRPO and GRPO clip at μ = 64 on the first two tuning builds, at lr 1e-4 and
    # 3e-5, three copies each, only the split's micro-batches halved
    for b in (1, 2, 3):
        (out / "tune" / "lr1e-4" / f"build{b}").mkdir(parents=True)
    proc, calls = bakeoff_sh("chaos")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(c["OUT"], c["LR"], c["MICRO_BATCH_TOKENS"]) for c in calls] == [
        (f"runs/bakeoff/chaos/lr{lr}/{copy}", lr, "2048" if copy == "split" else "")
        for lr in ("1e-4", "3e-5") for copy in ("original", "repeat", "split")]
    assert {(c["BUILDS"], c["POINTS"]) for c in calls} == {("1,2", "mu-grpo-d1e-4:64,grpo:64")}
