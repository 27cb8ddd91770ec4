"""Optimize one stage: μ minibatch updates of the stage policy on its (increasingly stale) rollouts.

    python optimize.py --stage_dir=runs/toy/stage_0                     # one process: CPU, 1 GPU
    torchrun --nproc_per_node=4 optimize.py --stage_dir=runs/x/stage_0  # FSDP2 over 4 GPUs

The stage's groups are put once in a seeded order and cut into `updates_per_stage` minibatches of
`prompts_per_update` groups: update u trains on minibatch u, data exactly u updates stale, no
response used twice (docs/design.md §1). An update (update.py) is one AdamW step on
loss.policy_loss: the loss is summed over packed micro-batches and ranks and normalised as its
aggregation says (μ-GRPO's: by the minibatch's kept-token count). With --resident, one
process trains a run's every stage, each of the μ that stage_rules.StagePlan gives it.

Writes next to --out (default <stage_dir>/policy): the next policy (an HF directory vLLM loads, in
the initial model's dtype), metrics.jsonl (one line per update), optimize_timing.json, and
train_state/ (fp32 weights and AdamW moments; DCP, sharded), from which a rerun resumes and the next
stage continues (--init_state): a run's stages are one optimization whose rollouts are refreshed.
Derived caches of the stage (rollout columns, per-stage log-prob passes) go into the stage
directory.
"""
import dataclasses
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import loss as L
from mu_grpo import checkpoint, common, handoff, passes, records, stage_rules
from mu_grpo.resident_trainer import trainer_start
from mu_grpo import trainer_model as M
import update

# ----------------------------------------------------------------------------- hyperparameters
# the stage and its outputs
stage_dir = "runs/toy/stage_0"  # holds rollouts/ (JSONL read only; its columns are built there if
                                # missing)
policy = ""                     # stage policy to start from (default: the one that generated the
                                # rollouts)
out = ""                        # next policy directory (default: <stage_dir>/policy);
                                # metrics.jsonl, train_state/ and the other outputs go next to it
                                # (replays: elsewhere)
init_state = ""                 # the previous stage's train_state/: continue its fp32 weights,
                                # AdamW moments and update count (run_stages.sh passes it); empty:
                                # `policy`, fresh AdamW
save_train_state = True         # keep train_state/ at the end (the next stage's --init_state)
release_older_states = False    # delete the run's older train states (stage_<t>/train_state, t <
                                # this stage) once this stage's own is written into its directory
                                # and kept (run_stages.sh: true unless KEEP_TRAIN_STATES), so two
                                # states coexist, not three

# the schedule: which rollouts each update trains on
updates_per_stage = 16          # μ: optimizer updates on this stage's rollouts (paper: 1024; GRPO:
                                # 4; resident with stage_end=drift: the first stage's)
prompts_per_update = 8          # whole groups per update (paper: 64 prompts × G=8 = 512 responses)
skip_zero_variance = False      # True: leave out groups whose rewards are all equal and draw
                                # minibatches from repeated passes over the rest (responses reused:
                                # an ablation, not the paper)
seed = 0                        # the seeded order in which the stage's groups become minibatches

# the stage's end: every minibatch, or earlier when the policy has drifted from the rollouts
stage_end = "fixed"             # fixed: all updates_per_stage updates | drift: end before the first
                                # update u ≥ drift_min_updates at which the drift warning is on; the
                                # minibatches left are recorded as unused in stage_end.json
                                # (docs/design.md §4)
drift_window = 16               # updates in the warning's moving average of 1 − E[ρ | A<0] (updates
                                # whose minibatch has no A<0 token are skipped)
drift_threshold = 0.01          # the warning: that average above this (first lab task: fires at
                                # update 47, 17 before the accuracy drop shows, and in no on-policy
                                # stage; docs/lab.md)
drift_min_updates = 16          # μ_min: no stage ends on drift before this many updates

# AdamW
lr = 1e-6                       # AdamW learning rate (constant after warmup)
warmup_updates = 0              # linear warmup over AdamW's first updates (across stages;
                                # optimizer_boundary=reset: each)
