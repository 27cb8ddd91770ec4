"""One update of the policy on a minibatch of a stage's responses (docs/design.md §2): the stage's
groups in one seeded order cut into minibatches; for each, the responses in packed micro-batches
(mu_grpo/passes.py) through loss.policy_loss, summed over micro-batches and ranks, and one AdamW
step, with the measurements of what the step took. optimize.py holds the hyperparameters and the
stage loop; this module reads no script's globals.
"""
import dataclasses
import math

import numpy as np
import torch

import loss as L
from mu_grpo import stage_rules
from mu_grpo import trainer_model as M
from mu_grpo.passes import adam_metrics, adam_sums, forward, micro_batches
from mu_grpo.trainer_model import log


# ------------------------------------------------------------- the order of prompts and minibatches


def minibatch_schedule(stage, updates_per_stage, prompts_per_update, seed,
                       skip_zero_variance=False):
    """[updates_per_stage, prompts_per_update] group indices: the stage's groups in one seeded
    order, cut into consecutive minibatches, so update u sees groups it alone sees, u updates stale.
    A stage with too few groups wraps into a new seeded order (said loudly: responses are then
    reused). skip_zero_variance: only the groups whose rewards differ."""
    candidates = np.arange(len(stage.groups))
    if skip_zero_variance:
        candidates = candidates[~stage.zero_variance]
        log(f"skip_zero_variance: leaving out {int(stage.zero_variance.sum())} of "
            f"{len(stage.groups)} groups with zero reward variance")
    need = updates_per_stage * prompts_per_update
    if need == 0:
        return np.zeros((0, prompts_per_update), dtype=np.int64)
    if len(candidates) < prompts_per_update:
        raise SystemExit(f"{stage.directory}: {len(candidates)} usable groups, fewer than "
                         f"--prompts_per_update={prompts_per_update}")
    if need > len(candidates):
        log(f"WARNING: {updates_per_stage} updates × {prompts_per_update} prompts need {need} "
            f"groups but the stage has {len(candidates)} usable: the schedule wraps into "
            f"{need / len(candidates):.2f} passes, so responses are reused and update u is no "
            "longer exactly u updates stale")
    elif need < len(candidates):
        log(f"note: {len(candidates) - need} of the stage's {len(candidates)} groups are left "
            f"unused ({updates_per_stage} updates × {prompts_per_update} prompts)")
    order = stage_rules.shuffled_window(candidates.tolist(), 0, need, seed)
    return np.asarray(order, dtype=np.int64).reshape(updates_per_stage, prompts_per_update)


# ----------------------------------------------------------------------------- one update


def m2po_minibatch_cutoff(model, stage, temp, mbs, columns, tau, tis_cap):
    """M2PO's cutoff over the whole minibatch: a no-grad pass over this rank's micro-batches, then
    every rank's harmful (log ρ)² gathered, so the mask does not depend on the number of GPUs."""
    _, _, device = M.placement()
    sq = [torch.zeros(0, device=device)]
    with torch.no_grad():
        for mb in mbs:
            x = forward(model, stage, mb, temp, columns)
            if mb is None:
                continue
            reference = x["old"] if "old" in x and tis_cap is not None else x["behavior"]
            log_ratio = torch.clamp(x["lp"] - reference, -L.LOG_RATIO_LIMIT,
                                    L.LOG_RATIO_LIMIT) * x["mask"]
            sq.append((log_ratio ** 2)[L.m2po_harmful(log_ratio, x["adv"], x["mask"])])
    return L.m2po_cutoff(M.gather_values(torch.cat(sq)), tau)


def empty_stats(loss, columns, cutoff):
    """policy_loss's stats of no tokens (zeros; extremes ±inf), with the same names as a real
    call's."""
    _, _, device = M.placement()
    zero, none = torch.zeros(1, 1, device=device), torch.zeros(
        1, 1, dtype=torch.bool, device=device)
    stats = L.policy_loss(zero, zero, zero[0], none, loss, m2po_cutoff=cutoff,
                          old_logprobs=zero if loss.tis_cap is not None else None,
                          ref_logprobs=zero if "ref" in columns else None)[1]
    stats["entropy_sum"] = stats["saved_activations_gib_max"] = torch.zeros((), device=device)
    return stats


