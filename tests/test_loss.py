"""loss.py on hand-computed cases. Every expected number can be checked with pencil and paper."""
import math

import pytest
import torch

import loss as L

T_, F_ = True, False
CALL = ("m2po_cutoff", "old_logprobs", "ref_logprobs", "num_tokens", "num_seqs")   # policy_loss's per-call arguments


def policy_loss(logprobs, behavior, adv, mask, objective="clip", **settings):
    """loss.policy_loss with the Loss made from flat settings (loss.build) and the per-call arguments passed on."""
    call = {k: settings.pop(k) for k in CALL if k in settings}
    return L.policy_loss(logprobs, behavior, adv, mask, L.build(objective, **settings), **call)


def _lp_from_ratio(behavior, ratios):
    """Current log-probs that give the requested ratios against `behavior`, with grad."""
    return (torch.tensor(behavior) + torch.log(torch.tensor(ratios))).requires_grad_(True)


def _loss_and_grad(behavior, ratios, adv, mask=None, **kw):
    lp = _lp_from_ratio(behavior, ratios)
    b = torch.tensor(behavior)
    mask = torch.ones_like(b, dtype=torch.bool) if mask is None else torch.tensor(mask)
    loss, stats = policy_loss(lp, b, torch.tensor(adv), mask, **kw)
    loss.backward()
    return loss.item(), lp.grad, L.metrics(stats)


# ------------------------------------------------------------------ surrogate and its gradient


def test_grpo_clip_stops_the_gradient_above_hi_for_positive_advantage():
    # A = +2, ratios 1.5 (above hi=1.2: clipped), 1.0 and 0.5 (below lo, but A>0 so not clipped)
    loss, grad, m = _loss_and_grad([[-1.0, -2.0, -0.5]], [[1.5, 1.0, 0.5]], [2.0],
                                   clip_low=0.8, clip_high=1.2)
    # −(1.2·2 + 1·2 + 0.5·2) / 3 = −1.8
    assert loss == pytest.approx(-1.8, abs=1e-6)
    # d/dℓ of −ρA/N is −Aρ/N; zero where the clip binds
    assert grad.tolist()[0] == pytest.approx([0.0, -2 * 1.0 / 3, -2 * 0.5 / 3], abs=1e-6)
    assert m["clip/upper_frac"] == pytest.approx(1 / 3)
    assert m["clip/lower_frac"] == 0.0
    assert m["ratio/mean_pos_adv"] == pytest.approx(1.0)
    assert math.isnan(m["ratio/mean_neg_adv"])
    assert m["ratio/min"] == pytest.approx(0.5) and m["ratio/max"] == pytest.approx(1.5)


def test_grpo_clip_stops_the_gradient_below_lo_for_negative_advantage():
    # A = −1: ratio 1.5 is *not* clipped (min picks −1.5), ratio 0.5 is clipped at lo = 0.8
    loss, grad, m = _loss_and_grad([[-1.0, -2.0, -0.5]], [[1.5, 1.0, 0.5]], [-1.0],
                                   clip_low=0.8, clip_high=1.2)
    assert loss == pytest.approx((1.5 + 1.0 + 0.8) / 3, abs=1e-6)        # 1.1
    assert grad.tolist()[0] == pytest.approx([1.5 / 3, 1.0 / 3, 0.0], abs=1e-6)
    assert m["clip/lower_frac"] == pytest.approx(1 / 3)
    assert m["ratio/mean_neg_adv"] == pytest.approx(1.0)