stage_warmup_updates = 0        # linear warmup over each stage's first updates, whatever AdamW
                                # carries (0: none)
weight_decay = 0.01
adam_betas = "0.9,0.999"        # AdamW's β1, β2
optimizer_boundary = "carry"    # at a stage's start: carry (AdamW's moments and step go on) | reset
                                # (zeroed: a new AdamW on the fp32 master weights, which
                                # --init_state carries either way)
grad_clip = 1.0                 # max global grad norm

# the loss (loss.py): `loss` names a row of loss.PRESETS; any value below other than None, or given
# as a flag (none too: --nav_delta=none turns NAV off), overrides the row's
loss = "mu-grpo"                # mu-grpo | grpo | dapo | m2po | cispo | topr | oapl | ...
                                # (run_stages.sh LOSS)
objective_args = ""             # the objective's own settings (and soft_value_beta) over the row's:
                                # name=value,...
temperature = 0.0               # log-prob temperature; 0: the sampling temperature from the
                                # manifest
clip_low = None                 # the clipping objectives' bounds (clip: the token ratio; gspo: the
                                # sequence's)
clip_high = None
dual_clip = None                # c > 1 caps the A<0 loss at −c·A (clip)
advantage = None                # group (generate.py's) | signed-reward | soft-value
                                # (loss.response_advantages)
nav_delta = None                # NAV trigger threshold on the ratio (none: NAV off)
nav_scope = None                # none | T | H | S | seq
m2po_tau = None                 # M2PO second-moment threshold over the whole minibatch (none: off)
tis_cap = None                  # truncated importance weight cap for engine/trainer mismatch (none:
                                # off)
kl_coef = None                  # β of the KL(π ‖ π_ref) penalty (0: none); needs ref_policy's
                                # log-probs
kl_estimator = None             # k1 | k2 | k3
ref_policy = ""                 # π_ref (run_stages.sh: the run's MODEL; empty: the stage policy),
                                # logged if kl_coef = 0
agg = None                      # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
token_normalizer = None         # means divide by kept tokens (vetoed/masked ones leave, as verl) |
                                # all
norm_len = 0                    # Dr. GRPO constant length (0: the manifest's max response tokens)

# memory and kernels
micro_batch_tokens = 16384      # tokens (prompt + response) packed into one micro-batch, per GPU
gradient_checkpointing = True   # recompute each layer in backward: activations of one layer at a
                                # time
attn_implementation = "auto"    # auto | flash_attention_2 | flex_attention | varlen_sdpa | sdpa
                                # (docs/scripts.md)
lora_rank = 0                   # > 0: train LoRA adapters (peft) on all linear layers; merged at
                                # save
lora_alpha = 32
hsdp = False                    # several nodes: shard the model within a node (torchrun's
                                # LOCAL_WORLD_SIZE ranks) and replicate it across nodes, so every
                                # layer's all-gather and reduce-scatter stays on the node's NVLink
                                # and only the gradient shards' all-reduce crosses nodes; for models
                                # whose weights, gradients and AdamW (16 bytes/parameter) fit one
                                # node (run_stages.sh HSDP)

# saving within a stage
checkpoint_every = 0            # updates between resumable states (0: only the final one)
save_policy_every = 0           # also write the policy every K updates, to <out>_u<k> (curves
                                # within a stage)

# guards and checks
max_nonfinite = 3               # consecutive non-finite updates before the run stops
engine_mismatch_bound = -1.0    # before a stage's first update, each engine's responses: mean |ℓ −
                                # b| (nats per token) between the trainer's and the engine's
                                # log-probs at most this at the run's first stage, else the run
                                # stops naming the engine; -1: the device's bound
                                # (passes.agreement_bound), 0: no check (a replay with another
                                # policy than the sampler's)
agreement_growth = 10.0         # later stages: at most max(that bound, this × stage 0's measured
                                # mean) (passes.agreement_gate)
collapse_entropy_ratio = 2.0    # above it, a policy whose entropy moved more than this factor from
                                # stage 0's has collapsed: recorded in the stage's first metrics row
                                # (agreement/collapsed), not stopped
