"""Optimize one stage: μ minibatch updates of the stage policy on its (increasingly stale) rollouts.

    python optimize.py --stage_dir=runs/toy/stage_0                     # one process: CPU or one GPU
    torchrun --nproc_per_node=4 optimize.py --stage_dir=runs/x/stage_0  # FSDP2 over 4 GPUs

The stage's groups are put once in a seeded order and cut into `updates_per_stage` minibatches of
`prompts_per_update` groups: update u trains on minibatch u, data exactly u updates stale, no
response used twice (docs/design.md §1). An update is one AdamW step on loss.policy_loss: the loss is
summed over packed micro-batches and ranks and divided by the minibatch's kept-token count.

Writes next to --out (default <stage_dir>/policy): the next policy (an HF directory vLLM loads, in the
initial model's dtype), metrics.jsonl (one line per update), optimize_timing.json, and train_state/
(fp32 weights and AdamW moments; DCP, sharded), from which a rerun resumes and the next stage
continues (--init_state): a run's stages are one optimization whose rollouts are refreshed. Derived
caches of the stage (rollout columns, per-stage log-prob passes) go into the stage directory.
"""
import dataclasses
import json
import math
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import common
import handoff
import loss as L
import model as M
import rollouts
import tracking

# ----------------------------------------------------------------------------- hyperparameters
# the stage and its outputs
stage_dir = "runs/toy/stage_0"  # holds rollouts/ (JSONL read only; its columns are built there if missing)
policy = ""                     # stage policy to start from (default: the one that generated the rollouts)
out = ""                        # next policy directory (default: <stage_dir>/policy); metrics.jsonl,
                                # train_state/ and the other outputs go next to it (replays: elsewhere)
init_state = ""                 # the previous stage's train_state/: continue its fp32 weights, AdamW moments
                                # and update count (run_stages.sh passes it); empty: `policy`, fresh AdamW
save_train_state = True         # keep train_state/ at the end (the next stage's --init_state)
release_init_state = False      # delete --init_state once this stage's own train state is written (it has taken
                                # over; run_stages.sh: true unless KEEP_TRAIN_STATES), so two states coexist, not three

# the schedule: which rollouts each update trains on
updates_per_stage = 16          # μ: optimizer updates on this stage's rollouts (paper: 1024; GRPO: 4; resident
                                # with stage_end=drift: the first stage's)
prompts_per_update = 8          # whole groups per update (paper: 64 prompts × G=8 = 512 responses)
skip_zero_variance = False      # True: leave out groups whose rewards are all equal and draw minibatches from
                                # repeated passes over the rest (responses reused: an ablation, not the paper)
seed = 0                        # the seeded order in which the stage's groups become minibatches

# the stage's end: every minibatch, or earlier when the policy has drifted from the rollouts
stage_end = "fixed"             # fixed: all updates_per_stage updates | drift: end before the first update u ≥
                                # drift_min_updates at which the drift warning is on; the minibatches left are
                                # recorded as unused in stage_end.json (docs/design.md §4)
drift_window = 16               # updates in the warning's moving average of 1 − E[ρ | A<0] (updates whose minibatch
                                # has no A<0 token are skipped)
drift_threshold = 0.01          # the warning: that average above this (first lab task: fires at update 47, 17 before
                                # the accuracy drop shows, and in no on-policy stage; docs/lab.md)
drift_min_updates = 16          # μ_min: no stage ends on drift before this many updates

# AdamW
lr = 1e-6                       # AdamW learning rate (constant after warmup)
warmup_updates = 0              # linear warmup over AdamW's first updates (across stages; RESET_OPTIMIZER: each)
weight_decay = 0.01
adam_betas = "0.9,0.999"
grad_clip = 1.0                 # max global grad norm

# the loss (loss.py; the LOSS presets of losses.sh set these)
temperature = 0.0               # log-prob temperature; 0: the sampling temperature from the manifest
clip_low = 0.0                  # ratio clip bounds (μ-GRPO 0 and 5; GRPO 0.8 and 1.2; DAPO 0.8 and 1.28)
clip_high = 5.0
dual_clip = None                # c > 1 caps the A<0 loss at −c·A (None: off)
nav_delta = 1e-4                # NAV trigger threshold on the ratio (None: NAV off)
nav_scope = "H"                 # none | T | H | S | seq
m2po_tau = None                 # M2PO second-moment threshold over the whole minibatch (None: off; M2PO: 0.04)
tis_cap = None                  # truncated importance weight cap for engine/trainer mismatch (None: off)
kl_coef = 0.0                   # β of the KL(π ‖ π_ref) penalty (0: none); needs ref_policy's log-probs
kl_estimator = "k3"             # k1 | k2 | k3
ref_policy = ""                 # π_ref (run_stages.sh: the run's first MODEL); empty: the stage policy when
                                # kl_coef > 0, else none. With kl_coef = 0 the KL is logged, not optimized
agg = "token-mean"              # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
token_normalizer = "kept"       # means divide by kept tokens (vetoed/masked ones leave, as verl) | all
norm_len = 0                    # Dr. GRPO constant length (0: the manifest's max response tokens)

# memory and kernels
micro_batch_tokens = 16384      # tokens (prompt + response) packed into one micro-batch, per GPU
gradient_checkpointing = False  # recompute each layer in backward: activations of one layer at a time
attn_implementation = "auto"    # auto | flash_attention_2 | flex_attention | varlen_sdpa | sdpa (docs/scripts.md)
lora_rank = 0                   # > 0: train LoRA adapters (peft) on all linear layers; merged at save
lora_alpha = 32
hsdp = False                    # several nodes: shard the model within a node (torchrun's LOCAL_WORLD_SIZE ranks) and
                                # replicate it across nodes, so every layer's all-gather and reduce-scatter stays on the
                                # node's NVLink and only the gradient shards' all-reduce crosses nodes; for models whose
                                # weights, gradients and AdamW (16 bytes/parameter) fit one node (run_stages.sh HSDP)

# saving within a stage
checkpoint_every = 0            # updates between resumable states (0: only the final one)
save_policy_every = 0           # also write the policy every K updates, to <out>_u<k> (curves within a stage)

# guards and checks
max_nonfinite = 3               # consecutive non-finite updates before the run stops
engine_mismatch_bound = -1.0    # before a stage's first update, each engine's responses: mean |ℓ − b| (nats per token)
                                # between the trainer's and the engine's log-probs at most this, else the run stops
                                # naming the engine; -1: the device's bound (agreement_bound), 0: no check (a replay
                                # of a stage with another policy than the one that generated it)
agreement_responses = 16        # responses per engine in that check (a no-grad pass over them)
check_packing = False           # update 0: log check/packed_* (the micro-batch packed in two orders) and check/alone_*
                                # (packed vs one sequence at a time): mean, p99.9, max |Δ log p|

# resident mode (run_stages.sh RESIDENT=true)
resident = False                # keep the model and AdamW for a run's every stage, handed rollouts and handing policies
                                # to generate.py --resident (handoff.py; run_stages.sh RESIDENT=true)
