"""Resident mode's hand-off (docs/design.md §4): how the long-lived engine process (generate.py
--resident) and trainer process (optimize.py --resident) pass stages to each other, through files,
as mu_grpo/rollouts.py is the contract of the process-per-phase loop.

    <run>/stage_<s>/rollouts/manifest.json    the engine → the trainer: stage s is generated
                                              (mu_grpo/rollouts.py)
    <run>/resident/trained_<s>.json           the trainer → the engine: the policy trained on
                                              stage s (it generates stage s + 1): where to load
                                              it from, its label
    <run>/resident/<role>.json                each process's pid and start time, so the other
                                              can tell it died
    <run>/resident/engine_<r>_stage_<s>.json  engine r → its coordinator: its shards of stage s
                                              are written and it is asleep (its reload, sleep and
                                              freed memory: a timeline row)
    <run>/resident/engine_<r>_asleep.json     engine r → the trainer: it has slept in this
                                              attempt (the trainer takes memory only after that)
    <fast dir>/policy_<s>/                    the policies handed over (bf16 safetensors;
                                              /dev/shm when it has room for two), the last two
                                              kept

A process that waits checks its partner every poll: a partner that died (or never started) is an
error within seconds, not a hang. Resume needs no file of its own: the engine starts at the first
stage without a manifest, the trainer at the last train state saved in the run directory, and every
flag of an earlier attempt is cleared before either starts (`reset`). The trainer's side of handing
a policy over is mu_grpo/resident_trainer.py's PolicyHandover; the engines' is
engine.PolicyReceiver.
"""
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from mu_grpo import common, processes, records

# how long a process waits for its partner to announce itself (a cold vLLM or torch start)
START_GRACE_S = 600.0


def state_dir(run_dir):
    return Path(run_dir) / "resident"


def shm_root():
    """Where memory-backed hand-off directories go: /dev/shm, or MU_GRPO_SHM (a test points it
    elsewhere)."""
    return Path(os.environ.get("MU_GRPO_SHM", "/dev/shm"))


def _shm_dir(run_dir):
    return shm_root() / f"mu-grpo-{common.run_key(run_dir)}"


def fast_dir(run_dir, policy_bytes):
    """(where policies are handed over, why): a directory in /dev/shm (memory; named after the run
    directory) when it has room for the two policies that coexist there (the trainer deletes policy
    s − 2 before it writes policy s, which goes to policy_<s>.tmp first while s − 1 still exists),
    else <run>/resident/policies on the run's disk. Resident mode's trainer decides on its rank 0
    and tells the other ranks (they could see different free space while rank 0 writes, and a rank
    that chose otherwise would enter a collective save alone)."""
    root, need = shm_root(), 2 * policy_bytes
    if not (root.is_dir() and os.access(root, os.W_OK)):
        return state_dir(run_dir) / "policies", f"{root} is not a writable directory"
    free = shutil.disk_usage(root).free
    if free <= need:
        return state_dir(run_dir) / "policies", (f"{root} has {free / 1e9:.1f} GB free, not the "
                                                 f"{need / 1e9:.1f} GB two policies need (in "
                                                 "Docker: --shm-size or --ipc=host)")
    return (_shm_dir(run_dir), f"{root} has {free / 1e9:.1f} GB free for two policies of "
                               f"{policy_bytes / 1e9:.1f} GB")


def policy_locations(run_dir):
    """Both places fast_dir may choose."""
    return [_shm_dir(run_dir), state_dir(run_dir) / "policies"]


def transfer_buffer(run_dir, rank):
    """Trainer rank `rank`'s buffer of the weight transfer on a CPU machine (mu_grpo/transfer.py): a
    file in /dev/shm (or MU_GRPO_SHM), named after the run directory."""
    return shm_root() / f"{_shm_dir(run_dir).name}-transfer-rank{rank}"


