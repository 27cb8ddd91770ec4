"""The trainer's GPU path on one lent GPU in under 10 minutes, with only what such a machine has
(torch with CUDA, transformers; no vLLM, no download): one table, also written as JSON.

    python tools/gpu_check.py                  # one GPU: Qwen2.5-0.5B's shape, the paper's lengths
    python tools/gpu_check.py --shape=tiny --mean_prompt_tokens=16 --mean_response_tokens=24 \\
        --max_response_tokens=48 --micro_batch_tokens=1024  # its CPU-sized version
                                                            # (tests/test_benchmarks.py)

On a model built from a config with random weights (tools/synthetic.py) and a synthetic stage at the
paper's lengths:
1. throughput: optimize.py itself, a subprocess, `updates` updates at the paper's micro-batch tokens
   with gradient checkpointing and packing: tokens/s, model FLOPs utilisation (each update's FLOPs
   from the groups it trained, its metrics row's: optimize.py's seeded schedule, not the file's
   order), peak memory against the estimate for that size (fp32 weights, gradients and AdamW's two
   moments, 16 bytes per parameter, + the saved activations + one micro-batch's logits' gradient,
   [tokens, vocabulary] in the compute dtype, + the trainer's overhead,
   handoff.TRAINER_OVERHEAD_GIB; informational, not gated);
2. bf16: one packed micro-batch's loss (loss.policy_loss through passes.forward) and gradients in
   bf16 against a float32 pass of the same weights, both ways a box computes in bf16: autocast (one
   GPU, one rank) and FSDP2's bf16 parameters over fp32 masters (model.fsdp2, the box's several
   ranks; here one rank), within bounds that follow from bf16's 8-bit significand: relative rounding
   2^-9 per operation through a few dozen layers of sums, so the loss within 2 % and the gradient's
   direction within cosine 0.99 and its norm within 5 %;
3. the weight hash: common.tensor_hash of the model's tensors on the device equal to the CPU's
   (integer arithmetic: exact, no tolerance);
4. the hand-off: the policy packed into one buffer the way vLLM packs it (packed_tensor.py
   `packed_ipc_producer`: each tensor's bytes back to back in one uint8 buffer, names, shapes and
   dtypes beside), sent to a second process by torch's CUDA IPC (torch.multiprocessing; shared
   memory on a CPU), which unpacks and hashes every tensor there; the hashes must equal the
   sender's, and once the receiver has let go the buffer's memory must be free again
   (torch.cuda.ipc_collect: what a resident hand-off relies on, a buffer per stage otherwise). The
   receiver is polled: one that dies fails its row at once.
Every row passes or fails; each check runs under its own guard (one that raises is its FAIL row, the
others still run) and the JSON is written after every check, so a machine lost mid-way keeps what it
measured. The script exits 1 if a row fails. Figures go to docs/paper-run.md with the command.
"""
import math
import queue as queue_module
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import loss as L  # noqa: E402
from mu_grpo import common  # noqa: E402
from mu_grpo import handoff  # noqa: E402
from mu_grpo import records  # noqa: E402
from mu_grpo import rollouts  # noqa: E402
from mu_grpo import trainer_model as M  # noqa: E402
from mu_grpo import passes  # noqa: E402
from synthetic import build_model, model_flops, trained_lengths, write_stage  # noqa: E402

# ----------------------------------------------------------------------------- hyperparameters
shape = "qwen2.5-0.5b"          # a shape of tools/synthetic.py SHAPES (~0.5 B parameters; tiny: the
                                # CPU version)
mean_prompt_tokens = 200        # the paper's lengths: prompts ~200 tokens, responses lognormal
                                # around 1000, capped
mean_response_tokens = 1000
max_response_tokens = 2560
prompts_per_update = 8          # × G=8 responses per update
updates = 3                     # optimize.py updates timed (the first is a warm-up, reported apart)
micro_batch_tokens = 16384      # tokens per packed micro-batch (optimize.py's default, the paper's)
peak_tflops = 989.0             # dense bf16 peak of one H100/H200 SXM, for MFU
loss_bound = 0.02               # bf16 vs float32: relative loss difference at most this
grad_cosine_min = 0.99          # ... gradient cosine at least this
grad_norm_bound = 0.05          # ... relative gradient-norm difference at most this
out_dir = str(ROOT / "tools" / "out" / "gpu_check")
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])


