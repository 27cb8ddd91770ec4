"""The loop's rules: how many updates each stage has (StagePlan: fixed, or planned from where the
stage before ended) and where training on a stage ends (StageEnd: after every minibatch, or on the
drift warning). run_stages.sh's loop, the resident trainer and the preflight follow the same two,
read from the run's records (stage_<s>/stage_end.json) alone, so that a rerun plans the same
stages."""
import dataclasses
import functools
import json
import math
import random

from mu_grpo import records


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage as the plan decides it (StagePlan.stage): the one record run_stages.sh's loop, the
    resident trainer (and through its hand-over the engines) and the preflight read."""
    index: int
    updates: int                        # μ: its minibatches (0: the run is over)
    prompts: int                        # its rollouts' prompts: μ minibatches of prompts_per_update
    evaluate: bool                      # the policy it starts from (trained on stage index − 1,
                                        # the initial one at 0) is evaluated before its rollouts;
                                        # with updates 0, the run's last policy
    save: bool                          # its policy and train state go into the run directory when
                                        # it ends (the run's older train states then go, unless
                                        # they are kept: optimize.py)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """How a run's stages are decided, the one rule run_stages.sh's loop, the resident trainer and
    the preflight follow (stage). μ: stage_end="fixed": `stages` stages of `updates_per_stage`
    updates. stage_end="drift": stage 0 of `updates_per_stage`; after a stage that ended on the
    drift warning after u updates, ceil(drift_growth · u) (the warning came at u: the next stage
    plans a little past it); after one that trained on all its μ minibatches without a warning, 2μ;
    at least the μ_min below which no stage ends (its record's drift_min_updates), at most
    drift_max_updates, never past the run's total_updates. Evaluated: the initial policy, the one
    after every eval_every-th stage and the last (0: none). Saved into the run directory: every
    save_every-th stage and any that may be the run's last (0: the last only; the loop per phase
    saves every stage: 1). Read from the records alone (stage_<s>/stage_end.json), so a rerun plans
    the same stages."""
    updates_per_stage: int              # μ: fixed, every stage's; drift, the first stage's
    stages: int                         # fixed: the run's stages (drift: total_updates' default)
    stage_end: str = "fixed"            # fixed | drift
    total_updates: int = 0              # drift: the run's updates (0: stages × updates_per_stage)
    drift_growth: float = 1.25
    # drift: the largest μ a stage is planned with (0: 4 × updates_per_stage)
    drift_max_updates: int = 0
    prompts_per_update: int = 1
    eval_every: int = 0
    save_every: int = 1

    def __post_init__(self):
        if self.stage_end not in ("fixed", "drift"):
            raise ValueError(f"stage_end must be fixed or drift, got {self.stage_end!r}")
        if not self.total_updates:
            object.__setattr__(self, "total_updates", self.stages * self.updates_per_stage)
        if not self.drift_max_updates:
            object.__setattr__(self, "drift_max_updates", 4 * self.updates_per_stage)

    @property
    def run_updates(self):
        """The updates of the whole run."""
        return (self.stages * self.updates_per_stage if self.stage_end == "fixed"
                else self.total_updates)

    def stage(self, run_dir, s):
        """Stage s of the run at run_dir, decided."""
        updates, before = self._updates(run_dir, s)
        may_be_last = (s == self.stages - 1 if self.stage_end == "fixed" else before
                       + updates >= self.total_updates)
        return Stage(s, updates, updates * self.prompts_per_update,
                     evaluate=bool(self.eval_every)
                     and (s == 0 or s % self.eval_every == 0 or not updates),
                     save=bool(updates)
                     and (may_be_last or bool(self.save_every) and (s + 1) % self.save_every == 0))

    def _updates(self, run_dir, s):
        """(μ of stage s, 0 once the run is over; the run's updates before it: drift's, from stage s
        − 1's record)."""
        if self.stage_end == "fixed":
            return (self.updates_per_stage if s < self.stages else 0), s * self.updates_per_stage
        if s == 0:
            return min(self.updates_per_stage, self.total_updates), 0
        path = records.stage_dir(run_dir, s - 1) / records.STAGE_END
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: stage {s - 1} has not been trained on, so "
                                    f"stage {s} has no size")
        end = json.loads(path.read_text())
        size = (math.ceil(self.drift_growth * end["updates"]) if end["reason"] == "drift"
                else 2 * end["generated_updates"])
        return max(0, min(max(end["drift_min_updates"], size), self.drift_max_updates,
                          self.total_updates - end["run_updates"])), end["run_updates"]


@dataclasses.dataclass(frozen=True)
class StageEnd:
    """Where training on a stage ends (docs/design.md §4): after all its minibatches (fixed), or
    (drift) before the first update u ≥ min_updates at which the drift warning is on: the moving
    average of 1 − E[ρ | A<0] over the last `window` updates that had an A<0 token, above
    `threshold`. Decided from the metrics rows' E[ρ | A<0], so a resumed stage ends where the
    unbroken one did; its record (records.STAGE_END) is what StagePlan sizes the next stage by."""
    rule: str = "fixed"                 # fixed | drift
    window: int = 16
    threshold: float = 0.01
    min_updates: int = 16

    def warning(self, neg_ratios):
        """The warning after these updates (their E[ρ | A<0], None or NaN for a minibatch without an
        A<0 token): (the moving average, or None before there are `window` of them; whether it
        exceeds the threshold)."""
        seen = [v for v in neg_ratios if v is not None and math.isfinite(v)][-self.window:]
        if self.window < 1 or len(seen) < self.window:
            return None, False
        average = sum(1.0 - v for v in seen) / len(seen)
        return average, average > self.threshold

    def ends_before(self, u, neg_ratios):
        """Whether the stage ends before update u, given updates 0..u−1's E[ρ | A<0]."""
        return self.rule == "drift" and u >= self.min_updates and self.warning(neg_ratios)[1]

    def record(self, stage, done, generated, neg_ratios, unused_groups):
        """The stage's STAGE_END row, less the run's counts: where it ended (`done` of its
        `generated` updates) and why, the drift signal there, and the groups generated for it but
        never trained on."""
        average, warned = self.warning(neg_ratios)
        return {"stage": stage, "reason": "drift" if done < generated else "all minibatches",
                "updates": done, "generated_updates": generated, "stage_end": self.rule,
                "drift_signal": average, "drift_warning": warned, "drift_window": self.window,
                "drift_threshold": self.threshold, "drift_min_updates": self.min_updates,
                "unused_prompts": len(unused_groups), "unused_groups": unused_groups}


@functools.lru_cache(maxsize=4)
def _permutation(n, seed, epoch):
    order = list(range(n))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    return order


def shuffled_window(items, start, count, seed):
    """items at positions [start, start + count) of an endless sequence of seeded shuffles of items,
    a new shuffle per pass (epoch): the order in which a run meets its training problems.
    generate.py takes each stage's prompts from it (stages see different prompts, wrapping into a
    new epoch; a rerun sees the same ones), minibatch_schedule an update's groups when it draws from
    repeated passes."""
    n = len(items)
    return [items[_permutation(n, seed, g // n)[g % n]] for g in range(start, start + count)]
