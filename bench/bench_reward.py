"""Grading throughput: a plain single-process math-verify loop against reward.grade_batch.

Builds realistic (response, gold) pairs from the benchmark files in ../shared/data (or --data_dir):
each gold answer boxed at the end of a few hundred characters of reasoning, half of them correct and
half perturbed (a changed digit, a dropped term). Both paths grade the same pairs, with timeouts on.

    python bench/bench_reward.py                 # 2000 pairs, 2 workers
    python bench/bench_reward.py --pairs=4000 --workers=2
"""
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ----------------------------------------------------------------------------- hyperparameters
pairs = 2000            # (response, gold) pairs graded by each path
workers = 2             # grade_batch worker processes
timeout_s = 5.0         # per-item limit, both paths
data_dir = str(Path(__file__).resolve().parents[2] / "shared" / "data")
seed = 0
# -----------------------------------------------------------------------------
for arg in sys.argv[1:]:
    key, _, value = arg.removeprefix("--").partition("=")
    if key not in globals() or key.startswith("_"):
        sys.exit(f"unknown option --{key}")
    globals()[key] = type(globals()[key])(value)


def perturb(answer, rng):
    digits = [i for i, c in enumerate(answer) if c.isdigit()]
    if digits:
        i = rng.choice(digits)
        return answer[:i] + str((int(answer[i]) + rng.randint(1, 9)) % 10) + answer[i + 1:]
    return answer + "+1"


def build_pairs():
    files = sorted(Path(data_dir).glob("*/*.jsonl"))
    if not files:
        sys.exit(f"no benchmark files under {data_dir} (pass --data_dir=...)")
    rows = [json.loads(line) for f in files for line in open(f)]
    rng = random.Random(seed)
    filler = "We expand, simplify and check each case carefully. " * 6
    out = []
    for _ in range(pairs):
        r = rng.choice(rows)
        pred = r["answer"] if rng.random() < 0.5 else perturb(r["answer"], rng)
        out.append((f"{filler}Therefore the final answer is $\\boxed{{{pred}}}$.", r["answer"], r["source"]))
    return out


def plain_loop(items):
    from math_verify import parse, verify  # math-verify's own loop, the baseline row
    t0 = time.perf_counter()
    correct = 0
    for response, gold, _ in items:
        correct += verify(parse(f"${gold}$", parsing_timeout=int(timeout_s)), parse(response, parsing_timeout=int(timeout_s)),
                          timeout_seconds=int(timeout_s))
    return time.perf_counter() - t0, correct


if __name__ == "__main__":
    import reward as R
    items = build_pairs()
    print(f"{len(items)} pairs from {data_dir}; {workers} workers; timeout {timeout_s} s per item; "
          f"{os.cpu_count()} CPUs")
    plain_s, plain_correct = plain_loop(items)
    t0 = time.perf_counter()
    results = R.grade_batch(items, workers=workers, timeout_s=timeout_s)
    pool_s = time.perf_counter() - t0
    pool_correct = sum(r == 1.0 for r, _ in results)
    print(f"| {'path':<40} | {'responses/s':>11} | {'graded correct':>14} |")
    print(f"|{'-' * 42}|{'-' * 13}|{'-' * 16}|")
    print(f"| {'math-verify parse+verify, 1 process':<40} | {len(items) / plain_s:11.0f} | {plain_correct:14d} |")
    print(f"| {f'reward.grade_batch, {workers} workers':<40} | {len(items) / pool_s:11.0f} | {pool_correct:14d} |")
    print(f"speed-up: {plain_s / pool_s:.2f}x")
