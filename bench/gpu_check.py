"""The trainer's GPU path on one lent GPU in under 10 minutes, with only what such a machine has (torch with CUDA,
transformers; no vLLM, no download): one table, also written as JSON.

    python bench/gpu_check.py                               # one GPU: Qwen2.5-0.5B's shape, the paper's lengths
    python bench/gpu_check.py --shape=tiny --mean_prompt_tokens=16 --mean_response_tokens=24 \\
        --max_response_tokens=48 --micro_batch_tokens=1024  # its CPU-sized version (tests/test_benchmarks.py)

On a model built from a config with random weights (bench/synthetic.py) and a synthetic stage at the paper's lengths:
1. throughput: optimize.py itself, a subprocess, `updates` updates at the paper's micro-batch tokens with gradient
   checkpointing and packing: tokens/s, model FLOPs utilisation, peak memory against the estimate for that size
   (fp32 weights, gradients and AdamW's two moments, 16 bytes per parameter, + the saved activations + the
   trainer's overhead, handoff.TRAINER_OVERHEAD_GIB; informational, not gated);
2. bf16: one packed micro-batch's loss (loss.policy_loss through update.forward) and gradients under bf16 autocast
   against a float32 pass of the same weights, within bounds that follow from bf16's 8-bit significand: relative
   rounding 2^-9 per operation through a few dozen layers of sums, so the loss within 2 % and the gradient's
   direction within cosine 0.99 and its norm within 5 %;
3. the weight hash: common.tensor_hash of the model's tensors on the device equal to the CPU's (integer arithmetic:
   exact, no tolerance);
4. the hand-off: the policy packed into one buffer the way vLLM packs it (packed_tensor.py `packed_ipc_producer`:
   each tensor's bytes back to back in one uint8 buffer, names, shapes and dtypes beside), sent to a second process
   by torch's CUDA IPC (torch.multiprocessing; shared memory on a CPU), which unpacks and hashes every tensor there;
   the hashes must equal the sender's.
Every row passes or fails; the script exits 1 if one fails. Figures go to docs/paper-run.md with the command.
"""
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import handoff  # noqa: E402
import loss as L  # noqa: E402
import model as M  # noqa: E402
import records  # noqa: E402
import rollouts  # noqa: E402
import update  # noqa: E402
from synthetic import build_model, model_flops, write_stage  # noqa: E402

# ----------------------------------------------------------------------------- hyperparameters
shape = "qwen2.5-0.5b"          # a shape of bench/synthetic.py SHAPES (~0.5 B parameters; tiny: the CPU version)
mean_prompt_tokens = 200        # the paper's lengths: prompts ~200 tokens, responses lognormal around 1000, capped
mean_response_tokens = 1000
max_response_tokens = 2560
prompts_per_update = 8          # × G=8 responses per update
updates = 3                     # optimize.py updates timed (the first is a warm-up, reported apart)
micro_batch_tokens = 16384      # tokens per packed micro-batch (optimize.py's default, the paper's)
peak_tflops = 989.0             # dense bf16 peak of one H100/H200 SXM, for MFU
loss_bound = 0.02               # bf16 vs float32: relative loss difference at most this
grad_cosine_min = 0.99          # ... gradient cosine at least this
grad_norm_bound = 0.05          # ... relative gradient-norm difference at most this
out_dir = str(ROOT / "bench" / "out" / "gpu_check")
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])