def throughput(model_dir, stage, dims):
    """optimize.py on the stage (gradient checkpointing, packing); its metrics → the throughput
    rows. dims: the model's (parameters, layers, hidden size, vocabulary, tied embeddings),
    synthetic.build_model's."""
    proc = subprocess.run([sys.executable, str(ROOT / "optimize.py"), f"--stage_dir={stage}",
                           f"--policy={model_dir}", f"--out={stage / 'policy'}",
                           f"--updates_per_stage={updates}",
                           f"--prompts_per_update={prompts_per_update}", "--save_train_state=false",
                           f"--micro_batch_tokens={micro_batch_tokens}",
                           "--gradient_checkpointing=true", "--engine_mismatch_bound=0"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"optimize.py failed ({proc.returncode}): "
                         f"{proc.stderr.strip().splitlines()[-1:]}")
    metrics = common.read_jsonl(stage / records.METRICS)
    steady = range(1, updates) if updates > 1 else range(1)
    seconds = sum(metrics[u]["seconds"] for u in steady)
    flops = sum(model_flops(trained_lengths(stage, metrics[u]["groups"]), *dims) for u in steady)
    peak = max((m.get("memory/peak_gib") or 0.0) for m in metrics) or None
    saved = max(m["memory/saved_activations_gib"] for m in metrics)
    logits_grad = micro_batch_tokens * dims[3] * (2 if torch.cuda.is_available() else 4) / 2**30
    estimate = 16 * dims[0] / 2**30 + saved + logits_grad + handoff.TRAINER_OVERHEAD_GIB
    return [("optimize.py tokens/s (gradient checkpointing, packed)", "info",
             sum(metrics[u]["tokens"] for u in steady)
             / seconds, None),
            ("model FLOPs utilisation (the schedule's groups)", "info",
             flops / seconds / (peak_tflops * 1e12), None),
            ("seconds per update (warm-up, then steady)", "info",
             [metrics[0]["seconds"], seconds / len(steady)], None),
            ("peak GPU memory, GiB (estimate: 16 B/parameter + saved activations + logits' "
             "gradient + overhead)",
             "info", peak, round(estimate, 2))]


def bf16_against_fp32(model_dir, stage):
    """One micro-batch's loss and gradients in bf16, by autocast and by FSDP2's bf16 parameters (one
    rank), against float32 on the same weights."""
    _, _, device = M.placement()
    attention = M.choose_attention("auto", device)
    data = rollouts.open_stage(stage / records.ROLLOUTS, workers=1)
    first = np.arange(min(8 * prompts_per_update, data.n))
    mb = passes.micro_batches(
        data, first[np.argsort(-(data.prompt_len + data.response_len)[first], kind="stable")],
        micro_batch_tokens)[0]

    def loss_and_grad(net, bf16):
        net.zero_grad(set_to_none=True)
        x = passes.forward(net, data, mb, 1.0, bf16=bf16)
        value, _ = L.policy_loss(x["lp"], x["behavior"], x["adv"], x["mask"], L.preset("mu-grpo"))
        value.backward()
        grads = [
            p.grad.full_tensor() if hasattr(p.grad,
                                            "full_tensor") else p.grad for p in net.parameters()
            if p.grad is not None]
        return float(value.detach()), torch.cat([g.float().flatten() for g in grads])

    plain = M.build(model_dir, attention=attention, gradient_checkpointing=True)
    l32, g32 = loss_and_grad(plain, bf16=False)
    l16, g16 = loss_and_grad(plain, bf16=True)
    del plain
    # one rank: the box's FSDP2 path, its bf16 parameters cast from fp32 masters
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    sharded = M.fsdp2(M.build(model_dir, attention=attention, gradient_checkpointing=True), device,
                      param_dtype=torch.bfloat16)
    lf, gf = loss_and_grad(sharded, bf16=False)
    rows = []
    for how, (loss16, grad16) in (("autocast", (l16, g16)),
                                  ("FSDP2 bf16 parameters, one rank", (lf, gf))):
        cosine = float(torch.nn.functional.cosine_similarity(grad16, g32, dim=0))
        norm = abs(float(grad16.norm() / g32.norm()) - 1)
        rel = abs(loss16 - l32) / max(abs(l32), 1e-12)
        rows += [(f"bf16 ({how}) vs float32: relative loss difference ({len(mb)} packed sequences)",
                  rel <= loss_bound, rel, loss_bound),
                 (f"bf16 ({how}) vs float32: gradient cosine", cosine >= grad_cosine_min, cosine,
                  grad_cosine_min),
                 (f"bf16 ({how}) vs float32: relative gradient-norm difference",
                  norm <= grad_norm_bound, norm, grad_norm_bound)]
    return rows


def model_tensors(model_dir, device):
    """{name: tensor on `device`} of the saved model, in its dtype (bf16)."""
    return {k: v.to(device) for f in sorted(Path(model_dir).glob("*.safetensors"))
            for k, v in load_file(f).items()}


def hash_on_device(model_dir, device):
    here = {k: common.tensor_hash(v) for k, v in model_tensors(model_dir, device).items()}
    cpu = {k: common.tensor_hash(v) for k, v in model_tensors(model_dir, "cpu").items()}
    differ = [k for k in cpu if here[k] != cpu[k]]
    return [(f"tensor_hash on {device} equal to the CPU's ({len(cpu)} tensors)", not differ,
             len(differ), 0)]


def receive(inbox, outbox):
    """The second process: the packed buffer (a CUDA IPC handle, rebuilt by torch.multiprocessing)
    and its layout; every tensor unpacked and hashed where it lies; then it lets the buffer go (its
    last reference dropped: torch tells the producer, whose ipc_collect frees it) and says so."""
    buffer, layout = inbox.get()
    hashes, offset = {}, 0
    for name, shape, dtype, size in layout:
        tensor = buffer[offset:offset + size].view(getattr(torch, dtype)).view(shape)
        hashes[name] = common.tensor_hash(tensor)
        offset += size
    del tensor, buffer
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    outbox.put(hashes)
    inbox.get()                                 # the sender's "done"


def poll(queue, child, timeout_s):
    """The child's next message, checking every half second that it lives: a dead child raises at
    once, naming its exit code (not a 300-second wait, every row measured so far lost)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            return queue.get(timeout=0.5)
        except queue_module.Empty:
            if not child.is_alive():
                raise RuntimeError(f"the receiving process died (exit code {child.exitcode})") \
                    from None
    raise RuntimeError(f"the receiving process sent nothing in {timeout_s} s")


def handoff_by_ipc(model_dir, device):
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else None
    tensors = model_tensors(model_dir, device)
    flat = {k: v.contiguous().view(-1).view(torch.uint8) for k, v in tensors.items()}
    buffer = torch.empty(sum(f.numel() for f in flat.values()), dtype=torch.uint8, device=device)
    if not cuda:
        buffer.share_memory_()
    layout, offset = [], 0
    for name, f in flat.items():
        buffer[offset:offset + f.numel()].copy_(f)
        layout.append((name, list(tensors[name].shape),
                       str(tensors[name].dtype).removeprefix("torch."), f.numel()))
        offset += f.numel()
    if cuda:
        torch.cuda.current_stream().synchronize()
    sent = {k: common.tensor_hash(v) for k, v in tensors.items()}
    size_gib = buffer.numel() / 2**30
    del tensors, flat
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=receive, args=(inbox, outbox))
    t0 = time.perf_counter()
    child.start()
    inbox.put((buffer, layout))
    got = poll(outbox, child, 300)
    seconds = time.perf_counter() - t0
    # the producer's last reference; the receiver has let go of its own
    del buffer
    if cuda:
        torch.cuda.ipc_collect()                # frees storage whose receivers have released it
        left = (torch.cuda.memory_allocated(device) - before) / 2**30
    inbox.put("done")
    child.join(timeout=60)
    differ = [k for k in sent if got.get(k) != sent[k]]
    how = "CUDA IPC" if cuda else "shared memory"
    return [(f"packed buffer ({size_gib:.2f} GiB) by {how} to a second process: tensors whose hash "
             "differs there",
             not differ and child.exitcode == 0, len(differ), 0),
            ("... seconds, the second process's start included", "info", seconds, None),
            ("... GiB still allocated after the receiver let go and ipc_collect (CUDA)",
             left <= 0.01 * size_gib if cuda else "info", left if cuda else None,
             round(0.01 * size_gib, 4))]


def guarded(name, check, *args):
    """A check's rows, or its one FAIL row naming what it raised."""
    try:
        return check(*args)
    except (Exception, SystemExit) as e:
        return [(f"{name}: it ran", False, f"{type(e).__name__}: {str(e)[:200]}", "no error")]


def report(path, rows, **about):
    common.atomic_write_json(path, {**about, "date": time.strftime("%Y-%m-%d"), "argv": sys.argv,
                                    "passed": not [r for r in rows if r[1] is False],
                                    "rows": [
                                        {"check": n,
                                         "status": "INFO" if p == "info" else "PASS" if p
                                         else "FAIL",
                                              "value": v if not isinstance(v, float)
                                         or math.isfinite(v) else None,
                                              "bound": b} for n, p, v, b in rows]})


def show(rows):
    """The table: status, check, value, bound."""
    fmt = lambda v: "—" if v is None else (f"{v:.4g}" if isinstance(v, float) else  # noqa: E731
                                         ", ".join(f"{x:.3g}" for x in v) if isinstance(v, list)
                                           else str(v))
    print(f"| {'':4} | {'check':<96} | {'value':>14} | {'bound':>8} |")
    print(f"|{'-' * 6}|{'-' * 98}|{'-' * 16}|{'-' * 10}|")
    for name, passed, value, bound in rows:
        status = "INFO" if passed == "info" else "PASS" if passed else "FAIL"
        print(f"| {status:4} | {name:<96} | {fmt(value):>14} | {fmt(bound):>8} |")


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out_dir)
    model_dir, stage = out / f"model-{shape}", out / f"stage-{shape}"
    subprocess.run(["rm", "-rf", str(model_dir), str(stage)], check=True)
    # parameters, layers, hidden size, vocabulary, tied embeddings
    dims = build_model(model_dir, shape)
    n_params, vocab = dims[0], dims[3]
    lengths = write_stage(stage, vocab, prompts_per_update * updates, mean_prompt_tokens,
                          mean_response_tokens, max_response_tokens)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    print(f"{shape}: {n_params / 1e9:.3f} B parameters on one {name}; {prompts_per_update * 8} "
          f"responses per update, mean {sum(p + r for p, r in lengths) / len(lengths):.0f} tokens "
          f"(prompt + response); micro-batches of {micro_batch_tokens} tokens; torch "
          f"{torch.__version__}")
    about = {"shape": shape, "parameters": n_params, "device": name, "torch": torch.__version__}
    rows = []
    for check_name, check, args in (("throughput", throughput, (model_dir, stage, dims)),
                                    ("bf16", bf16_against_fp32, (model_dir, stage)),
                                    ("tensor hash", hash_on_device, (model_dir, device)),
                                    ("hand-off", handoff_by_ipc, (model_dir, device))):
        rows += guarded(check_name, check, *args)
        # after every check: a lost machine keeps the rows
        report(out / "gpu_check.json", rows, **about)
    show(rows)
    failed = [r[0] for r in rows if r[1] is False]
    print(f"written to {out / 'gpu_check.json'}" + (f"; FAILED: {failed}" if failed else ""))
    sys.exit(1 if failed else 0)
