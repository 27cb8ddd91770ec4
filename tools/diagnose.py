"""Why a veto scope helps or not, on an ablate.sh run's saved checkpoints: for the negative-advantage responses of
the shared stale rollouts, where NAV's κ (the first token with ρ < δ) falls relative to the response's first
wrong token, the ratio ρ at that token, and the within-group net push before, at and after it.

    python tools/diagnose.py --ablation_dir=runs/lab-fork-ablation --variants=relaxed-no-nav,mu-grpo --updates=0,64,256

The first wrong token of a response is where its text leaves the task's correct solution (the lab's worked
solution without slips, boxed: the same for both lab tasks). The net push on a token is Σ_j A_j·ρ_j over the
responses j of its group that share the prompt, the prefix and the token (the relaxed surrogate's gradient
weight on its log-probability, before the minibatch normalizer): identical (context, token) pairs of group-mates
push together, so a prefix the whole group shares gets Σ A = 0 at ρ = 1. Negative: pushed down.

Writes <ablation_dir>/plots/diagnostics.json and .md; prints the table.
"""
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "data")]          # mu_grpo and loss.py; data/: the lab task's builder
import loss as L  # noqa: E402
from mu_grpo import common  # noqa: E402
from mu_grpo import records  # noqa: E402
import lab  # noqa: E402  (the worked solutions)

# ----------------------------------------------------------------------------- hyperparameters
ablation_dir = "runs/lab-fork-ablation"   # an ablate.sh output directory (stage_0/rollouts, <variant>/seed<k>/policy*)
variants = "relaxed-no-nav,mu-grpo"      # comma list of its variants
seeds = "0"                               # comma list
updates = "0,64,128,256"                  # checkpoints (0: the initial policy, the rollouts' own)
nav_delta = None                          # δ of the κ this reports; None: each variant's own, read from its replays'
                                          # optimize_config.json (a variant without NAV: the δ of the NAV variants)
groups = 128                              # groups analysed (those with a negative response; the first ones)
out = ""                                  # default <ablation_dir>/plots/diagnostics
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])


def first_wrong_token(tokenizer, response_ids, problem):
    """Index of the first response token whose text leaves the correct worked solution; None when the response
    never leaves it (a prefix of it: cut off by the length limit)."""
    correct = lab.demonstration({"problem": problem}, random.Random(0), p_slip=0.0, p_no_box=0.0)
    for t in range(len(response_ids)):
        if not correct.startswith(tokenizer.decode(response_ids[:t + 1], skip_special_tokens=True)):
            return t
    return None


def checkpoint_logprobs(path, rows):
    """Log-probs of every response's tokens under the checkpoint at `path` (fp32, temperature 1)."""
    from transformers import AutoModelForCausalLM  # transformers: only for a checkpoint's log-probs
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for r in rows:
            p, resp = r["prompt_token_ids"], r["response_token_ids"]
            logits = model(torch.tensor([p + resp])).logits[0, len(p) - 1:len(p) + len(resp) - 1]
            out.append(L.token_logprobs(logits, torch.tensor(resp), 1.0).numpy())
    return out


def first_trigger(ratio, advantage, delta):
    """κ, NAV's first trigger token of one response (loss.nav_triggers, the trainer's own test), or None."""
    trig, _ = L.nav_triggers(torch.as_tensor(ratio)[None], torch.tensor([advantage]),
                             torch.ones(1, len(ratio), dtype=torch.bool), delta)
    hits = trig[0].nonzero()
    return int(hits[0]) if len(hits) else None


def diagnose(rows, logprobs, tokenizer, delta):
    """The statistics of one checkpoint over the negative responses of `rows` (whole groups), κ at NAV's δ."""
    by_group = {}
    for i, r in enumerate(rows):
        by_group.setdefault(r["group"], []).append(i)
    kappa = {"before": 0, "at": 0, "after": 0, "none": 0}
    ratios_at, push = [], {"before": [], "at": [], "after": []}
    for members in by_group.values():
        ratio = {i: np.exp(np.clip(logprobs[i] - np.asarray(rows[i]["behavior_logprobs"]), -L.LOG_RATIO_LIMIT,
                                   L.LOG_RATIO_LIMIT)) for i in members}
        for i in members:
            r = rows[i]
            if r["advantage"] >= 0:
                continue
            f = first_wrong_token(tokenizer, r["response_token_ids"], r["prompt"])
            if f is None:
                continue
            ratios_at.append(ratio[i][f])
            k = first_trigger(ratio[i], r["advantage"], delta)
            kappa["none" if k is None else "before" if k < f else "at" if k == f else "after"] += 1
            ids = r["response_token_ids"]
            for t in range(len(ids)):
                sharing = [j for j in members if rows[j]["response_token_ids"][:t + 1] == ids[:t + 1]]
                net = sum(rows[j]["advantage"] * ratio[j][t] for j in sharing)
                push["before" if t < f else "at" if t == f else "after"].append(net)
    n = sum(kappa.values())
    q = np.quantile(ratios_at, [0.1, 0.5, 0.9]) if ratios_at else [float("nan")] * 3
    return {"negative_responses": n, **{f"kappa_{k}": v / max(n, 1) for k, v in kappa.items()},
            "ratio_at_first_wrong_p10": float(q[0]), "ratio_at_first_wrong_p50": float(q[1]),
            "ratio_at_first_wrong_p90": float(q[2]),
            **{f"push_{k}": float(np.mean(v)) if v else float("nan") for k, v in push.items()}}


