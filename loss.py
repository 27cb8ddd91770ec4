"""The μ-GRPO objective and the other high-staleness objectives, as pure tensor functions.

Reads next to docs/design.md §1 and docs/objectives.md. Per response i with response tokens t:

    ρ_t    = exp(ℓ_t − b_t)                                current vs behavior log-prob
    A_i    = (r_i − mean(r_group)) / (std(r_group) + eps)  group-normalized advantage (or
                                                           ADVANTAGES' others)
    surr_t = min(ρ_t·A_i, clip(ρ_t, lo, hi)·A_i)           clipped surrogate (μ-GRPO: lo=0, hi=5)
    trig_t = (A_i < 0) and (ρ_t < δ)                        NAV trigger (δ ≈ 1e-4)
    κ_i    = first t with trig_t
    veto_t = (A_i < 0) and (t > κ_i) and not trig_t         NAV scope "H"
    m_t    = not veto_t (and not masked by M2PO)            kept tokens
    loss   = aggregate(−surr_t + β·KL_t(π ‖ π_ref), over tokens with m_t)
                                                           β = 0 unless kl_coef

The objective (−surr_t above) is a seam: OBJECTIVES holds μ-GRPO's clipped surrogate beside CISPO,
TOPR, OAPL, DPPO-TV, VESPO, GSPO and M2PO's unclipped one, each a function over the same inputs; the
masks, the KL penalty and the aggregation are steps after it (policy_loss). PRESETS, the LOSS
presets, name an objective and its settings with their source.

Shapes: B responses (sequences), T padded response length, V vocabulary. Per-token tensors are
[B, T] with `response_mask` marking real response tokens; per-response tensors are [B].

Nothing here prints, touches files or keeps state. policy_loss returns its diagnostics as *stats*:
tensors that are sums (or extremes, or histogram counts) over tokens, so the stats of micro-batches
and ranks add up to the stats of the whole minibatch (merge_stats, then one all-reduce);
metrics(stats) divides them into the logged floats with one device sync.
"""
import dataclasses
import functools
import inspect
import math

import torch

NAV_SCOPES = ("none", "T", "H", "S", "seq")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
TOKEN_NORMALIZERS = ("kept", "all")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOG_RATIO_LIMIT = 20.0  # |ℓ − b| is clamped here before exp (as verl does) so ρ never overflows
# |trainer − engine log-prob| levels whose exceedance counts are kept (summable over micro-batches
# and ranks, unlike a quantile): the preflight gates on the share of tokens above a level, i.e. on a
# high quantile
MISMATCH_LEVELS = (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)
# the largest mean |trainer − engine log-prob| per token on the same weights, by device
# (docs/paper-run.md, "Why these bounds": bf16 logits of magnitude ~20 round by up to ~0.06 and two
# stacks round differently, typical tokens 1e-3..1e-2 nats apart; on a CPU both are float32, ~1e-6):
# optimize.py stops a stage's first update above it, the preflight gates on it. The GPU value is
# reasoned, not yet measured on a GPU
AGREEMENT_MEAN = {"cuda": 0.05, "cpu": 1e-3}
# GRPO's clip [0.8, 1.2]: every loss logs the tokens this clip would take the gradient from (A > 0
# above 1.2, A < 0 below 0.8), so a loss with a wider clip (μ-GRPO's [0, 5]) shows where it and GRPO
# differ, and on which tokens
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
                                float(temperature),
                                chunk_rows or _rows_per_chunk(vocab, logits.device))
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
        raise ValueError("group_size must be >= 2 for group-normalized advantages, got "
                         f"{group_size}")
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
    # a trigger strictly before t
    after_kappa = (seen - trig.int()) > 0
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
    # top-k sums, k = 0..n−1
    removed = torch.cat([sorted_sq.new_zeros(1), sorted_sq.cumsum(0)[:-1]])
    left_mean = (sorted_sq.sum() - removed) / torch.arange(
        n, 0, -1, device=sq.device, dtype=sq.dtype)
    ok = left_mean <= tau
    if not bool(ok.any()):
        # even one left is too much: mask all
        return sorted_sq[-1]
    k = int(ok.float().argmax())                                        # how many to remove
    return sorted_sq[k - 1] if k > 0 else torch.tensor(math.inf, device=sq.device)


def m2po_mask(log_ratio, advantages, response_mask, tau=0.04, cutoff=None):
    """M2PO keep-mask [B, T] bool: harmful tokens with (log ρ)² ≥ cutoff are dropped; the cutoff
    comes from this call's harmful tokens (m2po_cutoff) unless given (the whole minibatch's). Other
    response tokens are always kept, padding never."""
    harmful = m2po_harmful(log_ratio, advantages, response_mask)
    sq = log_ratio.detach().float() ** 2
    if cutoff is None:
        cutoff = m2po_cutoff(sq[harmful], tau)
    return response_mask.bool() & ~(harmful & (sq >= cutoff))


# ----------------------------------------------------------------------------------------------
# KL to a reference policy (the second seed's objective; TRL's and verl's KL penalty)


