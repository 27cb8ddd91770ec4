"""Process supervision, one implementation of each piece: which process a pid is (its start time, so that a reused
pid is not taken for the process that had it), whether it lives, the processes below it and stopping them all, and the
data-parallel engine processes generate.py and evaluate.py start (each in a session of its own, ended with its
parent however the parent dies).

    start_time(pid), same_process(pid, start)   a process named by its pid and start time (mu_grpo/handoff.py's partner)
    alive(pid)                                   running (not exited, not a zombie)
    descendants(root), stop_tree(root, grace_s)  every process below root; SIGTERM to them all, SIGKILL after grace_s
                                                 (mu_grpo/nodes.py's watch, frontier.sh's workers)
    run_together(commands, logs)                 commands side by side, each one's output into its log; a failed one
                                                 stops the others (the resident pair: run_stages.sh, the preflight)
    start_workers, stop_workers, run_workers     the engine processes: `script argv --worker_rank=r --engines=n`
    terminate_with_parent(parent)                in a child before exec: SIGTERM when its parent dies
    exit_on_sigterm()                            SIGTERM → SystemExit, so finalizers run (a process holding an engine)

Only the standard library; Linux (/proc, prctl).
"""
import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# ----------------------------------------------------------------------------- which process, and does it live


def _stat(pid):
    """The fields of /proc/<pid>/stat after the command name (field 3, the state, first), or None if there is no
    such process. The name is in parentheses and may hold spaces and ')' itself: the fields start after the last ')'."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def start_time(pid):
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): a pid and this pair name
    one process, even after the pid is reused. None if there is no such process."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def same_process(pid, start):
    """Whether pid is still the process whose start_time was `start` (recorded when it announced itself): False once
    it has exited and been reaped, or when its pid now names another process. A zombie (exited, not yet reaped by its
    parent) still counts: see alive."""
    return start_time(pid) == start


def alive(pid):
    """Whether the process runs: it exists and is not a zombie (exited, its parent has not reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def descendants(*roots):
    """Every process below any of roots (by parent pid, from one read of /proc), children before grandchildren."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int(_stat(entry.name)[1])
            except (TypeError, IndexError, ValueError):
                continue          # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(roots)
    while todo:
        kids = children.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found


def _signal(pids, sig):
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def _freeze(roots, me):
    """SIGSTOP every process in roots and below them (except me), again and again until a scan finds no new one: a
    stopped process cannot start another, so the list returned (parents before children) is the whole tree. Without
    it, a process started between a scan of /proc and the signal that kills its parent escapes to init (frontier.sh's
    stop once left generate.py's grading forkserver running, started while the tree was read)."""
    frozen, seen = [], set()
    todo = [p for p in roots if p != me]
    while todo:
        for p in todo:
            if p not in seen:
                frozen.append(p)
                seen.add(p)
        _signal(todo, signal.SIGSTOP)
        deadline = time.monotonic() + 1.0   # stopped on its way back to user space: a fork under way completes first
        while time.monotonic() < deadline and any((_stat(p) or "Z")[0] not in "TtZX" for p in todo):
            time.sleep(0.005)
        todo = [p for p in descendants(*todo) if p != me and p not in seen]
    return frozen


def stop_tree(root, grace_s=5.0, start=None):
    """SIGTERM to root and every process below it (those in sessions of their own included, e.g. engine workers:
    taken before their parents die and they move to init), SIGKILL to any left grace_s later; the calling process is
    spared when it is below root (mu_grpo/nodes.py's watch under run_stages.sh). The tree is frozen (SIGSTOP) while it is
    read, before either signal, so no process started meanwhile is missed; one started during the grace by a process
    still alive is found then. start: root's start_time when it was recorded; if root is no longer that process (it
    ended and its pid was reused), nothing is stopped. Returns whether anything was signalled."""
    if start is not None and not same_process(root, start):
        return False
    me = os.getpid()
    procs = _freeze([root], me)
    _signal(procs, signal.SIGTERM)
    _signal(reversed(procs), signal.SIGCONT)     # children first: each ends on its SIGTERM before its parent sees it
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        living = [p for p in procs if alive(p)]
        if not living:
            break
        started = [c for c in descendants(*living) if c != me and c not in procs]
        _signal(started, signal.SIGTERM)
        procs += started
        time.sleep(0.1)
    survivors = [p for p in procs if alive(p)]
    _signal(_freeze(survivors, me), signal.SIGKILL)
    return True


def _copy_output(stream, log_path, view):
    """A child's output appended to its log (all of it) and, with view, handed on as it comes (view(a binary stream):
    run_stages.sh's terminal view, as `cmd 2>&1 | tee -a LOG | view`)."""
    if view is not None:
        read_fd, write_fd = os.pipe()
        viewer = threading.Thread(target=view, args=(os.fdopen(read_fd, "rb"),), daemon=True)
        viewer.start()
        to_view = os.fdopen(write_fd, "wb")
    with open(log_path, "ab") as log:
        while chunk := stream.read1(1 << 16):
            log.write(chunk)
            log.flush()
            if view is not None:
                to_view.write(chunk)
                to_view.flush()
    if view is not None:
        to_view.close()
        viewer.join()


def run_together(commands, logs, grace_s=10.0, view=None, **popen):
    """Run commands side by side (name → argv), each one's output appended to its log (name → path) and shown through
    view. The first to fail stops the others and everything they started (stop_tree, by pid and start time: a failed
    one is reaped, so its pid may be reused). Returns (the name of the one that failed first or None, {name: exit
    status})."""
    procs, started, copiers = {}, {}, []
    for name, cmd in commands.items():
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)
        started[name] = start_time(procs[name].pid)
        copiers.append(threading.Thread(target=_copy_output, args=(procs[name].stdout, logs[name], view)))
        copiers[-1].start()
    failed = None
    while failed is None and any(p.poll() is None for p in procs.values()):
        failed = next((name for name, p in procs.items() if p.poll() not in (None, 0)), None)
        time.sleep(0.1)
    failed = failed or next((name for name, p in procs.items() if p.returncode != 0), None)
    if failed:
        for name, p in procs.items():
            stop_tree(p.pid, grace_s=grace_s, start=started[name])
    for c in copiers:
        c.join()
    return failed, {name: p.wait() for name, p in procs.items()}


# ----------------------------------------------------------------------------- the engine processes


def start_workers(script, argv, environments):
    """Start `script argv --worker_rank=r --engines=n` for each environment r of the n (engine.worker_environments:
    each on its GPU group), each leading its own process group (its vLLM engine core, GPU workers and grader pool are
    in it), and each ended by a SIGTERM when this process dies, however it dies: a SIGKILL to this process (or to
    run_stages.sh's process group, which the workers are not in) would otherwise leave them generating, holding their
    GPUs, beside the rerun's own engines. Returns the processes."""
    n = len(environments)
    return [subprocess.Popen([sys.executable, script, *argv, f"--worker_rank={r}", f"--engines={n}"],
                             env=env, start_new_session=True,
                             preexec_fn=functools.partial(terminate_with_parent, os.getpid()))
            for r, env in enumerate(environments)]


def terminate_with_parent(parent):
    """In a child, before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG, kept across exec; a
    parent that died before this call is caught by the getppid check). The child still runs the parent's Python
    signal handlers until exec: a parent's SIGTERM handler (exit_on_sigterm) would turn that SIGTERM into an
    exception here instead of the child's end, so the child ends by the default action."""
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def stop_workers(procs, grace_s=10):
    """SIGTERM to each worker's process group (vLLM's engine core shuts down on it, vllm/v1/engine/core.py
    `signal_handler`), SIGKILL to a group still alive grace_s later (the GPU driver frees a killed process's
    memory). No orphan engine is left holding a GPU. (stop_tree walks a tree by parent pid instead: it also takes
    processes that left their group, and needs no Popen.)"""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group may outlive its leader
            os.killpg(p.pid, signal.SIGKILL)


def run_workers(script, argv, environments):
    """Run the workers (start_workers) and wait for them; a SIGTERM or Ctrl-C to this process stops them all
    (stop_workers) before it exits. Returns their exit codes."""
    procs = []

    def stop(signum, frame):
        stop_workers(procs)
        raise SystemExit(f"stopped by signal {signum}; engine processes terminated")

    old = signal.signal(signal.SIGTERM, stop)
    try:
        procs += start_workers(script, argv, environments)
        return [p.wait() for p in procs]
    except KeyboardInterrupt:
        stop(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGTERM, old)


def exit_on_sigterm():
    """Turn SIGTERM into SystemExit in a process that holds a vLLM engine, so that vLLM's finalizers run
    and shut its engine core down (a process killed by the default SIGTERM action runs none)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