def test_every_loss_logs_the_tokens_grpos_clip_would_take_the_gradient_from_and_whether_they_are_first():
    # μ-GRPO's clip [0, 5] binds nowhere here; GRPO's [0.8, 1.2] would bind on A>0 at 1.5 (the first token of
    # response 0) and on A<0 at 0.5 (the second of response 1, whose first token is padding) and 0.7 (its third)
    behavior = [[0.0] * 4, [0.0] * 4]
    ratios = [[1.5, 1.0, 0.5, 1.3], [9.0, 0.5, 0.7, 1.4]]
    mask = [[T_, T_, T_, F_], [F_, T_, T_, T_]]
    _, _, m = _loss_and_grad(behavior, ratios, [1.0, -1.0], mask, clip_low=0.0, clip_high=5.0)
    assert m["clip/upper_frac"] == 0.0 and m["clip/lower_frac"] == 0.0
    assert m["grpo_clip/upper_frac"] == pytest.approx(1 / 6)       # 1.5 (1.3 is padding)
    assert m["grpo_clip/lower_frac"] == pytest.approx(2 / 6)       # 0.5 and 0.7 (9.0 is padding; 1.4 has A<0: free)
    assert m["grpo_clip/first_token_share"] == pytest.approx(2 / 3)   # 1.5 and 0.5 are their responses' first tokens
    assert m["grpo_clip/first_token_base"] == pytest.approx(2 / 6)
    _, _, g = _loss_and_grad(behavior, ratios, [1.0, -1.0], mask, clip_low=0.8, clip_high=1.2)
    assert (g["grpo_clip/upper_frac"], g["grpo_clip/lower_frac"]) == (g["clip/upper_frac"], g["clip/lower_frac"])


def test_relaxed_clip_0_5_stops_only_ratios_above_5_for_positive_advantage():
    # clip [0, 5]: ratio 6 with A>0 is clipped (zero grad), ratio 4 is not; A<0 never hits lo = 0
    loss, grad, _ = _loss_and_grad([[0.0, 0.0], [0.0, 0.0]], [[6.0, 4.0], [0.01, 4.0]], [1.0, -1.0],
                                   clip_low=0.0, clip_high=5.0)
    # tokens: −5, −4, +0.01, +4 → sum −4.99 over N = 4
    assert loss == pytest.approx(-4.99 / 4, abs=1e-6)
    assert grad.flatten().tolist() == pytest.approx([0.0, -4 / 4, 0.01 / 4, 4 / 4], abs=1e-6)


def test_dual_clip_caps_negative_advantage():
    # A = −2, c = 3: ratio 4 would give loss 8, capped at 3·2 = 6 with zero gradient; ratio 2 → 4
    loss, grad, m = _loss_and_grad([[0.0, 0.0]], [[4.0, 2.0]], [-2.0],
                                   clip_low=0.8, clip_high=1.2, dual_clip=3.0)
    assert loss == pytest.approx((6.0 + 4.0) / 2, abs=1e-6)
    assert grad.tolist()[0] == pytest.approx([0.0, 2.0 * 2.0 / 2], abs=1e-6)
    assert m["clip/dual_frac"] == pytest.approx(0.5)


def test_stats_merge_sums_and_extremes():
    a = {"tokens": torch.tensor(3.0), "ratio_min": torch.tensor(0.5), "ratio_max": torch.tensor(2.0)}
    b = {"tokens": torch.tensor(4.0), "ratio_min": torch.tensor(0.2), "ratio_max": torch.tensor(1.5)}
    assert {k: v.item() for k, v in L.merge_stats(a, b).items()} == {"tokens": 7.0, "ratio_min": pytest.approx(0.2),
                                                                     "ratio_max": 2.0}
    assert L.merge_stats({}, a) == a


def test_padding_contributes_nothing():
    loss, grad, m = _loss_and_grad([[0.0, 0.0, 0.0]], [[1.0, 1.0, 7.0]], [1.0], mask=[[T_, T_, F_]],
                                   clip_low=0.8, clip_high=1.2)
    assert loss == pytest.approx(-1.0)
    assert grad.tolist()[0] == pytest.approx([-0.5, -0.5, 0.0])
    assert m["loss/tokens"] == 2 and m["ratio/max"] == pytest.approx(1.0)


