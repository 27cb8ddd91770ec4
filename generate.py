"""Generate one stage's rollouts: vLLM samples G responses per prompt with the frozen stage policy,
reward.py grades them, and JSONL shards with behavior log-probs and advantages go to disk.

    python generate.py --policy=data/toy/model --data=data/toy/train.jsonl --run_dir=runs/toy \\
        --stage=0

Output (docs/design.md §3): <run_dir>/stage_<s>/rollouts/shard_<k>.jsonl, one line per response,
each shard written atomically; manifest.json last (its presence means the stage is complete).
Rerunning the same command after a crash keeps the finished shards and produces the rest,
identically (every prompt has its own sampling seed). On a multi-GPU box one engine runs per GPU
group (data parallel), each on its own shards; --tensor_parallel shards one engine across GPUs for
models too big for one. On several nodes (run_stages.sh NNODES > 1) every node runs this script for
its engines: shard k goes to engine k mod (nodes × engines) counted over all of them, node 0 writes
the plan and, once every node's shards are in, the manifest.

Evaluations (--evaluate, --results): the engines that generate stage s first evaluate their policy
(the one trained on stage s − 1, the initial one at stage 0) when the stage's plan says so
(stage_rules.StagePlan.stage), every benchmark's prompts shared among them as
evaluate.py shares them, so that a run starts no engine for it; node 0 scores it into the results
table (its rows and samples as evaluate.py writes them) and the timeline (an eval row, a part of the
generate phase's). The run's last policy has no next stage: run_stages.sh evaluates it with
evaluate.py.

Resident mode (--resident=true, run_stages.sh RESIDENT=true): the engines are built once and
generate every stage from --stage on, each with the policy the trainer process (optimize.py
--resident) hands over (mu_grpo/handoff.py), loaded in place; between stages they sleep (GPU). The
trainer plans the stages: each policy it hands over says how many prompts the stage it generates has
(0: it is the run's last policy) and whether it is evaluated first. Both modes generate each stage
through one loop (generate_stages): the same shards, manifest, seeds and evaluations (the last
policy's too).
"""
import contextlib
import functools
import itertools
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from mu_grpo import (benchmarks, common, engine, grading, model_cards, nodes, processes, records,
                     rollouts, sampling, stage_rules)
from mu_grpo.resident_engines import EngineSide

# ----------------------------------------------------------------------------- hyperparameters
# the stage: its policy, prompts and outputs
policy = "data/toy/model"       # HF checkpoint directory of the stage policy (resident: of the
                                # first stage)
data = "data/toy/train.jsonl"   # prepared problems: JSONL with id, problem, answer, source
run_dir = "runs/toy"            # stage s writes <run_dir>/stage_<s>/rollouts/
stage = 0                       # stage index: its prompts follow the previous stage's in the seeded
                                # order
prompts_per_stage = 64          # P (paper: 65,536 = 1024 updates × 64 prompts); may differ from
                                # stage to stage (resident: the first stage's; the trainer sets the
                                # others')

# sampling
group_size = 8                  # G responses per prompt
temperature = 1.0               # sampling temperature (the trainer uses the same one)
top_p = 1.0                     # must stay 1 and top_k 0: truncated sampling renormalizes the
                                # engine's
top_k = 0                       # log-probs over the kept tokens, the trainer's full softmax does
                                # not
max_prompt_tokens = 1536        # longer prompts are skipped and counted, never truncated
max_response_tokens = 2560
prompt_template = model_cards.PROMPT_TEMPLATE   # {problem} is replaced; the chat template follows
chat_template = True            # wrap in the tokenizer's chat template when it has one
seed = 0                        # prompt order and sampling seeds
per_request_seed = True         # each prompt's own sampling seed (common.sample_seed): a response
                                # is the same whichever engine, shard or resumed attempt generates
                                # it. False: the engine's seed alone (responses then depend on the
                                # batch: a resumed or re-sharded stage differs, and the stage's plan
                                # records it). Kept on until a GPU measures its cost: vLLM's V1
                                # sampler draws seeded rows one at a time
                                # (vllm/v1/sample/ops/topk_topp_sampler.py random_sample); its V2
                                # runner, 0.32's default on a GPU, reads every row's seed in one
                                # kernel (vllm/v1/worker/gpu/sample/gumbel.py), where a seed only
                                # rules out FlashInfer's top-k/top-p sampler
                                # (gpu/sample/sampler.py), which these rollouts (top_p=1, processed
                                # log-probs) never use

