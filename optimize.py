"""Optimize one stage: μ minibatch updates of the stage policy on its (increasingly stale) rollouts.

    python optimize.py --stage_dir=runs/toy/stage_0                     # one process: CPU or one GPU
    torchrun --nproc_per_node=4 optimize.py --stage_dir=runs/x/stage_0  # FSDP2 over 4 GPUs

Reads <stage_dir>/rollouts (validated before any compute), runs `updates_per_stage` AdamW updates of
`prompts_per_update` whole groups each with loss.policy_loss, and writes the next policy as an HF
directory (<stage_dir>/policy by default, renamed into place when complete) that vLLM loads directly.
One line per update goes to <stage_dir>/metrics.jsonl. A resumable state is saved every
`checkpoint_every` updates; rerunning the same command continues from it.
"""
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import common
import loss as L

# ----------------------------------------------------------------------------- hyperparameters
stage_dir = "runs/toy/stage_0"  # holds rollouts/ (read only)
policy = ""                     # stage policy to start from (default: the one that generated the rollouts)
out = ""                        # next policy directory (default: <stage_dir>/policy); metrics.jsonl,
                                # train_state/ and the other outputs go next to it (replays: elsewhere)
updates_per_stage = 16          # μ: optimizer updates on this stage's rollouts (paper: 1024; GRPO: 4)
prompts_per_update = 8          # whole groups per update (paper: 64 prompts × G=8 = 512 responses)
skip_zero_variance = True       # leave out groups whose rewards are all equal (zero advantage)
seed = 0                        # minibatch order: a seeded shuffle of the groups, reshuffled each pass
lr = 1e-6                       # AdamW learning rate (constant after warmup)
warmup_updates = 0              # linear warmup from 0
weight_decay = 0.01
adam_betas = "0.9,0.999"
grad_clip = 1.0                 # max global grad norm
temperature = 0.0               # log-prob temperature; 0: the sampling temperature from the manifest
clip_low = 0.0                  # ratio clip bounds (μ-GRPO 0 and 5; GRPO 0.8 and 1.2; DAPO 0.8 and 1.28)
clip_high = 5.0
dual_clip = None                # c > 1 caps the A<0 loss at −c·A (None: off)
nav_delta = 1e-4                # NAV trigger threshold on the ratio (None: NAV off)
nav_scope = "H"                 # none | T | H | S | seq
m2po_tau = None                 # M2PO second-moment threshold (None: off; M2PO uses 0.04 with no clip)
tis_cap = None                  # truncated importance weight cap for engine/trainer mismatch (None: off)
agg = "token-mean"              # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
norm_len = 0                    # Dr. GRPO constant length (0: the manifest's max response tokens)
micro_batch_tokens = 16384      # tokens (prompt + response) packed into one micro-batch, per GPU
gradient_checkpointing = False
lora_rank = 0                   # > 0: train LoRA adapters (peft) on all linear layers; merged at save
lora_alpha = 32
checkpoint_every = 0            # updates between resumable states (0: only at the end)
max_nonfinite = 3               # consecutive non-finite updates before the run stops
mismatch_warn = 0.05            # warn when the first update's mean |log ratio| exceeds this
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])
common.check_choice("nav_scope", nav_scope, L.NAV_SCOPES)
common.check_choice("agg", agg, L.AGG_MODES)
betas = tuple(float(b) for b in adam_betas.split(","))

# distributed is an if: torchrun sets WORLD_SIZE
distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
if distributed:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
is_main = rank == 0
if distributed and lora_rank:
    sys.exit("--lora_rank with torchrun is not supported: LoRA runs in one process (its adapters are small)")
stage_path = Path(stage_dir)
rollout_dir = stage_path / "rollouts"
out_dir = Path(out) if out else stage_path / "policy"
work_dir = out_dir.parent                       # everything this run writes lives here
state_dir = work_dir / "train_state"
metrics_path = work_dir / "metrics.jsonl"


def log(*args):
    if is_main:
        print(*args, flush=True)


# ----------------------------------------------------------------------------- rollouts

REQUIRED = ("prompt_id", "sample_idx", "prompt_token_ids", "response_token_ids", "behavior_logprobs",
            "finish_reason", "reward", "advantage", "stage", "policy")


