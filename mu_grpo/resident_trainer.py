"""Resident mode's trainer (optimize.py --resident, docs/design.md §4): one process for the whole
run, handed each stage's rollouts and handing each policy over (mu_grpo/handoff.py) where the
process-per-phase loop starts a trainer for every stage. What only that mode does: the trainer's
start (the hand-over, the run's newest train state continued, the engines asleep before it takes
memory) and the stages it trains, each decided once the one before is trained. optimize.py calls
trainer_start where the modes differ; every setting comes as an argument (this module reads no
script's globals). The engines' side: mu_grpo/resident_engines.py.
"""
import gc
import math
import shutil
import time
from pathlib import Path

import torch

from mu_grpo import checkpoint, common, handoff, passes, records, tracking
from mu_grpo import trainer_model as M
from mu_grpo.trainer_model import log


# ----------------------------------------------------------------------------- the trainer's side


def trainer_start(run_dir, plan, make_trainer, policy_handoff, engines, buffer_mb):
    """The resident trainer's start: the hand-over (PolicyHandover, `policy_handoff` to
    `engines` engine processes, each rank's transfer buffer `buffer_mb` MiB) and the trainer
    (make_trainer(source, resume): optimize.py's Trainer) continuing the run directory's newest
    train state, built once the engines have slept (after their first rollouts; on a resume with the
    transfer, at once); a resumed run trains the stages after that state again (their rollouts are
    on disk): an unbroken run's weights. Returns (trainer, hand-over, the stages: trainer_stages);
    no trainer and no stages once every stage is trained (the engines still evaluate the last
    policy)."""
    rank, world, device = M.placement()
    is_main = rank == 0
    partner = handoff.Partner(run_dir, "trainer")
    if is_main:
        partner.announce()
    handover = PolicyHandover(partner, plan, is_main)
    last, meta = checkpoint.newest_state(run_dir)
    first = (last + 1 if meta["complete"] else last) if meta else 0
    last_dir = records.stage_dir(run_dir, last) if meta else None
    # killed after stage `last`'s complete train state, before its policy reached the run directory:
    # saved again below
    resave = meta is not None and meta["complete"] and not common.policy_record(
        last_dir / records.POLICY)
    untrained = plan.stage(run_dir, first).updates
    if meta is not None and meta["complete"] and not resave:
        handover.publish_saved(last, last_dir / records.POLICY)   # the engine resumes from it
        # killed in its last evaluation: nothing to train, so no model or state (~91 GB at 7B) is
        # loaded beside the engine's start (vllm/v1/worker/gpu_worker.py:719 asserts no other
        # process frees memory meanwhile)
        if not untrained:
            log(f"stage {first}: every stage is trained; the last policy goes to its evaluation")
            return None, handover, []
    # vLLM's import (seconds) while the engines start, not after their rollouts
    if policy_handoff == "transfer":
        from mu_grpo import transfer  # vLLM's transfer classes: only with the transfer hand-off
        handover.sender = transfer.Sender(run_dir, engines, device, rank, world,
                                          check=partner.check_partner,
                                          buffer_bytes=buffer_mb * 2**20)
    # the engine's first rollouts: it is asleep before this process takes memory (to resave, no: the
    # engine waits for that policy, holding none)
    if untrained and not resave:
        partner.wait_for_rollouts(first)
    # with the transfer the engines start at once, also on a resumed run whose stages from `first`
    # have their rollouts already: they sleep before this process takes memory (with files a resumed
    # engine waits for this one's policy)
    if policy_handoff == "transfer":
        partner.wait(lambda: partner.engines_asleep(engines))
    t_start = time.time()
    trainer = make_trainer(last_dir / records.TRAIN_STATE if meta else None,
                           resume=meta is not None and not meta["complete"])
    trainer.ready()
    if handover.kind == "transfer":
        log("policies are handed over through vLLM's weight-transfer API "
            f"({handover.sender.backend}, {engines} engine(s))")
    # rank 0 chooses where (it sees the same /dev/shm as the engines), broadcast: a rank that chose
    # otherwise
    else:
        # would save alone into a collective
        fast, why = M.broadcast(
            handoff.fast_dir(run_dir,
                             M.parameter_count(trainer.start_policy) * trainer.dtype.itemsize)
            if is_main else None)
        handover.use_files(fast)
        log(f"policies are handed over through {fast}: {why}")
    if resave:
        counts = {k: meta[k] for k in checkpoint.COUNTS}
        checkpoint.save_policy(trainer.model, trainer.start_policy, trainer.dtype,
                               last_dir / records.POLICY,
                               {"stage": last, "stage_updates": meta["update"], **counts})
        # the cache of the state's load and the policy's gather back to the driver before the engine
        # starts beside this process (vLLM's start refuses a share above the free memory,
        # vllm/v1/worker/utils.py request_memory), as every stage's hand-over does
        # (release_gradients)
        M.release_memory()
        handover.publish_saved(last, last_dir / records.POLICY)
    # (the train state's load leaves garbage) then what lives for the run (the model, the modules:
    # vLLM's with the transfer) is out of every later gc.collect (model.release_memory's): on a CPU
    # a collect takes 0.1 s with torch and transformers imported, 0.3 s with vLLM too, a few ms once
    # they are frozen
    gc.collect()
    gc.freeze()
    if is_main:
        partner.timeline({"phase": "start", "name": "trainer_start", "stage": first,
                          "start": t_start, "end": time.time()})
    return trainer, handover, trainer_stages(run_dir, plan, handover, first)


