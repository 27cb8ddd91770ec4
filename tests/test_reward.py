"""reward.py: hand-written verdicts over the answer formats of the benchmarks, hostile input, the pool."""
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from mu_grpo import grading as G
import reward as R

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def boxed(answer):
    return f"Let me think step by step. ... so the answer is $\\boxed{{{answer}}}$."


# (gold, prediction inside the box, dataset, expected correct?)
CASES = [
    # integers, AIME/AMC/GSM8K gold normalization
    ("204", "204", "aime24", True),
    ("025", "25", "aime24", True),
    ("25", "025", "aime24", True),
    ("27.0", "27", "amc23", True),
    ("27", "27.0", "amc23", True),
    ("-3", "-3", "amc23", True),
    ("-3", "3", "amc23", False),
    ("204", "205", "aime24", False),
    ("204", "204.5", "aime24", False),
    ("204", "2.04", "aime24", False),
    ("1450000", "1,450,000", "gsm8k_test", True),
    ("1,450,000", "1450000", "gsm8k_test", True),
    ("18", "\\$18", "gsm8k_test", True),
    ("18", "18 \\text{ dollars}", "gsm8k_test", True),
    ("18", "19", "gsm8k_test", False),
    ("18", "1.8", "gsm8k_test", False),
    # fractions
    ("\\frac{1}{2}", "\\frac12", None, True),
    ("\\frac{1}{2}", "\\dfrac{1}{2}", None, True),
    ("\\frac{1}{2}", "1/2", None, True),
    ("\\frac{1}{2}", "0.5", None, True),
    ("\\frac{1}{2}", "\\frac{2}{4}", None, True),
    ("\\frac{1}{2}", "2", None, False),
    ("\\frac{1}{2}", "-\\frac{1}{2}", None, False),
    ("\\frac{1}{3}", "0.33", None, False),
    ("\\frac{1}{3}", "0.333", None, False),
    ("\\frac{3}{4}", "\\frac{4}{3}", None, False),
    ("14\\frac{6}{7}", "\\frac{104}{7}", "math_train", True),
    ("\\frac{9}{7}", "\\frac{7}{9}", None, False),
    # radicals and π
    ("2\\sqrt{2}", "\\sqrt{8}", None, True),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", None, True),
    ("\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2", None, True),
    ("\\frac{\\sqrt{3}}{2}", "0.866", None, False),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{2}}{2}", None, False),
    ("3\\sqrt{13}", "\\sqrt{117}", None, True),
    ("3\\sqrt{13}", "13\\sqrt{3}", None, False),
    ("\\pi", "\\pi", None, True),
    ("2\\pi", "2 \\pi", None, True),
    ("\\pi", "3.14159", None, False),
    ("\\pi", "3.14", None, False),
    ("\\frac{\\pi}{2}", "\\frac{1}{2}\\pi", None, True),
    ("\\frac{\\pi}{2}", "\\frac{\\pi}{3}", None, False),
    ("6 - 2\\pi", "6-2\\pi", None, True),
    # expressions in a variable
    ("x^2+2x+1", "(x+1)^2", None, True),
    ("x^2+2x+1", "x^2+2x-1", None, False),
    ("2n+1", "1+2n", "olympiadbench", True),
    ("2n+1", "2n-1", "olympiadbench", False),
    ("x=5", "5", None, True),
    ("5", "x=5", None, True),
    ("5", "x=6", None, False),
    # intervals: open/closed ends matter
    ("(3,4]", "(3,4]", None, True),
    ("(3,4]", "[3,4]", None, False),
    ("(3,4]", "(3,4)", None, False),
    ("(-\\infty, 0]", "(-\\infty,0]", None, True),
    ("(-\\infty, 0]", "(-\\infty, 0)", None, False),
    ("[2,5)", "[2,5)", None, True),
    ("(-\\infty,-2)\\cup(2,\\infty)", "(-\\infty,-2)\\cup(2,\\infty)", None, True),
    ("(-\\infty,-2)\\cup(2,\\infty)", "(-\\infty,-2]\\cup[2,\\infty)", None, False),
    # tuples (ordered) vs sets and comma lists (unordered)
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\frac{\\pi}{2})", None, True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(\\frac{\\pi}{2}, 3)", None, False),
    ("(1,2,3)", "(1,2,3)", None, True),
    ("(1,2,3)", "(3,2,1)", None, False),
    ("1,-2", "-2, 1", None, True),
    ("1,-2", "1", None, False),
    ("1,-2", "1,-2,3", None, False),
    ("\\{1\\pm\\sqrt{5},-2\\}", "-2, 1+\\sqrt{5}, 1-\\sqrt{5}", None, True),
    ("\\{1\\pm\\sqrt{5},-2\\}", "1+\\sqrt{5}, 1-\\sqrt{5}", None, False),
    ("2, 3", "3, 2", "olympiadbench", True),
    ("2, 3", "2", "olympiadbench", False),
    ("2", "2, 3", None, False),
    # matrices and vectors
    ("\\begin{pmatrix} 16/49 \\\\ 48/49 \\\\ 24/49 \\end{pmatrix}",
     "\\begin{pmatrix} \\frac{16}{49} \\\\ \\frac{48}{49} \\\\ \\frac{24}{49} \\end{pmatrix}", None, True),
    ("\\begin{pmatrix} 16/49 \\\\ 48/49 \\\\ 24/49 \\end{pmatrix}",
     "\\begin{pmatrix} 48/49 \\\\ 16/49 \\\\ 24/49 \\end{pmatrix}", None, False),
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", None, True),
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix} 1 & 3 \\\\ 2 & 4 \\end{pmatrix}", None, False),
    # text answers
    ("\\text{(C)}", "\\text{(C)}", None, True),
    ("\\text{(C)}", "C", None, True),
    ("\\text{(C)}", "(C)", None, True),
    ("\\text{(C)}", "(D)", None, False),
    ("\\text{(C)}", "\\text{(C) or (D)}", None, False),
    ("\\text{Evelyn}", "\\text{Evelyn}", None, True),
    ("\\text{Evelyn}", "Evelyn", None, True),
    ("\\text{Evelyn}", "Evylen", None, False),   # an anagram: a product of symbols would match
    ("\\text{Sunday}", "\\text{Monday}", None, False),
    # degrees, percent, units, base-n, money
    ("106^\\circ", "106", None, True),
    ("106^\\circ", "106^\\circ", None, True),
    ("106^\\circ", "106^{\\circ}", None, True),
    ("106^\\circ", "74^\\circ", None, False),
    ("50\\%", "50\\%", None, True),
    ("50\\%", "50", None, True),
    ("50\\%", "0.5", None, False),     # no ×100 leniency
    ("0.5", "50\\%", None, False),
    ("12.5\\%", "12.5", None, True),
    ("5.4 \\text{ cents}", "5.4", None, True),
    ("5.4 \\text{ cents}", "5.4 \\text{ cents}", None, True),
    ("5.4 \\text{ cents}", "54", None, False),
    ("10,\\!080", "10080", None, True),
    ("10,\\!080", "10,080", None, True),
    ("\\$32,\\!348", "32348", None, True),
    ("\\$32,\\!348", "32,\\!348", None, True),
    ("\\$32,\\!348", "32347", None, False),
    # thousands separators in the prediction, any dataset: LaTeX's `,\\!` and `{,}`, spaces
    ("32349", "32,\\! 349", None, True),
    ("32349", "32{,}349", None, True),
    ("1000", "1 000", None, True),
    ("1000", "1\\,000", None, True),
    ("1234567", "1 234 567", None, True),
    ("1000", "1 00", None, False),        # not groups of three: no separator
    ("1", "1 000", None, False),
    ("1", "1,\\!000", None, False),
    ("1000.5", "1 000.5", None, True),
    # e-notation gold without a dataset name
    ("4.5e33", "4.5 \\times 10^{33}", None, True),
    ("4.5e33", "4.5e33", None, True),
    ("4.5e33", "4.5 \\times 10^{32}", None, False),
    ("4.5e33", "4.5", None, False),
    # Minerva: e-notation and significant figures
    ("4.5e33", "4.5 \\times 10^{33}", "minerva_math", True),
    ("4.5e33", "4.5\\times10^{33}", "minerva_math", True),
    ("4.5e33", "4.5e33", "minerva_math", True),
    ("4.5e33", "4.54 \\times 10^{33}", "minerva_math", True),
    ("4.5e33", "4.6 \\times 10^{33}", "minerva_math", False),
    ("4.5e33", "4.5 \\times 10^{32}", "minerva_math", False),
    ("4.5e33", "4.5", "minerva_math", False),
    ("1.45e-5", "1.45 \\times 10^{-5}", "minerva_math", True),
    ("1.45e-5", "1.45 \\times 10^{5}", "minerva_math", False),
    ("41.8", "41.8", "minerva_math", True),
    ("41.8", "41.83", "minerva_math", True),
    ("41.8", "41.9", "minerva_math", False),
    ("0.33", "0.331", "minerva_math", True),
    ("0.33", "0.34", "minerva_math", False),
    ("-1./3", "-\\frac{1}{3}", "minerva_math", True),
    ("np.arcsin(10/13)", "\\arcsin(10/13)", "minerva_math", True),
    ("300", "300", "minerva_math", True),
    ("300", "301", "minerva_math", False),  # integers are exact
]

