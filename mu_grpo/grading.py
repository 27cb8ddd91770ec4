"""Grading many answers at once: a pool of worker processes with a hard limit per item, over reward.py's pure grader.

    grade_batch(items, workers=N, timeout_s=...)  → [(reward, info), ...]  in input order

Each item gets timeout_s seconds in its worker (reward.grade's own SIGALRM limit); a worker still busy 1 s after
that (a C-level sympy call that never returns to the interpreter) is killed and replaced, and the item gets reward 0
with reason `timeout`. workers=0 grades in the calling process (the soft limit only).
"""
import contextlib
import multiprocessing as mp
import signal
import threading
import time
from collections import deque
from multiprocessing.connection import wait

from reward import grade

# ----------------------------------------------------------------------------------------------
# The pool
#
# The workers live as long as the process and serve every grade_batch call: starting one costs more
# than grading thousands of answers. A forkserver child re-runs the parent's main script before its
# first task (multiprocessing/spawn.py `prepare`: the forkserver's own '__main__' preload never happens
# on Python 3.11, forkserver.py `ensure_running` asks for 'main_path' where spawn.py writes
# 'init_main_from_path'), which for generate.py means importing torch: about 1.5 s of CPU per worker.
# Per call, on a machine whose cores the engine needs, that cost 30 % of generate.py's tokens/s
# (bench/bench_generate.py); once per process it is paid during the engine's start-up.


def _worker(conn):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        index, reward_fn, timeout_s, (response, gold, dataset) = task
        try:
            result = reward_fn(response, gold, dataset, timeout_s=timeout_s)
        except Exception as e:  # a custom reward_fn may raise; report it on the item
            result = (0.0, {"reason": "error", "extracted": None, "error": repr(e)[:300]})
        conn.send((index, result))


class _Slot:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.task = None  # (item index, hard deadline, start time) while busy

    def stop(self, kill=False):
        if kill:
            self.proc.kill()
        else:
            with contextlib.suppress(OSError, BrokenPipeError):
                self.conn.send(None)
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


_pool = []                      # this process's grading workers (_Slot), shared by grade_batch calls
_pool_lock = threading.RLock()  # one grade_batch (or start/stop) at a time uses them


def _failed(reason, seconds, error=None):
    info = {"reason": reason, "extracted": None, "seconds": seconds}
    if error:
        info["error"] = error
    return 0.0, info


def start_graders(workers=0):
    """Start the process that forks grade_batch's workers, with math-verify and sympy imported (a few
    seconds), and `workers` workers, unless they run already; call it early (e.g. before loading a
    model) to keep that time out of the first grade_batch. Returns the multiprocessing context."""
    from multiprocessing import forkserver  # forkserver: only when graders start
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "reward", "math_verify", "sympy"])
    forkserver.ensure_running()
    with _pool_lock:
        while len(_pool) < workers:
            _pool.append(_Slot(ctx))
    return ctx


def stop_graders():
    """Stop this process's grading workers (they also exit with it: daemonic, and their pipe closes)."""
    with _pool_lock:
        while _pool:
            _pool.pop().stop()


def grade_batch(items, workers=2, timeout_s=10.0, reward_fn=grade, progress=None):
    """Grade many items in worker processes; results in input order.

    items: iterable of (response, gold) or (response, gold, dataset) tuples, or dicts with keys
    response, gold and optionally dataset. reward_fn(response, gold, dataset, timeout_s=...) →
    (reward, info), a module-level function (it is sent to the workers); default `grade`.
    Each item gets timeout_s seconds inside its worker; a worker still busy 1 s after that is
    killed and replaced, and the item gets reward 0 with reason `timeout`. workers=0 grades
    in this process (soft time limit only). The workers are kept for the next call (start_graders,
    stop_graders). progress: optional callable(n_done).
    """
    tasks = []
    for item in items:
        if isinstance(item, dict):
            tasks.append((item["response"], item["gold"], item.get("dataset")))
        else:
            tasks.append((item[0], item[1], item[2] if len(item) > 2 else None))
    if workers <= 0:
        out = []
        for i, task in enumerate(tasks):
            out.append(reward_fn(*task, timeout_s=timeout_s))
            if progress:
                progress(i + 1)
        return out
    if not tasks:
        return []

    with _pool_lock:
        ctx = start_graders(min(workers, len(tasks)))
        slots = _pool[:min(workers, len(tasks))]
        results = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        done = 0
        try:
            while done < len(tasks):
                for slot in slots:
                    if slot.task is None and pending:
                        i = pending.popleft()
                        slot.conn.send((i, reward_fn, timeout_s, tasks[i]))
                        slot.task = (i, time.monotonic() + timeout_s + 1.0, time.monotonic())
                busy = [s for s in slots if s.task is not None]
                next_deadline = min(s.task[1] for s in busy)
                ready = wait([s.conn for s in busy], timeout=max(0.0, next_deadline - time.monotonic()))
                for k, slot in enumerate(slots):
                    if slot.task is None:
                        continue
                    i, deadline, started = slot.task
                    if slot.conn in ready:
                        try:
                            index, result = slot.conn.recv()
                        except (EOFError, OSError):  # the worker died (e.g. out of memory)
                            index, result = i, _failed("error", time.monotonic() - started, "worker died")
                            slots[k] = _replace(slot, ctx)
                        else:
                            slot.task = None
                    elif time.monotonic() > deadline:
                        index, result = i, _failed("timeout", time.monotonic() - started)
                        slots[k] = _replace(slot, ctx)
                    else:
                        continue
                    results[index] = result
                    done += 1
                    if progress:
                        progress(done)
        except BaseException:  # interrupted mid-batch: the workers' pipes hold unread tasks or results
            for slot in slots:
                if slot in _pool:
                    _pool.remove(slot)
                slot.stop(kill=True)
            raise
    return results


def _replace(slot, ctx):
    """Kill a worker that overran or died and put a fresh one in its place in the pool."""
    slot.stop(kill=True)
    fresh = _Slot(ctx)
    _pool[_pool.index(slot)] = fresh
    return fresh
