"""The run's records, read and timed in one place: timeline.jsonl (its one writer, append) and the
sums every reader takes from a run directory's records (one wall-clock rule: time_split, with
pauses; the accuracy curve; the seconds to each evaluation; an ETA's measured seconds).
tools/plot.py, mu_grpo/tracking.py, mu_grpo/launch.py, tools/ and notebooks/results.ipynb read
through it.

timeline.jsonl, one row per timed span: {"phase", "name", "stage", "start", "end", "seconds"} (Unix
seconds), written by run_stages.sh (mu_grpo.launch --command=row: each phase; --command=attempt: an
attempt's zero-length start row), by mu_grpo/launch.py (a resident attempt's top row, attempt_row),
by the resident processes (handoff.Partner.timeline) and by generate.py (the evaluation its engines
make before a stage): rows that carry "process", parts of a top row (their attempt's, their generate
phase's). It is also the home of the run directory's names (a stage's rollouts/ files:
mu_grpo/rollouts.py) and of what a stage trains and where it writes (StageOutputs); the stage plan
and the drift rule that read them are mu_grpo/stage_rules.py.
"""
import dataclasses
import functools
import json
import time
from pathlib import Path

from mu_grpo import common


# ------------------------------------------------------------------------ the run directory's names
# Every script reads and writes a run directory through these names; this module owns them
# (docs/design.md §2):
#   <run>/stage_<s>/rollouts/       generate.py: shard_<k>.jsonl, columns/, plan.json, manifest.json
#                                   (mu_grpo/rollouts.py)
#   <run>/stage_<s>/policy/         optimize.py: the policy trained on stage s (and evaluated)
#   <run>/stage_<s>/train_state/    optimize.py: fp32 weights, AdamW, counts (the next stage starts
#                                   from it)
#   <run>/stage_<s>/metrics.jsonl   optimize.py: one row per update; beside it stage_end.json
#   <run>/results.jsonl, eval_samples/
#                                   evaluate.py: one row per (stage, benchmark), the graded samples
#   <run>/timeline.jsonl            one row per phase, and timeline.attempt.json (TIMELINE, ATTEMPT
#                                   below)
# and the directories their owners name: resident/ (mu_grpo/handoff.py), .nodes/ (mu_grpo/nodes.py),
# tracking/ (mu_grpo/tracking.py), logs/ and .done/ (run_stages.sh, whose loop, the part a
# researcher reads, spells stage_<s>/policy and train_state/ itself)
ROLLOUTS = "rollouts"
# in rollouts/, written last: its presence means the stage is complete (mu_grpo/rollouts.py)
MANIFEST = "manifest.json"
# in rollouts/: the settings the stage was started with (a rerun with others is refused)
PLAN = "plan.json"
POLICY = "policy"
TRAIN_STATE = "train_state"
METRICS = "metrics.jsonl"
# beside METRICS: a stage's trainer settings as resolved (optimize.py)
OPTIMIZE_CONFIG = "optimize_config.json"
OPTIMIZE_TIMING = "optimize_timing.json"    # beside METRICS: where its seconds went
RESULTS = "results.jsonl"
EVAL_SAMPLES = "eval_samples"
# beside the stage's metrics.jsonl: where training on it ended and why
STAGE_END = "stage_end.json"
TIMELINE = "timeline.jsonl"
# what makes the run what it is, from its first attempt (mu_grpo/launch.py run_settings)
RUN_SETTINGS = "run_settings.json"
# a resident pair's start, until its top row is in the timeline (attempt_row)
ATTEMPT = "timeline.attempt.json"


def stage_dir(run_dir, s):
    """Stage s's directory in a run."""
    return Path(run_dir) / f"stage_{s}"


def stage_dirs(run_dir):
    """[(s, its directory)] of every stage directory in a run, in stage order."""
    found = [(int(p.name[6:]), p) for p in Path(run_dir).glob("stage_*") if p.name[6:].isdigit()]
    return sorted(found)