def test_vetoed_tokens_leave_the_token_mean():
    # A = −1, ratios [1, 1e-5 (trigger), 2, 3]; scope H vetoes t=2,3: the mean is over the 2 kept tokens
    # (verl's masked token-mean, docs/design.md §1); with token_normalizer="all" over all 4 response tokens
    loss, grad, m = _loss_and_grad([[0.0] * 4], [[1.0, 1e-5, 2.0, 3.0]], [-1.0],
                                   clip_low=0.0, clip_high=5.0, nav_delta=1e-4, nav_scope="H")
    assert loss == pytest.approx((1.0 + 1e-5) / 2, abs=1e-7)
    assert grad.tolist()[0] == pytest.approx([1 / 2, 1e-5 / 2, 0.0, 0.0], abs=1e-7)
    assert m["loss/kept_tokens"] == 2 and m["loss/kept_frac"] == 0.5
    loss, grad, _ = _loss_and_grad([[0.0] * 4], [[1.0, 1e-5, 2.0, 3.0]], [-1.0], clip_low=0.0, clip_high=5.0,
                                   nav_delta=1e-4, nav_scope="H", token_normalizer="all")
    assert loss == pytest.approx((1.0 + 1e-5) / 4, abs=1e-7)
    assert grad.tolist()[0] == pytest.approx([1 / 4, 1e-5 / 4, 0.0, 0.0], abs=1e-7)
    # seq-mean-token-mean: each response's mean is over its kept tokens as well
    loss, _, _ = _loss_and_grad([[0.0] * 4, [0.0] * 4], [[1.0, 1e-5, 2.0, 3.0], [1.0] * 4], [-1.0, 1.0],
                                clip_low=0.0, clip_high=5.0, nav_delta=1e-4, nav_scope="H", agg="seq-mean-token-mean")
    assert loss == pytest.approx(((1.0 + 1e-5) / 2 + -1.0) / 2, abs=1e-7)
    _, _, m = _loss_and_grad([[0.0] * 4], [[1.0, 1e-5, 2.0, 3.0]], [-1.0],
                             clip_low=0.0, clip_high=5.0, nav_delta=1e-4, nav_scope="H")
    assert m["nav/trigger_frac"] == pytest.approx(0.25)
    assert m["nav/vetoed_frac"] == pytest.approx(0.5)
    assert m["nav/vetoed_frac_neg"] == pytest.approx(0.5)
    assert m["nav/triggered_seq_frac"] == 1.0


def test_log_sq_ratio_and_k3_kl_metrics_by_hand():
    # ratios e and 1: (log ρ)² mean = (1 + 0)/2; k3 KL = ((e − 1 − 1) + 0)/2
    _, _, m = _loss_and_grad([[0.0, 0.0]], [[math.e, 1.0]], [1.0], clip_low=0.0, clip_high=5.0)
    assert m["ratio/log_sq_mean"] == pytest.approx(0.5)
    assert m["ratio/kl"] == pytest.approx((math.e - 2) / 2)


def test_the_importance_weights_effective_sample_size_by_hand():
    # Kish: (Σ ρ)² / (N Σ ρ²). Ratios 2 and 0 (one token carries all the weight): 4 / (2 · 4) = 1/2; ratios 1, 1: 1
    _, _, m = _loss_and_grad([[0.0, 0.0]], [[2.0, 1e-9]], [1.0], clip_low=0.0, clip_high=5.0)
    assert m["ratio/ess_frac"] == pytest.approx(0.5, abs=1e-6)
    _, _, m = _loss_and_grad([[0.0, 0.0, 0.0]], [[1.0, 1.0, 4.0]], [1.0], clip_low=0.0, clip_high=5.0)
    assert m["ratio/ess_frac"] == pytest.approx(36 / (3 * 18))      # (1 + 1 + 4)² / (3 · (1 + 1 + 16)) = 2/3


