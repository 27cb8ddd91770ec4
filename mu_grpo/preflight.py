"""Preflight: the paper run in miniature on this box, with its model, its optimize settings and all its GPUs,
checking every path that only a GPU exercises before days of compute are spent (run_stages.sh runs it first
on the paper preset; PREFLIGHT=0 skips it, PREFLIGHT=force runs on after a FAIL).

    python -m mu_grpo.preflight --policy=Qwen/Qwen2.5-Math-7B --data=data/deepscaler.jsonl --out=runs/x/preflight.json

One small stage (`prompts` × G at the preset's response length) with generate.py (the run's engines, one
process each), a few updates with optimize.py (torchrun over the run's trainer ranks, its micro-batch,
checkpointing and loss flags), a second small stage sampled by vLLM from the saved policy and read back by the
trainer from its own fp32 state, two one-update runs with and without gradient checkpointing, a tiny
evaluation (by the second stage's engines first, as a run's engines evaluate), and with --resident=true two stages handed over between the resident engine and trainer
processes. Each check prints PASS / FAIL / SKIPPED (INFO: printed, not gated) with its measured number and
threshold; preflight.json keeps them and is written whatever happens (a check that raises is that check's
FAIL). A pass is cached for the same model, code (every source file and the requirements files), installed
libraries, flash-attn (installed or not), GPU count and model, and preflight settings; any other attempt starts
from an empty work directory (its rollouts and logs are its own). The miniature's weights (a train state of 12
bytes per parameter, four policies) are deleted at the end; its logs and rollouts stay until the next attempt.
Exit status 1 after a FAIL (0 with --force=true).
"""
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from mu_grpo import common, grading, handoff, model_cards, processes, records, stage_rules
from mu_grpo import trainer_model as M
from loss import AGREEMENT_MEAN, MISMATCH_LEVELS

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- hyperparameters
# the run it checks: its model, data, GPUs and processes; the report
policy = "data/toy/model"       # the run's initial model (HF name or directory)
data = "data/toy/train.jsonl"   # the run's training problems
out = "runs/preflight.json"     # the report; the miniature run lives in <out without .json>/
gpus = -1                       # GPUs (-1: all visible; 0: CPU)
engines = 0                     # vLLM engines, one process each (0: one per GPU; 1 on a CPU): the run's ENGINES
train_ranks = 0                 # optimize.py's torchrun ranks (0: one per GPU; 1 on a CPU): the run's TRAIN_RANKS

# the disk check: room for what the run keeps
run_dir = ""                    # the run directory whose free disk is checked against what the run keeps (empty:
                                # this report's directory)
# the run's shape, for that disk estimate (run_stages.sh passes them): what the run keeps follows from these
stages = 4                      # STAGES (STAGE_END=drift: the stages come from the plan, stage_plan)
updates_per_stage = 1024        # UPDATES_PER_STAGE: μ of every stage (STAGE_END=drift: of the first)
stage_end = "fixed"             # STAGE_END: fixed | drift
total_updates = 0               # TOTAL_UPDATES, drift: the run's updates (0: stages × updates_per_stage)
drift_max_updates = 0           # DRIFT_MAX_UPDATES (0: 4 × updates_per_stage: stage_rules.StagePlan's default)
drift_min_updates = 16          # μ_min, no stage ends on drift before it (optimize.py's default; run_stages.sh passes
                                # DRIFT_ARGS's --drift_min_updates)
save_every = 1                  # SAVE_EVERY, resident: a policy and train state kept every N stages and the last (0:
                                # the last only); processes per phase keep a policy every stage
keep_train_states = False       # KEEP_TRAIN_STATES: every stage's train state kept (else the newest only)

# the miniature: its stage and updates
prompts = 32                    # prompts in the miniature stage (× group_size responses)
group_size = 8
updates = 3                     # updates of the miniature optimize run
round_trip_lr = 1e-4            # their learning rate: 3 AdamW steps of ~lr move most weights by more than a bf16
                                # step (~1e-4 at |w| ≈ 0.02), so the saved policy visibly differs from the initial

# the run's settings the miniature runs at
max_prompt_tokens = 1536        # the preset's limits
max_response_tokens = 2560
temperature = 1.0
micro_batch_tokens = 16384      # the run's micro-batch (the headroom check runs at this size)
prompt_template = model_cards.PROMPT_TEMPLATE
optimize_args = ""              # the run's optimize.py flags, space-separated (run_stages.sh passes GRAD_CKPT and
                                # the LOSS preset's flags, so M2PO's gather and KL's reference pass run here too)

# the estimates: hours per stage, MFU
estimate_stage_prompts = 65536  # prompts per stage of the real run, for the hours-per-stage estimate
peak_tflops = 989.0             # dense bf16 peak per GPU (H100/H200 SXM), for MFU

# the exit status
force = False                   # exit 0 even after a FAIL

# the resident hand-off (run_stages.sh RESIDENT=true)
resident = False                # also run the resident hand-off in miniature (run_stages.sh passes RESIDENT)
resident_gpu_memory = 0.5       # resident: each engine's share of its GPU (run_stages.sh: RESIDENT_GPU_MEMORY)
policy_handoff = "transfer"     # resident: the run's HANDOFF; a transfer that fails here falls back to files, which
                                # preflight.json records and the run then uses (mu_grpo.launch --command=handoff)

