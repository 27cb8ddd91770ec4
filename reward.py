"""Math grading: the last \\boxed{...} answer against the gold answer, with Hugging Face
math-verify.

    grade(response, gold, dataset=None)          → (reward, info)         one item, in-process
    (mu_grpo/grading.py grades many in a process pool with a hard limit per item: grade_batch)

What is rewarded: 1.0 when the content of the **last** `\\boxed{...}` (also `\\boxed 5`,
`\\fbox{...}`) is equivalent to the gold answer, else 0.0 (optionally `format_bonus` for a boxed but
wrong answer). Boxes joined to the last one by `,`, `and` or `or` are part of it, as in math-verify:
`\\boxed{1} and \\boxed{2}` answers `{1, 2}` (so a hedge `\\boxed{2} or \\boxed{3}` is not the
answer 3). No box means 0 with reason `no_box`: there is no last-number fallback, which a policy
learns to game.

How answers are compared (in this order):
1. Both sides are normalized as text: `\\%` and `\\text{ percent}` dropped (so `50\\%` equals `50`
   but *not* `0.5`: no ×100 leniency), `\\dfrac`/`\\tfrac` → `\\frac`, `$`, `\\!` and
   `\\displaystyle` removed, thousands separators between groups of three digits dropped
   (`32,\\!349`, `32{,}349`, `1 000`, `1\\,000`), e-notation `4.5e33` → `4.5 \\times 10^{33}`.
   Gold answers get the per-dataset fixes of `normalize_gold` (AIME/AMC `025`/`27.0` → integers,
   GSM8K `1,000`, Minerva Python-isms).
2. Text answers (gold is `\\text{...}`, e.g. `\\text{(C)}`, `\\text{Evelyn}`): the texts must
   agree after lower-casing and dropping spaces, braces and parentheses (`C`, `(C)` and
   `\\text{(C)}` are one).
3. Minerva decimals (the dataset asks for significant figures): the prediction is a number within
   half a unit of the gold's last significant digit (gold `4.5e33` accepts 4.45e33 … 4.55e33).
4. Everything else: math-verify `parse` (LaTeX extraction only) and `verify`: fractions, radicals,
   π, intervals with open/closed ends, tuples (ordered) vs sets and comma lists (unordered),
   matrices, degrees, units in `\\text{}`, equations like `x = 5` against `5`.

Safety: math-verify's plain-expression path calls sympy's `parse_expr`, which is `eval`. Only the
LaTeX path is used, and while grading, `parse_expr` (and so `sympify` of strings) is replaced by a
function that refuses, so model output never runs as code. Time: each item gets a wall-clock budget
enforced with SIGALRM (raised as a BaseException that math-verify cannot swallow) in the grading
thread; grading.grade_batch also kills and replaces a worker that overruns (a C-level sympy call
that never returns to the interpreter), reporting `timeout` for that item. Reasons: correct, wrong,
no_box, unparsable, timeout, error. `grade` never raises.
"""
import contextlib
import functools
import logging
import math
import re
import signal
import threading
import time

REASONS = ("correct", "wrong", "no_box", "unparsable", "timeout", "error")
MAX_ANSWER_CHARS = 1000       # longest gold answer in the benchmarks is ~210 characters
INTEGER_DATASETS = ("aime", "amc", "gsm8k")
logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # we report timeouts ourselves


# ----------------------------------------------------------------------------------------------
# Extraction


_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _complete_boxes(text):
    """[(start, end, content)] of every complete \\boxed{...} / \\fbox{...} / `\\boxed 5` in text.

    One pass pairs all braces (so 10,000 nested or unclosed braces cost O(n)); a box whose brace
    never closes (a truncated response) is left out. start: the backslash; end: just past the box.
    """
    keywords = list(_BOX_RE.finditer(text))
    if not keywords:
        return []
    closing, stack = {}, []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            closing[stack.pop()] = i
    boxes = []
    for keyword in keywords:
        i = keyword.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            if i in closing:
                boxes.append((keyword.start(), closing[i] + 1, text[i + 1:closing[i]].strip()))
        elif i > keyword.end():  # `\boxed 5`: the token after the space
            token = re.match(r"[^\s$]+", text[i:])
            if token:
                boxes.append((keyword.start(), i + token.end(), token.group(0)))
    return boxes


def last_boxed(text):
    """Content of the last complete box in text, or None (a truncated last box is skipped)."""
    boxes = _complete_boxes(text)
    return boxes[-1][2] if boxes else None


# Between two boxes of one answer: a comma, `and` or `or`, with spaces and $ around (math-verify's
# rule: `\boxed{1}, \boxed{2} and \boxed{3}` is the answer {1, 2, 3}).
_BOX_JOINER = re.compile(r"^[\s$]*(?:,|,?\s*(?:and|or))[\s$]*$")


