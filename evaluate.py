"""Evaluate a policy on math benchmarks: avg@k and pass@k with vLLM, graded by reward.py.

    python evaluate.py --policy=runs/toy/stage_0/policy --benchmarks=toy --data_dir=data/toy \\
        --results=runs/toy/results.jsonl --stage=0
    python evaluate.py --policy=runs/x/policy_u00032,runs/x/policy_u00064 ...   # a curve:
                                                                                # one engine

A comma list of policies (checkpoints of one model, e.g. optimize.py's --save_policy_every) is
evaluated by one engine that reloads the weights in place between them (no new engine per
checkpoint); each gets its rows, labelled with the updates recorded in its policy_id.json, and its
samples go beside it, to <policy>/../eval_samples/<policy name>/.

avg@k is the mean accuracy over k samples per problem; pass@k the share of problems with at least
one correct sample among the k. All benchmarks go to the engines in one call, one data-parallel
engine per GPU. One row per benchmark is written to the results table (replacing the row of the same
stage and benchmark, so a rerun after a crash does not duplicate it), and the graded samples go to
<samples_dir>/<benchmark>.jsonl. Benchmarks missing from data_dir are fetched with data/prepare.py.
On several nodes (run_stages.sh NNODES > 1) every node runs this script for its engines, each
sampling the prompts of its engines' indices counted over all nodes; node 0 scores them all and
writes the rows.
"""
import json
import sys
import time
from pathlib import Path

from mu_grpo import benchmarks as B     # (`benchmarks` is this script's flag)
from mu_grpo import common, engine, grading, model_cards, nodes, processes, records

# ----------------------------------------------------------------------------- hyperparameters
# the policies and the benchmarks
policy = "data/toy/model"       # HF checkpoint directory, or a comma list of checkpoints of one
                                # model
benchmarks = "amc23,amc24,aime24,aime25,math500"   # comma list; also gsm8k, minerva_math,
                                                   # olympiadbench
data_dir = "data/benchmarks"    # <benchmark>.jsonl files (id, problem, answer, source)
max_problems = 0                # 0: all problems of each benchmark

# the protocol: sampling and grading (benchmarks.Evaluation)
k = 4                           # samples per problem (paper: avg@4)
k_per_benchmark = ""            # e.g. "aime24:32,aime25:32": another k for small, noisy benchmarks
temperature = 1.0               # paper protocol: temperature 1.0, top_p 0.7
top_p = 0.7
max_prompt_tokens = 1536
max_response_tokens = 2560
prompt_template = model_cards.PROMPT_TEMPLATE
chat_template = True
seed = 0                        # the sampling seed of every evaluation (generate.py's engines' too:
                                # its --eval_args)
grader_workers = 4
grader_timeout_s = 10.0

# the results table and its rows' labels
results = ""                    # results table (JSONL) to update; empty: print only
cache = ""                      # a directory of kept evaluations: one policy's rows and samples are
                                # taken from it when it holds this policy under this protocol
                                # (benchmarks.evaluation_key), else evaluated and kept there
                                # (run_stages.sh EVAL_CACHE: runs from one initial policy evaluate
                                # it once)
samples_dir = ""                # graded samples go here (default: next to the results table)
stage = -1                      # labels for the results row: stage index (-1: the initial policy)
skip_evaluated = False          # true: one policy whose stage the results table holds under this
                                # protocol is not evaluated again (run_stages.sh: a resumed run's
                                # evaluation phase)
run_start = 0.0                 # unix time the run started (for hours since start; 0: now)

# engines
gpus = -1                       # GPUs to use: one data-parallel engine per tensor_parallel of them
                                # (-1: all; 0: CPU)
tensor_parallel = 1
gpu_memory_utilization = 0.85
engines = 0                     # data-parallel engines (0: gpus // tensor_parallel; 1 on CPU)
worker_rank = -1                # internal: set for the per-GPU engine subprocesses
parts_dir = ""                  # internal: where the subprocesses leave their graded samples

# several nodes (run_stages.sh NNODES > 1)
nnodes = 1                      # nodes evaluating side by side (run_stages.sh NNODES), this one's
                                # rank, and node 0's
