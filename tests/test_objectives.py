"""loss.py's objectives, each against an independent few-line float64 reference of its primary source's formula
(docs/objectives.md), on two responses of three tokens (the second one padded after two), both advantage signs, ratios
above and below each bound; the LOSS presets' table and every list that names presets checked against it."""
import math
import re
import subprocess
import sys

import pytest
import torch

import loss as L
from conftest import ROOT

# behavior log-probs b and ratios ρ = π/μ: response 0 crosses CISPO's 5 (6.0), the clips' upper and lower bounds
# (6.0, 0.5); response 1 holds two tokens (0.2 below GRPO's and NAV's 0.5, 2.6 above 1.2), then padding whose junk ratio
# 7.0 must count nowhere. Sequence ratios: 6·1·0.5 = 3 (geometric 1.442), 0.2·2.6 = 0.52 (geometric 0.721)
BEHAVIOR = [[-3.0, -0.5, -0.2], [-0.4, -1.5, -3.0]]
RATIOS = [[6.0, 1.0, 0.5], [0.2, 2.6, 7.0]]
MASK = [[True, True, True], [True, True, False]]
SIGNS = [[1.5, -0.5], [-1.5, 0.5]]      # each response under both advantage signs


def reference(name, lp, b, A, m, **s):
    """The objective's loss from its source's formula, in float64: lp [2, 3] (with grad), b, A [2], m [2, 3] bool."""
    r = (lp - b) * m                                   # log ρ_t, 0 on padding
    rho, A, n = r.exp(), A[:, None], m.sum(1)
    seq = r.sum(1, keepdim=True)                       # log Π_t ρ_t
    def token_mean(x): return (x * m).sum() / m.sum()                             # noqa: E306,E704
    def seq_mean(x): return ((x * m).sum(1) / n).mean()                            # noqa: E306,E704
    if name == "clip":
        return token_mean(-torch.min(rho * A, rho.clamp(s["clip_low"], s["clip_high"]) * A))
    if name == "is":
        return token_mean(-rho * A)
    if name == "cispo":                               # −sg(min(ρ, ε_max))·A·log π
        return token_mean(-rho.clamp(max=s["eps_max"]).detach() * A * lp)
    if name == "topr":                                # A ≥ 0: −A·log π; A < 0: −sg(clip(ρ(y), 0, 1))·A·log π
        level = seq if s["seq_ratio"] == "product" else seq / n[:, None]
        w = torch.where(A < 0, level.clamp(max=0).exp(), torch.ones_like(level)).detach()
        return seq_mean(-w * A * lp)
    if name == "oapl":                                # (β₂·Σ_t log ρ_t − Â)², mean over responses
        return ((s["beta2"] * seq[:, 0] - A[:, 0]) ** 2).mean()
    if name == "dppo-tv":                             # −M·ρ·A, M = 0 where π − μ moved more than δ with A
        moved = lp.detach().exp() - b.exp()
        keep = ~(((A > 0) & (moved > s["tv_delta"])) | ((A < 0) & (-moved > s["tv_delta"])))
        return token_mean(-keep.double() * rho * A)
    if name == "vespo":                               # −sg(w^k e^{λ(1−w)})·A·log π, w = Π_t ρ_t
        w = seq.clamp(math.log(1e-8), 20).exp().detach()
        k = torch.where(A >= 0, s["k_pos"], s["k_neg"])
        lam = torch.where(A >= 0, s["lam_pos"], s["lam_neg"])
        return token_mean(-(w ** k * torch.exp(lam * (1 - w))) * A * lp)
    if name == "gspo":                                # PPO's min on s = exp(mean_t log ρ_t), mean over responses
        s_i = (seq / n[:, None]).exp()
        return (-torch.min(s_i * A, s_i.clamp(s["clip_low"], s["clip_high"]) * A)).mean()
    raise KeyError(name)