def transfer_socket(run_dir, engine):
    """Engine `engine`'s control socket of the weight transfer (mu_grpo/transfer.py): in a directory
    of this user's only (mode 0700) under the temporary directory, named after the run (a Unix
    socket's path must stay under 108 bytes, which a run directory's may not)."""
    return (Path(tempfile.gettempdir())
            / f"mu-grpo-transfer-{os.getuid()}-{common.run_key(run_dir)}" / f"engine_{engine}.sock")


def clear_policies(run_dir):
    """Delete the handed-over policies wherever they went, and the transfer's buffers (a finished or
    failed run: the run directory keeps the saved ones, and a resume hands the last one over
    again)."""
    for d in policy_locations(run_dir):
        shutil.rmtree(d, ignore_errors=True)
    for f in transfer_buffers(run_dir):
        f.unlink(missing_ok=True)


def transfer_buffers(run_dir):
    """The transfer buffers of the run that exist."""
    return sorted(shm_root().glob(f"{_shm_dir(run_dir).name}-transfer-rank*"))


def reset(run_dir):
    """Clear an earlier attempt's flags, pid files and handed-over policies (run_stages.sh, before
    it starts the two processes)."""
    clear_policies(run_dir)
    shutil.rmtree(state_dir(run_dir), ignore_errors=True)
    state_dir(run_dir).mkdir(parents=True)


class StageDirectory:
    """The process-per-phase loop's hand-over (optimize.py's, beside PolicyHandover's): the policy
    is saved into the stage directory (optimize.py --out), where the next stage's generate.py
    process loads it. Nothing is waited for (the rollouts are in before the process starts), sent,
    or timed beyond optimize_timing.json (run_stages.sh times the phase)."""
    kind = "stage directory"

    def policy_dirs(self, stage_policy, s, due):
        return (stage_policy,)

    def before_stage(self, s):
        pass

    def hand_over(self, s, trainer, run_updates):
        return {}

    def record(self, s, start, timing):
        pass

    def close(self):
        pass


# The trainer's memory that stays on each GPU while the engine is awake, beyond its resident state:
# the CUDA context and NCCL's buffers (~1 GiB, which torch.cuda.memory_reserved does not count) and
# what the caching allocator cannot hand back (fragmentation, ~1 GiB). Estimates: no GPU has run
# resident mode.
CUDA_CONTEXT_GIB = 1.0
TRAINER_OVERHEAD_GIB = CUDA_CONTEXT_GIB + 1.0


def max_engine_share(parameters, ranks, gpu_bytes, reference_model=False):
    """The largest RESIDENT_GPU_MEMORY (an engine's fraction of its GPU, vLLM's
    gpu_memory_utilization) that leaves the resident trainer its memory while the engine is awake:
    fp32 weights and AdamW's two moments, 12 bytes per parameter sharded over the ranks (the
    gradients are freed before the engine wakes), KL's fp32 reference model (4 bytes per parameter)
    when there is one, and TRAINER_OVERHEAD_GIB. vLLM's budget covers the whole engine (weights, KV
    cache, CUDA graphs), and its start-up refuses a budget above the free memory
    (vllm/v1/worker/utils.py `request_memory`, called from gpu_worker.py `init_device`: "Free memory
    on device ... is less than desired GPU memory utilization"), which is what a resumed engine
    meets, started beside the trainer. Returns (bound, trainer bytes per GPU)."""
    per_parameter = 12 + (4 if reference_model else 0)
    trainer = per_parameter * parameters / ranks + TRAINER_OVERHEAD_GIB * 2**30
    return math.floor(100 * (1 - trainer / gpu_bytes)) / 100, trainer


def trainer_memory_check(reserved_gib_per_rank, share, gpu_gib):
    """The preflight's gate on what the resident trainer holds beside an awake engine, measured
    after a hand-off (each rank's allocator: optimize.py's timeline row, reserved_gib_per_rank): the
    most any rank holds at most what the engine's share leaves, (1 − share) · the GPU's GiB, less
    CUDA_CONTEXT_GIB. Returns (passed, the most, the limit); passed None without a GPU, False with
    the figure missing."""
    if gpu_gib is None:
        return None, None, "no GPU"
    limit = round((1 - share) * gpu_gib - CUDA_CONTEXT_GIB, 2)
    if not reserved_gib_per_rank or None in reserved_gib_per_rank:
        return False, "missing", limit
    return max(reserved_gib_per_rank) <= limit, round(max(reserved_gib_per_rank), 2), limit


