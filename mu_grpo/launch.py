"""run_stages.sh's machinery, in Python where it can be tested fast; the shell keeps what a
researcher reads (the knobs, the presets, the generate → optimize → evaluate loop). run_stages.sh
exports its knobs (`set -a`) and calls `python -m mu_grpo.launch --command=<command>`:

    preset          PRESET=auto resolved by the GPUs torch sees (paper on a GPU box, else toy)
    settings        every knob checked against one table (KNOBS) before any phase runs, the
                    defaults resolved: shell assignments run_stages.sh evals, SETTINGS among them
                    (every knob, KEY=value lines: what the nodes' join compares and the trackers'
                    config)
    lock            the run directory's lock, on run_stages.sh's descriptor 9
    start --logs=DIR --store=ADDR:PORT
                    the start-up, every node, before any compute: node 0 builds the preset's task
                    and policy and fetches the paper's data while the others wait for its word; a
                    hub MODEL resolved to its local copy, TRAIN_DATA read, the resident engines' GPU
                    share checked; on several nodes their join and the trainers' ranks reaching each
                    other; the run's start time. Its assignments go to descriptor 3, its output to
                    stdout
    preflight       mu_grpo/preflight.py at the run's settings
    handoff         resident: the hand-off the run uses (HANDOFF, or files after the preflight's
                    fallback)
    stage --stage=S stage S as the plan decides it (stage_rules.StagePlan.stage): its μ (0 once
                    the run is over), prompts, whether the policy it starts from is evaluated, as
                    STAGE_UPDATES, STAGE_PROMPTS, EVALUATE; and the stage's line where the run
                    stands (tracking.where_line) on stderr
    resident --logs=DIR ENGINE... :: TRAINER...
                    the resident pair (engine, trainer), supervised: a failed one stops the other;
                    timed into timeline.jsonl
    view            a phase's output (stdin) on the terminal without the libraries' chatter
    row --name=N --stage=S --start=T0 --end=T1
                    node 0: a phase's row in timeline.jsonl
    finished --name=N
                    node 0: 1 if the phase is finished by the run's records, else 0
    attempt         node 0: this attempt's start row in timeline.jsonl (mu_grpo/records.py)
    loss_flags      optimize.py's flags of the LOSS preset (LOSS, NAV_DELTA from the environment)
    recorded        a run's recorded settings (ablate.sh's LAB=paper)
    presets         the names of loss.py's LOSS presets, in order, read without torch (ablate.sh's
                    VARIANTS=all)
    end --status=S --new_run=B
                    as the run ends: its engines' links and sockets in the temporary directory
                    removed, a refused new run removed, a stopped run's line

Each prints what run_stages.sh reads, and on a bad setting one line naming it and what is allowed,
exiting 2.
"""
import contextlib
import dataclasses
import fcntl
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mu_grpo import common, model_cards, processes, records, stage_rules

# ----------------------------------------------------------------------------- hyperparameters
command = ""                    # one of the commands above
stage = 0                       # stage: the stage asked about
logs = ""                       # resident, start: the directory of the logs (engine.log,
                                # trainer.log, collective.log)
store = "127.0.0.1:29500"  # start: node 0's MASTER_ADDR:MASTER_PORT (torchrun's rendezvous: the
                           # next port)
name = ""                       # row: the phase's name (eval_init, generate_0, ...; its kind: the
                                # part before the last _)
start = 0.0                     # row: when the phase started and ended (Unix seconds)
end = 0.0
status = 0                      # end: run_stages.sh's exit status
new_run = False                 # end: whether this attempt made the run directory
# -----------------------------------------------------------------------------
STOP_GRACE_S = 10.0             # resident: seconds a stopped partner has to end before SIGKILL


# ----------------------------------------------------------------------------- the settings table

NUMBER = re.compile(r"[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?")      # fullmatch


def whole(least=0):
    def rule(name, v):
        # no leading zero: bash would read 016 as octal 14
        if not re.fullmatch(r"0|[1-9][0-9]*", v):
            return f"{name} must be a whole number, got '{v}'"
        if int(v) < least:
            return f"{name} must be at least {least}, got '{v}'"
    return rule


def number(name, v):
    if not NUMBER.fullmatch(v):
        return f"{name} must be a non-negative number, got '{v}'"


def positive(name, v):
    if not NUMBER.fullmatch(v) or float(v) <= 0:
        return f"{name} must be a positive number, got '{v}'"


def positive_or_empty(name, v):
    return positive(name, v) if v else None


def boolean(name, v):
    if v not in ("true", "false"):
        return f"{name} must be true or false, got '{v}'"


def one_of(*allowed):
    def rule(name, v):
        if v not in allowed:
            return f"{name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, got '{v}'"
    return rule


def share_or_auto(name, v):
    if v != "auto" and not (re.fullmatch(r"0?\.[0-9]+|1(\.0*)?", v) and float(v) > 0):
        return f"{name} must be auto or a fraction in (0, 1], got '{v}'"


def anything(name, v):
    return None


def betas(name, v):
    parts = v.split(",")
    if len(parts) != 2 or not all(NUMBER.fullmatch(b) and float(b) < 1 for b in parts):
        return f"{name} must be two numbers in [0, 1), β1,β2 (e.g. 0.9,0.999), got '{v}'"


# vLLM's own rule (vllm/sampling_params.py, SamplingParams._verify_args)
def temperature(name, v):
    if not NUMBER.fullmatch(v) or float(v) > 2:
        return f"{name} must be a number in [0, 2], got '{v}'"


# (0, 1], vLLM's own rule (vllm/sampling_params.py, SamplingParams._verify_args)
def top_p(name, v):
    if not NUMBER.fullmatch(v) or not 0 < float(v) <= 1:
        return f"{name} must be a number in (0, 1], got '{v}'"


@dataclasses.dataclass(frozen=True)
class Knob:
    """A knob of run_stages.sh, declared once (KNOBS): its rule, its home, whether a rerun may
    change it, whether it is each node's own. Every list of knobs is derived from KNOBS."""
    # rule(name, value): the problem with a value, or None
    rule: object
    # where its default lives: run_stages.sh's block, or "<script> <flag>", a phase script's block
    # (an empty knob: that block decides, no flag passed; given: passed to that script as the flag)
    home: str = "run_stages.sh"
    # a rerun may change it: how the run runs, is watched, saved and when it is evaluated, not what
    # it computes (every other knob is the run's own once a phase has finished: run_settings.json)
    rerun: bool = False
    # each node's own (it may differ between nodes); every other knob of each node must equal node
    # 0's (mu_grpo/nodes.py join)
    own: bool = False

    @property
    def phase(self):
        """(script, flag) of a phase knob, else None."""
        return tuple(self.home.split()) if self.home != "run_stages.sh" else None


def phase(script, flag, rule, rerun=False):
    return Knob(rule, f"{script} {flag}", rerun)