def test_mismatch_shares_above_each_level_and_the_p999_bound():
    # |log ratio| of 5 response tokens (one padding token): 0, 5e-3, 0.05, 0.5, 2 → above 1e-4: 4 of 5, above 1e-3:
    # 4, above 0.01: 3, above 0.1: 2, above 1: 1, above 10: 0. p99.9 needs a level at most 0.1 % exceed: 10
    logs = [0.0, 5e-3, -0.05, 0.5, -2.0, 7.0]
    _, _, m = _loss_and_grad([[0.0] * 6], [[math.exp(x) for x in logs]], [1.0], mask=[[T_] * 5 + [F_]],
                             clip_low=0.0, clip_high=5.0)
    assert [m[f"mismatch/frac_over_{level:g}"] for level in L.MISMATCH_LEVELS] == pytest.approx([0.8, 0.8, 0.6, 0.4, 0.2, 0])
    assert m["mismatch/p999_at_most"] == 10.0
    _, _, m = _loss_and_grad([[0.0] * 2], [[1.0, math.exp(2e-3)]], [1.0], clip_low=0.0, clip_high=5.0)
    assert m["mismatch/p999_at_most"] == 1e-2          # 2e-3 is above 1e-3, below 1e-2
    _, _, m = _loss_and_grad([[0.0]], [[1.0]], [1.0], clip_low=0.0, clip_high=5.0)
    assert m["mismatch/p999_at_most"] == 1e-4           # the lowest level


def test_tis_weights_the_ratio_to_old_by_min_old_over_behavior_and_cap_detached():
    # ratio against old_logprobs; weight min(exp(old − behavior), cap) = min(3, 2) = 2, detached
    b = torch.tensor([[0.0]])
    old = torch.log(torch.tensor([[3.0]]))
    lp = (old + math.log(1.1)).requires_grad_(True)   # ρ = 1.1 vs old
    loss, _ = policy_loss(lp, b, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool),
                            clip_low=0.8, clip_high=1.2, tis_cap=2.0, old_logprobs=old)
    loss.backward()
    assert loss.item() == pytest.approx(-2 * 1.1)
    assert lp.grad.item() == pytest.approx(-2 * 1.1)
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(lp, b, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool),
                      clip_low=0.8, clip_high=1.2, tis_cap=2.0)


def test_bad_options_are_named():
    x = torch.zeros(1, 1)
    m = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="token-mean"):
        policy_loss(x, x, torch.zeros(1), m, clip_low=0.8, clip_high=1.2, agg="mean")
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(x, x, torch.zeros(1), m, clip_low=1.2, clip_high=0.8)
    with pytest.raises(ValueError, match="scope"):
        L.nav_mask(x, torch.zeros(1), m, scope="X")


# ------------------------------------------------------------------ aggregations


def test_token_mean_seq_mean_and_dr_grpo_normalize_as_their_formulas_by_hand():
    # two responses, lengths 1 and 3, all ratios 1 → per-token loss −A; A = [+1, −1] → [−1 | 1, 1, 1]
    b = torch.zeros(2, 3)
    mask = torch.tensor([[T_, F_, F_], [T_, T_, T_]])
    adv = torch.tensor([1.0, -1.0])
    kw = dict(clip_low=0.8, clip_high=1.2)
    tok, _ = policy_loss(b, b, adv, mask, agg="token-mean", **kw)
    seq, _ = policy_loss(b, b, adv, mask, agg="seq-mean-token-mean", **kw)
    drg, _ = policy_loss(b, b, adv, mask, agg="seq-mean-token-sum-norm", norm_len=4, **kw)
    assert tok.item() == pytest.approx((-1 + 3) / 4)           # 0.5
    assert seq.item() == pytest.approx((-1 / 1 + 3 / 3) / 2)   # 0
    assert drg.item() == pytest.approx((-1 + 3) / (2 * 4))     # 0.25