run_dir = ""                    # resident: the run directory (its stage_<s>/rollouts; outputs into stage_<s>/)
stages = 0                      # resident, stage_end=fixed: the run's stages, each of updates_per_stage updates
total_updates = 0               # resident, stage_end=drift: the run's updates (0: stages × updates_per_stage) in stages
drift_growth = 1.25             # planned as run_stages.sh plans them (rollouts.planned_updates with its DRIFT_GROWTH
drift_max_updates = 0           # and DRIFT_MAX_UPDATES; 0: 4 × updates_per_stage)
save_every = 0                  # resident: policy and train state into stage_<s>/ after every N-th stage and the
                                # last (0: the last only); the engine gets every policy through the fast hand-off dir
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])
common.check_choice("nav_scope", nav_scope, L.NAV_SCOPES)
common.check_choice("stage_end", stage_end, ("fixed", "drift"))
common.check_choice("agg", agg, L.AGG_MODES)
common.check_choice("token_normalizer", token_normalizer, L.TOKEN_NORMALIZERS)
common.check_choice("kl_estimator", kl_estimator, L.KL_ESTIMATORS)
common.check_choice("attn_implementation", attn_implementation, M.ATTENTION)
betas = tuple(float(b) for b in adam_betas.split(","))
if updates_per_stage < 0 or prompts_per_update < 1 or micro_batch_tokens < 1:
    sys.exit("--updates_per_stage must be >= 0, --prompts_per_update and --micro_batch_tokens >= 1")
total_updates = total_updates or stages * updates_per_stage        # resident drift defaults, resolved
drift_max_updates = drift_max_updates or 4 * updates_per_stage
deferred_norm = agg == "token-mean" and token_normalizer == "kept"   # divide by the kept count at the end

# distributed is an if: torchrun sets WORLD_SIZE
distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))     # this node's ranks (torchrun)
device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
if distributed:  # M.PROCESS_GROUP_TIMEOUT: an hour
    M.start_process_group(device)
is_main = rank == 0
if distributed and lora_rank:
    sys.exit("--lora_rank with torchrun is not supported: LoRA runs in one process (its adapters are small)")
if hsdp and distributed and local_world == world:
    sys.exit("--hsdp=true shards within a node and replicates across nodes: this torchrun has one node; use plain "
             "FSDP2 (--hsdp=false)")


def hsdp_shard_ranks():
    """FSDP2's shard group size: a node's ranks under --hsdp, else 0 (every rank)."""
    return local_world if hsdp and distributed else 0


def log(*args):
    if is_main:
        print(*args, flush=True)


barrier = M.barrier


@dataclasses.dataclass
class Progress:
    """Where a stage's training starts and where its outputs go."""
    out_dir: Path               # the next policy; metrics.jsonl, train_state/ and the timing go next to it
    updates: int                # μ: the stage's minibatches (its updates unless it ends on drift)
    start: int = 0              # the first update to run (a resumed stage: its state's)
    before: dict = None         # the counts before this stage, {run_updates, optimizer_updates} (model.py's records)
    start_weights: str = ""     # id of the weights the stage started from (keys TIS's stored pass)
    save_state: bool = True     # write the final train state (the next stage's, or a resume's, starting point)
    policy_dirs: tuple = ()     # where the final policy goes (default: out_dir)
    after: dict = None          # the counts this stage ends at, set by train_stage (a resident run's next `before`)

    def counts(self, done):
        """The run's and AdamW's update counts after `done` updates of this stage."""
        return {k: self.before[k] + done for k in M.COUNTS}

    @property
    def work_dir(self):
        return self.out_dir.parent

    @property
    def state_dir(self):
        return self.work_dir / "train_state"

    @property
    def metrics_path(self):
        return self.work_dir / "metrics.jsonl"


# ----------------------------------------------------------------------------- the stage's rollouts


def open_stage(directory):
    try:
        return rollouts.open_stage(Path(directory) / "rollouts", rank, world, barrier, decide=broadcast)
    except rollouts.RolloutError as e:
        raise SystemExit(str(e)) from None


def minibatch_schedule(stage, updates):
    """[updates, prompts_per_update] group indices: the stage's groups in one seeded order, cut into
    consecutive minibatches, so update u sees groups it alone sees, u updates stale. A stage with too few
    groups wraps into a new seeded order (said loudly: responses are then reused)."""
    candidates = np.arange(len(stage.groups))
    if skip_zero_variance:
        candidates = candidates[~stage.zero_variance]
        log(f"skip_zero_variance: leaving out {int(stage.zero_variance.sum())} of {len(stage.groups)} groups "
            f"with zero reward variance")
    need = updates * prompts_per_update
    if need == 0:
        return np.zeros((0, prompts_per_update), dtype=np.int64)
    if len(candidates) < prompts_per_update:
        raise SystemExit(f"{stage.directory}: {len(candidates)} usable groups, fewer than --prompts_per_update="
                         f"{prompts_per_update}")
    if need > len(candidates):
        log(f"WARNING: {updates} updates × {prompts_per_update} prompts need {need} groups but the stage "
            f"has {len(candidates)} usable: the schedule wraps into {need / len(candidates):.2f} passes, so responses "
            f"are reused and update u is no longer exactly u updates stale")
    elif need < len(candidates):
        log(f"note: {len(candidates) - need} of the stage's {len(candidates)} groups are left unused "
            f"({updates} updates × {prompts_per_update} prompts)")
    order = common.shuffled_window(candidates.tolist(), 0, need, seed)
    return np.asarray(order, dtype=np.int64).reshape(updates, prompts_per_update)


def drift_warning(neg_ratios):
    """The drift warning after these updates (their E[ρ | A<0], None or NaN for a minibatch without an A<0 token):
    (the moving average of 1 − E[ρ | A<0] over the last drift_window updates that had one, or None before there are
    that many; whether it exceeds drift_threshold)."""
    seen = [v for v in neg_ratios if v is not None and math.isfinite(v)][-drift_window:]
    if drift_window < 1 or len(seen) < drift_window:
        return None, False
    average = sum(1.0 - v for v in seen) / len(seen)
    return average, average > drift_threshold


def stage_ends_before(u, neg_ratios):
    """Whether the stage ends before update u: with stage_end=drift, at u ≥ drift_min_updates when the warning over
    updates 0..u−1 is on. Decided from the metrics lines, so a resumed stage ends where the unbroken one did."""
    return stage_end == "drift" and u >= drift_min_updates and drift_warning(neg_ratios)[1]


