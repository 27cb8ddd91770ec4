"""Audit a lab run's stages independently of the code that wrote them, and describe each stage's rollouts.

    python bench/stage_audit.py --run_dir=runs/trace/b2/s0/mu-grpo
    python bench/stage_audit.py --run_dir="μ-GRPO=runs/a,GRPO=runs/b" --probe_problems=0 --plot=docs/x.png

For every stage_<s>/rollouts of a run on a lab task (data/lab.py, data/lab_fork.py) it checks, with plain json,
HF transformers and Python arithmetic rather than rollouts.py, generate.py or reward.py:
  - the prompt–answer pairing: the gold answer is the value of the prompt's chain ("Compute 7 + 8 - 5 ...");
  - the rewards: 1 when the response's last \\boxed{N} equals that value, else 0;
  - the advantages: (r − mean_group) / (std_group + 1e-6) over the responses of one prompt_id (the sample
    std, n − 1, as TRL's and verl's GRPO);
  - the behaviour log-probs: the stage policy (the manifest's `policy`, loaded by transformers in float32) scores
    the first `max_responses` responses at the manifest's temperature (the lab samples with top_p 1, so the
    temperature is the whole processing); mean and max |recomputed − stored| per token;
  - the policy and the optimizer across the boundary: the policy's policy_id.json run_updates against the previous
    stage's last metrics line, and this stage's first line continuing AdamW's count (optimizer_update) at its lr.
and describes the stage: mean reward, share of groups with reward variance, response length and truncation, the
share of responses taking lab-fork's detour (" Check"), the first response token's distribution, the grader's
reasons. Prints one table per run; writes <run_dir>/stage_audit.json, and with --plot a figure of every run's
rollouts per stage (correct, wrong on the solution's path, detour).

It also probes each policy of the run (the initial one, then every stage's saved policy) on `probe_problems`
held-out problems, teacher-forced on their worked texts without slips: the probability of taking the solution at
the fork (lab-fork: the first response token of the boxed solution against the detour's " Check"), and the mean
per-step probability of the correct result of a step line ("Step k: a + d = r": the tokens of r) in the solution's
context and in the detour's (lab-fork's restate detour repeats the solution's step lines).
"""
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

# ----------------------------------------------------------------------------- hyperparameters
run_dir = "runs/trace/b2/s0/mu-grpo"    # a run_stages.sh run directory on a lab task; several: a comma list, each
                                        # optionally named (name=dir) for the figure
plot = ""                               # a PNG: the rollouts' composition per stage, one panel per run
window = 64                             # run updates per row of the training table (a long stage: several rows)
max_responses = 512                     # responses per stage whose behaviour log-probs are recomputed (0: none)
probe_problems = 200                    # held-out problems the policies are probed on (0: no probe)
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])

PROBLEM = re.compile(r"Compute (\d+(?: [+-] \d+)+) step by step")
BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")


def chain_value(prompt):
    """The value of a lab prompt's chain, by plain arithmetic."""
    tokens = PROBLEM.search(prompt).group(1).split()
    value = int(tokens[0])
    for sign, operand in zip(tokens[1::2], tokens[2::2]):
        value = value + int(operand) if sign == "+" else value - int(operand)
    return value


def read_rows(rollouts_dir):
    rows = []
    for shard in sorted(rollouts_dir.glob("shard_*.jsonl")):
        with open(shard) as f:
            rows += [json.loads(line) for line in f]
    return rows


@torch.no_grad()
def recompute_logprobs(policy, rows, temperature):
    """Per response: the policy's log-probs of its sampled tokens at `temperature` (transformers, float32)."""
    from transformers import AutoModelForCausalLM  # transformers: only for the recomputed log-probs
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    out = []
    for r in rows:
        ids = torch.tensor([r["prompt_token_ids"] + r["response_token_ids"]])
        logits = model(ids).logits[0, len(r["prompt_token_ids"]) - 1:-1].float() / temperature
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r["response_token_ids"])[:, None])[:, 0]
        out.append(lp)
    return out


def worked_texts(problem):
    """(solution, detour): lab-fork's boxed solution and its restate detour for a problem, without slips."""
    tokens = PROBLEM.search(problem).group(1).split()
    value, lines = int(tokens[0]), []
    for sign, operand in zip(tokens[1::2], tokens[2::2]):
        result = value + int(operand) if sign == "+" else value - int(operand)
        lines.append(f"Step {len(lines) + 1}: {value} {sign} {operand} = {result}")
        value = result
    solution = " " + "\n".join(lines + [f"\\boxed{{{value}}}"])
    detour = " " + "\n".join([f"Check: {PROBLEM.search(problem).group(1)} has {len(lines)} steps."] + lines
                              + [f"Answer: {value}"])
    return solution, detour


