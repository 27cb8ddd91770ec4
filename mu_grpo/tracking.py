"""Watching a run: live metrics in TensorBoard or Weights & Biases (run_stages.sh REPORT_TO), and where the run
stands (a line per stage: updates done of the total, the last evaluation, an ETA from the measured phase times).

The trackers are fed from the run's own records, by one process on node 0 that follows them beside the phases:

    python -m mu_grpo.tracking --command=check --report_to=tensorboard,wandb   one line, before any phase, if a package is missing
    python -m mu_grpo.tracking --command=follow --run_dir=RUN --report_to=... --pid=PID --stop_file=F --settings="K=V..."
                                   every poll_s: the records' rows not yet logged go to every tracker; after a last
                                   pass it ends when F exists (run_stages.sh's exit), run_stages.sh (pid) has ended,
                                   or on SIGTERM
The stage line (where_line) is printed by run_stages.sh's stage step (mu_grpo/launch.py) and the resident trainer.

What goes in, each row at the step of the **recorded** run update (never recomputed) with the wall-clock hours
since the run started beside it:
    train/...     every line of stage_<s>/metrics.jsonl (per update: loss, ratio, clipped and vetoed fractions,
                  E[ρ|A<0], KL, entropy, grad norm, lr, staleness, tokens/s, ...)
    rollout/...   each stage's rollouts/manifest.json (reward, lengths, truncation, zero-variance groups, tokens/s), at
                  the run update its policy was trained to
    eval/<benchmark>/...   each results.jsonl row (avg@k, its standard error, pass@k), at its policy's run update
    time/...      each timeline.jsonl row (the seconds of every phase, and each phase's running total in hours)
The run's settings (run_stages.sh's knobs, then the first stage's optimize_config.json) are the tracker run's config.

One tracker run per run directory: TensorBoard's event files in <run>/tensorboard, W&B's run id kept in
<run>/tracking/wandb_id, so a killed and resumed run continues the same curves. Which rows went to the trackers is
written to <run>/tracking/logged.json *before* they are logged, so a resumed follower never logs a step twice. The
follower runs in a session of its own: a kill of run_stages.sh's process group (Ctrl-C, a scheduler's SIGKILL) leaves
it to notice, make its last pass and close its trackers, which then hold every row sent (a tracker's buffered rows
die with a process killed outright); the next follower of the run waits for it (<run>/tracking/.lock). Only a
follower itself killed outright loses the rows it had sent but its tracker had not written; the JSONL records keep
every row. With REPORT_TO=none nothing here is imported by any phase: the trackers are optional dependencies.
"""
import importlib.util
import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

from mu_grpo import common, processes, records

# ----------------------------------------------------------------------------- hyperparameters
# the command, the run and its trackers
command = ""                    # check | follow
run_dir = ""                    # the run directory (run_stages.sh RUN)
report_to = "none"              # none | tensorboard | wandb | a comma list of the last two

# follow
pid = 0                         # run_stages.sh's pid: following ends, after a last pass, once it has ended (0: one pass)
stop_file = ""                  # or once this file exists (run_stages.sh's exit: no signal can come before the handler)
settings = ""                   # run_stages.sh's knobs as KEY=VALUE lines: the tracker run's config
group = ""                      # the tracker group of this run (frontier.sh, ablate.sh: one per frontier or ablation)
poll_s = 10.0                   # seconds between passes over the records (each stats them and reads what changed)
close_s = 120.0                 # seconds the trackers may take to close at the end (W&B's finish uploads what is left)
project = "mu-grpo"             # the W&B project (WANDB_PROJECT wins); W&B's mode is WANDB_MODE's (online, offline)

# the stage line's warning: KL(behaviour ‖ π) per token over the last stage's final updates, the lab's predictor of a fall
# of held-out accuracy at the next evaluation (docs/multistage.md: AUC 0.73 over 198 stage boundaries; 39 of its 40
# falls came above the threshold, 1 of 69 boundaries below it fell), lab-calibrated: a regime's mark (within one
# configuration it did not tell which stage falls), not a GPU box's calibration
fall_kl = 0.0237                # warn above this (Youden's threshold on the lab's 4-stage runs)
fall_kl_updates = 16            # over the stage's last this many updates
# -----------------------------------------------------------------------------

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}     # REPORT_TO → the package it needs
STREAMS = ("train", "rollout", "eval", "time")