def micro_batches(stage, responses):
    """This rank's micro-batches of at most micro_batch_tokens tokens (prompt + response), longest first,
    each packed into one row (no compute goes to padding); under torchrun padded with None to the largest
    count over the ranks, since FSDP's collectives need every rank to run as many passes."""
    responses = np.asarray(responses, dtype=np.int64)
    lengths = stage.prompt_len[responses] + stage.response_len[responses]
    order = np.argsort(-lengths, kind="stable")
    batches, current, tokens = [], [], 0
    for i, n in zip(responses[order].tolist(), lengths[order].tolist()):
        if current and tokens + n > micro_batch_tokens:
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    batches += [current] if current else []
    if distributed:
        count = torch.tensor([len(batches)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        batches += [None] * (int(count) - len(batches))
    return batches


def pack(stage, mb, columns):
    """One packed row for the model and per-response tensors for the loss, on the device.

    input_ids, position_ids [1, N]: the sequences back to back, positions restarting at 0 for each;
    keep [R]: the positions whose logits predict a response token; targets [R]; behavior and each
    extra column (TIS old, KL reference) [b, T]; mask [b, T]; advantages [b]."""
    parts = [stage.tokens(i) for i in mb]
    seq = [len(p) + len(r) for p, r, _ in parts]
    start = np.concatenate([[0], np.cumsum(seq)[:-1]])
    ids = np.concatenate([np.concatenate([p, r]) for p, r, _ in parts]).astype(np.int64)
    pos = np.concatenate([np.arange(n) for n in seq])
    keep = np.concatenate([np.arange(s + len(p) - 1, s + len(p) + len(r) - 1) for s, (p, r, _) in zip(start, parts)])
    lens = np.array([len(r) for _, r, _ in parts])
    mask = np.arange(lens.max())[None, :] < lens[:, None]                    # [b, T]

    def per_token(values):
        out = np.zeros(mask.shape, dtype=np.float32)
        out[mask] = np.concatenate(values)
        return torch.from_numpy(out).to(device)

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    targets = np.concatenate([r for _, r, _ in parts]).astype(np.int64)
    return dict(ids=t(ids)[None], pos=t(pos)[None], keep=t(keep), targets=t(targets),
                behavior=per_token([b for _, _, b in parts]), mask=t(mask), adv=t(stage.advantage[mb]),
                **{name: per_token([col.get(stage, i) for i in mb]) for name, col in columns.items()})


def forward(model, stage, mb, temp, columns=None, with_entropy=False):
    """Current log-probs [b, T] (0 on padding) of micro-batch `mb`'s response tokens at temperature temp,
    with the packed tensors; mb None (a padding pass) runs response 0. Logits are computed only at
    response positions ([R, V], bf16 on GPU); token_logprobs upcasts them chunk by chunk."""
    x = pack(stage, mb if mb is not None else [0], columns or {})
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" and not distributed):
        logits = model(input_ids=x["ids"], position_ids=x["pos"], logits_to_keep=x["keep"], use_cache=False).logits[0]
    lp_flat = L.token_logprobs(logits, x["targets"], temp)                          # [R] fp32
    x["lp"] = torch.zeros(x["mask"].shape, device=device).masked_scatter(x["mask"], lp_flat)
    if with_entropy:
        x["entropy_sum"] = L.token_entropy(logits.detach(), temp).sum()
    return x


# ----------------------------------------------------------------------------- per-stage log-prob passes


def logprob_pass(model, stage, temp, name, key, progress, may_compute=True):
    """A model's log-probs of every response token of the stage, computed once: one no-grad pass
    (sharded like training) before the first update, stored as a TokenColumn in the stage's logprobs/
    and read like the behavior log-probs, so a resume or a replay with the same model reuses it. TIS's
    old log-probs (the stage policy) and KL's reference log-probs are both such passes. Returns the column
    and the seconds spent."""
    stage_path = stage.directory.parent
    root = stage_path / "logprobs" if os.access(stage_path, os.W_OK) else progress.work_dir / "logprobs"
    path = root / f"{name}-{key}-T{temp}.f32"
    n_tokens = int(stage.token_offset[-1])
    column = None
    if is_main:          # rank 0 alone writes the column: a killed pass's parts first
        column = rollouts.TokenColumn(path, n_tokens, create=True)
        if not column.complete and (parts := column.parts()):
            log(f"{name} log-probs: {column.merge_parts(stage, parts)} responses from a killed pass kept")
    complete, missing = broadcast((column.complete, column.missing(stage)) if is_main else None)
    if complete:
        log(f"{name} log-probs: stored in {path}")
        return stored_column(path, n_tokens), 0.0
    if not may_compute:
        raise SystemExit(f"{path} is incomplete but training already started: the stage policy's log-probs cannot "
                         f"be recomputed from moved weights; delete {progress.state_dir} to restart the stage")
    t0 = time.perf_counter()
    mine = np.arange(rank, stage.n, world)
    todo = mine[missing[mine]]
    log(f"{name} log-probs: one pass over {stage.n} responses ({len(todo)} still to do on rank 0) → {path}")
    from tqdm import tqdm
    written, indices, values = [], [], []
    with torch.no_grad():
        for k, mb in enumerate(tqdm(micro_batches(stage, todo), disable=not is_main, desc=f"{name} pass")):
            x = forward(model, stage, mb, temp)
            for j, i in enumerate(mb or []):
                indices.append(i)
                values.append(x["lp"][j, :stage.response_len[i]].cpu().numpy())
            if k % 64 == 63:                     # a killed pass keeps what its parts hold
                written.append(rollouts.write_column_part(path, rank, len(written), indices, values))
                indices, values = [], []
    if indices:
        written.append(rollouts.write_column_part(path, rank, len(written), indices, values))
    everyone = gather_lists([str(p) for p in written])
    if is_main:
        common.wait_visible(everyone)           # other nodes' parts
        column.merge_parts(stage, [Path(p) for p in everyone])
        if (left := int(column.missing(stage).sum())):
            raise SystemExit(f"{path}: {left} responses have no {name} log-probs after the pass (a rank's part lost?)")
        column.mark_complete({"model": key, "temperature": temp, "responses": stage.n})
    barrier()
    return stored_column(path, n_tokens), time.perf_counter() - t0


def stored_column(path, n_tokens):
    """A complete column, read-only (rank 0 wrote it; on other nodes, once visible)."""
    common.wait_visible([Path(str(path) + ".complete")])
    return rollouts.TokenColumn(path, n_tokens, create=False, readonly=True)


# ----------------------------------------------------------------------------- one update


def loss_options(stage):
    """loss.policy_loss's options: the hyperparameters, and Dr. GRPO's constant length from the stage."""
    return dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, nav_delta=nav_delta,
                nav_scope=nav_scope, m2po_tau=m2po_tau, tis_cap=tis_cap, kl_coef=kl_coef,
                kl_estimator=kl_estimator, agg=agg, token_normalizer=token_normalizer,
                norm_len=norm_len or stage.max_response_tokens)


def m2po_minibatch_cutoff(model, stage, temp, mbs, columns):
    """M2PO's cutoff over the whole minibatch: a no-grad pass over this rank's micro-batches, then every
    rank's harmful (log ρ)² gathered, so the mask does not depend on the number of GPUs."""
    sq = [torch.zeros(0, device=device)]
    with torch.no_grad():
        for mb in mbs:
            x = forward(model, stage, mb, temp, columns)
            if mb is None:
                continue
            reference = x["old"] if "old" in x and tis_cap is not None else x["behavior"]
            log_ratio = torch.clamp(x["lp"] - reference, -L.LOG_RATIO_LIMIT, L.LOG_RATIO_LIMIT) * x["mask"]
            sq.append((log_ratio ** 2)[L.m2po_harmful(log_ratio, x["adv"], x["mask"])])
    return L.m2po_cutoff(gather_values(torch.cat(sq)), m2po_tau)


def gather_values(values):
    """Every rank's 1-D tensor of values, concatenated in rank order (ranks may hold different numbers)."""
    if not distributed:
        return values
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([values.numel()], device=device))
    longest = max(int(n) for n in sizes)
    parts = [torch.zeros(longest, device=device) for _ in range(world)]
    dist.all_gather(parts, torch.nn.functional.pad(values, (0, longest - values.numel())))
    return torch.cat([p[:int(n)] for p, n in zip(parts, sizes)])