SAFE, OWN = dict(rerun=True), dict(own=True)
# every knob run_stages.sh reads (its block's, its presets', and the phase knobs, whose homes are
# the scripts' blocks)
KNOBS = {
    "PRESET": Knob(one_of("paper", "toy", "lab", "lab-fork")), "LOSS": Knob(anything),
    "LOSS_ARGS": Knob(anything), "NAV_DELTA": Knob(positive_or_empty),
    "RUN": Knob(anything, **SAFE), "MODEL": Knob(anything), "TRAIN_DATA": Knob(anything),
    "EVAL_DATA_DIR": Knob(anything), "BENCHMARKS": Knob(anything),
    "TEMPLATE": Knob(one_of(*model_cards.TEMPLATES)),
    # the stages
    "STAGES": Knob(whole(1)), "UPDATES_PER_STAGE": Knob(whole(1)),
    "PROMPTS_PER_UPDATE": Knob(whole(1)), "GROUP_SIZE": Knob(whole(2)),
    "STAGE_END": Knob(one_of("fixed", "drift")), "TOTAL_UPDATES": Knob(whole(1)),
    "DRIFT_GROWTH": Knob(positive), "DRIFT_MAX_UPDATES": Knob(whole(1)),
    "DRIFT_ARGS": Knob(anything), "MAX_PROMPT": Knob(whole(1)), "MAX_RESPONSE": Knob(whole(1)),
    "SEED": Knob(whole()),
    # the phase scripts' knobs
    "LR": phase("optimize.py", "lr", number),
    "WARMUP": phase("optimize.py", "warmup_updates", whole()),
    "KL_COEF": phase("optimize.py", "kl_coef", number),
    "MICRO_BATCH_TOKENS": phase("optimize.py", "micro_batch_tokens", whole(1), rerun=True),
    "GRAD_CKPT": phase("optimize.py", "gradient_checkpointing", boolean, rerun=True),
    "OPTIMIZER_BOUNDARY": phase("optimize.py", "optimizer_boundary", one_of("carry", "reset")),
    "ADAM_BETAS": phase("optimize.py", "adam_betas", betas),
    "STAGE_WARMUP": phase("optimize.py", "stage_warmup_updates", whole()),
    "SAVE_POLICY_EVERY": phase("optimize.py", "save_policy_every", whole(), rerun=True),
    "TEMPERATURE": phase("generate.py", "temperature", temperature),
    "SHARD_PROMPTS": phase("generate.py", "shard_prompts", whole(1)),
    "PER_REQUEST_SEED": phase("generate.py", "per_request_seed", boolean),
    "EVAL_K": phase("evaluate.py", "k", whole(1)),
    "EVAL_TEMPERATURE": phase("evaluate.py", "temperature", temperature),
    "EVAL_TOP_P": phase("evaluate.py", "top_p", top_p),
    # evaluation and saving
    "EVAL_EVERY": Knob(whole(), **SAFE), "SAVE_EVERY": Knob(whole(), **SAFE),
    "KEEP_TRAIN_STATES": Knob(boolean, **SAFE), "EVAL_CACHE": Knob(anything, **SAFE),
    "CHECKPOINT_EVERY": Knob(whole(), **SAFE),
    # the box
    "GPUS": Knob(whole(), **SAFE), "ENGINES": Knob(whole(1), **SAFE),
    "TRAIN_RANKS": Knob(whole(1), **SAFE), "RESIDENT": Knob(boolean, **SAFE),
    "RESIDENT_GPU_MEMORY": Knob(share_or_auto, **SAFE),
    "HANDOFF": Knob(one_of("transfer", "files"), **SAFE),
    "PREFLIGHT": Knob(one_of("auto", "0", "1", "force"), **SAFE),
    "PREFLIGHT_ARGS": Knob(anything, **OWN), "PREFLIGHT_ONLY": Knob(boolean, **SAFE),
    "PREFLIGHT_REPORT": Knob(anything, **SAFE),
    # several nodes
    "NNODES": Knob(whole(1), **SAFE), "NODE_RANK": Knob(whole(), **OWN),
    "MASTER_ADDR": Knob(anything, **OWN), "MASTER_PORT": Knob(whole(), **SAFE),
    "JOIN_TIMEOUT": Knob(whole(), **OWN), "DEAD_AFTER": Knob(whole(), **OWN),
    "COLLECTIVE_TIMEOUT": Knob(whole(1), **OWN), "HSDP": Knob(boolean, **SAFE),
    # tracking (node 0 reports)
    "REPORT_TO": Knob(anything, **OWN), "TRACKER_GROUP": Knob(anything, **OWN),
}
# a rerun may raise these: the run goes on to its new length
EXTENDABLE = ("STAGES", "TOTAL_UPDATES")
RENAMED = {"UPDATES": "UPDATES_PER_STAGE", "RESET_OPTIMIZER": "OPTIMIZER_BOUNDARY (carry | reset)"}
PLAN_DEFAULTS = ("TOTAL_UPDATES", "DRIFT_MAX_UPDATES")     # empty: stage_rules.StagePlan's defaults
# derived from KNOBS: the knobs every node must share, those a rerun may change, the phase knobs
SHARED = [name for name, knob in KNOBS.items() if not knob.own]
RERUN_SAFE = {name for name, knob in KNOBS.items() if knob.rerun}
PHASE_KNOBS = {name: knob.phase for name, knob in KNOBS.items() if knob.phase}
ROOT = Path(__file__).resolve().parents[1]


def shell_value(value):
    """A block's Python default as the shell spells it (True → true, None → empty)."""
    return ("true" if value is True else "false" if value is False else "" if value is None
            else str(value))


def flags_variable(script):
    """The variable run_stages.sh passes a phase script's given knobs in: OPTIMIZE_FLAGS for
    optimize.py."""
    return f"{Path(script).stem.upper()}_FLAGS"


def block_default(name):
    """The value a phase knob takes from its home, the script's block (common.script_defaults)."""
    script, flag = PHASE_KNOBS[name]
    return shell_value(common.script_defaults(ROOT / script)[flag])
# the phase scripts' blocks are the run's too (a default edited between attempts changes it), but
# for these knobs of theirs: where and how it runs, its guards and saves, and the settings the loop
# always passes (the knobs above, and LOOP_PASSED: their block's value is never used by a run, so
# editing it changes no run)
# the flags run_stages.sh gives every call of the script (tests/test_launch.py reads them there)
LOOP_PASSED = {
    "generate.py": {"data", "run_dir", "group_size", "max_prompt_tokens", "max_response_tokens",
                    "gpus", "engines", "seed", "nnodes", "node_rank", "store", "eval_args",
                    "results", "run_start", "policy", "stage", "prompts_per_stage", "evaluate"},
    "optimize.py": {"prompts_per_update", "seed", "checkpoint_every", "stage_end", "hsdp",
                    "release_older_states", "policy", "updates_per_stage"},
    "evaluate.py": {"benchmarks", "data_dir", "max_prompt_tokens", "max_response_tokens", "results",
                    "run_start", "gpus", "engines", "nnodes", "node_rank", "store", "policy",
                    "stage", "skip_evaluated"},
}
# optimize.py's loss block: the knobs loss.resolve_loss makes the run's Loss of (recorded as that
# Loss, run_settings)
LOSS_BLOCK = ("loss", "objective_args", "clip_low", "clip_high", "dual_clip", "advantage",
              "nav_delta", "nav_scope", "m2po_tau", "tis_cap", "kl_coef", "kl_estimator", "agg",
              "token_normalizer")
PHASE_SCRIPTS = {
    "generate.py": LOOP_PASSED["generate.py"] | {
        "grader_workers", "grader_timeout_s", "tensor_parallel", "gpu_memory_utilization",
        "worker_rank", "resident", "policy_handoff", "eval_parts", "shard_prompts"},
    "optimize.py": LOOP_PASSED["optimize.py"] | {
        "stage_dir", "out", "init_state", "save_train_state", "micro_batch_tokens",
        "gradient_checkpointing", "attn_implementation", "save_policy_every", "max_nonfinite",
        "engine_mismatch_bound", "agreement_growth", "collapse_entropy_ratio",
        "agreement_responses", "check_packing", "resident", "run_dir", "stages", "total_updates",
        "drift_growth", "drift_max_updates", "save_every", "eval_every", "policy_handoff",
        "engines", "handoff_buffer_mb"},
    "evaluate.py": LOOP_PASSED["evaluate.py"] | {
        "max_problems", "grader_workers", "grader_timeout_s", "cache", "samples_dir",
        "tensor_parallel", "gpu_memory_utilization", "worker_rank", "parts_dir"},
}


