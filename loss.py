"""The μ-GRPO objective and its baselines, as pure tensor functions.

Reads next to DESIGN.md §4. Per response i with response tokens t:

    ρ_t    = exp(ℓ_t − b_t)                                 current vs behavior log-prob
    A_i    = (r_i − mean(r_group)) / (std(r_group) + eps)   group-normalized advantage
    surr_t = min(ρ_t·A_i, clip(ρ_t, lo, hi)·A_i)            clipped surrogate (μ-GRPO: lo=0, hi=5)
    trig_t = (A_i < 0) and (ρ_t < δ)                         NAV trigger (δ ≈ 1e-4)
    κ_i    = first t with trig_t
    veto_t = (A_i < 0) and (t > κ_i) and not trig_t          NAV scope "H"
    loss   = aggregate(−surr_t over kept tokens)

Shapes: B responses (sequences), T padded response length, V vocabulary. Per-token tensors are
[B, T] with `response_mask` marking real response tokens; per-response tensors are [B].

Nothing here prints, touches files or keeps state; metrics come back as a dict of floats.
"""
import math

import torch

NAV_SCOPES = ("none", "T", "H", "S", "seq")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_RATIO_LIMIT = 20.0  # |ℓ − b| is clamped here before exp (as verl does) so ρ never overflows


# ----------------------------------------------------------------------------------------------
# Log-probs of the sampled tokens, without a float32 copy of the full [N, V] logits


