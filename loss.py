"""The μ-GRPO objective and its baselines, as pure tensor functions.

Reads next to docs/design.md §1. Per response i with response tokens t:

    ρ_t    = exp(ℓ_t − b_t)                                 current vs behavior log-prob
    A_i    = (r_i − mean(r_group)) / (std(r_group) + eps)   group-normalized advantage
    surr_t = min(ρ_t·A_i, clip(ρ_t, lo, hi)·A_i)            clipped surrogate (μ-GRPO: lo=0, hi=5)
    trig_t = (A_i < 0) and (ρ_t < δ)                         NAV trigger (δ ≈ 1e-4)
    κ_i    = first t with trig_t
    veto_t = (A_i < 0) and (t > κ_i) and not trig_t          NAV scope "H"
    m_t    = not veto_t (and not masked by M2PO)                kept tokens
    loss   = aggregate(−surr_t + β·KL_t(π ‖ π_ref), over tokens with m_t)   β = 0 unless kl_coef

Shapes: B responses (sequences), T padded response length, V vocabulary. Per-token tensors are
[B, T] with `response_mask` marking real response tokens; per-response tensors are [B].

Nothing here prints, touches files or keeps state. policy_loss returns its diagnostics as *stats*:
0-d tensors that are sums (or extremes) over tokens, so the stats of micro-batches and ranks add up
to the stats of the whole minibatch (merge_stats, then one all-reduce); metrics(stats) divides them
into the logged floats with one device sync.
"""
import math

import torch

NAV_SCOPES = ("none", "T", "H", "S", "seq")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
TOKEN_NORMALIZERS = ("kept", "all")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOG_RATIO_LIMIT = 20.0  # |ℓ − b| is clamped here before exp (as verl does) so ρ never overflows
# |trainer − engine log-prob| levels whose exceedance counts are kept (summable over micro-batches and ranks,
# unlike a quantile): the preflight gates on the share of tokens above a level, i.e. on a high quantile
MISMATCH_LEVELS = (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)
# the largest mean |trainer − engine log-prob| per token on the same weights, by device (docs/paper-run.md, "Why
# these bounds": bf16 logits of magnitude ~20 round by up to ~0.06 and two stacks round differently, typical tokens
# 1e-3..1e-2 nats apart; on a CPU both are float32, ~1e-6): optimize.py stops a stage's first update above it, the
# preflight gates on it. The GPU value is reasoned, not yet measured on a GPU
AGREEMENT_MEAN = {"cuda": 0.05, "cpu": 1e-3}
# GRPO's clip [0.8, 1.2]: every loss logs the tokens this clip would take the gradient from (A > 0 above 1.2, A < 0
# below 0.8), so a loss with a wider clip (μ-GRPO's [0, 5]) shows where it and GRPO differ, and on which tokens
GRPO_CLIP = (0.8, 1.2)


# ----------------------------------------------------------------------------------------------
# Log-probs of the sampled tokens, without a float32 copy of the full [N, V] logits


def _rows_per_chunk(vocab_size, device):
    """Rows processed at once: about 1 GB of float32 work per chunk on a GPU (few, large kernels),
    64 MB on a CPU (cache-friendly, and CPU runs are small)."""
    budget_elements = (1 << 28) if device.type == "cuda" else (1 << 24)
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
    default about 1 GB of float32 on a GPU, 64 MB on a CPU) in both passes, so peak extra memory is
    one chunk of float32 logits whatever the number of tokens.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lead_shape, vocab = logits.shape[:-1], logits.shape[-1]
    flat = _TokenLogprobs.apply(logits.reshape(-1, vocab), target_ids.reshape(-1).long(),
                                float(temperature), chunk_rows or _rows_per_chunk(vocab, logits.device))
    return flat.reshape(lead_shape)


@torch.no_grad()
def token_entropy(logits, temperature=1.0):
    """Entropy of softmax(logits / temperature) per position, chunked. [..., V] → float32 [...]."""
    lead_shape, vocab = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    rows = _rows_per_chunk(vocab, logits.device)
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


def m2po_harmful(log_ratio, advantages, response_mask):
    """M2PO's candidates for masking, [B, T] bool: A > 0 and ρ > 1, or A < 0 and ρ < 1."""
    adv = advantages[:, None]
    return response_mask.bool() & (((adv > 0) & (log_ratio > 0)) | ((adv < 0) & (log_ratio < 0)))