def trackers_of(report):
    """REPORT_TO → the trackers it names ([] for none); anything else is refused in one line."""
    names = [t.strip() for t in report.split(",") if t.strip()]
    if names in ([], ["none"]):
        return []
    bad = [t for t in names if t not in PACKAGES]
    if bad or len(set(names)) != len(names):
        raise SystemExit(f"REPORT_TO must be none, tensorboard, wandb or a comma list of the last two, got {report!r}")
    return names


def check(report):
    """Refuse, in one line before any phase, a tracker whose package is not installed."""
    for name in trackers_of(report):
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise SystemExit(f"REPORT_TO={report} needs the {PACKAGES[name]!r} package, which is not installed in "
                             f"{sys.prefix}: pip install {PACKAGES[name]} (or REPORT_TO=none)")


# ----------------------------------------------------------------------------- the records, as tracker rows


def _numbers(row, prefix, skip=()):
    """{prefix + name: value} of a record's numeric fields (booleans and lists left out)."""
    return {f"{prefix}{k}": float(v) for k, v in row.items()
            if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}


class RecordFiles:
    """The run's record files, each read again only when its size, mtime or inode changed: a pass over a 1,024-stage
    run stats its ~4k files and opens only the new or grown ones (a finished stage's files never change)."""

    def __init__(self):
        self.cache = {}                 # path → ((inode, size, mtime_ns), parsed)

    def read(self, path, parse):
        """parse(path) as of now, from the cache when the file is unchanged; None when it does not exist."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self.cache.pop(path, None)
            return None
        key, hit = (st.st_ino, st.st_size, st.st_mtime_ns), self.cache.get(path)
        if hit is None or hit[0] != key:
            hit = self.cache[path] = (key, parse(path))
        return hit[1]

    def jsonl(self, path):
        return self.read(path, lambda p: common.read_jsonl(p, torn_tail_ok=True)) or []    # (appended meanwhile)

    def json(self, path):
        return self.read(path, lambda p: json.loads(Path(p).read_text()))


def _updates_after(run, s, files=None):
    """The run updates recorded when stage s ended (its stage_end.json), 0 before the first stage, None if unknown."""
    if s < 0:
        return 0
    end = (files or RecordFiles()).json(records.stage_dir(run, s) / records.STAGE_END)
    return end["run_updates"] if end else None


def run_start(run):
    """The run's start (run_stages.sh's .done/start), else None."""
    path = Path(run) / ".done" / "start"
    return float(path.read_text()) if path.exists() else None


def rows(run, files=None):
    """Every row the trackers show, from the run's records: (key, step, wall time, {name: value}); the key names
    the record the row comes from, so a row is logged once whatever happens to its file. `files`: a RecordFiles kept
    between passes (a follower's), so that only what changed is read."""
    run, out, files = Path(run), [], files or RecordFiles()
    # an ablation replay's directory holds its metrics.jsonl (ablate.sh: optimize.py --out=<dir>/policy); a run's stages
    for metrics in [run / records.METRICS, *(d / records.METRICS for _, d in records.stage_dirs(run))]:
        for r in files.jsonl(metrics):
            out.append((f"train/{r['run_update']}", r["run_update"], r.get("time"),
                        _numbers(r, "train/", skip=("update", "run_update", "stage", "time"))))
    for s, d in records.stage_dirs(run):
        manifest = d / records.ROLLOUTS / records.MANIFEST
        read = files.read(manifest, lambda p: (json.loads(Path(p).read_text()), os.stat(p).st_mtime))
        if read is not None and (step := _updates_after(run, s - 1, files)) is not None:
            m, written = read
            out.append((f"rollout/{s}", step, written, _numbers(
                m, "rollout/", skip=("complete", "stage", "engines_ran", "max_response_tokens", "prompts", "responses"))))
    for r in records.own_results(files.jsonl(run / records.RESULTS)):       # (a hand evaluation's rows are not the run's)
        b = r["benchmark"]
        out.append((f"eval/{r['stage']}/{b}/{r.get('policy')}", r["updates"], r.get("time"), {
            f"eval/{b}/avg_at_{r['k']}": r["avg_at_k"], f"eval/{b}/pass_at_{r['k']}": r["pass_at_k"],
            **({f"eval/{b}/avg_at_{r['k']}_stderr": r["avg_at_k_stderr"]} if r.get("avg_at_k_stderr") else {})}))
    totals = {}
    for r in files.jsonl(run / records.TIMELINE):
        if r["phase"] == "attempt":                        # an attempt's start: no time of its own
            continue
        after = r["phase"] in ("optimize", "eval")         # at the updates the phase ended with, else began with
        step = _updates_after(run, r["stage"] if after else r["stage"] - 1, files)
        if step is None:
            continue
        totals[r["phase"]] = totals.get(r["phase"], 0.0) + r["seconds"]
        if r.get("process") == "generate":   # its engines' evaluation, inside a generate phase (written before the
            totals["generate"] = totals.get("generate", 0.0) - r["seconds"]    # phase's row): evaluation's time
        out.append((f"time/{r['name']}/{r.get('process', '')}", step, r["end"], {
            f"time/{r['phase']}_seconds": r["seconds"], f"time/{r['phase']}_hours_total": totals[r["phase"]] / 3600}))
    return out


def run_config(run, knobs):
    """The tracker run's config: run_stages.sh's knobs, and the first stage's optimize.py settings once written."""
    config = {"run_stages": knobs, "group": group}
    first = records.stage_dir(run, 0) / records.OPTIMIZE_CONFIG
    if first.exists():
        config["optimize"] = json.loads(first.read_text())
    return config


# ----------------------------------------------------------------------------- the trackers


class TensorBoard:
    """Event files in <run>/tensorboard, one file per follower process (TensorBoard reads them as one run)."""

    def __init__(self, run, config, first):
        from torch.utils.tensorboard import SummaryWriter  # tensorboard: only when reported to
        self.writer = SummaryWriter(log_dir=str(Path(run) / "tensorboard"))
        if first:
            self.config(config)

    def config(self, config):
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, sort_keys=True) + "\n```", 0)

    def log(self, step, wall, values):
        for name, value in values.items():
            self.writer.add_scalar(name, value, step, walltime=wall)

    def close(self):
        self.writer.close()