agreement_responses = 16        # responses per engine in that check (a no-grad pass over them)
check_packing = False           # update 0: log check/packed_* (the micro-batch packed in two
                                # orders) and check/alone_* (packed vs one sequence at a time):
                                # mean, p99.9, max |Δ log p|

# resident mode (run_stages.sh RESIDENT=true)
resident = False                # keep the model and AdamW for a run's every stage, handed rollouts
                                # and handing policies to generate.py --resident
                                # (mu_grpo/handoff.py; run_stages.sh RESIDENT=true)
run_dir = ""                    # resident: the run directory (its stage_<s>/rollouts; outputs into
                                # stage_<s>/)
stages = 0                      # resident, stage_end=fixed: the run's stages, each of
                                # updates_per_stage updates
total_updates = 0               # resident, stage_end=drift: the run's updates (0: stages ×
                                # updates_per_stage) in stages
drift_growth = 1.25             # planned as run_stages.sh plans them (stage_rules.StagePlan with
                                # its DRIFT_GROWTH
drift_max_updates = 0           # and DRIFT_MAX_UPDATES; 0: 4 × updates_per_stage)
save_every = 0                  # resident: policy and train state into stage_<s>/ after every N-th
                                # stage and the last (0: the last only); the engines get every
                                # policy by policy_handoff
eval_every = 0                  # resident: the engines evaluate the policy after every N-th stage,
                                # the initial one and the last (run_stages.sh EVAL_EVERY; its record
                                # goes with each policy handed over)
policy_handoff = "transfer"     # resident: transfer (vLLM's weight-transfer API: CUDA IPC on GPUs,
                                # shared memory on CPUs; mu_grpo/transfer.py) | files (a policy
                                # directory in the fast hand-off dir per stage)
engines = 1                     # resident, transfer: the engine processes (generate.py's) the
                                # policies go to
handoff_buffer_mb = 0           # resident, transfer: each rank's hand-off buffer, MiB (0: 1 GiB or
                                # the largest tensor)
# -----------------------------------------------------------------------------
given = common.apply_overrides(globals(), sys.argv[1:])
for name, allowed in (("stage_end", ("fixed", "drift")), ("policy_handoff", ("transfer", "files")),
                      ("attn_implementation", M.ATTENTION),
                      ("optimizer_boundary", ("carry", "reset"))):
    common.check_choice(name, globals()[name], allowed)
try:    # the LOSS row, with what was set here: a value other than None in the block, or any flag
    loss_spec = L.resolve_loss(loss, globals(), given, objective_args)
except ValueError as e:
    sys.exit(f"--loss={loss}: {e}")
# each stage decided (resident: the run's; otherwise updates_per_stage), the drift defaults resolved
# once
stage_plan = stage_rules.StagePlan(updates_per_stage=updates_per_stage, stages=stages,
                                   stage_end=stage_end, total_updates=total_updates,
                                   drift_growth=drift_growth, drift_max_updates=drift_max_updates,
                                   prompts_per_update=prompts_per_update, eval_every=eval_every,
                                   save_every=save_every)
# where each stage ends
ending = stage_rules.StageEnd(stage_end, drift_window, drift_threshold, drift_min_updates)
gate = passes.AgreementGate(engine_mismatch_bound, agreement_growth, collapse_entropy_ratio,
                            agreement_responses)
betas = common.adam_betas(adam_betas)
if updates_per_stage < 0 or prompts_per_update < 1 or micro_batch_tokens < 1:
    sys.exit("--updates_per_stage must be >= 0, --prompts_per_update and --micro_batch_tokens >= 1")

# distributed is an if: torchrun sets WORLD_SIZE
distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))     # this node's ranks (torchrun)
device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
                      if torch.cuda.is_available() else "cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
if distributed:  # M.PROCESS_GROUP_TIMEOUT: an hour
    M.start_process_group(device)
