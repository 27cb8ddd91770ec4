"""docs/bakeoff.md §5's statistics, as declared: the t quantile and interval, the build count a
difference would need, the verdict tables of C1–C3 and C4, a secondary set's Holm-corrected tests,
and the AUC of a signal. Pure functions of numbers (tools/bakeoff.py reads the runs)."""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plot  # noqa: E402  (the t test's p, Holm)

MARGIN = 0.05               # m (§1; tools/regimes.py match_margin)
FAMILY_ALPHA = 0.05         # C1–C4's family: Bonferroni over 4 (§5); the secondaries' Holm level


def t_quantile(alpha, df):
    """t with P(|T| ≥ t) = alpha for Student's t with df degrees of freedom (bisection on
    plot.t_two_sided_p, to 1e-9)."""
    low, high = 0.0, 1e4
    while high - low > 1e-9:
        mid = (low + high) / 2
        low, high = (mid, high) if plot.t_two_sided_p(mid, df) > alpha else (low, mid)
    return (low + high) / 2

def interval(diffs, alpha):
    """(mean, sd, low, high) of diffs' mean: the two-sided t interval at 1 − alpha, df = n − 1."""
    n, mean = len(diffs), sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = t_quantile(alpha, n - 1) * sd / math.sqrt(n)
    return mean, sd, mean - half, mean + half

def builds_needed(sd, alpha=FAMILY_ALPHA / 4, margin=MARGIN):
    """The smallest n with t_{1 − alpha/2, n − 1} · sd / √n ≤ margin / 2 (§5)."""
    n = 2
    while t_quantile(alpha, n - 1) * sd / math.sqrt(n) > margin / 2:
        n += 1
    return n

def verdict_against(low, high, sd, m=MARGIN):
    """C1–C3's verdict of D = μ-GRPO − X's interval: the first row of §5's table that holds."""
    if high < 0:
        return "X better"
    if low >= m:
        return "needed"
    if 0 < low and high < m:
        return "μ-GRPO better, by less than m"
    if 0 < low < m <= high:
        return "μ-GRPO better, size not determined"
    if -m < low <= 0 and high < m:
        return "not needed (X within m)"
    return f"not determined ({builds_needed(sd)} builds would resolve it)"

def verdict_matches(low, high, m=MARGIN):
    """C4's verdict of D = μ-GRPO − GRPO μ = 4's interval (§5)."""
    if low > -m and high < 0:
        return "matches, a deficit under m"
    return "matches" if low > -m else "a deficit" if high < 0 else "not determined"

def verdict_sign(verdict):
    """The direction a §5 verdict states for D = μ-GRPO − X: +1, −1, or None (amendment 2)."""
    if verdict.startswith(("needed", "μ-GRPO better")):
        return 1
    return -1 if verdict in ("X better", "a deficit", "matches, a deficit under m") else None

def secondary(pairs):
    """[(name, mean, 95 % low, high, p, Holm p, shown)] of {name: per-build differences}: a
    two-sided t test each, Holm over the set."""
    tests = {name: plot.paired_test(d) for name, d in pairs.items()}
    adjusted = plot.holm([t[3] for t in tests.values()])
    return [(name, *t, q, q <= FAMILY_ALPHA) for (name, t), q in zip(tests.items(), adjusted)]

def auc(scores_pos, scores_neg):
    """P(a positive's score > a negative's), ties one half (Mann–Whitney); NaN without a pair."""
    pairs = len(scores_pos) * len(scores_neg)
    wins = sum((p > q) + 0.5 * (p == q) for p in scores_pos for q in scores_neg)
    return wins / pairs if pairs else math.nan