def m2po_cutoff(sq, tau):
    """The (log ρ)² at and above which harmful tokens are masked, so that the mean (log ρ)² of the
    harmful tokens left is ≤ tau. sq [H]: (log ρ)² of all harmful tokens of the minibatch (gathered
    from every rank, so the answer does not depend on how the minibatch is split). +inf: mask none.

    The largest values go first; tokens tied with the last one removed go too (that only lowers the
    mean). One sort, then a cumulative sum: mean_k = (total − top-k sum) / (H − k).
    """
    sq = sq.detach().float()
    if sq.numel() == 0:
        return torch.tensor(math.inf, device=sq.device)
    sorted_sq = torch.sort(sq, descending=True).values                                  # [H]
    n = sq.numel()
    removed = torch.cat([sorted_sq.new_zeros(1), sorted_sq.cumsum(0)[:-1]])             # top-k sums, k = 0..n−1
    left_mean = (sorted_sq.sum() - removed) / torch.arange(n, 0, -1, device=sq.device, dtype=sq.dtype)
    ok = left_mean <= tau
    if not bool(ok.any()):
        return sorted_sq[-1]                                           # even one left is too much: mask all
    k = int(ok.float().argmax())                                        # how many to remove
    return sorted_sq[k - 1] if k > 0 else torch.tensor(math.inf, device=sq.device)


def m2po_mask(log_ratio, advantages, response_mask, tau=0.04, cutoff=None):
    """M2PO keep-mask [B, T] bool: harmful tokens with (log ρ)² ≥ cutoff are dropped; the cutoff comes
    from this call's harmful tokens (m2po_cutoff) unless given (the whole minibatch's). Other
    response tokens are always kept, padding never."""
    harmful = m2po_harmful(log_ratio, advantages, response_mask)
    sq = log_ratio.detach().float() ** 2
    if cutoff is None:
        cutoff = m2po_cutoff(sq[harmful], tau)
    return response_mask.bool() & ~(harmful & (sq >= cutoff))


# ----------------------------------------------------------------------------------------------
# KL to a reference policy (the second seed's objective; TRL's and verl's KL penalty)


