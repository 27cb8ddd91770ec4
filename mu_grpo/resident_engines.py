"""Resident mode's engines (generate.py --resident, docs/design.md §4): they live for the whole run,
each stage generated with the policy the trainer handed over before it (mu_grpo/handoff.py),
sleeping between stages, where the process-per-phase loop starts them for every stage with --policy.
What only that mode does is EngineSide's; generate.py's Engines calls it where the modes differ.
Every setting comes as an argument (this module reads no script's globals). The trainer's side:
mu_grpo/resident_trainer.py.
"""
import contextlib
import itertools
import time

from mu_grpo import benchmarks, engine, handoff, records


# ----------------------------------------------------------------------------- the engines' side


class EngineSide:
    """What resident engines do beyond a stage's work (generate.py's Engines holds that, the same in
    both modes): the stages they generate, each with the policy the trainer handed over before it
    (engine.PolicyReceiver) until one says the run is over; asleep after their shards, before the
    trainer takes memory; the coordinator's waits for its engine processes (`procs_alive`: raises
    when one failed); the stage's timeline rows. `rank`: this engine among the node's;
    `coordinator`: the main process (the run's files, the rows).

    Timeline rows: the main process's per stage (phase generate: from the policy's arrival to the
    manifest, and the wait for it), every engine's own per stage (phase engine: its reload, sleep
    and the GPU memory sleep freed)."""

    def __init__(self, run_dir, policy_handoff, n_engines, rank, coordinator):
        self.run_dir, self.policy_handoff, self.n_engines = run_dir, policy_handoff, n_engines
        self.rank, self.coordinator = rank, coordinator
        self.partner = handoff.Partner(run_dir, "engine")
        self.receiver = self.row = self.mine = None
        # the main process: its engines' rows of the stage (their flags)
        self.engine_rows = []

    def policies(self, engines, first_pending, start_engine):
        """(s, the flag of its policy) of every stage from the first without a manifest
        (first_pending()), each with the policy handed over before it (the first: engines.given(),
        --policy, or on a resume the last one handed over), until a policy's flag has no next
        stage. `engines`: generate.py's Engines, whose llm this starts (start_engine(path, s)) when
        it has an engine."""
        partner = self.partner
        if self.coordinator:
            partner.announce()
        first = first_pending()
        flag = engines.given()
        # a resumed run's engine starts on the last policy handed over; with the transfer it starts
        # on the initial one, since the policy it waits for may come over the API, which needs the
        # engine up
        resumed = first > engines.first_stage
        if resumed and self.policy_handoff == "files":
            flag, _ = partner.wait_for_policy(first - 1)
        # the start-up (after that wait: the trainer's time, the engine not up)
        t_start = time.time()
        if engines.has_engine:
            engines.llm = start_engine(flag["path"], first)
        self.receiver = engine.PolicyReceiver(self.policy_handoff, partner, engines.llm,
                                              engines.index, engines.where(first))
        # a resumed run with the transfer: the trainer trains before this engine's first stage, so
        # the engine sleeps at once (the trainer takes memory only once every engine has slept:
        # mu_grpo/resident_trainer.py trainer_start)
        sleeps_first = self.policy_handoff == "transfer" and resumed
        if engines.has_engine and sleeps_first:
            engine.sleep(engines.llm)
            partner.engine_asleep(self.rank)
        # this engine's start-up (its first stage's row says it)
        started = time.time() - t_start
        if self.coordinator:
            # its row ends once every engine is asleep ("asleep": the trainer's turn)
            if sleeps_first:
                partner.wait(lambda: partner.engines_asleep(self.n_engines), partner=False,
                             watch=lambda: (engines.watch_workers(),
                                            self.trainer_alive_or_done(first - 1)))
            partner.timeline({"phase": "start", "name": "engine_start", "stage": first,
                              "start": t_start, "end": time.time(),
                              **({"asleep": True} if sleeps_first else {})})
        try:
            for s in itertools.count(first):
                self.row = {"phase": "generate", "name": f"generate_{s}", "stage": s,
                            "wait_seconds": 0.0}
                self.mine = {"phase": "engine", "name": f"engine_{self.rank}_{s}", "stage": s,
                             "engine": self.rank, "reload_seconds": 0.0,
                             "start_seconds": started if s == first else 0.0,
                             "handoff": self.policy_handoff}
                if s > first or sleeps_first:    # a policy arrives before it
                    flag, self.row["wait_seconds"] = self.receiver.wait(s, engines.where(s))
                    if engines.has_engine:
                        self.mine.update(self.receiver.load(flag, engines.where(s)))
                self.row["start"] = self.mine["start"] = time.time()
                yield s, flag
                if not flag["next_stage_prompts"]:
                    return
        finally:
            self.receiver.close()

    def trainer_alive_or_done(self, s):
        """Raise if the trainer died before handing over the policy trained on stage s: a resumed
        trainer with nothing left to train hands over the last policy and ends at once, often before
        the engine processes are up (the engines then evaluate it alone; before, the coordinator
        took that end for a death, and so on every rerun)."""
        try:
            self.partner.check_partner()
        except SystemExit:
            # (read after the check: the trainer writes it before it ends)
            if self.partner.trained(s) is None:
                raise

    def evaluation_parts(self, s):
        """Where the engines leave their shares of the evaluation before stage s: the hand-off's
        directory (cleared with every attempt's flags)."""
        return contextlib.nullcontext(
            records.stage_dir(handoff.state_dir(self.run_dir) / "eval", s - 1))

    def asleep(self, llm, s):
        """After this engine's shards of stage s: asleep before the trainer (told by the manifest)
        takes memory."""
        self.mine["sleep_seconds"], self.mine["freed_gib"] = engine.sleep(llm)
        self.partner.engine_asleep(self.rank)
        self.partner.engine_finished(s, self.rank, {**self.mine, "end": time.time()})

    def wait_for_engines(self, s, parts, shards, watch):
        """The coordinator waits for its engine processes: their shares of the evaluation (in
        `parts`, when one is due) and their shards of stage s (their flags, which hold their
        rows)."""
        if parts is not None:
            self.partner.wait(lambda: all(benchmarks.part_path(parts, r).exists()
                                          for r in range(self.n_engines)),
                              watch=watch, partner=False)
        if shards:
            self.engine_rows = self.partner.wait(
                lambda: self.partner.engines_finished(s, self.n_engines),
                watch=watch, partner=False)[1]

    def stage_rows(self):
        """The stage's timeline rows: every engine's and the main process's (which ends with the
        manifest)."""
        return [*self.engine_rows, {**self.row, "end": time.time()}]