# RESIDENT_GPU_MEMORY=auto: the bound less this share of the GPU (~7 GiB of an H200's 139.8 GiB, an
# estimate: no GPU has run resident mode), for what the bound does not count: the trainer's
# allocator blocks beyond TRAINER_OVERHEAD_GIB, NCCL buffers grown under load, other processes on
# the GPU
ENGINE_SHARE_MARGIN = 0.05


def auto_engine_share(bound):
    """RESIDENT_GPU_MEMORY=auto's share: the bound less ENGINE_SHARE_MARGIN, in hundredths (7B on
    4×H200: 0.83 → 0.78, with KL's reference model 0.78 → 0.73)."""
    return round(bound - ENGINE_SHARE_MARGIN, 2)


def check_engine_share(parameters, ranks, share, kl_coef, gpu_bytes):
    """run_stages.sh, RESIDENT=true on GPUs, before any phase (mu_grpo/launch.py):
    RESIDENT_GPU_MEMORY resolved (auto: auto_engine_share of the bound, said on stderr) and
    returned, for a model of `parameters` trained on `ranks` GPUs of gpu_bytes each; a share above
    max_engine_share, or no share left, is refused in one line."""
    ranks = int(ranks)
    bound, trainer = max_engine_share(parameters, ranks, gpu_bytes,
                                      reference_model=float(kl_coef) > 0)
    keeps = (f"the resident trainer keeps ~{trainer / 2**30:.1f} GiB on each GPU "
             f"({parameters / 1e9:.2f} B parameters over {ranks} rank(s)) of its "
             f"{gpu_bytes / 2**30:.1f} GiB")
    if share == "auto":
        share = auto_engine_share(bound)
        if share <= 0:
            raise SystemExit("RESIDENT_GPU_MEMORY=auto: no share of the GPU is left for an "
                             f"engine: {keeps}, an engine may take at most {bound:g} less a margin "
                             f"of {ENGINE_SHARE_MARGIN:g}; use more TRAIN_RANKS, or RESIDENT=false")
        print(f"RESIDENT_GPU_MEMORY=auto: {share:g} of each GPU per engine ({keeps}, so at most "
              f"{bound:g}, less a margin of {ENGINE_SHARE_MARGIN:g}; estimates, not measured on a "
              "GPU)", file=sys.stderr)
        return share
    share = float(share)
    if share > bound:
        raise SystemExit(f"RESIDENT_GPU_MEMORY={share:g} is too much: {keeps}, so an engine may "
                         f"take at most {bound:g}; set RESIDENT_GPU_MEMORY={bound:g} or less")
    return share


