"""mu_grpo/processes.py, with real processes (sleeps, shells and tiny Pythons; a few seconds in all): a process named by pid
and start time, liveness, stopping a tree with a grace period, the engine workers' start, stop and death with
their parent."""
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time

from mu_grpo import processes
from conftest import ROOT


def wait_until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(0.02)


def test_a_process_is_named_by_its_pid_and_start_time():
    child = subprocess.Popen(["sleep", "30"])
    try:
        start = processes.start_time(child.pid)
        assert isinstance(start, int) and start >= processes.start_time(os.getpid())   # started after this one
        assert processes.same_process(child.pid, start)
        assert not processes.same_process(child.pid, start + 1)   # the pid of another process, started later
        assert not processes.same_process(child.pid, start - 1)
        assert processes.alive(child.pid)
        child.kill()
        wait_until(lambda: not processes.alive(child.pid))       # a zombie, not reaped yet: not alive
        assert processes.same_process(child.pid, start)           # ... but still that process's pid
    finally:
        child.kill()
        child.wait()
    assert processes.start_time(child.pid) is None               # reaped: no such process
    assert not processes.same_process(child.pid, start) and not processes.alive(child.pid)


def test_a_process_name_with_spaces_and_parentheses_is_read_right(tmp_path):
    # /proc/<pid>/stat's second field is the name in parentheses, which may hold ") " itself
    odd = tmp_path / "a) b (c"
    odd.symlink_to("/bin/sleep")
    child = subprocess.Popen([str(odd), "30"])
    try:
        wait_until(lambda: "a) b (c" in open(f"/proc/{child.pid}/stat").read())
        assert processes.start_time(child.pid) >= processes.start_time(os.getpid())
        assert processes.alive(child.pid) and processes.descendants(os.getpid()).count(child.pid) == 1
    finally:
        child.kill()
        child.wait()


CHILD = "trap 'echo term >> {log}; exit 0' TERM; sleep 300 & wait"      # leaves a line when SIGTERM ends it
ROOT_SCRIPT = """import signal, subprocess, sys, time
for _ in range(int(sys.argv[1])):
    subprocess.Popen(["bash", "-c", sys.argv[2]])
if sys.argv[3] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[4], "w").close()
time.sleep(300)
"""


def tree(log, children=2, root_ignores_term=True):
    """A process with `children` shells, each with a sleep below it; the root itself ignores SIGTERM."""
    ready = f"{log}.ready"
    root = subprocess.Popen([sys.executable, "-c", ROOT_SCRIPT, str(children), CHILD.format(log=log),
                             "ignore" if root_ignores_term else "obey", ready], start_new_session=True)
    wait_until(lambda: os.path.exists(ready) and len(processes.descendants(root.pid)) == 2 * children)
    os.remove(ready)
    return root


def test_stopping_a_tree_sends_sigterm_then_sigkill_after_the_grace(tmp_path):
    log = tmp_path / "terms"
    root = tree(log)
    below = processes.descendants(root.pid)
    assert len(below) == 4                                       # two shells, a sleep below each
    t0 = time.monotonic()
    assert processes.stop_tree(root.pid, grace_s=1.0)
    seconds = time.monotonic() - t0
    assert root.wait(timeout=5) == -signal.SIGKILL and seconds >= 1.0    # the root ignored SIGTERM: killed after 1 s
    assert log.read_text() == "term\nterm\n"                     # the shells ended on the SIGTERM
    wait_until(lambda: not any(processes.alive(p) for p in below))
    # a tree that obeys SIGTERM is not waited on for the whole grace
    root = tree(log, children=1, root_ignores_term=False)
    t0 = time.monotonic()
    processes.stop_tree(root.pid, grace_s=30.0)
    assert time.monotonic() - t0 < 5 and root.wait(timeout=5) == -signal.SIGTERM


def test_a_process_started_while_the_tree_is_stopped_is_stopped_with_it():
    # a root that starts a sleep every few ms: one started between a read of /proc and the root's SIGTERM would be
    # left to init (frontier.sh's stop once left a grading forkserver that generate.py started just then)
    marker = f"299.{os.getpid()}"
    code = ("import os, sys, time\nwhile True:\n    if os.fork() == 0:\n        os.execvp('sleep', ['sleep', sys.argv[1]])\n"
            "    time.sleep(0.002)")
    root = subprocess.Popen([sys.executable, "-c", code, marker], start_new_session=True)

    def sleeps():
        return [p for p in os.listdir("/proc") if p.isdigit() and marker.encode() in _cmdline(p)]
    try:
        wait_until(lambda: len(sleeps()) >= 50)
        assert processes.stop_tree(root.pid, grace_s=2.0)
        assert root.wait(timeout=5) == -signal.SIGTERM
        time.sleep(0.5)                                          # a sleep's SIGTERM is taken at once
        assert not [p for p in sleeps() if processes.alive(int(p))], "a sleep outlived its stopped tree"
    finally:
        for p in sleeps():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(p), signal.SIGKILL)