def checkpoint_path(root, variant, seed, u, model):
    if u == 0:
        return model
    d = root / variant / f"seed{seed}"
    candidates = [d / f"{records.POLICY}_u{u:05d}", d / records.POLICY]
    for c in candidates:
        meta = c / common.POLICY_ID_FILE
        if meta.exists() and json.loads(meta.read_text()).get("stage_updates") == u:
            return c
    return None


def replay_delta(root, variant, seed):
    """The NAV δ a replay trained with (its optimize_config.json), None when it ran without NAV."""
    config = root / variant / f"seed{seed}" / records.OPTIMIZE_CONFIG
    if not config.exists():
        raise SystemExit(f"{config} is missing: not an ablate.sh replay (pass --nav_delta to diagnose it anyway)")
    settings = json.loads(config.read_text())
    loss = settings.get("resolved", {}).get("loss")   # the Loss it trained with (older replays: their block's value)
    return loss["nav_delta"] if loss else settings["hyperparameters"]["nav_delta"]


def deltas(root, variant_seeds):
    """δ per (variant, seed): --nav_delta when given, else the replay's own, and for a replay without NAV the one δ
    of the ablation's NAV replays (ablate.sh gives every NAV variant the same NAV_DELTA)."""
    if nav_delta is not None:
        return {vs: nav_delta for vs in variant_seeds}
    own = {vs: replay_delta(root, *vs) for vs in variant_seeds}
    used = {d for d in own.values() if d is not None}
    if len(used) > 1:
        raise SystemExit(f"the replays used several NAV δ {sorted(used)}: pass --nav_delta to pick one")
    if None in own.values() and not used:
        raise SystemExit("no replay listed ran with NAV, so there is no δ to report κ at: pass --nav_delta "
                         "(or list a NAV variant, e.g. --variants=relaxed-no-nav,mu-grpo)")
    return {vs: d if d is not None else next(iter(used)) for vs, d in own.items()}


def main():
    from transformers import AutoTokenizer  # transformers: only for the tokenizer
    root = Path(ablation_dir)
    stage_rollouts = records.stage_dir(root, 0) / records.ROLLOUTS
    manifest = json.loads((stage_rollouts / records.MANIFEST).read_text())
    model = manifest["policy"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    all_rows = [r for name in manifest["shards"] for r in common.read_jsonl(stage_rollouts / name)]
    negative_groups = sorted({r["group"] for r in all_rows if r["advantage"] < 0})[:groups]
    rows = [r for r in all_rows if r["group"] in set(negative_groups)]
    table = []
    variant_seeds = [(v, int(s)) for v in variants.split(",") if v for s in seeds.split(",") if s]
    delta = deltas(root, variant_seeds)
    for variant, seed in variant_seeds:
        for u in [int(x) for x in updates.split(",") if x]:
            path = checkpoint_path(root, variant, seed, u, model)
            if path is None:
                print(f"{variant} seed {seed}: no checkpoint at update {u}; skipped")
                continue
            stats = diagnose(rows, checkpoint_logprobs(path, rows), tokenizer, delta[variant, seed])
            table.append({"variant": variant, "seed": seed, "updates": u, "nav_delta": delta[variant, seed], **stats})
            print(json.dumps(table[-1]), flush=True)
    target = Path(out) if out else root / "plots" / "diagnostics"
    target.parent.mkdir(parents=True, exist_ok=True)
    common.atomic_write_json(target.with_suffix(".json"), table)
    lines = [f"negative responses of {len(negative_groups)} groups; κ at the replay's NAV δ; push: Σ_j A_j·ρ_j over "
             "the group-mates sharing the token and its prefix", "",
             "| variant | seed | updates | δ | κ before / at / after / none | ρ at first wrong p10 / p50 / p90 | "
             "net push before / at / after |", "|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['variant']} | {r['seed']} | {r['updates']} | {r['nav_delta']:g} | "
                     f"{r['kappa_before']:.2f} / {r['kappa_at']:.2f} / "
                     f"{r['kappa_after']:.2f} / {r['kappa_none']:.2f} | {r['ratio_at_first_wrong_p10']:.3g} / "
                     f"{r['ratio_at_first_wrong_p50']:.3g} / {r['ratio_at_first_wrong_p90']:.3g} | "
                     f"{r['push_before']:+.3f} / {r['push_at']:+.3f} / {r['push_after']:+.3f} |")
    target.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
