"""Evaluate a policy on math benchmarks: avg@k and pass@k with vLLM, graded by reward.py.

    python evaluate.py --policy=runs/toy/stage_0/policy --benchmarks=toy --data_dir=data/toy \\
        --results=runs/toy/results.jsonl --stage=0
    python evaluate.py --policy=runs/x/policy_u00032,runs/x/policy_u00064 ...   # a curve: one engine

A comma list of policies (checkpoints of one model, e.g. optimize.py's --save_policy_every) is
evaluated by one engine that reloads the weights in place between them (no new engine per
checkpoint); each gets its rows, labelled with the updates recorded in its policy_id.json, and its
samples go beside it, to <policy>/../eval_samples/<policy name>/.

avg@k is the mean accuracy over k samples per problem; pass@k the share of problems with at least one
correct sample among the k. All benchmarks go to the engines in one call, one data-parallel engine per
GPU. One row per benchmark is written to the results table (replacing the row of the same stage and
benchmark, so a rerun after a crash does not duplicate it), and the graded samples go to
<samples_dir>/<benchmark>.jsonl. Benchmarks missing from data_dir are fetched with data/prepare.py.
"""
import json
import sys
import tempfile
import time
from pathlib import Path

import common
import reward

# ----------------------------------------------------------------------------- hyperparameters
policy = "data/toy/model"       # HF checkpoint directory, or a comma list of checkpoints of one model
benchmarks = "amc23,amc24,aime24,aime25,math500"   # comma list; also gsm8k, minerva_math, olympiadbench
data_dir = "data/benchmarks"    # <benchmark>.jsonl files (id, problem, answer, source)
k = 4                           # samples per problem (paper: avg@4)
k_per_benchmark = ""            # e.g. "aime24:32,aime25:32": another k for small, noisy benchmarks
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
gpus = -1                       # GPUs to use: one data-parallel engine per tensor_parallel of them (-1: all; 0: CPU)
tensor_parallel = 1
gpu_memory_utilization = 0.85
grader_workers = 4
grader_timeout_s = 10.0
worker_rank = -1                # internal: set for the per-GPU engine subprocesses
engines = 0                     # data-parallel engines (0: gpus // tensor_parallel; 1 on CPU)
parts_dir = ""                  # internal: where the subprocesses leave their graded samples
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])
policies = [policy]             # the --policy list (main)


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


def k_for(name):
    """Samples per problem for a benchmark: --k, or its entry in --k_per_benchmark."""
    ks = dict(item.split(":") for item in k_per_benchmark.split(",") if item.strip()) if k_per_benchmark else {}
    return int(ks.get(name, k))


def sample_and_grade(sets, rank, n):
    """For each policy, every benchmark's prompts at positions ≡ rank (mod n), submitted in one generate
    call to this process's engine, then graded: [[(benchmark, problem index, sample index, text, reward,
    info)] per policy]. The engine is built once; the next policy's weights are loaded into it in place
    (the worker's reload_weights, vllm/v1/worker/gpu_worker.py, which the CPU worker inherits) and the
    prefix cache, which holds the last policy's KV, is emptied."""
    reward.start_graders(grader_workers)  # their start-up runs beside the engine's
    llm = common.make_llm(policies[0], seed=seed, max_model_len=max_prompt_tokens + max_response_tokens,
                          tensor_parallel=tensor_parallel, gpu_memory_utilization=gpu_memory_utilization)
    parts = []
    for i, path in enumerate(policies):
        if i:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
            llm.reset_prefix_cache()
        parts.append(sample_and_grade_one(llm, sets, rank, n))
    return parts


def sample_and_grade_one(llm, sets, rank, n):
    from vllm import SamplingParams
    tokenizer = llm.get_tokenizer()
    stops = common.stop_token_ids(tokenizer, chat_template)      # EOS and the chat turn's end
    requests = [(name, j, row, ids) for name, rows in sets.items() for j, row in enumerate(rows)
                if len(ids := common.build_prompt_ids(tokenizer, row["problem"], prompt_template, chat_template))
                <= max_prompt_tokens][rank::n]
    params = [SamplingParams(n=k_for(name), temperature=temperature, top_p=top_p, max_tokens=max_response_tokens,
                             stop_token_ids=stops, seed=common.sample_seed(seed, name, j))
              for name, j, _, _ in requests]
    outputs = llm.generate([{"prompt_token_ids": ids} for *_, ids in requests], params, use_tqdm=rank == 0)
    samples = [(name, j, c.index, c.text, row["answer"], row.get("source", name))
               for (name, j, row, _), o in zip(requests, outputs) for c in sorted(o.outputs, key=lambda c: c.index)]
    graded = reward.grade_batch([(text, gold, source) for *_, text, gold, source in samples],
                                workers=grader_workers, timeout_s=grader_timeout_s)
    return [(name, j, i, text, r, {"reason": info["reason"], "extracted": info.get("extracted")})
            for (name, j, i, text, _, _), (r, info) in zip(samples, graded)]