node_rank = 0                   # store ("addr:port", mu_grpo/nodes.py); their graded samples meet
                                # beside the results table
store = ""
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])


def evaluation():
    """This command line's evaluation protocol (benchmarks.protocol)."""
    return B.protocol(benchmarks, data_dir, k, k_per_benchmark, max_problems,
                      temperature=temperature, top_p=top_p, max_prompt_tokens=max_prompt_tokens,
                      max_response_tokens=max_response_tokens, prompt_template=prompt_template,
                      chat_template=chat_template, seed=seed, grader_workers=grader_workers,
                      grader_timeout_s=grader_timeout_s)


def sample_and_grade(policies, ev, rank, n):
    """For each policy, its graded samples of every benchmark's prompts at positions ≡ rank (mod n),
    and when the sampling started (the engine built). The engine is built once; the next policy's
    weights are loaded into it in place (engine.load_policy)."""
    grading.start_graders(grader_workers)  # their start-up runs beside the engine's
    llm = engine.make_llm(policies[0], seed=seed,
                          max_model_len=max_prompt_tokens + max_response_tokens,
                          tensor_parallel=tensor_parallel,
                          gpu_memory_utilization=gpu_memory_utilization,
                          # the run's one compile cache
                          run_dir=Path(results).parent if results else None)
    parts, start = [], time.time()
    for i, path in enumerate(policies):
        if i:
            engine.load_policy(llm, path)
        print(engine.verify_weights(llm, path, f"evaluation engine {rank}"), flush=True)
        parts.append(B.sample_and_grade(llm, ev, rank, n))
    return parts, start


def write_part(directory, policies, ev, rank, total):
    """Engine `rank`'s share (of `total` engines), sampled, graded and left in directory
    (benchmarks.write_part)."""
    parts, start = sample_and_grade(policies, ev, rank, total)
    B.write_part(directory, rank, parts, start, time.time())


def score_policies(ev, policies, parts, seconds, engines):
    """Each policy's rows and sample files (benchmarks.policy_rows), written into the results table
    when there is one; returns the rows."""
    out_rows = []
    for path, samples in zip(policies, parts):
        labels = {"stage": stage, "updates": common.policy_record(path).get("run_updates", 0),
                  "hours": B.hours_since(run_start), "policy": str(path), "seconds": seconds,
                  "engines": engines}
        out_rows += B.policy_rows(samples, ev, labels,
                                  sample_dir=sample_dir_of(path, len(policies)),
                                  say=f"{path} " if len(policies) > 1 else "")
    # rows are keyed on (stage, benchmark, policy): a rerun on a subset keeps the others
    if results:
        B.update_results(results, out_rows)
    return out_rows


def engines_here():
    """This node's engines, the index of its first among every node's, and every node's together."""
    n = engines or engine.n_engines(gpus, tensor_parallel)
    return n, node_rank * n, nnodes * n


def sample_dir_of(path, n_policies):
    """Where a policy's graded samples go: samples_dir, else beside the results table (one policy)
    or beside the policy (a comma list)."""
    if n_policies == 1:
        return Path(samples_dir) if samples_dir else (
            B.stage_samples_dir(results, stage) if results else None)
    return (Path(samples_dir) if samples_dir else Path(path).parent
            / records.EVAL_SAMPLES) / Path(path).name


def evaluate_once(ev, path):
    """One policy's rows from the cache when it holds this policy under this protocol, else
    evaluated here and kept there. Its lock is held meanwhile, so runs that start together evaluate
    the policy once (the others wait for the first, then reuse its rows)."""
    key = B.evaluation_key(ev, path)
    entry = B.cache_entry(cache, key)
    with common.exclusive(entry.with_name(f"{key}.lock")):
        if not entry.exists():
            rows = evaluate(ev, [path])
            B.keep(entry, rows, sample_dir_of(path, 1))
            print(f"kept for later runs: {entry}")
            return
        rows = B.reuse(entry, results, stage=stage,
                       updates=common.policy_record(path).get("run_updates", 0), policy=path,
                       run_start=run_start, sample_dir=sample_dir_of(path, 1))
    for r in rows:
        print(f"{r['benchmark']}: avg@{r['k']} {r['avg_at_k']:.4f}  pass@{r['k']} "
              f"{r['pass_at_k']:.4f}  ({r['problems']} problems), reused: {entry}")


