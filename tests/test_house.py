"""The house's own bars (issue 55): what a reader of the code meets, checked on the source, not on a run."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_REQUIRED_PARAMETERS = 7


def sources():
    """The project's Python files outside tests (no venv, no hidden directory)."""
    return [f for f in sorted(ROOT.rglob("*.py")) if not any(p.startswith(".") or p == "tests"
                                                             for p in f.relative_to(ROOT).parts)]


def required_parameters(function):
    """A def's parameters a caller must give: positional ones without a default and keyword-only ones without one
    (self and cls not counted)."""
    a = function.args
    positional = a.posonlyargs + a.args
    required = len(positional) - len(a.defaults) + sum(d is None for d in a.kw_defaults)
    bound = positional and positional[0].arg in ("self", "cls") and len(a.defaults) < len(positional)
    return required - bool(bound)


def test_required_parameters_are_counted_as_a_caller_sees_them():
    def count(text):
        return required_parameters(ast.parse(text).body[0])
    assert count("def f(a, b, c=1, *, d, e=2): pass") == 3                         # a, b, d
    assert count("def f(self, a, /, b, *args, c, **kw): pass") == 3                # a, b, c
    assert count("def f(cls=None): pass") == 0


def test_no_function_takes_more_than_seven_required_parameters():
    # a long list of required parameters is settings read one by one or state that belongs in one object
    functions = [(f, n) for f in sources() for n in ast.walk(ast.parse(f.read_text()))
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    long = [f"{f.relative_to(ROOT)}:{n.lineno} {n.name} ({required_parameters(n)})" for f, n in functions
            if required_parameters(n) > MAX_REQUIRED_PARAMETERS]
    assert len(functions) > 100 and not long, "\n".join(long)


# the sizes the house agreed on (issue 55): a script read top to bottom stays readable in one sitting
SIZE_BARS = {"generate.py": 600, "optimize.py": 600, "run_stages.sh": 230, "frontier.sh": 150}


def test_the_scripts_stay_within_their_size_bars():
    sizes = {name: len((ROOT / name).read_text().splitlines()) for name in SIZE_BARS}
    assert {name: n for name, n in sizes.items() if n > SIZE_BARS[name]} == {}, sizes


def unexplained_imports(text):
    """The line numbers of imports made inside a function with no comment saying why: on the import's line, on the
    line above it, or on the first import of the run of imports it belongs to."""
    lines = text.splitlines()
    functions = [f for f in ast.walk(ast.parse(text)) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = sorted({n.lineno for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))})
    said = set()
    for i in inside:
        above = lines[i - 2].strip() if i > 1 else ""
        if "#" in lines[i - 1] or above.startswith("#") or (i - 1 in said and above.startswith(("import ", "from "))):
            said.add(i)
    return [i for i in inside if i not in said]


def test_an_import_inside_a_function_is_explained_by_hand():
    text = ("def f():\n"
            "    import a          # why\n"
            "    import b\n"                     # the run of imports that a's comment opens
            "    x = 1\n"
            "    import c\n"                     # not in that run: unexplained
            "    # why d and e\n"
            "    import d\n"
            "    from e import g\n")
    assert unexplained_imports(text) == [5]
    assert unexplained_imports("import os\n\ndef f():\n    return os\n") == []


def test_imports_are_at_the_top_unless_a_comment_says_why_not():
    # an import inside a function is a cost moved (a heavy library only the path that needs it loads), a cycle
    # broken, or a module found at run time: the comment says which
    found = [f"{f.relative_to(ROOT)}:{i}" for f in sources() for i in unexplained_imports(f.read_text())]
    assert not found, f"{len(found)} imports inside functions without a comment saying why:\n" + "\n".join(found)