def gather_lists(items):
    """Every rank's list of picklable items, concatenated in rank order."""
    if not distributed:
        return list(items)
    everyone = [None] * world
    dist.all_gather_object(everyone, list(items))
    return [x for part in everyone for x in part]


def broadcast(obj):
    """Rank 0's picklable object, on every rank (decisions taken from the filesystem: one rank decides)."""
    if not distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def reduce_stats(stats):
    """Sum the ranks' stats (extremes: min/max), two collectives in all."""
    if not distributed:
        return stats
    names = sorted(stats)
    sums = [n for n in names if not n.endswith(("_min", "_max"))]
    extremes = [n for n in names if n.endswith(("_min", "_max"))]
    total = torch.stack([stats[n].double() for n in sums])
    dist.all_reduce(total)
    ext = torch.stack([(stats[n] if n.endswith("_max") else -stats[n]).double() for n in extremes])
    dist.all_reduce(ext, op=dist.ReduceOp.MAX)
    out = {n: total[i].float() for i, n in enumerate(sums)}
    out.update({n: (ext[i] if n.endswith("_max") else -ext[i]).float() for i, n in enumerate(extremes)})
    return out


def packing_check(model, stage, temp, mb):
    """Whether the packed attention keeps sequences apart, measured two ways on micro-batch `mb` (every rank's):
    - differential (check/packed_*): the same sequences packed in the order given and in reverse. Both rows have
      the same length, so every GEMM has the same shape and rounds alike; a sequence that saw the ones packed
      before it sees other ones in the other order, which moves its log-probs by far more than rounding;
    - packed vs each of its first 8 sequences alone (check/alone_*, for information): on a GPU the bf16 GEMMs of
      a 16k-row micro-batch and of one sequence's rows are tiled differently (cuBLAS tile shapes, split-K), which
      moves a few tokens in a hundred by ~0.1 nats with no fault at all.
    The mean, the 99.9th percentile and the max of |Δ log p| over every rank's tokens."""
    with torch.no_grad():
        packed = forward(model, stage, mb, temp)
        backwards = forward(model, stage, mb[::-1] if mb else None, temp)
        n = len(mb or [])
        reordered = [(packed["lp"][j] - backwards["lp"][n - 1 - j]).abs()[:int(stage.response_len[i])]
                     for j, i in enumerate(mb or [])]
        alone = [torch.zeros(0, device=device)]
        singles = (mb or [])[:8]
        count = torch.tensor([len(singles)], device=device)
        if distributed:
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        for j in range(int(count)):
            if j < len(singles):
                one = forward(model, stage, [singles[j]], temp)["lp"][0]
                k = int(stage.response_len[singles[j]])
                alone.append((one[:k] - packed["lp"][j, :k]).abs())
            else:
                forward(model, stage, None, temp)
    fewest = torch.tensor([n], device=device)       # a micro-batch of one sequence compares nothing: said so
    if distributed:
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
    out = {"check/packed_sequences_min": int(fewest)}
    for name, diffs in (("packed", reordered), ("alone", alone)):
        # a few thousand values per rank: gathered whole, the quantile exact
        values = gather_values(torch.cat(diffs) if diffs else torch.zeros(0, device=device))
        if values.numel():
            out.update({f"check/{name}_mean_abs_diff": values.mean().item(),
                        f"check/{name}_max_abs_diff": values.max().item(),
                        f"check/{name}_p999_abs_diff": torch.quantile(values.double(), 0.999).item()})
    return out


def empty_stats(loss_kw, columns, cutoff):
    """policy_loss's stats of no tokens (zeros; extremes ±inf), with the same names as a real call's."""
    zero, none = torch.zeros(1, 1, device=device), torch.zeros(1, 1, dtype=torch.bool, device=device)
    stats = L.policy_loss(zero, zero, zero[0], none, **loss_kw, m2po_cutoff=cutoff,
                          old_logprobs=zero if tis_cap is not None else None,
                          ref_logprobs=zero if "ref" in columns else None)[1]
    stats["entropy_sum"] = stats["saved_activations_gib_max"] = torch.zeros((), device=device)
    return stats


def run_update(model, optimizer, stage, batch, temp, loss_kw, columns, measure_memory=False):
    """One AdamW update on the minibatch `batch` (response indices). Returns (metrics, stepped)."""
    lengths = stage.prompt_len[batch] + stage.response_len[batch]
    mbs = micro_batches(stage, batch[np.argsort(-lengths, kind="stable")][rank::world])   # balanced by length
    cutoff = m2po_minibatch_cutoff(model, stage, temp, mbs, columns) if m2po_tau is not None else None
    # the parameters as the optimizer holds them, not model.parameters(): after a no-grad forward (the M2PO or TIS
    # pass) FSDP2 leaves the root module's parameters unsharded (the root does not reshard after forward:
    # torch/distributed/fsdp/_fully_shard/_fsdp_state.py:203) and registers those on the modules
    # (_fsdp_param.py, _setattr_on_modules), so model.parameters() would name tensors that are not the sharded
    # ones the optimizer steps
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.zero_grad(set_to_none=True)
    n_tokens = int(stage.response_len[batch].sum())
    stats = empty_stats(loss_kw, columns, cutoff)     # a rank may have no response of this minibatch
    for k, mb in enumerate(mbs):
        with M.SavedActivations(enabled=measure_memory and k == 0) as saved:
            x = forward(model, stage, mb, temp, columns, with_entropy=True)
        if mb is None:                 # padding pass: keeps FSDP's collectives in step, adds nothing
            (x["lp"].sum() * 0.0).backward()
            continue
        part, s = L.policy_loss(x["lp"], x["behavior"], x["adv"], x["mask"], **loss_kw, m2po_cutoff=cutoff,
                                old_logprobs=x.get("old") if tis_cap is not None else None, ref_logprobs=x.get("ref"),
                                num_tokens=1.0 if deferred_norm else n_tokens, num_seqs=len(batch))
        (part * world).backward()      # FSDP averages gradients over ranks; ×world makes it the sum
        s["entropy_sum"] = x["entropy_sum"]
        s["saved_activations_gib_max"] = torch.tensor(saved.bytes / 2**30, device=device)
        stats = L.merge_stats(stats, s)
    if device.type == "cuda":
        stats["memory_peak_gib_max"] = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30, device=device)
    stats = reduce_stats(stats)
    if deferred_norm:              # Σ kept loss / N_kept: the count is known only now (NAV uses the current ratios)
        scale = 1.0 / stats["kept"].clamp(min=1.0)
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in trainable if p.grad is not None]
        torch._foreach_mul_(grads, scale)
        stats["loss"] = stats["loss"] * scale
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, grad_clip)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    extra = {"grad_norm": grad_norm, "entropy": stats["entropy_sum"] / stats["tokens"].clamp(min=1.0),
             "memory/saved_activations_gib": stats["saved_activations_gib_max"]}
    if "memory_peak_gib_max" in stats:
        extra["memory/peak_gib"] = stats["memory_peak_gib_max"]
    m = L.metrics(stats, extra)                                                   # the one host sync
    stepped = math.isfinite(m["grad_norm"]) and math.isfinite(m["loss/policy"])
    if stepped:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    return m, stepped


