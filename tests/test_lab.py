"""The CPU lab (data/lab.py, data/lab_fork.py, ablate.sh, tools/plot.py --ablation_dir, tools/diagnose.py): the tasks, the
table, and a reduced ablation with its diagnostics."""
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, needs_vllm, read_lines, run_script

sys.path[:0] = [str(ROOT / "data"), str(ROOT / "tools")]
import lab  # noqa: E402
import lab_fork  # noqa: E402
import plot  # noqa: E402
import reward  # noqa: E402


def test_lab_problems_are_disjoint_graded_and_correct():
    train, test = lab.problems(40, 3, 3, 5, seed=0)
    assert len(train) == 40 and [sum(r["steps"] == n for r in test) for n in (3, 4, 5)] == [3, 3, 3]
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    for row in train + test:                       # the answer is the chain's value; every value stays in 0..19
        words = row["problem"].split()             # Compute a ± d ± d ... step by step.
        value = int(words[1])
        for sign, d in zip(words[2:-3:2], words[3:-3:2]):
            value += int(d) if sign == "+" else -int(d)
            assert 0 <= value <= 19
        assert str(value) == row["answer"]


def test_lab_demonstrations_by_hand():
    row = lab.problem_row(7, [("+", 8), ("-", 5), ("+", 9)])
    assert row["problem"] == "Compute 7 + 8 - 5 + 9 step by step." and row["answer"] == "19"
    clean = lab.demonstration(row, random.Random(0), p_slip=0.0, p_no_box=0.0)
    assert clean == " Step 1: 7 + 8 = 15\nStep 2: 15 - 5 = 10\nStep 3: 10 + 9 = 19\n\\boxed{19}"
    assert reward.grade(clean, row["answer"], "lab")[0] == 1.0
    unboxed = lab.demonstration(row, random.Random(0), p_slip=0.0, p_no_box=1.0)
    assert unboxed.endswith("\nAnswer: 19") and reward.grade(unboxed, "19", "lab")[0] == 0.0
    slipped = lab.demonstration(row, random.Random(0), p_slip=1.0, p_no_box=0.0)
    for line in slipped.strip().split("\n")[:-1]:  # Step k: a ± d = r, every r off by 1 or 10
        a, sign, d, _, r = line.split(": ")[1].split()
        assert abs(int(r) - (int(a) + int(d) if sign == "+" else int(a) - int(d))) in (1, 10)


@pytest.mark.parametrize("fork,detour,detour_text", [
    ("start", "restate", " Check: 7 + 8 - 5 + 9 has 3 steps.\nStep 1: 7 + 8 = 15\nStep 2: 15 - 5 = 10\nStep 3: 10 + 9 = 19\n"
                         "Answer: 19"),
    ("start", "reverse", " Check: 7 + 8 - 5 + 9 has 3 steps.\nUndo 3: 19 - 9 = 10\nUndo 2: 10 + 5 = 15\nUndo 1: 15 - 8 = 7\n"
                         "Answer: 19"),
    ("end", "restate", " Step 1: 7 + 8 = 15\nStep 2: 15 - 5 = 10\nStep 3: 10 + 9 = 19\nCheck:\nStep 1: 7 + 8 = 15\n"
                       "Step 2: 15 - 5 = 10\nStep 3: 10 + 9 = 19\nAnswer: 19")])
def test_lab_fork_demonstrations_by_hand(fork, detour, detour_text):
    row = lab.problem_row(7, [("+", 8), ("-", 5), ("+", 9)])
    options = dict(fork=fork, detour=detour, p_slip=0.0)
    solution = lab_fork.demonstration(row, random.Random(0), p_detour=0.0, **options)
    assert solution == lab.demonstration(row, random.Random(0), p_slip=0.0, p_no_box=0.0)   # the lab's worked solution
    taken = lab_fork.demonstration(row, random.Random(0), p_detour=1.0, **options)
    assert taken == detour_text
    assert reward.grade(solution, "19", "lab")[0] == 1.0 and reward.grade(taken, "19", "lab")[0] == 0.0


@pytest.fixture(scope="session")
def small_lab(tmp_path_factory):
    out = tmp_path_factory.mktemp("small_lab")
    lab.build(out, train_problems=16, test_per_length=2, heldout_per_length=3, max_steps=4, hidden_size=64, layers=1,
              sft_steps=2, sft_batch=4)
    return out