def result_positions(offsets, text):
    """The token positions (of a text tokenized with these character offsets) that spell each step line's result."""
    return [[i for i, (a, b) in enumerate(offsets) if a < m.end(1) and b > m.start(1)]
            for m in re.finditer(r"= (\d+)", text)]


@torch.no_grad()
def probe_policy(policy, problems):
    """{fork_solution, step_correct_solution, step_correct_detour}: means over the problems (see the docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers: only for the probe
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    fork, steps = [], {"solution": [], "detour": []}
    for problem in problems:
        prompt = [tokenizer.bos_token_id] + tokenizer.encode(problem, add_special_tokens=False)
        for kind, text in zip(("solution", "detour"), worked_texts(problem)):
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = torch.tensor([prompt + enc["input_ids"]])
            logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
            token_lp = logp.gather(-1, torch.tensor(enc["input_ids"])[:, None])[:, 0]
            if kind == "solution":
                fork.append(token_lp[0].exp().item())
            for inside in result_positions(enc["offset_mapping"], text):
                steps[kind].append(token_lp[inside].sum().exp().item())
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    return {"fork_solution": mean(fork), "step_correct_solution": mean(steps["solution"]),
            "step_correct_detour": mean(steps["detour"])}


def audit_stage(stage_dir, previous_metrics, metrics):
    rollouts_dir = stage_dir / "rollouts"
    manifest = json.loads((rollouts_dir / "manifest.json").read_text())
    rows = read_rows(rollouts_dir)
    gold_ok = sum(str(chain_value(r["prompt"])) == str(r["answer"]) for r in rows)
    regraded = [float(bool((m := BOXED.findall(r["response"])) and int(m[-1]) == chain_value(r["prompt"])))
                for r in rows]
    differing = [(a, r) for a, r in zip(regraded, rows) if a != r["reward"]]
    groups = {}
    for r in rows:                         # the advantages from the stored rewards (the regrade is checked above)
        groups.setdefault((r["prompt_id"], r["group"]), []).append((r, r["reward"]))
    adv_err, varied = 0.0, 0
    for members in groups.values():
        rewards = torch.tensor([reward for _, reward in members])
        mean, std = rewards.mean(), rewards.std(unbiased=True)
        varied += bool(std > 0)
        for (r, reward) in members:
            adv_err = max(adv_err, abs((reward - mean.item()) / (std.item() + 1e-6) - r["advantage"]))
    policy = manifest["policy"]
    record = json.loads((Path(policy) / "policy_id.json").read_text()) if (Path(policy) / "policy_id.json").exists() \
        else {"run_updates": 0}
    lp_mean = lp_max = math.nan
    if max_responses:
        sample = rows[:max_responses]
        recomputed = recompute_logprobs(policy, sample, manifest["plan"]["temperature"])
        diffs = torch.cat([(lp - torch.tensor(r["behavior_logprobs"])).abs() for lp, r in zip(recomputed, sample)])
        lp_mean, lp_max = diffs.mean().item(), diffs.max().item()
    first = Counter(r["response"][:6] for r in rows)
    n = len(rows)
    return {
        "stage": manifest["stage"], "policy": policy, "policy_run_updates": record.get("run_updates", 0),
        "trained_run_updates_before": previous_metrics[-1]["run_update"] + 1 if previous_metrics else 0,
        "adamw_continues": (metrics[0]["optimizer_update"] == (previous_metrics[-1]["optimizer_update"] + 1
                                                                if previous_metrics else 0)) if metrics else None,
        "lr": metrics[0]["lr"] if metrics else None,
        "responses": n, "gold_pairing_ok": gold_ok / n, "rewards_differing": len(differing),
        "rewards_differing_examples": [(r["response"][-40:], r["answer"], r["reward"], a) for a, r in differing[:3]],
        "advantage_max_error": adv_err, "behavior_lp_mean_abs_diff": lp_mean, "behavior_lp_max_abs_diff": lp_max,
        "mean_reward": sum(regraded) / n, "groups_with_variance": varied / len(groups),
        "mean_response_tokens": sum(len(r["response_token_ids"]) for r in rows) / n,
        "truncated": sum(r["finish_reason"] == "length" for r in rows) / n,
        "detour": sum(r["response"].startswith(" Check") for r in rows) / n,
        "first_chars": dict(first.most_common(4)),
        "grader_reasons": dict(Counter(r["reward_info"]["reason"] for r in rows)),
    }


TRAINING = ("grpo_clip/lower_frac", "grpo_clip/upper_frac", "nav/vetoed_frac", "ratio/kl", "ratio/mean_neg_adv",
            "entropy", "reward/mean")


def training_windows(rows):
    """The metrics lines' means over each `window` run updates: where A<0 tokens fell below GRPO's clip (ρ < 0.8) and
    A>0 ones rose above it, the vetoed share, KL(behaviour ‖ π), E[ρ | A<0], the entropy, the minibatches' reward."""
    out = []
    for start in range(0, len(rows), window):
        chunk = rows[start:start + window]
        mean = lambda k: (sum(v) / len(v)) if (v := [r[k] for r in chunk if r.get(k) is not None]) else None  # noqa: E731
        out.append({"updates": f"{chunk[0]['run_update']}–{chunk[-1]['run_update']}", **{k: mean(k) for k in TRAINING}})
    return out