# the gates: a check FAILs above its threshold
# Gates: the mean and the 99.9th percentile of per-token |Δ log p|, never the max (printed for information).
# GPU, bf16: log-softmax is 2-Lipschitz in the largest logit difference (|Δ log p_t| ≤ 2·max_j |Δz_j|); bf16 keeps
# 8 mantissa bits, so logits of magnitude ~20 round by up to ~0.06, and the engine's and the trainer's kernels
# accumulate different rounding over 28 layers: typical tokens differ by 1e-3..1e-2 nats, rare low-probability
# ones by several. The failures these checks exist for move most tokens: a wrong temperature or checkpoint moves
# the mean by > 0.05; a fault that touches a minority of tokens (positions past some length, the end of a packed
# row seeing the row before) is diluted in the mean but puts far more than 1 token in 1000 above 1 nat (a logit
# difference > 0.5).
# Packing is checked differentially: one micro-batch packed in two orders (update.py packing_check). Both rows
# are as long, so every GEMM has the same shape, tiling and reduction order and each row rounds alike (cuBLAS gives
# bit-identical results for one shape on one GPU); the attention kernels work per sequence. A correct packing
# differs by ~0 there, while a sequence that sees its predecessors sees other ones in the other order. Not packed
# vs one sequence alone: a 16k-row and a 300-row GEMM are tiled differently, and a published measurement on
# Qwen2.5-7B moved 5.6 % of tokens by more than ~0.1 nats through a batch-shape change alone, which would fail a
# healthy box (that comparison is printed, not gated). These bounds are our reasoning, not yet calibrated on a GPU.
# CPU, fp32: the same checks at float32 noise (~1e-6 per log-prob).
agreement_mean = AGREEMENT_MEAN["cuda"]  # mean |log π_trainer − log π_engine| at update 0 (GPU 0.05; CPU fp32 1e-3:
                                # loss.AGREEMENT_MEAN, the bound optimize.py stops a stage at)
agreement_p999 = 1.0            # 99.9th percentile (GPU); CPU 1e-2 (a level of loss.MISMATCH_LEVELS)
packing_mean = 0.01             # one micro-batch packed in two orders, mean |Δ log p| (GPU); CPU 1e-5
packing_p999 = 0.25             # its 99.9th percentile (GPU); CPU 1e-4
max_truncation_rate = 0.25      # responses hitting max_response_tokens
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])
settings = {k: v for k, v in common.hyperparameters(globals()).items() if k != "force"}   # all in the cache key
n_gpus = common.gpu_count() if gpus < 0 else gpus
on_gpu = n_gpus > 0
n_engines = engines or max(1, n_gpus)
n_ranks = train_ranks or max(1, n_gpus)
if not on_gpu:
    agreement_mean, agreement_p999, packing_mean, packing_p999 = AGREEMENT_MEAN["cpu"], 1e-2, 1e-5, 1e-4
common.check_choice("stage_end", stage_end, ("fixed", "drift"))
common.check_choice("policy_handoff", policy_handoff, ("transfer", "files"))
if updates_per_stage < 1 or stages < 1:
    sys.exit(f"--updates_per_stage={updates_per_stage} --stages={stages}: a run has at least one stage of at least one "
             f"update")
if agreement_p999 not in MISMATCH_LEVELS:
    sys.exit(f"--agreement_p999={agreement_p999}: allowed values are the levels optimize.py counts, {MISMATCH_LEVELS}")
report_path = Path(out)
work = report_path.with_suffix("")            # runs/x/preflight/
HINTS = {
    "engine/trainer agreement": "check --temperature (must equal sampling's), top_p=1/top_k=0 and that the "
                                "trainer loads the engine's checkpoint; on a GPU, the bf16 kernels (vLLM version)",
    "stop tokens": "generation ran past the end of the turn: check the tokenizer's chat template and eos_token "
                   "(common.stop_token_ids, common.turn_markers)",
    "truncation": "too many responses hit max_response_tokens: raise MAX_RESPONSE or check the stop tokens",
    "packed attention": "packed sequences see each other: use --attn_implementation=varlen_sdpa or sdpa, and "
                        "report the transformers/flash-attn versions",
    "gradient checkpointing": "checkpointing does not engage: the model must run in train mode with "
                              "gradient_checkpointing_enable (transformers version?)",
    "round trip": "the saved policy is not the trained one, or the next stage did not load the train state: check "
                  "the saved dtype, tied weights, the FSDP2 gather (checkpoint.save_policy) and --init_state",
    "evaluation": "the engines' evaluation of the saved policy failed: see generate_1's log",
    "resident hand-off": "the engine and trainer processes did not hand a stage over: see logs/resident_engine.log "
                         "and logs/resident_trainer.log (on a GPU: lower RESIDENT_GPU_MEMORY if the engine cannot wake)",
    "disk": "the run directory's filesystem cannot hold what the run keeps: free space, point RUN at a larger disk, "
            "or keep fewer train states (KEEP_TRAIN_STATES=false)",
    "headroom": "peak GPU memory near the limit: lower MICRO_BATCH_TOKENS or set GRAD_CKPT=true; low MFU: check "
                "the attention implementation (flash-attn installed?) and GRAD_CKPT",
}


