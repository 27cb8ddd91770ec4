"""The lab's second task (lab-fork): the good path begins with a low-probability fork, and the other branch is a
long suffix that is doomed once taken, as in the paper, where a trigger token marks a choice and everything
after it lives in contexts the current policy no longer produces.

    python data/lab_fork.py --out_dir=data/lab_fork      # writes train.jsonl, test.jsonl, heldout.jsonl and model/

The problems are the lab's (data/lab.py: 3–8 additions or subtractions of 1–9, every value in 0..19). The
demonstrations the policy is warm-started on take the detour with probability `p_detour` at the fork, the
solution otherwise:

    fork=start   " Check: 7 + 8 - 5 + 9 has 3 steps.\\nStep 1: 7 + 8 = 15 ... Answer: 19"    (detour: no box)
                 " Step 1: 7 + 8 = 15\\nStep 2: 15 - 5 = 10\\nStep 3: 10 + 9 = 19\\n\\\\boxed{19}"
    fork=end     the steps, then "Check:" and the steps again, "Answer: 19"                   (detour)
                 the steps, then "\\\\boxed{19}"

The detour is graded wrong whatever its arithmetic (reward.py: no box); its text shares the step lines'
tokens (detour=restate) or writes each step backwards (detour=reverse: "Undo 3: 19 - 9 = 10"), so that
pushing it down reaches the solution's own tokens more (restate) or less (reverse). Steps slip by ±1/±10
with probability p_slip on either path. The warm-started policy takes the detour about p_detour of the
time: its best answer starts with a low-probability choice.
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from mu_grpo import common  # noqa: E402
import lab  # noqa: E402  (the problems are the lab's)
import toy  # noqa: E402  (the tokenizer, model, warm start and writers are the toy's)

# ----------------------------------------------------------------------------- hyperparameters
# the task: where it goes, the lab's problems and their split (seed: the model's and the warm start's too)
out_dir = "data/lab_fork"   # where train.jsonl, test.jsonl and model/ go
train_problems = 4096
test_per_length = 50        # test problems per chain length (× the max_steps − min_steps + 1 lengths: printed)
heldout_per_length = 625    # held-out problems per chain length (× 4 = 2,500; never trained or warm-started on): one
                            # sample each has avg@1's standard error ≤ 0.5/√2500 = 0.01 at any accuracy (frontier.sh)
min_steps = 3               # chain lengths: min_steps..max_steps operations
max_steps = 6
seed = 0

# the model: the toy's tiny Llama and byte-level BPE tokenizer
hidden_size = 128           # model width; head dimension is fixed at 32
layers = 4
vocab_size = 400            # byte-level BPE: 256 bytes + merges + 3 special tokens

# the warm start: supervised steps
sft_steps = 500             # warm-start optimizer steps
sft_batch = 64              # sequences per warm-start step
sft_lr = 3e-3

# its demonstrations: the fork, the detour, slips
p_detour = 0.8              # demonstrations: chance of the detour at the fork
fork = "start"              # where the fork is: start (before the steps) | end (after them)
detour = "restate"          # the detour's text: restate (the steps again) | reverse (the steps undone, backwards)
p_slip = 0.01               # chance that a step's result is off by ±1 or ±10 (either path)
# -----------------------------------------------------------------------------
FORKS, DETOURS = ("start", "end"), ("restate", "reverse")


def detour_lines(lines, detour):
    if detour == "restate":
        return lab.step_lines(lines)
    return [f"Undo {k + 1}: {r} {'-' if s == '+' else '+'} {d} = {a}" for k, (a, s, d, r) in reversed(list(enumerate(lines)))]


def demonstration(row, rng, *, p_detour, fork, detour, p_slip):
    """One worked solution: the detour (unboxed) with probability p_detour, else the boxed solution."""
    lines, value = lab.steps(row, rng, p_slip)
    solution = lab.step_lines(lines)
    if rng.random() >= p_detour:
        return " " + "\n".join(solution + [f"\\boxed{{{value}}}"])
    if fork == "start":
        expression = " ".join(row["problem"].split()[1:-3])
        return " " + "\n".join([f"Check: {expression} has {len(lines)} steps."] + detour_lines(lines, detour)
                               + [f"Answer: {value}"])
    return " " + "\n".join(solution + ["Check:"] + detour_lines(lines, detour) + [f"Answer: {value}"])


def build(out_dir, *, test_per_length=50, heldout_per_length=625, max_steps=6, p_detour=0.8, fork="start",
          detour="restate", p_slip=0.01, **lab_settings):
    """Write the task's train/test/held-out sets and its warm-started policy (HF directory) under out_dir: the lab's
    build (data/lab.py, lab_settings: its other settings) with this task's demonstrations, two per training problem
    in the tokenizer's corpus."""
    options = dict(p_detour=p_detour, fork=fork, detour=detour, p_slip=p_slip)
    return lab.build(out_dir, test_per_length=test_per_length, heldout_per_length=heldout_per_length,
                     max_steps=max_steps, demonstrate=lambda row, rng: demonstration(row, rng, **options),
                     corpus_copies=2, **lab_settings)


if __name__ == "__main__":
    common.apply_overrides(globals(), sys.argv[1:])
    toy.portable_kernels()      # the same task and policy on any x86-64 machine (before torch is imported)
    common.check_choice("fork", fork, FORKS)
    common.check_choice("detour", detour, DETOURS)
    path = build(**common.hyperparameters(globals()))
    print(f"lab-fork task and policy written: {out_dir}/train.jsonl, test.jsonl, heldout.jsonl, {path}")