def audit_run(run):
    """Every stage's audit, printed as a table, and the probes of the run's policies; written to
    <run>/stage_audit.json and returned."""
    stages = sorted((int(p.name.split("_")[1]), p) for p in run.glob("stage_*") if (p / "rollouts" / "manifest.json").exists())
    if not stages:
        sys.exit(f"{run}: no stage_<s>/rollouts/manifest.json (not a run directory, or nothing generated yet)")
    out, previous = [], []
    for _, stage_dir in stages:
        path = stage_dir / "metrics.jsonl"
        metrics = [json.loads(line) for line in open(path)] if path.exists() else []
        out.append(audit_stage(stage_dir, previous, metrics))
        previous = metrics
    keys = ["stage", "policy_run_updates", "trained_run_updates_before", "adamw_continues", "lr", "gold_pairing_ok",
            "rewards_differing", "advantage_max_error", "behavior_lp_mean_abs_diff", "behavior_lp_max_abs_diff",
            "mean_reward", "groups_with_variance", "mean_response_tokens", "truncated", "detour"]
    print(f"{run}\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in out:
        print("| " + " | ".join(f"{row[k]:.4g}" if isinstance(row[k], float) else str(row[k]) for k in keys) + " |")
    for row in out:
        print(f"stage {row['stage']}: first characters {row['first_chars']}; grader {row['grader_reasons']}")
    probes = []
    if probe_problems:
        first = json.loads((stages[0][1] / "rollouts" / "manifest.json").read_text())
        data_dir = Path(first["plan"]["data"]).parent
        problems = [json.loads(line)["problem"] for line in open(data_dir / "heldout.jsonl")][::7][:probe_problems]
        policies = [(0, first["policy"])] + [(json.loads((d / "policy" / "policy_id.json").read_text())["run_updates"],
                                              str(d / "policy")) for _, d in stages if (d / "policy" / "config.json").exists()]
        print("| run updates | P(solution at the fork) | P(correct step result), solution | ..., detour |\n|---|---|---|---|")
        for updates, policy in policies:
            probes.append({"run_updates": updates, "policy": policy, **probe_policy(policy, problems)})
            p = probes[-1]
            print(f"| {updates} | {p['fork_solution']:.3f} | {p['step_correct_solution']:.3f} | {p['step_correct_detour']:.3f} |")
    training = training_windows([json.loads(line) for _, d in stages if (d / "metrics.jsonl").exists()
                                 for line in open(d / "metrics.jsonl")])
    print(f"| run updates | {' | '.join(TRAINING)} |\n|" + "---|" * (len(TRAINING) + 1))
    for row in training:
        print(f"| {row['updates']} | " + " | ".join("—" if row[k] is None else f"{row[k]:.4f}" for k in TRAINING) + " |")
    audit = {"stages": out, "probes": probes, "training": training}
    common.atomic_write_json(run / "stage_audit.json", audit)
    return audit


def composition_figure(audits, path):
    """One panel per run: its rollouts per stage as shares of correct answers, wrong ones on the solution's path
    (a slip), the detour (no box) and the rest."""
    import matplotlib  # matplotlib: only for the figure
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen
    fig, axes = plt.subplots(1, len(audits), figsize=(3.2 * len(audits), 3.2), sharey=True, squeeze=False)
    kinds = [("correct", "tab:green"), ("wrong", "tab:red"), ("no_box", "tab:gray")]
    for ax, (name, audit) in zip(axes[0], audits.items()):
        stages = [r["stage"] for r in audit["stages"]]
        bottom = [0.0] * len(stages)
        for kind, colour in kinds + [("other", "tab:olive")]:
            share = [(r["grader_reasons"].get(kind, 0) if kind != "other" else
                      r["responses"] - sum(r["grader_reasons"].get(k, 0) for k, _ in kinds)) / r["responses"]
                     for r in audit["stages"]]
            ax.bar(stages, share, bottom=bottom, color=colour, label={"no_box": "detour (no box)",
                                                                      "wrong": "wrong (a slip)"}.get(kind, kind))
            bottom = [b + v for b, v in zip(bottom, share)]
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("stage (its rollouts)")
        ax.set_xticks(stages)
    axes[0][0].set_ylabel("share of the stage's rollouts")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


def main():
    audits = {}
    for item in run_dir.split(","):
        name, _, directory = item.rpartition("=")      # name=dir, or a bare dir (named by its path)
        audits[name or directory] = audit_run(Path(directory))
    if plot:
        composition_figure(audits, plot)


if __name__ == "__main__":
    main()