def final_boxed(text):
    """Contents of the boxes that form the final answer: the last complete box and those joined to
    it by `,`/`and`/`or` (`\\boxed{1} and \\boxed{2}` → ["1", "2"]); [] when there is no box."""
    boxes = _complete_boxes(text)
    if not boxes:
        return []
    k = len(boxes) - 1
    while k > 0 and _BOX_JOINER.match(text[boxes[k - 1][1]:boxes[k][0]]):
        k -= 1
    return [content for _, _, content in boxes[k:]]


# ----------------------------------------------------------------------------------------------
# Normalization


_E_NOTATION = re.compile(r"^([-+]?\d*\.?\d+)[eE]([-+]?\d+)$")


def normalize_gold(gold, dataset=None):
    """Dataset-specific fixes to a gold answer string, before the common normalization.

    aime*/amc*: integers `025`, `27.0` → `25`, `27`.  gsm8k*: `1,000` → `1000`.
    minerva*: `-1./3` → `-1/3`, `np.arcsin(x)` → `\\arcsin(x)`. Any dataset: Python e-notation
    `4.5e33` → `4.5 \\times 10^{33}` (math-verify reads `e` as Euler's number). olympiadbench:
    multi-answers are already written `a, b`, which math-verify reads as an unordered set.
    """
    gold = str(gold).strip()
    ds = (dataset or "").lower()
    if ds.startswith(INTEGER_DATASETS):
        g = gold.replace(",", "")
        with contextlib.suppress(ValueError):
            value = float(g)
            if value == int(value):
                return str(int(value))
        return g
    if ds.startswith("minerva"):
        gold = gold.replace("np.", "\\").replace("./", "/")
    return _from_e_notation(gold)


def _from_e_notation(s):
    """`4.5e33` → `4.5 \\times 10^{33}`: math-verify would read the e as Euler's number."""
    m = _E_NOTATION.match(s)
    return f"{m.group(1)} \\times 10^{{{int(m.group(2))}}}" if m else s


# Thousands separators: `32,\\!349` and `32{,}349` (LaTeX's), `1 000`, `1\\,000`, `1~000` (spaces,
# only between groups of exactly three digits). A plain comma `1,000` math-verify reads itself.
_LATEX_THOUSANDS = re.compile(r"(?<=\d)(?:,\\!|\{,\})\s*(?=\d{3}(?!\d))")
_SPACED_NUMBER = re.compile(r"(?<![\d.])\d{1,3}(?:(?:\\[,;: ]|~| )\d{3})+(?![\d])")