class WandB:
    """One W&B run per run directory, resumed by the id kept in <run>/tracking/wandb_id; every metric plotted against
    run_update (W&B's own step counts log calls, and restarts in every offline process)."""

    def __init__(self, run, config, first):
        import wandb  # wandb: only when reported to
        id_file = Path(run) / "tracking" / "wandb_id"
        if not id_file.exists():
            id_file.parent.mkdir(parents=True, exist_ok=True)
            common.atomic_write(id_file, uuid.uuid4().hex[:16])
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", project), id=id_file.read_text().strip(),
                              name=os.path.relpath(run), group=group or None, dir=str(Path(run) / "tracking"),
                              config=config, resume="allow")
        self.run.define_metric("run_update")
        for stream in STREAMS:
            self.run.define_metric(f"{stream}/*", step_metric="run_update")

    def config(self, config):
        self.run.config.update(config, allow_val_change=True)

    def log(self, step, wall, values):
        self.run.log({**values, "run_update": step})        # W&B keeps its own time stamp of the call

    def close(self):
        self.run.finish()


class Follower:
    """The trackers of one run and which of its records' rows they already hold (<run>/tracking/logged.json)."""

    def __init__(self, run, report, knobs):
        self.run, self.knobs = Path(run), knobs
        (self.run / "tracking").mkdir(parents=True, exist_ok=True)
        self.state_path = self.run / "tracking" / "logged.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {"keys": [], "config": 0}
        self.logged = set(self.state["keys"])
        self.files = RecordFiles()      # kept between passes: each pass reads only the files that changed
        config, first = run_config(run, knobs), not self.state_path.exists()
        self.trackers = [{"tensorboard": TensorBoard, "wandb": WandB}[name](run, config, first)
                         for name in trackers_of(report)]
        if first:
            self._save()

    def _save(self):
        self.state["keys"] = sorted(self.logged)
        common.atomic_write_json(self.state_path, self.state)

    def sync(self):
        """Log the rows not logged yet (the keys are saved first) and the optimize settings once they exist.
        Returns how many rows went in."""
        new = [r for r in rows(self.run, self.files) if r[0] not in self.logged]
        config = run_config(self.run, self.knobs)
        grew = len(config) > self.state["config"]
        if not new and not grew:
            return 0
        self.logged |= {key for key, *_ in new}
        self.state["config"] = len(config)
        self._save()
        start = run_start(self.run)
        for tracker in self.trackers:
            if grew:
                tracker.config(config)
            for key, step, wall, values in sorted(new, key=lambda r: (r[1], r[2] or 0.0)):
                beside = {f"{key.split('/')[0]}/wall_hours": (wall - start) / 3600} if wall and start else {}
                tracker.log(step, wall, {**values, **beside})
        return len(new)

    def close(self, within_s):
        """Close every tracker, waiting at most within_s seconds in all: W&B's finish waits for its uploads, and
        run_stages.sh waits for this process at its exit. Past the bound the follower ends and says so; a tracker's
        error is raised here."""
        done, errors = threading.Event(), []

        def close_all():
            try:
                for tracker in self.trackers:
                    tracker.close()
            except BaseException as e:      # raised below, in the follower's own thread
                errors.append(e)
            finally:
                done.set()
        threading.Thread(target=close_all, daemon=True).start()
        if not done.wait(within_s):
            print(f"[tracking] the trackers did not close within {within_s:g} s (close_s): ending without them; the "
                  f"records are complete, and W&B's offline files under {self.run / 'tracking'} keep what it had "
                  f"(`wandb sync` sends them)", file=sys.stderr, flush=True)
        elif errors:
            raise errors[0]