@pytest.mark.parametrize("agg", L.AGG_MODES)
@pytest.mark.parametrize("normalizer", L.TOKEN_NORMALIZERS)
@pytest.mark.parametrize("options", [dict(), dict(nav_delta=0.3, nav_scope="H"), dict(dual_clip=3.0),
                                     *(dict(objective=name) for name in ("cispo", "topr", "oapl", "dppo-tv", "vespo",
                                                                         "gspo")),
                                     dict(objective="cispo", nav_delta=0.3), dict(objective="is", m2po_tau=0.04),
                                     dict(m2po_tau=0.04, m2po_cutoff=0.5)])
def test_micro_batch_split_does_not_change_loss_grad_or_stats(agg, normalizer, options):
    # the recipe of optimize.py: micro-batch losses with the minibatch's counts (token-mean over kept
    # tokens: sums, the gradient divided by the merged kept count afterwards), stats merged. The gradients
    # themselves are compared: each is a sum of at most 7 terms of magnitude ≤ ~5, so another summation
    # order changes it by ~1e-7 (float32); 1e-6 leaves room for that and catches any term lost or doubled
    g = torch.Generator().manual_seed(0)
    B, T = 6, 7
    lengths = torch.tensor([7, 3, 5, 1, 6, 2])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    behavior = -torch.rand(B, T, generator=g) * 3
    current = behavior + torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    clip = dict(clip_low=0.0, clip_high=5.0) if options.get("objective", "clip") == "clip" else {}   # (the clip's)
    kw = dict(agg=agg, token_normalizer=normalizer, num_seqs=B, norm_len=T, **clip, **options)
    deferred = agg == "token-mean" and normalizer == "kept"

    def run(splits):
        lp = current.clone().requires_grad_(True)
        stats = {}
        for idx in torch.tensor_split(torch.arange(B), splits):
            n_tok = 1.0 if deferred else (int(mask.sum()) if splits > 1 else None)
            part, s = policy_loss(lp[idx], behavior[idx], adv[idx], mask[idx], num_tokens=n_tok, **kw)
            part.backward()
            stats = L.merge_stats(stats, s)
        if deferred:
            lp.grad /= stats["kept"]
            stats["loss"] = stats["loss"] / stats["kept"]
        return lp.grad.clone(), L.metrics(stats)

    lp = current.clone().requires_grad_(True)
    whole, whole_stats = policy_loss(lp, behavior, adv, mask, **kw)
    whole.backward()
    expected = L.metrics(whole_stats)
    assert expected["loss/policy"] == pytest.approx(whole.item())
    for splits in (1, 2, 3):
        grad, m = run(splits)
        assert torch.allclose(grad, lp.grad, atol=1e-6)
        assert m.keys() == expected.keys()
        for k in m:
            assert m[k] == pytest.approx(expected[k], abs=1e-6, nan_ok=True), k


# ------------------------------------------------------------------ two identities of the veto scopes


@pytest.mark.parametrize("scope,reference", [("T", "none"), ("S", "H")])
def test_a_trigger_weighs_at_most_delta_so_T_is_none_and_S_is_H(scope, reference):
    # A trigger token has A < 0 and ρ < δ; under the relaxed clip its gradient weight on log π is ρ·|A| < δ·|A|. T
    # differs from none only by dropping triggers, S from H only by dropping the triggers after κ: the updates
    # are equal up to such δ-sized terms (with the normalizer over all tokens; with `kept` the two differ also
    # by the count of the dropped triggers in the denominator). Here, first response: triggers at t = 1, 3 (ρ < δ = 0.1), κ = 1
    delta, ratios = 0.1, [[0.5, 0.05, 0.9, 0.02, 1.2], [1.0, 1.0, 0.5, 0.5, 1.0]]
    adv, n = [-1.5, 0.5], 10
    kw = dict(clip_low=0.0, clip_high=5.0, nav_delta=delta, token_normalizer="all")
    _, g_scope, _ = _loss_and_grad([[0.0] * 5] * 2, ratios, adv, nav_scope=scope, **kw)
    _, g_ref, _ = _loss_and_grad([[0.0] * 5] * 2, ratios, adv, nav_scope=reference, **kw)
    diff = (g_scope - g_ref).abs()
    dropped = [1, 3] if scope == "T" else [3]             # T: every trigger; S vs H: the triggers after κ = 1
    assert diff[0, dropped].tolist() == pytest.approx([ratios[0][t] * 1.5 / n for t in dropped])   # ρ·|A| / N
    assert max(diff[0, dropped].tolist()) < delta * 1.5 / n
    assert diff.sum().item() == pytest.approx(diff[0, dropped].sum().item())        # nothing else differs