def _rows_per_chunk(vocab_size, budget_elements=1 << 24):
    """Rows processed at once: about 64 MB of float32 work per chunk."""
    return max(1, budget_elements // vocab_size)


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[target], computed and differentiated chunk by chunk.

    Forward keeps only the [N] result; backward recomputes each chunk's softmax, so neither pass
    holds more than one chunk of float32 logits (the naive log_softmax keeps a full [N, V] copy).
    """

    @staticmethod
    def forward(ctx, logits, target_ids, temperature, rows):
        # logits [N, V] (any float dtype), target_ids [N] long → [N] float32
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for s in range(0, logits.shape[0], rows):
            x = logits[s:s + rows].float() / temperature                       # [n, V] fp32
            picked = x.gather(1, target_ids[s:s + rows, None]).squeeze(1)     # [n]
            out[s:s + rows] = picked - torch.logsumexp(x, dim=-1)
        ctx.save_for_backward(logits, target_ids)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # d log p[y] / d logits = (onehot(y) − softmax(logits / T)) / T
        logits, target_ids = ctx.saved_tensors
        temperature, rows = ctx.temperature, ctx.rows
        grad_logits = torch.empty_like(logits)
        for s in range(0, logits.shape[0], rows):
            g = grad_out[s:s + rows, None].float()                              # [n, 1]
            probs = torch.softmax(logits[s:s + rows].float() / temperature, dim=-1)
            chunk = -probs * g
            chunk.scatter_add_(1, target_ids[s:s + rows, None], g)
            grad_logits[s:s + rows] = (chunk / temperature).to(logits.dtype)
        return grad_logits, None, None, None


def token_logprobs(logits, target_ids, temperature=1.0, chunk_rows=None):
    """Log-prob of each target token under softmax(logits / temperature).

    logits [..., V], target_ids [...] → float32 [...]. Works in row chunks (chunk_rows rows, by
    default about 64 MB of float32) in both passes, so peak extra memory is one chunk of float32
    logits whatever the vocabulary.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lead_shape, vocab = logits.shape[:-1], logits.shape[-1]
    flat = _TokenLogprobs.apply(logits.reshape(-1, vocab), target_ids.reshape(-1).long(),
                                float(temperature), chunk_rows or _rows_per_chunk(vocab))
    return flat.reshape(lead_shape)


@torch.no_grad()
def token_entropy(logits, temperature=1.0):
    """Entropy of softmax(logits / temperature) per position, chunked. [..., V] → float32 [...]."""
    lead_shape, vocab = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    rows = _rows_per_chunk(vocab)
    for s in range(0, flat.shape[0], rows):
        x = flat[s:s + rows].float() / temperature
        logp = torch.log_softmax(x, dim=-1)
        out[s:s + rows] = -(logp.exp() * logp).sum(-1)
    return out.reshape(lead_shape)


# ----------------------------------------------------------------------------------------------
# Advantages


def group_advantages(rewards, group_size, normalize_std=True, eps=1e-6):
    """Group-normalized advantages. rewards [B] with B = groups × G, each group contiguous.

    A_i = (r_i − mean_g) / (std_g + eps), or A_i = r_i − mean_g with normalize_std=False
    (Dr. GRPO). std is the *sample* std (Bessel's correction, ddof=1), as in TRL's GRPOTrainer and
    verl's GRPO advantage, so advantage magnitudes match runs made with those tools; the population
    std would scale every advantage by sqrt(G / (G − 1)) (1.069 for G = 8).

    Returns (advantages [B] float32, zero_variance [groups] bool): a group whose rewards are all
    equal has all-zero advantages and carries no learning signal.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-normalized advantages, got {group_size}")
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    r = rewards.view(-1, group_size)                        # [groups, G]
    centered = r - r.mean(dim=1, keepdim=True)              # [groups, G]
    zero_variance = (r == r[:, :1]).all(dim=1)              # [groups]
    if normalize_std:
        centered = centered / (r.std(dim=1, unbiased=True, keepdim=True) + eps)
    centered[zero_variance] = 0.0                           # exact zeros, not rounding noise
    return centered.reshape(-1), zero_variance


# ----------------------------------------------------------------------------------------------
# Masks: NAV and M2PO


def nav_triggers(ratio, advantages, response_mask, delta=1e-4):
    """Trigger tokens and the strict suffix after the first one (t > κ), both [B, T] bool."""
    negative = (advantages < 0)[:, None]                                  # [B, 1]
    trig = response_mask.bool() & negative & (ratio < delta)              # [B, T]
    seen = trig.int().cumsum(dim=1)                                       # triggers at or before t
    after_kappa = (seen - trig.int()) > 0                                 # a trigger strictly before t
    return trig, after_kappa & response_mask.bool()


def nav_mask(ratio, advantages, response_mask, delta=1e-4, scope="H"):
    """Negative-advantage veto: keep-mask [B, T] bool (False on padding and vetoed tokens).

    Only responses with A < 0 are touched; padding is never a trigger. Scopes:
      none  keep everything
      T     drop the trigger tokens only
      H     drop tokens after κ that are not triggers (default)
      S     drop every token after κ
      seq   drop the whole response once it has a trigger
    """
    if scope not in NAV_SCOPES:
        raise ValueError(f"nav scope must be one of {NAV_SCOPES}, got {scope!r}")
    mask = response_mask.bool()
    trig, after_kappa = nav_triggers(ratio, advantages, mask, delta)
    if scope == "none":
        veto = torch.zeros_like(mask)
    elif scope == "T":
        veto = trig
    elif scope == "H":
        veto = after_kappa & ~trig
    elif scope == "S":
        veto = after_kappa
    else:  # seq
        veto = trig.any(dim=1, keepdim=True) & mask
    return mask & ~veto


def m2po_mask(log_ratio, advantages, response_mask, tau=0.04):
    """M2PO keep-mask [B, T] bool: mask the harmful tokens with the largest (log ρ)² until the mean
    (log ρ)² of the remaining harmful tokens is ≤ tau. Harmful: A > 0 and ρ > 1, or A < 0 and ρ < 1.
    Other response tokens are always kept. One sort, no Python loop over tokens.
    """
    mask = response_mask.bool()
    adv = advantages[:, None]
    harmful = mask & (((adv > 0) & (log_ratio > 0)) | ((adv < 0) & (log_ratio < 0)))   # [B, T]
    sq = log_ratio.detach().float()[harmful] ** 2                                        # [H]
    keep = mask.clone()
    if sq.numel() == 0:
        return keep
    order = torch.argsort(sq, descending=True, stable=True)                               # [H]
    sorted_sq = sq[order]
    n = sq.numel()
    # mean of what is left after removing the k largest, for k = 0 .. n−1
    left_sum = sorted_sq.sum() - torch.cat([sorted_sq.new_zeros(1), sorted_sq.cumsum(0)[:-1]])
    left_mean = left_sum / torch.arange(n, 0, -1, device=sq.device, dtype=sq.dtype)
    ok = left_mean <= tau
    k = int(ok.float().argmax()) if bool(ok.any()) else n                               # how many to drop
    drop_flat = torch.zeros(n, dtype=torch.bool, device=sq.device)
    drop_flat[order[:k]] = True
    harmful_idx = harmful.nonzero(as_tuple=True)
    keep[harmful_idx[0][drop_flat], harmful_idx[1][drop_flat]] = False
    return keep


# ----------------------------------------------------------------------------------------------
# The policy loss


def policy_loss(logprobs, behavior_logprobs, advantages, response_mask, *, clip_low, clip_high,
                dual_clip=None, nav_delta=None, nav_scope="H", m2po_tau=None, tis_cap=None,
                old_logprobs=None, agg="token-mean", num_tokens=None, num_seqs=None, norm_len=None,
                keep_mask=None, return_metrics=True):
    """Clipped off-policy surrogate with NAV / M2PO masks. Returns (loss, metrics).

    logprobs [B, T]           current policy's log-probs of the sampled tokens (with grad)
    behavior_logprobs [B, T]  log-probs stored by the engine at sampling time
    advantages [B]            per-response advantage
    response_mask [B, T]      True on real response tokens
    clip_low, clip_high       ratio bounds: μ-GRPO 0 and 5; GRPO 0.8 and 1.2; DAPO 0.8 and 1.28
    dual_clip                 c > 1: for A < 0 the per-token loss is capped at −c·A
    nav_delta, nav_scope      NAV trigger threshold (None: off) and scope (see nav_mask)
    m2po_tau                  M2PO second-moment threshold (None: off); see m2po_mask
    tis_cap, old_logprobs     truncated importance weight min(exp(old − behavior), cap), detached,
                              for engine/trainer mismatch; old_logprobs are the trainer's log-probs
                              of the behavior policy and become the ratio's denominator
    agg                       token-mean: Σ kept loss / num_tokens (all response tokens of the
                                minibatch; vetoed tokens count in the denominator, so it is fixed
                                before the forward and micro-batches add up exactly)
                              seq-mean-token-mean: mean over responses of each one's token mean
                              seq-mean-token-sum-norm: Σ kept loss / (num_seqs · norm_len) (Dr. GRPO)
    num_tokens, num_seqs      the whole minibatch's response-token and response counts, so that a
                              micro-batch's loss is its exact share (default: this call's counts)
    norm_len                  Dr. GRPO's constant length (default: T, the padded width)
    keep_mask [B, T]          an extra precomputed keep-mask (e.g. M2PO over the whole minibatch)
    """
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    if not 0 <= clip_low <= 1 <= clip_high:
        raise ValueError(f"need 0 <= clip_low <= 1 <= clip_high, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    if tis_cap is not None and old_logprobs is None:
        raise ValueError("tis_cap needs old_logprobs (the trainer's log-probs of the behavior policy)")

    mask = response_mask.bool()                                         # [B, T]
    maskf = mask.float()
    adv = advantages.float()[:, None]                                   # [B, 1]
    reference = behavior_logprobs if old_logprobs is None else old_logprobs
    log_ratio = torch.clamp(logprobs.float() - reference.float(), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    log_ratio = log_ratio * maskf                                       # padding: ρ = 1
    ratio = torch.exp(log_ratio)                                        # [B, T]

    # clipped surrogate, as a per-token loss −surr_t
    clipped = torch.clamp(ratio, clip_low, clip_high)
    token_loss = torch.maximum(-ratio * adv, -clipped * adv)            # [B, T]
    if dual_clip is not None:
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -dual_clip * adv), token_loss)
    if tis_cap is not None:
        tis = torch.clamp(torch.exp(old_logprobs.float() - behavior_logprobs.float()), max=tis_cap)
        token_loss = token_loss * tis.detach()

    # masks
    nav_keep = mask if nav_delta is None else nav_mask(ratio.detach(), advantages, mask, nav_delta,
                                                        nav_scope)
    m2po_keep = mask if m2po_tau is None else m2po_mask(log_ratio.detach(), advantages, mask, m2po_tau)
    keep = nav_keep & m2po_keep
    if keep_mask is not None:
        keep = keep & keep_mask.bool()
    keepf = keep.float()

    # aggregation
    B, T = mask.shape
    n_tok = maskf.sum() if num_tokens is None else num_tokens
    n_seq = B if num_seqs is None else num_seqs
    if agg == "token-mean":
        loss = (token_loss * keepf).sum() / max(float(n_tok), 1.0)
    elif agg == "seq-mean-token-mean":
        per_seq = (token_loss * keepf).sum(1) / maskf.sum(1).clamp(min=1)   # [B]
        loss = per_seq.sum() / max(float(n_seq), 1.0)
    else:
        length = T if norm_len is None else norm_len
        loss = (token_loss * keepf).sum() / (max(float(n_seq), 1.0) * length)

    if not return_metrics:
        return loss, {}
    return loss, _metrics(loss, ratio.detach(), log_ratio.detach(), advantages.detach(), mask, keep,
                          nav_keep, m2po_keep, clip_low, clip_high, dual_clip, nav_delta, m2po_tau)


@torch.no_grad()
def _metrics(loss, ratio, log_ratio, advantages, mask, keep, nav_keep, m2po_keep, clip_low,
             clip_high, dual_clip, nav_delta, m2po_tau):
    """Diagnostics of one policy_loss call, namespaced as in DESIGN.md §4 (floats; nan if empty)."""
    adv = advantages.float()[:, None].expand_as(ratio)
    neg, pos = mask & (adv < 0), mask & (adv > 0)

    def frac(num, den):
        return num.sum().float() / den.sum().float() if bool(den.any()) else torch.tensor(math.nan)

    def mean_of(x, sel):
        return x[sel].mean() if bool(sel.any()) else torch.tensor(math.nan)

    m = {
        "loss/policy": loss.detach().float(),
        "loss/tokens": mask.sum().float(),
        "loss/kept_frac": frac(keep, mask),
        "clip/upper_frac": frac(pos & (ratio > clip_high), mask),
        "clip/lower_frac": frac(neg & (ratio < clip_low), mask),
        "ratio/mean_neg_adv": mean_of(ratio, neg),
        "ratio/mean_pos_adv": mean_of(ratio, pos),
        "ratio/min": ratio[mask].min() if bool(mask.any()) else torch.tensor(math.nan),
        "ratio/max": ratio[mask].max() if bool(mask.any()) else torch.tensor(math.nan),
        "ratio/log_sq_mean": mean_of(log_ratio ** 2, mask),
        # KL(behavior ‖ current) from behavior samples, k3 estimator E_b[ρ − 1 − log ρ] (≥ 0)
        "ratio/kl": mean_of(ratio - 1 - log_ratio, mask),
    }
    if dual_clip is not None:
        m["clip/dual_frac"] = frac(neg & (ratio > dual_clip), mask)  # where the −c·A cap binds
    if nav_delta is not None:
        trig, after_kappa = nav_triggers(ratio, advantages, mask, nav_delta)
        vetoed = mask & ~nav_keep
        m.update({
            "nav/trigger_frac": frac(trig, mask),
            "nav/trigger_frac_neg": frac(trig, neg),
            "nav/vetoed_frac": frac(vetoed, mask),
            "nav/vetoed_frac_neg": frac(vetoed, neg),
            "nav/triggered_seq_frac": frac(trig.any(1), mask.any(1)),
        })
    if m2po_tau is not None:
        m["m2po/masked_frac"] = frac(mask & ~m2po_keep, mask)
    names = list(m)
    values = torch.stack([torch.as_tensor(v, dtype=torch.float32).to(ratio.device) for v in m.values()])
    return dict(zip(names, values.tolist()))  # one device sync for all metrics