# wrong answers that are boxed several times, or hidden behind a bare number
EXTRACTION_CASES = [
    ("5", "First \\boxed{3}, but wait, the answer is \\boxed{5}.", True),
    ("5", "The answer is \\boxed{5}. Hmm, actually \\boxed{3}.", False),
    ("5", "The answer is 5.", False),                  # no box: no last-number fallback
    ("5", "\\boxed 5", True),
    ("5", "\\fbox{5}", True),
    ("5", "\\boxed{\\boxed{5}}", True),
    ("5", "\\boxed{5} and then \\boxed{", True),       # an unclosed last box falls back to the complete one
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{2}}", True),
    ("5", "\\boxed{}", False),
    # several boxes joined by `,`/`and`/`or` are one answer (math-verify's rule), so hedging fails
    ("\\{1,2,3\\}", "so \\boxed{1} and \\boxed{2} and \\boxed{3}.", True),
    ("1,2,3", "$\\boxed{3}$, $\\boxed{1}$, or $\\boxed{2}$", True),
    ("(2,1),(1,2)", "\\boxed{(1, 2)}, \\boxed{(2, 1)}", True),
    ("\\{1,2,3\\}", "\\boxed{1} and \\boxed{2}", False),
    ("(2,1),(1,2)", "\\boxed{(1, 2)}, \\boxed{(1, 2)}", False),
    ("3", "\\boxed{2} or \\boxed{3}", False),         # a hedge is not the answer 3
    ("3", "\\boxed{2}, no: \\boxed{3}", True),        # words between: only the last box counts
]


