"""mu_grpo/pool.py: tasks JOBS at a time, each slot on its share of the cores; a failure or a signal stops them all."""
import os
import signal
import subprocess
import sys
import time

import pytest

from mu_grpo import pool
from conftest import ROOT


def test_each_slot_has_its_share_of_the_cores_and_as_many_threads(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    assert pool.slots(2) == [([4, 5], {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "4,5"}),
                             ([6, 7], {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "6,7"})]
    assert [cores for cores, _ in pool.slots(3)] == [[4], [5], [6]]            # a core each, the fourth left idle
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert [cores for cores, _ in pool.slots(3)] == [[0], [1], [0]]            # more slots than cores: one shared
    assert pool.slots(1) == [([], {})]                                         # one: the whole machine, unpinned
    gpus = [{"CUDA_VISIBLE_DEVICES": "0,1", "GPUS": "2"}, {"CUDA_VISIBLE_DEVICES": "2,3", "GPUS": "2"}]
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in pool.slots(2, gpus)] == ["0,1", "2,3"]


def task(tmp_path, name, command):
    return name, ["bash", "-c", command], {}, str(tmp_path / f"{name}.log")


def test_tasks_run_jobs_at_a_time_in_order_each_pinned_to_its_slot(tmp_path):
    # four tasks of 0.5 s in two slots: two at once, taken in order; each sees its slot's cores and threads
    record = tmp_path / "record"
    here = sorted(os.sched_getaffinity(0))
    slot_list = [([here[0]], {"OMP_NUM_THREADS": "1", "SLOT": "a"}),       # (on one core both slots have it)
                 ([here[-1]], {"OMP_NUM_THREADS": "1", "SLOT": "b"})]
    cores = '$(taskset -pc $$ | cut -d: -f2 | tr -d " ")'
    command = f'echo "start $SLOT $OMP_NUM_THREADS {cores}" >> {record}; sleep 0.5; echo end >> {record}'
    starts, done = [], []
    pool.run([task(tmp_path, f"t{i}", command) for i in range(4)], slot_list,
             started=lambda i, name, cores, env: starts.append((i, env["SLOT"], cores)), finished=done.append)
    assert [i for i, _, _ in starts] == [0, 1, 2, 3] and [slot for _, slot, _ in starts[:2]] == ["a", "b"]
    assert all(cores == ([here[0]] if slot == "a" else [here[-1]]) for _, slot, cores in starts)
    assert sorted(done) == [0, 1, 2, 3]
    lines = record.read_text().splitlines()
    assert lines[:2] == [f"start a 1 {here[0]}", f"start b 1 {here[-1]}"]       # both started before either ended
    assert lines.count("end") == 4 and max(i for i, x in enumerate(lines) if x.startswith("start")) > 2


def test_a_failed_task_stops_the_others_and_is_named_with_its_log(tmp_path):
    marker, sleep = tmp_path / "never", f"302.{os.getpid()}"
    tasks = [task(tmp_path, "slow", f"sleep {sleep}; touch {marker}"),
             task(tmp_path, "bad", "echo its last words; exit 3"), task(tmp_path, "after", f"touch {marker}")]
    with pytest.raises(SystemExit) as stopped:
        pool.run(tasks, [([], {}), ([], {})])
    assert str(stopped.value).startswith(f"bad failed (exit 3); see {tmp_path / 'bad.log'}")
    assert "its last words" in str(stopped.value) and not marker.exists()     # the task after it never started
    assert not [p for p in os.listdir("/proc") if p.isdigit() and sleep.encode() in _cmdline(p)], "slow still runs"


def test_the_command_line_marks_each_task_done_and_a_rerun_skips_it(tmp_path):
    count = tmp_path / "count"
    lines = f"one echo 1 >> {count}\ntwo echo 2 >> {count}\n"
    args = [sys.executable, "-m", "mu_grpo.pool", "--jobs=2", f"--logs={tmp_path / 'logs'}", f"--done={tmp_path / 'done'}"]
    for _ in range(2):
        proc = subprocess.run(args, input=lines, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
    assert sorted(count.read_text().split()) == ["1", "2"]                    # each ran once
    assert sorted(os.listdir(tmp_path / "done")) == ["one", "two"]
    proc = subprocess.run(args, input="lonely\n", cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "stdin line 1: 'lonely' has a name and no command" in proc.stderr


def test_a_sigterm_to_the_pool_stops_every_task_it_started(tmp_path):
    started = tmp_path / "started"
    marker = f"301.{os.getpid()}"        # the sleeps' command line, to find them
    lines = "".join(f"t{i} touch {started}.{i}; sleep {marker}\n" for i in range(2))
    proc = subprocess.Popen([sys.executable, "-m", "mu_grpo.pool", "--jobs=2", f"--logs={tmp_path}", f"--done={tmp_path / 'd'}"],
                            stdin=subprocess.PIPE, cwd=ROOT, text=True)
    proc.stdin.write(lines)
    proc.stdin.close()
    deadline = time.monotonic() + 30
    while not all(os.path.exists(f"{started}.{i}") for i in range(2)):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 130
    left = [p for p in os.listdir("/proc") if p.isdigit() and marker.encode() in _cmdline(p)]
    assert not left, "a task outlived the stopped pool"
    assert not os.listdir(tmp_path / "d")                                      # neither is marked done


def _cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""