# every objective at its source's settings, and again where its own setting decides (a bound that binds here)
CASES = [("clip", dict(clip_low=0.8, clip_high=1.2)), ("clip", dict(clip_low=0.0, clip_high=5.0)), ("is", {}),
         ("cispo", dict(eps_max=5.0)), ("cispo", dict(eps_max=0.9)),
         ("topr", dict(seq_ratio="product")), ("topr", dict(seq_ratio="geometric")),
         ("oapl", dict(beta2=1e-3)), ("oapl", dict(beta2=0.5)),
         ("dppo-tv", dict(tv_delta=0.15)), ("dppo-tv", dict(tv_delta=0.01)),
         ("vespo", dict(k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0)),
         ("gspo", dict(clip_low=1 - 3e-4, clip_high=1 + 4e-4)), ("gspo", dict(clip_low=0.5, clip_high=1.3))]
AGG = {"topr": "seq-mean-token-mean", "oapl": "seq-mean-token-mean", "gspo": "seq-mean-token-mean"}   # their rows'


def ours(name, settings, advantages, agg=None):
    """loss.policy_loss of the objective alone (no mask) on the example: (loss, d loss / d log π [2, 3], metrics)."""
    b = torch.tensor(BEHAVIOR)
    lp = (b + torch.log(torch.tensor(RATIOS))).requires_grad_(True)
    spec = L.Loss(name, settings, agg=agg or AGG.get(name, "token-mean"))
    value, stats = L.policy_loss(lp, b, torch.tensor(advantages), torch.tensor(MASK), spec)
    value.backward()
    return value.item(), lp.grad * torch.tensor(MASK), L.metrics(stats)


def theirs(name, settings, advantages):
    b = torch.tensor(BEHAVIOR, dtype=torch.float64)
    lp = (b + torch.log(torch.tensor(RATIOS, dtype=torch.float64))).requires_grad_(True)
    value = reference(name, lp, b, torch.tensor(advantages, dtype=torch.float64), torch.tensor(MASK), **settings)
    value.backward()
    return value.item(), lp.grad * torch.tensor(MASK)


@pytest.mark.parametrize("advantages", SIGNS)
@pytest.mark.parametrize("name,settings", CASES)
def test_each_objective_is_its_sources_formula_in_value_and_gradient(name, settings, advantages):
    # float32 against float64 on numbers of order 1–10: 1e-5 relative is float32's rounding of a few terms; a wrong
    # sign, a lost stop-gradient (its gradient gains ρ·A·log π terms), a token ratio for a sequence ratio or a bound
    # on the wrong side moves a value or a gradient entry by more than 1e-2
    value, grad, _ = ours(name, settings, advantages)
    want, want_grad = theirs(name, settings, advantages)
    assert value == pytest.approx(want, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-6)


def test_the_examples_reach_every_branch():
    # where a bound binds, the reference's gradient has zeros the unbounded objective has not (the case can fail)
    _, clipped = theirs("clip", dict(clip_low=0.8, clip_high=1.2), [1.5, -0.5])
    assert clipped[0, 0] == 0 and clipped[1, 0] == 0 and clipped[0, 1] != 0      # 6.0 above 1.2 (A>0), 0.2 below 0.8
    _, cispo = theirs("cispo", dict(eps_max=5.0), [1.5, -0.5])
    assert cispo[0, 0].item() == pytest.approx(-5 * 1.5 / 5)        # the weight truncated at 5, not 6; 5 tokens
    _, topr = theirs("topr", dict(seq_ratio="product"), [1.5, -0.5])
    assert topr[1].tolist()[:2] == pytest.approx([0.52 * 0.5 / 2 / 2] * 2)   # −(0.52)(−0.5)/2 tokens/2 responses
    assert topr[0].tolist() == pytest.approx([-1.5 / 3 / 2] * 3)             # A ≥ 0: SFT, no weight
    _, dppo = theirs("dppo-tv", dict(tv_delta=0.15), [1.5, -0.5])
    assert dppo[0, 0] == 0 and dppo[1, 0] == 0 and dppo[0, 2] != 0           # moved with A beyond 0.15 / against A
    _, gspo = theirs("gspo", dict(clip_low=0.5, clip_high=1.3), [1.5, -0.5])
    assert (gspo[0] == 0).all() and (gspo[1, :2] != 0).all()                 # 1.442 clipped (A>0); 0.721 inside