def trainer_stages(run_dir, plan, handover, first):
    """(stage, its records.StageOutputs) of every stage from `first` until the plan ends the run,
    each decided once the stage before it is trained (stage_rules.StagePlan.stage) and opened once
    its rollouts are in."""
    s = first
    while (decided := plan.stage(run_dir, s)).updates:
        # the stage's line
        log(tracking.where_line(run_dir, plan.run_updates, s) if M.placement()[0] == 0 else None)
        handover.wait_for_rollouts(s)
        stage_policy = records.stage_dir(run_dir, s) / records.POLICY
        yield passes.open_stage(records.stage_dir(run_dir, s)), records.StageOutputs(
            out_dir=stage_policy, updates_per_stage=decided.updates, save_state=decided.save,
            policy_dirs=handover.policy_dirs(stage_policy, s, decided.save), check_saves=s == first)
        s += 1


# -------------------------------------------------------------------------- the hand-over, its side


class PolicyHandover:
    """The resident trainer's side of handing each policy to the engines (rank 0 writes; every rank
    sends), for the two ways a resident run does it: files (policy_<s>/ in the fast directory,
    fast_dir, for the engines to load) or transfer (vLLM's weight-transfer API: `sender`, a
    transfer.Sender). `plan` (stage_rules.StagePlan) decides the stage each policy generates: its
    prompts and whether the engines evaluate the policy first go with it."""

    def __init__(self, partner, plan, is_main, sender=None):
        self.partner, self.plan, self.is_main, self.sender = partner, plan, is_main, sender
        # files: the directory, chosen once the trainer knows the policy's size (use_files)
        self.fast = None
        # the last stage's wait for its rollouts; what each rank then held
        self.waited = self.reserved = None

    @property
    def kind(self):
        return "files" if self.sender is None else "transfer"

    def use_files(self, where):
        self.fast = Path(where)

    def wait_for_rollouts(self, s):
        self.waited = self.partner.wait_for_rollouts(s)

    def policy_dirs(self, stage_policy, s, due):
        """Where train_stage saves the policy trained on stage s: the fast directory's policy_<s>
        (files), and the run directory's stage_policy when a save is `due` there."""
        return (*([self.fast / f"policy_{s}"] if self.sender is None else []),
                *([stage_policy] if due else []))

    def before_stage(self, s):
        """Before stage s's policy is written: two policies coexist in the fast directory, s − 1 and
        s."""
        if self.is_main and self.sender is None:
            shutil.rmtree(self.fast / f"policy_{s - 2}", ignore_errors=True)

    def publish_saved(self, s, directory):
        """Hand over the policy trained on stage s, saved at `directory`, with its recorded
        counts."""
        if self.is_main:
            record = common.policy_record(directory)
            self.publish(s, directory, record["fingerprint"], record["run_updates"])

    def publish(self, s, path, fingerprint, run_updates, engine_weights=None):
        """The policy trained on stage s (at `path`, or None: in the engines already), with the
        stage it generates as the plan decides it."""
        after = self.plan.stage(self.partner.run_dir, s + 1)
        self.partner.publish_policy(
            s, path, records.stage_dir(self.partner.run_dir, s) / records.POLICY, fingerprint,
            run_updates=run_updates, next_stage_prompts=after.prompts, evaluate=after.evaluate,
            engine_weights=engine_weights)

    def hand_over(self, s, trainer, run_updates):
        """Hand over the policy trained on stage s (train_stage has saved it where policy_dirs
        said), the trainer first keeping only its resident state (fp32 weights, AdamW; not the
        gradients) as the engines wake. Returns the timing: the rollouts' wait, the gradient bytes
        kept, the transfer's seconds and (rank 0) GB/s."""
        timing = {"wait_seconds": self.waited,
                  "gradient_bytes_kept": M.release_gradients(trainer.optimizer)}
        if self.sender is None:
            self.publish_saved(s, self.fast / f"policy_{s}")
        else:
            record, fingerprint, timing["handoff_seconds"], sent = self.sender.send(
                trainer.model, trainer.dtype)
            if self.is_main:
                self.publish(s, None, fingerprint, run_updates, engine_weights=record)
                timing["handoff_gb_per_s"] = sent / 1e9 / timing["handoff_seconds"]
        # what each rank's allocator holds while the engines are awake (the preflight gates it
        # against their share)
        self.reserved = reserved_gib_per_rank()
        return timing

    def record(self, s, start, timing):
        """Stage s's row in the run's timeline (rank 0)."""
        if self.is_main:
            self.partner.timeline({"phase": "optimize", "name": f"optimize_{s}", "stage": s,
                                   "start": start, "end": time.time(), "wait_seconds": self.waited,
                                   "gradient_bytes_kept": timing["gradient_bytes_kept"],
                                   "reserved_gib_per_rank": self.reserved, "handoff": self.kind,
                                   **{k: v for k, v in timing.items()
                                      if k.endswith(("seconds", "per_s"))}})

    def close(self):
        if self.sender is not None:
            self.sender.close()


def reserved_gib_per_rank():
    """What each rank's allocator holds (NaN without a GPU: None), gathered on every rank."""
    held = M.reserved_gib()
    reserved = M.gather_values(torch.tensor([math.nan if held is None else held],
                                            device=M.placement()[2]))
    return [common.finite_or_none(x) for x in reserved.tolist()]
