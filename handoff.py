"""Resident mode's hand-off (DESIGN.md §2): how the long-lived engine process (generate.py --resident) and
trainer process (optimize.py --resident) pass stages to each other, through files, as rollouts.py is the
contract of the process-per-phase loop.

    <run>/stage_<s>/rollouts/manifest.json     the engine → the trainer: stage s is generated (rollouts.py)
    <run>/resident/trained_<s>.json            the trainer → the engine: the policy trained on stage s (it
                                               generates stage s + 1): where to load it from, its label
    <run>/resident/<role>.json                 each process's pid and start time, so the other can tell it died
    <fast dir>/policy_<s>/                     the policies handed over (bf16 safetensors; /dev/shm when it
                                               has room), the last two kept

A process that waits checks its partner every poll: a partner that died (or never started) is an error within
seconds, not a hang. Resume needs no file of its own: the engine starts at the first stage without a manifest,
the trainer at the last train state saved in the run directory, and every flag of an earlier attempt is
cleared before either starts (`reset`).
"""
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import common

START_GRACE_S = 600.0   # how long a process waits for its partner to announce itself (a cold vLLM or torch start)


def state_dir(run_dir):
    return Path(run_dir) / "resident"


def fast_dir(run_dir, needed_bytes=0):
    """Where policies are handed over: a directory in /dev/shm (memory; named after the run directory) when it
    has room for two of them, else <run>/resident/policies."""
    run = Path(run_dir).resolve()
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * needed_bytes:
        return shm / f"mu-grpo-{hashlib.sha256(str(run).encode()).hexdigest()[:12]}"
    return state_dir(run) / "policies"


def reset(run_dir):
    """Clear an earlier attempt's flags, pid files and handed-over policies (run_stages.sh, before it starts the
    two processes)."""
    shutil.rmtree(state_dir(run_dir), ignore_errors=True)
    shutil.rmtree(fast_dir(run_dir), ignore_errors=True)
    state_dir(run_dir).mkdir(parents=True)


def _start_time(pid):
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): a pid and this pair name
    one process, even after the pid is reused. None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def finish(run_dir):
    """After a complete run: the handed-over policies are gone (the run directory keeps the saved ones)."""
    shutil.rmtree(fast_dir(run_dir), ignore_errors=True)
    shutil.rmtree(state_dir(run_dir) / "policies", ignore_errors=True)


class Partner:
    """One side of the hand-off: announces this process, waits for the other's files while watching it live."""

    def __init__(self, run_dir, role):
        if role not in ("engine", "trainer"):
            raise ValueError(f"role must be engine or trainer, got {role!r}")
        self.run_dir, self.role = Path(run_dir), role
        self.other = "trainer" if role == "engine" else "engine"
        self.dir = state_dir(run_dir)
        self.started = time.monotonic()

    def announce(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        common.atomic_write_json(self.dir / f"{self.role}.json", {"pid": os.getpid(), "start": _start_time(os.getpid())})

    def check_partner(self):
        """Raise SystemExit if the other process died, or has not announced itself within START_GRACE_S."""
        path = self.dir / f"{self.other}.json"
        if not path.exists():
            if time.monotonic() - self.started > START_GRACE_S:
                raise SystemExit(f"the {self.other} process has not started within {START_GRACE_S:.0f} s ({path} is "
                                 f"missing): see its log")
            return
        info = json.loads(path.read_text())
        if _start_time(info["pid"]) != info["start"]:
            raise SystemExit(f"the {self.other} process (pid {info['pid']}) has died: see its log; rerun to resume")

    def wait(self, ready, watch=None, poll_s=0.05):
        """Wait until ready() is true, checking the partner (and calling watch(), which raises on a failure of
        the caller's own: its engine processes) at every poll; returns the seconds waited."""
        t0 = time.perf_counter()
        while not ready():
            self.check_partner()
            if watch is not None:
                watch()
            time.sleep(poll_s)
        return time.perf_counter() - t0

    def timeline(self, row):
        """Append a row of this process's (row: phase, name, stage, start, end, ...) to <run>/timeline.jsonl."""
        common.append_jsonl(self.run_dir / "timeline.jsonl",
                            {**row, "seconds": row["end"] - row["start"], "process": self.role})

    # the trainer → the engine

    def publish_policy(self, stage, path, label, fingerprint, updates):
        """The policy trained on `stage` is at `path` (complete); `label` is its run-directory name, updates the
        run's updates so far."""
        common.atomic_write_json(self.dir / f"trained_{stage}.json", {
            "stage": stage, "path": str(path), "policy": str(label), "fingerprint": fingerprint, "updates": updates})

    def trained(self, stage):
        """The flag of the policy trained on `stage`, or None."""
        path = self.dir / f"trained_{stage}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def wait_for_policy(self, stage):
        """(flag, seconds waited) of the policy trained on `stage`."""
        seconds = self.wait(lambda: self.trained(stage) is not None)
        return self.trained(stage), seconds

    # the engine → the trainer

    def manifest(self, stage):
        return self.run_dir / f"stage_{stage}" / "rollouts" / "manifest.json"

    def wait_for_rollouts(self, stage):
        """Seconds waited until stage `stage`'s rollouts are complete (their manifest is written last)."""
        return self.wait(lambda: self.manifest(stage).exists())
