"""The lab task: chained arithmetic written out step by step, for the CPU ablations (ablate.sh).

    python data/lab.py --out_dir=data/lab            # writes train.jsonl, test.jsonl, heldout.jsonl and model/

A problem is a start value and 3–8 additions or subtractions of 1–9 that keep every value in 0..19:

    Compute 7 + 8 - 5 + 9 step by step.
     Step 1: 7 + 8 = 15
    Step 2: 15 - 5 = 10
    Step 3: 10 + 9 = 19
    \\boxed{19}

A worked solution is 32–77 tokens long (mean 55), so the trainer's importance ratios act on tens of
tokens per response, as in the paper's long math solutions (the toy's responses have at most 7). The test
set has the same number of problems for each chain length (3..8 steps): graded difficulty, since one
slip anywhere spoils the answer. Train and test problems are disjoint.

The policy is a tiny Llama warm-started on *imperfect* demonstrations: each step's result slips by
±1 or ±10 with probability `p_slip` (the chain goes on from the wrong value), and a share `p_no_box`
of the solutions ends in `Answer: 19` instead of a box (graded wrong). Sampled at temperature 1 it so
solves 57% of the test problems (65% of the 3-step chains, 52% of the 8-step ones): RL has room to remove both kinds
of error. The answers are graded by reward.py like any math answer.
"""
import random
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from mu_grpo import common  # noqa: E402
import toy  # noqa: E402  (the tokenizer, model, warm start and writers are the toy's)

# ----------------------------------------------------------------------------- hyperparameters
# the task: where it goes, its problems and their split (seed: the model's and the warm start's too)
out_dir = "data/lab"        # where train.jsonl, test.jsonl and model/ go
train_problems = 4096
test_per_length = 100       # test problems per chain length (× the max_steps − min_steps + 1 lengths: printed)
heldout_per_length = 420    # held-out problems per chain length (× 6 = 2,520; never trained or warm-started on): one
                            # sample each has avg@1's standard error ≤ 0.5/√2520 < 0.01 at any accuracy (frontier.sh)
min_steps = 3               # chain lengths: min_steps..max_steps operations
max_steps = 8
seed = 0

# the model: the toy's tiny Llama and byte-level BPE tokenizer
hidden_size = 128           # model width; head dimension is fixed at 32
layers = 4
vocab_size = 400            # byte-level BPE: 256 bytes + merges + 3 special tokens

# the warm start: supervised steps on imperfect demonstrations
sft_steps = 500             # warm-start optimizer steps
sft_batch = 64              # sequences per warm-start step
sft_lr = 3e-3
p_slip = 0.05               # demonstrations: chance that a step's result is off by ±1 or ±10
p_no_box = 0.2              # demonstrations: chance that the final answer is not boxed
# -----------------------------------------------------------------------------


def chain(rng, n_steps):
    """A start value in 2..17 and n_steps (sign, operand 1..9) pairs keeping every value in 0..19."""
    value = start = rng.randint(2, 17)
    ops = []
    for _ in range(n_steps):
        sign = rng.choice("+-")
        if (sign == "+" and value == 19) or (sign == "-" and value == 0):
            sign = "-" if sign == "+" else "+"
        d = rng.randint(1, min(9, 19 - value if sign == "+" else value))
        value += d if sign == "+" else -d
        ops.append((sign, d))
    return start, ops


def problem_row(start, ops):
    text = f"Compute {start} " + " ".join(f"{s} {d}" for s, d in ops) + " step by step."
    answer = start + sum(d if s == "+" else -d for s, d in ops)
    return {"id": f"lab-{start}" + "".join(f"{s}{d}" for s, d in ops), "problem": text,
            "answer": str(answer), "source": "lab", "steps": len(ops)}


def by_length(rng, per_length, min_steps, max_steps, seen):
    """per_length new problems of each chain length min_steps..max_steps, none of them in seen (problem texts;
    the ones drawn are added to it)."""
    rows = []
    for n in range(min_steps, max_steps + 1):
        count = 0
        while count < per_length:
            row = problem_row(*chain(rng, n))
            if row["problem"] not in seen:
                seen.add(row["problem"])
                rows.append(row)
                count += 1
    return rows


def problems(train_problems, test_per_length, min_steps, max_steps, seed):
    """Disjoint train and test sets; the test set has test_per_length problems of each chain length."""
    rng = random.Random(seed)
    seen = set()
    test = by_length(rng, test_per_length, min_steps, max_steps, seen)
    train = []
    while len(train) < train_problems:
        row = problem_row(*chain(rng, rng.randint(min_steps, max_steps)))
        if row["problem"] not in seen:
            seen.add(row["problem"])
            train.append(row)
    return train, test