def kl_penalty(logprobs, ref_logprobs, estimator="k3"):
    """Per-token estimate of KL(π ‖ π_ref) from samples, [B, T] (Schulman's estimators, d = ℓ_ref − ℓ):
        k1 = −d                 unbiased, can be negative
        k2 = d² / 2             biased, ≥ 0
        k3 = exp(d) − d − 1     unbiased for on-policy samples, ≥ 0, low variance (TRL's and verl's default)
    d is clamped to ±LOG_RATIO_LIMIT like the ratio, so exp(d) stays finite."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    d = torch.clamp(ref_logprobs.float() - logprobs.float(), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d ** 2
    return torch.exp(d) - d - 1


# ----------------------------------------------------------------------------------------------
# The policy loss


def policy_loss(logprobs, behavior_logprobs, advantages, response_mask, *, clip_low, clip_high,
                dual_clip=None, nav_delta=None, nav_scope="H", m2po_tau=None, m2po_cutoff=None,
                tis_cap=None, old_logprobs=None, kl_coef=0.0, ref_logprobs=None, kl_estimator="k3",
                agg="token-mean", token_normalizer="kept", num_tokens=None, num_seqs=None, norm_len=None):
    """Clipped off-policy surrogate with NAV / M2PO masks and an optional KL penalty.
    Returns (loss, stats); metrics(stats) gives the logged floats.

    logprobs [B, T]           current policy's log-probs of the sampled tokens (with grad)
    behavior_logprobs [B, T]  log-probs stored by the engine at sampling time
    advantages [B]            per-response advantage
    response_mask [B, T]      True on real response tokens
    clip_low, clip_high       ratio bounds: μ-GRPO 0 and 5; GRPO 0.8 and 1.2; DAPO 0.8 and 1.28
    dual_clip                 c > 1: for A < 0 the per-token loss is capped at −c·A
    nav_delta, nav_scope      NAV trigger threshold (None: off) and scope (see nav_mask)
    m2po_tau, m2po_cutoff     M2PO second-moment threshold (None: off); the cutoff is computed from
                              this call's tokens unless given (update.py: the whole minibatch's)
    tis_cap, old_logprobs     truncated importance weight min(exp(old − behavior), cap), detached,
                              for engine/trainer mismatch; old_logprobs are the trainer's log-probs
                              of the behavior policy and become the ratio's denominator
    kl_coef, ref_logprobs     β and the reference policy's log-probs [B, T]: β·KL_t (kl_penalty with
                              kl_estimator) is added to each token's loss before aggregation, so it
                              follows the same masks and every aggregation and split stays exact
    agg                       token-mean: Σ kept loss / num_tokens
                              seq-mean-token-mean: mean over responses of each one's mean over its
                                normalized tokens
                              seq-mean-token-sum-norm: Σ kept loss / (num_seqs · norm_len) (Dr. GRPO)
    token_normalizer          which tokens a mean divides by: "kept" (response tokens not vetoed or
                              masked, verl's masked mean; docs/design.md §1) or "all" (every response token)
    num_tokens, num_seqs      the whole minibatch's token-mean denominator and response count, so that
                              a micro-batch's loss is its exact share (default: this call's). With
                              token_normalizer="kept" the minibatch's count is only known once every
                              micro-batch's ratios are: update.py passes num_tokens=1 (a sum) and
                              divides the gradient by the kept count afterwards
    norm_len                  Dr. GRPO's constant length (default: T, the padded width)
    """
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    if token_normalizer not in TOKEN_NORMALIZERS:
        raise ValueError(f"token_normalizer must be one of {TOKEN_NORMALIZERS}, got {token_normalizer!r}")
    if not 0 <= clip_low <= 1 <= clip_high:
        raise ValueError(f"need 0 <= clip_low <= 1 <= clip_high, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    if tis_cap is not None and old_logprobs is None:
        raise ValueError("tis_cap needs old_logprobs (the trainer's log-probs of the behavior policy)")
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's log-probs)")

    mask = response_mask.bool()                                         # [B, T]
    maskf = mask.float()
    adv = advantages.float()[:, None]                                   # [B, 1]
    reference = behavior_logprobs if old_logprobs is None else old_logprobs
    log_ratio = torch.clamp(logprobs.float() - reference.float(), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    log_ratio = log_ratio * maskf                                       # padding: ρ = 1
    ratio = torch.exp(log_ratio)                                        # [B, T]

    token_loss = clipped_surrogate_loss(ratio, adv, clip_low, clip_high, dual_clip)     # −surr_t [B, T]
    if tis_cap is not None:
        tis = torch.clamp(torch.exp(old_logprobs.float() - behavior_logprobs.float()), max=tis_cap)
        token_loss = token_loss * tis.detach()
    kl = kl_penalty(logprobs, ref_logprobs, kl_estimator) * maskf if ref_logprobs is not None else None
    if kl_coef:
        token_loss = token_loss + kl_coef * kl

    # masks
    nav_keep = mask if nav_delta is None else nav_mask(ratio.detach(), advantages, mask, nav_delta, nav_scope)
    m2po_keep = mask if m2po_tau is None else m2po_mask(log_ratio.detach(), advantages, mask, m2po_tau,
                                                        m2po_cutoff)
    keep = nav_keep & m2po_keep
    keepf = keep.float()
    norm = keepf if token_normalizer == "kept" else maskf               # the tokens a mean divides by

    # aggregation
    kept_loss = token_loss * keepf
    loss = aggregate(kept_loss, norm, agg, num_tokens, num_seqs, norm_len)
    engine_log_ratio = logprobs.detach().float() - behavior_logprobs.float()
    stats = _stats(loss, kept_loss, advantages.detach(),
                   terms=(ratio.detach(), log_ratio.detach(), engine_log_ratio, kl),
                   masks=(mask, keep, nav_keep, m2po_keep),
                   settings=dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, nav_delta=nav_delta,
                                 m2po_tau=m2po_tau, kl_coef=kl_coef))
    return loss, stats


def clipped_surrogate_loss(ratio, adv, clip_low, clip_high, dual_clip=None):
    """The clipped surrogate as a per-token loss: −min(ρ_t·A, clip(ρ_t, lo, hi)·A) [B, T], for A < 0 capped at −c·A
    when dual_clip = c. ratio [B, T], adv [B, 1]."""
    clipped = torch.clamp(ratio, clip_low, clip_high)
    token_loss = torch.maximum(-ratio * adv, -clipped * adv)
    if dual_clip is not None:
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -dual_clip * adv), token_loss)
    return token_loss


def aggregate(kept_loss, norm, agg="token-mean", num_tokens=None, num_seqs=None, norm_len=None):
    """policy_loss's aggregation (agg, num_tokens, num_seqs, norm_len as there) of the kept tokens' losses [B, T]
    (0 elsewhere), with norm [B, T] the tokens a mean divides by."""
    B, T = kept_loss.shape
    n_seq = B if num_seqs is None else num_seqs
    if agg == "token-mean":
        denominator = norm.sum() if num_tokens is None else num_tokens
        return kept_loss.sum() / torch.clamp(torch.as_tensor(denominator, dtype=torch.float32), min=1.0)
    if agg == "seq-mean-token-mean":
        per_seq = kept_loss.sum(1) / norm.sum(1).clamp(min=1)           # [B]
        return per_seq.sum() / max(float(n_seq), 1.0)
    length = T if norm_len is None else norm_len
    return kept_loss.sum() / (max(float(n_seq), 1.0) * length)


@torch.no_grad()
def _stats(loss, kept_loss, advantages, terms, masks, settings):
    """Sums over this call's tokens (names ending in _min/_max: extremes), as 0-d float32 tensors. terms: the
    per-token ρ, log ρ, the trainer − engine log ratio and the KL estimate (or None) [B, T]; masks: the response,
    kept, NAV-kept and M2PO-kept tokens [B, T]; settings: policy_loss's clip_low, clip_high, dual_clip, nav_delta,
    m2po_tau, kl_coef."""
    ratio, log_ratio, engine_log_ratio, kl = terms
    mask, keep, nav_keep, m2po_keep = masks
    clip_low, clip_high, dual_clip = settings["clip_low"], settings["clip_high"], settings["dual_clip"]
    adv = advantages.float()[:, None].expand_as(ratio)
    neg, pos = mask & (adv < 0), mask & (adv > 0)
    first = mask & (mask.long().cumsum(1) == 1)                         # each response's first token [B, T]
    count = lambda sel: sel.sum().float()                               # noqa: E731
    inf = torch.tensor(math.inf, device=ratio.device)
    engine_abs = engine_log_ratio.abs() * mask
    s = {
        "loss": loss.detach().float(), "loss_sum": kept_loss.detach().sum(),
        "tokens": count(mask), "kept": count(keep), "seqs": count(mask.any(1)),
        "neg_tokens": count(neg), "pos_tokens": count(pos),
        "clip_upper": count(pos & (ratio > clip_high)), "clip_lower": count(neg & (ratio < clip_low)),
        "grpo_upper": count(pos & (ratio > GRPO_CLIP[1])), "grpo_lower": count(neg & (ratio < GRPO_CLIP[0])),
        "grpo_first": count((pos & (ratio > GRPO_CLIP[1]) | neg & (ratio < GRPO_CLIP[0])) & first),
        "first_tokens": count(first),
        "ratio_sum_neg": (ratio * neg).sum(), "ratio_sum_pos": (ratio * pos).sum(),
        "ratio_min": torch.where(mask, ratio, inf).min() if mask.numel() else inf,
        "ratio_max": torch.where(mask, ratio, -inf).max() if mask.numel() else -inf,
        "log_sq_sum": (log_ratio ** 2 * mask).sum(),
        "ratio_sum": (ratio * mask).sum(), "ratio_sq_sum": (ratio ** 2 * mask).sum(),     # the weights' ESS
        # KL(behavior ‖ current) from behavior samples, k3 estimator E_b[ρ − 1 − log ρ] (≥ 0)
        "kl_behavior_sum": ((ratio - 1 - log_ratio) * mask).sum(),
        # trainer vs engine log-probs, whatever the ratio's reference (TIS): the mismatch at update 0
        "engine_abs_sum": engine_abs.sum(), "engine_abs_max": engine_abs.max() if mask.numel() else -inf,
        "engine_kl_sum": ((engine_log_ratio.exp() - 1 - engine_log_ratio) * mask).sum(),
        **{f"engine_over_{i}": count(engine_abs > level) for i, level in enumerate(MISMATCH_LEVELS)},
    }
    if dual_clip is not None:
        s["clip_dual"] = count(neg & (ratio > dual_clip))              # where the −c·A cap binds
    if settings["nav_delta"] is not None:
        trig, _ = nav_triggers(ratio, advantages, mask, settings["nav_delta"])
        s.update({"nav_trig": count(trig), "nav_vetoed": count(mask & ~nav_keep),
                  "nav_trig_seqs": count(trig.any(1))})
    if settings["m2po_tau"] is not None:
        s["m2po_masked"] = count(mask & ~m2po_keep)
    if kl is not None:
        s["kl_ref_sum"] = kl.detach().sum()
        # > 0 after merging: in the loss
        s["kl_in_loss"] = torch.tensor(float(bool(settings["kl_coef"])), device=ratio.device)
    return {k: v.float() for k, v in s.items()}


def merge_stats(a, b):
    """Stats of two disjoint sets of tokens (micro-batches, ranks) combined: sums add, extremes extreme."""
    if not a:
        return dict(b)
    combine = {"_min": torch.minimum, "_max": torch.maximum}
    return {k: combine.get(k[-4:], torch.add)(a[k], b[k]) for k in a}


def metrics(stats, extra=None):
    """The logged metrics (floats; nan where a set is empty) from a minibatch's stats, in one device sync.
    `extra`: more 0-d tensors to bring over in the same sync (e.g. the grad norm), returned as floats."""
    names = list(stats) + list(extra or {})
    values = torch.stack([torch.as_tensor(v, dtype=torch.float32).to(stats["tokens"].device).reshape(())
                          for v in list(stats.values()) + list((extra or {}).values())]).tolist()
    s = dict(zip(names, values))
    frac = lambda num, den: s[num] / s[den] if s[den] > 0 else math.nan    # noqa: E731
    m = {
        "loss/policy": s["loss"], "loss/tokens": s["tokens"], "loss/kept_tokens": s["kept"],
        "loss/kept_frac": frac("kept", "tokens"),
        "clip/upper_frac": frac("clip_upper", "tokens"), "clip/lower_frac": frac("clip_lower", "tokens"),
        # the tokens GRPO's clip would take the gradient from (= clip/*_frac for GRPO itself), and the share of
        # them that are a response's first token (lab-fork's fork), against the first tokens' share of all tokens
        "grpo_clip/upper_frac": frac("grpo_upper", "tokens"), "grpo_clip/lower_frac": frac("grpo_lower", "tokens"),
        "grpo_clip/first_token_share": s["grpo_first"] / (s["grpo_upper"] + s["grpo_lower"])
        if s["grpo_upper"] + s["grpo_lower"] > 0 else math.nan,
        "grpo_clip/first_token_base": frac("first_tokens", "tokens"),
        "ratio/mean_neg_adv": frac("ratio_sum_neg", "neg_tokens"),
        "ratio/mean_pos_adv": frac("ratio_sum_pos", "pos_tokens"),
        "ratio/min": s["ratio_min"] if s["tokens"] else math.nan,
        "ratio/max": s["ratio_max"] if s["tokens"] else math.nan,
        "ratio/log_sq_mean": frac("log_sq_sum", "tokens"), "ratio/kl": frac("kl_behavior_sum", "tokens"),
        # Kish's effective sample size of the importance weights ρ over the tokens, as a fraction of them:
        # (Σ ρ)² / (N Σ ρ²), 1 on policy, 1/N when one token carries all the weight
        "ratio/ess_frac": s["ratio_sum"] ** 2 / (s["tokens"] * s["ratio_sq_sum"]) if s["ratio_sq_sum"] > 0 else math.nan,
        "mismatch/mean_abs_log_ratio": frac("engine_abs_sum", "tokens"),
        "mismatch/max_abs_log_ratio": s["engine_abs_max"] if s["tokens"] else math.nan,
        "mismatch/kl": frac("engine_kl_sum", "tokens"),
        **{f"mismatch/frac_over_{level:g}": frac(f"engine_over_{i}", "tokens") for i, level in enumerate(MISMATCH_LEVELS)},
    }
    # an upper bound on the 99.9th percentile of |Δ log p|: the lowest level at most 0.1 % of the tokens exceed
    over = [(level, m[f"mismatch/frac_over_{level:g}"]) for level in MISMATCH_LEVELS]
    m["mismatch/p999_at_most"] = next((level for level, f in over if f <= 1e-3), math.inf) if s["tokens"] else math.nan
    if "clip_dual" in s:
        m["clip/dual_frac"] = frac("clip_dual", "tokens")
    if "nav_trig" in s:
        m.update({"nav/trigger_frac": frac("nav_trig", "tokens"), "nav/trigger_frac_neg": frac("nav_trig", "neg_tokens"),
                  "nav/vetoed_frac": frac("nav_vetoed", "tokens"), "nav/vetoed_frac_neg": frac("nav_vetoed", "neg_tokens"),
                  "nav/triggered_seq_frac": frac("nav_trig_seqs", "seqs")})
    if "m2po_masked" in s:
        m["m2po/masked_frac"] = frac("m2po_masked", "tokens")
    if "kl_ref_sum" in s:
        m["kl/ref_mean"] = frac("kl_ref_sum", "tokens")
        m["kl/in_loss"] = float(s["kl_in_loss"] > 0)
    m.update({k: s[k] for k in (extra or {})})
    return m