def run(name, cmd):
    """One phase of the miniature run, logged to <work>/logs/<name>.log; its output on failure."""
    (work / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True)
    (work / "logs" / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise PhaseError(name, failure_line(proc.stderr) or f"exit {proc.returncode}")
    return time.perf_counter() - t0


# torchrun's own log lines (glog format: level, date, time, pid, file:line]), e.g. "E1124 19:44:59.374000 27657
# .../torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 ..."
TORCHRUN_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")


def failure_line(stderr):
    """Why a phase failed: the last line of its output, or under torchrun the last line the ranks wrote before the
    launcher's own traceback (torch/distributed/elastic: `raise ChildFailedError`, then its summary table), its
    log lines left out."""
    if "ChildFailedError" in stderr:
        stderr = stderr[:stderr.rfind("Traceback (most recent call last):")]
    lines = [line for line in stderr.splitlines() if line.strip() and not TORCHRUN_LOG.match(line)]
    return lines[-1].strip() if lines else None


class PhaseError(RuntimeError):
    def __init__(self, phase, message):
        super().__init__(f"{phase} failed: {message} (see {work / 'logs' / (phase + '.log')})")
        self.phase = phase


def trainer_launcher():
    """optimize.py's launcher at the run's shape: torchrun over train_ranks ranks (the run's TRAIN_RANKS), from this
    Python's environment."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n_ranks}"] \
        if n_ranks > 1 else [sys.executable]


def optimize_cmd(stage_dir, out_dir, n_updates, *extra):
    """optimize.py as the run calls it (its micro-batch and optimize_args), then this check's own flags, which
    win (a later --key=value overrides an earlier one). The trainer's own stop on the engines' agreement is off
    here: the preflight gates the same mean (and its p99.9) and reports it as a check, with its numbers."""
    return [*trainer_launcher(), "optimize.py", f"--stage_dir={stage_dir}", f"--out={out_dir}",
            f"--micro_batch_tokens={micro_batch_tokens}", *optimize_args.split(), "--engine_mismatch_bound=0",
            f"--updates_per_stage={n_updates}",
            f"--prompts_per_update={max(1, prompts // max(1, updates))}", f"--lr={round_trip_lr}", *extra]


def engine_args(run, prompts_per_stage):
    """generate.py's settings at the run's shape (its engines, lengths, template, temperature)."""
    return [f"--data={data}", f"--run_dir={run}", f"--prompts_per_stage={prompts_per_stage}", f"--group_size={group_size}",
            f"--temperature={temperature}", f"--max_prompt_tokens={max_prompt_tokens}",
            f"--max_response_tokens={max_response_tokens}", f"--shard_prompts={prompts_per_stage}", f"--gpus={n_gpus}",
            f"--engines={n_engines}", f"--prompt_template={prompt_template}"]


def generate_cmd(model, stage):
    return [sys.executable, "generate.py", f"--policy={model}", f"--stage={stage}", *engine_args(work, prompts)]


def check(results, name, passed, value, threshold, unit=""):
    """A row of the table: passed True/False (gated), None (SKIPPED), or "info" (printed, not gated)."""
    status = "INFO" if passed == "info" else "SKIPPED" if passed is None else ("PASS" if passed else "FAIL")
    results.append({"check": name, "status": status, "value": value, "threshold": threshold, "unit": unit,
                    "hint": HINTS.get(name.split(":")[0]) if status == "FAIL" else None})


@contextlib.contextmanager
def guarded(results, name):
    """A check that raises (a figure missing from a log, a file not written) is that check's FAIL row with the
    error, and the preflight goes on to its other checks; a phase that failed (PhaseError) stops the miniature."""
    try:
        yield
    except PhaseError:
        raise
    except (Exception, SystemExit) as e:
        check(results, f"{name}: the check ran", False, f"{type(e).__name__}: {e}", "no error")


def stop_token_check(results, rows, model):
    """No response may hold a special token or a new turn's opening before its last token: generation then ran
    past the end of its turn (e.g. the template's end-of-turn token was not a stop token), and what follows
    can be an invented next turn whose answer gets graded. Looked for in the decoded text, special tokens
    kept, so a turn opening written as ordinary tokens counts too. (Added tokens that are not special, such as
    R1-distill's <think>, may appear anywhere.)"""
    from transformers import AutoTokenizer  # transformers: only for the stop-token check
    tok = AutoTokenizer.from_pretrained(model)
    markers = common.turn_markers(tok)
    texts = tok.batch_decode([r["response_token_ids"][:-1] for r in rows], skip_special_tokens=False)
    inside = [(r, next(m for m in markers if m in t)) for r, t in zip(rows, texts) if any(m in t for m in markers)]
    example = f" (e.g. {inside[0][1]!r} in prompt {inside[0][0]['prompt_id']})" if inside else ""
    check(results, "stop tokens: responses with a special token or a new turn before their end", not inside,
          f"{len(inside)}{example}" if inside else 0, 0, "responses")
    truncated = sum(r["finish_reason"] == "length" for r in rows) / max(1, len(rows))
    check(results, "truncation: rate at max_response_tokens", truncated <= max_truncation_rate, round(truncated, 4),
          max_truncation_rate)


def agreement_record(first, manifest):
    """The stage-0 agreement this box measured for this model, kept in the report whatever its checks say (the bound
    is reasoned, not measured: tools/table1.py --command=agreement reads every model's side by side): update 0's mean,
    p99.9 level and max |Δ log p| between the trainer and the engines on the same weights, the policy's entropy and
    the responses' mean length (a long high-entropy sample drifts more), and the bound the run gates on."""
    keys = ("mismatch/mean_abs_log_ratio", "mismatch/p999_at_most", "mismatch/max_abs_log_ratio", "entropy")
    return {**{k.split("/")[-1]: first.get(k) for k in keys}, "mean_response_tokens": manifest["mean_response_tokens"],
            "bound_mean": agreement_mean, "bound_p999": agreement_p999, "device": "cuda" if on_gpu else "cpu",
            "model": policy}


def agreement_checks(results, first, what):
    """Update 0's engine/trainer |Δ log p| (optimize.py's mismatch/ metrics): gated on the mean and on the share
    of tokens above the p99.9 bound (≤ 0.1 %); the max is printed."""
    check(results, f"{what}: mean |Δ log p| at update 0", first["mismatch/mean_abs_log_ratio"] <= agreement_mean,
          first["mismatch/mean_abs_log_ratio"], agreement_mean)
    over = first.get(f"mismatch/frac_over_{agreement_p999:g}")
    check(results, f"{what}: p99.9 |Δ log p| (share of tokens above the bound ≤ 0.001)",
          over is not None and over <= 1e-3, first.get("mismatch/p999_at_most"), agreement_p999)
    check(results, f"{what}: max |Δ log p| (for information)", "info", first["mismatch/max_abs_log_ratio"], "—")


def packing_checks(results, first):
    """update.py's packing_check of update 0: gated on one micro-batch packed in two orders (every rank's packs
    at least 2 sequences, or nothing was compared); packed vs one sequence alone is printed."""
    mean, p999 = first.get("check/packed_mean_abs_diff"), first.get("check/packed_p999_abs_diff")
    fewest = first.get("check/packed_sequences_min") or 0
    check(results, "packed attention: sequences per packed micro-batch compared (fewest over ranks)", fewest >= 2,
          fewest, ">= 2")
    check(results, "packed attention: mean |Δ log p| of one micro-batch packed in two orders",
          mean is not None and mean <= packing_mean, mean, packing_mean)
    check(results, "packed attention: p99.9 |Δ log p| of one micro-batch packed in two orders",
          p999 is not None and p999 <= packing_p999, p999, packing_p999)
    check(results, "packed attention: max |Δ log p| in two orders (for information)", "info",
          first.get("check/packed_max_abs_diff"), "—")
    for stat in ("mean", "p999", "max"):
        check(results, f"packed attention: {stat} |Δ log p| packed vs each sequence alone (for information)", "info",
              first.get(f"check/alone_{stat}_abs_diff"), "—")


def round_trip_checks(results, initial, saved, state_dir):
    """The saved policy is the trained one: it differs from the initial checkpoint in most elements (a save of
    stale weights does not), and equals the trainer's fp32 state cast to its dtype, bit for bit, on a sample of
    tensors (the first and the last layer's 2-D weights)."""
    import torch.distributed.checkpoint as dcp  # DCP: only the round-trip check reads a state

    saved_index, initial_index = M.safetensors_index(saved), M.safetensors_index(initial)
    layers = sorted({int(k.split(".")[2]) for k in saved_index if k.startswith("model.layers.")})
    names = [k for k in sorted(saved_index) if k.endswith(".weight") and k in initial_index
             and any(k.startswith(f"model.layers.{i}.") for i in (layers[:1] + layers[-1:]))]

    def read(index, name):
        with safe_open(str(index[name]), "pt") as f:
            return f.get_tensor(name)
    saved_t = {k: read(saved_index, k) for k in names}
    saved_t = {k: v for k, v in saved_t.items() if v.dim() == 2}
    changed = sum(int((v != read(initial_index, k).to(v.dtype)).sum()) for k, v in saved_t.items())
    total = sum(v.numel() for v in saved_t.values())
    check(results, "round trip: share of sampled weights that differ from the initial checkpoint", changed > 0.5 * total,
          round(changed / max(total, 1), 4), "> 0.5")
    state = {"model": {k: torch.empty(v.shape, dtype=torch.float32) for k, v in saved_t.items()}}
    try:
        dcp.load(state, checkpoint_id=str(state_dir))
    except Exception as e:                       # e.g. LoRA's state names its weights differently
        check(results, "round trip: saved weights equal the trainer's state", None, f"not comparable ({type(e).__name__})", "0")
        return
    worst = max(float((state["model"][k].to(v.dtype).float() - v.float()).abs().max()) for k, v in saved_t.items())
    check(results, "round trip: saved weights equal the trainer's state (max |Δ|)", worst == 0.0, worst, 0.0)


def resident_miniature(results, figures, model):
    """Resident mode in miniature with the run's hand-off (run_resident, resident_checks). A transfer that fails, in
    its run or its checks, does not stop the run: its rows become INFO, one line says so, and the miniature runs
    again with files, which the run then uses (figures["policy_handoff"], read by mu_grpo.launch --command=handoff)."""
    how, first = policy_handoff, len(results)
    try:
        run_resident(work / "resident", model, how)
        with guarded(results, "resident hand-off"):
            resident_checks(results, figures, work / "resident", how)
    except PhaseError as e:
        if how == "files":
            raise
        check(results, "resident hand-off: the transfer ran", False, str(e), "exit 0")
    failed = [r for r in results[first:] if r["status"] == "FAIL"]
    if how == "transfer" and failed:
        for r in results[first:]:
            r["status"], r["hint"] = ("INFO", None) if r["status"] == "FAIL" else (r["status"], r["hint"])
        print(f"preflight: the weight transfer failed its check ({failed[0]['check']}: {failed[0]['value']}); this "
              f"run hands its policies over as files (HANDOFF=files)", flush=True)
        how = "files"
        run_resident(work / "resident", model, how)
        with guarded(results, "resident hand-off"):
            resident_checks(results, figures, work / "resident", how)
    figures["policy_handoff"] = how


def run_resident(run_dir, model, how):
    """generate.py --resident and optimize.py --resident side by side for two stages of one update each, at the run's
    engines and ranks, the policy handed over by `how` (transfer or files); their logs go to logs/resident_engine.log
    and logs/resident_trainer.log."""
    shutil.rmtree(run_dir, ignore_errors=True)
    handoff.reset(run_dir)
    prompts_per_stage = max(1, prompts // max(1, updates))
    engine_cmd = [sys.executable, "generate.py", "--resident=true", "--stage=0", f"--policy={model}",
                  *engine_args(run_dir, prompts_per_stage), f"--gpu_memory_utilization={resident_gpu_memory}",
                  f"--policy_handoff={how}"]
    trainer_cmd = [*trainer_launcher(), "optimize.py", "--resident=true", f"--run_dir={run_dir}", "--stages=2", f"--policy={model}",
                   f"--micro_batch_tokens={micro_batch_tokens}", *optimize_args.split(), "--updates_per_stage=1",
                   f"--prompts_per_update={prompts_per_stage}", f"--lr={round_trip_lr}", f"--policy_handoff={how}",
                   f"--engines={n_engines}"]
    (work / "logs").mkdir(parents=True, exist_ok=True)
    logs = {role: work / "logs" / f"resident_{role}.log" for role in ("engine", "trainer")}
    for path in logs.values():
        path.write_text("")
    _, codes = processes.run_together({"engine": [str(c) for c in engine_cmd], "trainer": [str(c) for c in trainer_cmd]},
                                      logs, cwd=ROOT)
    if any(codes.values()):
        raise PhaseError("resident", f"engine exit {codes['engine']}, trainer exit {codes['trainer']}")


def resident_checks(results, figures, run_dir, how):
    """Resident mode in miniature (run_resident): the engines generate stage 0 and sleep (on a GPU: level 2,
    weights and KV cache freed), the trainer trains on it and hands its policy over (`how`), every engine wakes,
    loads it in place and generates its shards of stage 1 with it, the trainer trains on that. Every engine's own
    timeline row says it reloaded (and, on a GPU, what its sleep freed); a figure missing from a row is a FAIL. The
    transfer's seconds and rate per engine (the slowest's) are measured here (INFO, and in figures["handoff"])."""
    flag = handoff.Partner(run_dir, "engine").trained(0)
    manifest = json.loads((records.stage_dir(run_dir, 1) / records.ROLLOUTS / records.MANIFEST).read_text())
    rows = records.read(run_dir)
    engine_rows = {s: {r["engine"]: r for r in rows if r["phase"] == "engine" and r["stage"] == s} for s in (0, 1)}
    reloads = [engine_rows[1].get(r, {}).get("reload_seconds") for r in range(n_engines)]
    reloaded = all(x is not None and x > 0 for x in reloads)
    handed = manifest["policy_id"] == flag["fingerprint"] and (records.stage_dir(run_dir, 1) / records.POLICY / "model.safetensors").exists()
    check(results, f"resident hand-off: stage 1 generated by the policy trained on stage 0, handed over by {how} and "
          f"loaded in place by every engine ({n_engines})", handed and reloaded, "none" if not any(reloads) else
          round(min(x or 0.0 for x in reloads), 3), "reloaded", "s (slowest engine's reload: the least)")
    check(results, f"resident hand-off: every engine generated a shard of a {manifest['prompts']}-prompt stage",
          manifest.get("engines_ran") == n_engines, manifest.get("engines_ran"), n_engines, "engines")
    freed = [engine_rows[0].get(r, {}).get("freed_gib") for r in range(n_engines)]
    if on_gpu:
        ok = all(f is not None and f > 1.0 for f in freed)
        value = "missing" if any(f is None for f in freed) else round(min(freed), 2)
    else:
        ok, value = None, None
    check(results, "resident hand-off: every sleeping engine frees GPU memory (the least)", ok, value,
          "> 1" if on_gpu else "no GPU", "GiB")
    trained = next((r for r in rows if r["phase"] == "optimize" and r["stage"] == 0), {})
    check(results, "resident hand-off: the trainer's reserved memory beside an awake engine (the most of any rank)",
          *handoff.trainer_memory_check(trained.get("reserved_gib_per_rank"), resident_gpu_memory, gpu_gib()), "GiB")
    if how == "transfer":
        sent = trained
        rates = [engine_rows[1][r]["handoff_bytes"] / 1e9 / engine_rows[1][r]["reload_seconds"] for r in range(n_engines)]
        figures["handoff"] = {"seconds": sent["handoff_seconds"], "gb_per_s": sent["handoff_gb_per_s"],
                              "engine_gb_per_s": rates}
        check(results, "resident hand-off: seconds of a transfer (the trainer's send)", "info",
              round(sent["handoff_seconds"], 3), "measured", "s")
        check(results, "resident hand-off: GB/s of a transfer into each engine (the slowest)", "info",
              round(min(rates), 3), "measured", "GB/s")


def stage_plan(first, total, max_updates, min_updates, growth=2.0):
    """The μ of every stage of a run with STAGE_END=drift whose stages each train `growth` times the updates of the
    stage before (stage_rules.StagePlan: twice μ after a stage without a drift warning), at least μ_min, at most
    max_updates and the updates left, until `total` updates."""
    plan = [min(first, total)]
    while sum(plan) < total:
        plan.append(min(max(min_updates, math.ceil(growth * plan[-1])), max_updates, total - sum(plan)))
    return plan


def kept_bytes(plan, response_bytes, responses_per_update, policy_bytes, state_bytes):
    """(bytes, how many policies, how many train states) a run of these stages (their μ) keeps at its peak: every
    stage's rollouts; a policy per stage, or in resident mode one per save_every stages and the last; the train
    states kept (every saved one with keep_train_states, else the newest) and one more, the newest being written
    beside them (checkpoint.save_state: train_state.tmp, then renamed over)."""
    last = len(plan) - 1
    saves = len(plan) if not resident else \
        sum(s == last or bool(save_every and (s + 1) % save_every == 0) for s in range(len(plan)))
    states = (saves if keep_train_states else 1) + 1
    rollout = sum(plan) * responses_per_update * response_bytes
    return rollout + saves * policy_bytes + states * state_bytes, saves, states


def disk_check(results, rows, model):
    """The run directory's free space against what the run keeps (kept_bytes), from its settings: the miniature's
    bytes per response (JSONL and columns) × the run's responses, its stages' policies and train states. A drift
    run is gated on the fewest stages it can have (none ends on drift: each twice the last) and the most (every one
    ends at μ_min, the first included: 1 + (total − min(first, μ_min)) / μ_min stages, whose rollouts are at most the
    first's, μ_min per later stage and twice the updates trained, since a stage plans at most max(μ_min, 2 × the
    updates of the one before)) is printed for information."""
    stage_dir = records.stage_dir(work, 0) / records.ROLLOUTS
    response_bytes = sum(f.stat().st_size for f in stage_dir.rglob("*") if f.is_file()) / max(1, len(rows))
    n = M.parameter_count(model)
    policy_bytes, state_bytes = n * M.checkpoint_dtype(model).itemsize, 12 * n
    where = Path(run_dir) if run_dir else report_path.parent
    where.mkdir(parents=True, exist_ok=True)
    # resident, HANDOFF=files: the two handed-over policies go to the run's disk when /dev/shm has no room for them
    handed = 2 * policy_bytes if resident and policy_handoff == "files" and \
        handoff.fast_dir(where, policy_bytes)[0] == handoff.state_dir(where) / "policies" else 0
    responses_per_update = estimate_stage_prompts / updates_per_stage * group_size
    plan = stage_rules.StagePlan(updates_per_stage, stages, stage_end, total_updates=total_updates,
                              drift_max_updates=drift_max_updates)     # the run's plan, its defaults resolved there
    total = plan.total_updates
    stages_kept = [updates_per_stage] * stages if stage_end == "fixed" else \
        stage_plan(updates_per_stage, total, plan.drift_max_updates, drift_min_updates)
    keeps, policies, states = kept_bytes(stages_kept, response_bytes, responses_per_update, policy_bytes, state_bytes)
    free = shutil.disk_usage(where).free
    what = f"{len(stages_kept)} stages' rollouts ({sum(stages_kept)} updates), {policies} policies and {states} train states" + \
        (" and the 2 handed-over policies" if handed else "")
    fewest = " (drift: the fewest stages, none ended on drift)" if stage_end == "drift" else ""
    check(results, f"disk: free space in {where} for {what}{fewest}", free >= keeps + handed, round(free / 1e9, 1),
          f">= {(keeps + handed) / 1e9:.1f}", "GB")
    if stage_end == "drift":
        step = max(1, min(drift_min_updates, plan.drift_max_updates))
        most_stages = 1 + math.ceil(max(0, total - min(stages_kept[0], drift_min_updates)) / step)
        most_updates = min(stages_kept[0] + (most_stages - 1) * drift_min_updates + 2 * total,
                           stages_kept[0] + (most_stages - 1) * plan.drift_max_updates)
        most = kept_bytes([most_updates] + [0] * (most_stages - 1), response_bytes, responses_per_update,
                          policy_bytes, state_bytes)[0]
        check(results, f"disk: what a drift run keeps at most, every stage ended at μ_min={drift_min_updates} "
              f"({most_stages} stages; for information)", "info", round((most + handed) / 1e9, 1), "—", "GB")


def grader_throughput(rows):
    """Responses graded per second on this box's CPUs (the stage's own responses, repeated to ≥ 2,000)."""
    items = [(r["response"], r["answer"], r.get("source")) for r in rows] * max(1, math.ceil(2000 / max(1, len(rows))))
    t0 = time.perf_counter()
    grading.grade_batch(items, workers=max(1, (os.cpu_count() or 2) - 1))
    return len(items) / (time.perf_counter() - t0)


def code_version(root=ROOT):
    """A hash of every source file at the repository's top level (the scripts, presets.sh), in mu_grpo/ and data/, and
    of the requirements files: a pass is reused only for the code, and what it installs, that earned it."""
    h = hashlib.sha256()
    sources = [*root.glob("*.py"), *root.glob("*.sh"), *root.glob("mu_grpo/*.py"), *root.glob("data/*.py"),
               *root.glob("requirements*.txt")]
    for path in sorted(sources):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def libraries_version():
    """A hash of Python's version and every installed distribution's name and version (torch, vLLM, transformers,
    the CUDA wheels, ...): the kernels a pass was measured with."""
    installed = sorted({f"{d.metadata['Name']}=={d.version}".lower() for d in importlib.metadata.distributions()})
    return hashlib.sha256("\n".join([platform.python_version(), *installed]).encode()).hexdigest()[:16]


def gpu_gib():
    """The first GPU's memory in GiB; None on a CPU."""
    return torch.cuda.get_device_properties(0).total_memory / 2**30 if on_gpu else None


def gpu_names():
    """The model of each GPU the run uses (torch's names, CUDA_VISIBLE_DEVICES honoured); [] on a CPU."""
    return [torch.cuda.get_device_name(i) for i in range(n_gpus)] if on_gpu else []


def cache_key(model):
    """What a cached pass was earned for: the model's weights, the code and requirements files, the installed
    libraries, whether flash-attn is installed (model.choose_attention then packs attention with its kernel, which
    the packing check exists for), the GPUs' count and model, and every preflight setting."""
    return {"model": common.policy_fingerprint(model), "code": code_version(), "libraries": libraries_version(),
            "flash_attn": importlib.util.find_spec("flash_attn") is not None, "gpus": n_gpus, "gpu_names": gpu_names(),
            "settings": settings}


def clean_up():
    """Delete the miniature's weights (its train state alone is 12 bytes per parameter: 91 GB for 7B) and stored
    passes; keep its logs, rollouts and metrics."""
    handoff.clear_policies(work / "resident")
    stages = [d for _, d in [*records.stage_dirs(work), *records.stage_dirs(work / "resident")]]
    for d in [p for s in [*stages, *work.glob("ckpt_*")] for name in (records.POLICY, records.TRAIN_STATE)
              for p in s.glob(f"{name}*")] + [s / "logprobs" for s in stages]:
        shutil.rmtree(d, ignore_errors=True)


def miniature(results, figures, model):
    """The miniature run and its checks (raises PhaseError when a phase fails; a check that raises is its FAIL)."""
    stage0, stage1 = records.stage_dir(work, 0), records.stage_dir(work, 1)
    figures["generate_seconds"] = run("generate_0", generate_cmd(model, 0))
    manifest = json.loads((stage0 / records.ROLLOUTS / records.MANIFEST).read_text())
    rows = [r for f in sorted((stage0 / records.ROLLOUTS).glob("shard_*.jsonl")) for r in common.read_jsonl(f)]
    with guarded(results, "stop tokens"):
        stop_token_check(results, rows, model)
    with guarded(results, "disk"):
        disk_check(results, rows, model)

    run("optimize_0", optimize_cmd(stage0, stage0 / records.POLICY, updates, f"--policy={model}",
                                   "--check_packing=true"))
    metrics = common.read_jsonl(stage0 / records.METRICS)
    figures["agreement"] = agreement_record(metrics[0], manifest)
    with guarded(results, "engine/trainer agreement"):
        agreement_checks(results, metrics[0], "engine/trainer agreement")
    with guarded(results, "packed attention"):
        packing_checks(results, metrics[0])

    small = min(micro_batch_tokens, 2048)      # a micro-batch that fits without checkpointing
    saved = {}
    for ckpt in (False, True):
        d = work / f"ckpt_{'on' if ckpt else 'off'}"
        run(f"optimize_ckpt_{ckpt}", optimize_cmd(stage0, d / records.POLICY, 1, f"--policy={model}",
                                                  f"--gradient_checkpointing={ckpt}", f"--micro_batch_tokens={small}",
                                                  "--save_train_state=false"))
        m = common.read_jsonl(d / records.METRICS)[0]
        saved[ckpt] = (m["memory/saved_activations_gib"], m.get("memory/peak_gib"))
    check(results, "gradient checkpointing: saved activations with / without", saved[True][0] < 0.5 * saved[False][0],
          round(saved[True][0] / max(saved[False][0], 1e-12), 4), 0.5, "ratio")

    # round trip: the saved policy is the trained one; vLLM samples from it; the next stage's trainer starts from the
    # fp32 train state with --policy the *initial* model, so a train state that is not loaded shows as a mismatch
    with guarded(results, "round trip"):
        round_trip_checks(results, model, stage0 / records.POLICY, stage0 / records.TRAIN_STATE)
    # the saved policy's evaluation first, by the engines that generate with it (generate.py, as in a run): 16
    # training problems, k = 2, the paper's top_p
    (work / "eval").mkdir(parents=True, exist_ok=True)
    common.atomic_write_lines(work / "eval" / "train.jsonl", common.read_jsonl(data)[:16])
    run("generate_1", [*generate_cmd(stage0 / records.POLICY, 1), "--evaluate=true",
                       f"--eval_args=--benchmarks=train --data_dir={work / 'eval'} --k=2 --top_p=0.7",
                       f"--results={work / 'eval' / records.RESULTS}"])
    run("optimize_1", optimize_cmd(stage1, stage1 / records.POLICY, 1, f"--policy={model}",
                                   f"--init_state={stage0 / records.TRAIN_STATE}", "--save_train_state=false"))
    with guarded(results, "round trip"):
        agreement_checks(results, common.read_jsonl(stage1 / records.METRICS)[0],
                         "round trip: vLLM on the saved policy vs the trainer's state")

    ev = common.read_jsonl(work / "eval" / records.RESULTS)[0]
    check(results, "evaluation: avg@2 of the saved policy on 16 training problems", True, round(ev["avg_at_k"], 4), "runs")
    if resident:
        resident_miniature(results, figures, model)

    with guarded(results, "headroom"):
        throughput(results, figures, model, metrics, manifest, rows, saved)


def throughput(results, figures, model, metrics, manifest, rows, saved):
    """Headroom (GPU memory, MFU) and the throughputs behind the hours-per-stage estimate."""
    steady = metrics[1:] or metrics
    train_tps = sum(m["tokens"] for m in steady) / sum(m["seconds"] for m in steady)
    peak = max((m.get("memory/peak_gib") or 0.0) for m in metrics)
    if on_gpu:
        total = gpu_gib()
        check(results, "headroom: peak GPU memory per rank at the run's micro-batch", peak <= 0.9 * total,
              round(peak, 2), round(0.9 * total, 1), "GiB")
        mfu = 6 * M.parameter_count(model) * train_tps / (peak_tflops * 1e12 * n_ranks)
        check(results, "headroom: training MFU (6·N·tokens/s over bf16 peak)", mfu >= 0.1, round(mfu, 3), 0.1)
    else:
        check(results, "headroom: peak GPU memory per rank at the run's micro-batch", None, None, "no GPU", "GiB")
        check(results, "headroom: training MFU (6·N·tokens/s over bf16 peak)", None, None, "no GPU")
    grader_rps = grader_throughput(rows)
    mean_response = manifest["mean_response_tokens"]
    mean_prompt = sum(len(r["prompt_token_ids"]) for r in rows) / max(1, len(rows))
    stage_responses = estimate_stage_prompts * group_size
    per_engine = manifest.get("tokens_per_s_per_engine", manifest["generated_tokens_per_s"])
    hours = {"generate": stage_responses * mean_response / max(per_engine * n_engines, 1e-9) / 3600,
             "optimize": stage_responses * (mean_prompt + mean_response) / max(train_tps, 1e-9) / 3600,
             "grade": stage_responses / grader_rps / 3600}
    figures.update({"train_tokens_per_s": train_tps, "generated_tokens_per_s_per_engine": per_engine,
                    "engines_ran": manifest.get("engines_ran"), "engines": n_engines, "train_ranks": n_ranks,
                    "batch_saturation": manifest.get("batch_saturation"),
                    "grader_responses_per_s": grader_rps, "peak_gpu_gib": peak or None,
                    "estimated_hours_per_stage": hours, "mean_response_tokens": mean_response,
                    "saved_activations_gib": {"with_ckpt": saved[True][0], "without": saved[False][0]}})


def main():
    model = common.local_dir(policy)        # a hub name: the same local snapshot every phase reads
    common.check_lengths(model, max_prompt_tokens, max_response_tokens)       # one line, not vLLM's traceback
    key = cache_key(model)
    if report_path.exists():
        old = json.loads(report_path.read_text())
        if old.get("key") == key and old.get("passed"):
            print(f"preflight: passed before for this model, code, libraries, GPUs and settings ({report_path}); "
                  f"skipping")
            return
    print(f"preflight on {n_gpus} GPU(s) ({'bf16' if on_gpu else 'CPU, fp32'}), {n_engines} engine(s), {n_ranks} "
          f"trainer rank(s): {prompts} prompts × G={group_size}, {updates} updates, micro-batches of "
          f"{micro_batch_tokens} tokens, optimize flags [{optimize_args}]; model {model}; work dir {work}")
    # an attempt's rollouts, logs and figures are its own: a rerun after a FAIL (MAX_RESPONSE raised, another model,
    # temperature or vLLM) would otherwise find stage 0 complete (generate.py keeps a stage with a manifest) and
    # check the last attempt's responses again
    shutil.rmtree(work, ignore_errors=True)
    results, figures = [], {}
    try:
        miniature(results, figures, model)
    except PhaseError as e:
        check(results, f"{e.phase}: the phase ran", False, str(e), "exit 0")
    except (Exception, SystemExit) as e:      # whatever went wrong, the report is written and says what
        check(results, "preflight: it ran to the end", False, f"{type(e).__name__}: {e}", "no error")
    finally:
        clean_up()
    passed = all(r["status"] != "FAIL" for r in results)
    common.atomic_write_json(report_path, {"passed": passed, "key": key, "checks": results, "figures": figures,
                                           "time": time.time()})
    print_table(results, figures)
    if not passed:
        print(f"preflight FAILED ({report_path}); " + ("--force=true: going on anyway" if force else
                                                       "the run will not start (PREFLIGHT=force to start anyway)"))
        if not force:
            sys.exit(1)


def print_table(results, figures):
    width = max([len(r["check"]) for r in results] + [5])          # names in full
    print(f"| {'check':<{width}} | {'status':<7} | {'measured':>12} | {'threshold':>10} |")
    print(f"|{'-' * (width + 2)}|{'-' * 9}|{'-' * 14}|{'-' * 12}|")
    for r in results:
        value = f"{r['value']:.3g}" if isinstance(r["value"], float) else str(r["value"])
        print(f"| {r['check']:<{width}} | {r['status']:<7} | {value:>12} | {str(r['threshold']):>10} |")
        if r["hint"]:
            print(f"|   hint: {r['hint']}")
    if "train_tokens_per_s" in figures:
        h = figures["estimated_hours_per_stage"]
        print(f"throughput here: generation {figures['generated_tokens_per_s_per_engine']:.0f} tokens/s per engine "
              f"({figures['engines_ran']} of {figures['engines']} engine(s) ran), training "
              f"{figures['train_tokens_per_s']:.0f} tokens/s on {figures['train_ranks']} rank(s), grading "
              f"{figures['grader_responses_per_s']:.0f} responses/s")
        print(f"ESTIMATE for a stage of {estimate_stage_prompts} prompts × G={group_size} at this response length "
              f"({figures['mean_response_tokens']:.0f} tokens): generate {h['generate']:.2f} h, optimize "
              f"{h['optimize']:.2f} h (grading {h['grade']:.2f} h, overlapped with generation)")
        saturation = figures.get("batch_saturation")
        if saturation is not None and saturation < 1:
            print(f"  the miniature filled {100 * saturation:.0f}% of an engine's largest batch (max_num_seqs); a full "
                  f"one generates more tokens/s, so the generate estimate is an upper bound")


if __name__ == "__main__":
    main()
