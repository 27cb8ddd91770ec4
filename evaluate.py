"""Evaluate a policy on math benchmarks: avg@k and pass@k with vLLM, graded by reward.py.

    python evaluate.py --policy=runs/toy/stage_0/policy --benchmarks=toy --data_dir=data/toy \\
        --results=runs/toy/results.jsonl --stage=0

avg@k is the mean accuracy over k samples per problem; pass@k the share of problems with at least one
correct sample among the k. One row per benchmark is written to the results table (replacing rows of
the same stage label, so a rerun after a crash does not duplicate them), and the graded samples go to
<samples_dir>/<benchmark>.jsonl. Benchmarks missing from data_dir are fetched with data/prepare.py.
"""
import json
import sys
import time
from pathlib import Path

import common
import reward

# ----------------------------------------------------------------------------- hyperparameters
policy = "data/toy/model"       # HF checkpoint directory
benchmarks = "amc23,amc24,aime24,aime25,math500"   # comma list; also gsm8k, minerva_math, olympiadbench
data_dir = "data/benchmarks"    # <benchmark>.jsonl files (id, problem, answer, source)
k = 4                           # samples per problem (paper: avg@4)
temperature = 1.0               # paper protocol: temperature 1.0, top_p 0.7
top_p = 0.7
max_prompt_tokens = 1536
max_response_tokens = 2560
prompt_template = common.DEFAULT_PROMPT_TEMPLATE
chat_template = True
max_problems = 0                # 0: all problems of each benchmark
seed = 0
results = ""                    # results table (JSONL) to update; empty: print only
samples_dir = ""                # graded samples go here (default: next to the results table)
stage = -1                      # labels for the results row: stage index (-1: the initial policy)
updates = 0                     # optimizer updates so far in the run
run_start = 0.0                 # unix time the run started (for hours since start; 0: now)
tensor_parallel = 1
gpu_memory_utilization = 0.85
grader_workers = 4
grader_timeout_s = 10.0
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])


def avg_and_pass_at_k(correct):
    """correct: per problem, a list of k 0/1 rewards → (avg@k, pass@k)."""
    if not correct:
        return float("nan"), float("nan")
    avg = sum(sum(c) / len(c) for c in correct) / len(correct)
    passed = sum(any(x == 1.0 for x in c) for c in correct) / len(correct)
    return avg, passed


def benchmark_rows(name):
    path = Path(data_dir) / f"{name}.jsonl"
    if not path.exists():
        sys.path.insert(0, str(Path(__file__).parent / "data"))
        import prepare
        try:
            prepare.prepare(name, str(path))
        except Exception as e:
            sys.exit(f"benchmark {name!r} is not at {path} and could not be fetched ({type(e).__name__}: {e}). "
                     f"Offline: place a JSONL file with fields id, problem, answer, source at {path} "
                     f"(data/prepare.py --input=<local file> --out={path} converts one)")
    rows = common.load_problems(path)
    return rows[:max_problems] if max_problems else rows


def main():
    from vllm import SamplingParams
    names = [b.strip() for b in benchmarks.split(",") if b.strip()]
    sets = {name: benchmark_rows(name) for name in names}
    llm = common.make_llm(policy, seed=seed, max_model_len=max_prompt_tokens + max_response_tokens,
                          tensor_parallel=tensor_parallel, gpu_memory_utilization=gpu_memory_utilization)
    tokenizer = llm.get_tokenizer()
    out_rows = []
    sample_dir = Path(samples_dir) if samples_dir else (Path(results).parent / "eval_samples" / f"stage_{stage}"
                                                        if results else None)
    for name, rows in sets.items():
        prompts, kept = [], []
        for i, row in enumerate(rows):
            ids = common.build_prompt_ids(tokenizer, row["problem"], prompt_template, chat_template)
            if len(ids) <= max_prompt_tokens:
                prompts.append({"prompt_token_ids": ids})
                kept.append(row)
        params = [SamplingParams(n=k, temperature=temperature, top_p=top_p, max_tokens=max_response_tokens,
                                 seed=(seed * 1_000_003 + i) % 2**31) for i in range(len(prompts))]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=True)
        texts = [(c.text, row["answer"], row.get("source", name)) for row, o in zip(kept, outputs)
                 for c in sorted(o.outputs, key=lambda c: c.index)]
        graded = reward.grade_batch(texts, workers=grader_workers, timeout_s=grader_timeout_s)
        correct = [[graded[j * k + s][0] for s in range(k)] for j in range(len(kept))]
        avg, passed = avg_and_pass_at_k(correct)
        out_rows.append({"stage": stage, "updates": updates, "benchmark": name, "k": k,
                         "avg_at_k": avg, "pass_at_k": passed, "problems": len(kept),
                         "skipped_long_prompts": len(rows) - len(kept),
                         "hours": (time.time() - run_start) / 3600 if run_start else 0.0,
                         "policy": str(policy), "temperature": temperature, "top_p": top_p, "time": time.time(),
                         "seconds": time.perf_counter() - t0})
        print(f"{name}: avg@{k} {avg:.4f}  pass@{k} {passed:.4f}  ({len(kept)} problems)", flush=True)
        if sample_dir:
            sample_dir.mkdir(parents=True, exist_ok=True)
            common.atomic_write_lines(sample_dir / f"{name}.jsonl", [
                {"id": row["id"], "sample_idx": s, "response": texts[j * k + s][0], "answer": row["answer"],
                 "reward": graded[j * k + s][0], "reason": graded[j * k + s][1]["reason"],
                 "extracted": graded[j * k + s][1].get("extracted")}
                for j, row in enumerate(kept) for s in range(k)])
    if results:
        path = Path(results)
        path.parent.mkdir(parents=True, exist_ok=True)
        old = common.read_jsonl(path) if path.exists() else []
        common.atomic_write_lines(path, [r for r in old if r["stage"] != stage] + out_rows)
    mean = sum(r["avg_at_k"] for r in out_rows) / max(1, len(out_rows))
    print(f"average avg@{k} over {len(out_rows)} benchmarks: {mean:.4f}")


if __name__ == "__main__":
    main()
