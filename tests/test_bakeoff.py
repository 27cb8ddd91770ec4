"""tools/bakeoff.py: the tuning's choices as docs/bakeoff.md declares them, on runs written here by
hand."""
import json
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import bakeoff  # noqa: E402


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


def test_each_arms_lr_is_its_best_mean_test_accuracy_and_heldout_is_never_read(tmp_path):
    # grpo:4: means 0.30 (1e-4), 0.40 (3e-5), 0.35 (1e-5) → 3e-5, inside the grid. mu-grpo: 0.50 at
    # 1e-5, an end: one more point due
    for lr, (g1, g2) in {"1e-4": (0.2, 0.4), "3e-5": (0.35, 0.45), "1e-5": (0.3, 0.4)}.items():
        fake_run(tmp_path, lr, 1, "grpo:4", g1, clip=[0.001, 0.003])
        fake_run(tmp_path, lr, 2, "grpo:4", g2, clip=[0.002, 0.002])
    for lr, m in {"1e-4": 0.1, "3e-5": 0.3, "1e-5": 0.5}.items():
        for b in (1, 2):
            fake_run(tmp_path, lr, b, "mu-grpo-d1e-4:64", m)
    finals, clips = bakeoff.collect(tmp_path / "tune")
    # the test rows, never held-out's 0.99
    assert finals["grpo:4"][3e-5] == {1: 0.35, 2: 0.45}
    chosen = bakeoff.choose(finals, [1, 2])
    assert chosen["grpo:4"] == (3e-5, 0.4, False)
    assert chosen["mu-grpo-d1e-4:64"] == (1e-5, 0.5, True)
    # the gate's T: twice grpo:4's mean clip share at its lr (3e-5): builds' means 0.002 and 0.002 →
    # T = 0.004
    assert sum(clips[3e-5].values()) / 2 * 2 == pytest.approx(0.004)
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