def test_the_lab_builder_writes_a_policy_that_loads(small_lab):
    from transformers import AutoModelForCausalLM
    assert len(read_lines(small_lab / "test.jsonl")) == 4
    AutoModelForCausalLM.from_pretrained(small_lab / "model")


def test_the_warm_start_problems_are_replayed_without_training(small_lab):
    # toy.warm_start_problems must list exactly the problems toy.warm_start trains on (the held-out set excludes them)
    from transformers import AutoTokenizer
    import toy
    tokenizer = AutoTokenizer.from_pretrained(small_lab / "model")
    drawn = []

    def examples(rng, batch):
        rows = [lab.problem_row(*lab.chain(rng, rng.randint(3, 5))) for _ in range(batch)]
        pairs = [(r["problem"], lab.demonstration(r, rng, 0.05, 0.2)) for r in rows]
        drawn.extend(p for p, _ in pairs)
        return pairs
    toy.warm_start(toy.build_model(tokenizer, 64, 1, 0), tokenizer, examples, 3, 4, 1e-3, seed=7)
    assert len(drawn) == 12
    assert toy.warm_start_problems(examples, 3, 4, seed=7) == set(drawn[:12])
    assert toy.warm_start_problems(examples, 3, 4, seed=8) != set(drawn[:12])


def test_the_held_out_set_is_new_problems_of_every_length(small_lab):
    train, test = (read_lines(small_lab / f) for f in ("train.jsonl", "test.jsonl"))
    held = read_lines(small_lab / "heldout.jsonl")
    assert [sum(r["steps"] == n for r in held) for n in (3, 4)] == [3, 3]
    assert len({r["problem"] for r in held}) == 6
    assert not {r["problem"] for r in held} & {r["problem"] for r in train + test}
    # and never a warm-start example: a problem the warm start saw is skipped and the next one of its length drawn
    redrawn = lab.heldout(train, test, {held[0]["problem"]}, 3, 3, 4, seed=0)
    assert held[0] not in redrawn and redrawn[:2] == held[1:3] and len(redrawn) == 6


def test_kappa_ratio_and_net_push_around_the_first_wrong_token_by_hand(small_lab, monkeypatch):
    # one group of three: a correct response (A = +1) and two that leave the worked solution at token f = 5 (A = -1/2
    # each); ratios are set by hand through the checkpoint's log-probs (behavior log-probs all 0)
    monkeypatch.setattr(sys, "argv", ["tools/diagnose.py"])
    sys.modules.pop("diagnose", None)
    import diagnose
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(small_lab / "model")
    row = lab.problem_row(7, [("+", 8), ("-", 5), ("+", 9)])
    correct = tokenizer.encode(lab.demonstration(row, random.Random(0), p_slip=0.0, p_no_box=0.0), add_special_tokens=False)
    f, wrong = 5, tokenizer.encode("Z", add_special_tokens=False)
    bad = correct[:f] + wrong + correct[f + 1:f + 3]                   # 5 shared tokens, the wrong one, 2 after it
    responses = [(correct, 1.0), (bad, -0.5), (bad, -0.5)]
    rows = [{"group": 0, "prompt": row["problem"], "response_token_ids": ids, "advantage": a,
             "behavior_logprobs": [0.0] * len(ids)} for ids, a in responses]
    n = len(bad)
    ratios = [np.ones(len(correct)), np.ones(n), np.ones(n)]
    ratios[1][2] = 1e-5            # second response: κ = 2, before f (δ = 1e-4)
    ratios[2][f + 1] = 1e-5        # third: κ = f + 1, after f
    ratios[2][f] = 0.5             # its ratio at the first wrong token
    stats = diagnose.diagnose(rows, [np.log(r) for r in ratios], tokenizer, 1e-4)
    assert stats["negative_responses"] == 2
    assert (stats["kappa_before"], stats["kappa_at"], stats["kappa_after"], stats["kappa_none"]) == (0.5, 0, 0.5, 0)
    assert stats["ratio_at_first_wrong_p50"] == pytest.approx((1.0 + 0.5) / 2)
    # net push Σ_j A_j·ρ_j over the group-mates sharing the token and its prefix, listed per negative response:
    # before f: all three share every token: 1 - 0.5·ρ₂ - 0.5·ρ₃, i.e. 0 except at t = 2 (ρ₂ = 1e-5): 0.5 - 0.5e-5
    # at f: the two bad ones share it: -0.5·1 - 0.5·0.5 = -0.75, twice
    # after f (t = f+1, f+2): -0.5·ρ₂ - 0.5·ρ₃ = -0.5 - 0.5e-5 at f+1, -1 at f+2, twice each
    before = [0.0] * f + [0.0] * f
    before[2] = before[f + 2] = 0.5 - 0.5e-5
    assert stats["push_before"] == pytest.approx(np.mean(before))
    assert stats["push_at"] == pytest.approx(-0.75)
    assert stats["push_after"] == pytest.approx(np.mean([-0.5 - 0.5e-5, -1.0] * 2))