def _common(s):
    """Normalization applied to both gold and prediction."""
    s = _LATEX_THOUSANDS.sub("", s)
    s = _SPACED_NUMBER.sub(lambda m: re.sub(r"\D", "", m.group(0)), s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\displaystyle", "")
    s = s.replace("\\!", "").replace("\\$", "").replace("$", "")
    s = re.sub(r"\\text\{\s*(\\%|%|percent)\s*\}", "", s)
    s = s.replace("\\%", "").replace("%", "")
    return s.strip()


_TEXT_GOLD = re.compile(r"^\\(?:text|textbf|mathrm)\{([^{}]*)\}$")


def _as_text(s):
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\b", "", s)
    return re.sub(r"[\s{}()\\.]", "", s).lower()


def _significant_tolerance(gold_latex):
    """Half a unit of the last significant digit of a decimal gold (None for
    integers/non-numbers)."""
    m = re.match(r"^([-+]?\d*\.?\d+)(?: \\times 10\^\{([-+]?\d+)\})?$", gold_latex)
    if not m or "." not in m.group(1) and m.group(2) is None:
        return None
    mantissa, exponent = m.group(1).lstrip("+-"), int(m.group(2) or 0)
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return 0.5 * 10.0 ** (exponent - decimals)


# ----------------------------------------------------------------------------------------------
# Time limit and the no-eval guard


class GradeTimeout(BaseException):
    """Raised by SIGALRM inside grade(); a BaseException so library `except Exception` can't eat
    it."""


@contextlib.contextmanager
def _time_limit(seconds):
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield  # signals only work in the main thread; grade_batch's parent enforces a hard limit
        return

    def on_alarm(signum, frame):
        raise GradeTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# What sympy's eval-based parse_expr may still see while grading: numbers, names and arithmetic
# operators (latex2sympy builds numbers with sympy.Number("50")). No parentheses, brackets, quotes
# or attribute dots means no call, no subscript, no string and no attribute access can be written.
_SAFE_EXPR = re.compile(r"^(?:[A-Za-z0-9_+\-*/^ ]|(?<=\d)\.|\.(?=\d))*$")


@contextlib.contextmanager
def _no_string_eval():
    """Guard sympy's eval-based string parser wherever math-verify and latex2sympy can reach it."""
    # math-verify, sympy: only where answers are graded
    import latex2sympy2_extended.latex2sympy2 as l2s
    import math_verify.parser as mv_parser
    import sympy.parsing.sympy_parser as sympy_parser
    original = sympy_parser.parse_expr

    def guarded_parse_expr(s, *args, **kwargs):
        if (not isinstance(s, str) or len(s) > MAX_ANSWER_CHARS or "__" in s
            or not _SAFE_EXPR.match(s)):
            raise ValueError("reward.py: refused to eval a string that is not plain arithmetic")
        return original(s, *args, **kwargs)

    modules = (sympy_parser, mv_parser, l2s)
    saved = [m.parse_expr for m in modules]
    for m in modules:
        m.parse_expr = guarded_parse_expr
    try:
        yield
    finally:
        for m, original in zip(modules, saved):
            m.parse_expr = original


@functools.lru_cache(maxsize=4096)
def _parse_latex(latex):
    # math-verify: only where answers are graded
    from math_verify import LatexExtractionConfig, parse
    config = [LatexExtractionConfig(boxed_match_priority=0)]
    return parse(f"${latex}$", extraction_config=config, fallback_mode="no_fallback",
                 parsing_timeout=None)


def _as_number(expr):
    import sympy  # sympy: only where answers are graded
    if isinstance(expr, sympy.Basic) and expr.is_number:
        value = complex(expr.evalf(20))
        if value.imag == 0 and math.isfinite(value.real):
            return value.real
    return None


# ----------------------------------------------------------------------------------------------
# Grading


def grade(response, gold, dataset=None, timeout_s=5.0, format_bonus=0.0):
    """Reward of one response against its gold answer: (reward, info). Never raises.

    info: {"reason": one of REASONS, "extracted": boxed answer or None, "seconds": time spent}
    """
    t0 = time.perf_counter()
    info = {"reason": "error", "extracted": None}
    try:
        with _time_limit(timeout_s):
            info["reason"] = _grade(str(response), str(gold), dataset, info)
    except GradeTimeout:
        info["reason"] = "timeout"
    except Exception as e:  # the grader must not take a run down; the reason says what happened
        info["reason"], info["error"] = "error", f"{type(e).__name__}: {e}"[:300]
    info["seconds"] = time.perf_counter() - t0
    if info["reason"] == "correct":
        return 1.0, info
    bonus = format_bonus if info["reason"] in ("wrong", "unparsable") else 0.0
    return bonus, info


def _grade(response, gold, dataset, info):
    boxes = final_boxed(response)
    if not boxes:
        return "no_box"
    boxed = ", ".join(boxes)
    info["extracted"] = boxed[:MAX_ANSWER_CHARS]
    if len(boxed) > MAX_ANSWER_CHARS or not boxed.strip():
        return "unparsable"
    gold_latex = _common(normalize_gold(gold, dataset))
    pred_latex = ", ".join(_from_e_notation(_common(part)) for part in boxes)
    if (dataset or "").lower().startswith("gsm8k"):
        pred_latex = re.sub(r"(?<=\d),(?=\d{3}\b)", "", pred_latex)
    text = _TEXT_GOLD.match(gold_latex)
    if text:
        return ("correct" if _as_text(pred_latex) == _as_text(text.group(1)) and pred_latex
                else "wrong")

    from math_verify import verify  # math-verify: only where answers are graded
    with _no_string_eval():
        gold_parsed = _parse_latex(gold_latex)
        pred_parsed = _parse_latex(pred_latex)
        if not pred_parsed:
            return "unparsable"
        if not gold_parsed:  # an answer math-verify cannot read: compare the normalized texts
            return "correct" if _as_text(pred_latex) == _as_text(gold_latex) else "wrong"
        tolerance = (_significant_tolerance(gold_latex)
                     if (dataset or "").lower().startswith("minerva") else None)
        if tolerance is not None:
            g, p = _as_number(gold_parsed[0]), _as_number(pred_parsed[0])
            if g is not None and p is not None:
                return "correct" if abs(p - g) <= tolerance * (1 + 1e-9) else "wrong"
        ok = verify(gold_parsed, pred_parsed, timeout_seconds=None)
    return "correct" if ok else "wrong"


def format_reward(response):
    """Optional shaping: 1.0 when the response contains a complete \\boxed{...}, else 0.0."""
    return 1.0 if last_boxed(str(response)) is not None else 0.0
