"""optimize.py on CPU with a tiny toy policy and rollouts written here, with behavior log-probs from the
same weights (so the first update's ratios are 1 up to float noise)."""
import json
import math
import shutil
import sys

import numpy as np
import pytest
import torch

import common
import loss as L
from conftest import ROOT, kill_when, read_lines, run_script

G = 4


def _weights(policy_dir):
    from safetensors.torch import load_file
    return load_file(str(policy_dir / "model.safetensors"))


def write_stage(stage_dir, model_dir, answers_by_prompt, temperature=1.0):
    """A complete rollouts directory: for each (problem, gold), G responses; the first one correct."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    for gi, (problem, gold) in enumerate(answers_by_prompt):
        prompt_ids = common.build_prompt_ids(tok, problem, "{problem}")
        responses = [f" \\boxed{{{gold}}}", f" \\boxed{{{int(gold) + 1}}}", f" {gold}", f" \\boxed{{{int(gold) + 2}}}"]
        rewards = [1.0, 0.0, 0.0, 0.0]
        adv, _ = L.group_advantages(rewards, G)
        for i, text in enumerate(responses):
            resp = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + resp])).logits[0, len(prompt_ids) - 1:-1]
            lp = L.token_logprobs(logits, torch.tensor(resp), temperature).tolist()
            rows.append({"prompt_id": f"p{gi}", "group": gi, "sample_idx": i, "prompt_token_ids": prompt_ids,
                         "response_token_ids": resp, "behavior_logprobs": lp, "finish_reason": "stop",
                         "reward": rewards[i], "advantage": float(adv[i]), "stage": 0, "policy": str(model_dir)})
    out = stage_dir / "rollouts"
    out.mkdir(parents=True, exist_ok=True)
    common.atomic_write_lines(out / "shard_00000.jsonl", rows)      # no columns: optimize.py builds them
    common.atomic_write_json(out / "manifest.json", {
        "complete": True, "stage": 0, "policy": str(model_dir), "shards": ["shard_00000.jsonl"],
        "sampling": {"n": G, "temperature": temperature, "top_p": 1.0, "max_tokens": 12}})
    return rows


PROBLEMS = [(f"Question: What is {a} + {b}? Answer:", str(a + b)) for a, b in [(1, 2), (3, 4), (2, 5), (6, 1)]]
FAST = ["--lr=1e-3", "--prompts_per_update=4", "--nav_delta=1e-4"]


@pytest.fixture
def stage(toy, tmp_path):
    write_stage(tmp_path / "stage_0", toy / "model", PROBLEMS)
    return tmp_path / "stage_0"


def test_policy_moves_toward_rewarded_responses(toy, stage):
    from transformers import AutoModelForCausalLM
    run_script("optimize.py", f"--stage_dir={stage}", "--updates_per_stage=6", *FAST)
    metrics = read_lines(stage / "metrics.jsonl")
    assert [m["update"] for m in metrics] == list(range(6))
    first, last = metrics[0], metrics[-1]
    assert first["mismatch/mean_abs_log_ratio"] < 1e-5 and first["mismatch/max_abs_log_ratio"] < 1e-4
    assert abs(first["ratio/kl"]) < 1e-8
    assert last["loss/policy"] < first["loss/policy"]
    rows = read_lines(stage / "rollouts" / "shard_00000.jsonl")
    model = AutoModelForCausalLM.from_pretrained(stage / "policy", dtype=torch.float32).eval()
    for r in rows:
        ids = torch.tensor([r["prompt_token_ids"] + r["response_token_ids"]])
        p = len(r["prompt_token_ids"])
        with torch.no_grad():
            lp = L.token_logprobs(model(ids).logits[0, p - 1:-1], torch.tensor(r["response_token_ids"])).sum()
        moved = lp.item() - sum(r["behavior_logprobs"])
        assert (moved > 0) == (r["advantage"] > 0), (r["sample_idx"], moved)
    assert (stage / "policy" / "tokenizer.json").exists()
    progress = json.loads((stage / "train_state" / "progress.json").read_text())   # the next stage continues it
    assert progress["complete"] and progress["update"] == progress["global_update"] == 6


@pytest.mark.parametrize("breakage,message", [
    ("missing_field", "shard_00000.jsonl:2: missing field 'behavior_logprobs'"),
    ("length", "shard_00000.jsonl:3: "),
    ("nonfinite", "shard_00000.jsonl:1: non-finite value in behavior_logprobs"),
    ("truncated", "truncated last line"),
    ("no_manifest", "no manifest.json"),
    ("missing_sample", "expected 0..3"),
])
def test_malformed_rollouts_are_refused_with_file_and_line(stage, breakage, message):
    shard = stage / "rollouts" / "shard_00000.jsonl"
    rows = read_lines(shard)
    if breakage == "missing_field":
        del rows[1]["behavior_logprobs"]
    elif breakage == "length":
        rows[2]["behavior_logprobs"].append(-1.0)
    elif breakage == "nonfinite":
        rows[0]["behavior_logprobs"][0] = math.nan
    elif breakage == "missing_sample":
        rows = rows[1:]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if breakage == "truncated":
        text = text[:-40]
    shard.write_text(text)
    if breakage == "no_manifest":
        (stage / "rollouts" / "manifest.json").unlink()
    proc = run_script("optimize.py", f"--stage_dir={stage}", "--updates_per_stage=1", *FAST, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
    assert not (stage / "policy").exists()


def test_bad_hyperparameters_name_the_allowed_values(stage):
    proc = run_script("optimize.py", f"--stage_dir={stage}", "--nav_scope=X", check=False)
    assert proc.returncode != 0 and "'none', 'T', 'H', 'S', 'seq'" in proc.stderr
    proc = run_script("optimize.py", f"--stage_dir={stage}", "--no_such_knob=1", check=False)
    assert proc.returncode != 0 and "unknown option --no_such_knob" in proc.stderr


def test_micro_batch_size_does_not_change_the_update(toy, stage, tmp_path):
    # one micro-batch per update vs one response per micro-batch: same loss and gradient norm; weights
    # agree to a few lr (Adam turns float-noise gradients of unused rows into steps of up to lr)
    other = tmp_path / "other"
    shutil.copytree(stage, other)
    run_script("optimize.py", f"--stage_dir={stage}", "--updates_per_stage=2", *FAST, "--lr=1e-5",
               "--micro_batch_tokens=100000")
    run_script("optimize.py", f"--stage_dir={other}", "--updates_per_stage=2", *FAST, "--lr=1e-5",
               "--micro_batch_tokens=16")
    for a, b in zip(read_lines(stage / "metrics.jsonl"), read_lines(other / "metrics.jsonl")):
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    big, small = _weights(stage / "policy"), _weights(other / "policy")
    assert all(torch.allclose(big[k], small[k], atol=3e-5) for k in big)


@pytest.mark.parametrize("micro_batch_tokens", [16384, 50])
def test_torchrun_fsdp2_matches_one_process(toy, stage, tmp_path, micro_batch_tokens):
    # with 50-token micro-batches the two ranks get different numbers of micro-batches
    args = ["--updates_per_stage=3", "--prompts_per_update=3", f"--micro_batch_tokens={micro_batch_tokens}",
            *FAST[:1], "--nav_delta=1e-4"]
    run_script("optimize.py", f"--stage_dir={stage}", *args, f"--out={tmp_path / 'one' / 'policy'}")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = __import__("subprocess").run([*torchrun, "optimize.py", f"--stage_dir={stage}", *args,
                                         f"--out={tmp_path / 'two' / 'policy'}"], cwd=ROOT, capture_output=True, text=True,
                                        timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = _weights(tmp_path / "one" / "policy"), _weights(tmp_path / "two" / "policy")
    assert len(read_lines(tmp_path / "two" / "metrics.jsonl")) == 3 and not (stage / "metrics.jsonl").exists()
    assert one.keys() == two.keys()
    initial = _weights(toy / "model")
    for k in one:
        assert torch.allclose(one[k], two[k], atol=2e-5), k
    assert any(not torch.equal(one[k], initial[k]) for k in one)


def test_killed_mid_stage_resumes_to_the_same_weights(toy, stage, tmp_path):
    args = ["--updates_per_stage=40", "--checkpoint_every=4", "--micro_batch_tokens=16", *FAST]
    reference = tmp_path / "reference"
    shutil.copytree(stage, reference)
    run_script("optimize.py", f"--stage_dir={reference}", *args)
    cmd = [sys.executable, "optimize.py", f"--stage_dir={stage}", *args]
    assert kill_when(cmd, lambda: (stage / "train_state" / "progress.json").exists())
    assert not (stage / "policy").exists()
    proc = run_script("optimize.py", f"--stage_dir={stage}", *args)
    assert "resuming from" in proc.stdout
    a, b = _weights(reference / "policy"), _weights(stage / "policy")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    metrics = read_lines(stage / "metrics.jsonl")
    assert [m["update"] for m in metrics] == list(range(40))
    ref_metrics = read_lines(reference / "metrics.jsonl")
    assert [m["loss/policy"] for m in metrics] == pytest.approx([m["loss/policy"] for m in ref_metrics], abs=1e-6)


def test_lora_trains_and_saves_a_merged_policy(toy, stage):
    from transformers import AutoModelForCausalLM
    run_script("optimize.py", f"--stage_dir={stage}", "--updates_per_stage=3", *FAST, "--lora_rank=4")
    merged = _weights(stage / "policy")
    initial = _weights(toy / "model")
    assert merged.keys() == initial.keys()                     # plain weights: no adapter tensors
    assert any(not torch.equal(merged[k], initial[k]) for k in merged)
    AutoModelForCausalLM.from_pretrained(stage / "policy")     # reloads as an ordinary checkpoint


def test_truncated_importance_weight_uses_the_trainers_old_logprobs(stage):
    run_script("optimize.py", f"--stage_dir={stage}", "--updates_per_stage=2", *FAST, "--tis_cap=2")
    [old] = (stage / "logprobs").glob("old-*.f32")
    assert old.with_name(old.name + ".complete").exists()
    rows = read_lines(stage / "rollouts" / "shard_00000.jsonl")
    # same weights generated the behavior log-probs: old ≈ behavior, token for token in the stage's order
    assert np.fromfile(old, dtype="<f4") == pytest.approx([x for r in rows for x in r["behavior_logprobs"]], abs=1e-4)
    first = read_lines(stage / "metrics.jsonl")[0]
    assert abs(first["ratio/kl"]) < 1e-8 and (stage / "policy" / "model.safetensors").exists()


def test_m2po_and_grpo_presets_run(stage):
    run_script("optimize.py", f"--stage_dir={stage}", "--updates_per_stage=2", *FAST, "--nav_delta=none",
               "--clip_low=0", "--clip_high=1e9", "--m2po_tau=0.04")
    assert "m2po/masked_frac" in read_lines(stage / "metrics.jsonl")[0]