@pytest.mark.parametrize("name", ["topr", "vespo", "gspo", "oapl"])
def test_a_sequence_objective_reads_the_sequence_ratio_not_each_tokens(name):
    # each token of a response gets the same weight (the whole response's ratio) times its own ∂ log π: the gradient
    # of response 0 (A > 0 or A < 0) is the same at every token for these objectives (3 equal entries)
    settings = dict(CASES)[name] if name != "oapl" else dict(beta2=0.5)
    for advantages in SIGNS:
        _, grad, _ = ours(name, settings, advantages)
        assert torch.allclose(grad[0], grad[0, :1].expand(3), rtol=1e-5, atol=1e-7), (name, advantages, grad[0])


def test_the_diagnostics_are_the_same_for_every_objective_and_count_the_zero_gradients_per_sign():
    # GRPO's clip on the example with A = [+1.5, −0.5]: the zero-gradient tokens are 6.0 of response 0 (A>0, above
    # 1.2) and 0.2 of response 1 (A<0, below 0.8): 1 of 3 positive tokens, 1 of 2 negative ones
    _, _, m = ours("clip", dict(clip_low=0.8, clip_high=1.2), [1.5, -0.5])
    assert m["grad/zero_frac_pos"] == pytest.approx(1 / 3) and m["grad/zero_frac_neg"] == pytest.approx(1 / 2)
    # CISPO keeps every gradient
    _, _, c = ours("cispo", dict(eps_max=5.0), [1.5, -0.5])
    assert c["grad/zero_frac_pos"] == 0 and c["grad/zero_frac_neg"] == 0 and c["cispo/truncated_frac"] == 1 / 5
    # the same names for every objective, and each family's own besides
    common = set(m) - set(L.FAMILY_METRICS)
    for name, settings in CASES:
        metrics = ours(name, settings, [1.5, -0.5])[2]
        assert common <= set(metrics), name
    # the sequence weights' ESS, Kish's (Σ w)² / (N Σ w²) over w = 3 and 0.52: 12.39 / (2 · 9.27)
    assert m["ratio/seq_ess_frac"] == pytest.approx((3 + 0.52) ** 2 / (2 * (9 + 0.52 ** 2)), rel=1e-5)
    # quantiles to their bin (a factor 1.37 in |log ρ|): the positive tokens' ratios are 6, 1, 0.5 → p50 is 1, p99 6
    assert m["ratio/p50_pos"] == 1.0
    assert math.log(6) / 1.37 <= math.log(m["ratio/p99_pos"]) <= math.log(6) * 1.37
    assert math.log(0.5) * 1.37 <= math.log(m["ratio/p01_pos"]) <= math.log(0.5) / 1.37
    # the sequence log-ratio of the one negative response, log 0.52 = −0.654 (a factor 1.6 to its bin)
    assert -0.654 * 1.6 <= m["seq_log_ratio/p50_neg"] <= -0.654 / 1.6


