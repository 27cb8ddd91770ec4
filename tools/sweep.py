"""frontier.sh's runs: its settings checked, the points, the preflight per LOSS (and the estimate), the builds (the
rule's probes, tools/regimes.py), the runs in the order they are taken, JOBS at a time (mu_grpo/pool.py), and the table
(tools/frontier.py). frontier.sh holds the knobs and their meaning and hands them all here; every run is one
run_stages.sh run, which resumes itself, so a rerun skips what finished.

    bash frontier.sh                     # (it runs python tools/sweep.py --preset=... --mus=... ...)
"""
import fcntl
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mu_grpo import common, launch  # noqa: E402
from mu_grpo import pool  # noqa: E402

# frontier.sh's knobs, as it gives them (lists space-separated); their meaning is there
preset = "lab-fork"
out = ""
mus = ""
total_updates = ""
eval_updates = ""
benchmarks = ""
eval_k = ""
losses = ""
nav_deltas = ""
seeds = ""
key_points = ""
sweep_builds = ""
sweep_seeds = ""
builds = ""
candidates = ""
regimes = ""
min_builds = ""
probe_updates = ""
probe_seed = ""
baseline = ""
resident_max_mu = ""
drift_first = ""
costs = ""
eval_cache = ""
points = ""
estimate = ""
preflight = ""
gpus = ""
jobs = ""
common.apply_overrides(globals(), sys.argv[1:] if __name__ == "__main__" else [])
T0 = time.time()


def check():
    """frontier.sh's settings, each refused in one line naming it. Returns the GPUs' count."""
    for name in ("total_updates", "eval_updates", "resident_max_mu", "drift_first"):
        if not globals()[name].isdigit() or int(globals()[name]) < 1:
            common.refuse(f"{name.upper()} must be a whole number >= 1, got '{globals()[name]}'")
    for mu in mus.split():
        if mu != "drift" and not (mu.isdigit() and int(mu) >= 1 and int(total_updates) % int(mu) == 0):
            common.refuse(f"MUS: each μ must divide TOTAL_UPDATES={total_updates} (or be 'drift'), got '{mu}'")
    numbers = [*seeds.split(), *builds.split(), jobs, *candidates.split(), min_builds, probe_updates, probe_seed,
               *sweep_seeds.split(), *([] if sweep_builds == "first" else sweep_builds.split())]
    for x in numbers:
        if not x.isdigit():
            common.refuse(f"SEEDS, BUILDS, JOBS, CANDIDATES, MIN_BUILDS, PROBE_UPDATES, PROBE_SEED and SWEEP_* must be whole "
                   f"numbers (SWEEP_BUILDS or 'first'), got '{x}'")
    for r in regimes.split():
        name, _, quota = r.partition(":")
        if name not in ("saturated", "learns", "stalls") or not (quota.isdigit() and int(quota) >= 1):
            common.refuse(f"REGIMES: each is <regime>:<quota>, a regime of saturated, learns or stalls, got '{r}'")
    if int(jobs) < 1:
        common.refuse(f"JOBS must be at least 1, got {jobs}")
    if preflight not in ("auto", "0", "1", "force"):
        common.refuse(f"PREFLIGHT must be auto, 0, 1 or force, got '{preflight}'")
    n_gpus = gpus or str(common.gpu_count())
    if not n_gpus.isdigit():
        common.refuse(f"GPUS must be a whole number, got '{n_gpus}'")
    if not preset.startswith("lab") and builds not in ("", "0"):
        common.refuse("BUILDS: only the lab tasks have builds; use BUILDS=0")
    return int(n_gpus)


def check_loss(loss):
    """A LOSS that names no preset of loss.py: its line naming them."""
    if problem := launch.check_loss_name(loss):
        common.refuse(problem)


def nav_presets():
    """The LOSS presets with NAV: the rows of loss.py's PRESETS with a NAV δ (their flags follow NAV_DELTA)."""
    return [name for name in launch.L().PRESETS if launch.L().preset(name).nav_delta is not None]


def positive_number(text):
    try:
        return 0 < float(text) < math.inf
    except ValueError:
        return False