def test_diagnose_reports_kappa_at_the_delta_each_replay_trained_with(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["tools/diagnose.py"])
    sys.modules.pop("diagnose", None)
    import diagnose

    def replay(variant, delta):
        d = tmp_path / variant / "seed0"
        d.mkdir(parents=True)
        (d / "optimize_config.json").write_text(json.dumps({"hyperparameters": {"nav_delta": delta}}))
    replay("mu-grpo", 0.1)
    replay("grpo", None)
    assert diagnose.deltas(tmp_path, [("grpo", 0), ("mu-grpo", 0)]) == {("grpo", 0): 0.1, ("mu-grpo", 0): 0.1}
    with pytest.raises(SystemExit, match="no replay listed ran with NAV"):
        diagnose.deltas(tmp_path, [("grpo", 0)])
    replay("nav-T", 1e-4)
    with pytest.raises(SystemExit, match="several NAV δ"):
        diagnose.deltas(tmp_path, [("nav-T", 0), ("mu-grpo", 0)])
    with pytest.raises(SystemExit, match="optimize_config.json is missing"):
        diagnose.deltas(tmp_path, [("m2po", 0)])
    monkeypatch.setattr(diagnose, "nav_delta", 1e-3)                       # --nav_delta wins
    assert diagnose.deltas(tmp_path, [("grpo", 0)]) == {("grpo", 0): 1e-3}
    # κ is the trainer's own trigger test: A < 0 and ρ < δ (strictly), the first such token
    assert diagnose.first_trigger(np.array([1.0, 0.1, 0.05]), -1.0, 0.1) == 2
    assert diagnose.first_trigger(np.array([1.0, 0.05]), +1.0, 0.1) is None