# ----------------------------------------------------------------------------- one stage


def logprob_temperature(stage):
    """The temperature of the trainer's log-probs: --temperature, else the stage's sampling temperature."""
    return temperature or stage.temperature


def describe_stage(stage, updates):
    """Log what the stage trains on (`updates` minibatches) and with which loss; returns logprob_temperature."""
    temp = logprob_temperature(stage)
    if temperature and temperature != stage.temperature:
        log(f"WARNING: --temperature={temperature} differs from the sampling temperature {stage.temperature}: "
            f"the ratios will not start at 1")
    G = stage.group_size
    tokens_per_group = stage.response_len.sum() / max(1, len(stage.groups))
    log(f"stage {stage.index}: {len(stage.groups)} groups × G={G} ({int(stage.zero_variance.sum())} with zero reward "
        f"variance, kept: zero advantage); {updates} updates of {prompts_per_update} prompts")
    log(f"  minibatch: {prompts_per_update * G} responses, ~{tokens_per_group * prompts_per_update:.0f} response "
        f"tokens; staleness 0..{max(updates - 1, 0)} updates; temperature {temp}")
    log(f"  loss: clip [{clip_low}, {clip_high}], dual clip {dual_clip}, NAV δ={nav_delta} scope {nav_scope}, "
        f"M2PO τ={m2po_tau}, TIS cap {tis_cap}, KL β={kl_coef} ({kl_estimator}), {agg} over {token_normalizer} tokens")
    return temp


def agreement_bound():
    """The largest mean |ℓ − b| per token between trainer and engine on the same weights, on this device
    (loss.AGREEMENT_MEAN: float32 noise on a CPU, measured ~5e-7 on the toy; bf16 rounding on a GPU, reasoned)."""
    return L.AGREEMENT_MEAN.get(device.type, L.AGREEMENT_MEAN["cuda"])


def response_engines(stage):
    """[n]: the engine that generated each response (its shard's stats.json, generate.py `engine_index`; 0 for a
    shard without one, written by other code than generate.py)."""
    stats = [sh.path.with_suffix(".stats.json") for sh in stage.shards]
    per_shard = [json.loads(p.read_text()).get("engine", 0) if p.exists() else 0 for p in stats]
    return np.asarray(per_shard, dtype=np.int64)[stage.shard_of] if stage.n else np.zeros(0, np.int64)


def engine_agreement(model, stage, temp):
    """The guard on rollouts that the trainer's policy did not generate (an engine serving other weights, or sampling
    otherwise than its log-probs say), before a stage's first update: for up to agreement_responses responses of
    each engine's shards, the mean |ℓ − b| between the trainer's and the stored behavior log-probs; above
    agreement_bound() the run stops naming the engine and the stage. Returns {engine: its mean}."""
    bound = agreement_bound() if engine_mismatch_bound < 0 else engine_mismatch_bound
    engines = response_engines(stage)
    n_engines = int(engines.max()) + 1 if engines.size else 0
    chosen = np.concatenate([np.flatnonzero(engines == e)[:agreement_responses] for e in range(n_engines)])
    sums = torch.zeros(n_engines, 2, dtype=torch.float64, device=device)          # Σ |ℓ − b|, tokens
    with torch.no_grad():
        for mb in micro_batches(stage, chosen[rank::world]):
            x = forward(model, stage, mb, temp)
            for j, i in enumerate(mb or []):
                k = int(stage.response_len[i])
                sums[engines[i], 0] += (x["lp"][j, :k] - x["behavior"][j, :k]).abs().sum().double()
                sums[engines[i], 1] += k
    if distributed:
        dist.all_reduce(sums)
    means = (sums[:, 0] / sums[:, 1].clamp(min=1)).tolist()
    log(f"engine agreement before update 0: mean |log ratio| {', '.join(f'engine {e} {v:.2e}' for e, v in enumerate(means))}"
        f" (bound {bound:g})")
    for e, v in enumerate(means):
        if v > bound:
            raise SystemExit(f"stage {stage.index}, engine {e}: before any update the trainer's log-probs differ from "
                             f"the engine's by {v:.3g} nats per token on average (bound {bound:g}): the engine did not "
                             f"serve the policy the trainer holds, or sampled otherwise (temperature, top_p/top_k); "
                             f"stopping before training on its rollouts")
    return dict(enumerate(means))