def parse_point(point):
    """A point's (label, μ, learning rate or None): label:μ, or label:μ@lr, run at that LR (each
    point of one frontier at its own learning rate, as docs/bakeoff.md's arms)."""
    spec, _, lr = point.partition("@")
    label, mu = spec.rsplit(":", 1)
    return label, mu, lr or None


def without_lr(point):
    """label:μ of a point: its runs' directory, whatever its learning rate."""
    return point.partition("@")[0]


def all_points():
    """Every point, label:μ: each LOSS with each μ of MUS; a preset with NAV (its flags follow NAV_DELTA) once per δ
    of NAV_DELTAS, labelled <loss>-d<δ>. POINTS picks some of them (label:μ@lr: at that learning
    rate); "probes": the rule's builds only, no run."""
    found, with_nav = [], nav_presets()
    for loss in losses.split():
        check_loss(loss)                # an unknown preset: the line naming them
        nav = loss in with_nav
        for label in ([f"{loss}-d{d}" for d in nav_deltas.split()] if nav else [loss]):
            found += [f"{label}:{mu}" for mu in mus.split()]
    if points == "probes":
        return []
    for p in [*points.split(), baseline, *key_points.split()]:
        if without_lr(p) not in found:
            common.refuse(f"'{p}' (POINTS, BASELINE or KEY_POINTS) is not one of the points: {' '.join(found)}")
        lr = p.partition("@")[2]
        if "@" in p and not positive_number(lr):
            common.refuse(f"'{p}': a point's learning rate (label:μ@lr) must be a positive number, "
                          f"got '{lr}'")
    specs = [without_lr(p) for p in points.split()]
    if len(set(specs)) < len(specs):
        common.refuse(f"POINTS: each label:μ once (its runs' directory is <label>-mu<μ>), "
                      f"got '{points}'")
    return points.split() or found


def stage_mu(point):
    """A point's (first) stage's μ: its μ, or DRIFT_FIRST for the drift rule."""
    mu = parse_point(point)[1]
    return int(drift_first) if mu == "drift" else int(mu)


def is_resident(point):
    return stage_mu(point) <= int(resident_max_mu)