def policy_updates(path):
    """The updates a listed checkpoint was trained for (policy_id.json from optimize.py; 0 for a model
    it did not write, e.g. the initial policy)."""
    meta = Path(path) / common.POLICY_ID_FILE
    return json.loads(meta.read_text()).get("global_updates", 0) if meta.exists() else 0


def score(parts, sets, path, sample_dir, seconds, n):
    """One results row per benchmark for one policy's graded samples; the samples go to sample_dir."""
    by_problem = {}
    for name, j, i, text, r, info in parts:
        by_problem.setdefault((name, j), []).append((i, text, r, info))
    out_rows = []
    for name, rows in sets.items():
        done = sorted(j for b, j in by_problem if b == name)
        correct = [[r for _, _, r, _ in sorted(by_problem[name, j])] for j in done]
        avg, passed = avg_and_pass_at_k(correct)
        kn = k_for(name)
        out_rows.append({"stage": stage, "updates": updates if len(policies) == 1 else policy_updates(path),
                         "benchmark": name, "k": kn, "avg_at_k": avg, "pass_at_k": passed, "problems": len(done),
                         "skipped_long_prompts": len(rows) - len(done),
                         "hours": (time.time() - run_start) / 3600 if run_start else 0.0,
                         "policy": str(path), "temperature": temperature, "top_p": top_p, "time": time.time(),
                         "seconds": seconds, "engines": n})
        label = f"{path} {name}" if len(policies) > 1 else name
        print(f"{label}: avg@{kn} {avg:.4f}  pass@{kn} {passed:.4f}  ({len(done)} problems)", flush=True)
        if sample_dir:
            sample_dir.mkdir(parents=True, exist_ok=True)
            common.atomic_write_lines(sample_dir / f"{name}.jsonl", [
                {"id": rows[j]["id"], "sample_idx": i, "response": text, "answer": rows[j]["answer"], "reward": r,
                 "reason": info["reason"], "extracted": info.get("extracted")}
                for j in done for i, text, r, info in sorted(by_problem[name, j])])
    return out_rows


def main():
    global policies
    policies = [p.strip() for p in policy.split(",") if p.strip()]
    configs = {p: json.loads((Path(p) / "config.json").read_text()) for p in policies if Path(p).is_dir()}
    shapes = {json.dumps({k: c.get(k) for k in ("architectures", "vocab_size", "hidden_size", "num_hidden_layers")})
              for c in configs.values()}
    if len(shapes) > 1:
        sys.exit(f"--policy lists checkpoints of different models ({len(shapes)} shapes): one engine reloads the "
                 f"weights of one architecture; evaluate them separately")
    names = [b.strip() for b in benchmarks.split(",") if b.strip()]
    sets = {name: benchmark_rows(name) for name in names}
    n = engines or common.n_engines(gpus, tensor_parallel)
    if worker_rank >= 0:             # an engine subprocess: its share of every benchmark, to a file
        common.atomic_write_json(Path(parts_dir) / f"part_{worker_rank}.json", sample_and_grade(sets, worker_rank, n))
        return
    t0 = time.perf_counter()
    if n > 1:
        with tempfile.TemporaryDirectory() as tmp:
            codes = common.run_engine_workers(__file__, [*sys.argv[1:], f"--parts_dir={tmp}"], n, tensor_parallel)
            if any(codes):
                sys.exit(f"evaluation engines failed with exit codes {codes}")
            per_rank = [json.loads((Path(tmp) / f"part_{r}.json").read_text()) for r in range(n)]
            parts = [[x for part in per_rank for x in part[i]] for i in range(len(policies))]
    else:
        parts = sample_and_grade(sets, 0, 1)
    seconds = (time.perf_counter() - t0) / len(policies)
    out_rows = []
    for path, policy_parts in zip(policies, parts):
        if len(policies) == 1:
            sample_dir = Path(samples_dir) if samples_dir else (
                Path(results).parent / "eval_samples" / f"stage_{stage}" if results else None)
        else:
            sample_dir = (Path(samples_dir) if samples_dir else Path(path).parent / "eval_samples") / Path(path).name
        out_rows += score(policy_parts, sets, path, sample_dir, seconds, n)
    if results:       # rows are keyed on (stage, benchmark, policy): a rerun on a subset keeps the others
        path = Path(results)
        path.parent.mkdir(parents=True, exist_ok=True)
        old = common.read_jsonl(path) if path.exists() else []
        new_keys = {(r["stage"], r["benchmark"], r["policy"]) for r in out_rows}
        common.atomic_write_lines(path, [r for r in old if (r["stage"], r["benchmark"], r.get("policy")) not in new_keys]
                                  + out_rows)
    mean = sum(r["avg_at_k"] for r in out_rows) / max(1, len(out_rows))
    print(f"average avg@k over {len(out_rows)} rows: {mean:.4f} ({n} engine(s), {seconds:.1f} s per policy)")


if __name__ == "__main__":
    main()