is_main = rank == 0
if distributed and lora_rank:
    sys.exit("--lora_rank with torchrun is not supported: LoRA runs in one process (its adapters "
             "are small)")
if hsdp and distributed and local_world == world:
    sys.exit("--hsdp=true shards within a node and replicates across nodes: this torchrun has one "
             "node; use plain FSDP2 (--hsdp=false)")


shard_ranks = local_world if hsdp and distributed else 0     # FSDP2's shard group: a node's ranks
                                                             # under HSDP, else all


def log(*args):
    if is_main and any(args):           # (a None alone: nothing to say)
        print(*args, flush=True)


# ----------------------------------------------------------------------------- one stage


def logprob_temperature(stage):
    """The temperature of the trainer's log-probs: --temperature, else the stage's sampling
    temperature."""
    return temperature or stage.temperature


def describe_stage(stage, updates_per_stage):
    """Log what the stage trains on (updates_per_stage minibatches) and with which loss; returns
    logprob_temperature."""
    temp = logprob_temperature(stage)
    if temperature and temperature != stage.temperature:
        log(f"WARNING: --temperature={temperature} differs from the sampling temperature "
            f"{stage.temperature}: the ratios will not start at 1")
    G = stage.group_size
    tokens_per_group = stage.response_len.sum() / max(1, len(stage.groups))
    log(f"stage {stage.index}: {len(stage.groups)} groups × G={G} "
        f"({int(stage.zero_variance.sum())} with zero reward variance, kept: zero advantage); "
        f"{updates_per_stage} updates of {prompts_per_update} prompts")
    log(f"  minibatch: {prompts_per_update * G} responses, "
        f"~{tokens_per_group * prompts_per_update:.0f} response tokens; staleness "
        f"0..{max(updates_per_stage - 1, 0)} updates; temperature {temp}")
    log(f"  loss {loss}: {loss_spec.describe()}")
    return temp