# ------------------------------------------------------------------ NAV masks, written out by hand

# one negative-advantage response: ratios [0.5, 1e-5, 0.9, 1e-6, 1.2] → triggers at t=1 and t=3, κ = 1
SEVERAL = [0.5, 1e-5, 0.9, 1e-6, 1.2]
# trigger at the very first token
FIRST = [1e-5, 1.0, 1.0]


@pytest.mark.parametrize("ratios,scope,expected", [
    (SEVERAL, "none", [T_, T_, T_, T_, T_]),
    (SEVERAL, "T", [T_, F_, T_, F_, T_]),
    (SEVERAL, "H", [T_, T_, F_, T_, F_]),
    (SEVERAL, "S", [T_, T_, F_, F_, F_]),
    (SEVERAL, "seq", [F_, F_, F_, F_, F_]),
    (FIRST, "T", [F_, T_, T_]),
    (FIRST, "H", [T_, F_, F_]),
    (FIRST, "S", [T_, F_, F_]),
    (FIRST, "seq", [F_, F_, F_]),
    ([0.5, 0.9, 2.0], "H", [T_, T_, T_]),    # no trigger
    ([0.5, 0.9, 2.0], "seq", [T_, T_, T_]),
])
def test_each_nav_scope_vetoes_exactly_its_tokens_of_a_negative_response(ratios, scope, expected):
    ratio = torch.tensor([ratios])
    keep = L.nav_mask(ratio, torch.tensor([-1.0]), torch.ones_like(ratio, dtype=torch.bool), 1e-4, scope)
    assert keep.tolist() == [expected]


@pytest.mark.parametrize("scope", L.NAV_SCOPES)
def test_nav_never_touches_positive_or_zero_advantage(scope):
    ratio = torch.tensor([SEVERAL, SEVERAL])
    keep = L.nav_mask(ratio, torch.tensor([1.0, 0.0]), torch.ones_like(ratio, dtype=torch.bool), 1e-4, scope)
    assert keep.all()


def test_nav_padding_is_never_a_trigger():
    # the padded position holds a tiny ratio; it must not trigger, and stays masked out
    ratio = torch.tensor([[1.0, 0.5, 1e-9, 1e-9]])
    mask = torch.tensor([[T_, T_, F_, F_]])
    for scope in L.NAV_SCOPES:
        assert L.nav_mask(ratio, torch.tensor([-1.0]), mask, 1e-4, scope).tolist() == [[T_, T_, F_, F_]]
    # a real trigger followed by padding: S drops the real suffix, padding stays out
    ratio = torch.tensor([[1e-5, 1.0, 1.0]])
    mask = torch.tensor([[T_, T_, F_]])
    assert L.nav_mask(ratio, torch.tensor([-1.0]), mask, 1e-4, "S").tolist() == [[T_, F_, F_]]


# ------------------------------------------------------------------ M2PO