@dataclasses.dataclass
class StageOutputs:
    """A stage's size and where its training writes (optimize.py's train_stage; where training
    stands, the update it starts from and the counts before it, is the trainer's)."""
    out_dir: Path               # the next policy; metrics.jsonl, train_state/ and the timing go
                                # next to it
    updates_per_stage: int      # μ: the stage's minibatches (its updates unless it ends on drift)
    save_state: bool = True     # write the final train state (the next stage's, or a resume's,
                                # starting point)
    policy_dirs: tuple = ()     # where the final policy goes (the hand-over's policy_dirs: the
                                # stage directory's policy/ when it is saved there; (): nowhere, a
                                # resident transfer's stage without a save)
    check_saves: bool = False   # check the disk for both saves even when none is due (a resident
                                # run's first stage)

    @property
    def work_dir(self):
        return self.out_dir.parent

    @property
    def state_dir(self):
        return self.work_dir / TRAIN_STATE

    @property
    def metrics_path(self):
        return self.work_dir / METRICS


def metrics_row(stage, groups, place, m, seconds, extra):
    """An update's row of METRICS (optimize.py's train_stage): its place (`place`: update u, in the
    stage, and its staleness; in the run; in AdamW's life; its lr), its minibatch (`groups`, the
    stage's rollouts.Stage), loss.metrics' values `m` (the engine/trainer mismatch at update 0
    only), `extra`, timing."""
    batch = stage.groups[groups].ravel()
    tokens = int((stage.prompt_len[batch] + stage.response_len[batch]).sum())
    row = {**place, "reward/mean": float(stage.reward[batch].mean()),
           "minibatch/zero_variance_frac": float(stage.zero_variance[groups].mean()),
           "groups": [stage.group_keys[i] for i in groups],     # which prompts (stage positions)
           **extra, "time": time.time(), "seconds": seconds, "tokens": tokens,
           "tokens_per_s": tokens / seconds}
    row.update({k: v for k, v in m.items() if place["update"] == 0
                or not k.startswith("mismatch/")})
    return {k: (common.finite_or_none(v) if isinstance(v, float) else v) for k, v in row.items()}


# -------------------------------------------------------------------------- what a run has finished
# One rule, read from the records both modes write (no marker one mode writes and the other does
# not): the rerun check (mu_grpo/launch.py rerun_check), the per-phase loop's skips (launch
# --command=finished) and the resident trainer's start (checkpoint.newest_state: a stage's final
# state) all read it. The names a run writes at its top level: the only ones it ever removes
# (launch.settle_record), and what a directory holds when it is a run's that has not yet recorded
# its settings (launch.rerun_check)
RUN_NAMES = ("logs", ".done", ".lock", ".lock.node*", ".nodes", "resident", "tracking",
             "tensorboard", "preflight.json", "stage_*", TIMELINE, ATTEMPT, RESULTS, EVAL_SAMPLES,
             # (common.unwritable's probe; common.atomic_write's temporary name)
             RUN_SETTINGS, "plots", ".write_probe.*", ".*.tmp*")


def rollouts_finished(run_dir, s):
    """Stage s's rollouts are finished when its manifest is written (generate.py, last)."""
    return (stage_dir(run_dir, s) / ROLLOUTS / MANIFEST).exists()


def last_trained(run_dir):
    """The newest stage whose training is finished, -1 before any: its stage_end.json and its policy
    (saved last, atomically) are in its directory. Every stage before it is finished too: its
    rollouts came from their policies, and its train state carries theirs (a resident run that saved
    only every few stages has older stages without a policy: they are not trained again)."""
    return max((s for s, d in stage_dirs(run_dir)
                if (d / STAGE_END).exists() and (d / POLICY / common.POLICY_ID_FILE).exists()),
               default=-1)


def phase_finished(run_dir, name):
    """Whether run_stages.sh's phase `name` is finished by the run's records: generate_<s> once its
    rollouts are (or a later stage is trained), optimize_<s> once stage s is trained (last_trained).
    An evaluation phase (eval_init, eval_<s>) is never skipped here: evaluate.py skips a policy the
    results hold under its protocol (benchmarks.evaluated), the check generate.py's evaluations make
    too."""
    kind, _, s = name.rpartition("_")
    if kind == "generate":
        return rollouts_finished(run_dir, int(s)) or int(s) <= last_trained(run_dir)
    if kind == "optimize":
        return int(s) <= last_trained(run_dir)
    if kind == "eval" or name == "eval_init":
        return False
    raise ValueError(f"no phase is named {name!r} (generate_<s>, optimize_<s>, eval_<s>, "
                     "eval_init)")