def train_stage(trainer, stage, outputs, columns):
    """The stage's updates from where `trainer` stands (trainer.start) on: the schedule, what comes
    before the first update (the TIS pass, the guards), the loop (metrics lines, intermediate
    policies and resumable states), then the final train state and policy where `outputs` says.
    `columns`: the stored per-stage passes computed so far (KL's reference). Returns (its timing,
    the counts it ends at: the next stage's start)."""
    model, optimizer, start = trainer.model, trainer.optimizer, trainer.start
    updates_per_stage = outputs.updates_per_stage
    temp = describe_stage(stage, updates_per_stage)
    recipe = update.Recipe(update.stage_loss(loss_spec, stage, norm_len), micro_batch_tokens,
                           grad_clip)
    schedule = update.minibatch_schedule(stage, updates_per_stage, prompts_per_update, seed,
                                         skip_zero_variance)
    columns, timing, neg_ratios, first_row = before_first_update(
        trainer, stage, outputs, columns, temp, schedule)

    def save_policy(directory, done):
        checkpoint.save_policy(model, trainer.start_policy, trainer.dtype, directory,
                               {"stage": stage.index, "stage_updates": done,
                                **trainer.counts(done)})

    def save_state(done, final=False):
        checkpoint.save_state(model, optimizer, outputs.state_dir, {
            "update": done, **trainer.counts(done), "complete": final,
            "start_weights": trainer.start_weights})
        # the stage's directory: kept there, its state is the run's
        home = stage.directory.parent
        if (release_older_states and outputs.save_state and is_main
            and outputs.work_dir.resolve() == home.resolve()):
            # it takes over from the run's older ones
            for older, directory in records.stage_dirs(home.parent):
                if older < stage.index:
                    shutil.rmtree(directory / records.TRAIN_STATE, ignore_errors=True)

    # (a resumed stage's state was saved after its reset; a new
    if start == 0 and optimizer_boundary == "reset":
        M.reset_optimizer_state(optimizer)                # AdamW, the run's first stage's: a no-op)
        trainer.before = {**trainer.before, "optimizer_updates": 0}
    nonfinite_in_row, skipped_total, train_seconds = 0, 0, 0.0
    bar = tqdm(range(start, updates_per_stage), disable=not is_main,
               desc=f"stage {stage.index} updates", initial=start, total=updates_per_stage)
    done = updates_per_stage
    for u in bar:
        if ending.ends_before(u, neg_ratios):
            done = u
            break
        t0 = time.perf_counter()
        # this update's index in the run and in AdamW's life
        counts = trainer.counts(u)
        lr_now = (lr * update.warmup(counts["optimizer_updates"], warmup_updates)
                  * update.warmup(u, stage_warmup_updates))
        for group in optimizer.param_groups:
            group["lr"] = lr_now
        batch = stage.groups[schedule[u]].ravel()           # whole groups: response indices
        m, stepped = update.run_update(model, optimizer, stage, batch, temp, columns, recipe,
                                       measure_memory=u == start)
        nonfinite_in_row = 0 if stepped else nonfinite_in_row + 1
        skipped_total += not stepped
        if nonfinite_in_row >= max_nonfinite:
            raise SystemExit(f"{nonfinite_in_row} non-finite updates in a row (at update {u}): "
                             "stopping; lower --lr or check the rollouts")
        seconds = time.perf_counter() - t0
        train_seconds += seconds
        place = {"update": u, "run_update": counts["run_updates"],
                 "optimizer_update": counts["optimizer_updates"], "stage": stage.index,
                 "staleness": u, "lr": lr_now}
        row = records.metrics_row(stage, schedule[u], place, m, seconds, {
            "skipped_nonfinite": skipped_total, "update_skipped": not stepped,
            **(first_row if u == start else {})})
        neg_ratios.append(row.get("ratio/mean_neg_adv"))
        if is_main:
            common.append_jsonl(outputs.metrics_path, row)
            bar.set_postfix(loss=f"{m['loss/policy']:.4f}", reward=f"{row['reward/mean']:.2f}",
                            ratio_neg=f"{m['ratio/mean_neg_adv']:.3f}")
        if save_policy_every and (u + 1) % save_policy_every == 0 and u + 1 < updates_per_stage:
            save_policy(outputs.out_dir.with_name(f"{outputs.out_dir.name}_u{u + 1:05d}"), u + 1)
        if checkpoint_every and (u + 1) % checkpoint_every == 0 and u + 1 < updates_per_stage:
            save_state(u + 1)
    bar.close()
    t_save = time.perf_counter()
    record_stage_end(stage, schedule, done, neg_ratios, outputs, trainer.counts(done))
    if outputs.save_state:
        save_state(done, final=True)
    first, *copies = outputs.policy_dirs or (None,)
    if first is not None:
        save_policy(first, done)
    if is_main:
        for directory in copies:                 # the same files: copied, not gathered again
            common.atomic_copytree(first, directory)
        if not outputs.save_state:
            shutil.rmtree(outputs.state_dir, ignore_errors=True)
    M.barrier()
    return {**timing, "train_seconds": train_seconds, "save_seconds": time.perf_counter() - t_save,
            "updates_this_run": done - start}, trainer.counts(done)