def _all_finite(values):
    """True when every value is a finite number: one C-level sum (NaN and ±inf survive a sum, and a
    non-number raises) instead of a Python check per token, which matters at a billion tokens."""
    try:
        return math.isfinite(sum(values))
    except TypeError:
        return False


def load_rollouts(directory):
    """Validated groups of a complete stage: a list of lists of response dicts (G per group)."""
    manifest_file = directory / "manifest.json"
    if not manifest_file.exists():
        shards = sorted(directory.glob("shard_*.jsonl"))
        raise SystemExit(f"{directory}: no manifest.json ({len(shards)} shards present): the stage's generation "
                         f"is incomplete; rerun generate.py to finish it")
    manifest = json.loads(manifest_file.read_text())
    groups = {}
    for name in manifest["shards"]:
        path = directory / name
        if not path.exists():
            raise SystemExit(f"{path}: listed in the manifest but missing")
        for n, row in enumerate(common.read_jsonl(path), 1):
            where = f"{path}:{n}"
            for field in REQUIRED:
                if field not in row:
                    raise SystemExit(f"{where}: missing field {field!r}")
            if len(row["response_token_ids"]) != len(row["behavior_logprobs"]):
                raise SystemExit(f"{where}: {len(row['response_token_ids'])} response tokens but "
                                 f"{len(row['behavior_logprobs'])} behavior_logprobs")
            if not row["response_token_ids"] or not row["prompt_token_ids"]:
                raise SystemExit(f"{where}: empty prompt_token_ids or response_token_ids")
            if not _all_finite(row["behavior_logprobs"]):
                raise SystemExit(f"{where}: non-finite value in behavior_logprobs")
            if not math.isfinite(row["advantage"]) or not math.isfinite(row["reward"]):
                raise SystemExit(f"{where}: non-finite reward or advantage")
            groups.setdefault(row.get("group", row["prompt_id"]), []).append(row)  # a prompt may recur in a stage
    G = manifest["sampling"]["n"]
    for pid, g in groups.items():
        if sorted(r["sample_idx"] for r in g) != list(range(G)):
            raise SystemExit(f"{directory}: group {pid!r} has samples {sorted(r['sample_idx'] for r in g)}, "
                             f"expected 0..{G - 1}")
        g.sort(key=lambda r: r["sample_idx"])
    return manifest, list(groups.values())


def micro_batches(responses):
    """Micro-batches of at most micro_batch_tokens tokens (prompt + response), longest first; each
    is packed into one row, so no compute goes to padding."""
    ordered = sorted(responses, key=lambda r: len(r["prompt_token_ids"]) + len(r["response_token_ids"]), reverse=True)
    batches, current, tokens = [], [], 0
    for r in ordered:
        n = len(r["prompt_token_ids"]) + len(r["response_token_ids"])
        if current and tokens + n > micro_batch_tokens:
            batches.append(current)
            current, tokens = [], 0
        current.append(r)
        tokens += n
    return batches + ([current] if current else [])


def pack(batch):
    """One packed row for the model and the per-response tensors the loss needs.

    input_ids, position_ids [1, N]: the sequences back to back, positions restarting at 0 for each
    (transformers then masks attention block-diagonally); keep [R]: the positions whose logits
    predict a response token; targets [R]; behavior, old, mask [b, T_resp]; advantages [b].
    """
    ids, pos, keep, targets = [], [], [], []
    resp_width = max(len(r["response_token_ids"]) for r in batch)
    behavior = torch.zeros(len(batch), resp_width)
    old = torch.zeros(len(batch), resp_width)       # trainer log-probs of the behavior policy (TIS)
    mask = torch.zeros(len(batch), resp_width, dtype=torch.bool)
    for i, r in enumerate(batch):
        p, n, offset = len(r["prompt_token_ids"]), len(r["response_token_ids"]), len(ids)
        ids += r["prompt_token_ids"] + r["response_token_ids"]
        pos += list(range(p + n))
        keep += range(offset + p - 1, offset + p + n - 1)    # logits at t predict token t+1
        targets += r["response_token_ids"]
        behavior[i, :n] = torch.tensor(r["behavior_logprobs"])
        if "old_logprobs" in r:
            old[i, :n] = torch.tensor(r["old_logprobs"])
        mask[i, :n] = True
    adv = torch.tensor([float(r["advantage"]) for r in batch])
    return (torch.tensor([ids]), torch.tensor([pos]), torch.tensor(keep), torch.tensor(targets), behavior, old,
            mask, adv)