# rewards and advantages (reward.py, loss.py)
grader_workers = 0              # grading.grade_batch processes per engine (0: the CPUs left over by
                                # the engines)
grader_timeout_s = 10.0         # per response
format_bonus = 0.0              # reward for a boxed but wrong answer
normalize_std = True            # advantages (r − mean) / std; False: Dr. GRPO (r − mean)

# shards and engines
shard_prompts = 4096            # prompts per shard: the unit of resume
gpus = -1                       # GPUs to use (-1: all of CUDA_VISIBLE_DEVICES; 0: CPU)
engines = 0                     # data-parallel vLLM engines; 0: gpus // tensor_parallel (1 on CPU)
tensor_parallel = 1             # GPUs per engine
gpu_memory_utilization = 0.85   # of each GPU (resident mode on a GPU: leave the trainer's resident
                                # state room)
worker_rank = -1                # internal: set for the per-GPU engine subprocesses

# resident mode (run_stages.sh RESIDENT=true)
resident = False                # keep the engines for the stages from --stage on (policies from
                                # optimize.py --resident)
policy_handoff = "transfer"     # resident: how each policy arrives: transfer (vLLM's
                                # weight-transfer API, mu_grpo/transfer.py)
                                # | files (a policy directory, loaded with reload_weights);
                                # optimize.py's the same

# the evaluations these engines make before the stage they generate (resident: and after the last)
evaluate = False                # evaluate the policy first (the stage's plan decides: run_stages.sh
                                # passes it; resident, the first stage's, then each handed-over
                                # policy's), unless the results table holds it already
eval_args = ""                  # the evaluation protocol: evaluate.py's flags over its block, the
                                # protocol's one home (--benchmarks, --data_dir, --k, --temperature,
                                # --top_p, --seed: its seed, not the run's), sampled with this
                                # script's prompt settings and written to --results
results = ""
run_start = 0.0
eval_parts = ""                 # internal: where the per-GPU engine subprocesses leave their shares
                                # of the evaluation

# several nodes (run_stages.sh NNODES > 1)
nnodes = 1                      # nodes generating this stage side by side (run_stages.sh NNODES),
                                # each with its
node_rank = 0                   # engines; this one's rank, and node 0's store ("addr:port",
                                # mu_grpo/nodes.py) where they
store = ""                      # meet
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])
if group_size < 2:
    sys.exit("--group_size must be >= 2 (advantages are normalized within a group)")
if top_p < 1.0 or top_k > 0:
    sys.exit(f"--top_p={top_p} --top_k={top_k}: truncated sampling is refused for training "
             "rollouts. vLLM's log-probs are then renormalized over the kept tokens while "
             "optimize.py's full softmax is not, so the ratios would start away from 1 "
             "(evaluate.py may truncate freely); use top_p=1, top_k=0")
if policy_handoff not in ("transfer", "files"):
    sys.exit(f"--policy_handoff={policy_handoff!r}: transfer or files")
if resident and nnodes > 1:
    sys.exit("--resident=true runs on one node (its hand-off goes through one machine's /dev/shm); "
             "on several nodes run the process-per-phase loop (run_stages.sh RESIDENT=false)")
n_engines = engines or engine.n_engines(gpus, tensor_parallel)     # this node's
all_engines = nnodes * n_engines                                    # every node's (the same count
                                                                    # on each: mu_grpo/nodes.py
                                                                    # join)
