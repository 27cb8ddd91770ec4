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
<samples_dir>/<benchmark>.jsonl. Benchmarks missing from data_dir are fetched with data/prepare.py. On several
nodes (run_stages.sh NNODES > 1) every node runs this script for its engines, each sampling the prompts of its
engines' indices counted over all nodes; node 0 scores them all and writes the rows.
"""
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import common
import engine
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
seed = 0                        # the sampling seed of every evaluation (resident mode's generate.py --eval_seed: the same)
results = ""                    # results table (JSONL) to update; empty: print only
samples_dir = ""                # graded samples go here (default: next to the results table)
stage = -1                      # labels for the results row: stage index (-1: the initial policy)
run_start = 0.0                 # unix time the run started (for hours since start; 0: now)
gpus = -1                       # GPUs to use: one data-parallel engine per tensor_parallel of them (-1: all; 0: CPU)
tensor_parallel = 1
gpu_memory_utilization = 0.85
grader_workers = 4
grader_timeout_s = 10.0
worker_rank = -1                # internal: set for the per-GPU engine subprocesses
engines = 0                     # data-parallel engines (0: gpus // tensor_parallel; 1 on CPU)
parts_dir = ""                  # internal: where the subprocesses leave their graded samples
nnodes = 1                      # nodes evaluating side by side (run_stages.sh NNODES), this one's rank, and node 0's
node_rank = 0                   # store ("addr:port", nodes.py); their graded samples meet beside the results table
coordinator = ""
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])


def evaluation(sets):
    """This command line's evaluation protocol (engine.Evaluation)."""
    return engine.Evaluation(sets=sets, k=engine.samples_per_problem(sets, k, k_per_benchmark), temperature=temperature,
                             top_p=top_p,
                             max_prompt_tokens=max_prompt_tokens, max_response_tokens=max_response_tokens,
                             prompt_template=prompt_template, chat_template=chat_template, seed=seed,
                             grader_workers=grader_workers, grader_timeout_s=grader_timeout_s)


def sample_and_grade(policies, ev, rank, n):
    """For each policy, its graded samples of every benchmark's prompts at positions ≡ rank (mod n). The engine
    is built once; the next policy's weights are loaded into it in place (engine.load_policy)."""
    reward.start_graders(grader_workers)  # their start-up runs beside the engine's
    llm = engine.make_llm(policies[0], seed=seed, max_model_len=max_prompt_tokens + max_response_tokens,
                          tensor_parallel=tensor_parallel, gpu_memory_utilization=gpu_memory_utilization,
                          run_dir=Path(results).parent if results else None)   # the run's one compile cache
    parts = []
    for i, path in enumerate(policies):
        if i:
            engine.load_policy(llm, path)
        print(engine.verify_weights(llm, path, f"evaluation engine {rank}"), flush=True)
        parts.append(engine.sample_and_grade(llm, ev, rank, n))
    return parts


def main():
    policies = [p.strip() for p in policy.split(",") if p.strip()]
    for path in policies:               # one line, not vLLM's traceback at the engine's start
        common.check_lengths(path, max_prompt_tokens, max_response_tokens)
    configs = {p: json.loads((Path(p) / "config.json").read_text()) for p in policies if Path(p).is_dir()}
    shapes = {json.dumps({k: c.get(k) for k in ("architectures", "vocab_size", "hidden_size", "num_hidden_layers")})
              for c in configs.values()}
    if len(shapes) > 1:
        sys.exit(f"--policy lists checkpoints of different models ({len(shapes)} shapes): one engine reloads the "
                 f"weights of one architecture; evaluate them separately")
    names = [b.strip() for b in benchmarks.split(",") if b.strip()]
    ev = evaluation(engine.benchmark_sets(names, data_dir, max_problems))
    n = engines or engine.n_engines(gpus, tensor_parallel)          # this node's engines
    first, total = node_rank * n, nnodes * n                        # their index among every node's
    if worker_rank >= 0:             # an engine subprocess: its share of every benchmark, to a file
        common.atomic_write_json(Path(parts_dir) / f"part_{first + worker_rank}.json",
                                 sample_and_grade(policies, ev, first + worker_rank, total))
        return
    import nodes
    cluster = nodes.from_args(dict(nnodes=nnodes, node_rank=node_rank, coordinator=coordinator))
    if cluster is not None and not results:
        sys.exit("--nnodes > 1 needs --results: the nodes' samples meet beside it")
    t0 = time.perf_counter()
    if total > 1:
        shared = Path(results).parent / ".nodes" / f"eval_stage_{stage}" if cluster is not None else None
        if cluster is not None:          # a killed evaluation's samples are not read: node 0 clears them first
            if node_rank == 0:
                shutil.rmtree(shared, ignore_errors=True)
            cluster.barrier(f"eval_{stage}/cleared")
        with tempfile.TemporaryDirectory() if shared is None else contextlib.nullcontext(shared) as tmp:
            Path(tmp).mkdir(parents=True, exist_ok=True)
            if n > 1:
                codes = engine.run_engine_workers(__file__, [*sys.argv[1:], f"--parts_dir={tmp}"], n, tensor_parallel)
                if any(codes):
                    sys.exit(f"evaluation engines failed with exit codes {codes}")
            else:
                common.atomic_write_json(Path(tmp) / f"part_{first}.json", sample_and_grade(policies, ev, first, total))
            if cluster is not None:
                cluster.barrier(f"eval_{stage}/sampled")
                if node_rank > 0:                    # node 0 scores every node's samples
                    cluster.barrier(f"eval_{stage}/scored")
                    print(f"node {node_rank}: its {n} engine(s)' samples handed to node 0")
                    return
                common.wait_visible([Path(tmp) / f"part_{r}.json" for r in range(total)])
            per_rank = engine.read_parts(tmp, total)
            parts = [[x for part in per_rank for x in part[i]] for i in range(len(policies))]
    else:
        parts = sample_and_grade(policies, ev, 0, 1)
    seconds = (time.perf_counter() - t0) / len(policies)
    out_rows = []
    for path, samples in zip(policies, parts):
        if len(policies) == 1:
            sample_dir = Path(samples_dir) if samples_dir else (
                Path(results).parent / "eval_samples" / f"stage_{stage}" if results else None)
        else:
            sample_dir = (Path(samples_dir) if samples_dir else Path(path).parent / "eval_samples") / Path(path).name
        labels = {"stage": stage, "updates": common.policy_record(path).get("run_updates", 0),
                  "hours": (time.time() - run_start) / 3600 if run_start else 0.0, "policy": str(path),
                  "seconds": seconds, "engines": total}
        rows = engine.score(samples, ev, labels, sample_dir)
        for r in rows:
            label = f"{path} {r['benchmark']}" if len(policies) > 1 else r["benchmark"]
            print(f"{label}: avg@{r['k']} {r['avg_at_k']:.4f}  pass@{r['k']} {r['pass_at_k']:.4f}  ({r['problems']} problems)",
                  flush=True)
        out_rows += rows
    if results:       # rows are keyed on (stage, benchmark, policy): a rerun on a subset keeps the others
        engine.update_results(results, out_rows)
    mean = sum(r["avg_at_k"] for r in out_rows) / max(1, len(out_rows))
    print(f"average avg@k over {len(out_rows)} rows: {mean:.4f} ({total} engine(s), {seconds:.1f} s per policy)")
    if cluster is not None:
        shutil.rmtree(shared)
        cluster.barrier(f"eval_{stage}/scored")


if __name__ == "__main__":
    main()