@pytest.mark.parametrize("gold,pred,dataset,expected", CASES)
def test_equivalent_answers_are_right_and_different_ones_wrong(gold, pred, dataset, expected):
    reward, info = R.grade(boxed(pred), gold, dataset)
    assert (reward == 1.0) is expected, info
    assert info["reason"] in (("correct",) if expected else ("wrong", "unparsable"))
    assert info["extracted"] == pred


@pytest.mark.parametrize("gold,response,expected", EXTRACTION_CASES)
def test_the_graded_answer_is_the_last_boxed_one_and_its_joined_boxes(gold, response, expected):
    reward, info = R.grade(response, gold)
    assert (reward == 1.0) is expected, info


def test_reasons_and_format_bonus():
    assert R.grade("no box here, 5", "5")[1]["reason"] == "no_box"
    assert R.grade(boxed("6"), "5")[1]["reason"] == "wrong"
    assert R.grade(boxed("6"), "5", format_bonus=0.1)[0] == 0.1
    assert R.grade("no box", "5", format_bonus=0.1)[0] == 0.0
    assert R.grade(boxed("5"), "5", format_bonus=0.1)[0] == 1.0
    assert R.format_reward(boxed("x")) == 1.0 and R.format_reward("x") == 0.0


def test_last_boxed_reads_balanced_braces_and_bare_boxes():
    assert R.last_boxed("a \\boxed{1} b \\boxed{ {2} }") == "{2}"
    assert R.last_boxed("\\boxed{a{b}c}") == "a{b}c"
    assert R.last_boxed("\\boxed 7$ end") == "7"
    assert R.last_boxed("\\boxedx{1}") is None
    assert R.last_boxed("nothing") is None
    assert R.final_boxed("\\boxed{1}, \\boxed 2 and $\\boxed{3}$") == ["1", "2", "3"]
    assert R.final_boxed("\\boxed{1} so \\boxed{2} or \\boxed{3}") == ["2", "3"]
    assert R.final_boxed("\\boxed{1} and \\boxed{2") == ["1"]
    assert R.final_boxed("none") == []