def run_settings(k):
    """What makes a run what it is: every knob but each node's own and RERUN_SAFE, the phase
    scripts' blocks but their safe knobs and optimize.py's loss block, and the Loss that block, LOSS
    and LOSS_ARGS make (its row of loss.py's PRESETS as it is: an edited row is a changed run)
    ({"knobs": ..., "<script>": ..., "loss": ...}); recorded at its first attempt
    (records.RUN_SETTINGS)."""
    knobs = {n: k[n] for n in SHARED if n not in RERUN_SAFE}
    scripts = {name: {key: v for key, v in common.script_defaults(name).items() if key not in safe
                      and not (name == "optimize.py" and key in LOSS_BLOCK)}
               for name, safe in PHASE_SCRIPTS.items()}
    return {"knobs": knobs, **scripts, "loss": dataclasses.asdict(run_loss(k)),
            "data": data_files(k)}


def data_files(k):
    """What the run trains and evaluates on, by content: {path: sha256 of the file} of TRAIN_DATA
    and each benchmark's file, those that exist (the paper's are fetched at the first start, after
    the settings check)."""
    import hashlib  # only the settings record hashes files
    paths = [k["TRAIN_DATA"],
             *(f"{k['EVAL_DATA_DIR']}/{b}.jsonl" for b in k["BENCHMARKS"].split(",") if b)]
    return {p: "sha256:" + hashlib.sha256(Path(p).read_bytes()).hexdigest()[:16] for p in paths
            if Path(p).is_file()}


def setting_changes(recorded, now):
    """(changed, extended): the settings of `now` that differ from `recorded` as "NAME old → new" (a
    script's as "optimize.py lr ..."), and whether the only changes raise EXTENDABLE knobs (the run
    goes on to its new length)."""
    changed, raised = [], False
    for part in sorted(set(recorded) | set(now)):
        old, new = recorded.get(part, {}), now.get(part, {})
        for key in sorted(set(old) | set(new), key=str):
            a, b = old.get(key, "(unset)"), new.get(key, "(unset)")
            a, b = (x if x != "" else "(empty)" for x in (a, b))
            # (data: a file not there yet, fetched later; a flag the loop always passes: a record
            # made before LOOP_PASSED left those out holds their block values, which no run used)
            # (a record made before the loss was recorded whole: its loss block's values, now the
            # Loss's part)
            if (a == b or part == "data" and "(unset)" in (a, b) or key in LOOP_PASSED.get(part, ())
                    or part == "loss" and part not in recorded
                    or part == "optimize.py" and key in LOSS_BLOCK):
                continue
            if (part == "knobs" and key in EXTENDABLE and str(a).isdigit() and str(b).isdigit()
                and int(b) > int(a)):
                raised = True
                continue
            changed.append(f"{key} {a} → {b}" if part == "knobs" else f"{part} {key} {a!r} → {b!r}")
    return changed, raised


def rerun_check(k):
    """The run directory against this attempt's settings, before any compute (nothing is written
    here): assignments run_stages.sh evals. RUN is a run's directory or a new one: one that holds
    anything else is refused. A run that holds finished work (records.finished_work: a rollout
    shard, a train state, a trained stage, a results row) keeps the settings it recorded: a change
    is refused in one line naming each, and nothing is removed; a raised STAGES or TOTAL_UPDATES
    goes on to the new length (EXTEND); an attempt that left no finished work starts afresh with the
    new settings (FRESH: settle_record removes what it left, the names a run writes and nothing
    else)."""
    run = Path(k["RUN"])
    if run.exists() and not run.is_dir():
        common.refuse(f"RUN={run} is a file, not a run's directory: choose a new RUN")
    for d in [run, *(d for _, d in records.stage_dirs(run)),
              *(d / records.ROLLOUTS for _, d in records.stage_dirs(run))]:
        if d.is_dir() and (problem := common.unwritable(d)):
            common.refuse(f"RUN={run}: {d} cannot be written ({problem}): the run writes there; "
                          "make it writable")
    path = run / records.RUN_SETTINGS
    try:
        work = records.finished_work(run)
    except (ValueError, json.JSONDecodeError) as e:
        common.refuse(f"RUN={run}: a record cannot be read ({e}): restore it from a copy, or "
                      "choose a new RUN")
    if not path.exists():
        others = sorted(p.name for p in (run.iterdir() if run.is_dir() else [])
                        if not any(fnmatch.fnmatch(p.name, name) for name in records.RUN_NAMES))
        if others:
            common.refuse(f"RUN={run} is a directory that holds no run ({', '.join(others[:4])}"
                          f"{', ...' if len(others) > 4 else ''}): a run's directory holds only "
                          f"what the run writes, choose a new RUN (e.g. {run}/<name>)")
        if work:
            common.refuse(f"RUN={run} holds a run's work ({', '.join(work)}) but no "
                          f"{records.RUN_SETTINGS} (the settings it was run with), so this "
                          "attempt's cannot be checked against them: restore the file, or choose a "
                          "new RUN")
        return {"FRESH": "0", "EXTEND": "0"}
    try:
        recorded = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        common.refuse(f"{path} is not valid JSON ({e}): it records the settings RUN={run} was run "
                      "with; restore it from a copy, or choose a new RUN")
    changed, raised = setting_changes(recorded, run_settings(k))
    if changed and work:
        common.refuse(f"RUN={run} was run with other settings: {'; '.join(changed)}. It holds "
                      f"finished work ({', '.join(work)}), which is kept: rerun with its settings "
                      f"({path}), or choose a new RUN (what a rerun may change: docs/running.md)")
    return {"FRESH": "1" if changed else "0", "EXTEND": "1" if raised and not changed else "0"}


def misspelt_knobs(environment):
    """Variables of the environment that are no knob of any launcher but close to one of
    run_stages.sh's (a typo the run would ignore): [(name, the knob)]."""
    import difflib  # only the settings check looks for typos
    known = set(KNOBS) | set(RENAMED) | launcher_knobs()
    return [(name, close[0]) for name in environment if name.isupper() and name not in known
            and (close := difflib.get_close_matches(name, KNOBS, n=1, cutoff=0.85))]


def launcher_knobs():
    """Every variable the shell scripts here read as a knob (NAME=${NAME:-...}, : "${NAME:=...}") or
    set for the others (run_stages.sh's exports among them), so that a frontier's or a table's knobs
    are no typos of the run's."""
    names = set()
    for script in Path(__file__).resolve().parents[1].glob("*.sh"):
        names |= set(re.findall(r"\b([A-Z][A-Z0-9_]*)=", script.read_text()))
    return names