def _fake_ablation(root):
    """Two variants × two seeds, evaluated at updates 0 (the initial policy), 2 and 4."""
    rows = [{"stage": -1, "benchmark": "test", "policy": str(root.parent / "model"), "updates": 0, "avg_at_k": 0.5}]
    acc = {("a", 0): [0.6, 0.7], ("a", 1): [0.8, 0.5], ("b", 0): [0.2, 0.1], ("b", 1): [0.6, 0.4]}
    for (variant, seed), (at2, at4) in acc.items():
        d = root / variant / f"seed{seed}"
        d.mkdir(parents=True)
        rows += [{"stage": -1, "benchmark": "test", "policy": str(d / "policy_u00002"), "updates": 2, "avg_at_k": at2},
                 {"stage": -1, "benchmark": "test", "policy": str(d / "policy"), "updates": 4, "avg_at_k": at4}]
        ratios = [1.0, 0.5, 0.25, 0.9] if variant == "a" else [1.0, 0.01, 0.02, 0.03]
        (d / "metrics.jsonl").write_text("".join(json.dumps(
            {"update": u, "ratio/mean_neg_adv": ratios[u], "nav/vetoed_frac": 0.1 * u if variant == "a" else None,
             "clip/upper_frac": 0.01, "clip/lower_frac": 0.0}) + "\n" for u in range(4)))
    (root / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_ablation_table_by_hand(tmp_path):
    root = tmp_path / "ablation"
    _fake_ablation(root)
    ablation, initial = plot.load_ablation(root)
    assert initial == 0.5 and set(ablation) == {"a", "b"}
    assert ablation["a"]["curves"][1] == [(0, 0.5), (2, 0.8), (4, 0.5)]
    curve = plot.mean_curve(ablation["a"]["curves"])       # (updates, mean, min, max) over the two seeds
    expected = [(0, 0.5, 0.5, 0.5), (2, 0.7, 0.6, 0.8), (4, 0.6, 0.5, 0.7)]
    assert [c == pytest.approx(e) for c, e in zip(curve, expected)] == [True] * 3
    rows = {r["variant"]: r for r in plot.ablation_table(ablation, initial)}
    a, b = rows["a"], rows["b"]
    assert (a["final"], a["final_min"], a["final_max"]) == pytest.approx((0.6, 0.5, 0.7))
    assert (a["best"], a["best_at"]) == pytest.approx((0.7, 2))
    assert a["collapsed_seeds"] == 0 and a["collapse_at"] is None
    assert a["min_ratio_neg"] == pytest.approx(0.25)                 # both seeds' lowest E[ρ | A<0]
    assert a["vetoed_frac"] == pytest.approx((0 + 0.1 + 0.2 + 0.3) / 4)
    assert a["clipped_frac"] == pytest.approx(0.01)
    # b: seed 0 falls to 0.2 < 0.5 × 0.5 at update 2; seed 1 never below 0.25
    assert b["collapsed_seeds"] == 1 and b["collapse_at"] == 2
    assert (b["final"], b["best"], b["best_at"]) == pytest.approx((0.25, 0.5, 0))
    assert b["min_ratio_neg"] == pytest.approx(0.01) and b["vetoed_frac"] == 0
    md = plot.table_markdown(plot.ablation_table(ablation, initial), initial)
    assert "| b | 2 | 0.250 (0.100–0.400) | 0.500 (0) | 1 (2) | 0.010 |" in md
    # b against a, paired by seed: finals 0.1 − 0.7 = −0.6 and 0.4 − 0.5 = −0.1; mean −0.35, sd 0.3536, df 1:
    # half-width 12.706 · 0.3536 / √2 = 3.1765 (printed to 3 places)
    row, ratio = plot.ablation_comparisons(ablation, against=("a", "relaxed-no-nav"))
    assert (row["statistic"], row["variant"], row["against"], row["seeds"]) == ("final accuracy", "b", "a", [0, 1])
    assert row["differences"] == pytest.approx([-0.6, -0.1])
    assert (row["mean"], row["low"], row["high"]) == pytest.approx((-0.35, -3.5265, 2.8265), abs=1e-4)
    assert "| final accuracy | b − a | 2 | -0.600, -0.100 | -0.350 | -3.526 to +2.826 |" in \
        plot.comparisons_markdown([row])
    # the lowest E[ρ | A<0] of each seed: b 0.01 against a 0.25 in both seeds (their metrics are the same per seed)
    assert ratio["statistic"] == "lowest E[ρ | A<0]" and ratio["differences"] == pytest.approx([-0.24, -0.24])


@pytest.mark.slow
@needs_vllm
def test_reduced_ablation_produces_the_curves_figures_table_and_diagnostics(tmp_path):
    # the lab-fork task, two variants, one seed, 4 updates, a small-μ reference (2 resident stages of 2 updates)
    out, lab_dir = tmp_path / "ablation", tmp_path / "lab"
    env = {"LAB": "lab-fork", "OUT": str(out), "LAB_DIR": str(lab_dir), "VARIANTS": "grpo mu-grpo", "SEEDS": "0",
           "UPDATES_PER_STAGE": "4", "PROMPTS_PER_UPDATE": "2", "SAVE_EVERY": "2", "ONPOLICY_UPDATES": "2", "ONPOLICY_SEEDS": "0",
           "MAX_RESPONSE": "48", "NAV_DELTA": "0.5", "BUILD": "1",
           "LAB_ARGS": "--train_problems=48 --test_per_length=3 --max_steps=4 --hidden_size=64 --layers=2 "
                       "--sft_steps=40"}
    proc = subprocess.run(["bash", "ablate.sh"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # BUILD=1 is the builder's seed: the task's problems are lab.problems' for seed 1, not for the default 0
    written = [json.loads(line)["problem"] for line in open(lab_dir / "train.jsonl")]
    assert written == [p["problem"] for p in lab.problems(48, 3, 3, 4, 1)[0]]
    assert written != [p["problem"] for p in lab.problems(48, 3, 3, 4, 0)[0]]
    ablation, initial = plot.load_ablation(out)
    assert set(ablation) == {"grpo", "mu-grpo", "onpolicy-grpo"}
    for variant in ("grpo", "mu-grpo"):   # the initial policy, the policy saved at update 2, the final one
        assert [u for u, _ in ablation[variant]["curves"][0]] == [0, 2, 4]
        assert [m["update"] for m in ablation[variant]["metrics"][0]] == [0, 1, 2, 3]
    assert [u for u, _ in ablation["onpolicy-grpo"]["curves"][0]] == [0, 2, 4]     # its two stages' policies
    settings = json.loads((out / "mu-grpo" / "seed0" / "optimize_config.json").read_text())["hyperparameters"]
    assert settings["nav_delta"] == 0.5                                                # NAV_DELTA reached the replay
    for name in ("fig2_clip.png", "fig3_nav_scope.png", "table.md"):
        assert (out / "plots" / name).stat().st_size > 0
    table = (out / "plots" / "table.md").read_text()
    assert all(f"| {v} | 1 |" in table for v in ("grpo", "mu-grpo"))
    # the mechanism diagnostics on the saved checkpoints (the pipeline: every share is a share, push is finite)
    # at the replays' own δ (NAV_DELTA=0.5, read from their optimize_config.json), also for grpo's, which had none
    run_script("tools/diagnose.py", f"--ablation_dir={out}", "--variants=grpo,mu-grpo", "--updates=0,4", "--groups=4")
    rows = json.loads((out / "plots" / "diagnostics.json").read_text())   # the numbers: test_kappa_ratio_and_net_push_around_the_first_wrong_token_by_hand
    assert [(r["variant"], r["updates"], r["nav_delta"]) for r in rows] == \
        [("grpo", 0, 0.5), ("grpo", 4, 0.5), ("mu-grpo", 0, 0.5), ("mu-grpo", 4, 0.5)]
    table = (out / "plots" / "diagnostics.md").read_text()
    assert table.count("| mu-grpo | 0 | ") == 2 and table.count("| grpo | 0 | ") == 2 and table.count(" | 0.5 | ") == 4
    # an engine that reloads the weights samples what a fresh engine samples: [a perturbed copy, the initial
    # policy] by one engine; its initial-policy samples equal those of the ablation's engine, which started
    # on it (the replays here barely move a policy that solves nothing, so a copy is perturbed instead)
    import torch
    from safetensors.torch import load_file, save_file
    perturbed = tmp_path / "perturbed"
    shutil.copytree(lab_dir / "model", perturbed)
    torch.manual_seed(0)
    weights = load_file(perturbed / "model.safetensors")
    save_file({k: v + 0.05 * torch.randn_like(v) for k, v in weights.items()}, perturbed / "model.safetensors",
              metadata={"format": "pt"})
    run_script("evaluate.py", f"--policy={perturbed},{lab_dir / 'model'}", "--benchmarks=test",
               f"--data_dir={lab_dir}", "--k=1", "--temperature=1.0", "--top_p=1.0", "--prompt_template={problem}",
               "--max_prompt_tokens=64", "--max_response_tokens=48", f"--samples_dir={tmp_path / 'list'}",
               "--grader_workers=1")
    fresh = [r["response"] for r in read_lines(lab_dir / "eval_samples" / "model" / "test.jsonl")]
    reloaded = [r["response"] for r in read_lines(tmp_path / "list" / "model" / "test.jsonl")]
    other = [r["response"] for r in read_lines(tmp_path / "list" / "perturbed" / "test.jsonl")]
    assert reloaded == fresh and other != fresh


@pytest.mark.slow
def test_the_lab_build_is_the_same_whichever_kernels_the_cpu_would_pick(tmp_path):
    # torch picks AVX512, AVX2 or generic kernels by CPU; they sum in other orders, so the same build gave other
    # policies on other machines. The builder pins the generic ones: under either ISA's kernels, the same files
    import hashlib
    tiny = ["--train_problems=48", "--test_per_length=3", "--max_steps=4", "--hidden_size=64", "--layers=2",
            "--sft_steps=10"]
    digests = []
    for capability in ("avx2", "avx512"):
        out = tmp_path / capability
        subprocess.run([sys.executable, "data/lab.py", f"--out_dir={out}", *tiny], cwd=ROOT, check=True,
                       capture_output=True, env={**os.environ, "ATEN_CPU_CAPABILITY": capability})
        digests.append([hashlib.sha256((out / name).read_bytes()).hexdigest()
                        for name in ("model/model.safetensors", "model/tokenizer.json", "train.jsonl", "test.jsonl")])
    assert digests[0] == digests[1]


def test_paired_differences_across_two_frontiers_by_hand(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["tools/paired.py"])
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import paired
    a = {("build1", "seed0"): {"final": 0.6}, ("build1", "seed1"): {"final": 0.7}, ("build0", "seed0"): {"final": 0.2},
         ("build2", "seed0"): {"final": 0.9}}
    b = {("build1", "seed0"): {"final": 0.1}, ("build1", "seed1"): {"final": 0.3}, ("build0", "seed0"): {"final": 0.25}}
    measured = {"build0": {"regime": "stalls"}, "build1": {"regime": "learns"}}
    rows = {r["regime"]: r for r in paired.regimes.paired_by_regime(a, b, measured, "≠")}
    # learns: build1's two seeds 0.5, 0.4 are one build's difference, 0.45: no interval over one build
    assert rows["learns"]["differences"] == pytest.approx([0.45]) and rows["learns"]["verdict"] == "—"
    assert rows["stalls"]["mean"] == pytest.approx(-0.05) and rows["stalls"]["verdict"] == "—"
    # all: three pairs (build2 has none) on two builds, −0.05 and 0.45: mean 0.2, sd 0.35355, df 1: half-width
    # 12.706 · 0.35355 / √2 = 3.1765
    assert rows["all"]["pairs"] == 3 and rows["all"]["differences"] == pytest.approx([-0.05, 0.45])
    assert (rows["all"]["mean"], rows["all"]["low"], rows["all"]["high"]) == pytest.approx((0.2, -2.9765, 3.3765), abs=1e-4)



@pytest.mark.slow
@needs_vllm
def test_the_paper_presets_stage_is_replayed_under_several_families_at_the_boxs_shape(toy, tmp_path):
    # LAB=paper: run_stages.sh makes stage 0 (the paper preset's control flow with the toy preset's CPU settings, two
    # engines and two trainer ranks: the box's shape), then each family replays it in two gloo ranks (torchrun)
    out = tmp_path / "replay"
    env = {"LAB": "paper", "STAGE_PRESET": "toy", "OUT": str(out), "MODEL": str(toy / "model"), "TRAIN_DATA": str(toy / "train.jsonl"),
           "EVAL_DATA_DIR": str(toy), "BENCHMARKS": "test", "TEMPLATE": "plain", "MAX_PROMPT": "64",
           "MAX_RESPONSE": "12", "VARIANTS": "mu-grpo oapl", "SEEDS": "0", "UPDATES_PER_STAGE": "4",
           "PROMPTS_PER_UPDATE": "4", "SAVE_EVERY": "2", "ONPOLICY_UPDATES": "0", "ENGINES": "2", "TRAIN_RANKS": "2",
           "JOBS": "1", "LR": "5e-4", "EVAL_K": "1", "MICRO_BATCH_TOKENS": "4096", "GRAD_CKPT": "false"}
    proc = subprocess.run(["bash", "ablate.sh"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    source = json.loads((out / "source" / "stage_0" / "optimize_config.json").read_text())
    for variant in ("mu-grpo", "oapl"):
        config = json.loads((out / variant / "seed0" / "optimize_config.json").read_text())
        assert config["world"] == 2 and config["resolved"]["loss"]["objective"] == ("clip" if variant == "mu-grpo"
                                                                                    else "oapl")
        assert config["hyperparameters"]["stage_dir"] == str(out / "source" / "stage_0")
        assert [r["update"] for r in read_lines(out / variant / "seed0" / "metrics.jsonl")] == [0, 1, 2, 3]
    assert source["world"] == 2 and source["resolved"]["loss"]["objective"] == "clip"
    # the mu-grpo replay is the paper run's own stage 0 again (its rollouts, policy, seed and learning rate): the same
    # loss at every update, float for float
    run_rows = read_lines(out / "source" / "stage_0" / "metrics.jsonl")
    replay_rows = read_lines(out / "mu-grpo" / "seed0" / "metrics.jsonl")
    assert [r["loss/policy"] for r in replay_rows] == [r["loss/policy"] for r in run_rows]
    oapl = read_lines(out / "oapl" / "seed0" / "metrics.jsonl")
    assert all("oapl/residual_sq_mean" in r and "grad/zero_frac_neg" in r for r in oapl)
    # the initial policy and each replay's policies at updates 2 and 4, evaluated on the run's benchmark
    rows = read_lines(out / "results.jsonl")
    assert len({r["policy"] for r in rows}) == 5 and {r["benchmark"] for r in rows} == {"test"}