def before_first_update(trainer, stage, outputs, columns, temp, schedule):
    """What a stage needs before its first update (of this run: a resumed stage's, trainer.start):
    TIS's stored pass of the stage policy, added to `columns`; the metrics lines of the updates
    already done, and their drift signal (lines after the resumed update are dropped, so the file
    matches an unbroken run); at update 0 the engines' agreement (passes.check_engines); with
    check_packing the packing check. Returns (columns, timing, the drift signal so far, the checks'
    values for the first update's metrics line)."""
    model, start, updates_per_stage, timing = (trainer.model, trainer.start,
                                               outputs.updates_per_stage, {})
    if loss_spec.tis_cap is not None:
        columns = {**columns}
        columns["old"], timing["old_pass_seconds"] = passes.logprob_pass(
            model, stage, temp, "old", trainer.start_weights, outputs.work_dir, micro_batch_tokens,
            resumed_state=outputs.state_dir if start else None)
    kept = None
    # metrics lines after the resumed update are dropped, so the file matches an unbroken run
    if is_main:
        outputs.work_dir.mkdir(parents=True, exist_ok=True)
        # (killed mid-line)
        rows = common.read_jsonl(outputs.metrics_path, missing_ok=True, torn_tail_ok=True)
        kept = [r for r in rows if r.get("update", 0) < start]
        common.atomic_write_lines(outputs.metrics_path, kept)
    # the drift signal
    neg_ratios = M.broadcast([r.get("ratio/mean_neg_adv") for r in kept] if is_main else None)
    # log-probs at another temperature than b's
    resampled = temperature and temperature != stage.temperature
    first_row = {}
    if start == 0 and updates_per_stage and engine_mismatch_bound != 0 and not resampled:
        first_row = passes.check_engines(model, stage, temp, gate, micro_batch_tokens)
    if check_packing and start < updates_per_stage:
        first = stage.groups[schedule[start]].ravel()
        first_row.update(passes.packing_check(model, stage, temp, passes.micro_batches(
            stage, first[np.argsort(-stage.response_len[first], kind="stable")][rank::world],
            micro_batch_tokens)[0]))
    return columns, timing, neg_ratios, first_row


def record_stage_end(stage, schedule, done, neg_ratios, outputs, counts):
    """stage_end.json beside metrics.jsonl (stage_rules.StageEnd.record, the run's counts): the next
    stage's size is planned from it (stage_rules.StagePlan)."""
    row = ending.record(stage.index, done, outputs.updates_per_stage, neg_ratios,
                        [stage.group_keys[g] for g in schedule[done:].ravel().tolist()])
    if done < outputs.updates_per_stage:
        log(f"stage {stage.index} ends on drift after {done} of {outputs.updates_per_stage} "
            f"updates: the average 1 − E[ρ | A<0] of the last {drift_window} updates is "
            f"{row['drift_signal']:.4f} > {drift_threshold}; {row['unused_prompts']} prompts "
            "unused")
    if is_main:
        common.atomic_write_json(outputs.work_dir / records.STAGE_END, {**row, **counts})


# ----------------------------------------------------------------------------- the trainer


def kl_reference(start_policy):
    """π_ref of the KL term: --ref_policy, else the stage policy when kl_coef > 0 (said: the usual
    π_ref is the run's first model), else none."""
    reference = common.local_dir(ref_policy) if ref_policy else (
        start_policy if loss_spec.kl_coef else "")
    if reference and not ref_policy:
        log(f"KL reference: the stage policy {start_policy} (pass --ref_policy=<the run's first "
            "model> for the usual π_ref)")
    return reference