def test_the_advantages_the_trainer_computes_by_hand():
    # TOPR's ±1: 2r − 1; OAPL's soft value over the group: V = β log mean exp(r/β); rewards (1, 0), β = 1:
    # V = log((e + 1)/2) = 0.6201, Â = (0.3799, −0.6201); all-equal rewards: Â = 0 (V = r)
    assert L.response_advantages([[1.0, 0.0, 1.0, 1.0]], "signed-reward").tolist() == [[1.0, -1.0, 1.0, 1.0]]
    v = math.log((math.e + 1) / 2)
    assert L.response_advantages([[1.0, 0.0]], "soft-value").tolist()[0] == pytest.approx([1 - v, -v], rel=1e-6)
    assert L.response_advantages([[1.0, 1.0], [0.0, 0.0]], "soft-value").tolist() == [[0.0, 0.0], [0.0, 0.0]]
    # a small β tends to the group's best reward: V → max r
    assert L.response_advantages([[1.0, 0.0]], "soft-value", 0.01).tolist()[0] == pytest.approx([0.0, -1.0], abs=1e-2)


def test_a_bad_setting_is_named_with_what_is_allowed():
    with pytest.raises(ValueError, match="objective cispo has no setting clip_high; its settings: eps_max=5.0"):
        L.preset("cispo", clip_high=1.2)
    with pytest.raises(ValueError, match="objective must be one of clip, is, cispo"):
        L.Loss("ppo")
    with pytest.raises(ValueError, match="seq_ratio must be product or geometric"):
        L.preset("topr", seq_ratio="mean")
    with pytest.raises(ValueError, match="eps_max must be a number, got 'x'"):
        L.preset("cispo", eps_max="x")
    with pytest.raises(ValueError, match="LOSS must be one of mu-grpo grpo"):
        L.preset("ppo")
    assert L.parse_settings("eps_max=4, seq_ratio=geometric,x=none") == {"eps_max": 4.0, "seq_ratio": "geometric",
                                                                          "x": None}


# ------------------------------------------------------------------ the presets' table and the lists that name them


def test_the_existing_presets_are_what_they_were():
    # the rows that replaced losses.sh: optimize.py's old block (clip [0, 5], NAV δ 1e-4 scope H) and each preset's
    # old flags over it; m2po's clip_high=1e9 was the unclipped surrogate it now names
    mu = dict(clip_low=0.0, clip_high=5.0)
    old = {"mu-grpo": ("clip", mu, 1e-4, "H"), "grpo": ("clip", dict(clip_low=0.8, clip_high=1.2), None, "H"),
           "dapo": ("clip", dict(clip_low=0.8, clip_high=1.28), None, "H"), "m2po": ("is", {}, None, "H"),
           "relaxed-no-nav": ("clip", mu, None, "H"), "relaxed-low": ("clip", {**mu, "clip_high": 1.2}, 1e-4, "H"),
           "relaxed-high": ("clip", {**mu, "clip_low": 0.8}, 1e-4, "H"),
           **{f"nav-{s}": ("clip", mu, 1e-4, s) for s in ("none", "T", "S", "seq")},
           "offpolicy-grpo": ("clip", dict(clip_low=0.8, clip_high=1.2), None, "H")}
    for name, (objective, settings, delta, scope) in old.items():
        loss = L.preset(name)
        assert (loss.objective, loss.settings, loss.nav_delta, loss.nav_scope) == (objective, settings, delta, scope)
        assert (loss.agg, loss.token_normalizer, loss.advantage) == ("token-mean", "kept", "group"), name
        assert loss.m2po_tau == (0.04 if name == "m2po" else None) and loss.tis_cap is None
        assert (loss.kl_coef, loss.kl_estimator) == ((0.04, "k3") if name == "offpolicy-grpo" else (0.0, "k3"))


def test_every_row_names_an_objective_its_settings_and_a_source():
    for name, row in L.PRESETS.items():
        loss = L.preset(name)                       # valid as it stands
        assert row.objective in L.OBJECTIVES and len(row.source) > 20, name
        assert loss.describe().startswith(row.objective), name