def test_gold_answers_are_normalized_per_dataset():
    assert R.normalize_gold("025", "aime24") == "25"
    assert R.normalize_gold("27.0", "amc23") == "27"
    assert R.normalize_gold("2,125", "gsm8k_test") == "2125"
    assert R.normalize_gold("4.5e33", "minerva_math") == "4.5 \\times 10^{33}"
    assert R.normalize_gold("1.45e-5", "minerva_math") == "1.45 \\times 10^{-5}"
    assert R.normalize_gold("\\frac{1}{2}", "math500") == "\\frac{1}{2}"


# ------------------------------------------------------------------ hostile input

MARKER = "/tmp/mu_grpo_reward_pwned"
ATTACKS = [
    f"\\boxed{{__import__('os').system('touch {MARKER}')}}",
    f"\\boxed{{exec(\"open('{MARKER}','w')\")}}",
    f"\\boxed{{(lambda: open('{MARKER}', 'w'))()}}",
    "\\boxed{().__class__.__base__.__subclasses__()}",
    f"\\boxed{{open('{MARKER}', 'w').write('x')}}",
    f"\\boxed{{eval(\"__import__('os').system('touch {MARKER}')\")}}",
    f"\\boxed{{\\text{{__import__('os').system('touch {MARKER}')}}}}",
    f"The answer: __import__('os').system('touch {MARKER}')",
]


@pytest.mark.parametrize("attack", ATTACKS)
def test_model_output_never_runs_as_code(attack):
    if os.path.exists(MARKER):
        os.remove(MARKER)
    reward, info = R.grade(attack, "5")
    assert reward == 0.0
    assert not os.path.exists(MARKER)
    # and with the unsafe expression path of math-verify not reachable even when parse_expr is hit
    R.grade(attack.replace("\\boxed", "\\boxed "), "5")
    assert not os.path.exists(MARKER)


@pytest.mark.parametrize("response", [
    "x" * 1_000_000 + " \\boxed{5}",
    "\\boxed{" + "{" * 10_000 + "5" + "}" * 10_000 + "}",
    "\\boxed{" * 10_000,
    "\\boxed{9^{9^{9^{9^9}}}}",
    "\\boxed{(10^{100})!}",
    "\\boxed{1000000!}",
    "\\boxed{2^{2^{40}}}",
    "\\boxed{" + "1+" * 20_000 + "1}",
])
def test_hostile_input_is_bounded(response):
    t0 = time.perf_counter()
    reward, info = R.grade(response, "5", timeout_s=2.0)
    assert time.perf_counter() - t0 < 4.0
    assert info["reason"] in R.REASONS


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200), st.text(max_size=30))
def test_random_text_never_raises(response, gold):
    reward, info = R.grade(response, gold, timeout_s=2.0)
    assert reward in (0.0, 1.0) and info["reason"] in R.REASONS


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="\\{}^_0123456789+-*/()[],.$ abcxe", max_size=60))
def test_random_latex_in_a_box_never_raises(content):
    reward, info = R.grade("\\boxed{" + content + "}", "\\frac{1}{2}", timeout_s=2.0)
    assert info["reason"] in R.REASONS


# ------------------------------------------------------------------ the pool