PROTOCOL = ("k", "temperature", "top_p", "max_prompt_tokens", "max_response_tokens",
            "prompt_template", "seed")


def same_protocol(a, b):
    """Whether two results rows (or a row and a protocol's labels) were made under one evaluation
    protocol, the fields of PROTOCOL: what makes two rows of one policy and benchmark comparable (a
    hand evaluation under another adds rows beside the run's, never replaces them:
    benchmarks.update_results). A field a row lacks (rows written before rows carried it) matches
    any value."""
    return all(a[key] == b[key] for key in PROTOCOL if key in a and key in b)


def own_results(rows):
    """The rows of a run's own protocol: its first row's (the run's first evaluation is its own,
    written before anyone else could evaluate its policies); rows under another protocol (hand
    evaluations) are left out of its curves and summaries."""
    first = min(rows, key=lambda r: r.get("time", 0.0), default=None)
    return [r for r in rows if same_protocol(r, first)]


def finished_work(run_dir):
    """What a run directory holds that a run computed, one phrase each (empty: nothing): rollouts
    (every shard is written whole, so a stage's complete shards count), train states (a mid-stage
    checkpoint's too), trained stages, results rows. A rerun with other settings is refused on any
    of it (launch.rerun_check)."""
    found = []
    for s, d in stage_dirs(run_dir):
        if rollouts_finished(run_dir, s):
            found.append(f"stage {s}'s rollouts")
        elif shards := list((d / ROLLOUTS).glob("shard_*.jsonl")):
            found.append(f"{len(shards)} rollout shard(s) of stage {s}")
        if (d / STAGE_END).exists() and (d / POLICY / common.POLICY_ID_FILE).exists():
            found.append(f"stage {s}'s training")
        elif (d / TRAIN_STATE / "progress.json").exists():
            found.append(f"stage {s}'s train state")
    if rows := common.read_jsonl(Path(run_dir) / RESULTS, missing_ok=True):
        found.append(f"{len(rows)} results row(s)")
    return found


# ----------------------------------------------------------------------------- writing

def append(run_dir, row, **more):
    """Append a row (phase, name, stage, start, end, ...) to <run_dir>/timeline.jsonl with its
    seconds, then `more`."""
    common.append_jsonl(Path(run_dir) / TIMELINE,
                        {**row, "seconds": row["end"] - row["start"], **more})


def attempt_started(run_dir, t):
    """run_stages.sh's start, a zero-length row: the time from the last record before it is not the
    run's (pauses)."""
    append(run_dir, {"phase": "attempt", "name": "attempt", "stage": -1, "start": t, "end": t},
           process="run_stages.sh")


def resident_started(run_dir, t):
    """A resident attempt's start marker: its row (attempt_row) is written when it ends, or at the
    next start."""
    common.atomic_write_json(Path(run_dir) / ATTEMPT, {"start": t})


def attempt_row(run_dir, start, end, ended):
    """A resident attempt's top row in timeline.jsonl (its processes' rows are parts of it:
    time_split), then its start marker removed: how it ended (completed, failed, stopped by a
    Ctrl-C, or killed: a SIGKILL or SIGTERM leaves no time to write the row, close_killed_attempt
    writes it at the next start) and the last stage trained."""
    last = sum((d / STAGE_END).exists() for _, d in stage_dirs(run_dir)) - 1
    append(run_dir,
           {"phase": "resident", "name": "resident", "stage": last, "start": start, "end": end},
           ended=ended)
    (Path(run_dir) / ATTEMPT).unlink(missing_ok=True)