def resolve(knobs):
    """The knobs (name → the shell's value, every one of KNOBS; a phase knob may be absent) checked
    and their defaults resolved, in one pass: (the resolved knobs, the first problem or None). An
    empty value is a default still to resolve."""
    k = dict(knobs)
    gpus = int(k["GPUS"]) if re.fullmatch(r"[0-9]+", k.get("GPUS", "")) else 0
    defaults = {"ENGINES": str(max(gpus, 1)), "TRAIN_RANKS": str(max(gpus, 1)),
                "SAVE_EVERY": k.get("EVAL_EVERY", ""),
                "RUN": f"runs/{k.get('PRESET')}-{k.get('LOSS')}"}
    for name, value in defaults.items():
        k[name] = k.get(name) or value
    # passed as flags; the others are their blocks'
    given = {name for name in PHASE_KNOBS if k.get(name)}
    for name in PHASE_KNOBS.keys() - given:
        k[name] = block_default(name)
    # OPTIMIZE_FLAGS, GENERATE_FLAGS, ...
    for script in sorted({script for script, _ in PHASE_KNOBS.values()}):
        k[flags_variable(script)] = " ".join(f"--{flag}={k[name]}"
                                             for name, (where, flag) in PHASE_KNOBS.items()
                                             if where == script and name in given)
    # the LOSS preset's flags, and its β of the KL penalty unless KL_COEF is given
    try:
        k["LOSS_FLAGS"], row = loss_flags(k.get("LOSS", ""),
                                          k.get("NAV_DELTA", "")), L().preset(k.get("LOSS", ""))
        k["KL_COEF"] = k["KL_COEF"] or str(row.kl_coef)
    except ValueError as e:
        return k, str(e)
    for name, knob in KNOBS.items():
        if name not in k:
            return k, f"{name} is not set (run_stages.sh has every knob)"
        if name in PLAN_DEFAULTS and not k[name]:
            continue
        if problem := knob.rule(name, k[name]):
            return k, problem
    # the drift plan's knobs, given to a fixed run: a run other than the one asked for
    if k["STAGE_END"] == "fixed":
        fixed = int(k["STAGES"]) * int(k["UPDATES_PER_STAGE"])
        if k["TOTAL_UPDATES"] and int(k["TOTAL_UPDATES"]) != fixed:
            return k, (f"TOTAL_UPDATES={k['TOTAL_UPDATES']}, and with STAGE_END=fixed the run has "
                       f"STAGES × UPDATES_PER_STAGE = {k['STAGES']} × {k['UPDATES_PER_STAGE']} = "
                       f"{fixed} updates: set STAGES (TOTAL_UPDATES is the drift plan's)")
        if k["DRIFT_MAX_UPDATES"]:
            return (k, f"DRIFT_MAX_UPDATES={k['DRIFT_MAX_UPDATES']} sizes drift stages, which "
                       "STAGE_END=fixed has none of")
    plan = stage_plan(k)               # the plan's defaults, resolved where the plan is
    k["TOTAL_UPDATES"], k["DRIFT_MAX_UPDATES"] = (
        str(plan.total_updates), str(plan.drift_max_updates))
    if gpus > 0:
        for name in ("ENGINES", "TRAIN_RANKS"):
            if int(k[name]) > gpus:
                return (k, f"{name}={k[name]} is more than GPUS={gpus} (one engine, one trainer "
                           "rank per GPU)")
    nnodes, node_rank = int(k["NNODES"]), int(k["NODE_RANK"])
    if node_rank >= nnodes:
        return k, f"NODE_RANK must be in 0..{nnodes - 1} (NNODES={nnodes}), got {node_rank}"
    if k["RESIDENT"] == "true" and nnodes > 1:
        return k, ("RESIDENT=true runs on one node (its hand-off goes through one machine's "
                   f"/dev/shm); use RESIDENT=false on {nnodes} nodes")
    if k["EVAL_CACHE"] and nnodes > 1:
        return k, f"EVAL_CACHE reuses evaluations on one node; leave it empty on {nnodes} nodes"
    # CUDA IPC hands each rank's buffer to the engine worker on the same GPU (handles keyed by the
    # GPU's UUID: vllm/distributed/weight_transfer/ipc_engine.py, receive_weights): an engine GPU
    # without a trainer rank gets no weights (the first hand-off fails), and a rank's buffer on a
    # GPU without an engine is never opened, so torch's IPC reference count never frees it (a buffer
    # per hand-off). run_stages.sh's engines are one GPU each
    if (k["RESIDENT"] == "true" and k["HANDOFF"] == "transfer" and gpus
        and k["ENGINES"] != k["TRAIN_RANKS"]):
        return k, ("HANDOFF=transfer hands each trainer rank's weights to the engine on its GPU "
                   "(CUDA IPC): every trainer rank's GPU needs an engine and every engine's GPU a "
                   f"trainer rank, so ENGINES must equal TRAIN_RANKS, got ENGINES={k['ENGINES']} "
                   f"and TRAIN_RANKS={k['TRAIN_RANKS']}; or HANDOFF=files")
    # vLLM samples greedily below a temperature of 1e-5 (vllm/sampling_params.py _SAMPLING_EPS), one
    # response per prompt (_verify_greedy_sampling: "n must be 1 when using greedy sampling")
    if float(k["TEMPERATURE"]) < 1e-5:
        return k, (f"TEMPERATURE={k['TEMPERATURE']} samples greedily, one response per prompt: a "
                   f"group of GROUP_SIZE={k['GROUP_SIZE']} needs TEMPERATURE > 0 (the paper's 1.0)")
    if float(k["EVAL_TEMPERATURE"]) < 1e-5 and int(k["EVAL_K"]) > 1:
        return k, (f"EVAL_TEMPERATURE={k['EVAL_TEMPERATURE']} samples greedily, one response per "
                   f"problem: EVAL_K={k['EVAL_K']} needs EVAL_TEMPERATURE > 0, or EVAL_K=1")
    if k["PREFLIGHT"] == "auto":
        k["PREFLIGHT"] = "1" if k["PRESET"] == "paper" else "0"
    if k["PREFLIGHT_REPORT"] and k["PREFLIGHT"] != "0":
        return k, (f"PREFLIGHT_REPORT={k['PREFLIGHT_REPORT']} names another run's preflight, and "
                   f"PREFLIGHT={k['PREFLIGHT']} runs this one's: give PREFLIGHT=0 with it")
    if k["PREFLIGHT_REPORT"] and not Path(k["PREFLIGHT_REPORT"]).is_file():
        return k, (f"PREFLIGHT_REPORT={k['PREFLIGHT_REPORT']} does not exist: run that preflight "
                   "first (table1.sh: its model's preparation, prepare.txt)")
    if k["PREFLIGHT_ONLY"] == "true" and k["PREFLIGHT"] == "0" and not (
        k["EVAL_CACHE"] and k["EVAL_EVERY"] != "0"):
        return k, ("PREFLIGHT_ONLY=true stops after the preflight and the initial evaluation kept "
                   "in EVAL_CACHE, and this runs neither: use PREFLIGHT=1 (or an EVAL_CACHE)")
    problem = run_problems(k)
    # β as the run's Loss has it (its row, or LOSS_ARGS' --kl_coef):
    if problem is None and "KL_COEF" not in given:
        # run_stages.sh points KL's reference at MODEL when it is > 0
        k["KL_COEF"] = str(run_loss(k).kl_coef)
    return k, problem


FLAG_KNOBS = {"LOSS_ARGS": "optimize.py", "DRIFT_ARGS": "optimize.py",
              "PREFLIGHT_ARGS": "mu_grpo/preflight.py"}


def knob_flags(name, text):
    """The flags a knob holds for its script (FLAG_KNOBS), parsed as that script will parse them:
    ({flag: value}, the first problem or None). A misspelt flag fails here, before any compute, not
    when its phase starts hours in."""
    import difflib  # only the settings check looks for typos
    script = FLAG_KNOBS[name]
    defaults, values = common.script_defaults(ROOT / script, computed=True), {}
    for arg in shlex.split(text):
        key, eq, raw = arg.removeprefix("--").partition("=")
        key = key.replace("-", "_")
        if not arg.startswith("--") or not eq:
            return values, f"{name}={text}: {arg!r} is not a --key=value flag of {script}"
        if key not in defaults:
            close = difflib.get_close_matches(key, defaults, n=1)
            return values, (f"{name}={text}: --{key} is no flag of {script}"
                            + (f" (did you mean --{close[0]}?)" if close else ""))
        try:
            values[key] = common._parse_value(key, raw, defaults[key])
        except SystemExit as e:
            return values, f"{name}={text}: {e}"
    return values, None