def heldout(train, test, warm_start_problems, per_length, min_steps, max_steps, seed):
    """A larger held-out set: per_length problems of each chain length that are neither train nor test problems
    nor ever a warm-start example, drawn from their own stream (seed + 2), so the task and its policy are the same
    with or without it."""
    seen = {r["problem"] for r in train + test} | set(warm_start_problems)
    return by_length(random.Random(seed + 2), per_length, min_steps, max_steps, seen)


def steps(row, rng, p_slip):
    """The steps (value, sign, operand, result) of a worked solution in which a step's result slips by ±1 or ±10
    with probability p_slip (the chain goes on from the wrong value), and the value they reach."""
    start = int(row["problem"].split()[1])
    tokens = row["problem"].split()[2:-3]
    value, lines = start, []
    for k in range(0, len(tokens), 2):
        sign, d = tokens[k], int(tokens[k + 1])
        result = value + d if sign == "+" else value - d
        if rng.random() < p_slip and (slips := [s for s in (-10, -1, 1, 10) if 0 <= result + s <= 19]):
            result += rng.choice(slips)
        lines.append((value, sign, d, result))
        value = result
    return lines, value


def step_lines(lines):
    return [f"Step {k + 1}: {a} {s} {d} = {r}" for k, (a, s, d, r) in enumerate(lines)]


def demonstration(row, rng, p_slip, p_no_box):
    """One imperfect worked solution: a step's result slips by ±1 or ±10 with probability p_slip."""
    lines, value = steps(row, rng, p_slip)
    final = f"Answer: {value}" if rng.random() < p_no_box else f"\\boxed{{{value}}}"
    return " " + "\n".join(step_lines(lines) + [final])


def build(out_dir, *, train_problems=4096, test_per_length=100, heldout_per_length=420, min_steps=3, max_steps=8,
          seed=0, hidden_size=128, layers=4, vocab_size=400, sft_steps=500, sft_batch=64, sft_lr=3e-3, p_slip=0.05,
          p_no_box=0.2, demonstrate=None, corpus_copies=1):
    """Write the lab's train/test/held-out sets and its warm-started policy (HF directory) under out_dir.
    demonstrate(row, rng): a worked solution (default: demonstration's with p_slip, p_no_box; data/lab_fork.py gives
    its own); corpus_copies: how many of them per training problem the tokenizer is trained on."""
    import torch  # torch after toy.portable_kernels set ATEN_CPU_CAPABILITY (the builder's main)
    torch.set_num_threads(common.usable_cores())
    demonstrate = demonstrate or (lambda row, rng: demonstration(row, rng, p_slip, p_no_box))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = problems(train_problems, test_per_length, min_steps, max_steps, seed)
    print(f"{len(train)} training problems, {len(test)} test problems ({test_per_length} per chain length, "
          f"{max_steps - min_steps + 1} lengths: {min_steps}..{max_steps} steps)")
    toy.write_jsonl(out / "train.jsonl", train)
    toy.write_jsonl(out / "test.jsonl", test)
    corpus_rng = random.Random(seed + 1)
    corpus = [r["problem"] + demonstrate(r, corpus_rng) for r in train for _ in range(corpus_copies)]
    tokenizer = toy.build_tokenizer(corpus, vocab_size)
    model = toy.build_model(tokenizer, hidden_size, layers, seed)
    test_ids = {r["id"] for r in test}

    def examples(rng, batch):   # fresh chains (never a test problem), so the warm start does not memorize
        rows = []
        while len(rows) < batch:
            row = problem_row(*chain(rng, rng.randint(min_steps, max_steps)))
            if row["id"] not in test_ids:
                rows.append((row["problem"], demonstrate(row, rng)))
        return rows
    warm_problems = toy.warm_start_problems(examples, sft_steps, sft_batch, seed)
    held = heldout(train, test, warm_problems, heldout_per_length, min_steps, max_steps, seed)
    toy.write_jsonl(out / "heldout.jsonl", held)
    print(f"{len(held)} held-out problems ({heldout_per_length} per chain length; none trained or warm-started on)")
    if sft_steps:
        toy.warm_start(model, tokenizer, examples, sft_steps, sft_batch, sft_lr, seed)
    return toy.save_model(model, tokenizer, out / "model")


if __name__ == "__main__":
    common.apply_overrides(globals(), sys.argv[1:])
    toy.portable_kernels()      # the same task and policy on any x86-64 machine (before torch is imported)
    path = build(**common.hyperparameters(globals()))
    print(f"lab task and policy written: {out_dir}/train.jsonl, test.jsonl, heldout.jsonl, {path}")