def close_killed_attempt(run_dir):
    """An attempt killed before it wrote its row (its start marker is still there) gets its row now,
    ending at the last row its processes wrote: what it did after that was lost, and is not timed,
    as the wait before this rerun is not (time_split). Without it the run's wall-clock would start
    at the last attempt while its records (rollouts, updates, evaluations) cover the killed ones
    too."""
    marker = Path(run_dir) / ATTEMPT
    if not marker.exists():
        return
    start = json.loads(marker.read_text())["start"]
    timeline = read(run_dir)
    # its processes' rows: not run_stages.sh's "attempt" row, which the rerun writes before this
    # runs
    attempt_row(run_dir, start,
                max([t["end"] for t in timeline if t["start"] >= start and t["phase"] != "attempt"],
                                    default=start), "killed")


# ----------------------------------------------------------------------------- reading

def read(run_dir):
    """The run's timeline rows ([] before its first). Other processes append to it while it is read
    (the engine process, the trainer, run_stages.sh): a last line not yet whole is not a row yet."""
    return common.read_jsonl(Path(run_dir) / TIMELINE, missing_ok=True, torn_tail_ok=True)


def load_run(path):
    """Everything a figure needs from a run directory: results, timeline, per-update metrics,
    manifests."""
    rows = functools.partial(common.read_jsonl, missing_ok=True)
    path = Path(path)
    metrics, manifests, stage_ends = [], {}, {}
    for s, stage_dir in stage_dirs(path):
        metrics += [{**row, "stage": s} for row in rows(stage_dir / METRICS)]
        if (stage_dir / STAGE_END).exists():      # where training on the stage ended, and why
            stage_ends[s] = json.loads((stage_dir / STAGE_END).read_text())
        if (stage_dir / ROLLOUTS / MANIFEST).exists():
            manifests[s] = json.loads((stage_dir / ROLLOUTS / MANIFEST).read_text())
    metrics += rows(path / METRICS)     # an ablation replay: optimize.py --out=<path>/policy
    return {"name": path.name, "results": own_results(rows(path / RESULTS)), "timeline": read(path),
            "metrics": metrics, "manifests": manifests, "stage_ends": stage_ends}


def accuracy_by_stage(run):
    """[(stage, the run's updates (the evaluated policy's record), hours, mean avg@k over
    benchmarks)] in stage order."""
    by_stage = {}
    for r in run["results"]:
        by_stage.setdefault(r["stage"], []).append(r)
    return [(s, rows[0]["updates"], max(r["hours"] for r in rows),
             sum(r["avg_at_k"] for r in rows) / len(rows)) for s, rows in sorted(by_stage.items())]


def phase_summary(run):
    """Seconds per phase kind, total, and the share spent outside generation and training compute.
    The rows that carry "process" are parts of a top row, not counted again in the total: a resident
    run's two processes' count in evaluation and the components; a generate phase's evaluation moves
    its seconds from the phase's kind to eval."""
    per_kind, parts = {}, {}
    for t in run["timeline"]:
        # its engines' evaluation, inside a generate phase: the phase's time is
        if t.get("process") == "generate":
            # the evaluation's, not generation's
            per_kind["generate"] = per_kind.get("generate", 0.0) - t["seconds"]
            per_kind[t["phase"]] = per_kind.get(t["phase"], 0.0) + t["seconds"]
            continue
        kinds = parts if "process" in t else per_kind
        kinds[t["phase"]] = kinds.get(t["phase"], 0.0) + t["seconds"]
    total = sum(per_kind.values())
    generation = sum(m.get("generation_seconds", 0.0) for m in run["manifests"].values())
    training = sum(m.get("seconds") or 0.0 for m in run["metrics"])
    evaluation = per_kind.get("eval", 0.0) + parts.get("eval", 0.0)
    overhead = (total - evaluation - generation - training) / max(total - evaluation, 1e-9)
    return per_kind, total, generation, training, overhead