class Trainer:
    """The policy as the trainer holds it, its AdamW and KL's reference, and where training stands:
    the first update of the next stage, the counts before it, the id of the weights it starts from
    (checkpoint.restore's, then each stage's end). Built once, when the first stage needs it
    (ready): per phase after that stage's π_ref pass, so that the two never coexist; resident before
    the first rollouts arrive, π_ref then kept for the run. `source` and `resume`: the train state
    it starts from (None: the policy's weights, AdamW afresh) and whether that is a resume of the
    stage (checkpoint.restore)."""

    def __init__(self, start_policy, source, resume, keep_reference):
        torch.manual_seed(seed)
        self.start_policy, self.source, self.resume = start_policy, source, resume
        self.attention = M.choose_attention(attn_implementation, device)
        hsdp_shape = (f"; HSDP: {world // shard_ranks} replica(s) × {shard_ranks} shard(s)"
                      if shard_ranks else "")
        log(f"{world} process(es) on {device.type}, attention {self.attention}{hsdp_shape}")
        self.reference = kl_reference(start_policy)
        self.keep_reference = keep_reference and bool(self.reference)
        # every policy is saved in the initial model's dtype
        self.dtype = M.checkpoint_dtype(start_policy)
        self.model = self.optimizer = self.ref_model = None
        self.start, self.before, self.start_weights = 0, None, None

    def ready(self):
        """Build the model and AdamW (empty when a train state fills them) and load the train state;
        returns the seconds that took (0 once built)."""
        if self.model is not None:
            return 0.0
        t0 = time.perf_counter()
        if self.keep_reference:
            self.ref_model = self.build_reference()
        self.model = M.build(self.start_policy, attention=self.attention,
                             gradient_checkpointing=gradient_checkpointing, lora_rank=lora_rank,
                             lora_alpha=lora_alpha, weights=self.source is None,
                             shard_ranks=shard_ranks)
        self.optimizer = torch.optim.AdamW(M.parameter_groups(self.model), lr=lr, betas=betas,
                                           weight_decay=weight_decay, eps=1e-8)
        M.init_optimizer_state(self.optimizer)
        self.start, self.before, self.start_weights, said = checkpoint.restore(
            self.model, self.optimizer, self.source, resume=self.resume,
            start_policy=self.start_policy)
        log(said)
        return time.perf_counter() - t0

    def build_reference(self):
        return M.build(self.reference, attention=self.attention, trainable=False,
                       shard_ranks=shard_ranks)

    def reference_columns(self, stage, work_dir):
        """KL's reference log-probs of the stage, stored once per stage: ({"ref": column}, its
        timing), or ({}, {}) without π_ref; from the kept model, else from one built for the pass
        and freed."""
        if not self.reference:
            return {}, {}
        model = self.ref_model or self.build_reference()
        column, seconds = passes.logprob_pass(model, stage, logprob_temperature(stage), "ref",
                                              common.policy_fingerprint(self.reference), work_dir,
                                              micro_batch_tokens)
        if model is not self.ref_model:
            del model
            M.release_memory()
        return {"ref": column}, {"ref_pass_seconds": seconds}

    def counts(self, done):
        """The run's and AdamW's update counts after `done` updates of the stage it trains."""
        return {k: n + done for k, n in self.before.items()}

    def next_stage(self, after):
        """Where the next stage starts, this one having ended at the counts `after`: its update 0,
        from weights no file names (a fresh id keys its TIS pass)."""
        self.start, self.before, self.start_weights = 0, after, uuid.uuid4().hex[:16]


def record_settings(outputs, stage, trainer):
    """optimize_config.json beside metrics.jsonl: the hyperparameters as resolved (with the stage
    plan's defaults: total_updates, drift_max_updates), what this stage resolved at run time, the
    versions of the code and libraries, and the command line."""
    if is_main:
        outputs.work_dir.mkdir(parents=True, exist_ok=True)
        resolved = {"policy": trainer.start_policy, "ref_policy": trainer.reference,
                    "temperature": logprob_temperature(stage), "attention": trainer.attention,
                    "norm_len": norm_len or stage.max_response_tokens,
                    "loss": dataclasses.asdict(loss_spec),
                    **({"resident": True} if resident else {})}
        common.atomic_write_json(outputs.work_dir / records.OPTIMIZE_CONFIG, {
            "hyperparameters": {**common.hyperparameters(globals()),
                                **dataclasses.asdict(stage_plan)},
            "resolved": resolved, "world": world, "device": str(device),
            "versions": common.versions(), "argv": sys.argv})


def check_disk(stage, trainer, outputs):
    """Refuse, before any compute, a stage whose outputs will not fit: a train state when it saves
    one (fp32 weights and AdamW's two moments, 12 bytes per parameter; a new one is written beside
    the current before it replaces it), every policy it saves into the run (in the initial model's
    dtype) and the per-stage log-prob passes still to compute (4 bytes per response token each).
    outputs.check_saves: as if it saved both (a resident run's first stage: a disk without room for
    one save stops the run now, not hours in)."""
    n = M.parameter_count(trainer.start_policy)
    saves_state = outputs.save_state or bool(checkpoint_every) or outputs.check_saves
    saves_policy = outputs.out_dir in outputs.policy_dirs or outputs.check_saves
    state = (4 if lora_rank else 12) * n if saves_state else 0
    policies = int(saves_policy) + (max(outputs.updates_per_stage - 1, 0) // save_policy_every
                                    if save_policy_every else 0)
    policy_bytes = policies * n * trainer.dtype.itemsize
    passes = bool(trainer.reference) + (loss_spec.tis_cap is not None)
    pass_bytes = passes * 4 * int(stage.token_offset[-1])
    common.require_free_disk(outputs.work_dir, state + policy_bytes + pass_bytes,
                             f"this stage's train state ({state / 1e9:.1f} GB), {policies} policy "
                             f"directory(ies) ({policy_bytes / 1e9:.1f} GB) and {passes} log-prob "
                             f"pass(es) ({pass_bytes / 1e9:.1f} GB)")