def kl_penalty(logprobs, ref_logprobs, estimator="k3"):
    """Per-token estimate of KL(π ‖ π_ref) from samples, [B, T] (Schulman's estimators,
    d = ℓ_ref − ℓ):
        k1 = −d                 unbiased, can be negative
        k2 = d² / 2             biased, ≥ 0
        k3 = exp(d) − d − 1     unbiased for on-policy samples, ≥ 0, low variance (TRL's and
                                verl's default)
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
# The objectives: each a per-token loss [B, T] to minimise (before the masks and the aggregation)
# and its own statistics, from the same inputs (Tokens). A response-level loss ℓ_i sits on each of
# the response's tokens, so that the mean over responses of their token means (seq-mean-token-mean,
# such a row's aggregation) is the mean of ℓ_i. Adding one: a function here, its name in OBJECTIVES,
# a row in PRESETS and its hand test (tests/test_objectives.py).


@dataclasses.dataclass
class Tokens:
    """What every objective reads, [B, T] unless said: logprobs ℓ_t (with grad), reference_logprobs
    b_t (the ratio's denominator: the behavior log-probs, or TIS's old ones), log_ratio ℓ − b
    clamped (0 on padding, with grad), ratio ρ_t, adv A_i [B, 1], mask (response tokens, bool) and
    maskf (float)."""
    logprobs: torch.Tensor
    reference_logprobs: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    maskf: torch.Tensor

    def seq_log_ratio(self, level="product"):
        """log ρ(y_i) [B, 1]: Σ_t log ρ_t (product: the sequence's likelihood ratio) or its mean
        over the response's tokens (geometric: GSPO's length-normalised ratio). With grad."""
        total = self.log_ratio.sum(1, keepdim=True)
        if level == "product":
            return total
        return total / self.maskf.sum(1, keepdim=True).clamp(min=1.0)

    def responses(self, sign):
        """Responses with tokens and A > 0 (sign +1) or A < 0 (−1), [B, 1] bool."""
        return self.mask.any(1, keepdim=True) & (self.adv * sign > 0)


def _count(selected):
    return selected.sum().float()


def _check_level(seq_ratio):
    if seq_ratio not in ("product", "geometric"):
        raise ValueError(f"seq_ratio must be product or geometric, got {seq_ratio!r}")


def clip_surrogate(x, clip_low=0.8, clip_high=1.2, dual_clip=None):
    """PPO's clipped surrogate (GRPO, DAPO, μ-GRPO's relaxed clip): −min(ρ_t·A_i, clip(ρ_t, lo,
    hi)·A_i), for A < 0 capped at −c·A with dual_clip = c. The tokens beyond the clip on the side
    that binds get no gradient."""
    if not 0 <= clip_low <= 1 <= clip_high:
        raise ValueError(f"need 0 <= clip_low <= 1 <= clip_high, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    pos, neg = x.mask & (x.adv > 0), x.mask & (x.adv < 0)
    stats = {"clip_upper": _count(pos & (x.ratio > clip_high)),
             "clip_lower": _count(neg & (x.ratio < clip_low))}
    if dual_clip is not None:
        stats["clip_dual"] = _count(neg & (x.ratio > dual_clip))        # where the −c·A cap binds
    return clipped_surrogate_loss(x.ratio, x.adv, clip_low, clip_high, dual_clip), stats


def clipped_surrogate_loss(ratio, adv, clip_low, clip_high, dual_clip=None):
    """−min(ρ·A, clip(ρ, lo, hi)·A) [B, T] (for A < 0 capped at −c·A when dual_clip = c); ratio [B,
    T] or [B, 1], adv [B, 1]."""
    clipped = torch.clamp(ratio, clip_low, clip_high)
    token_loss = torch.maximum(-ratio * adv, -clipped * adv)
    if dual_clip is not None:
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -dual_clip * adv), token_loss)
    return token_loss


def importance_weighted(x):
    """The importance-weighted policy gradient, unclipped: −ρ_t·A_i (M2PO's surrogate: its mask does
    the bounding)."""
    return -x.ratio * x.adv, {}


def cispo(x, eps_max=5.0):
    """CISPO (MiniMax-M1, arXiv 2506.13585; ScaleRL's form, arXiv 2510.13786): REINFORCE weighted by
    the importance ratio truncated from above and detached, −sg(min(ρ_t, ε_max))·A_i·ℓ_t: no lower
    bound, every token keeps a gradient."""
    if eps_max <= 0:
        raise ValueError(f"eps_max must be > 0, got {eps_max}")
    weight = torch.clamp(x.ratio, max=eps_max).detach()
    return -weight * x.adv * x.logprobs, {"cispo_truncated": _count(x.mask & (x.ratio > eps_max))}


def topr(x, seq_ratio="product"):
    """TOPR (arXiv 2503.14286): A_i ≥ 0: −A_i·ℓ_t, no importance weight; A_i < 0: −sg(clip(ρ(y_i),
    0, 1))·A_i·ℓ_t, ρ(y_i) the sequence ratio: the product of the token ratios (the paper's, its log
    capped at 0 before exp) or their geometric mean (seq_ratio="geometric", as an open verl
    implementation has it)."""
    _check_level(seq_ratio)
    neg = x.responses(-1)                                                       # [B, 1]
    weight = torch.where(neg, torch.exp(x.seq_log_ratio(seq_ratio).clamp(max=0.0)), 1.0).detach()
    return -weight * x.adv * x.logprobs, {"topr_neg_seqs": _count(neg),
                                          "topr_neg_weight_sum": (weight * neg).sum()}


def oapl(x, beta2=1e-3):
    """OAPL (arXiv 2602.19362), ratio-free: per response the squared residual (β₂·Σ_t log ρ_t −
    A_i)², with A_i the row's soft-value advantage Â*_i = r_i − β₁·log mean_j exp(r_j/β₁)
    (ADVANTAGES); no clip, no mask. A response loss: on each of its tokens (see above)."""
    if beta2 <= 0:
        raise ValueError(f"beta2 must be > 0, got {beta2}")
    residual_sq = (beta2 * x.seq_log_ratio("product") - x.adv) ** 2                  # [B, 1]
    seqs = x.mask.any(1, keepdim=True)
    return residual_sq * x.maskf, {"oapl_residual_sq_sum": (residual_sq.detach() * seqs).sum()}


def dppo_tv(x, tv_delta=0.15):
    """DPPO with its total-variation trust region (arXiv 2602.04879): −M_t·ρ_t·A_i, where M_t = 0
    once the sampled token's probability has moved more than δ in the advantage's direction (A_i > 0
    and π_t − μ_t > δ, or A_i < 0 and μ_t − π_t > δ): probabilities, not ratios."""
    if not 0 < tv_delta < 1:
        raise ValueError(f"tv_delta must be in (0, 1), got {tv_delta}")
    # π_t − μ_t
    moved = torch.exp(x.logprobs.detach().float()) - torch.exp(x.reference_logprobs.float())
    out = x.mask & (((x.adv > 0) & (moved > tv_delta)) | ((x.adv < 0) & (-moved > tv_delta)))
    return -x.ratio * x.adv * (~out).float(), {"dppo_masked": _count(out)}


def vespo(x, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0):
    """VESPO (arXiv 2602.10693; its authors' code): −sg(φ(w_i))·A_i·ℓ_t, φ(w) = w^k·e^{λ(1−w)} of
    the sequence ratio w_i = Π_t ρ_t (its log clamped to [log 1e-8, 20], as that code does), (k, λ)
    = (k_pos, lam_pos) for A ≥ 0 and (k_neg, lam_neg) for A < 0: 1 at w = 1, vanishing at 0 and
    ∞."""
    if min(k_pos, lam_pos, k_neg, lam_neg) <= 0:
        raise ValueError(f"VESPO's k and λ must be > 0, got {k_pos}, {lam_pos}, {k_neg}, {lam_neg}")
    # [B, 1]
    log_w = x.seq_log_ratio("product").detach().clamp(math.log(1e-8), LOG_RATIO_LIMIT)
    k = torch.where(x.adv >= 0, k_pos, k_neg)
    lam = torch.where(x.adv >= 0, lam_pos, lam_neg)
    phi = torch.exp(k * log_w + lam * (1 - torch.exp(log_w)))
    seqs = x.mask.any(1, keepdim=True) & (x.adv != 0)
    return -phi * x.adv * x.logprobs, {"vespo_weight_sum": (phi * seqs).sum(),
                                       "vespo_seqs": _count(seqs)}


def gspo(x, clip_low=1 - 3e-4, clip_high=1 + 4e-4):
    """GSPO (arXiv 2507.18071): PPO's clip on the sequence's geometric-mean ratio s_i = exp(mean_t
    log ρ_t), per response −min(s_i·A_i, clip(s_i, lo, hi)·A_i) (a response loss: on each of its
    tokens)."""
    if not 0 <= clip_low <= 1 <= clip_high:
        raise ValueError(f"need 0 <= clip_low <= 1 <= clip_high, got {clip_low}, {clip_high}")
    s = torch.exp(x.seq_log_ratio("geometric"))                                      # [B, 1]
    outside = (x.responses(1) & (s > clip_high)) | (x.responses(-1) & (s < clip_low))
    return clipped_surrogate_loss(s, x.adv, clip_low,
                                  clip_high) * x.maskf, {"gspo_clipped_seqs": _count(outside)}


OBJECTIVES = {"clip": clip_surrogate, "is": importance_weighted, "cispo": cispo, "topr": topr,
              "oapl": oapl, "dppo-tv": dppo_tv, "vespo": vespo, "gspo": gspo}
# the statistics only one family has: metric name → (its stat, the stat it is a share or mean of)
FAMILY_METRICS = {
    "clip/upper_frac": ("clip_upper", "tokens"), "clip/lower_frac": ("clip_lower", "tokens"),
    "clip/dual_frac": ("clip_dual", "tokens"),
    "cispo/truncated_frac": ("cispo_truncated", "tokens"),
    "topr/neg_weight_mean": ("topr_neg_weight_sum", "topr_neg_seqs"),
    "oapl/residual_sq_mean": ("oapl_residual_sq_sum", "seqs"),
    "dppo/masked_frac": ("dppo_masked", "tokens"),
    "vespo/weight_mean": ("vespo_weight_sum", "vespo_seqs"),
    "gspo/clipped_seq_frac": ("gspo_clipped_seqs", "seqs"),
}


# ----------------------------------------------------------------------------------------------
# The advantage an objective is given, per response


ADVANTAGES = ("group", "signed-reward", "soft-value")


def response_advantages(rewards, kind, soft_value_beta=1.0):
    """The advantage of each response for the kinds the trainer computes from the stage's rewards
    [groups, G] (float array or tensor) → float32 tensor [groups, G] ("group" is generate.py's,
    stored with the rollouts: group_advantages):
        signed-reward  A_i = 2·r_i − 1: +1 for a correct response, −1 for a wrong one (TOPR's
                       raw ±1 reward, no baseline; for rewards in {0, 1})
        soft-value     Â*_i = r_i − β₁·log mean_j exp(r_j/β₁), β₁ = soft_value_beta (OAPL's
                       advantage: the group's own samples estimate the optimal value V̂*)"""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if kind == "signed-reward":
        return (2 * r - 1).float()
    if kind == "soft-value":
        if soft_value_beta <= 0:
            raise ValueError(f"soft_value_beta must be > 0, got {soft_value_beta}")
        value = soft_value_beta * (
            torch.logsumexp(r / soft_value_beta, dim=1, keepdim=True) - math.log(r.shape[1]))
        return (r - value).float()
    raise ValueError("the trainer computes the advantages signed-reward and soft-value, got "
                     f"{kind!r}")


# ----------------------------------------------------------------------------------------------
# A loss: the objective and the steps around it, and the LOSS presets


@dataclasses.dataclass(frozen=True)
class Loss:
    """What policy_loss computes: the objective with its settings (its keyword arguments; the rest
    its defaults), the advantage it is given, the masks, the KL penalty, TIS and the aggregation.
    Checked when made: a bad setting is a ValueError naming the allowed values."""
    objective: str = "clip"                 # a name of OBJECTIVES
    settings: dict = dataclasses.field(default_factory=dict)
    advantage: str = "group"                # ADVANTAGES: generate.py's group-normalised one, or
                                            # one computed here
    soft_value_beta: float = 1.0            # β₁ of the soft-value advantage
    nav_delta: float | None = None          # NAV's trigger threshold (None: no NAV)
    nav_scope: str = "H"                    # NAV_SCOPES
    m2po_tau: float | None = None           # M2PO's second-moment threshold (None: no M2PO mask)
    tis_cap: float | None = None            # truncated importance weight of the trainer/engine
                                            # mismatch (None: off)
    kl_coef: float = 0.0                    # β of the KL(π ‖ π_ref) penalty
    kl_estimator: str = "k3"                # KL_ESTIMATORS
    agg: str = "token-mean"                 # AGG_MODES
    token_normalizer: str = "kept"          # TOKEN_NORMALIZERS
    norm_len: int | None = None             # Dr. GRPO's constant length (None: the padded width)

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got "
                             f"{self.objective!r}")
        own = objective_settings(self.objective)
        if unknown := sorted(set(self.settings) - set(own)):
            raise ValueError(f"objective {self.objective} has no setting {', '.join(unknown)}; its "
                             f"settings: {', '.join(f'{k}={v}' for k, v in own.items()) or 'none'}")
        numbers = {**{k: v for k, v in self.settings.items() if not isinstance(own[k], str)},
                   **{k: getattr(self, k) for k in (
                       "soft_value_beta", "nav_delta", "m2po_tau", "tis_cap", "kl_coef")}}
        if wrong := [k for k, v in numbers.items() if isinstance(v, (str, bool))]:
            raise ValueError(f"{wrong[0]} must be a number, got {numbers[wrong[0]]!r}")
        fields = {
            f.name: f.default for f in dataclasses.fields(self) if f.name not in (
                "objective", "settings")}
        # none only where the default is none (a mask off, dual_clip off)
        defaults = {**own, **fields}
        if unset := [k for k, v in {**self.settings,
                                    **{k: getattr(self, k) for k in fields}}.items()
                     if v is None and defaults[k] is not None]:
            raise ValueError(f"{unset[0]} cannot be none (its default: {defaults[unset[0]]!r})")
        for name, allowed in (("advantage", ADVANTAGES), ("nav_scope", NAV_SCOPES),
                              ("kl_estimator", KL_ESTIMATORS), ("agg", AGG_MODES),
                              ("token_normalizer", TOKEN_NORMALIZERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got "
                                 f"{getattr(self, name)!r}")
        for name in ("nav_delta", "m2po_tau", "tis_cap"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (or none: off), got {getattr(self, name)}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        # the objective's own checks of its values, on one token
        one = torch.zeros(1, 1)
        OBJECTIVES[self.objective](Tokens(one, one, one, one + 1, one, one.bool(), one),
                                   **self.settings)

    def describe(self):
        """One line: the objective, its settings, the advantage, the masks, KL, TIS and the
        aggregation."""
        own = {**objective_settings(self.objective), **self.settings}
        parts = [f"{self.objective}({', '.join(f'{k}={v}' for k, v in own.items())}), "
                 f"{self.advantage} advantage"]
        if self.nav_delta is not None:
            parts.append(f"NAV δ={self.nav_delta} scope {self.nav_scope}")
        if self.m2po_tau is not None:
            parts.append(f"M2PO τ={self.m2po_tau}")
        if self.tis_cap is not None:
            parts.append(f"TIS cap {self.tis_cap}")
        if self.kl_coef:
            parts.append(f"KL β={self.kl_coef} ({self.kl_estimator})")
        return ", ".join(parts + [f"{self.agg} over {self.token_normalizer} tokens"])


def objective_settings(name):
    """An objective's settings and their defaults (its source's), from its signature."""
    return {p.name: p.default
            for p in list(inspect.signature(OBJECTIVES[name]).parameters.values())[1:]}


LOSS_FIELDS = tuple(
    f.name for f in dataclasses.fields(Loss) if f.name not in ("objective", "settings"))
# settings of the clipping objectives, optimize.py's knobs
CLIP_SETTINGS = ("clip_low", "clip_high", "dual_clip")


def parse_settings(text):
    """'name=value,...' (optimize.py's objective_args) → {name: value}: numbers as float, none as
    None, else text."""
    settings = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, equals, raw = item.partition("=")
        if not equals or not name.strip():
            raise ValueError(f"objective_args: {item!r} is not name=value")
        try:
            settings[name.strip()] = None if raw.strip().lower() == "none" else float(raw)
        except ValueError:
            settings[name.strip()] = raw.strip()
    return settings


def build(objective="clip", **settings):
    """A Loss from flat settings: its own fields by name (LOSS_FIELDS), every other one the
    objective's."""
    return Loss(objective, {k: v for k, v in settings.items() if k not in LOSS_FIELDS},
                **{k: v for k, v in settings.items() if k in LOSS_FIELDS})


@dataclasses.dataclass(frozen=True)
class Preset:
    """A LOSS preset: an objective and its settings (flat, as build takes them), with where they
    come from."""
    objective: str
    settings: dict
    source: str


CLIP_0_5 = dict(clip_low=0.0, clip_high=5.0)                  # μ-GRPO's relaxed clip
NAV = dict(nav_delta=1e-4, nav_scope="H")                     # μ-GRPO's veto
PRESETS = {
    "mu-grpo": Preset("clip", {**CLIP_0_5, **NAV},
                      "μ-GRPO (the paper; docs/design.md §1): the relaxed clip [0, 5] "
                                                   "and NAV's veto, δ = 1e-4, scope H"),
    "grpo": Preset("clip", dict(clip_low=0.8, clip_high=1.2),
                   "GRPO (arXiv 2402.03300): PPO's clip, ε = 0.2"),
    "dapo": Preset("clip", dict(clip_low=0.8, clip_high=1.28),
                   "DAPO (arXiv 2503.14476): clip-higher, ε_low = 0.2, "
                                                               "ε_high = 0.28"),
    "m2po": Preset("is", dict(m2po_tau=0.04), "M2PO (arXiv 2510.01161): no clip, the second-moment "
                                              "mask, τ = 0.04"),
    "relaxed-no-nav": Preset("clip", CLIP_0_5, "the paper's ablation: μ-GRPO's relaxed clip "
                                               "without NAV"),
    "relaxed-low": Preset("clip", {**CLIP_0_5, "clip_high": 1.2, **NAV},
                          "the paper's ablation: μ-GRPO with GRPO's upper bound 1.2 back"),
    "relaxed-high": Preset("clip", {**CLIP_0_5, "clip_low": 0.8, **NAV},
                           "the paper's ablation: μ-GRPO with GRPO's lower bound 0.8 back"),
    "nav-none": Preset("clip", {**CLIP_0_5, **NAV, "nav_scope": "none"},
                       "the paper's Fig. 3: μ-GRPO, NAV's "
                                                                         "triggers counted, "
                                                                         "nothing vetoed"),
    "nav-T": Preset("clip", {**CLIP_0_5, **NAV, "nav_scope": "T"},
                    "the paper's Fig. 3: μ-GRPO vetoing the triggers"),
    "nav-S": Preset("clip", {**CLIP_0_5, **NAV, "nav_scope": "S"},
                    "the paper's Fig. 3: μ-GRPO vetoing all after κ"),
    "nav-seq": Preset("clip", {**CLIP_0_5, **NAV, "nav_scope": "seq"},
                      "the paper's Fig. 3: μ-GRPO vetoing the "
                                                                       "whole response"),
    "offpolicy-grpo": Preset("clip",
                             dict(clip_low=0.8, clip_high=1.2, kl_coef=0.04, kl_estimator="k3"),
                             "the paper's second seed objective: GRPO's clip with β·KL(π ‖ π_ref), "
                             "k3, β = 0.04 (DeepSeekMath's; our choice), π_ref the run's MODEL"),
    "cispo": Preset("cispo", dict(eps_max=5.0), "CISPO (MiniMax-M1, arXiv 2506.13585; ScaleRL, "
                                                "arXiv 2510.13786): the truncated, detached "
                                                "importance weight, ε_max = 5"),
    "cispo-nav": Preset("cispo", dict(eps_max=5.0, **NAV),
                        "CISPO with μ-GRPO's NAV veto (δ = 1e-4, scope H): "
                                                            "with relaxed-no-nav and mu-grpo, what "
                                                            "NAV adds"),
    "topr": Preset("topr",
                   dict(seq_ratio="product", advantage="signed-reward", agg="seq-mean-token-mean"),
                   "TOPR (arXiv 2503.14286): SFT on A ≥ 0, the sequence ratio clipped to [0, 1] on "
                   "A < 0; the paper's ±1 reward and per-response length normalisation"),
    "oapl": Preset(
        "oapl",
        dict(beta2=1e-3, advantage="soft-value", soft_value_beta=1.0, agg="seq-mean-token-mean"),
        "OAPL (arXiv 2602.19362): ratio-free, (β₂·log ρ(y) − Â*)², β₁ = 1, β₂ = 1e-3, mean over "
        "responses"),
    "dppo-tv": Preset("dppo-tv", dict(tv_delta=0.15),
                      "DPPO-TV (arXiv 2602.04879): ρ·A masked where the token's "
                                                      "probability moved more than δ = 0.15 with "
                                                      "the advantage"),
    "vespo": Preset("vespo", dict(k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0),
                    "VESPO (arXiv 2602.10693; FloyedShen/VESPO): φ(w) = w^k e^{λ(1−w)} of the "
                    "sequence ratio, (k, λ) = (2, 3) for A ≥ 0 and (3, 2) for A < 0, token-mean"),
    "gspo": Preset("gspo", dict(clip_low=1 - 3e-4, clip_high=1 + 4e-4, agg="seq-mean-token-mean"),
                   "GSPO (arXiv 2507.18071): the clip on the geometric-mean sequence ratio, [1 − "
                   "3e-4, 1 + 4e-4]; the known-fragile control"),
}


def resolve_loss(name, knobs, given=(), objective_args=""):
    """The Loss optimize.py trains with: the row of preset `name`, with each of `knobs` (its loss
    block's values: LOSS_FIELDS but norm_len, and CLIP_SETTINGS) that is set (not None) or given as
    a flag (a flag's none turns a mask off), and the objective's own settings of objective_args
    ('name=value,...')."""
    set_here = {k: v for k, v in knobs.items() if k in LOSS_FIELDS + CLIP_SETTINGS
                and k != "norm_len"
                and (v is not None or k in given)}
    # (a flag parser reads `none` as None)
    if "nav_scope" in set_here and set_here["nav_scope"] is None:
        set_here["nav_scope"] = "none"
    return preset(name, **{**set_here, **parse_settings(objective_args)})


def preset(name, **overrides):
    """The Loss of a LOSS preset, with `overrides` (flat, as build takes them) over its row's
    settings."""
    if name not in PRESETS:
        raise ValueError(f"LOSS must be one of {' '.join(PRESETS)}, got {name!r}")
    return build(PRESETS[name].objective, **{**PRESETS[name].settings, **overrides})


# ----------------------------------------------------------------------------------------------
# The policy loss


def policy_loss(logprobs, behavior_logprobs, advantages, response_mask, loss, *, m2po_cutoff=None,
                old_logprobs=None, ref_logprobs=None, num_tokens=None, num_seqs=None):
    """The objective of `loss` (a Loss), then its masks (NAV, M2PO), TIS's weight and the KL
    penalty, then the aggregation. Returns (loss value, stats); metrics(stats) gives the logged
    floats.

    logprobs [B, T]           current policy's log-probs of the sampled tokens (with grad)
    behavior_logprobs [B, T]  log-probs stored by the engine at sampling time
    advantages [B]            per-response advantage (the kind loss.advantage names)
    response_mask [B, T]      True on real response tokens
    m2po_cutoff               M2PO's cutoff over the whole minibatch (update.py), else this
                              call's tokens'
    old_logprobs [B, T]       the trainer's log-probs of the behavior policy, with
                              loss.tis_cap: the ratio's denominator, and min(exp(old −
                              behavior), cap), detached, weighs each token
    ref_logprobs [B, T]       the reference policy's: β·KL_t (kl_penalty) is added to each
                              token's loss before the aggregation (it follows the same masks,
                              and every split stays exact); logged when β = 0
    num_tokens, num_seqs      the whole minibatch's token-mean denominator and response count,
                              so that a micro-batch's loss is its exact share (default: this
                              call's). With token-mean over kept tokens the count is known only
                              once every micro-batch's ratios are: update.py passes
                              num_tokens=1 (a sum) and divides the gradient by the kept count
                              afterwards
    Aggregations: token-mean Σ kept loss / num_tokens; seq-mean-token-mean the mean over
    responses of each one's mean over its normalised tokens; seq-mean-token-sum-norm Σ kept loss /
    (num_seqs · norm_len) (Dr. GRPO). The normaliser's tokens: "kept" (response tokens not vetoed
    or masked, verl's masked mean) or "all".
    """
    if loss.tis_cap is not None and old_logprobs is None:
        raise ValueError("tis_cap needs old_logprobs (the trainer's log-probs of the behavior "
                         "policy)")
    if loss.kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's log-probs)")
    mask = response_mask.bool()                                         # [B, T]
    maskf = mask.float()
    reference = behavior_logprobs if old_logprobs is None else old_logprobs
    x = _tokens(logprobs, reference, advantages, mask)
    objective = functools.partial(OBJECTIVES[loss.objective], **loss.settings)
    token_loss, own_stats = objective(x)                                # [B, T]
    if loss.tis_cap is not None:
        tis = torch.clamp(torch.exp(old_logprobs.float() - behavior_logprobs.float()),
                          max=loss.tis_cap)
        token_loss = token_loss * tis.detach()
    kl = kl_penalty(logprobs, ref_logprobs,
                    loss.kl_estimator) * maskf if ref_logprobs is not None else None
    if loss.kl_coef:
        token_loss = token_loss + loss.kl_coef * kl

    # masks
    nav_keep = mask if loss.nav_delta is None else nav_mask(
        x.ratio.detach(), advantages, mask, loss.nav_delta,
        loss.nav_scope)
    m2po_keep = mask if loss.m2po_tau is None else m2po_mask(
        x.log_ratio.detach(), advantages, mask, loss.m2po_tau,
        m2po_cutoff)
    keep = nav_keep & m2po_keep
    keepf = keep.float()
    # the tokens a mean divides by
    norm = keepf if loss.token_normalizer == "kept" else maskf

    # aggregation
    kept_loss = token_loss * keepf
    value = aggregate(kept_loss, norm, loss.agg, num_tokens, num_seqs, loss.norm_len)
    engine_log_ratio = logprobs.detach().float() - behavior_logprobs.float()
    zero = mask & (_coefficients(objective, logprobs, reference, advantages, mask, keepf) == 0)
    stats = _stats(value, kept_loss, x, engine_log_ratio, kl,
                   masks=(keep, nav_keep, m2po_keep, zero), loss=loss)
    return value, {**stats, **{k: v.detach().float() for k, v in own_stats.items()}}


def _tokens(logprobs, reference, advantages, mask):
    maskf = mask.float()
    log_ratio = torch.clamp(logprobs.float() - reference.float(), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    log_ratio = log_ratio * maskf                                       # padding: ρ = 1
    return Tokens(logprobs.float(), reference.float(), log_ratio, torch.exp(log_ratio),
                  advantages.float()[:, None], mask, maskf)


def _coefficients(objective, logprobs, reference, advantages, mask, keepf):
    """Each token's gradient coefficient ∂(Σ kept objective loss)/∂ℓ_t [B, T], on a detached copy: 0
    where the objective, a clip or a mask gives the token no gradient (the same measure for every
    objective)."""
    with torch.enable_grad():
        lp = logprobs.detach().float().requires_grad_(True)
        token_loss, _ = objective(_tokens(lp, reference.detach(), advantages.detach(), mask))
        (grad,) = torch.autograd.grad((token_loss * keepf).sum(), lp, allow_unused=True)
    return torch.zeros_like(lp) if grad is None else grad


def aggregate(kept_loss, norm, agg="token-mean", num_tokens=None, num_seqs=None, norm_len=None):
    """policy_loss's aggregation (agg, num_tokens, num_seqs, norm_len as there) of the kept tokens'
    losses [B, T] (0 elsewhere), with norm [B, T] the tokens a mean divides by."""
    B, T = kept_loss.shape
    n_seq = B if num_seqs is None else num_seqs
    if agg == "token-mean":
        denominator = norm.sum() if num_tokens is None else num_tokens
        return kept_loss.sum() / torch.clamp(
            torch.as_tensor(denominator, dtype=torch.float32), min=1.0)
    if agg == "seq-mean-token-mean":
        per_seq = kept_loss.sum(1) / norm.sum(1).clamp(min=1)           # [B]
        return per_seq.sum() / max(float(n_seq), 1.0)
    length = T if norm_len is None else norm_len
    return kept_loss.sum() / (max(float(n_seq), 1.0) * length)


# the bins of the log-ratio histograms whose quantiles are logged (a count per bin adds up over
# micro-batches and ranks, a quantile does not): around 0, then on each side 39 bins of equal width
# in log |log ρ| from 1e-4 to the clamp (tokens; a bin spans a factor 1.37) or to 1e4 (the
# sequence's Σ_t log ρ_t; a factor 1.60) and one beyond: 81 in all
# torch.logspace's start, end, steps of the edges
TOKEN_BINS = (-4, math.log10(LOG_RATIO_LIMIT), 40)
SEQ_BINS = (-4, 4, 40)
QUANTILES = (0.01, 0.5, 0.99)


def edges(bins, device=None):
    """The positive edges of a histogram's bins [steps] (made on the device: no copy from the
    host)."""
    return torch.logspace(*bins, device=device)


def _histogram(values, selected, bins):
    """Counts of values [B, T] where selected, in the bins 0, ±edges(bins): [2·steps + 1] float32. A
    sum over every value, not over values[selected], whose shape depends on the data (on a GPU: a
    sync per call)."""
    positive = edges(bins, values.device)
    signed = torch.cat([-positive.flip(0), positive])
    index = torch.bucketize(values.detach().float(), signed).flatten()
    return torch.zeros(len(signed) + 1, device=values.device).scatter_add_(
        0, index, selected.flatten().float())


def histogram_quantile(counts, bins, q):
    """The q-quantile of a _histogram of those bins, to its bin: the geometric middle of its bounds
    (0 for the bin around 0, the last edge for the bins beyond it); nan without values."""
    total = float(counts.sum())
    if total == 0:
        return math.nan
    i = int(torch.searchsorted(counts.cumsum(0), torch.tensor([q * total], dtype=counts.dtype))[0])
    positive = edges(bins).tolist()
    n = len(positive)
    j = abs(min(i, 2 * n) - n)             # bin i spans magnitudes positive[j − 1] .. positive[j]
    if j == 0:
        return 0.0
    magnitude = positive[-1] if j == n else math.sqrt(positive[j - 1] * positive[j])
    return magnitude if i > n else -magnitude


@torch.no_grad()
def _stats(value, kept_loss, x, engine_log_ratio, kl, masks, loss):
    """Sums over this call's tokens (names ending in _min/_max: extremes; _hist: counts per bin), as
    float32 tensors. x: the objective's inputs; engine_log_ratio: trainer − engine log-probs; kl:
    the KL estimate (or None) [B, T]; masks: the kept, NAV-kept, M2PO-kept and zero-coefficient
    tokens [B, T]."""
    keep, nav_keep, m2po_keep, zero = masks
    mask, ratio, log_ratio = x.mask, x.ratio.detach(), x.log_ratio.detach()
    adv = x.adv.expand_as(ratio)
    neg, pos = mask & (adv < 0), mask & (adv > 0)
    # each response's first token [B, T]
    first = mask & (mask.long().cumsum(1) == 1)
    inf = torch.tensor(math.inf, device=ratio.device)
    engine_abs = engine_log_ratio.abs() * mask
    seq_log = x.seq_log_ratio("product").detach()                       # [B, 1]
    seq_weight = torch.exp(seq_log.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)) * mask.any(
        1, keepdim=True)
    s = {
        "loss": value.detach().float(), "loss_sum": kept_loss.detach().sum(),
        "tokens": _count(mask), "kept": _count(keep), "seqs": _count(mask.any(1)),
        "neg_tokens": _count(neg), "pos_tokens": _count(pos),
        "zero_pos": _count(zero & pos), "zero_neg": _count(zero & neg),
        "grpo_upper": _count(pos & (ratio > GRPO_CLIP[1])),
        "grpo_lower": _count(neg & (ratio < GRPO_CLIP[0])),
        "grpo_first": _count((pos & (ratio > GRPO_CLIP[1]) | neg & (ratio < GRPO_CLIP[0])) & first),
        "first_tokens": _count(first), "ratio_sum_neg": (ratio * neg).sum(),
        "ratio_sum_pos": (ratio * pos).sum(),
        "ratio_min": torch.where(mask, ratio, inf).min() if mask.numel() else inf,
        "ratio_max": torch.where(mask, ratio, -inf).max() if mask.numel() else -inf,
        # the weights' ESS
        "log_sq_sum": (log_ratio ** 2 * mask).sum(), "ratio_sum": (ratio * mask).sum(),
        "ratio_sq_sum": (ratio ** 2 * mask).sum(), "seq_weight_sum": seq_weight.sum(),
        "seq_weight_sq_sum": (seq_weight ** 2).sum(),
        # KL(behavior ‖ current) from behavior samples, k3 estimator E_b[ρ − 1 − log ρ] (≥ 0)
        "kl_behavior_sum": ((ratio - 1 - log_ratio) * mask).sum(),
        # trainer vs engine log-probs, whatever the ratio's reference (TIS): the mismatch at
        # update 0
        "engine_abs_sum": engine_abs.sum(),
        "engine_abs_max": engine_abs.max() if mask.numel() else -inf,
        "engine_kl_sum": ((engine_log_ratio.exp() - 1 - engine_log_ratio) * mask).sum(),
        **{f"engine_over_{i}": _count(engine_abs > level)
           for i, level in enumerate(MISMATCH_LEVELS)},
    }
    for sign, tokens in (("pos", pos), ("neg", neg)):
        responses = x.responses(1 if sign == "pos" else -1)[:, 0]
        s[f"token_{sign}_hist"] = _histogram(log_ratio, tokens, TOKEN_BINS)
        s[f"seq_{sign}_hist"] = _histogram(seq_log[:, 0], responses, SEQ_BINS)
    if loss.nav_delta is not None:
        trig, _ = nav_triggers(ratio, x.adv[:, 0], mask, loss.nav_delta)
        s.update({"nav_trig": _count(trig), "nav_vetoed": _count(mask & ~nav_keep),
                  "nav_trig_seqs": _count(trig.any(1))})
    if loss.m2po_tau is not None:
        s["m2po_masked"] = _count(mask & ~m2po_keep)
    if kl is not None:
        s["kl_ref_sum"] = kl.detach().sum()
        # > 0 after merging: in the loss
        s["kl_in_loss"] = torch.tensor(float(bool(loss.kl_coef)), device=ratio.device)
    return {k: v.float() for k, v in s.items()}


def merge_stats(a, b):
    """Stats of two disjoint sets of tokens (micro-batches, ranks) combined: sums add, extremes
    extreme."""
    if not a:
        return dict(b)
    combine = {"_min": torch.minimum, "_max": torch.maximum}
    return {k: combine.get(k[-4:], torch.add)(a[k], b[k]) for k in a}


def metrics(stats, extra=None):
    """The logged metrics (floats; nan where a set is empty) from a minibatch's stats, in one device
    sync. `extra`: more 0-d tensors to bring over in the same sync (e.g. the grad norm), returned as
    floats."""
    items = {**stats, **(extra or {})}
    device = stats["tokens"].device
    flat = torch.cat([torch.as_tensor(v,
                                      dtype=torch.float32).to(device).reshape(-1)
                      for v in items.values()]).tolist()
    s, at = {}, 0
    for name, v in items.items():
        n = torch.as_tensor(v).numel()
        s[name] = flat[at] if n == 1 and not name.endswith("_hist") else torch.tensor(
            flat[at:at + n])
        at += n
    frac = lambda num, den: s[num] / s[den] if s[den] > 0 else math.nan    # noqa: E731
    m = {
        "loss/policy": s["loss"], "loss/tokens": s["tokens"], "loss/kept_tokens": s["kept"],
        "loss/kept_frac": frac("kept", "tokens"),
        # the share of each sign's tokens the update gives no gradient (masked, clipped, vetoed, or
        # the objective's)
        "grad/zero_frac_pos": frac("zero_pos", "pos_tokens"),
        "grad/zero_frac_neg": frac("zero_neg", "neg_tokens"),
        # the tokens GRPO's clip would take the gradient from (= clip/*_frac for GRPO itself), and
        # the share of them that are a response's first token (lab-fork's fork), against the first
        # tokens' share of all tokens
        "grpo_clip/upper_frac": frac("grpo_upper", "tokens"),
        "grpo_clip/lower_frac": frac("grpo_lower", "tokens"),
        "grpo_clip/first_token_share": s["grpo_first"] / (s["grpo_upper"] + s["grpo_lower"])
        if s["grpo_upper"] + s["grpo_lower"] > 0 else math.nan,
        "grpo_clip/first_token_base": frac("first_tokens", "tokens"),
        "ratio/mean_neg_adv": frac("ratio_sum_neg", "neg_tokens"),
        "ratio/mean_pos_adv": frac("ratio_sum_pos", "pos_tokens"),
        "ratio/min": s["ratio_min"] if s["tokens"] else math.nan,
        "ratio/max": s["ratio_max"] if s["tokens"] else math.nan,
        "ratio/log_sq_mean": frac("log_sq_sum", "tokens"),
        "ratio/kl": frac("kl_behavior_sum", "tokens"),
        # Kish's effective sample size of the importance weights as a fraction of them: (Σ w)² / (N
        # Σ w²), 1 on policy, 1/N when one carries all the weight; w the token ratios ρ_t, and the
        # sequence ratios Π_t ρ_t
        "ratio/ess_frac": s["ratio_sum"] ** 2 / (s["tokens"] * s["ratio_sq_sum"])
        if s["ratio_sq_sum"] > 0 else math.nan,
        "ratio/seq_ess_frac": s["seq_weight_sum"] ** 2 / (s["seqs"] * s["seq_weight_sq_sum"])
        if s["seq_weight_sq_sum"] > 0 else math.nan,
        "mismatch/mean_abs_log_ratio": frac("engine_abs_sum", "tokens"),
        "mismatch/max_abs_log_ratio": s["engine_abs_max"] if s["tokens"] else math.nan,
        "mismatch/kl": frac("engine_kl_sum", "tokens"),
        **{f"mismatch/frac_over_{level:g}": frac(f"engine_over_{i}", "tokens")
           for i, level in enumerate(MISMATCH_LEVELS)},
    }
    # the token ratio's quantiles per advantage sign, and the sequence log-ratio's (Σ_t log ρ_t),
    # each to its bin
    for sign in ("pos", "neg"):
        for q in QUANTILES:
            hist = s[f"token_{sign}_hist"]
            m[f"ratio/p{q * 100:02.0f}_{sign}"] = (math.exp(histogram_quantile(hist, TOKEN_BINS, q))
                                                   if hist.sum() else math.nan)
            m[f"seq_log_ratio/p{q * 100:02.0f}_{sign}"] = histogram_quantile(
                s[f"seq_{sign}_hist"], SEQ_BINS, q)
    # an upper bound on the 99.9th percentile of |Δ log p|: the lowest level at most 0.1 % of the
    # tokens exceed
    over = [(level, m[f"mismatch/frac_over_{level:g}"]) for level in MISMATCH_LEVELS]
    m["mismatch/p999_at_most"] = next((level for level, f in over
                                       if f <= 1e-3), math.inf) if s["tokens"] else math.nan
    m.update({name: frac(num, den) for name, (num, den) in FAMILY_METRICS.items() if num in s})
    if "nav_trig" in s:
        m.update({"nav/trigger_frac": frac("nav_trig", "tokens"),
                  "nav/trigger_frac_neg": frac("nav_trig", "neg_tokens"),
                  "nav/vetoed_frac": frac("nav_vetoed", "tokens"),
                  "nav/vetoed_frac_neg": frac("nav_vetoed", "neg_tokens"),
                  "nav/triggered_seq_frac": frac("nav_trig_seqs", "seqs")})
    if "m2po_masked" in s:
        m["m2po/masked_frac"] = frac("m2po_masked", "tokens")
    if "kl_ref_sum" in s:
        m["kl/ref_mean"] = frac("kl_ref_sum", "tokens")
        m["kl/in_loss"] = float(s["kl_in_loss"] > 0)
    m.update({k: s[k] for k in (extra or {})})
    return m