def run_problems(k):
    """A value that passes its own rule but leaves the run meaningless, or silently other than
    asked, given the rest of the run's knobs (resolve's last checks), or None."""
    flags = {}
    for name in FLAG_KNOBS:
        values, problem = knob_flags(name, k[name])
        if problem:
            return problem
        flags[name] = values
    if "loss" in flags["LOSS_ARGS"]:
        return (f"LOSS_ARGS={k['LOSS_ARGS']} names a loss preset: that is LOSS's "
                f"(LOSS={flags['LOSS_ARGS']['loss']})")
    loss, given = loss_knobs(k)
    loss = {**loss, **flags["DRIFT_ARGS"]}
    if loss["nav_delta"] is not None and loss["nav_delta"] <= 0:
        return (f"NAV δ {loss['nav_delta']} (LOSS={k['LOSS']}, NAV_DELTA or LOSS_ARGS) never "
                "triggers, since a ratio is positive: NAV is off that way without saying so; turn "
                "it off with --nav_delta=none (LOSS=relaxed-no-nav) or give δ > 0 (the paper's "
                "1e-4)")
    if (loss["clip_low"] is not None and loss["clip_high"] is not None
        and loss["clip_low"] >= loss["clip_high"]):
        return (f"the clip interval [{loss['clip_low']}, {loss['clip_high']}] (LOSS={k['LOSS']}, "
                "LOSS_ARGS) is empty")
    try:                               # the Loss optimize.py will make, made here first
        run_loss(k)
    except ValueError as e:
        args = f" with LOSS_ARGS={shlex.quote(k['LOSS_ARGS'])}" if k["LOSS_ARGS"] else ""
        return f"LOSS={k['LOSS']}{args}: {e}"
    if k["STAGE_END"] == "drift" and loss["drift_window"] < 1:
        return (f"STAGE_END=drift with --drift_window={loss['drift_window']} (DRIFT_ARGS): the "
                "warning never comes, so no stage ends on drift; give a window of at least 1 "
                "update, or STAGE_END=fixed")
    if k["STAGE_END"] == "fixed" and k["DRIFT_ARGS"]:
        return (f"DRIFT_ARGS={k['DRIFT_ARGS']} sets the drift warning, which only STAGE_END=drift "
                "uses (it is fixed)")
    run_updates = stage_plan(k).run_updates
    if int(k["WARMUP"]) >= run_updates:
        return (f"WARMUP={k['WARMUP']} updates is at least the run's {run_updates}: the learning "
                f"rate never reaches LR={k['LR']}")
    if int(k["STAGE_WARMUP"]) >= int(k["UPDATES_PER_STAGE"]):
        return (f"STAGE_WARMUP={k['STAGE_WARMUP']} updates is at least a stage's "
                f"{k['UPDATES_PER_STAGE']}: the learning rate never reaches LR={k['LR']} within a "
                "stage")
    if int(k["SAVE_POLICY_EVERY"]) >= int(k["UPDATES_PER_STAGE"]) and k["STAGE_END"] == "fixed":
        return (f"SAVE_POLICY_EVERY={k['SAVE_POLICY_EVERY']} saves a policy within a stage every "
                f"so many updates, and a stage has {k['UPDATES_PER_STAGE']}: none would be saved; "
                "0 turns the saves off")
    if k["EVAL_CACHE"] and Path(k["EVAL_CACHE"]).exists() and not Path(k["EVAL_CACHE"]).is_dir():
        return f"EVAL_CACHE={k['EVAL_CACHE']} is a file: it names a directory of kept evaluations"
    return None


def loss_knobs(k):
    """optimize.py's loss block as the run gives it (LOSS_FLAGS, then LOSS_ARGS over the block's
    values), and the names given as flags."""
    # (resolve's, else made here)
    preset = k.get("LOSS_FLAGS") or loss_flags(k["LOSS"], k.get("NAV_DELTA", ""))
    given = {**knob_flags("LOSS_ARGS", preset)[0], **knob_flags("LOSS_ARGS", k["LOSS_ARGS"])[0]}
    return {**common.script_defaults(ROOT / "optimize.py"), **given}, given


def run_loss(k):
    """The loss.Loss optimize.py trains the run with (loss.resolve_loss of its loss block), or the
    ValueError."""
    loss, given = loss_knobs(k)
    return L().resolve_loss(k["LOSS"], loss, given, loss["objective_args"])


def L():
    """loss.py (its torch import is paid only by the steps that read the LOSS presets)."""
    import loss  # (torch: only the steps that read the LOSS presets pay its import)
    return loss


def preset_names():
    """The names of loss.py's LOSS presets, read from its PRESETS table without running it (without
    torch: a login node checks a table's methods with the system's Python)."""
    import ast  # only these checks read loss.py's text
    for node in ast.parse((ROOT / "loss.py").read_text()).body:
        targets = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        if isinstance(node, ast.Assign) and targets == ["PRESETS"]:
            return [key.value for key in node.value.keys]


def check_loss_name(name):
    """A LOSS that names no preset: the line naming them, else None."""
    names = preset_names()
    return None if name in names else f"LOSS must be one of {' '.join(names)}, got {name!r}"


def loss_flags(name, nav_delta=""):
    """optimize.py's flags of the LOSS preset `name`: --loss=<name>, and --nav_delta=NAV_DELTA when
    its row has NAV (the presets without NAV ignore NAV_DELTA). A name of no preset: the ValueError
    naming them."""
    row = L().preset(name)
    return f"--loss={name}" + (f" --nav_delta={nav_delta}" if nav_delta
                               and row.nav_delta is not None else "")


def stage_plan(k):
    """The run's stage_rules.StagePlan from its knobs (the loop per phase saves every stage)."""
    return stage_rules.StagePlan(int(k["UPDATES_PER_STAGE"]), int(k["STAGES"]), k["STAGE_END"],
                                 total_updates=int(k["TOTAL_UPDATES"] or 0),
                                 drift_growth=float(k["DRIFT_GROWTH"]),
                                 drift_max_updates=int(k["DRIFT_MAX_UPDATES"] or 0),
                                 prompts_per_update=int(k["PROMPTS_PER_UPDATE"]),
                                 eval_every=int(k["EVAL_EVERY"]),
                                 save_every=int(k["SAVE_EVERY"] or 0)
                                 if k.get("RESIDENT") == "true" else 1)


def derived(k):
    """The numbers and paths the loop uses, computed from the resolved knobs."""
    node0, plan = k["NODE_RANK"] == "0", stage_plan(k)
    first = plan.stage(k["RUN"], 0)
    return {"PROMPTS_PER_STAGE": str(first.prompts),
            "EVALUATE_INITIAL": str(first.evaluate).lower(), "RUN_UPDATES": str(plan.run_updates),
            "LOGS": k["RUN"] + ("/logs" if node0 else f"/logs/node{k['NODE_RANK']}"),
            "LOCK": k["RUN"] + ("/.lock" if node0 else f"/.lock.node{k['NODE_RANK']}"),
            "SETTINGS": "".join(f"{n}={k[n]}\n" for n in SHARED),
            "TEMPLATE_FLAG": " ".join(template_args(k["TEMPLATE"]))}


def assignments(values):
    return "\n".join(f"{name}={shlex.quote(value)}" for name, value in values.items())


def settings_command():
    # a knob's old name: ignored, it would leave the setting unsaid
    for old, new in RENAMED.items():
        if old in os.environ:
            common.refuse(f"{old}={os.environ[old]}: the knob is {new} now")
    for name, knob in misspelt_knobs(os.environ):
        common.refuse(f"{name}={os.environ[name]} is not a knob: did you mean {knob}? "
                      "(run_stages.sh's variables)")
    knobs = {name: os.environ[name] for name in KNOBS if name in os.environ}
    # empty: every GPU torch sees
    knobs["GPUS"] = knobs.get("GPUS") or os.environ.get("VISIBLE_GPUS", "")
    k, problem = resolve(knobs)
    if problem:
        common.refuse(problem)
    visible = os.environ.get("VISIBLE_GPUS", "")
    if visible.isdigit() and int(k["GPUS"]) > int(visible):
        common.refuse(f"GPUS={k['GPUS']}, and torch sees {visible} GPU(s) here "
                      f"(CUDA_VISIBLE_DEVICES='{os.environ.get('CUDA_VISIBLE_DEVICES', '')}')")
    if k["REPORT_TO"] != "none":
        from mu_grpo import tracking  # the trackers' module: only the settings step reads it
        try:
            tracking.check(k["REPORT_TO"])
        except SystemExit as e:
            common.refuse(str(e))
    values = assignments({**k, **derived(k), **rerun_check(k)})
    plan = (f"stages that end on drift, the first of {k['UPDATES_PER_STAGE']} updates, until "
            f"{k['TOTAL_UPDATES']} updates" if k["STAGE_END"] == "drift"
            else f"{k['STAGES']} stages × {k['UPDATES_PER_STAGE']} updates")
    print(f"run {k['RUN']}: {k['PRESET']} preset, loss {k['LOSS']}; {plan} of "
          f"{k['PROMPTS_PER_UPDATE']} prompts × G={k['GROUP_SIZE']}; model {k['MODEL']}; GPUs "
          f"{k['GPUS']}", file=sys.stderr)
    print(values)