def write_timing(outputs, timing):
    """optimize_timing.json (rank 0), with every rank's peak RSS."""
    peak_rss = M.gather_values(torch.tensor([common.peak_rss_gib()], device=device))
    if is_main:
        timing = {**timing, "world": world, "peak_rss_gib_per_rank": peak_rss.tolist()}
        common.atomic_write_json(outputs.work_dir / records.OPTIMIZE_TIMING, timing)
        seconds = ", ".join(f"{k} {v:.1f}" for k, v in timing.items() if k.endswith("seconds"))
        log(f"next policy written to {outputs.out_dir} ({seconds})")


# ------------------------------------------------------------------- the stages this process trains


def train_one(trainer, handover, stage, outputs):
    """One stage, as both modes train it: the checks before any compute, KL's reference pass, the
    model (built for the process's first stage), the updates (train_stage, which saves the policy
    where the hand-over said), the policy handed over (per phase: its save is all), the timing."""
    t0 = time.time()
    passes.check_fits(stage, trainer.start_policy)
    record_settings(outputs, stage, trainer)
    check_disk(stage, trainer, outputs)
    handover.before_stage(stage.index)
    columns, timing = trainer.reference_columns(stage, outputs.work_dir)
    if built := trainer.ready():
        timing["load_seconds"] = built
    trained, after = train_stage(trainer, stage, outputs, columns)
    timing.update(trained)
    timing.update(handover.hand_over(stage.index, trainer, after["run_updates"]))
    trainer.next_stage(after)
    write_timing(outputs, {**timing, "attention": trainer.attention})
    handover.record(stage.index, t0, timing)


def one_stage():
    """The process-per-phase loop's stage: --stage_dir, from --policy (default: the one that
    generated it), resuming its own train state or continuing --init_state; its outputs at --out.
    Returns (trainer, hand-over, [(the stage, its outputs)])."""
    stage = passes.open_stage(stage_dir)
    start_policy = common.local_dir(policy or stage.manifest["policy"])
    common.require_policy(start_policy)
    out_dir = Path(out) if out else Path(stage_dir) / records.POLICY
    handover = handoff.StageDirectory()
    outputs = records.StageOutputs(out_dir=out_dir, updates_per_stage=updates_per_stage,
                                   save_state=save_train_state,
                                     policy_dirs=handover.policy_dirs(out_dir, stage.index, True))
    # rank 0 decides
    source = M.broadcast(
        checkpoint.state_source(outputs.state_dir, init_state) if is_main else None)
    trainer = Trainer(start_policy, source, resume=source == outputs.state_dir,
                      keep_reference=False)
    return trainer, handover, [(stage, outputs)]


def main():
    """The stages this process is given, each trained by train_one: per phase the one at
    --stage_dir, then the process ends; resident every stage of the run, the process living on. What
    differs is the hand-over (handoff.StageDirectory or resident_trainer.PolicyHandover)."""
    if resident:
        def make_trainer(source, resume):        # (the policy resolved once the trainer is due)
            return Trainer(common.local_dir(policy), source, resume=resume, keep_reference=True)
        trainer, handover, stages = trainer_start(run_dir, stage_plan, make_trainer,
                                                  policy_handoff, engines, handoff_buffer_mb)
    else:
        trainer, handover, stages = one_stage()
    try:
        for stage, outputs in stages:
            train_one(trainer, handover, stage, outputs)
    finally:
        handover.close()
    del trainer
    M.end_process_group()


if __name__ == "__main__":
    main()