def _cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""


def test_a_tree_is_stopped_only_if_its_root_is_still_the_process_recorded(tmp_path):
    root = tree(tmp_path / "terms", children=1, root_ignores_term=False)
    start = processes.start_time(root.pid)
    assert not processes.stop_tree(root.pid, grace_s=0.5, start=start + 1)    # another process with that pid
    time.sleep(0.2)
    assert root.poll() is None and len(processes.descendants(root.pid)) == 2
    assert processes.stop_tree(root.pid, grace_s=0.5, start=start)
    assert root.wait(timeout=5) == -signal.SIGTERM


def test_the_process_that_stops_a_tree_it_is_in_is_spared():
    # mu_grpo/nodes.py's watch runs below the run_stages.sh it stops
    code = ("import os; from mu_grpo import processes; below = processes.descendants(os.getppid()); "
            "processes.stop_tree(os.getppid(), grace_s=0.5); print(os.getpid(), *below)")
    root = subprocess.Popen(["bash", "-c", f"sleep 300 & {sys.executable} -c \"{code}\"; sleep 300"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = root.communicate(timeout=20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(root.pid, signal.SIGKILL)
    assert root.returncode == -signal.SIGTERM
    me, *below = [int(p) for p in out.split()]                   # the stopping process went on to say so
    others = [p for p in below if p != me]
    assert me in below and len(others) == 1 and not processes.alive(others[0])    # the sleep is gone


def test_a_child_is_terminated_when_its_parent_dies():
    # the parent starts a sleep that is to end with it, says its pid, and is SIGKILLed
    code = ("import functools, os, signal, subprocess; from mu_grpo import processes; "
            "p = subprocess.Popen(['sleep', '300'], preexec_fn=functools.partial(processes.terminate_with_parent, "
            "os.getpid())); print(p.pid, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    parent = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert parent.returncode == -signal.SIGKILL
    child = int(parent.stdout)
    wait_until(lambda: not processes.alive(child), timeout_s=5)
    # a parent that died before the child could ask: the child ends at once (a pid that is not its parent's), also
    # when the parent handles SIGTERM in Python (exit_on_sigterm, as an engine's process does): the child has that
    # handler until exec, and ended by raising from it, not by the signal
    old = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        late = subprocess.Popen(["sleep", "300"], preexec_fn=functools.partial(processes.terminate_with_parent, 1))
    finally:
        signal.signal(signal.SIGTERM, old)
    assert late.wait(timeout=5) == -signal.SIGTERM


WORKER = """import os, signal, subprocess, sys, time
args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
with open(os.path.join(args["out"], "worker_" + args["worker_rank"]), "w") as f:
    f.write(" ".join([args["engines"], os.environ["MARK"], str(os.getsid(0) == os.getpid())]))
if args.get("hang"):                    # ignores SIGTERM, with a child in its process group that does not
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(args["out"], "child_" + args["worker_rank"]), "w") as f:
        f.write(str(child.pid))
    time.sleep(300)
sys.exit(int(args["worker_rank"]))
"""


def test_workers_run_each_in_its_session_with_its_environment_and_their_codes_come_back(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    envs = [dict(os.environ, MARK="first"), dict(os.environ, MARK="second")]
    assert processes.run_workers(str(script), [f"--out={tmp_path}"], envs) == [0, 1]
    assert (tmp_path / "worker_0").read_text() == "2 first True"
    assert (tmp_path / "worker_1").read_text() == "2 second True"


def test_stopping_workers_kills_their_groups_after_the_grace(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = processes.start_workers(str(script), [f"--out={tmp_path}", "--hang=1"], [dict(os.environ, MARK="x")] * 2)
    wait_until(lambda: all((tmp_path / f"child_{r}").exists() for r in range(2)))
    children = [int((tmp_path / f"child_{r}").read_text()) for r in range(2)]
    t0 = time.monotonic()
    processes.stop_workers(procs, grace_s=0.5)
    assert time.monotonic() - t0 >= 0.5 and [p.wait(timeout=5) for p in procs] == [-signal.SIGKILL] * 2
    wait_until(lambda: not any(processes.alive(c) for c in children), timeout_s=5)