def follow(run, report, knobs, parent, stop_path=""):
    """Log the run's records as they are written until stop_path exists, the parent process has ended or a SIGTERM
    comes, then a last pass; parent 0: one pass."""
    if not trackers_of(report):
        return
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    with common.exclusive(Path(run) / "tracking" / ".lock"):      # a killed attempt's follower makes its last pass first
        follower = Follower(run, report, knobs)
        try:
            while True:
                follower.sync()
                if not parent or stop or not processes.alive(parent) or (stop_path and os.path.exists(stop_path)):
                    follower.sync()
                    return
                deadline = time.monotonic() + poll_s
                while time.monotonic() < deadline and not stop and not (stop_path and os.path.exists(stop_path)):
                    time.sleep(0.1)
        finally:
            follower.close(close_s)


# ----------------------------------------------------------------------------- where the run stands


def _duration(seconds):
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{max(minutes, 1)} min"


def where_line(run, total, s):
    """[stage s] the run updates recorded so far of the total, the last stage's KL to its rollouts (warned above
    fall_kl), the last evaluation (its benchmarks' mean avg@k), and an ETA: the phases' measured seconds so far
    (timeline.jsonl) per update done, times the updates left."""
    run = Path(run)
    done = _updates_after(run, s - 1) or 0
    parts = [f"[stage {s}] update {done} of {total}"]
    last_stage = common.read_jsonl(records.stage_dir(run, s - 1) / records.METRICS, missing_ok=True,  # none at s = 0
                                   torn_tail_ok=True)
    kl = [r["ratio/kl"] for r in last_stage[-fall_kl_updates:] if r.get("ratio/kl") is not None]
    if kl:
        mean_kl = sum(kl) / len(kl)
        parts.append(f"KL to its rollouts over stage {s - 1}'s last {len(kl)} updates {mean_kl:.4f}"
                     + (f" ⚠ above {fall_kl:g}, where the lab's falls of held-out accuracy came (a lab-calibrated "
                        f"threshold: docs/multistage.md)" if mean_kl > fall_kl else ""))
    results = records.own_results(common.read_jsonl(run / records.RESULTS, missing_ok=True))
    if results:
        last = max(results, key=lambda r: r["time"])
        same = [r for r in results if r["stage"] == last["stage"] and r.get("policy") == last.get("policy")]
        mean = sum(r["avg_at_k"] for r in same) / len(same)
        parts.append(f"last evaluation: avg@{last['k']} {mean:.3f} after {last['updates']} updates"
                     + (f" (mean of {len(same)} benchmarks)" if len(same) > 1 else ""))
    spent = records.measured_seconds(records.read(run))
    if done and total > done:
        parts.append(f"ETA {_duration(spent / done * (total - done))} ({_duration(spent)} measured for {done} updates)")
    elif not done:
        parts.append("ETA after the first stage")
    return " · ".join(parts)


def parse_settings(text):
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


if __name__ == "__main__":
    common.apply_overrides(globals(), sys.argv[1:])
    common.check_choice("command", command, ("check", "follow"))
    if command == "check":
        check(report_to)
    else:
        follow(run_dir, report_to, parse_settings(settings), pid, stop_file)