def metrics_row(stage, u, groups, counts, lr_now, m, seconds, extra):
    """Update u's line of metrics.jsonl: its place (in the stage: its staleness; in the run; in AdamW's life), its
    minibatch, loss.metrics' values (the engine/trainer mismatch at update 0 only), timing."""
    batch = stage.groups[groups].ravel()
    tokens = int((stage.prompt_len[batch] + stage.response_len[batch]).sum())
    row = {"update": u, "run_update": counts["run_updates"], "optimizer_update": counts["optimizer_updates"],
           "stage": stage.index, "staleness": u, "lr": lr_now, "reward/mean": float(stage.reward[batch].mean()),
           "minibatch/zero_variance_frac": float(stage.zero_variance[groups].mean()),
           "groups": [stage.group_keys[i] for i in groups],     # which prompts (stage positions)
           **extra, "time": time.time(), "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
    row.update({k: v for k, v in m.items() if u == 0 or not k.startswith("mismatch/")})
    return {k: (common.finite_or_none(v) if isinstance(v, float) else v) for k, v in row.items()}


def train_stage(model, optimizer, stage, progress, columns, start_policy, save_dtype):
    """The stage's updates from progress.start on: the TIS pass, the schedule, the loop (metrics lines,
    intermediate policies and resumable states), then the final train state and policy. `columns`: the
    stored per-stage passes computed so far (KL's reference); start_policy: its tokenizer files go with
    every saved policy. Returns its timing."""
    temp, updates = describe_stage(stage, progress.updates), progress.updates
    loss_kw, schedule, start, timing = loss_options(stage), minibatch_schedule(stage, updates), progress.start, {}
    if tis_cap is not None:
        columns = {**columns}
        columns["old"], timing["old_pass_seconds"] = logprob_pass(model, stage, temp, "old", progress.start_weights,
                                                                  progress, may_compute=start == 0)
    kept = None
    if is_main:  # metrics lines after the resumed update are dropped, so the file matches an unbroken run
        progress.work_dir.mkdir(parents=True, exist_ok=True)
        rows = common.read_jsonl(progress.metrics_path) if progress.metrics_path.exists() else []
        kept = [r for r in rows if r.get("update", 0) < start]
        common.atomic_write_lines(progress.metrics_path, kept)
    neg_ratios = broadcast([r.get("ratio/mean_neg_adv") for r in kept] if is_main else None)   # the drift signal so far
    if start == 0 and updates and engine_mismatch_bound != 0 and not (temperature and temperature != stage.temperature):
        engine_agreement(model, stage, temp)       # logged, not in the metrics: the engines' count is the mode's
    if check_packing and start < updates:
        first = stage.groups[schedule[start]].ravel()
        packed_diff = packing_check(model, stage, temp, micro_batches(
            stage, first[np.argsort(-stage.response_len[first], kind="stable")][rank::world])[0])

    def save_policy(directory, done):
        M.save_policy(model, start_policy, save_dtype, directory,
                      {"stage": stage.index, "stage_updates": done, **progress.counts(done)})

    def save_state(done, final=False):
        M.save_state(model, optimizer, progress.state_dir, {
            "update": done, **progress.counts(done), "complete": final, "start_weights": progress.start_weights})
        if release_init_state and init_state and is_main and Path(init_state).exists():
            shutil.rmtree(init_state)         # this stage's own state has taken over from the previous stage's

    nonfinite_in_row, skipped_total, train_seconds = 0, 0, 0.0
    from tqdm import tqdm
    bar = tqdm(range(start, updates), disable=not is_main, desc=f"stage {stage.index} updates",
               initial=start, total=updates)
    done = updates
    for u in bar:
        if stage_ends_before(u, neg_ratios):
            done = u
            break
        t0 = time.perf_counter()
        counts = progress.counts(u)                         # this update's index in the run and in AdamW's life
        lr_now = lr * min(1.0, (counts["optimizer_updates"] + 1) / warmup_updates) if warmup_updates else lr
        for group in optimizer.param_groups:
            group["lr"] = lr_now
        batch = stage.groups[schedule[u]].ravel()           # whole groups: response indices
        m, stepped = run_update(model, optimizer, stage, batch, temp, loss_kw, columns, measure_memory=u == start)
        nonfinite_in_row = 0 if stepped else nonfinite_in_row + 1
        skipped_total += not stepped
        if nonfinite_in_row >= max_nonfinite:
            raise SystemExit(f"{nonfinite_in_row} non-finite updates in a row (at update {u}): stopping; "
                             f"lower --lr or check the rollouts")
        seconds = time.perf_counter() - t0
        train_seconds += seconds
        row = metrics_row(stage, u, schedule[u], counts, lr_now, m, seconds,
                          {"skipped_nonfinite": skipped_total, "update_skipped": not stepped,
                           **(packed_diff if u == start and check_packing else {})})
        neg_ratios.append(row.get("ratio/mean_neg_adv"))
        if is_main:
            common.append_jsonl(progress.metrics_path, row)
            bar.set_postfix(loss=f"{m['loss/policy']:.4f}", reward=f"{row['reward/mean']:.2f}",
                            ratio_neg=f"{m['ratio/mean_neg_adv']:.3f}")
        if save_policy_every and (u + 1) % save_policy_every == 0 and u + 1 < updates:
            save_policy(progress.out_dir.with_name(f"{progress.out_dir.name}_u{u + 1:05d}"), u + 1)
        if checkpoint_every and (u + 1) % checkpoint_every == 0 and u + 1 < updates:
            save_state(u + 1)
    bar.close()
    t_save = time.perf_counter()
    record_stage_end(stage, schedule, done, neg_ratios, progress)
    if progress.save_state:
        save_state(done, final=True)
    first, *copies = progress.policy_dirs or (progress.out_dir,)
    save_policy(first, done)
    if is_main:
        for directory in copies:                 # the same files: copied, not gathered again
            common.atomic_copytree(first, directory)
        if not progress.save_state:
            shutil.rmtree(progress.state_dir, ignore_errors=True)
    barrier()
    progress.after = progress.counts(done)
    return {**timing, "train_seconds": train_seconds, "save_seconds": time.perf_counter() - t_save,
            "updates_this_run": done - start}


def record_stage_end(stage, schedule, done, neg_ratios, progress):
    """stage_end.json beside metrics.jsonl: where the stage ended and why, the drift signal there, and the groups
    (prompts) generated for it but never trained on; the next stage's size is planned from it
    (rollouts.planned_updates)."""
    average, warned = drift_warning(neg_ratios)
    unused = schedule[done:].ravel().tolist()
    if done < progress.updates:
        log(f"stage {stage.index} ends on drift after {done} of {progress.updates} updates: the average 1 − E[ρ | A<0] "
            f"of the last {drift_window} updates is {average:.4f} > {drift_threshold}; {len(unused)} prompts unused")
    if is_main:
        common.atomic_write_json(progress.work_dir / rollouts.STAGE_END, {
            "stage": stage.index, "reason": "drift" if done < progress.updates else "all minibatches",
            "updates": done, "generated_updates": progress.updates, "stage_end": stage_end,
            "drift_signal": average, "drift_warning": warned, "drift_window": drift_window,
            "drift_threshold": drift_threshold, "drift_min_updates": drift_min_updates,
            "unused_prompts": len(unused), "unused_groups": [stage.group_keys[g] for g in unused],
            **progress.counts(done)})


# ----------------------------------------------------------------------------- main


def reference_pass(stage, temp, reference, attention, progress):
    """KL's reference log-probs, stored once per stage: π_ref built for the pass and freed before the
    trainer is built. Returns ({"ref": column} or {}, its timing)."""
    if not reference:
        return {}, {}
    ref_model = M.build(reference, attention=attention, trainable=False, shard_ranks=hsdp_shard_ranks())
    column, seconds = logprob_pass(ref_model, stage, temp, "ref", common.policy_fingerprint(reference), progress)
    del ref_model
    M.release_memory()
    return {"ref": column}, {"ref_pass_seconds": seconds}


def check_disk(stage, start_policy, progress, passes, saves_state, saves_policy=True):
    """Refuse, before any compute, a stage whose outputs will not fit: a train state when it saves one (fp32 weights
    and AdamW's two moments, 12 bytes per parameter; a new one is written beside the current before it replaces
    it), every policy it saves (in the initial model's dtype) and the per-stage log-prob passes still to compute
    (4 bytes per response token each)."""
    n = M.parameter_count(start_policy)
    state = (4 if lora_rank else 12) * n if saves_state else 0
    policies = int(saves_policy) + (max(progress.updates - 1, 0) // save_policy_every if save_policy_every else 0)
    policy_bytes = policies * n * M.checkpoint_dtype(start_policy).itemsize
    pass_bytes = passes * 4 * int(stage.token_offset[-1])
    common.require_free_disk(progress.work_dir, state + policy_bytes + pass_bytes,
                             f"this stage's train state ({state / 1e9:.1f} GB), {policies} policy directory(ies) "
                             f"({policy_bytes / 1e9:.1f} GB) and {passes} log-prob pass(es) ({pass_bytes / 1e9:.1f} GB)")


def write_settings(progress, resolved):
    """optimize_config.json beside metrics.jsonl: the hyperparameters as resolved, what was derived at run
    time, the versions of the code and libraries, and the command line."""
    if is_main:
        progress.work_dir.mkdir(parents=True, exist_ok=True)
        common.atomic_write_json(progress.work_dir / "optimize_config.json", {
            "hyperparameters": common.hyperparameters(globals()), "resolved": resolved, "world": world,
            "device": str(device), "versions": common.versions(), "argv": sys.argv})


def write_timing(progress, timing):
    """optimize_timing.json (rank 0), with every rank's peak RSS."""
    peak_rss = torch.tensor([common.peak_rss_gib()], device=device)
    if distributed:
        parts = [torch.zeros(1, device=device) for _ in range(world)]
        dist.all_gather(parts, peak_rss)
        peak_rss = torch.cat(parts)
    if is_main:
        timing = {**timing, "world": world, "peak_rss_gib_per_rank": peak_rss.tolist()}
        common.atomic_write_json(progress.work_dir / "optimize_timing.json", timing)
        seconds = ", ".join(f"{k} {v:.1f}" for k, v in timing.items() if k.endswith("seconds"))
        log(f"next policy written to {progress.out_dir} ({seconds})")


def check_vocabulary(stage, start_policy):
    if stage.max_token_id() >= (vocab := M.vocab_size(start_policy)):
        raise SystemExit(f"{stage.directory}: token id {stage.max_token_id()} ≥ the policy's vocabulary size {vocab}: "
                         f"rollouts made with another tokenizer?")


def check_lengths(stage, start_policy):
    """Refuse in one line rollouts longer than the policy holds (common.model_max_len, as vLLM derives it): they
    were made with another model or longer length flags, and the trainer would run past its positions silently."""
    limit, key = common.model_max_len(start_policy)
    longest = int((stage.prompt_len + stage.response_len).max(initial=0))
    if limit is not None and longest > limit:
        raise SystemExit(f"{stage.directory}: a prompt and response of {longest} tokens, more than the policy "
                         f"{start_policy} holds ({key} = {limit}): rollouts made with another model, or with "
                         f"--max_prompt_tokens + --max_response_tokens above its limit?")


def build_trainer(start_policy, attention, weights):
    """The policy as the trainer holds it and its AdamW."""
    model = M.build(start_policy, attention=attention, gradient_checkpointing=gradient_checkpointing,
                    lora_rank=lora_rank, lora_alpha=lora_alpha, weights=weights, shard_ranks=hsdp_shard_ranks())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=betas,
                                  weight_decay=weight_decay, eps=1e-8)
    return model, optimizer


def teardown():
    """FSDP2's device mesh holds the process groups: the caller drops the model and optimizer first, so the
    groups' gloo/NCCL threads are shut down and joined here, by destroy_process_group, and not during
    interpreter teardown (a 3-rank gloo run once aborted there: "terminate called without an active exception")."""
    if distributed:
        M.release_memory()
        barrier()
        dist.destroy_process_group()


def kl_reference(start_policy):
    """π_ref of the KL term: --ref_policy, else the stage policy when kl_coef > 0 (said: the usual π_ref is the
    run's first model), else none."""
    reference = common.local_dir(ref_policy) if ref_policy else (start_policy if kl_coef else "")
    if reference and not ref_policy:
        log(f"KL reference: the stage policy {start_policy} (pass --ref_policy=<the run's first model> for the usual π_ref)")
    return reference


def record_settings(progress, stage, start_policy, reference, attention, **more):
    """optimize_config.json with what this stage resolved at run time."""
    write_settings(progress, {"policy": start_policy, "ref_policy": reference, "temperature": logprob_temperature(stage),
                              "attention": attention, "norm_len": loss_options(stage)["norm_len"], **more})


def main():
    t_start = time.perf_counter()
    stage = open_stage(stage_dir)
    start_policy = common.local_dir(policy or stage.manifest["policy"])
    check_vocabulary(stage, start_policy)
    check_lengths(stage, start_policy)
    attention = M.choose_attention(attn_implementation, device)
    log(f"{world} process(es) on {device.type}, attention {attention}"
        + (f"; HSDP: {world // hsdp_shard_ranks()} replica(s) × {hsdp_shard_ranks()} shard(s)" if hsdp_shard_ranks() else ""))
    progress = Progress(out_dir=Path(out) if out else Path(stage_dir) / "policy", updates=updates_per_stage,
                        save_state=save_train_state)
    reference = kl_reference(start_policy)
    check_disk(stage, start_policy, progress, passes=bool(reference) + (tis_cap is not None),
               saves_state=save_train_state or bool(checkpoint_every))
    record_settings(progress, stage, start_policy, reference, attention)
    torch.manual_seed(seed)
    columns, timing = reference_pass(stage, logprob_temperature(stage), reference, attention, progress)
    source = broadcast(M.state_source(progress.state_dir, init_state) if is_main else None)   # resume? rank 0 decides
    model, optimizer = build_trainer(start_policy, attention, weights=source is None)
    progress.start, progress.before, progress.start_weights, said = M.restore(
        model, optimizer, source, resume=source == progress.state_dir, start_weights=common.policy_fingerprint(start_policy),
        start_policy=start_policy)
    if said:
        log(said)
    timing["load_seconds"] = time.perf_counter() - t_start - sum(timing.values())
    timing.update(train_stage(model, optimizer, stage, progress, columns, start_policy,
                              M.checkpoint_dtype(start_policy)))       # every policy keeps the initial dtype
    write_timing(progress, {**timing, "attention": attention})
    del model, optimizer
    teardown()


# ----------------------------------------------------------------------------- resident mode


@dataclasses.dataclass
class Resident:
    """What the resident trainer keeps for the whole run: the policy and AdamW, KL's reference model, and where the
    policies are handed over."""
    model: object
    optimizer: object
    start_policy: Path
    attention: str
    reference: str
    ref_model: object
    fast: Path = None

    @property
    def dtype(self):
        return M.checkpoint_dtype(self.start_policy)


def run_stage_dir(s):
    return Path(run_dir) / f"stage_{s}"


def stage_updates(s):
    """μ of stage s in a resident run, 0 once the run is over: updates_per_stage for each of the `stages` stages, or
    with stage_end=drift planned from where stage s − 1 ended (its stage_end.json), as run_stages.sh plans a run of
    processes per phase. The trainer plans; each policy it hands over tells the engines the next stage's size."""
    if stage_end == "fixed":
        return updates_per_stage if s < stages else 0
    return rollouts.planned_updates(run_dir, s, first=updates_per_stage, growth=drift_growth,
                                    max_updates=drift_max_updates, total=total_updates)


def resident_main():
    """Resident mode: the model, AdamW (and KL's reference model) built once and kept for the stages from the first
    untrained one until the run is over (stage_updates); each stage's rollouts are waited for, trained on
    (train_stage, as a one-stage run would), and the policy handed to the engine process through the fast hand-off
    directory. A resumed run starts from the newest train state in the run directory and trains again the stages
    after it (their rollouts are on disk), which gives the same weights as an unbroken run."""
    partner = handoff.Partner(run_dir, "trainer")
    if is_main:
        partner.announce()
    last, meta = M.newest_state(run_dir)
    first = (last + 1 if meta["complete"] else last) if meta else 0
    # killed after stage `last`'s complete train state, before its policy reached the run directory: saved again below
    resave = meta is not None and meta["complete"] and not common.policy_record(run_stage_dir(last) / "policy")
    if meta is not None and meta["complete"] and not resave:
        publish(partner, last, run_stage_dir(last) / "policy")   # the engine resumes from it
    if stage_updates(first) and not resave:   # the engine's first rollouts: it is asleep before this process takes
        partner.wait_for_rollouts(first)      # memory (to resave, no: the engine waits for that policy, holding none)
    t_start = time.time()
    start_policy = common.local_dir(policy)
    trainer = build_resident(start_policy, weights=meta is None)
    start, before, start_weights, said = M.restore(
        trainer.model, trainer.optimizer, run_stage_dir(last) / "train_state" if meta else None,
        resume=meta is not None and not meta["complete"], start_weights=common.policy_fingerprint(start_policy),
        start_policy=start_policy)
    if said:
        log(said)
    if resave:
        M.save_policy(trainer.model, start_policy, trainer.dtype, run_stage_dir(last) / "policy",
                      {"stage": last, "stage_updates": meta["update"], **{k: meta[k] for k in M.COUNTS}})
        # the cache of the state's load and the policy's gather back to the driver before the engine starts beside
        # this process (vLLM's start refuses a share above the free memory, vllm/v1/worker/utils.py request_memory),
        # as every stage's hand-over does (release_gradients)
        M.release_memory()
        publish(partner, last, run_stage_dir(last) / "policy")
    if is_main:
        partner.timeline({"phase": "start", "name": "trainer_start", "stage": first, "start": t_start, "end": time.time()})
    s = first
    while updates := stage_updates(s):
        # saved into the run directory: every save_every-th stage, and any stage that may be the last (one that reaches
        # the run's updates unless it ends on drift)
        may_end_run = s == stages - 1 if stage_end == "fixed" else before["run_updates"] + updates >= total_updates
        due = may_end_run or bool(save_every and (s + 1) % save_every == 0)
        progress = Progress(out_dir=run_stage_dir(s) / "policy", updates=updates, start=start if s == first else 0,
                            before=before,
                            start_weights=start_weights if s == first else uuid.uuid4().hex[:16], save_state=due,
                            policy_dirs=(trainer.fast / f"policy_{s}", *([run_stage_dir(s) / "policy"] if due else [])))
        resident_stage(partner, trainer, s, progress, check_all=s == first)
        before = progress.after                  # the next stage continues the counts this one recorded
        s += 1
    del trainer
    teardown()


def build_resident(start_policy, weights):
    """The resident trainer's model and AdamW (empty when a train state will fill them), KL's reference model, and
    the hand-off directory: chosen on rank 0 (it sees the same /dev/shm as the engines) and broadcast, since a rank
    that chose otherwise would save alone into a collective; the choice is logged."""
    attention = M.choose_attention(attn_implementation, device)
    reference = kl_reference(start_policy)
    torch.manual_seed(seed)
    ref_model = M.build(reference, attention=attention, trainable=False, shard_ranks=hsdp_shard_ranks()) if reference else None
    model, optimizer = build_trainer(start_policy, attention, weights=weights)
    trainer = Resident(model, optimizer, start_policy, attention, reference, ref_model)
    policy_bytes = M.parameter_count(start_policy) * trainer.dtype.itemsize
    trainer.fast, why = broadcast(handoff.fast_dir(run_dir, policy_bytes) if is_main else None)
    log(f"policies are handed over through {trainer.fast}: {why}")
    return trainer


def resident_stage(partner, trainer, s, progress, check_all):
    """Stage s in the resident trainer: wait for its rollouts, train on them as a one-stage run would, free the
    gradients (the engine wakes next), hand the policy over. check_all: check the disk for a save even when none
    is due (the first stage: a disk without room for one save stops the run now, not hours in)."""
    if is_main:          # where the run stands (run_stages.sh prints this line per stage in the other mode)
        log(tracking.where_line(run_dir, stages * updates_per_stage if stage_end == "fixed" else total_updates, s))
    waited = partner.wait_for_rollouts(s)
    t0 = time.time()
    stage = open_stage(run_stage_dir(s))
    check_vocabulary(stage, trainer.start_policy)
    check_lengths(stage, trainer.start_policy)
    record_settings(progress, stage, trainer.start_policy, trainer.reference, trainer.attention, resident=True)
    saves = progress.save_state or check_all
    check_disk(stage, trainer.start_policy, progress, passes=(trainer.ref_model is not None) + (tis_cap is not None),
               saves_state=saves, saves_policy=saves)
    if is_main:                            # two policies coexist in the hand-off directory: s − 1 and this one
        shutil.rmtree(trainer.fast / f"policy_{s - 2}", ignore_errors=True)
    columns, timing = {}, {}
    if trainer.ref_model is not None:
        columns["ref"], timing["ref_pass_seconds"] = logprob_pass(
            trainer.ref_model, stage, logprob_temperature(stage), "ref",
            common.policy_fingerprint(trainer.reference), progress)
    timing.update(train_stage(trainer.model, trainer.optimizer, stage, progress, columns, trainer.start_policy,
                              trainer.dtype))
    # this process keeps only its resident state (fp32 weights, AdamW), not the gradients (4 bytes per parameter)
    timing["gradient_bytes_kept"] = M.release_gradients(trainer.optimizer)
    publish(partner, s, trainer.fast / f"policy_{s}")
    if is_main and progress.save_state and release_init_state:    # the newest train state replaces the older ones
        for older in range(s):
            shutil.rmtree(run_stage_dir(older) / "train_state", ignore_errors=True)
    write_timing(progress, {**timing, "attention": trainer.attention, "wait_seconds": waited})
    if is_main:
        partner.timeline({"phase": "optimize", "name": f"optimize_{s}", "stage": s, "start": t0, "end": time.time(),
                          "wait_seconds": waited, "gradient_bytes_kept": timing["gradient_bytes_kept"],
                          **{k: v for k, v in timing.items() if k.endswith("seconds")}})


def publish(partner, s, directory):
    """Hand the policy trained on stage s (saved at `directory`) to the engine, with its recorded counts and the
    size of the stage it generates (0: the run is over)."""
    if is_main:
        record = common.policy_record(directory)
        partner.publish_policy(s, directory, Path(run_dir) / f"stage_{s}" / "policy", record["fingerprint"],
                               run_updates=record["run_updates"],
                               next_stage_prompts=stage_updates(s + 1) * prompts_per_update)


if __name__ == "__main__":
    resident_main() if resident else main()