def point_env(point, updates=None, every=None):
    """The run_stages.sh settings of a point's runs, over `updates` updates (TOTAL_UPDATES) evaluated every `every`
    (EVAL_UPDATES; after every stage when its μ is larger); a point's own learning rate its LR."""
    updates, every = int(updates or total_updates), int(every or eval_updates)
    label, mu, lr = parse_point(point)
    env = {"LOSS": label.rsplit("-d", 1)[0] if "-d" in label else label,
           "NAV_DELTA": label.rsplit("-d", 1)[1] if "-d" in label else "1e-4",
           "RESIDENT": "true" if is_resident(point) else "false", **({"LR": lr} if lr else {})}
    if mu == "drift":
        return {**env, "STAGE_END": "drift", "UPDATES_PER_STAGE": drift_first, "TOTAL_UPDATES": str(updates),
                "DRIFT_MAX_UPDATES": str(updates), "EVAL_EVERY": "1"}
    mu = int(mu)
    return {**env, "STAGE_END": "fixed", "STAGES": str(updates // mu), "UPDATES_PER_STAGE": str(mu),
            "EVAL_EVERY": str(every // mu if every > mu else 1), "DRIFT_ARGS": "", "DRIFT_MAX_UPDATES": ""}  # (drift's)


def minutes():
    return f"{(time.time() - T0) / 60:.0f} min"


def python(*args, **kwargs):
    """One of the project's scripts in this Python, from the repository's root; a failure ends the frontier."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, text=True, **kwargs)
    if proc.returncode:
        sys.exit(proc.returncode)
    return proc


def preflights(selected, gpu_env, slices):
    """One preflight per LOSS before any run, on one run's share of the box, at the settings of the LOSS's first
    resident point (the hand-off checked too), else its first; with ESTIMATE, the first one's estimate."""
    checked = {}
    for point in selected:
        loss = point_env(point)["LOSS"]
        if loss in checked:
            continue
        point = next((p for p in selected if point_env(p)["LOSS"] == loss and is_resident(p)), point)
        checked[loss] = point
        run = Path(out) / ("preflight" if len(checked) == 1 else f"preflight-{loss}")
        print(f"preflight for {loss} on {f'GPUs {slices[0]}' if gpu_env else 'this box'} at {point}'s settings: {run}",
              flush=True)
        env = {**os.environ, **gpu_env, **point_env(point), "PRESET": preset, "RUN": str(run),
               "PREFLIGHT_ONLY": "true", "PREFLIGHT": "force" if preflight == "force" else "1"}
        with open(f"{run}.log", "w") as log:
            code = subprocess.run(["bash", "run_stages.sh"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL).returncode
        if code:
            tail = Path(f"{run}.log").read_text(errors="replace").splitlines()[-20:]
            sys.exit(f"the preflight failed; see {run}.log:\n" + "\n".join(tail))
        if estimate == "true" and len(checked) == 1:
            table = python("tools/frontier.py", f"--estimate_from={run}/preflight.json",
                           f"--estimate_points={' '.join(selected)}", f"--total_updates={total_updates}",
                           f"--preflight_updates={stage_mu(point)}", f"--costs={costs}", stdout=subprocess.PIPE).stdout
            print(table, end="", flush=True)
            (Path(out) / "estimate.md").write_text(table)


def task_dir(build):
    """A build's task: data/<task>/ for build 0, data/<task>_build<b>/ else; built by its builder (--seed=<build>) if
    it is not there yet (on every core: a build's thread count is part of what it is)."""
    task = preset.replace("-", "_")
    where = f"data/{task}" + ("" if build == 0 else f"_build{build}")
    if not ((ROOT / where / "model" / "config.json").exists() and (ROOT / where / "heldout.jsonl").exists()):
        python(f"data/{task}.py", f"--out_dir={where}", f"--seed={build}", stdout=sys.stderr)
    return where


def launch_task(run, build, seed, env, task_dirs):
    """A pool task: run_stages.sh at the point's settings env on the build's task, into run (its log beside it)."""
    task = task_dirs.get(build)
    build_env = {"MODEL": f"{task}/model", "TRAIN_DATA": f"{task}/train.jsonl", "EVAL_DATA_DIR": task} if task else {}
    given = {k: v for k, v in (("EVAL_K", eval_k), ("BENCHMARKS", benchmarks)) if v}
    Path(run).parent.mkdir(parents=True, exist_ok=True)
    return (str(run), ["bash", "run_stages.sh"], {**build_env, **env, **given, "PRESET": preset, "SEED": str(seed),
                                                  "RUN": str(run), "PREFLIGHT": "0", "EVAL_CACHE": eval_cache},
            f"{run}.log")


def chosen_builds(slot_list, task_dirs):
    """The rule (tools/regimes.py): candidates in order, each built and probed (GRPO at the smallest μ for
    PROBE_UPDATES updates), until every regime has its quota. Returns (the kept builds, the first of each regime)."""
    small = mus.split()[0]
    if not small.isdigit() or int(probe_updates) % int(small):
        common.refuse(f"PROBE_UPDATES={probe_updates} must be a multiple of the smallest μ ({small})")
    looked, kept, firsts = [], [], []
    selection_log = Path(out) / "regimes" / "selection.log"
    for b in map(int, candidates.split()):
        task_dirs[b] = task_dir(b)
        probe = Path(out) / "regimes" / f"build{b}"
        if not Path(f"{probe}.json").exists():
            print(f"probe of build {b}: GRPO μ = {small}, {probe_updates} updates, seed {probe_seed} ({minutes()})",
                  flush=True)
            env = point_env(f"grpo:{small}", updates=probe_updates, every=probe_updates)
            pool.run([launch_task(probe, b, probe_seed, env, task_dirs)], slot_list[:1])
            python("tools/regimes.py", f"--regime_of={probe}")
        looked.append(b)
        with open(selection_log, "w") as log:
            select = subprocess.run([sys.executable, "tools/regimes.py", f"--select={Path(out) / 'regimes'}",
                                     f"--candidates={' '.join(map(str, looked))}", f"--regimes={regimes}",
                                     f"--at_least={min_builds}"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                    stderr=log)
        if select.returncode:
            sys.exit(selection_log.read_text())
        lines = select.stdout.splitlines()
        kept, firsts = [int(b) for b in lines[0].split()], [int(b) for b in lines[1].split()]
        if lines[2] == "complete":
            break
    print(selection_log.read_text(), end="", file=sys.stderr)     # the rule's table, how many it looked at and kept
    if not kept:
        sys.exit(f"the rule kept no build of [{candidates}] (regimes {regimes}): see {out}/regimes/")
    return kept, firsts


def runs_in_order(selected, kept, sweep):
    """(build, seed, point) in the order they are taken: per seed, the key points on every build, then the rest of
    the sweep on its builds (stopped early, the claims' runs are done)."""
    key = [without_lr(p) for p in key_points.split()]
    is_key = lambda p: not key or without_lr(p) in key  # noqa: E731
    order = []
    for seed in seeds.split():
        order += [(b, seed, p) for p in selected if is_key(p) for b in kept]
        if key and seed in sweep_seeds.split():
            order += [(b, seed, p) for p in selected if not is_key(p) for b in sweep if b in kept]
    return order


def main():
    n_gpus = check()
    n_jobs = int(jobs)
    slices = []
    if n_jobs > 1 and n_gpus > 0:      # each run at once on its own GPUS / JOBS of the GPUs
        try:
            slices = pool.gpu_slices(n_gpus, n_jobs, os.environ.get("CUDA_VISIBLE_DEVICES"))
        except SystemExit as e:
            common.refuse(str(e))
    gpu_envs = [{"CUDA_VISIBLE_DEVICES": s, "GPUS": str(n_gpus // n_jobs)} for s in slices]
    selected = all_points()
    Path(out).mkdir(parents=True, exist_ok=True)
    lock = open(Path(out) / ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"another frontier.sh is running on {out} (it holds {out}/.lock)")
    if preflight in ("1", "force") or (preflight == "auto" and preset == "paper") or estimate == "true":
        preflights(selected, gpu_envs[0] if gpu_envs else {}, slices)
    slot_list = pool.slots(n_jobs, gpu_envs or None)
    task_dirs = {}
    if preset.startswith("lab") and not builds:
        (Path(out) / "regimes").mkdir(parents=True, exist_ok=True)
        kept, firsts = chosen_builds(slot_list, task_dirs)
    else:
        kept, firsts = [int(b) for b in (builds or "0").split()], []
        for b in kept if preset.startswith("lab") else ():
            task_dirs[b] = task_dir(b)
    if points == "probes":
        print(f"the rule's builds: {' '.join(map(str, kept))} (POINTS=probes: no run)")
        return
    sweep = [int(b) for b in (firsts or kept[:1] if sweep_builds == "first" else sweep_builds.split())]
    print(f"frontier {out} on {preset}: {len(selected)} point(s) [{' '.join(selected)}] × builds "
          f"[{' '.join(map(str, kept))}] × seeds [{seeds}]"
          + (f" (the points other than [{key_points}] only on builds [{' '.join(map(str, sweep))}] × seeds "
             f"[{sweep_seeds}])" if key_points else "")
          + f", {total_updates} updates each, evaluated every {eval_updates}; resident up to μ = {resident_max_mu}; "
            f"baseline {baseline}", flush=True)
    order = runs_in_order(selected, kept, sweep)
    run_name = lambda p: "{}-mu{}".format(*parse_point(p)[:2])  # noqa: E731  (its lr: not in it)
    tasks = [launch_task(Path(out) / f"build{b}" / f"seed{s}" / run_name(p), b, s, point_env(p),
                         task_dirs)
             for b, s, p in order]

    def started(i, name, cores, env):
        where = "".join([f", cores {','.join(map(str, cores))}" if cores else "",
                         f", GPUs {env['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in env else ""])
        print(f"[{i + 1}/{len(tasks)}] {name} ({minutes()}{where})", flush=True)
    pool.run(tasks, slot_list, started)
    table = python("tools/frontier.py", f"--runs_dir={out}", f"--baseline={baseline}", f"--costs={costs}",
                   f"--key_points={key_points}",
                   stdout=subprocess.PIPE).stdout
    print(table, end="")
    (Path(out) / "frontier.log").write_text(table)
    print(f"frontier done in {minutes()}: {out}/frontier.md, {out}/plots/")


if __name__ == "__main__":
    main()
