"""generate.py's throughput against a bare `LLM.generate` on the same prompts, in the same run.

    python bench/bench_generate.py                        # 64 prompts × 8, up to 128 tokens each
    python bench/bench_generate.py --prompts=128 --max_response_tokens=256

generate.py does more than sample: a seed per prompt, log-probs of every sampled token (flat), stop
tokens, grading in a process pool (overlapped with the next shard's generation), advantages, atomic
JSONL and binary columns. This measures what that costs. The policy is a small Llama with random
weights and the toy tokenizer, so responses rarely stop early and every path generates about the same
number of tokens. Rows, each on the same prompt token ids, n = G, temperature 1, same max tokens:
  bare             LLM.generate(prompts, SamplingParams(n, temperature, max_tokens)), one call
  bare + logprobs  the same with logprobs=0, flat_logprobs=True (what training needs)
  generate.py      the script in a subprocess, once per shard size: its engine time (manifest
                   generation_seconds: the shards flow through one engine back to back) and from its
                   first request to its last shard written (wall_seconds: grading and writing too);
                   engine start-up is excluded, as it is for the bare rows. The last shard's grading
                   and writing are not overlapped with generation.
Each measurement runs in a fresh process after a two-token warm-up call with the same options (as
generate.py does: the first request with log-probs compiles a vLLM kernel), the paths interleaved and
repeated; the table gives medians. Same machine, same engine settings
(engine.make_llm). tokens/s = response tokens / seconds.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import engine  # noqa: E402
import records  # noqa: E402

# ----------------------------------------------------------------------------- hyperparameters
prompts = 64                 # prompts from the toy training set
group_size = 8               # G responses per prompt
max_response_tokens = 128
shard_sizes = "64,16"        # generate.py runs, one per shard size (prompts per shard, comma-separated)
repeats = 3                  # each path measured this many times, interleaved; the median is reported
mode = "compare"             # internal: bare | bare_logprobs measure one bare call in a fresh process
hidden_size = 256            # the random-weight policy
layers = 4
out_dir = str(ROOT / "bench" / "out" / "generate")
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])


def build_policy(path, toy_dir):
    """A random-weight Llama with the toy tokenizer (head dimension 32, which vLLM's CPU backend supports)."""
    import torch  # torch, transformers: only when the policy is built
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(toy_dir / "model")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                      num_attention_heads=hidden_size // 32, num_key_value_heads=hidden_size // 32,
                      vocab_size=len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=False,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)


def bare(policy, data, logprobs):
    """One LLM.generate call on generate.py's stage-0 prompts in this process: (tokens, seconds)."""
    from vllm import SamplingParams  # vLLM: only for the bare-LLM row
    llm = engine.make_llm(policy, seed=0, max_model_len=64 + max_response_tokens)
    tokenizer = llm.get_tokenizer()
    rows = common.shuffled_window(common.load_problems(data), 0, prompts, 0)
    batch = [{"prompt_token_ids": common.build_prompt_ids(tokenizer, r["problem"], "{problem}")} for r in rows]
    extra = {"logprobs": 0, "flat_logprobs": True} if logprobs else {}
    params = SamplingParams(n=group_size, temperature=1.0, max_tokens=max_response_tokens, seed=0, **extra)
    llm.generate(batch[:1], SamplingParams(max_tokens=2, **extra), use_tqdm=False)  # warm-up, as generate.py
    t0 = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return sum(len(c.token_ids) for o in outputs for c in o.outputs), seconds


def run_generate(policy, data, shard_prompts):
    """generate.py in a subprocess: (tokens, generation seconds, wall seconds) from its manifest."""
    run_dir = Path(out_dir) / f"run-{shard_prompts}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    subprocess.run([sys.executable, str(ROOT / "generate.py"), f"--policy={policy}", f"--data={data}",
                    f"--run_dir={run_dir}", f"--prompts_per_stage={prompts}", f"--group_size={group_size}",
                    f"--shard_prompts={shard_prompts}", f"--max_response_tokens={max_response_tokens}",
                    "--max_prompt_tokens=64", "--prompt_template={problem}"], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    m = json.loads((records.stage_dir(run_dir, 0) / records.ROLLOUTS / records.MANIFEST).read_text())
    return m["mean_response_tokens"] * m["responses"], m["generation_seconds"], m["wall_seconds"]


if __name__ == "__main__":
    out, toy_dir = Path(out_dir), ROOT / "data" / "toy"
    if not (toy_dir / "model" / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "data" / "toy.py"), f"--out_dir={toy_dir}"], check=True)
    policy = out / f"policy-{hidden_size}x{layers}"
    if not (policy / "config.json").exists():
        build_policy(policy, toy_dir)
    data = toy_dir / "train.jsonl"
    if mode in ("bare", "bare_logprobs"):
        print(json.dumps(bare(policy, data, mode == "bare_logprobs")))
        sys.exit(0)

    # every measurement in a fresh process (a first generate call, as in generate.py), interleaved, repeated
    samples = {}
    for _ in range(repeats):
        for m, label in (("bare", "bare LLM.generate"), ("bare_logprobs", "bare + logprobs=0 (flat)")):
            proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], f"--mode={m}"], check=True,
                                  capture_output=True, text=True)
            samples.setdefault(label, []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
        for shard_prompts in map(int, str(shard_sizes).split(",")):
            tokens, generation, wall = run_generate(policy, data, shard_prompts)
            shards = -(-prompts // shard_prompts)
            samples.setdefault(f"generate.py, {shards} shard(s), generation only", []).append((tokens, generation))
            samples.setdefault(f"generate.py, {shards} shard(s), wall", []).append((tokens, wall))

    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    rates = {label: median([t / s for t, s in xs]) for label, xs in samples.items()}
    reference = rates["bare LLM.generate"]
    print(f"{prompts} prompts × G={group_size}, max {max_response_tokens} tokens; policy {hidden_size}×{layers} "
          f"random weights; {common.gpu_count() or 'no'} GPU(s), {os.cpu_count()} CPUs; median of {repeats}")
    print(f"| {'path':<44} | {'tokens':>7} | {'tokens/s':>8} | {'× bare':>6} |")
    print(f"|{'-' * 46}|{'-' * 9}|{'-' * 10}|{'-' * 8}|")
    for label, xs in samples.items():
        print(f"| {label:<44} | {xs[0][0]:7.0f} | {rates[label]:8.0f} | {rates[label] / reference:6.2f} |")