def test_m2po_removal_order_by_hand():
    # harmful: row 0 (A>0) log ρ > 0 → 0.5, 0.1; row 1 (A<0) log ρ < 0 → −0.4, −0.05
    # (log ρ)²: 0.25, 0.01, 0.16, 0.0025; mean 0.105625 > 0.04
    # drop 0.25 → mean 0.1725/3 = 0.0575 > 0.04; drop 0.16 → 0.0125/2 = 0.00625 ≤ 0.04: stop
    log_ratio = torch.tensor([[0.5, -0.3, 0.1], [-0.4, 0.2, -0.05]])
    keep = L.m2po_mask(log_ratio, torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool), 0.04)
    assert keep.tolist() == [[F_, T_, T_], [F_, T_, T_]]
    # with tau = 0.06 only the first removal is needed
    keep = L.m2po_mask(log_ratio, torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool), 0.06)
    assert keep.tolist() == [[F_, T_, T_], [T_, T_, T_]]


def test_m2po_leaves_harmless_and_padding_alone():
    # large (log ρ)² on helpful tokens (A>0 with ρ<1) is never masked; padding stays masked
    log_ratio = torch.tensor([[-3.0, -2.0, 5.0]])
    mask = torch.tensor([[T_, T_, F_]])
    assert L.m2po_mask(log_ratio, torch.tensor([1.0]), mask, 0.04).tolist() == [[T_, T_, F_]]


def test_m2po_cutoff_by_hand():
    # same numbers as above: after removing 0.25 and 0.16 the mean is ≤ 0.04, so the cutoff is 0.16
    sq = torch.tensor([0.25, 0.01, 0.16, 0.0025])
    assert L.m2po_cutoff(sq, 0.04).item() == pytest.approx(0.16)
    assert L.m2po_cutoff(sq, 0.2).item() == math.inf              # mean 0.105625 is already ≤ 0.2
    assert L.m2po_cutoff(torch.tensor([]), 0.04).item() == math.inf
    assert L.m2po_cutoff(torch.tensor([1.0, 1.0]), 0.04).item() == 1.0   # nothing may stay: all go
    # ties with the last removed value go too: 0.3, 0.3, 0.3, 0.0 → removing one 0.3 leaves 0.2 > 0.1,
    # two leave 0.15 > 0.1, three leave 0 ≤ 0.1
    assert L.m2po_cutoff(torch.tensor([0.3, 0.3, 0.3, 0.0]), 0.1).item() == pytest.approx(0.3)
    # the order of the tokens (how a minibatch is split over ranks) does not matter
    assert L.m2po_cutoff(sq.flip(0), 0.04) == L.m2po_cutoff(sq, 0.04)


def test_m2po_in_policy_loss_reports_masked_fraction():
    b = torch.zeros(2, 3)
    lp = torch.tensor([[0.5, -0.3, 0.1], [-0.4, 0.2, -0.05]])
    _, s = policy_loss(lp, b, torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool),
                         clip_low=0.0, clip_high=5.0, m2po_tau=0.04)
    assert L.metrics(s)["m2po/masked_frac"] == pytest.approx(2 / 6)
    # a cutoff from the whole minibatch overrides this call's: 0.2 masks only the 0.25 token
    _, s = policy_loss(lp, b, torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool),
                         clip_low=0.0, clip_high=5.0, m2po_tau=0.04, m2po_cutoff=0.2)
    assert L.metrics(s)["m2po/masked_frac"] == pytest.approx(1 / 6)


# ------------------------------------------------------------------ KL to the reference policy