class Partner:
    """One side of the hand-off: announces this process, waits for the other's files while watching
    it live."""

    def __init__(self, run_dir, role):
        if role not in ("engine", "trainer"):
            raise ValueError(f"role must be engine or trainer, got {role!r}")
        self.run_dir, self.role = Path(run_dir), role
        self.other = "trainer" if role == "engine" else "engine"
        self.dir = state_dir(run_dir)
        self.started = time.monotonic()

    def _write(self, name, obj):
        self.dir.mkdir(parents=True, exist_ok=True)
        common.atomic_write_json(self.dir / name, obj)

    def announce(self):
        self._write(f"{self.role}.json",
                    {"pid": os.getpid(), "start": processes.start_time(os.getpid())})

    def check_partner(self):
        """Raise SystemExit if the other process died, or has not announced itself within
        START_GRACE_S."""
        path = self.dir / f"{self.other}.json"
        if not path.exists():
            if time.monotonic() - self.started > START_GRACE_S:
                raise SystemExit(f"the {self.other} process has not started within "
                                 f"{START_GRACE_S:.0f} s ({path} is missing): see its log")
            return
        info = json.loads(path.read_text())
        if not processes.same_process(info["pid"], info["start"]):
            raise SystemExit(f"the {self.other} process (pid {info['pid']}) has died: see its log; "
                             "rerun to resume")

    def wait(self, ready, watch=None, poll_s=0.05, partner=True):
        """Wait until ready() is true (not None or False), checking the partner (and calling
        watch(), which raises on a failure of the caller's own: its engine processes) at every poll;
        returns (the seconds waited, what ready() returned). partner=False: a wait on the caller's
        own processes, during which the partner may end normally (the trainer exits after handing
        over its last policy while the engines still evaluate it)."""
        t0 = time.perf_counter()
        while not (value := ready()):
            if partner:
                self.check_partner()
            if watch is not None:
                watch()
            time.sleep(poll_s)
        return time.perf_counter() - t0, value

    def timeline(self, row):
        """Append a row of this process's (row: phase, name, stage, start, end, ...) to
        <run>/timeline.jsonl."""
        records.append(self.run_dir, row, process=self.role)

    # the trainer → the engine

    def publish_policy(self, stage, path, label, fingerprint, run_updates, next_stage_prompts,
                       evaluate, engine_weights=None):
        """The policy trained on `stage` is at `path` (complete), or (path None) is in the engines
        already, handed over through vLLM's weight-transfer API (mu_grpo/transfer.py) with
        `engine_weights` the hashes they must hold; `label` is its run-directory name, run_updates
        the run's updates it was trained for (its policy_id.json record), next_stage_prompts the
        prompts of the stage it generates and `evaluate` whether the engines evaluate it first, as
        the trainer's plan decides (0 prompts: the run's last policy)."""
        self._write(f"trained_{stage}.json", {"stage": stage, "path": str(path) if path else None,
                                              "policy": str(label), "fingerprint": fingerprint,
                                              "run_updates": run_updates,
                                              "next_stage_prompts": next_stage_prompts,
                                              "evaluate": evaluate,
                                              **({"engine_weights": engine_weights}
                                                 if engine_weights else {})})

    def trained(self, stage):
        """The flag of the policy trained on `stage`, or None."""
        path = self.dir / f"trained_{stage}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def wait_for_policy(self, stage):
        """(flag, seconds waited) of the policy trained on `stage`."""
        seconds, flag = self.wait(lambda: self.trained(stage))
        return flag, seconds

    # the engines → their coordinator (generate.py's main process; with one engine, the same
    # process)

    def engine_finished(self, stage, rank, row):
        """Engine `rank` has written its shards of `stage` and is asleep; `row` is its timeline row
        (its reload, sleep and the memory sleep freed), which the coordinator appends once every
        engine's is in."""
        self._write(f"engine_{rank}_stage_{stage}.json", row)

    def engines_finished(self, stage, n_engines):
        """The n engines' rows of `stage` in rank order once all are in, else None."""
        paths = [self.dir / f"engine_{r}_stage_{stage}.json" for r in range(n_engines)]
        if not all(p.exists() for p in paths):
            return None
        return [json.loads(p.read_text()) for p in paths]

    def engine_asleep(self, rank):
        """Engine `rank` is asleep (after its first stage, or at once on a resumed run with the
        transfer, whose trainer trains before that engine's first stage): the trainer takes memory
        only once every engine has been (engines_asleep). Written again after every stage; cleared
        with the attempt's other flags."""
        self._write(f"engine_{rank}_asleep.json", {"rank": rank})

    def engines_asleep(self, n_engines):
        return all((self.dir / f"engine_{r}_asleep.json").exists() for r in range(n_engines))

    # the engine → the trainer

    def manifest(self, stage):
        return records.stage_dir(self.run_dir, stage) / records.ROLLOUTS / records.MANIFEST

    def wait_for_rollouts(self, stage):
        """Seconds waited until stage `stage`'s rollouts are complete (their manifest is written
        last, once every engine is asleep)."""
        return self.wait(lambda: self.manifest(stage).exists())[0]
