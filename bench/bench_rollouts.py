"""Start-up cost of the training path on a paper-like stage: time and peak memory to open the rollouts
(validate, build the binary columns from JSONL the first time, memory-map them afterwards).

    python bench/bench_rollouts.py                   # 1/16 of a paper stage: 4,096 prompts × 8, ~50 M tokens
    python bench/bench_rollouts.py --prompts=256     # a quick look

It writes a synthetic stage (JSONL only, as an older generate.py or another tool would leave it:
random token ids, a realistic length mix), then measures, each in a fresh process:
  first start  rollouts.open_stage builds the columns from the JSONL (streaming, one process per core)
  later start  the columns exist: validation and memory-mapping only
  optimize.py  `optimize.py --updates_per_stage=0` on a tiny model: the whole start before the first
               update (rollouts, schedule, model build and load, saving the policy)
Peak RSS is the largest resident set of the process or any of its workers.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import records  # noqa: E402
import rollouts  # noqa: E402

# ----------------------------------------------------------------------------- hyperparameters
prompts = 4096              # 1/16 of the paper's 65,536 prompts per stage
group_size = 8
shard_prompts = 1024        # prompts per shard (4 shards: what 4 engines would write)
mean_response_tokens = 1500 # lognormal response lengths, capped at max_response_tokens (paper: 2560)
max_response_tokens = 2560
vocab = 32000
out_dir = str(ROOT / "bench" / "out" / "rollouts")
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])

MEASURE = """
import resource, sys, time
sys.path.insert(0, {root!r})
import common
t0 = time.perf_counter()
import rollouts
stage = rollouts.open_stage({rollouts!r})
n_tokens = int(stage.token_offset[-1])
seconds = time.perf_counter() - t0
peak = max(common.peak_rss_gib(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20)  # workers
print(seconds, peak, stage.n, n_tokens)
"""


def write_stage(stage_dir):
    """The synthetic stage as JSONL shards and a manifest (no columns)."""
    rng = np.random.default_rng(0)
    out = stage_dir / records.ROLLOUTS
    out.mkdir(parents=True, exist_ok=True)
    names, tokens = [], 0
    for k, start in enumerate(range(0, prompts, shard_prompts)):
        rows = []
        for g in range(start, min(prompts, start + shard_prompts)):
            prompt = rng.integers(3, vocab, int(rng.integers(80, 400))).tolist()
            lengths = np.minimum(max_response_tokens, rng.lognormal(np.log(mean_response_tokens) - 0.18, 0.6,
                                                                     group_size).astype(int) + 1)
            rewards = (rng.random(group_size) < 0.4).astype(float)
            adv = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
            for i, n in enumerate(lengths):
                resp = rng.integers(3, vocab, n).tolist()
                rows.append({"prompt_id": f"p{g}", "group": g, "sample_idx": i, "prompt_token_ids": prompt,
                             "response_token_ids": resp,
                             "behavior_logprobs": np.round(-rng.exponential(1.0, n), 6).tolist(),
                             "finish_reason": "length" if n == max_response_tokens else "stop",
                             "reward": float(rewards[i]), "advantage": round(float(adv[i]), 6),
                             "zero_variance": bool(rewards.min() == rewards.max()), "stage": 0, "policy": "bench"})
                tokens += int(n)
        name = f"shard_{k:05d}.jsonl"
        common.atomic_write(out / name, b"".join(rollouts.dumps(r) for r in rows))
        names.append(name)
    common.atomic_write_json(out / "manifest.json", {
        "complete": True, "stage": 0, "policy": "bench", "shards": names,
        "sampling": {"n": group_size, "temperature": 1.0, "top_p": 1.0, "max_tokens": max_response_tokens}})
    return tokens


def measure(code_or_cmd):
    proc = subprocess.run(code_or_cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    return proc.stdout


def tiny_model(path):
    import torch  # torch, transformers: only when the model is built
    from transformers import LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, str(ROOT / "data"))
    import toy  # data/ is on the path only now
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(path)
    toy.build_tokenizer(["What is 1 + 2? \\boxed{3}"] * 10, 300).save_pretrained(path)


if __name__ == "__main__":
    out = Path(out_dir)
    stage_dir = out / f"stage-{prompts}x{group_size}"
    subprocess.run(["rm", "-rf", str(stage_dir)], check=True)
    t0 = time.perf_counter()
    tokens = write_stage(stage_dir)
    jsonl_gb = sum(f.stat().st_size for f in (stage_dir / records.ROLLOUTS).glob("*.jsonl")) / 1e9
    print(f"synthetic stage: {prompts} prompts × G={group_size} = {prompts * group_size} responses, "
          f"{tokens / 1e6:.1f} M response tokens, {jsonl_gb:.2f} GB of JSONL in "
          f"{len(list((stage_dir / records.ROLLOUTS).glob('*.jsonl')))} shards (written in {time.perf_counter() - t0:.0f} s)")
    code = MEASURE.format(root=str(ROOT), rollouts=str(stage_dir / records.ROLLOUTS))
    rows = []
    for label in ("first start (columns built from JSONL)", "later start (columns memory-mapped)"):
        seconds, peak, n, _ = measure([sys.executable, "-c", code]).split()
        rows.append((label, float(seconds), float(peak)))
    model = out / "tiny-model"
    if not (model / "config.json").exists():
        tiny_model(model)
    t0 = time.perf_counter()
    measure([sys.executable, str(ROOT / "optimize.py"), f"--stage_dir={stage_dir}", f"--policy={model}",
             f"--out={stage_dir / 'policy'}", "--updates_per_stage=0"])
    timing = json.loads((stage_dir / "optimize_timing.json").read_text())
    rows.append(("optimize.py --updates_per_stage=0", time.perf_counter() - t0, max(timing["peak_rss_gib_per_rank"])))
    print(f"| {'start':<42} | {'seconds':>8} | {'peak RSS GiB':>12} |")
    print(f"|{'-' * 44}|{'-' * 10}|{'-' * 14}|")
    for label, seconds, peak in rows:
        print(f"| {label:<42} | {seconds:8.1f} | {peak:12.2f} |")
    print(json.dumps({"prompts": prompts, "responses": prompts * group_size, "response_tokens": tokens,
                      "jsonl_gb": jsonl_gb, "rows": rows}))