is_engine_worker = worker_rank >= 0                                 # one of the per-GPU engine
                                                                    # processes the main process
                                                                    # (run_stages.sh's) starts
graders = grader_workers or max(1, ((os.cpu_count() or 2) - n_engines) // n_engines)


def engine_index():
    """This process's engine among every node's (its shards' stats record it)."""
    return node_rank * n_engines + max(worker_rank, 0)


def rollouts_dir(s):
    return records.stage_dir(run_dir, s) / records.ROLLOUTS


def shard_count(prompts):
    """How many shards a stage of `prompts` prompts is cut into: one per shard_prompts prompts, and
    at least one per engine, so that every engine has work when there are prompts for it (a GRPO μ =
    4 stage of 256 prompts on 4 engines: 4 shards of 64, not one shard of 256 that one engine
    generates while three wait)."""
    return max(math.ceil(prompts / shard_prompts), min(all_engines, prompts))


def prompt_offset(s):
    """Where stage s's prompts start in the seeded order of the training set: right after the
    previous stage's, as its plan records them (stages of different sizes stay disjoint); s · P when
    there is no such record (stage 0, or a stage generated alone)."""
    previous = rollouts_dir(s - 1) / records.PLAN
    plan = json.loads(previous.read_text()) if s > 0 and previous.exists() else {}
    if "prompt_offset" in plan:
        return plan["prompt_offset"] + plan["prompts_per_stage"]
    return s * prompts_per_stage


def plan_of(s, label, prompts):
    return {"policy": label, "data": data, "stage": s, "prompt_offset": prompt_offset(s),
            "prompts_per_stage": prompts, "group_size": group_size,
            "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "max_prompt_tokens": max_prompt_tokens, "max_response_tokens": max_response_tokens,
            "prompt_template": prompt_template, "chat_template": chat_template, "seed": seed,
            "shard_prompts": shard_prompts, "shards": shard_count(prompts),
            # the default is absent: older plans match
            "normalize_std": normalize_std, "format_bonus": format_bonus,
            **({} if per_request_seed else {"per_request_seed": False})}


def stage_shards(s, problems, prompts):
    """{shard k: (positions in the stage, problem rows)} of stage s's `prompts` prompts:
    shard_count() shards of equal size (the last one smaller). Every prompt has its own sampling
    seed, so a response is the same whichever engine and shard generate it."""
    stage_rows = stage_rules.shuffled_window(problems, prompt_offset(s), prompts, seed)
    size = math.ceil(len(stage_rows) / shard_count(prompts))
    return {k: (list(range(i, min(i + size, len(stage_rows)))), stage_rows[i:i + size])
            for k, i in enumerate(range(0, len(stage_rows), size))}


def engine_shards(shards, rank, s):
    """The shards of stage s that this node's engine `rank` generates and has not yet written: shard
    k goes to engine k mod all_engines, counting this node's engines from node_rank × n_engines (a
    rule every engine process applies alone to the same stage, so no two take one shard)."""
    return [k for k in shards if k % all_engines == node_rank * n_engines + rank
            and not rollouts.shard_done(rollouts_dir(s), k)]


def prepare_stage(s, label, prompts):
    """The main process, before it writes stage s's manifest: refuse other settings than the stage
    was started with, record its plan (the manifest copies it), check the disk. (A killed run's
    half-written files are removed before any engine starts: remove_temporaries.)"""
    out = rollouts_dir(s)
    out.mkdir(parents=True, exist_ok=True)
    plan_file, plan = out / records.PLAN, plan_of(s, label, prompts)
    if plan_file.exists():
        old = json.loads(plan_file.read_text())
        diff = {k: (old.get(k), v) for k, v in plan.items() if old.get(k) != v}
        if diff:
            sys.exit(f"{out} was started with other settings {diff}; rerun with the same flags "
                     "(and ENGINES, which sets the shard count of a stage smaller than ENGINES × "
                     "SHARD_PROMPTS) or delete the directory")
    else:
        common.atomic_write_json(plan_file, plan)
    # what the stage will write, estimated: half the response limit per response at ~40 bytes per
    # token (JSONL ids, log-probs and text, ~30; binary columns, 8)
    common.require_free_disk(out, prompts * group_size * max_response_tokens // 2 * 40,
                             f"the stage's rollouts ({prompts} prompts × G={group_size})")


def remove_temporaries(first):
    """Delete a killed run's half-written files in the rollouts of the stages from `first` on that
    it started, before any engine process starts (this process is then the only writer;
    run_stages.sh holds the run's lock)."""
    for s in itertools.takewhile(lambda s: rollouts_dir(s).is_dir(), itertools.count(first)):
        rollouts.remove_temporaries(rollouts_dir(s))


def shard_job(s, label, prompts):
    """This engine's part of stage s (`prompts` prompts, sampled by the policy `label`) as
    mu_grpo/sampling.py takes it: the stage's plan, as prepare_stage records it."""
    return sampling.Job(plan_of(s, label, prompts), rollouts_dir(s), engine_index(), graders,
                        grader_timeout_s, progress_bar=not is_engine_worker)


def start_engine(path, s):
    """This process's vLLM engine on the policy at `path` (to generate stage s), its weights
    verified (engine.verify_weights), its grading processes, and a two-token warm-up (on a GPU the
    first request with log-probs compiles vLLM's token-rank kernel, vllm/v1/sample/ops/logprobs.py
    `batched_count_greater_than`; a CPU counts eagerly, engine.eager_rank_count), so start-up pays
    it, not the first shard's tokens/s."""
    from vllm import SamplingParams  # vLLM: only in a process that runs an engine
    # their imports run beside the engine's start-up, not in the first grading
    grading.start_graders(graders)
    llm = engine.make_llm(path, seed=seed, max_model_len=max_prompt_tokens + max_response_tokens,
                          tensor_parallel=tensor_parallel,
                          gpu_memory_utilization=gpu_memory_utilization, sleep_mode=resident,
                          run_dir=run_dir,      # one compile cache for the run's engines
                          transfer_engine=engine_index() if resident
                          and policy_handoff == "transfer" else None)
    print(engine.verify_weights(llm, path, f"engine {engine_index()}, stage {s}"), flush=True)
    llm.generate([{"prompt_token_ids": [0]}],
                 SamplingParams(max_tokens=2, logprobs=0, flat_logprobs=True,
                                                             detokenize=False), use_tqdm=False)
    return llm


def write_manifest(s, label, shard_ids, policy_id=None):
    """Stage s's manifest.json, written last once every shard is: sampling parameters, the plan
    prepare_stage recorded, counts and summary statistics of the shards (policy_id: the fingerprint
    of the policy that generated them, default its directory's). Returns it."""
    missing = [k for k in shard_ids if not rollouts.shard_done(rollouts_dir(s), k)]
    if missing:
        sys.exit(f"stage {s}: shards {missing} were not produced; rerun to resume")
    stats = [json.loads(rollouts.stats_path(rollouts_dir(s), k).read_text()) for k in shard_ids]
    if sum(st["responses"] for st in stats) == 0:
        sys.exit(f"stage {s}: every prompt was longer than --max_prompt_tokens={max_prompt_tokens} "
                 f"(after the template); raise it or shorten --prompt_template")
    plan = json.loads((rollouts_dir(s) / records.PLAN).read_text())
    manifest = {
        "complete": True, "stage": s, "policy": label,
        "policy_id": policy_id or common.policy_fingerprint(label),
        "sampling": {"n": group_size, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                     "max_tokens": max_response_tokens, "seed": seed,
                     "per_request_seed": per_request_seed, "logprobs_mode": "processed_logprobs"},
        "plan": plan,
        "shards": [rollouts.shard_path(rollouts_dir(s), st["shard"]).name for st in stats],
        **rollouts.stage_summary(stats, plan)}
    common.atomic_write_json(rollouts_dir(s) / records.MANIFEST, manifest)
    m = manifest
    print(f"stage {s} rollouts: {m['responses']} responses, mean reward {m['mean_reward']:.3f}, "
          f"all-correct groups {m['frac_groups_all_correct']:.2f}, all-wrong "
          f"{m['frac_groups_all_wrong']:.2f}, mean length {m['mean_response_tokens']:.0f} (max "
          f"{m['max_response_tokens']}), truncated {m['truncation_rate']:.3f}, skipped prompts "
          f"{m['skipped_long_prompts']}, {m['generated_tokens_per_s']:.0f} tokens/s → "
          f"{rollouts_dir(s)}",
          flush=True)
    return manifest


def first_pending_stage():
    """The first stage from --stage on without a complete manifest."""
    return next(s for s in itertools.count(stage)
                if not (rollouts_dir(s) / records.MANIFEST).exists())


# ----------------------------------------------------------------------------- the evaluations


@functools.cache
def evaluation():
    """These engines' evaluations' protocol: evaluate.py's block with eval_args over it
    (benchmarks.protocol), this script's prompt settings and graders."""
    p = common.script_defaults(Path(__file__).with_name("evaluate.py"))
    common.apply_overrides(p, shlex.split(eval_args))
    return benchmarks.protocol(p["benchmarks"], p["data_dir"], p["k"], p["k_per_benchmark"],
                               p["max_problems"], temperature=p["temperature"], top_p=p["top_p"],
                               max_prompt_tokens=max_prompt_tokens,
                               max_response_tokens=max_response_tokens,
                               prompt_template=prompt_template, chat_template=chat_template,
                               seed=p["seed"], grader_workers=graders,
                               grader_timeout_s=grader_timeout_s)


def sample_evaluation(llm, ev, parts):
    """This engine's share of an evaluation, left in `parts` for the process that scores it."""
    t0 = time.time()
    benchmarks.write_part(parts, engine_index(),
                          [benchmarks.sample_and_grade(llm, ev, engine_index(), all_engines)], t0,
                          time.time())


def score_evaluation(ev, t, label, updates, parts):
    """Every engine's share of the evaluation of the policy trained on stage t (`label`, trained for
    the run's `updates`), merged and scored: its rows and sample files as evaluate.py writes them
    (seconds: the engines' sampling, the first start to the last end). Returns its timeline row:
    that span and the scoring's own seconds, not the time between them (per phase the engines
    generate the stage's shards before it is scored)."""
    # the other nodes' too
    common.wait_visible([benchmarks.part_path(parts, r) for r in range(all_engines)])
    (samples,), start, end = benchmarks.merge_parts(parts, all_engines)
    t0 = time.time()
    labels = {"stage": t, "updates": updates, "hours": benchmarks.hours_since(run_start),
              "policy": label, "seconds": end - start, "engines": all_engines}
    benchmarks.update_results(results, benchmarks.policy_rows(
        samples, ev, labels, sample_dir=benchmarks.stage_samples_dir(results, t),
        say=f"stage {t} "))
    return {"phase": "eval", "name": f"eval_{t}", "stage": t, "start": start,
            "end": end + time.time() - t0}


def evaluation_due(cluster, s, flag):
    """Whether the engines evaluate the policy of `flag` (trained on stage s − 1) before stage s:
    when the stage's plan says so (the flag's evaluate: run_stages.sh's --evaluate, or the trainer's
    hand-over) and the results table lacks it. Node 0's answer, shared (a resumed stage does not
    redo it), which a per-phase engine process is given (--eval_parts); resident engines read the
    table alone (its rows of s − 1 are written once every engine sampled it)."""
    if not (flag["evaluate"] and results):
        return False
    if is_engine_worker and not resident:
        return bool(eval_parts)
    return cluster.share(f"generate_{s}/evaluate",
                         not benchmarks.evaluated(results, s - 1, evaluation())) == "True"


# ---------------------------------------------------------------- the stages this process generates


class Engines:
    """This process's part of the stages it generates, the same steps in both modes
    (generate_stages): its own vLLM engine (none in a main process whose engines are processes of
    their own, which it coordinates), the policy each stage is generated with, and in the main
    process the run's files (each stage's plan and manifest, the evaluations' rows). Where the modes
    differ is `resident` (mu_grpo/resident_engines.py EngineSide; None per phase): per phase
    --policy generates --stage alone and a coordinator starts its engine processes for the stage;
    resident engines live for the run, each stage's policy handed over by the trainer, sleeping
    between stages."""

    def __init__(self, cluster, procs=()):
        self.cluster, self.procs, self.rank = cluster, procs, max(worker_rank, 0)
        self.has_engine = is_engine_worker or n_engines == 1
        self.node0 = not is_engine_worker and node_rank == 0        # writes the run's files
        self.first_stage, self.index, self.llm = stage, engine_index(), None
        self.resident = EngineSide(run_dir, policy_handoff, n_engines, self.rank,
                                   not is_engine_worker) if resident \
            else None

    def where(self, s):
        return f"engine {self.index}, stage {s}"

    def given(self):
        """The flag of --policy, as a handed-over policy's (handoff.Partner.publish_policy)."""
        return {"path": policy, "policy": str(policy),
                "fingerprint": common.policy_fingerprint(policy),
                "run_updates": common.policy_record(policy).get("run_updates", 0),
                "next_stage_prompts": prompts_per_stage, "evaluate": evaluate}

    def policies(self):
        """(s, the flag of its policy) of every stage this process generates: per phase --stage
        alone (none once its manifest is written), resident every stage from the first without a
        manifest, each with the policy handed over before it."""
        if self.resident:
            yield from self.resident.policies(self, first_pending_stage, start_engine)
        elif self.cluster.share(f"generate_{stage}/complete",
                                (rollouts_dir(stage) / records.MANIFEST).exists()) == "True":
            print(f"{rollouts_dir(stage)} is complete (manifest.json exists); nothing to do")
        else:
            yield stage, self.given()

    def watch_workers(self):
        for p in self.procs:
            if p.poll() not in (None, 0):
                raise SystemExit(f"an engine process failed (exit {p.returncode}); rerun to resume")

    def evaluation_parts(self, s):
        """Where the engines leave their shares of the evaluation before stage s: resident, the
        hand-off's (EngineSide); per phase a directory the nodes meet in (cluster.meeting_dir,
        beside the results table; on one node a temporary one), given to the engine processes
        (--eval_parts)."""
        if self.resident:
            return self.resident.evaluation_parts(s)
        if is_engine_worker:
            return contextlib.nullcontext(Path(eval_parts))
        return self.cluster.meeting_dir(Path(results).parent / ".nodes" / f"eval_stage_{s - 1}",
                                        f"generate_{s}/eval")

    def work(self, s, flag, ev, parts, shards):
        """This process's part of stage s: its engine's share of the evaluation (ev: when one is
        due) and its shards, then (resident) asleep; a coordinator waits for its engine processes'
        parts (per phase: started for the stage; resident: their flags)."""
        mine = engine_shards(shards, self.rank, s) if self.has_engine else []
        if self.has_engine and (ev or mine or self.resident):
            # resident: started before the first stage
            self.llm = self.llm or start_engine(flag["path"], s)
            if ev:
                sample_evaluation(self.llm, ev, parts)
            if mine:
                sampling.generate_shards(self.llm,
                                         shard_job(s, flag["policy"], flag["next_stage_prompts"]),
                                         flag["fingerprint"], mine, shards)
            if self.resident and shards:
                self.resident.asleep(self.llm, s)
        elif not self.has_engine and not self.resident:
            todo = [k for r in range(n_engines) for k in engine_shards(shards, r, s)]
            if ev or todo:
                codes = processes.run_workers(
                    __file__, [*sys.argv[1:], *([f"--eval_parts={parts}"] if ev else [])],
                    engine.worker_environments(n_engines, tensor_parallel))
                if any(codes):
                    sys.exit(f"engine processes failed with exit codes {codes}; rerun to resume")
        if self.resident and not is_engine_worker:
            self.resident.wait_for_engines(s, parts if ev else None, shards, self.watch_workers)

    def timeline(self, row):
        records.append(run_dir, row, process="engine" if resident else "generate")

    def stage_rows(self):
        """Resident: the stage's rows, every engine's and the main process's (which ends with the
        manifest)."""
        for row in self.resident.stage_rows() if self.resident else []:
            self.timeline(row)


def generate_stages(problems, engines):
    """Every stage `engines` gives this process, by the same steps in both modes: the evaluation of
    its policy when due, then (unless the policy is the run's last) the stage: node 0's main process
    prepares it, every engine generates its shards, node 0's main process writes the manifest; on
    several nodes (per phase) the nodes meet at each step (node 0 decides what the filesystem
    says)."""
    cluster = engines.cluster
    for s, flag in engines.policies():
        prompts = flag["next_stage_prompts"]
        ev = evaluation() if evaluation_due(cluster, s, flag) else None
        shards = stage_shards(s, problems, prompts) if prompts else {}
        if engines.node0 and shards:
            prepare_stage(s, flag["policy"], prompts)
            print(f"stage {s}: {prompts} prompts × G={group_size} = {prompts * group_size} "
                  f"responses in {len(shards)} shards; {nnodes} node(s) × {n_engines} engine(s) × "
                  f"TP {tensor_parallel}; temperature {temperature}, max {max_response_tokens} "
                  f"tokens{f'; the evaluation of stage {s - 1} first' if ev else ''}",
                  flush=True)
        cluster.barrier(f"generate_{s}/prepared")
        with engines.evaluation_parts(s) if ev else contextlib.nullcontext() as parts:
            engines.work(s, flag, ev, parts, shards)
            cluster.barrier(f"generate_{s}/generated")
            if engines.node0 and ev:
                engines.timeline(
                    score_evaluation(ev, s - 1, flag["policy"], flag["run_updates"], parts))
        if not shards:
            continue
        if engines.node0:
            # the other nodes' too
            common.wait_visible([rollouts.stats_path(rollouts_dir(s), k) for k in shards])
            write_manifest(s, flag["policy"], list(shards), policy_id=flag["fingerprint"])
            engines.stage_rows()
        cluster.barrier(f"generate_{s}/written")
        if not is_engine_worker:
            # node 0's (on one node: there already)
            common.wait_visible([rollouts_dir(s) / records.MANIFEST])


def main():
    # one line, not vLLM's traceback
    common.require_policy(policy)
    common.check_lengths(policy, max_prompt_tokens, max_response_tokens)
    problems = common.load_problems(data)
    cluster = nodes.OneNode() if is_engine_worker else nodes.from_args(
        dict(nnodes=nnodes, node_rank=node_rank, store=store))
    # a killed run's half-written files, before any engine process starts
    if not is_engine_worker and node_rank == 0:
        remove_temporaries(first_pending_stage())
    if not (resident and n_engines > 1 and not is_engine_worker):
        return generate_stages(problems, Engines(cluster))
    # a SIGTERM ends this process through the finally below, workers first
    processes.exit_on_sigterm()
    procs = processes.start_workers(__file__, sys.argv[1:],
                                    engine.worker_environments(n_engines, tensor_parallel))
    try:
        generate_stages(problems, Engines(cluster, procs))
        codes = [p.wait() for p in procs]
        if any(codes):
            sys.exit(f"engine processes failed with exit codes {codes}; rerun to resume")
    finally:
        processes.stop_workers(procs)


if __name__ == "__main__":
    main()