def main():
    policies = [p.strip() for p in policy.split(",") if p.strip()]
    for path in policies:               # one line, not vLLM's traceback at the engine's start
        if Path(path).is_dir() or common.looks_local(path):      # (a hub name: vLLM fetches it)
            common.require_policy(path)
        common.check_lengths(path, max_prompt_tokens, max_response_tokens)
    configs = {p: json.loads((Path(p) / "config.json").read_text()) for p in policies
               if Path(p).is_dir()}
    shapes = {json.dumps({k: c.get(k) for k in ("architectures", "vocab_size", "hidden_size",
                                                "num_hidden_layers")})
              for c in configs.values()}
    if len(shapes) > 1:
        sys.exit(f"--policy lists checkpoints of different models ({len(shapes)} shapes): one "
                 "engine reloads the weights of one architecture; evaluate them separately")
    ev = evaluation()
    skip = skip_evaluated and results and len(policies) == 1 and worker_rank < 0
    if skip and nodes.from_args(dict(nnodes=nnodes, node_rank=node_rank, store=store)).share(
            f"eval_{stage}/evaluated",        # node 0's word (another's view may lag)
            B.evaluated(results, stage, ev) if node_rank == 0 else None) == "True":
        print(f"stage {stage}: {results} holds its evaluation under this protocol already")
        return
    if worker_rank >= 0:             # an engine subprocess: its share of every benchmark, to a file
        _, first, total = engines_here()
        write_part(parts_dir, policies, ev, first + worker_rank, total)
        return
    if not cache:
        evaluate(ev, policies)
    elif len(policies) > 1 or nnodes > 1 or not results:
        sys.exit("--cache reuses one policy's evaluation on one node, into a results table: give "
                 "one --policy, --nnodes=1 and --results")
    else:
        evaluate_once(ev, policies[0])


def evaluate(ev, policies):
    """Sample and grade every policy on this node's engines (on several nodes node 0 scores them
    all), write the rows and samples; returns the rows (node 0's; [] on the others)."""
    n, first, total = engines_here()
    cluster = nodes.from_args(dict(nnodes=nnodes, node_rank=node_rank, store=store))
    if nnodes > 1 and not results:
        sys.exit("--nnodes > 1 needs --results: the nodes' samples meet beside it")
    t0 = time.perf_counter()
    # the engines' samples meet in a directory: on several nodes one beside the results table
    if total > 1:
        with cluster.meeting_dir(Path(results).parent / ".nodes" / f"eval_stage_{stage}",
                                 f"eval_{stage}") as tmp:
            if n > 1:
                codes = processes.run_workers(__file__, [*sys.argv[1:], f"--parts_dir={tmp}"],
                                              engine.worker_environments(n, tensor_parallel))
                if any(codes):
                    sys.exit(f"evaluation engines failed with exit codes {codes}")
            else:
                write_part(tmp, policies, ev, first, total)
            cluster.barrier(f"eval_{stage}/sampled")
            if cluster.rank > 0:                    # node 0 scores every node's samples
                cluster.barrier(f"eval_{stage}/scored")
                print(f"node {node_rank}: its {n} engine(s)' samples handed to node 0")
                return []
            # one node: there already
            common.wait_visible([B.part_path(tmp, r) for r in range(total)])
            parts = B.merge_parts(tmp, total)[0]
    else:
        parts = sample_and_grade(policies, ev, 0, 1)[0]
    seconds = (time.perf_counter() - t0) / len(policies)
    out_rows = score_policies(ev, policies, parts, seconds, total)
    mean = sum(r["avg_at_k"] for r in out_rows) / max(1, len(out_rows))
    print(f"average avg@k over {len(out_rows)} rows: {mean:.4f} ({total} engine(s), {seconds:.1f} "
          "s per policy)")
    cluster.barrier(f"eval_{stage}/scored")
    return out_rows


if __name__ == "__main__":
    main()