def response_logprobs(model, batch, temp, with_entropy=False):
    """Current log-probs [b, T_resp] (padded with 0) of the batch's response tokens, the stored
    behavior (and old) log-probs, mask and advantages, and the summed entropy. Logits are computed
    only at response positions ([R, V], bf16 on GPU); token_logprobs upcasts them chunk by chunk."""
    ids, pos, keep, targets, behavior, old, mask, adv = (t.to(device) for t in pack(batch))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" and not distributed):
        logits = model(input_ids=ids, position_ids=pos, logits_to_keep=keep, use_cache=False).logits[0]  # [R, V]
    lp_flat = L.token_logprobs(logits, targets, temp)                                 # [R] fp32
    lp = torch.zeros(mask.shape, device=device).masked_scatter(mask, lp_flat)         # [b, T_resp]
    entropy = L.token_entropy(logits.detach(), temp).sum() if with_entropy else None
    return lp, behavior, old, mask, adv, entropy


def padded_micro_batches(responses):
    """This rank's micro-batches, padded with None to the largest count over the ranks: FSDP's
    collectives need every rank to run the same number of forward/backward passes."""
    mbs = micro_batches(responses)
    if distributed:
        count = torch.tensor([len(mbs)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        mbs += [None] * (int(count) - len(mbs))
    return mbs


# ----------------------------------------------------------------------------- model and state


def load_model(path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # fp32 master weights
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_rank:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules="all-linear",
                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
    if distributed:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                  reduce_dtype=torch.float32)
        model.to(device)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    else:
        model.to(device)
    return model


def save_state(model, optimizer, update):
    """Resumable state, atomically: written to train_state.tmp, then renamed over train_state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    tmp = state_dir.with_name("train_state.tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    if distributed:
        dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    if distributed:
        dist.barrier()
    if is_main:
        common.atomic_write_json(tmp / "progress.json", {"update": update, "world": world,
                                                         "rng": torch.get_rng_state().tolist()})
        old = state_dir.with_name("train_state.old")
        shutil.rmtree(old, ignore_errors=True)
        if state_dir.exists():
            os.replace(state_dir, old)
        os.replace(tmp, state_dir)
        shutil.rmtree(old, ignore_errors=True)
        common.fsync_dir(work_dir)
    if distributed:
        dist.barrier()


def load_state(model, optimizer):
    """Update index to continue from (0 when there is no saved state)."""
    progress = state_dir / "progress.json"
    if not progress.exists():
        return 0
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(state_dir))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    meta = json.loads(progress.read_text())
    torch.set_rng_state(torch.tensor(meta["rng"], dtype=torch.uint8))
    return meta["update"]


def save_policy(model, source_dir, dtype):
    """The next policy as an HF directory vLLM loads: full weights (LoRA merged), tokenizer, configs."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    if lora_rank:
        model = model.merge_and_unload()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return
    bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
    if bad:
        raise SystemExit(f"refusing to save non-finite weights ({bad[:3]}...)")
    state = {k: v.to(dtype) for k, v in state.items()}
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    if not Path(source_dir).is_dir():      # a hub name: fetch its small files (weights are ours)
        from huggingface_hub import snapshot_download
        source_dir = snapshot_download(source_dir, allow_patterns=["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"])
    for f in Path(source_dir).iterdir():   # tokenizer, chat template, generation config
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".safetensors.index.json", ".pt")) \
                and f.name != "config.json":
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    common.fsync_dir(out_dir.parent)


# ----------------------------------------------------------------------------- the loop


