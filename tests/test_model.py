"""mu_grpo/trainer_model.py, in process: the saved policy is the trainer's weights in the initial dtype and loads back, tied
embeddings stay one parameter, what the resident trainer keeps while the engine is awake, and the message of a
process group that cannot start."""
import json
import re

from conftest import read_lines

import pytest
import torch

from mu_grpo import checkpoint, common
from mu_grpo import trainer_model as M


def test_released_gradients_are_gone_not_zeroed():
    # the resident trainer frees its fp32 gradients before the engine wakes; zero_grad() without set_to_none would
    # keep 4 bytes per parameter allocated
    net = torch.nn.Linear(16, 8)
    optimizer = torch.optim.AdamW(net.parameters())
    net(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    assert sum(p.grad.numel() for p in net.parameters()) == 16 * 8 + 8
    assert M.release_gradients(optimizer) == 0
    assert all(p.grad is None for p in net.parameters())
    assert len(optimizer.state) == 2                            # AdamW's moments stay: they are the resident state


def test_a_process_group_that_cannot_start_names_shm_and_docker():
    error = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled system error\nlast error: shm")
    message = M.process_group_hint("nccl", error, 64 * 2**20)
    assert "\n" not in message
    assert message.startswith("the nccl process group could not start (RuntimeError: NCCL error in: "
                              "ProcessGroupNCCL.cpp:1234, unhandled system error)")
    assert "/dev/shm has 64 MiB free" in message and "--ipc=host" in message and "--shm-size" in message
    assert "no /dev/shm" in M.process_group_hint("nccl", error, None)


def tiny_checkpoint(directory, tied, dtype=torch.bfloat16):
    """A 2-layer Llama with random weights saved as an HF checkpoint in `dtype` (the initial policy's)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
    LlamaForCausalLM(config).to(dtype).save_pretrained(directory)
    return directory


def trained(source):
    """The trainer's policy built from `source`, every weight then moved by a step bf16 can see."""
    model = M.build(source, attention="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_the_saved_policy_is_the_trainers_weights_in_the_initial_dtype(tmp_path):
    from safetensors.torch import load_file
    source = tiny_checkpoint(tmp_path / "initial", tied=False)
    model = trained(source)
    assert all(p.dtype == torch.float32 for p in model.parameters())          # fp32 master weights
    checkpoint.save_policy(model, source, M.checkpoint_dtype(source), tmp_path / "policy", {"stage": 0})
    saved = load_file(tmp_path / "policy" / "model.safetensors")
    mine = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert saved.keys() == mine.keys() and all(torch.equal(saved[k], mine[k]) for k in saved)
    record = json.loads((tmp_path / "policy" / "policy_id.json").read_text())
    fingerprint = checkpoint.weights_fingerprint(tmp_path / "policy")
    assert record == {"fingerprint": fingerprint, "stage": 0, "engine_weights": {
        "dtype": "float32", "hash": common.TENSOR_HASH,
        "hashes": {k: f"{v:016x}" for k, v in checkpoint.engine_weight_hashes(tmp_path / "policy").items()}}}
    assert json.loads((tmp_path / "policy" / "config.json").read_text())["dtype"] == "bfloat16"
    again = M.build(tmp_path / "policy", attention="sdpa")                   # and it loads back as it was saved
    assert all(torch.equal(again.state_dict()[k], mine[k].float()) for k in mine)


def test_tied_embeddings_are_one_parameter_saved_once_and_tied_again_on_load(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    source = tiny_checkpoint(tmp_path / "initial", tied=True)
    model = trained(source)
    assert model.lm_head.weight is model.model.embed_tokens.weight        # one parameter, stepped once
    checkpoint.save_policy(model, source, torch.bfloat16, tmp_path / "policy", {"stage": 0})
    assert "lm_head.weight" not in load_file(tmp_path / "policy" / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight.detach().to(torch.bfloat16))


def test_each_hsdp_mesh_dimension_gets_its_own_process_group_options(monkeypatch):
    # NCCL's split_group modifies the options it is given (torch deep-copies its own default for this reason), so the
    # two mesh dimensions must not share one object; each carries the run's timeout, not the backend's 10 minutes
    import torch.distributed.device_mesh as device_mesh
    asked = {}
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda device_type, shape, **kwargs: asked.update(
        shape=shape, **kwargs))
    M.hsdp_mesh.__wrapped__(4, 2, "cpu")
    options = asked["backend_override"]
    assert asked["shape"] == (2, 2) and asked["mesh_dim_names"] == ("replicate", "shard")
    assert options["replicate"] is not options["shard"]
    assert options["replicate"]._timeout == options["shard"]._timeout == M.PROCESS_GROUP_TIMEOUT


def test_adamw_state_made_before_the_first_activation_gives_the_same_updates_bit_for_bit():
    # model.init_optimizer_state makes AdamW's moments as its first step would, before any forward: the same three
    # updates as lazily made ones (a float64 step, or a step starting at 1, moves the bias correction and fails this)
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    optimizers = [torch.optim.AdamW(n.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01, eps=1e-8)
                  for n in nets]
    M.init_optimizer_state(optimizers[1])
    assert len(optimizers[0].state) == 0 and len(optimizers[1].state) == 4        # every parameter, before a forward
    x = torch.randn(8, 6)
    for _ in range(3):
        for net, opt in zip(nets, optimizers):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(a, b)
        sa, sb = optimizers[0].state[a], optimizers[1].state[b]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


@pytest.mark.slow
def test_the_gpu_check_runs_at_cpu_size_and_every_check_passes(tmp_path, monkeypatch):
    # tools/gpu_check.py, the trainer's path on a lent GPU, at its CPU size: optimize.py on a synthetic stage, bf16
    # against float32 (CPU autocast, and FSDP2's bf16 parameters on one gloo rank), the hash on the device against the
    # CPU's, the packed buffer hashed in a second process (shared memory here, CUDA IPC on a GPU). One table, its JSON
    import importlib.util
    import sys
    from conftest import ROOT, run_script
    proc = run_script("tools/gpu_check.py", "--shape=tiny", "--mean_prompt_tokens=16", "--mean_response_tokens=24",
                      "--max_response_tokens=48", "--micro_batch_tokens=1024", "--updates=2", f"--out_dir={tmp_path}")
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["passed"] and report["device"] == "CPU"
    gated = [re.sub(r" \([^()]*\)$", "", r["check"]) for r in report["rows"] if r["status"] == "PASS"]
    assert gated == [f"bf16 ({how}) vs float32: {what}" for how in ("autocast", "FSDP2 bf16 parameters, one rank")
                     for what in ("relative loss difference", "gradient cosine", "relative gradient-norm difference")] \
        + ["tensor_hash on cpu equal to the CPU's", gated[-1]] and gated[-1].startswith("packed buffer (0.00 GiB) by "
                                                                         "shared memory"), gated
    assert report["rows"][-1]["status"] == "INFO"          # the buffer's release: CUDA IPC's, gated on a GPU only
    assert report["rows"][0]["value"] > 0 and "| PASS | bf16 (autocast) vs float32: gradient cosine" in proc.stdout
    # each update's FLOPs are those of the groups it trained (its row's "groups", optimize.py's seeded schedule): their
    # tokens are the row's own count; the file's first minibatch (the old reading) is another
    monkeypatch.setattr(sys, "argv", ["tools/gpu_check.py"])
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    stage = tmp_path / "stage-tiny"
    metrics = read_lines(stage / "metrics.jsonl")
    for m in metrics:
        assert sum(p + r for p, r in gpu_check.trained_lengths(stage, m["groups"])) == m["tokens"]
    from mu_grpo import rollouts
    data = rollouts.open_stage(stage / "rollouts", workers=1)
    n = len(metrics[0]["groups"]) * 8
    file_order = [int((data.prompt_len + data.response_len)[u * n:(u + 1) * n].sum()) for u in range(len(metrics))]
    assert file_order != [m["tokens"] for m in metrics]          # the old reading counted other groups
    # a check that raises is its own FAIL row (the others still run); a receiver that dies is seen at once
    assert gpu_check.guarded("hand-off", lambda: 1 / 0) == [
        ("hand-off: it ran", False, "ZeroDivisionError: division by zero", "no error")]
    ctx = __import__("torch.multiprocessing").multiprocessing.get_context("spawn")
    child = ctx.Process(target=sys.exit, args=(3,))
    child.start()
    with pytest.raises(RuntimeError, match=r"the receiving process died \(exit code 3\)"):
        gpu_check.poll(ctx.Queue(), child, timeout_s=60)


@pytest.mark.slow
def test_the_trainer_benchmark_runs_at_cpu_size_and_prints_its_table(tmp_path):
    # tools/bench_train.py, optimize.py's throughput with and without gradient checkpointing on a synthetic stage: its
    # tiny shape on the CPU, both rows measured (a failed optimize.py is a "failed" row)
    from conftest import run_script
    proc = run_script("tools/bench_train.py", "--shape=tiny", "--updates=2", "--mean_prompt_tokens=16",
                      "--mean_response_tokens=24", "--max_response_tokens=48", "--micro_batch_tokens=1024",
                      f"--out_dir={tmp_path}")
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| False", "| True"))]
    assert len(rows) == 2 and "failed" not in proc.stdout, proc.stdout
    assert all(float(r.split("|")[2]) > 0 for r in rows)          # tokens/s