def hang_on_marker(response, gold, dataset=None, timeout_s=None):
    """A reward function that hangs in C-like fashion (ignoring SIGALRM) on one item."""
    import signal
    if response == "HANG":
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        time.sleep(60)
    return R.grade(response, gold, dataset, timeout_s=timeout_s)


def test_pool_kills_a_hanging_item_and_finishes_the_rest():
    items = [(boxed(str(i)), str(i)) for i in range(6)] + [("HANG", "1")] + [(boxed("7"), "8")]
    t0 = time.perf_counter()
    results = G.grade_batch(items, workers=2, timeout_s=1.0, reward_fn=hang_on_marker)
    assert time.perf_counter() - t0 < 20
    assert [r for r, _ in results] == [1.0] * 6 + [0.0, 0.0]
    assert results[6][1]["reason"] == "timeout"
    assert results[7][1]["reason"] == "wrong"


def pid_as_reward(response, gold, dataset=None, timeout_s=None):
    """A reward function that reports which worker process graded the item."""
    import os
    return 0.0, {"reason": "wrong", "extracted": None, "pid": os.getpid()}


def test_pool_workers_serve_every_call_and_a_killed_one_is_replaced():
    # starting a worker costs more than grading thousands of answers: the workers stay for the next call
    G.stop_graders()
    first = {i["pid"] for _, i in G.grade_batch([("a", "1")] * 20, workers=2, reward_fn=pid_as_reward)}
    second = {i["pid"] for _, i in G.grade_batch([("a", "1")] * 20, workers=2, reward_fn=pid_as_reward)}
    assert len(first) == 2 and second == first
    # a worker killed on a timeout is replaced for this call and the next; another reward_fn, same workers
    results = G.grade_batch([("HANG", "1")] + [(boxed("1"), "1")] * 4, workers=2, timeout_s=1.0,
                            reward_fn=hang_on_marker)
    assert [r for r, _ in results] == [0.0, 1.0, 1.0, 1.0, 1.0] and results[0][1]["reason"] == "timeout"
    third = {i["pid"] for _, i in G.grade_batch([("a", "1")] * 20, workers=2, reward_fn=pid_as_reward)}
    assert len(third) == 2 and len(third & first) == 1
    G.stop_graders()
    assert G._pool == []


def test_pool_takes_a_partial_as_reward_fn():
    # generate.py passes functools.partial(grade, format_bonus=...): it must travel to the workers
    import functools
    results = G.grade_batch([(boxed("6"), "5"), ("no box", "5"), (boxed("5"), "5")], workers=2,
                            reward_fn=functools.partial(R.grade, format_bonus=0.1))
    assert [r for r, _ in results] == [0.1, 0.0, 1.0]


def test_pool_matches_in_process_grading_in_order():
    items = [{"response": boxed(p), "gold": g, "dataset": d} for g, p, d, _ in CASES[:40]]
    pooled = G.grade_batch(items, workers=2, timeout_s=5.0)
    local = [R.grade(it["response"], it["gold"], it["dataset"]) for it in items]
    assert [r for r, _ in pooled] == [r for r, _ in local]
    assert [i["reason"] for _, i in pooled] == [i["reason"] for _, i in local]


# ------------------------------------------------------------------ the real gold answers


@pytest.mark.skipif(not SHARED.exists(), reason="../shared/data not present")
@pytest.mark.parametrize("name", ["math500/math500", "aime24/aime24", "amc23/amc23", "gsm8k/gsm8k_test",
                                  "minerva_math/minerva_math", "olympiadbench/olympiadbench"])
def test_every_gold_answer_grades_itself_correct(name):
    rows = [json.loads(line) for line in open(SHARED / f"{name}.jsonl")][:200]
    items = [(boxed(r["answer"]), r["answer"], r["source"]) for r in rows]
    results = G.grade_batch(items, workers=2, timeout_s=10.0)
    wrong = [(r["answer"], info["reason"]) for r, (reward, info) in zip(rows, results) if reward != 1.0]
    assert len(wrong) <= 0.02 * len(rows), wrong[:20]
