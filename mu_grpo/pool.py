"""Tasks side by side, JOBS at a time, each in a slot of its own: frontier.sh's runs (tools/sweep.py) and ablate.sh's
replays. A free slot takes the next task no slot has taken. Slot k has its JOBS-th of this process's cores (pinned as
taskset pins, torch's and vLLM's OpenMP threads as many: tests/conftest.py pins its workers the same way) and, on a
GPU box, the environment the caller gives it (its GPUs). With JOBS=1 a task has the whole machine, unpinned.

A failed task stops the others (each one's whole process tree, processes.stop_tree), and so does SIGINT or SIGTERM to
this process (exit 130); a rerun starts over, skipping the tasks marked done (--done) or that resume themselves
(run_stages.sh). For a shell script, one task per line of stdin, its name and then a bash command:

    printf '%s\\n' "replay_grpo_seed0 replay grpo 0" "replay_grpo_seed1 replay grpo 1" \\
        | python -m mu_grpo.pool --jobs=2 --logs=runs/x/logs --done=runs/x/.done

(each task's output in <logs>/<name>.log; <done>/<name> once it succeeded; the functions and variables the commands
use exported by the script: `export -f`).
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mu_grpo import common, processes

jobs = 1                        # tasks at once, each in its own slot
logs = ""                       # the command line's: each task's output goes to <logs>/<name>.log
done = ""                       # the command line's: <done>/<name> marks a finished task (skipped on a rerun)


def slots(n_jobs, environments=None):
    """Each of n_jobs slots' environment and cores: its n_jobs-th of this process's cores (with more jobs than cores,
    one core, shared), environments[k] added (a GPU box's CUDA_VISIBLE_DEVICES and GPUS); n_jobs = 1: no cores,
    the whole machine. Returns [(cores, environment)]."""
    environments = environments or [{}] * n_jobs
    if n_jobs == 1:
        return [([], environments[0])]
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // n_jobs
    out = []
    for k in range(n_jobs):
        mine = cores[k * per:(k + 1) * per] if per else [cores[k % len(cores)]]
        threads = {"OMP_NUM_THREADS": str(len(mine)), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, mine))}
        out.append((mine, {**threads, **environments[k]}))
    return out


def gpu_slices(n_gpus, n_jobs, visible):
    """The CUDA_VISIBLE_DEVICES of each of n_jobs runs at once: an even share of the box's n_gpus GPUs (the first n_gpus
    of `visible`, the box's CUDA_VISIBLE_DEVICES, else 0..n_gpus−1), so no two runs' engines share a GPU and every run
    has as many GPUs, and their times compare; a split that cannot be even is refused in one line."""
    if n_jobs > n_gpus or n_gpus % n_jobs:
        sys.exit(f"JOBS={n_jobs} cannot split this box's {n_gpus} GPU(s) evenly between runs at once (every run the "
                 f"same share, so their times compare): use a JOBS that divides {n_gpus}, or JOBS=1")
    ids = visible.split(",")[:n_gpus] if visible else [str(i) for i in range(n_gpus)]
    if len(ids) < n_gpus:
        sys.exit(f"CUDA_VISIBLE_DEVICES={visible} names fewer than the {n_gpus} GPUs to split (GPUS={n_gpus})")
    per = n_gpus // n_jobs
    return [",".join(ids[k * per:(k + 1) * per]) for k in range(n_jobs)]


def run(tasks, slot_list, started=None, finished=None):
    """tasks: [(name, argv, environment, log path)], run in order in slot_list's slots (slots()); started(index, name,
    cores, environment) is called as each starts (its line on the terminal), finished(index) as each succeeds.
    Returns once all succeeded; after the first failure stops the rest and exits 1 naming it and its log's last lines;
    on SIGINT or SIGTERM stops them all and exits 130."""
    running = {}                                   # slot → (process, its start time, task index)
    def stop_all(signum=None, frame=None):         # noqa: E306
        for proc, start, _ in running.values():
            processes.stop_tree(proc.pid, start=start)
        if signum is not None:
            sys.exit(130)
    old = {s: signal.signal(s, stop_all) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        todo = list(enumerate(tasks))
        while todo or running:
            for slot in [k for k in range(len(slot_list)) if k not in running]:
                if not todo:
                    break
                i, (name, argv, env, log) = todo.pop(0)
                cores, slot_env = slot_list[slot]
                if started:
                    started(i, name, cores, slot_env)
                Path(log).parent.mkdir(parents=True, exist_ok=True)
                with open(log, "w") as out:
                    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, **env, **slot_env},
                                            preexec_fn=(lambda c=cores: os.sched_setaffinity(0, c)) if cores else None)
                running[slot] = (proc, processes.start_time(proc.pid), i)
            time.sleep(0.2)
            for slot, (proc, _, i) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[slot]
                if proc.returncode == 0 and finished:
                    finished(i)
                elif proc.returncode != 0:
                    name, log = tasks[i][0], tasks[i][3]
                    stop_all()
                    tail = Path(log).read_text(errors="replace").splitlines()[-10:]
                    sys.exit(f"{name} failed (exit {proc.returncode}); see {log} (rerun to resume):\n"
                             + "\n".join(tail))
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def main():
    """The command line: tasks from stdin (name, then a bash command), skipping those marked done."""
    tasks = []
    for n, line in enumerate(sys.stdin, 1):
        if line.strip():
            name, _, command = line.strip().partition(" ")
            if not command:
                sys.exit(f"stdin line {n}: '{line.strip()}' has a name and no command (name, then a bash command)")
            if not (Path(done) / name).exists():
                tasks.append((name, ["bash", "-c", command], {}, str(Path(logs) / f"{name}.log")))
    t0 = time.time()

    def started(i, name, cores, env):
        print(f"[{name}] {i + 1}/{len(tasks)} at {time.time() - t0:.0f} s{', cores ' if cores else ''}"
              f"{','.join(map(str, cores))}", flush=True)
    Path(done).mkdir(parents=True, exist_ok=True)       # each marked as it succeeds: a later failure keeps the mark
    run(tasks, slots(jobs), started, finished=lambda i: (Path(done) / tasks[i][0]).touch())


if __name__ == "__main__":
    common.apply_overrides(globals(), sys.argv[1:])
    if jobs < 1 or not logs or not done:
        sys.exit(f"--jobs must be at least 1 (got {jobs}), and --logs and --done name directories")
    main()