def lock_command():
    """run_stages.sh's lock on its run directory, taken on the descriptor 9 it opened (flock locks
    the open file, which the script keeps after this process ends). Another holder, and a filesystem
    without locks (Lustre mounted without -o flock: "No locks available"), are told apart."""
    try:
        fcntl.flock(9, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"another run_stages.sh is running on {os.environ['RUN']} (it holds "
                 f"{os.environ['LOCK']}); wait for it or choose another RUN")
    except OSError as e:
        sys.exit(f"cannot lock {os.environ['LOCK']} ({e.strerror}): RUN's filesystem may not "
                 "support locks (Lustre: mount it with -o flock), or choose a RUN on another "
                 "filesystem")


def preset_command():
    """The preset (auto: paper with GPUs, else toy) and, for the presets that use it, the GPUs torch
    sees (VISIBLE_GPUS: the paper preset's default GPUS). The CPU presets skip torch's count:
    importing torch for it is about 2.5 s of every run_stages.sh start."""
    preset = os.environ.get("PRESET", "auto")
    if preset not in ("auto", "paper"):
        if preset not in ("toy", "lab", "lab-fork"):
            common.refuse(f"PRESET must be auto, paper, toy, lab or lab-fork, got '{preset}'")
        # given for a CPU preset: counted too (settings_command checks it)
        gpus = os.environ.get("GPUS", "")
        print(assignments({"PRESET": preset, **({"VISIBLE_GPUS": str(common.gpu_count())}
                                                if gpus.isdigit() and int(gpus) > 0 else {})}))
        return
    visible = common.gpu_count()
    if preset == "auto":
        preset = "paper" if visible > 0 else "toy"
        print(f"PRESET=auto: using the '{preset}' preset ("
              f"{f'{visible} GPU(s) found' if preset == 'paper' else 'no GPU found'})",
              file=sys.stderr)
    if preset == "paper" and visible == 0:
        common.refuse(f"PRESET=paper needs GPUs and torch sees none here (CUDA_VISIBLE_DEVICES="
               f"'{os.environ.get('CUDA_VISIBLE_DEVICES', '')}'); on a CPU machine use PRESET=toy "
               "or PRESET=lab")
    print(assignments({"PRESET": preset, "VISIBLE_GPUS": str(visible)}))


def run_or_exit(cmd):
    """A step's command, its own output on the terminal; its failure ends this one with its
    status."""
    if status := subprocess.run(cmd).returncode:
        sys.exit(status)


def build_command():
    """Node 0, before the others look: the toy and lab tasks and their warm-started policies built
    where the preset's MODEL is missing, the paper's training data fetched, and on several nodes the
    benchmarks evaluate.py would fetch on every node at once."""
    e = os.environ
    builder = {"toy": "data/toy.py", "lab": "data/lab.py",
               "lab-fork": "data/lab_fork.py"}.get(e["PRESET"])
    # the preset's own policy: data/<task>/model
    built = builder and Path(builder).with_suffix("") / "model"
    if built and e["MODEL"] == str(built) and not (built / "config.json").exists():
        run_or_exit([sys.executable, builder, f"--out_dir={built.parent}"])
    if e["PRESET"] == "paper" and not Path(e["TRAIN_DATA"]).exists():
        run_or_exit([sys.executable, "data/prepare.py", "--name=deepscaler",
                     f"--out={e['TRAIN_DATA']}"])
    if int(e["NNODES"]) > 1:
        from mu_grpo import benchmarks  # only the build step fetches benchmarks
        benchmarks.benchmark_sets(e["BENCHMARKS"].split(","), e["EVAL_DATA_DIR"])


def start_up_command():
    """Every node, before any compute: node 0 builds or fetches the model and data (build_command)
    while the others wait for its word (mu_grpo/nodes.py ready: started first, they would find
    nothing at those paths yet, and take a directory not built yet for a hub name); the model and
    data prepared (prepared); on several nodes, all of them checked to have the same settings, model
    and data (mu_grpo/nodes.py join), then the trainers' network (collective_command); the run's
    start, node 0's. The assignments run_stages.sh evals go to descriptor 3 (stdout stays the
    terminal's)."""
    e, several, node0 = os.environ, int(os.environ["NNODES"]) > 1, os.environ["NODE_RANK"] == "0"
    node_flags = [f"--nnodes={e['NNODES']}", f"--node_rank={e['NODE_RANK']}", f"--store={store}",
                  f"--join_timeout_s={e['JOIN_TIMEOUT']}"]
    if node0:
        settle_record()
        build_command()
    is_dir = "1" if Path(e["MODEL"]).is_dir() else "0"
    if several:         # node 0's word: on another node a directory may not be visible yet
        is_dir = nodes_command("ready", *node_flags, f"--value={is_dir}", capture=True)
    with contextlib.redirect_stdout(sys.stderr):      # the libraries' output
        values = prepared({**e, "MODEL_IS_DIR": is_dir})
    if node0:
        record_settings()
    if several:
        data = ",".join([e["TRAIN_DATA"],
                         *(f"{e['EVAL_DATA_DIR']}/{b}.jsonl" for b in e["BENCHMARKS"].split(","))])
        nodes_command("join", *node_flags, f"--run_dir={e['RUN']}", f"--model={values['MODEL']}",
                      f"--data={data}", f"--settings={e['SETTINGS']}")
        collective_command()
    marker = Path(e["RUN"]) / ".done" / "start"
    if node0 and not marker.exists():
        marker.write_text(f"{int(time.time())}\n")
    values["START"] = marker.read_text().strip() if node0 else ""
    if several:
        values["START"] = nodes_command("share", *node_flags, "--key=start",
                                        f"--value={values['START']}", capture=True)
    with open(3, "w") as out:
        out.write(assignments(values) + "\n")


def settle_record():
    """Node 0, under the run's lock, before the start-up builds anything: FRESH (rerun_check), what
    an attempt that left no finished work wrote is removed (the names a run writes,
    records.RUN_NAMES; its logs stay), said; EXTEND, a finished run's end marker removed so that it
    goes on, said. The settings are recorded later (record_settings), once the model and data are
    checked."""
    e, run = os.environ, Path(os.environ["RUN"])
    if e.get("FRESH") == "1":
        gone = [p for p in run.iterdir() if p.name not in ("logs", ".lock")
                and not p.name.startswith(".lock.")
                and any(fnmatch.fnmatch(p.name, name) for name in records.RUN_NAMES)]
        print(f"[run] the last attempt on {run} finished nothing and had other settings: what it "
              f"left ({', '.join(sorted(p.name for p in gone))}) is cleared", flush=True)
        for p in gone:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        (run / ".done").mkdir()
    if e.get("EXTEND") == "1":
        (run / ".done" / "all").unlink(missing_ok=True)
        print(f"[run] {run} goes on to STAGES={e['STAGES']} (TOTAL_UPDATES={e['TOTAL_UPDATES']})",
              flush=True)