def test_optimize_pys_loss_block_is_neutral():
    # a None knob takes its row's value: no preset inherits another's (NAV on unless switched off, before); every
    # setting of a Loss is a knob there but soft_value_beta, given as --objective_args=soft_value_beta=... (with the
    # objectives' own settings)
    from mu_grpo import common
    block = common.script_defaults(ROOT / "optimize.py")
    knobs = set(L.LOSS_FIELDS + L.CLIP_SETTINGS) - {"norm_len", "soft_value_beta"}
    assert {k: block[k] for k in knobs} == dict.fromkeys(knobs)
    assert L.resolve_loss("oapl", block, (), "soft_value_beta=0.5,beta2=0.1").soft_value_beta == 0.5
    assert block["loss"] == "mu-grpo" and block["objective_args"] == ""


def test_every_list_that_names_presets_is_the_tables():
    from mu_grpo import launch
    assert launch.preset_names() == list(L.PRESETS)            # read without torch, for a login node
    # ablate.sh's VARIANTS=all: the same names, in order, from the command it runs
    named = subprocess.run([sys.executable, "-m", "mu_grpo.launch", "--command=presets"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    assert named == list(L.PRESETS) and "mu-grpo" in named
    readme = (ROOT / "README.md").read_text()
    assert re.findall(r"^\| `([a-z][A-Za-z0-9-]*)`(?: \(default\))? \| ([a-z-]+) \|", readme, re.M) == \
        [(name, row.objective) for name, row in L.PRESETS.items()]
    lists = [re.search(r'VARIANTS=\$\{VARIANTS:-([^}]*)\}', (ROOT / "ablate.sh").read_text())[1],
             re.search(r'LOSSES=\$\{LOSSES:-([^}]*)\}', (ROOT / "frontier.sh").read_text())[1]]
    sys.path.insert(0, str(ROOT / "tools"))
    import plot
    import table1
    named = {*" ".join(lists).split(), *plot.CLIP_VARIANTS, *plot.SCOPE_VARIANTS, *plot.AGAINST, *table1.NAMES}
    assert named - {"onpolicy-grpo"} <= set(L.PRESETS), named - set(L.PRESETS)


@pytest.mark.parametrize("name", list(L.PRESETS))
def test_NAV_DELTA_reaches_a_preset_with_NAV_and_no_other(name):
    from mu_grpo import launch
    has_nav = L.preset(name).nav_delta is not None
    assert launch.loss_flags(name, "0.1") == f"--loss={name}" + (" --nav_delta=0.1" if has_nav else "")
    assert launch.loss_flags(name) == f"--loss={name}"


def test_a_flags_none_turns_a_mask_off_names_no_scope_and_is_refused_where_a_setting_has_no_none():
    # the flag parser reads --x=none as None: for nav_scope that is the scope "none" (before: refused
    # with "got None"); for a setting without a none (kl_coef, a clip bound, agg) one line, not a
    # traceback
    assert L.resolve_loss("mu-grpo", {"nav_scope": None}, {"nav_scope"}).nav_scope == "none"
    assert L.resolve_loss("mu-grpo", {"nav_delta": None}, {"nav_delta"}).nav_delta is None
    # (the objective's)
    for name, default in (("kl_coef", "0.0"), ("clip_low", "0.8"), ("agg", "'token-mean'")):
        with pytest.raises(ValueError, match=f"{name} cannot be none \\(its default: {default}\\)"):
            L.resolve_loss("mu-grpo", {name: None}, {name})


def test_the_runs_kl_coef_is_its_losss_so_kl_gets_its_reference_from_loss_args_too():
    # run_stages.sh points KL's reference at the run's MODEL when KL_COEF > 0; a β given in
    # LOSS_ARGS counts (before: KL_COEF stayed 0 and π_ref was the stage policy, silently)
    from mu_grpo import launch
    from test_launch import TOY
    assert launch.resolve({**TOY, "LOSS_ARGS": "--kl_coef=0.1"})[0]["KL_COEF"] == "0.1"
    assert launch.resolve({**TOY, "LOSS": "offpolicy-grpo"})[0]["KL_COEF"] == "0.04"
    assert launch.resolve(TOY)[0]["KL_COEF"] == "0.0"