def throughput(model_dir, stage, lengths, dims):
    """optimize.py on the stage (gradient checkpointing, packing); its metrics → the throughput rows. dims: the
    model's (parameters, layers, hidden size, vocabulary, tied embeddings), synthetic.build_model's."""
    proc = subprocess.run([sys.executable, str(ROOT / "optimize.py"), f"--stage_dir={stage}", f"--policy={model_dir}",
                           f"--out={stage / 'policy'}", f"--updates_per_stage={updates}",
                           f"--prompts_per_update={prompts_per_update}", "--save_train_state=false",
                           f"--micro_batch_tokens={micro_batch_tokens}", "--gradient_checkpointing=true",
                           "--engine_mismatch_bound=0"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"optimize.py failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    metrics = common.read_jsonl(stage / records.METRICS)
    steady = range(1, updates) if updates > 1 else range(1)
    seconds = sum(metrics[u]["seconds"] for u in steady)
    per_update = len(lengths) // updates
    flops = sum(model_flops(lengths[u * per_update:(u + 1) * per_update], *dims) for u in steady)
    peak = max((m.get("memory/peak_gib") or 0.0) for m in metrics) or None
    saved = max(m["memory/saved_activations_gib"] for m in metrics)
    estimate = 16 * dims[0] / 2**30 + saved + handoff.TRAINER_OVERHEAD_GIB
    return [("optimize.py tokens/s (gradient checkpointing, packed)", "info", sum(metrics[u]["tokens"] for u in steady)
             / seconds, None),
            ("model FLOPs utilisation", "info", flops / seconds / (peak_tflops * 1e12), None),
            ("seconds per update (warm-up, then steady)", "info", [metrics[0]["seconds"], seconds / len(steady)], None),
            ("peak GPU memory, GiB (estimate: 16 B/parameter + saved activations + overhead)", "info", peak,
             round(estimate, 2))]


def bf16_against_fp32(model_dir, stage):
    """One micro-batch's loss and gradients under bf16 autocast and in float32, the same weights."""

    _, _, device = M.placement()
    net = M.build(model_dir, attention=M.choose_attention("auto", device), gradient_checkpointing=True)
    data = rollouts.open_stage(stage / records.ROLLOUTS, workers=1)
    first = np.arange(min(8 * prompts_per_update, data.n))
    mb = update.micro_batches(data, first[np.argsort(-(data.prompt_len + data.response_len)[first], kind="stable")],
                              micro_batch_tokens)[0]
    out = {}
    for bf16 in (True, False):
        net.zero_grad(set_to_none=True)
        x = update.forward(net, data, mb, 1.0, bf16=bf16)
        value, _ = L.policy_loss(x["lp"], x["behavior"], x["adv"], x["mask"], clip_low=0.0, clip_high=5.0,
                                 nav_delta=1e-4)
        value.backward()
        grad = torch.cat([p.grad.float().flatten() for p in net.parameters() if p.grad is not None])
        out[bf16] = (float(value.detach()), grad)
    (l16, g16), (l32, g32) = out[True], out[False]
    cosine = float(torch.nn.functional.cosine_similarity(g16, g32, dim=0))
    norm = abs(float(g16.norm() / g32.norm()) - 1)
    rel = abs(l16 - l32) / max(abs(l32), 1e-12)
    return [(f"bf16 vs float32: relative loss difference ({len(mb)} packed sequences)", rel <= loss_bound, rel,
             loss_bound),
            ("bf16 vs float32: gradient cosine", cosine >= grad_cosine_min, cosine, grad_cosine_min),
            ("bf16 vs float32: relative gradient-norm difference", norm <= grad_norm_bound, norm, grad_norm_bound)]


def model_tensors(model_dir, device):
    """{name: tensor on `device`} of the saved model, in its dtype (bf16)."""
    return {k: v.to(device) for f in sorted(Path(model_dir).glob("*.safetensors")) for k, v in load_file(f).items()}


def hash_on_device(model_dir, device):
    here = {k: common.tensor_hash(v) for k, v in model_tensors(model_dir, device).items()}
    cpu = {k: common.tensor_hash(v) for k, v in model_tensors(model_dir, "cpu").items()}
    differ = [k for k in cpu if here[k] != cpu[k]]
    return [(f"tensor_hash on {device} equal to the CPU's ({len(cpu)} tensors)", not differ, len(differ), 0)]


def receive(inbox, outbox):
    """The second process: the packed buffer (a CUDA IPC handle, rebuilt by torch.multiprocessing) and its layout;
    every tensor unpacked and hashed where it lies."""
    buffer, layout = inbox.get()
    hashes, offset = {}, 0
    for name, shape, dtype, size in layout:
        tensor = buffer[offset:offset + size].view(getattr(torch, dtype)).view(shape)
        hashes[name] = common.tensor_hash(tensor)
        offset += size
    outbox.put(hashes)
    inbox.get()                                 # the sender's "done": the buffer may be freed after this returns


def handoff_by_ipc(model_dir, device):
    tensors = model_tensors(model_dir, device)
    flat = {k: v.contiguous().view(-1).view(torch.uint8) for k, v in tensors.items()}
    buffer = torch.empty(sum(f.numel() for f in flat.values()), dtype=torch.uint8, device=device)
    if buffer.device.type == "cpu":
        buffer.share_memory_()
    layout, offset = [], 0
    for name, f in flat.items():
        buffer[offset:offset + f.numel()].copy_(f)
        layout.append((name, list(tensors[name].shape), str(tensors[name].dtype).removeprefix("torch."), f.numel()))
        offset += f.numel()
    if buffer.device.type == "cuda":
        torch.cuda.current_stream().synchronize()
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=receive, args=(inbox, outbox))
    t0 = time.perf_counter()
    child.start()
    inbox.put((buffer, layout))
    got = outbox.get(timeout=300)
    seconds = time.perf_counter() - t0
    inbox.put("done")
    child.join(timeout=60)
    sent = {k: common.tensor_hash(v) for k, v in tensors.items()}
    differ = [k for k in sent if got.get(k) != sent[k]]
    how = "CUDA IPC" if buffer.device.type == "cuda" else "shared memory"
    return [(f"packed buffer ({buffer.numel() / 2**30:.2f} GiB) by {how} to a second process: tensors whose hash "
             f"differs there", not differ and child.exitcode == 0, len(differ), 0),
            ("... seconds, the second process's start included", "info", seconds, None)]


def show(rows):
    """The table: status, check, value, bound."""
    fmt = lambda v: "—" if v is None else (f"{v:.4g}" if isinstance(v, float) else  # noqa: E731
                                         ", ".join(f"{x:.3g}" for x in v) if isinstance(v, list) else str(v))
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
    dims = build_model(model_dir, shape)         # parameters, layers, hidden size, vocabulary, tied embeddings
    n_params, vocab = dims[0], dims[3]
    lengths = write_stage(stage, vocab, prompts_per_update * updates, mean_prompt_tokens, mean_response_tokens,
                          max_response_tokens)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    print(f"{shape}: {n_params / 1e9:.3f} B parameters on one {name}; {prompts_per_update * 8} responses per update, "
          f"mean {sum(p + r for p, r in lengths) / len(lengths):.0f} tokens (prompt + response); micro-batches of "
          f"{micro_batch_tokens} tokens; torch {torch.__version__}")
    rows = [*throughput(model_dir, stage, lengths, dims),
            *bf16_against_fp32(model_dir, stage), *hash_on_device(model_dir, device), *handoff_by_ipc(model_dir, device)]
    show(rows)
    failed = [r[0] for r in rows if r[1] is False]
    common.atomic_write_json(out / "gpu_check.json", {
        "shape": shape, "parameters": n_params, "device": name, "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "argv": sys.argv, "passed": not failed,
        "rows": [{"check": n, "status": "INFO" if p == "info" else "PASS" if p else "FAIL",
                  "value": v if not isinstance(v, float) or math.isfinite(v) else None, "bound": b}
                 for n, p, v, b in rows]})
    print(f"written to {out / 'gpu_check.json'}" + (f"; FAILED: {failed}" if failed else ""))
    sys.exit(1 if failed else 0)