def reduce_metrics(m, tokens):
    """Combine the ranks' metrics: token-weighted means, except min, max and the token count."""
    keys = sorted(m)
    finite = [math.isfinite(m[k]) for k in keys]
    vals = torch.tensor([m[k] if f else 0.0 for k, f in zip(keys, finite)], dtype=torch.float64, device=device)
    weights = torch.tensor([float(tokens) if f else 0.0 for f in finite], dtype=torch.float64, device=device)
    lo = torch.tensor([m[k] if f else math.inf for k, f in zip(keys, finite)], dtype=torch.float64, device=device)
    hi = torch.tensor([m[k] if f else -math.inf for k, f in zip(keys, finite)], dtype=torch.float64, device=device)
    sums = torch.stack([vals * weights, weights, vals])
    dist.all_reduce(sums)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    out = {}
    for i, k in enumerate(keys):
        if k.endswith("/min"):
            out[k] = lo[i].item()
        elif k.endswith("/max") or k.endswith("max_abs_log_ratio"):
            out[k] = hi[i].item()
        elif k == "loss/tokens":
            out[k] = sums[2, i].item()
        else:
            out[k] = (sums[0, i] / sums[1, i]).item() if sums[1, i] > 0 else math.nan
    return out


def main():
    t_start = time.perf_counter()
    manifest, groups = load_rollouts(rollout_dir)
    start_policy = policy or manifest["policy"]
    temp = temperature or manifest["sampling"]["temperature"]
    if temperature and temperature != manifest["sampling"]["temperature"]:
        log(f"WARNING: --temperature={temperature} differs from the sampling temperature "
            f"{manifest['sampling']['temperature']}: the ratios will not start at 1")
    G = manifest["sampling"]["n"]
    if skip_zero_variance:
        kept = [g for g in groups if not all(r["reward"] == g[0]["reward"] for r in g)]
        log(f"skipping {len(groups) - len(kept)} of {len(groups)} groups with zero reward variance")
        groups = kept
    if len(groups) < prompts_per_update:
        raise SystemExit(f"{rollout_dir}: {len(groups)} usable groups, fewer than --prompts_per_update="
                         f"{prompts_per_update}")
    tokens_per_group = sum(len(r["response_token_ids"]) for g in groups for r in g) / len(groups)
    log(f"stage {manifest['stage']}: {len(groups)} groups × G={G}; {updates_per_stage} updates of {prompts_per_update} "
        f"prompts ({prompts_per_update * G} responses, ~{tokens_per_group * prompts_per_update:.0f} response tokens) = "
        f"{updates_per_stage * prompts_per_update / len(groups):.2f} passes over the data; staleness 0..{updates_per_stage - 1} "
        f"updates; {world} process(es) on {device.type}; temperature {temp}; clip [{clip_low}, {clip_high}], "
        f"dual clip {dual_clip}, NAV δ={nav_delta} scope {nav_scope}, M2PO τ={m2po_tau}, TIS cap {tis_cap}, agg {agg}")

    from transformers import AutoConfig
    src_cfg = AutoConfig.from_pretrained(start_policy)
    save_dtype = getattr(src_cfg, "dtype", None) or getattr(src_cfg, "torch_dtype", None) or torch.float32
    save_dtype = getattr(torch, save_dtype) if isinstance(save_dtype, str) else save_dtype
    torch.manual_seed(seed)
    model = load_model(start_policy)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=betas, weight_decay=weight_decay, eps=1e-8)
    start = load_state(model, optimizer)
    if start:
        log(f"resuming from {state_dir} at update {start}")
    if tis_cap is not None:
        attach_old_logprobs(model, groups, temp, fresh=start == 0)
    if is_main:  # metrics lines after the resumed update are dropped, so the file matches an unbroken run
        work_dir.mkdir(parents=True, exist_ok=True)
        rows = common.read_jsonl(metrics_path) if metrics_path.exists() else []
        common.atomic_write_lines(metrics_path, [r for r in rows if r.get("update", 0) < start])
    load_seconds = time.perf_counter() - t_start
    length_norm = norm_len or manifest["sampling"]["max_tokens"]
    loss_kw = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, nav_delta=nav_delta,
                   nav_scope=nav_scope, tis_cap=tis_cap, agg=agg, norm_len=length_norm)
    nonfinite_in_row, skipped_total, train_seconds = 0, 0, 0.0
    from tqdm import tqdm
    bar = tqdm(range(start, updates_per_stage), disable=not is_main, desc=f"stage {manifest['stage']} updates",
               initial=start, total=updates_per_stage)
    for u in bar:
        t0 = time.perf_counter()
        lr_now = lr * min(1.0, (u + 1) / warmup_updates) if warmup_updates else lr
        for group in optimizer.param_groups:
            group["lr"] = lr_now
        batch = [r for g in common.shuffled_window(groups, u * prompts_per_update, prompts_per_update, seed)
                 for r in g]  # whole groups, reshuffled each pass
        n_tokens = sum(len(r["response_token_ids"]) for r in batch)
        mine = sorted(batch, key=lambda r: -len(r["response_token_ids"]))[rank::world]   # balanced by length
        mbs = padded_micro_batches(mine)
        m2po_keep = m2po_masks(model, mbs, batch, temp) if m2po_tau is not None else None
        collected, entropy_sum = [], 0.0
        optimizer.zero_grad(set_to_none=True)
        for k, mb in enumerate(mbs):
            lp, behavior, old, mask, adv, entropy = response_logprobs(model, mb or batch[:1], temp,
                                                                      with_entropy=True)
            if mb is None:                 # padding pass: keeps FSDP's collectives in step, adds nothing
                (lp.sum() * 0.0).backward()
                continue
            keep = m2po_keep[k] if m2po_keep is not None else None
            part, _ = L.policy_loss(lp, behavior, adv, mask, old_logprobs=old if tis_cap is not None else None,
                                    num_tokens=n_tokens, num_seqs=len(batch), keep_mask=keep, return_metrics=False,
                                    **loss_kw)
            (part * world).backward()   # FSDP averages gradients over ranks; ×world makes it the sum
            collected.append((lp.detach(), behavior, old, mask, adv, keep))
            entropy_sum += entropy.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        m, my_tokens = update_metrics(collected, loss_kw)
        if distributed:
            m = reduce_metrics(m, my_tokens)
        finite = math.isfinite(grad_norm) and math.isfinite(m["loss/policy"])
        if finite:
            optimizer.step()
            nonfinite_in_row = 0
        else:
            optimizer.zero_grad(set_to_none=True)
            nonfinite_in_row += 1
            skipped_total += 1
            if nonfinite_in_row >= max_nonfinite:
                raise SystemExit(f"{nonfinite_in_row} non-finite updates in a row (at update {u}): stopping; "
                                 f"lower --lr or check the rollouts")
        entropy = torch.tensor([entropy_sum, float(my_tokens)], dtype=torch.float64)
        if distributed:
            dist.all_reduce(entropy)
        seconds = time.perf_counter() - t0
        train_seconds += seconds
        row = {"update": u, "stage": manifest["stage"], "staleness": u, "lr": lr_now, "grad_norm": grad_norm,
               "entropy": (entropy[0] / entropy[1]).item(), "reward/mean": sum(r["reward"] for r in batch) / len(batch),
               "skipped_nonfinite": skipped_total, "update_skipped": not finite, "time": time.time(),
               "seconds": seconds, "tokens": sum(len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in batch)}
        row["tokens_per_s"] = row["tokens"] / seconds
        if device.type == "cuda":
            row["memory/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row.update({k: v for k, v in m.items() if u == 0 or not k.startswith("mismatch/")})
        if u == 0 and m["mismatch/mean_abs_log_ratio"] > mismatch_warn:
            log(f"WARNING: before any update the mean |log ratio| between trainer and engine is "
                f"{m['mismatch/mean_abs_log_ratio']:.3f} (> {mismatch_warn}): check the temperature, top_p/top_k "
                f"and that --policy is the checkpoint that generated the rollouts")
        row = {k: (common.finite_or_none(v) if isinstance(v, float) else v) for k, v in row.items()}
        if is_main:
            common.append_jsonl(metrics_path, row)
            bar.set_postfix(loss=f"{m['loss/policy']:.4f}", reward=f"{row['reward/mean']:.2f}",
                            ratio_neg=f"{m['ratio/mean_neg_adv']:.3f}")
        if checkpoint_every and (u + 1) % checkpoint_every == 0 and u + 1 < updates_per_stage:
            save_state(model, optimizer, u + 1)
    t_save = time.perf_counter()
    save_policy(model, start_policy, save_dtype)
    if is_main:
        shutil.rmtree(state_dir, ignore_errors=True)
        common.atomic_write_json(work_dir / "optimize_timing.json", {
            "load_seconds": load_seconds, "train_seconds": train_seconds,
            "save_seconds": time.perf_counter() - t_save, "updates_this_run": updates_per_stage - start})
        log(f"next policy written to {out_dir} (load {load_seconds:.1f} s, train {train_seconds:.1f} s, "
            f"save {time.perf_counter() - t_save:.1f} s)")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def attach_old_logprobs(model, groups, temp, fresh):
    """TIS needs the trainer's log-probs of the stage policy for every response: one no-grad pass
    over the stage before the first update, saved to old_logprobs.jsonl for resumes."""
    path = work_dir / "old_logprobs.jsonl"
    responses = [r for g in groups for r in g]
    key = lambda r: f"{r.get('group', r['prompt_id'])}/{r['sample_idx']}"  # noqa: E731
    if not path.exists():
        if not fresh:
            raise SystemExit(f"{path} is missing but training already started: the stage policy's log-probs "
                             f"cannot be recomputed; delete {state_dir} to restart the stage")
        mine = sorted(responses, key=lambda r: -len(r["response_token_ids"]))[rank::world]
        found = {}
        with torch.no_grad():
            for mb in padded_micro_batches(mine):
                lp, _, _, mask, _, _ = response_logprobs(model, mb or responses[:1], temp)
                for r, row, m in zip(mb or [], lp.cpu(), mask.cpu()):
                    found[key(r)] = [round(x, 6) for x in row[m].tolist()]
        if distributed:
            parts = [None] * world
            dist.all_gather_object(parts, found)
            found = {k: v for p in parts for k, v in p.items()}
        if is_main:
            common.atomic_write_lines(path, [{"key": k, "old_logprobs": v} for k, v in found.items()])
        if distributed:
            dist.barrier()
    table = {row["key"]: row["old_logprobs"] for row in common.read_jsonl(path)}
    for r in responses:
        r["old_logprobs"] = table[key(r)]


def m2po_masks(model, mbs, batch, temp):
    """M2PO keep-masks for this rank's micro-batches, from a no-grad pass over all of them at once."""
    with torch.no_grad():
        parts = [response_logprobs(model, mb or batch[:1], temp) for mb in mbs]
    parts = [p for p, mb in zip(parts, mbs) if mb is not None]
    T = max(p[0].shape[1] for p in parts)
    pad = lambda x: torch.nn.functional.pad(x, (0, T - x.shape[1]))  # noqa: E731
    reference = [old if tis_cap is not None else behavior for _, behavior, old, _, _, _ in parts]
    log_ratio = torch.cat([pad(p[0] - ref) for p, ref in zip(parts, reference)])
    mask = torch.cat([pad(p[3]) for p in parts])
    adv = torch.cat([p[4] for p in parts])
    keep = L.m2po_mask(log_ratio, adv, mask, m2po_tau)
    out, i = [], 0
    for p in parts:
        out.append(keep[i:i + p[0].shape[0], :p[0].shape[1]])
        i += p[0].shape[0]
    return out + [None] * (len(mbs) - len(parts))


def update_metrics(collected, loss_kw):
    """policy_loss metrics over all micro-batches of this rank's share, the mismatch figures, and
    this rank's response-token count."""
    T = max(c[0].shape[1] for c in collected)
    pad = lambda x: torch.nn.functional.pad(x, (0, T - x.shape[1]))  # noqa: E731
    lp, behavior, old, mask = (torch.cat([pad(c[i]) for c in collected]) for i in range(4))
    adv = torch.cat([c[4] for c in collected])
    keep = torch.cat([pad(c[5]) for c in collected]) if collected[0][5] is not None else None
    _, m = L.policy_loss(lp, behavior, adv, mask, old_logprobs=old if tis_cap is not None else None,
                         keep_mask=keep, **loss_kw)
    if m2po_tau is not None:
        m["m2po/masked_frac"] = float((mask & ~keep).sum() / mask.sum().clamp(min=1))
    abs_lr = (lp - behavior).abs()[mask]            # trainer vs engine, whatever the ratio's reference
    m["mismatch/mean_abs_log_ratio"] = abs_lr.mean().item()
    m["mismatch/max_abs_log_ratio"] = abs_lr.max().item()
    m["mismatch/kl"] = ((lp - behavior).exp() - 1 - (lp - behavior))[mask].mean().item()
    return m, int(mask.sum())


if __name__ == "__main__":
    main()
