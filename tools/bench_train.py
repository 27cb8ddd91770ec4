"""Training throughput of optimize.py: tokens/s, model FLOPs utilization and memory, with and without
gradient checkpointing, on a randomly initialized model built from a config (no download).

    python tools/bench_train.py                                  # Qwen2.5-1.5B shape, one GPU
    python tools/bench_train.py --shape=qwen2.5-7b --gpus=4      # the paper's model under torchrun, FSDP2
    python tools/bench_train.py --shape=tiny --updates=2         # a CPU smoke run of the bench itself

It writes a synthetic stage (random tokens; prompt and response lengths drawn from a length mix like a
math RL stage's: lognormal responses around `mean_response_tokens`, capped) and runs the real
optimize.py on it, then reads its metrics.jsonl. Model FLOPs per update count the tokens actually
computed: 2·N_body per token for every token, the lm_head (2·V·H) only at response positions (the
trainer computes logits only there), causal attention 2·layers·hidden·s² per sequence; ×3 for forward
+ backward (recomputation under gradient checkpointing is not counted: MFU is model FLOPs).
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mu_grpo import common  # noqa: E402
from mu_grpo import records  # noqa: E402
from synthetic import build_model, count_parameters, model_flops, trained_lengths, write_stage  # noqa: E402

# ----------------------------------------------------------------------------- hyperparameters
# the model and the box
shape = "qwen2.5-1.5b"      # a shape of synthetic.SHAPES: qwen2.5-0.5b | qwen2.5-1.5b | qwen2.5-7b | tiny
gpus = 1                    # > 1: torchrun --nproc_per_node=gpus (FSDP2; gloo ranks on a CPU machine)
layers = 0                  # 0: the shape's layer count; > 0: fewer layers (the real shape, scaled down, on CPU)

# the synthetic stage: its lengths
mean_prompt_tokens = 200    # prompt lengths uniform in [mean/2, 3·mean/2]
mean_response_tokens = 1000 # lognormal response lengths (σ 0.6), capped at max_response_tokens
max_response_tokens = 2560

# the updates measured
prompts_per_update = 8      # × G=8 responses
updates = 4                 # the first is reported apart (warm-up)
micro_batch_tokens = 16384

# the report: MFU and where it goes
peak_tflops = 989.0         # dense bf16 peak of one H100/H200 SXM
out_dir = str(ROOT / "tools" / "out" / "train")
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])

if __name__ == "__main__":
    out = Path(out_dir)
    model_dir = out / (f"model-{shape}" + (f"-{layers}layers" if layers else ""))
    if not (model_dir / "config.json").exists():
        build_model(model_dir, shape, layers)
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model_dir)
    layers, hidden, vocab, tied = c.num_hidden_layers, c.hidden_size, c.vocab_size, bool(c.tie_word_embeddings)
    n_params = count_parameters(model_dir)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"] if gpus > 1 \
        else [sys.executable]
    table = []
    for ckpt in (False, True):
        stage = out / f"stage-{shape}-ckpt{int(ckpt)}"
        subprocess.run(["rm", "-rf", str(stage)], check=True)
        lengths = write_stage(stage, vocab, prompts_per_update * updates, mean_prompt_tokens, mean_response_tokens,
                              max_response_tokens)
        proc = subprocess.run([*launcher, str(ROOT / "optimize.py"), f"--stage_dir={stage}",
                               f"--policy={model_dir}", f"--out={stage / 'policy'}", f"--updates_per_stage={updates}",
                               f"--prompts_per_update={prompts_per_update}", "--save_train_state=false",
                               f"--micro_batch_tokens={micro_batch_tokens}", f"--gradient_checkpointing={ckpt}",
                               "--engine_mismatch_bound=0"],       # (random tokens: no engine sampled them)
                              capture_output=True, text=True)
        if proc.returncode != 0:
            table.append((ckpt, None, proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"))
            continue
        metrics = [json.loads(line) for line in open(stage / records.METRICS)]
        timing = json.loads((stage / records.OPTIMIZE_TIMING).read_text())
        steady = range(1, updates) if updates > 1 else range(1)
        seconds = sum(metrics[u]["seconds"] for u in steady)
        tokens = sum(metrics[u]["tokens"] for u in steady)
        flops = sum(model_flops(trained_lengths(stage, metrics[u]["groups"]), n_params, layers, hidden, vocab, tied)
                    for u in steady)       # each update's groups, optimize.py's seeded schedule
        peak = max((m.get("memory/peak_gib") or 0.0) for m in metrics) or None
        table.append((ckpt, (tokens / seconds, flops / seconds / (peak_tflops * 1e12 * gpus), peak,
                             metrics[0]["memory/saved_activations_gib"], max(timing["peak_rss_gib_per_rank"]),
                             seconds / len(steady)), None))
    mean_len = np.mean([p + r for p, r in lengths])
    print(f"{shape}: {n_params / 1e9:.2f} B parameters on {gpus} rank(s); "
          f"{prompts_per_update * 8} responses per update, mean {mean_len:.0f} tokens (prompt + response); "
          f"micro-batches of {micro_batch_tokens} tokens per rank; {max(1, updates - 1)} timed updates after one warm-up")
    print(f"| {'grad ckpt':<9} | {'tokens/s':>9} | {'MFU':>6} | {'peak GPU GiB':>12} | {'saved activations GiB':>21} | "
          f"{'peak RSS GiB':>12} | {'s/update':>8} |")
    print(f"|{'-' * 11}|{'-' * 11}|{'-' * 8}|{'-' * 14}|{'-' * 23}|{'-' * 14}|{'-' * 10}|")
    for ckpt, res, err in table:
        if res is None:
            print(f"| {str(ckpt):<9} | failed: {err}")
        else:
            tps, mfu, peak, saved, rss, sec = res
            peak_text = f"{peak:12.1f}" if peak else f"{'(CPU)':>12}"
            print(f"| {str(ckpt):<9} | {tps:9.0f} | {100 * mfu:5.1f}% | {peak_text} | {saved:21.3f} | {rss:12.2f} | {sec:8.2f} |")