def stage_loss(loss, stage, norm_len=0):
    """The loss.Loss of a stage: `loss` with Dr. GRPO's constant length (norm_len; 0: the stage's
    longest response), and, when the loss names another advantage than generate.py's (stored with
    the rollouts), that one computed from the stage's rewards, whole groups at once, into
    stage.advantage."""
    if loss.advantage != "group":
        stage.advantage[stage.groups] = L.response_advantages(
            stage.reward[stage.groups], loss.advantage,
            loss.soft_value_beta).numpy()
    return dataclasses.replace(loss, norm_len=norm_len or stage.max_response_tokens)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How an update makes its step from a minibatch: the loss.Loss, the tokens packed into one
    micro-batch, and the max global grad norm."""
    loss: L.Loss
    micro_batch_tokens: int
    grad_clip: float

    @property
    def deferred_norm(self):
        """The loss is a token mean over the kept tokens (policy_loss's defaults), whose count is
        known only once every micro-batch has run: the micro-batches' losses are sums and the
        gradient is divided at the end."""
        return self.loss.agg == "token-mean" and self.loss.token_normalizer == "kept"


def warmup(done, updates):
    """A linear warmup's lr factor at the update after `done` updates: (done + 1) / updates, up to 1
    (none: 1)."""
    return min(1.0, (done + 1) / updates) if updates else 1.0


def run_update(model, optimizer, stage, batch, temp, columns, recipe, measure_memory=False):
    """One AdamW update on the minibatch `batch` (response indices) with its log-probs at
    temperature `temp`, as `recipe` says. columns: the stored per-stage passes ("old": TIS's, "ref":
    KL's). Returns (metrics, stepped)."""
    rank, world, device = M.placement()
    # memory/peak_gib is this update's: max_memory_allocated is the peak since the last
    if device.type == "cuda":
        # reset, else since the process began (torch/cuda/memory.py:553)
        torch.cuda.reset_peak_memory_stats(device)
    loss, micro_batch_tokens, deferred_norm = (recipe.loss, recipe.micro_batch_tokens,
                                               recipe.deferred_norm)
    tis_cap, m2po_tau = loss.tis_cap, loss.m2po_tau
    lengths = stage.prompt_len[batch] + stage.response_len[batch]
    # this rank's responses, balanced by length
    mine = batch[np.argsort(-lengths, kind="stable")][rank::world]
    mbs = micro_batches(stage, mine, micro_batch_tokens)
    cutoff = None if m2po_tau is None else m2po_minibatch_cutoff(
        model, stage, temp, mbs, columns, m2po_tau, tis_cap)
    # the parameters as the optimizer holds them, not model.parameters(): after a no-grad forward
    # (the M2PO or TIS pass) FSDP2 leaves the root module's parameters unsharded (the root does not
    # reshard after forward: torch/distributed/fsdp/_fully_shard/_fsdp_state.py:203) and registers
    # those on the modules (_fsdp_param.py, _setattr_on_modules), so model.parameters() would name
    # tensors that are not the sharded ones the optimizer steps
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.zero_grad(set_to_none=True)
    n_tokens = int(stage.response_len[batch].sum())
    stats = empty_stats(loss, columns, cutoff)     # a rank may have no response of this minibatch
    for k, mb in enumerate(mbs):
        with M.SavedActivations(enabled=measure_memory and k == 0) as saved:
            x = forward(model, stage, mb, temp, columns, with_entropy=True)
        # padding pass: keeps FSDP's collectives in step, adds nothing
        if mb is None:
            (x["lp"].sum() * 0.0).backward()
            continue
        part, s = L.policy_loss(x["lp"], x["behavior"], x["adv"], x["mask"], loss,
                                m2po_cutoff=cutoff,
                                old_logprobs=x.get("old") if tis_cap is not None else None,
                                ref_logprobs=x.get("ref"),
                                num_tokens=1.0 if deferred_norm else n_tokens, num_seqs=len(batch))
        (part * world).backward()      # FSDP averages gradients over ranks; ×world makes it the sum
        s["entropy_sum"] = x["entropy_sum"]
        s["saved_activations_gib_max"] = torch.tensor(saved.bytes / 2**30, device=device)
        stats = L.merge_stats(stats, s)
    if device.type == "cuda":
        stats["memory_peak_gib_max"] = torch.tensor(
            torch.cuda.max_memory_allocated(device) / 2**30, device=device)
    stats = M.reduce_stats(stats)
    # Σ kept loss / N_kept: the count is known only now (NAV uses the current ratios)
    if deferred_norm:
        scale = 1.0 / stats["kept"].clamp(min=1.0)
        grads = [
            p.grad.to_local() if hasattr(p.grad,
                                         "to_local") else p.grad for p in trainable
                                         if p.grad is not None]
        torch._foreach_mul_(grads, scale)
        stats["loss"] = stats["loss"] * scale
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, recipe.grad_clip)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    extra = {"grad_norm": grad_norm,
             "entropy": stats["entropy_sum"] / stats["tokens"].clamp(min=1.0),
             "memory/saved_activations_gib": stats["saved_activations_gib_max"]}
    if "memory_peak_gib_max" in stats:
        extra["memory/peak_gib"] = stats["memory_peak_gib_max"]
    # the one host sync
    m = L.metrics(stats, extra)
    stepped = math.isfinite(m["grad_norm"]) and math.isfinite(m["loss/policy"])
    if stepped:
        before = adam_sums(optimizer, after_step=False)
        optimizer.step()
        m.update(
            adam_metrics(
                *(M.reduce_stats(sums) for sums in (
                    before, adam_sums(optimizer, after_step=True)))))
    else:
        optimizer.zero_grad(set_to_none=True)
    return m, stepped