def time_split(run):
    """A run's wall-clock in seconds, taken apart: generation (the engines' sampling, manifest
    generation_seconds), training (the updates, metrics seconds), evaluation, switching (the rest of
    the phases: process and engine starts, loads, saves, hand-offs, grading tails) and idle (between
    phases: the wall-clock no phase covers). The five add up to the wall-clock; stages: how many
    stages paid a switch. A resumed run's wall-clock leaves out its pauses (nothing of it ran
    then)."""
    _, total, generation, training, _ = phase_summary(run)
    evaluation = sum(t["seconds"] for t in run["timeline"] if t["phase"] == "eval")
    # a resident run's attempts, or the phases
    top = [t for t in run["timeline"] if "process" not in t]
    first, last = (min(t["start"] for t in top), max(t["end"] for t in top)) if top else (0.0, 0.0)
    wall = last - first - sum(max(0.0,
                                  min(to, last) - max(since, first)) for since, to in pauses(run))
    return {"wall": wall, "generation": generation, "training": training, "evaluation": evaluation,
            "switching": total - evaluation - generation - training, "idle": wall - total,
            "stages": len(run["manifests"])}


def pauses(run):
    """[(from, to)]: when nothing of a resumed run ran, however long the rerun waited: from the last
    record before an attempt's start (run_stages.sh's zero-length "attempt" row) to it, and from a
    resident attempt's end (its row: records.attempt_row; a killed one's ends at its last record) to
    the next start (runs recorded before the attempt rows). What a killed phase or attempt did after
    its last record is lost with the wait."""
    rows = sorted(run["timeline"], key=lambda t: t["start"])
    top = [t for t in rows if "process" not in t]
    found = [
        (t["end"], later["start"]) for t, later in zip(top, top[1:]) if t["phase"] == "resident"]
    for i, t in enumerate(rows):
        if t["phase"] == "attempt" and i > 0:
            found.append((max(r["end"] for r in rows[:i]), t["start"]))
    merged = []
    # the two kinds overlap on a resident run
    for since, to in sorted(p for p in found if p[1] > p[0]):
        if merged and since <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], to))
        else:
            merged.append((since, to))
    return merged


def resident_parts(run):
    """A resident run's switching costs from its processes' timeline rows, in seconds: start-up (the
    slowest of the processes' starts: the trainer's, the engine process's, each engine's own),
    weight reloads and engine sleeps (each engine writes its own row per stage; the engines work
    side by side, so a stage costs its slowest engine's), the trainer's saves."""
    rows = [t for t in run["timeline"] if "process" in t]
    starts = [t["seconds"] for t in rows if t["phase"] == "start"]

    def slowest_per_stage(key):
        per_stage = {}
        for t in rows:
            if t["phase"] == "engine":
                per_stage[t["stage"]] = max(per_stage.get(t["stage"], 0.0), t.get(key) or 0.0)
        return sum(per_stage.values())
    return {"start-up": max(
        starts + [t.get("start_seconds") or 0.0 for t in rows if t["phase"] == "engine"],
        default=0.0),
            "reload": slowest_per_stage("reload_seconds"),
            "save": sum(t.get("save_seconds", 0.0) for t in rows if t["process"] == "trainer"),
            "sleep": slowest_per_stage("sleep_seconds")}


def evaluation_seconds(run):
    """{stage: seconds from the run's start to its evaluation}, earlier evaluations and pauses taken
    out (the x of an accuracy-against-time curve; {} before any top row)."""
    evals = sorted((t for t in run["timeline"] if t["phase"] == "eval"), key=lambda t: t["start"])
    tops = [t for t in run["timeline"] if "process" not in t]
    if not tops:
        return {}
    start, gaps = min(t["start"] for t in tops), pauses(run)
    return {t["stage"]: t["start"] - start
            - sum(e["seconds"] for e in evals if e["end"] <= t["start"])
            - sum(to - since for since, to in gaps if to <= t["start"]) for t in evals}


def measured_seconds(timeline):
    """The seconds the run's phases measured so far (an ETA's numerator): every top row's, and the
    rows of a resident attempt still running (once written, an attempt's row holds its processes'
    rows)."""
    ended = max((r["end"] for r in timeline if r["phase"] == "resident"), default=float("-inf"))
    return sum(r["seconds"] for r in timeline if "process" not in r or r["start"] >= ended)