def test_kl_estimators_by_hand():
    # ℓ = log 0.5, ℓ_ref = log 0.25: d = ℓ_ref − ℓ = −log 2
    lp, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
    d = -math.log(2)
    assert L.kl_penalty(lp, ref, "k1").item() == pytest.approx(math.log(2))
    assert L.kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert L.kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(d) - d - 1)     # 0.5 + 0.693 − 1
    assert L.kl_penalty(lp, lp, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k1"):
        L.kl_penalty(lp, ref, "k4")


def test_kl_penalty_is_added_per_token_before_aggregation():
    # ratios 1 (ℓ = b), A = 0: the surrogate is 0, so the loss is β · mean k3 over kept tokens.
    # tokens: ℓ = log 0.5 each, ref = log 0.25 and log 0.5 → k3 = (0.5 − ln 2 ... ) and 0
    lp = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    k3 = math.exp(-math.log(2)) + math.log(2) - 1
    loss, s = policy_loss(lp, lp.detach(), torch.tensor([0.0]), mask, clip_low=0.0, clip_high=5.0,
                            kl_coef=0.1, ref_logprobs=ref)
    assert loss.item() == pytest.approx(0.1 * k3 / 2)
    loss.backward()
    # d k3 / d ℓ = 1 − exp(ℓ_ref − ℓ): 1 − 0.5 and 0; times β / N
    assert lp.grad.tolist()[0] == pytest.approx([0.1 * 0.5 / 2, 0.0])
    m = L.metrics(s)
    assert m["kl/ref_mean"] == pytest.approx(k3 / 2) and m["kl/in_loss"] == 1.0
    # β = 0: monitored, not in the loss; and bit-identical to a call without a reference
    loss0, s0 = policy_loss(lp, lp.detach(), torch.tensor([1.0]), mask, clip_low=0.0, clip_high=5.0,
                              kl_coef=0.0, ref_logprobs=ref)
    plain, _ = policy_loss(lp, lp.detach(), torch.tensor([1.0]), mask, clip_low=0.0, clip_high=5.0)
    assert loss0.item() == plain.item() and L.metrics(s0)["kl/in_loss"] == 0.0
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp.detach(), torch.tensor([1.0]), mask, clip_low=0.0, clip_high=5.0, kl_coef=0.1)


# ------------------------------------------------------------------ advantages


def test_group_advantages_by_hand():
    # group 0: mean 0.25, sample std sqrt((0.75² + 3·0.25²)/3) = 0.5 → [1.5, −0.5, −0.5, −0.5]
    adv, zero_var = L.group_advantages([1, 0, 0, 0, 1, 1, 1, 1], 4, eps=0.0)
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0])
    assert zero_var.tolist() == [F_, T_]
    adv, _ = L.group_advantages([1, 0, 0, 0], 4, normalize_std=False)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    with pytest.raises(ValueError, match="multiple of group_size"):
        L.group_advantages([1, 0, 0], 2)


# ------------------------------------------------------------------ token log-probs


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_token_logprobs_match_naive(temperature):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(37, 1000, generator=g) * 4).requires_grad_(True)
    target = torch.randint(0, 1000, (37,), generator=g)
    weights = torch.randn(37, generator=g)
    naive = torch.log_softmax(logits / temperature, -1).gather(1, target[:, None]).squeeze(1)
    (naive * weights).sum().backward()
    naive_grad, logits.grad = logits.grad.clone(), None
    for rows in (None, 5):   # one chunk, and eight chunks of 5 rows
        ours = L.token_logprobs(logits, target, temperature, chunk_rows=rows)
        assert torch.allclose(ours, naive, atol=1e-5)
        (ours * weights).sum().backward()
        assert torch.allclose(logits.grad, naive_grad, atol=1e-5)
        logits.grad = None


def test_token_logprobs_keeps_leading_shape_and_bf16():
    logits = torch.randn(2, 3, 50).bfloat16()
    target = torch.randint(0, 50, (2, 3))
    out = L.token_logprobs(logits, target, 1.0)
    assert out.shape == (2, 3) and out.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1).gather(-1, target[..., None]).squeeze(-1)
    assert torch.allclose(out, ref, atol=1e-5)


def test_token_entropy_is_log_k_for_uniform_and_zero_for_one_hot():
    # uniform over 4 → log 4; one-hot-ish → ≈ 0
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    assert L.token_entropy(logits).tolist() == pytest.approx([math.log(4), 0.0], abs=1e-5)