def record_settings():
    """Node 0, once the model and data are checked: the run's settings recorded where none are, or
    rewritten after FRESH or EXTEND (a refused first attempt records nothing: its directory is no
    run yet)."""
    e, record = os.environ, Path(os.environ["RUN"]) / records.RUN_SETTINGS
    if e.get("FRESH") == "1" or e.get("EXTEND") == "1" or not record.exists():
        common.atomic_write_json(record, run_settings(e))
        return
    # files fetched after the first record (the paper's benchmarks,
    recorded = json.loads(record.read_text())
    # at its first evaluation)
    if new := {p: h for p, h in data_files(e).items() if p not in recorded.get("data", {})}:
        common.atomic_write_json(record, {**recorded, "data": {**recorded.get("data", {}), **new}})


def finished_command():
    """Whether run_stages.sh's phase `name` is finished (prints 1 or 0), by the run's records
    (records.phase_finished: the rule both modes' records answer, so a run switched between modes
    skips what the other finished)."""
    print(int(records.phase_finished(os.environ["RUN"], name)))


def nodes_command(name, *flags, capture=False):
    """mu_grpo/nodes.py's command `name`; its failure ends this one with its status. capture:
    returns what it printed."""
    proc = subprocess.run([sys.executable, "-m", "mu_grpo.nodes", f"--command={name}", *flags],
                          text=True, stdout=subprocess.PIPE if capture else None)
    if proc.returncode:
        sys.exit(proc.returncode)
    return proc.stdout.strip() if capture else None


def prepared(env):
    model = env["MODEL"]
    # a hub name (node 0's word on several nodes: mu_grpo/nodes.py ready)
    if env["MODEL_IS_DIR"] == "0":
        # downloaded once (on each node); every phase reads the local copy
        model = common.local_dir(model)
    try:
        common.require_policy(model, "MODEL", given=env["MODEL"])
    except SystemExit as e:
        common.refuse(str(e))
    try:
        rows = common.load_problems(env["TRAIN_DATA"])
    except (OSError, ValueError) as e:
        common.refuse(f"TRAIN_DATA={env['TRAIN_DATA']} is not a prepared problem file (see "
                      f"data/prepare.py): {e}")
    if not rows:
        common.refuse(f"TRAIN_DATA={env['TRAIN_DATA']} has no problems (see data/prepare.py)")
    print_overlap(rows, env)
    per_stage = int(env.get("PROMPTS_PER_STAGE") or 0)
    # (the paper's own: 65,536 prompts a stage from DeepScaleR's ~40k): said, not refused
    if per_stage > len(rows):
        print(f"[run] a stage's {per_stage} prompts are {per_stage / len(rows):.2f} passes over "
              f"TRAIN_DATA's {len(rows)} problems: a stage samples some problems twice, in groups "
              "of their own (stage_rules.shuffled_window)", file=sys.stderr)
    # the prompt its model card shows
    if env["TEMPLATE"] in ("chat", "chat-system") or model_cards.known(env["MODEL"]):
        # (2-3 s: not for the toy and lab tasks' plain prompts)
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model)
        if problem := model_cards.check_prompt(tokenizer, env["MODEL"], env["TEMPLATE"]):
            common.refuse(problem)
    share = env["RESIDENT_GPU_MEMORY"]
    # the engines' share must leave the trainer its memory
    if env["RESIDENT"] == "true" and int(env["GPUS"]) > 0:
        # (2 s, and mu_grpo/trainer_model.py's: only on a resident GPU run, not for every phase's
        # row)
        import torch

        from mu_grpo import handoff  # handoff, model: only on a resident GPU run
        from mu_grpo import trainer_model as M
        share = str(handoff.check_engine_share(M.parameter_count(model), env["TRAIN_RANKS"], share,
                                               env["KL_COEF"],
                                               torch.cuda.get_device_properties(0).total_memory))
    elif share == "auto":
        share = "0.1"            # a CPU engine's own (engine.make_llm): there the share is unused
    return {"MODEL": model, "RESIDENT_GPU_MEMORY": share}


def print_overlap(rows, env):
    """Name each benchmark that shares problems with the training data (the same text, spaces and
    case aside): its accuracy is then not held-out. A line, not a refusal: the overlap may be known
    and meant."""
    text = lambda row: " ".join(str(row["problem"]).lower().split())  # noqa: E731
    trained = {text(r) for r in rows}
    for name in env.get("BENCHMARKS", "").split(","):
        path = Path(env.get("EVAL_DATA_DIR", "")) / f"{name}.jsonl"
        if name and path.is_file():
            problems = common.load_problems(path)
            if shared := sum(text(r) in trained for r in problems):
                print(f"[run] TRAIN_DATA={env['TRAIN_DATA']} holds {shared} of benchmark {name}'s "
                      f"{len(problems)} problems ({path}): its accuracy on them is not held-out",
                      file=sys.stderr)


def stage_command(s):
    """Stage s as the plan decides it, in assignments run_stages.sh evals (several nodes: node 0's,
    shared), and the stage's line on stderr."""
    from mu_grpo import tracking  # the stage's line: only this step reads the run's records for it
    plan, run = stage_plan(os.environ), os.environ["RUN"]
    decided = plan.stage(run, s)
    if decided.updates:
        print(tracking.where_line(run, plan.run_updates, s), file=sys.stderr, flush=True)
    print(assignments({"STAGE_UPDATES": str(decided.updates), "STAGE_PROMPTS": str(decided.prompts),
                       "EVALUATE": str(decided.evaluate).lower()}).replace("\n", " "))


def recorded_command():
    """The recorded settings of the run in RUN that a replay of its stage takes (ablate.sh
    LAB=paper), as shell assignments."""
    knobs = json.loads((Path(os.environ["RUN"]) / records.RUN_SETTINGS).read_text())["knobs"]
    print(assignments({**{n: knobs[n] for n in ("MODEL", "TRAIN_DATA", "EVAL_DATA_DIR",
                                                "BENCHMARKS", "MAX_PROMPT", "MAX_RESPONSE")},
                       "TEMPLATE_FLAG": " ".join(template_args(knobs["TEMPLATE"]))}))


def loss_flags_command():
    """optimize.py's flags of the LOSS preset (LOSS, NAV_DELTA from the environment), or the line
    naming the presets."""
    try:
        print(loss_flags(os.environ["LOSS"], os.environ.get("NAV_DELTA", "")))
    except ValueError as e:
        common.refuse(str(e))


def preflight_command():
    """mu_grpo/preflight.py at the run's settings (its miniature's size: PREFLIGHT_ARGS); KL: the
    trainer's KL flags."""
    e = os.environ
    # the trainer's μ_min, if given
    drift_min = re.findall(r"--drift_min_updates=[0-9]+", e["DRIFT_ARGS"])[-1:]
    sys.exit(subprocess.run([
        sys.executable, "-m", "mu_grpo.preflight", f"--policy={e['MODEL']}",
        f"--data={e['TRAIN_DATA']}", f"--out={e['RUN']}/preflight.json", f"--run_dir={e['RUN']}",
        f"--gpus={e['GPUS']}", f"--engines={e['ENGINES']}", f"--train_ranks={e['TRAIN_RANKS']}",
        f"--stages={e['STAGES']}", f"--micro_batch_tokens={e['MICRO_BATCH_TOKENS']}",
        f"--max_prompt_tokens={e['MAX_PROMPT']}", f"--max_response_tokens={e['MAX_RESPONSE']}",
        "--optimize_args=" + " ".join(
            x for x in (f"--gradient_checkpointing={e['GRAD_CKPT']}", e["LOSS_FLAGS"],
                        e["LOSS_ARGS"],
                                                  f"--kl_coef={e['KL_COEF']}", e["KL"]) if x),
        f"--temperature={e['TEMPERATURE']}", f"--group_size={e['GROUP_SIZE']}",
        f"--force={'true' if e['PREFLIGHT'] == 'force' else 'false'}",
        f"--estimate_stage_prompts={e['PROMPTS_PER_STAGE']}", f"--resident={e['RESIDENT']}",
        f"--resident_gpu_memory={e['RESIDENT_GPU_MEMORY']}",
        f"--updates_per_stage={e['UPDATES_PER_STAGE']}", f"--stage_end={e['STAGE_END']}",
        f"--total_updates={e['TOTAL_UPDATES']}", f"--drift_max_updates={e['DRIFT_MAX_UPDATES']}",
        f"--save_every={e['SAVE_EVERY']}", f"--keep_train_states={e['KEEP_TRAIN_STATES']}",
        f"--policy_handoff={e['HANDOFF']}", *drift_min, *template_args(e["TEMPLATE"]),
        *e["PREFLIGHT_ARGS"].split()]).returncode or None)


