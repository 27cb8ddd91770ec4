"""Training throughput of optimize.py: tokens/s, model FLOPs utilization and peak memory, with and
without gradient checkpointing, on a randomly initialized model built from a config (no download).

    python bench/bench_train.py                          # Qwen2.5-1.5B shape, bf16 on one GPU
    python bench/bench_train.py --shape=tiny --updates=2 # a CPU smoke run of the bench itself

It writes a synthetic stage (random prompt/response tokens of the paper's lengths) and runs the real
optimize.py on it, then reads its metrics.jsonl. FLOPs per update: 6·N·tokens + 6·layers·hidden·s²
per sequence (causal attention, forward + backward); MFU against `peak_tflops`.
"""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402

# ----------------------------------------------------------------------------- hyperparameters
shape = "qwen2.5-1.5b"      # qwen2.5-1.5b | qwen2.5-7b | tiny
prompt_tokens = 300         # per response
response_tokens = 1500
responses_per_update = 64   # 8 prompts × G=8
updates = 4                 # the first is reported apart (warm-up)
micro_batch_tokens = 16384
peak_tflops = 989.0         # dense bf16 peak of one H100/H200 SXM
out_dir = str(ROOT / "bench" / "out" / "train")
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064),
    "tiny": (64, 2, 2, 2, 128, 512),
}


def build_model(path):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    sys.path.insert(0, str(ROOT / "data"))
    import toy
    hidden, layers, heads, kv, inter, vocab = SHAPES[shape]
    cfg = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=inter, vocab_size=vocab, max_position_embeddings=4096,
                      tie_word_embeddings=shape == "qwen2.5-1.5b", torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    toy.build_tokenizer(["What is 1 + 2? \\boxed{3}"] * 10, 300).save_pretrained(path)
    n_params = sum(p.numel() for p in model.parameters())
    return n_params, layers, hidden, vocab


def count_parameters(model_dir):
    import math
    from safetensors import safe_open
    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            total += sum(math.prod(sf.get_slice(k).get_shape()) for k in sf.keys())
    return total


def write_stage(stage, vocab):
    rng = random.Random(0)
    rows = []
    for g in range(responses_per_update // 8 * updates):
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        for i in range(8):
            resp = [rng.randrange(vocab) for _ in range(response_tokens)]
            rows.append({"prompt_id": f"p{g}", "group": g, "sample_idx": i, "prompt_token_ids": prompt,
                         "response_token_ids": resp, "behavior_logprobs": [-12.0] * response_tokens,
                         "finish_reason": "length", "reward": float(i % 2), "advantage": 1.0 if i % 2 else -1.0,
                         "stage": 0, "policy": "bench"})
    out = stage / "rollouts"
    out.mkdir(parents=True, exist_ok=True)
    common.atomic_write_lines(out / "shard_00000.jsonl", rows)
    common.atomic_write_json(out / "manifest.json", {"complete": True, "stage": 0, "policy": "bench",
                                                     "shards": ["shard_00000.jsonl"],
                                                     "sampling": {"n": 8, "temperature": 1.0, "max_tokens": response_tokens}})


if __name__ == "__main__":
    out = Path(out_dir)
    model_dir = out / f"model-{shape}"
    if not (model_dir / "config.json").exists():
        n_params, layers, hidden, vocab = build_model(model_dir)
    else:
        from transformers import AutoConfig
        c = AutoConfig.from_pretrained(model_dir)
        layers, hidden, vocab = c.num_hidden_layers, c.hidden_size, c.vocab_size
        n_params = None
    table = []
    for ckpt in (False, True):
        stage = out / f"stage-{shape}-ckpt{int(ckpt)}"
        subprocess.run(["rm", "-rf", str(stage)], check=True)
        write_stage(stage, vocab)
        proc = subprocess.run([sys.executable, str(ROOT / "optimize.py"), f"--stage_dir={stage}",
                               f"--policy={model_dir}", f"--out={stage / 'policy'}", f"--updates_per_stage={updates}",
                               f"--prompts_per_update={responses_per_update // 8}",
                               f"--micro_batch_tokens={micro_batch_tokens}", f"--gradient_checkpointing={ckpt}",
                               "--skip_zero_variance=false"], capture_output=True, text=True)
        if proc.returncode != 0:
            table.append((ckpt, None, proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"))
            continue
        metrics = [json.loads(line) for line in open(stage / "metrics.jsonl")]
        steady = metrics[1:] or metrics
        seconds = sum(m["seconds"] for m in steady) / len(steady)
        tokens = sum(m["tokens"] for m in steady) / len(steady)
        if n_params is None:
            n_params = count_parameters(model_dir)
        seq = prompt_tokens + response_tokens
        flops = 6 * n_params * tokens + 6 * layers * hidden * seq * seq * (tokens / seq)
        peak = max((m.get("memory/peak_gib") or 0.0) for m in metrics)
        table.append((ckpt, (tokens / seconds, flops / seconds / (peak_tflops * 1e12), peak, seconds), None))
    print(f"{shape}: {n_params / 1e9:.2f} B parameters; {responses_per_update} responses × ({prompt_tokens} + "
          f"{response_tokens}) tokens per update; micro-batches of {micro_batch_tokens} tokens; "
          f"{updates - 1} timed updates after one warm-up")
    print(f"| {'gradient checkpointing':<22} | {'tokens/s':>9} | {'MFU':>6} | {'peak GiB':>8} | {'s/update':>8} |")
    print(f"|{'-' * 24}|{'-' * 11}|{'-' * 8}|{'-' * 10}|{'-' * 10}|")
    for ckpt, res, err in table:
        if res is None:
            print(f"| {str(ckpt):<22} | failed: {err}")
        else:
            tps, mfu, peak, sec = res
            print(f"| {str(ckpt):<22} | {tps:9.0f} | {100 * mfu:5.1f}% | {peak:8.1f} | {sec:8.2f} |")