def handoff_command():
    """The hand-off a resident run uses (printed): HANDOFF, or files when the run's preflight
    (PREFLIGHT_REPORT, else its own preflight.json) found the weight transfer failing on this box
    and fell back (figures.policy_handoff), which one line on stderr says."""
    e = os.environ
    report = Path(e.get("PREFLIGHT_REPORT") or Path(e["RUN"]) / "preflight.json")
    fell_back = e["HANDOFF"] == "transfer" and report.exists() and \
        json.loads(report.read_text()).get("figures", {}).get("policy_handoff") == "files"
    if fell_back:
        print("HANDOFF=transfer: the preflight found the weight transfer failing on this box "
              f"({report}); the policies are handed over as files", file=sys.stderr)
    print("files" if fell_back else e["HANDOFF"])


def template_args(template):
    """The prompt template flag of generate.py, evaluate.py and mu_grpo/preflight.py: plain and
    chat-system, the problem alone (model_cards.py TEMPLATES)."""
    return (["--prompt_template={problem}"]
            if model_cards.prompt_template(template) == "{problem}" else [])


def collective_command():
    """The trainers' network, right after the nodes' join and not in the first update: every rank of
    every node (torchrun at MASTER_PORT + 1, optimize.py's backend and devices: mu_grpo/nodes.py
    collective) all-reduces one number within COLLECTIVE_TIMEOUT; `timeout` bounds a hang. On a
    failure, one line (a rank's own, else this one)."""
    env, (addr, port) = os.environ, store.rsplit(":", 1)
    timeout_s, log_path = int(env["COLLECTIVE_TIMEOUT"]), Path(logs) / "collective.log"
    with open(log_path, "w") as log:
        status = subprocess.run(
            ["timeout", "-k", "10", str(2 * timeout_s + 30), sys.executable, "-m",
             "torch.distributed.run", f"--nnodes={env['NNODES']}",
             f"--node_rank={env['NODE_RANK']}", f"--nproc_per_node={env['TRAIN_RANKS']}",
             f"--master_addr={addr}", f"--master_port={int(port) + 1}",
             f"--rdzv_conf=timeout={timeout_s}", "-m", "mu_grpo.nodes", "--command=collective",
             f"--nnodes={env['NNODES']}", f"--node_rank={env['NODE_RANK']}", f"--store={store}",
             f"--collective_timeout_s={timeout_s}"],
            stdout=log, stderr=subprocess.STDOUT).returncode
    text = log_path.read_text(errors="replace")
    if status != 0:
        line = next((x for x in text.splitlines() if "process group across" in x), None) or (
            f"node {env['NODE_RANK']}: the trainers' ranks did not all reach each other within "
            f"{timeout_s} s (torchrun's rendezvous at {addr}:{int(port) + 1}, then one "
            "all-reduce): likely a blocked port or the wrong interface (NCCL_SOCKET_IFNAME, "
            "GLOO_SOCKET_IFNAME)")
        print(f"{line} (whole output: {log_path})", file=sys.stderr)
        sys.exit(1)
    for line in text.splitlines():
        if "reached each other" in line and env["NODE_RANK"] == "0":
            print(line)


# ----------------------------------------------------------------------------- the terminal


def view_command():
    try:
        common.terminal_view(sys.stdin.buffer, sys.stdout.buffer)
    # Ctrl-C reaches the whole foreground group: the phase stops, this says nothing
    except KeyboardInterrupt:
        sys.exit(130)


def end_command():
    """As run_stages.sh ends, however it ends (exit `status`): the run's engine links and
    weight-transfer sockets in the temporary directory removed (engine.link_dir,
    handoff.transfer_socket); a new run refused before its first phase (status 2) removed, so that
    nothing is left of it; after a Ctrl-C or SIGTERM, the line saying how it goes on."""
    from mu_grpo import engine  # (light: vLLM is imported inside its functions)
    from mu_grpo import handoff
    run = os.environ["RUN"]
    for d in (engine.link_dir(run), handoff.transfer_socket(run, 0).parent):
        shutil.rmtree(d, ignore_errors=True)
    if status == 2 and new_run and os.environ.get("NODE_RANK", "0") == "0":
        shutil.rmtree(run, ignore_errors=True)
    if status in (130, 143):
        print(f"[run] stopped: rerun the same command to resume {run} where it stopped",
              file=sys.stderr)


def row_command():
    """A phase's row in the run's timeline (run_stages.sh's `phase`, node 0)."""
    records.append(os.environ["RUN"],
                   {"phase": name.rsplit("_", 1)[0], "name": name, "stage": stage, "start": start,
                                       "end": end})


# ----------------------------------------------------------------------------- resident mode


def resident_command(argv):
    """The engine process and the trainer for every stage (RESIDENT=true): a failed one stops the
    other (and what it started); a rerun resumes (the engine at the first stage without a manifest,
    the trainer at the last train state saved). Timed into timeline.jsonl as one row per attempt
    (records.attempt_row)."""
    from mu_grpo import handoff  # only the resident step reads the hand-off
    if "::" not in argv:
        raise SystemExit("--command=resident: ENGINE COMMAND :: TRAINER COMMAND")
    cut = argv.index("::")
    commands = {"engine": argv[:cut], "trainer": argv[cut + 1:]}
    run_dir = Path(os.environ["RUN"])
    handoff.reset(run_dir)
    records.close_killed_attempt(run_dir)
    print(f"[resident] the engine process ({os.environ['ENGINES']} engine(s)) and the trainer "
          f"({os.environ['TRAIN_RANKS']} rank(s)) for every stage: {run_dir}/logs/engine.log, "
          "trainer.log", flush=True)
    t0 = time.time()
    records.resident_started(run_dir, t0)
    ended = "stopped"                    # by a Ctrl-C
    try:
        failed, codes = processes.run_together(
            commands, {role: Path(logs) / f"{role}.log" for role in commands}, grace_s=STOP_GRACE_S,
            view=lambda stream: common.terminal_view(stream, sys.stdout.buffer))
        ended = "failed" if failed else "completed"
    # a Ctrl-C too: the handed-over policies (up to two, 15 GB each at 7B, in /dev/shm) are not
    # kept, a
    finally:
        # resumed trainer hands its policy over again from its files
        handoff.clear_policies(run_dir)
        records.attempt_row(run_dir, t0, time.time(), ended)
    if failed:
        print(f"[resident] failed (the {failed} exited with {codes[failed]}); see "
              f"{run_dir}/logs/engine.log and trainer.log; rerun to resume", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    argv = sys.argv[1:]          # this script's flags, then (resident) the two commands
    n_own = next((i for i, a in enumerate(argv) if not a.startswith("--")), len(argv))
    common.apply_overrides(globals(), argv[:n_own])
    rest = argv[n_own:]
    commands = {"lock": lock_command, "preset": preset_command, "settings": settings_command,
                "start": start_up_command, "preflight": preflight_command,
                "handoff": handoff_command, "stage": lambda: stage_command(stage),
                "resident": lambda: resident_command(rest), "view": view_command,
                "row": row_command, "finished": finished_command, "loss_flags": loss_flags_command,
                "recorded": recorded_command, "presets": lambda: print(" ".join(preset_names())),
                "end": end_command,
                "attempt": lambda: records.attempt_started(os.environ["RUN"], time.time())}
    common.check_choice("command", command, tuple(commands))
    commands[command]()
