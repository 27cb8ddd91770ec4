"""mu_grpo/handoff.py, in process: the resident processes' protocol (announce, a dead or missing
partner, policies handed over, the engines' rows), where policies go (/dev/shm or the run's disk)
and the engines' share of a GPU."""
import json
import os
import subprocess
import sys
import time
import types

import pytest
import torch

from mu_grpo import common, handoff, processes, resident_trainer


def test_a_partner_that_announced_is_watched_and_a_dead_one_is_named(tmp_path):
    engine = handoff.Partner(tmp_path, "engine")
    engine.announce()
    info = json.loads((tmp_path / "resident" / "engine.json").read_text())
    assert info["pid"] == os.getpid() and info["start"] == processes.start_time(os.getpid())
    trainer = handoff.Partner(tmp_path, "trainer")
    trainer.check_partner()                                   # alive: nothing happens
    # a partner that died: a process that announced itself and exited
    code = f"from mu_grpo import handoff; handoff.Partner({str(tmp_path)!r}, 'engine').announce()"
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=os.path.dirname(os.path.dirname(handoff.__file__)))
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match=r"the engine process \(pid \d+\) has died"):
        trainer.wait(lambda: False, poll_s=0.01)
    assert time.monotonic() - t0 < 1.0                         # within one poll, not a timeout
    # a wait on the caller's own processes goes on after the partner ended (the trainer after its
    # last policy)
    answers = iter([None, None, "parts"])
    assert trainer.wait(lambda: next(answers), poll_s=0.01, partner=False)[1] == "parts"


def test_a_partner_that_never_starts_is_an_error_after_the_grace(tmp_path, monkeypatch):
    trainer = handoff.Partner(tmp_path, "trainer")
    trainer.check_partner()                                    # within the grace: waiting is fine
    monkeypatch.setattr(handoff, "START_GRACE_S", 0.05)
    with pytest.raises(SystemExit, match="the engine process has not started within 0 s"):
        trainer.wait(lambda: False, poll_s=0.01)


def test_wait_returns_the_seconds_and_what_was_ready(tmp_path):
    partner = handoff.Partner(tmp_path, "trainer")
    answers = iter([None, None, {"x": 1}])
    seconds, value = partner.wait(lambda: next(answers), poll_s=0.01)
    assert value == {"x": 1} and seconds >= 0.02


def test_engines_finished_only_once_every_engine_wrote_its_row(tmp_path):
    partner = handoff.Partner(tmp_path, "engine")
    partner.engine_finished(3, 1, {"engine": 1, "reload_seconds": 0.5})
    assert partner.engines_finished(3, 2) is None             # engine 0 has not finished stage 3
    partner.engine_finished(3, 0, {"engine": 0, "reload_seconds": 0.25})
    assert [r["engine"] for r in partner.engines_finished(3, 2)] == [0, 1]
    assert partner.engines_finished(2, 2) is None


def test_a_published_policy_is_read_back_and_reset_clears_every_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("MU_GRPO_SHM", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    trainer = handoff.Partner(tmp_path / "run", "trainer")
    trainer.announce()
    trainer.publish_policy(0, "/x/policy_0", "run/stage_0/policy", "abc", run_updates=8,
                           next_stage_prompts=32, evaluate=True)
    flag, waited = handoff.Partner(tmp_path / "run", "engine").wait_for_policy(0)
    assert flag == {"stage": 0, "path": "/x/policy_0", "policy": "run/stage_0/policy",
                    "fingerprint": "abc", "run_updates": 8, "next_stage_prompts": 32,
                    "evaluate": True}
    for d in handoff.policy_locations(tmp_path / "run"):
        (d / "policy_0").mkdir(parents=True)
    handoff.reset(tmp_path / "run")
    assert list((tmp_path / "run" / "resident").iterdir()) == []
    assert not any(d.exists() for d in handoff.policy_locations(tmp_path / "run"))


def test_the_file_hand_over_saves_where_the_engines_load_and_publishes_the_next_stages_size(
        tmp_path):
    # a drift-free fixed run of 3 stages × μ = 4, 8 prompts per update, evaluated every 2nd stage:
    # the policy trained on stage 0 generates stage 1 (4 × 8 = 32 prompts; not evaluated: 1 % 2),
    # the one trained on stage 2 none (the run is over: evaluated)
    from mu_grpo import stage_rules
    run, fast = tmp_path / "run", tmp_path / "fast"
    plan = stage_rules.StagePlan(4, stages=3, prompts_per_update=8, eval_every=2)
    handover = resident_trainer.PolicyHandover(handoff.Partner(run, "trainer"), plan, is_main=True)
    handover.use_files(fast)
    assert handover.kind == "files"
    assert handover.policy_dirs(run / "stage_1" / "policy", 1, due=False) == (fast / "policy_1",)
    assert handover.policy_dirs(run / "stage_2" / "policy", 2, due=True) == (
        fast / "policy_2", run / "stage_2" / "policy")
    for s, updates in [(0, 4), (2, 12)]:
        (fast / f"policy_{s}").mkdir(parents=True)
        (fast / f"policy_{s}"
         / common.POLICY_ID_FILE).write_text(
             json.dumps({"fingerprint": f"fp{s}", "run_updates": updates}))
    # the trainer's side the hand-over frees: its gradients (bytes still held: none)
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    trainer = types.SimpleNamespace(optimizer=torch.optim.SGD([weight], lr=0.1))
    assert handover.hand_over(0, trainer, run_updates=4) == {
        "wait_seconds": None, "gradient_bytes_kept": 0}
    assert weight.grad is None and handover.reserved == [None]      # (no GPU: no allocator)
    handover.hand_over(2, trainer, run_updates=12)
    engine = handoff.Partner(run, "engine")
    assert engine.trained(0) == {"stage": 0, "path": str(fast / "policy_0"),
                                 "policy": str(run / "stage_0" / "policy"), "fingerprint": "fp0",
                                 "run_updates": 4, "next_stage_prompts": 32, "evaluate": False}
    assert (engine.trained(2)["next_stage_prompts"], engine.trained(2)["evaluate"],
            engine.trained(2)["fingerprint"]) \
        == (0, True, "fp2")
    # policy_0 goes before policy_2 is written; policy_1 stays (s − 1)
    handover.before_stage(2)
    assert not (fast / "policy_0").exists() and (fast / "policy_2").exists()


def test_clearing_policies_at_the_end_keeps_the_flags_and_the_run_directory(tmp_path, monkeypatch):
    # run_stages.sh after a resident run ends or fails: up to two policies per location would stay
    # in /dev/shm
    monkeypatch.setenv("MU_GRPO_SHM", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    handoff.reset(tmp_path / "run")
    handoff.Partner(tmp_path / "run", "trainer").publish_policy(
        1, "/x", "y", "fp", run_updates=4, next_stage_prompts=0, evaluate=False)
    for d in handoff.policy_locations(tmp_path / "run"):
        (d / "policy_1").mkdir(parents=True)
    (tmp_path / "run" / "stage_1" / "policy").mkdir(parents=True)
    handoff.clear_policies(tmp_path / "run")
    assert not any(d.exists() for d in handoff.policy_locations(tmp_path / "run"))
    run = tmp_path / "run"
    assert (run / "resident" / "trained_1.json").exists() and (run / "stage_1" / "policy").exists()


def test_policies_go_to_shm_only_when_two_fit_there(tmp_path, monkeypatch):
    # the hand-off directory holds two policies at once (s − 1 and s, written to policy_s.tmp first,
    # once s − 2 is deleted): /dev/shm is chosen when its free space exceeds two policies, else the
    # run's own disk, and why is said
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("MU_GRPO_SHM", str(shm))
    free = __import__("shutil").disk_usage(shm).free
    where, why = handoff.fast_dir(tmp_path / "run", policy_bytes=free // 3)
    assert (where.parent == shm and where.name.startswith("mu-grpo-")
            and "free for two policies" in why)
    # two would not fit
    where, why = handoff.fast_dir(tmp_path / "run", policy_bytes=free // 2 + 1)
    assert where == tmp_path / "run" / "resident" / "policies"
    assert (f"not the {2 * (free // 2 + 1) / 1e9:.1f} GB two policies need" in why
            and "--shm-size" in why)
    monkeypatch.setenv("MU_GRPO_SHM", str(tmp_path / "missing"))
    where, why = handoff.fast_dir(tmp_path / "run", policy_bytes=1)
    assert where == tmp_path / "run" / "resident" / "policies" and "not a writable directory" in why


def test_the_engines_share_leaves_the_resident_trainer_its_memory():
    # Qwen2.5-Math-7B (7.62 B parameters) on 4 ranks of 139.8 GiB: fp32 weights and AdamW's two
    # moments, 12 × 7.62e9 / 4 = 22.86 GB = 21.29 GiB, plus 2 GiB: 23.29 GiB, so an engine may take
    # 1 − 23.29/139.8 = 0.833
    gib = 2**30
    bound, trainer = handoff.max_engine_share(7.62e9, 4, 139.8 * gib)
    assert trainer / gib == pytest.approx(12 * 7.62e9 / 4 / gib + 2, rel=1e-12)
    assert bound == 0.83
    # with KL's fp32 reference model, 4 bytes more per parameter: 16 × 7.62e9 / 4 / 2^30 + 2 = 30.38
    # GiB → 0.78
    assert handoff.max_engine_share(7.62e9, 4, 139.8 * gib, reference_model=True)[0] == 0.78
    # one rank holds it all: 12 × 7.62e9 / 2^30 + 2 = 87.16 GiB of an H100's 79.2 GiB: no share is
    # left
    assert handoff.max_engine_share(7.62e9, 1, 79.2 * gib)[0] < 0


def test_a_share_above_the_bound_is_refused_in_one_line():
    h200 = 139.8 * 2**30
    handoff.check_engine_share(7_620_000_000, "4", "0.8", "0", h200)       # at most 0.83: fine
    with pytest.raises(SystemExit) as e:
        handoff.check_engine_share(7_620_000_000, "4", "0.9", "0", h200)
    message = str(e.value)
    assert "\n" not in message and message.startswith("RESIDENT_GPU_MEMORY=0.9 is too much")
    assert "~23.3 GiB on each GPU (7.62 B parameters over 4 rank(s)) of its 139.8 GiB" in message
    assert message.endswith("set RESIDENT_GPU_MEMORY=0.83 or less")


def test_the_default_share_is_the_bound_less_a_stated_margin(capsys):
    # RESIDENT_GPU_MEMORY=auto (the default; was a fixed 0.5, half the KV cache the bound allows for
    # 7B on 4×H200): 0.83 − 0.05 = 0.78, with KL's reference model 0.78 − 0.05 = 0.73; one rank of
    # an H100 has none left
    assert handoff.ENGINE_SHARE_MARGIN == 0.05
    assert handoff.auto_engine_share(0.83) == 0.78 and handoff.auto_engine_share(0.78) == 0.73
    h200, h100 = 139.8 * 2**30, 79.2 * 2**30
    assert handoff.check_engine_share(7_620_000_000, "4", "auto", "0", h200) == 0.78
    said = capsys.readouterr().err
    assert (said.startswith("RESIDENT_GPU_MEMORY=auto: 0.78 of each GPU per engine")
            and "estimates" in said)
    assert handoff.check_engine_share(7_620_000_000, "4", "auto", "0.04", h200) == 0.73
    # a number is kept, within the bound
    assert handoff.check_engine_share(7_620_000_000, "4", "0.8", "0", h200) == 0.8
    with pytest.raises(SystemExit, match=r"^RESIDENT_GPU_MEMORY=auto: no share of the GPU is left "
                                         r"for an engine: .*"
                                         r"use more TRAIN_RANKS, or RESIDENT=false$"):
        handoff.check_engine_share(7_620_000_000, "1", "auto", "0", h100)


@pytest.mark.slow
def test_a_resumed_trainer_saves_its_policy_again_after_releasing_memory_or_builds_nothing_idle(
        toy, tmp_path):
    # killed after stage 0's complete train state and before its policy reached the run directory,
    # the resumed trainer saves that policy again from its state and hands it over. Before: it first
    # waited for stage 1's rollouts, which the engine makes only from that policy (a deadlock: the
    # engine holds no GPU memory while it waits for its first policy), and it then handed the policy
    # over while holding the cache of its load and save, which a GPU engine starting beside it
    # counts as used (vllm/v1/worker/utils.py request_memory). Now: load, save, release
    # (model.release_memory: gc and torch.cuda.empty_cache, as after every stage), then hand over.
    from conftest import ROOT, kill_when
    from test_optimize import FAST, PROBLEMS, write_stage
    run, events = tmp_path / "run", tmp_path / "events.txt"
    write_stage(run / "stage_0", toy / "model", PROBLEMS)
    (tmp_path / "shm").mkdir()
    env = {"MU_GRPO_SHM": str(tmp_path / "shm")}

    def trainer(stages):
        args = ["optimize.py", "--resident=true", f"--run_dir={run}", f"--stages={stages}",
                # no engine answers a transfer here
                f"--policy={toy / 'model'}", "--updates_per_stage=1",
                "--policy_handoff=files", *FAST]
        return [sys.executable, "-c",
                "import runpy, sys\nfrom mu_grpo import handoff, trainer_model as M\n"
                f"def event(what): open({str(events)!r}, 'a').write(what + '\\n')\n"
                "release, publish, build = M.release_memory, handoff.Partner.publish_policy, "
                "M.build\nM.release_memory = lambda: (event('released'), release())[1]\n"
                "M.build = lambda *a, **k: (event('built'), build(*a, **k))[1]\n"
                "handoff.Partner.publish_policy = lambda self, s, *a, **k: (event(f'published "
                "{s}'), publish(self, s, *a, **k))[1]\n"
                f"sys.argv = {args!r}\nrunpy.run_path('optimize.py', run_name='__main__')\n"]

    handoff.reset(run)
    # this test is the engine process: alive, never generating
    handoff.Partner(run, "engine").announce()
    proc = subprocess.run(trainer(1), cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "stage_0" / "train_state").is_dir() and (run / "stage_0" / "policy").is_dir()
    # as a kill between the train state and the policy run_stages.sh, before a rerun's two processes
    __import__("shutil").rmtree(run / "stage_0" / "policy")
    handoff.reset(run)
    handoff.Partner(run, "engine").announce()
    events.unlink()
    # the rerun of a 2-stage run: it hands stage 0's policy over, then waits for stage 1's rollouts
    # (ended here)
    assert kill_when(trainer(2), lambda: (run / "resident" / "trained_0.json").exists(),
                     timeout=600, env=env)
    said = events.read_text().split()
    assert said[-2:] == ["published", "0"] and said[-3] == "released", said
    assert common.policy_record(run / "stage_0" / "policy")["stage"] == 0
    # a 1-stage run killed in its last evaluation: the resumed trainer has nothing to train; it
    # hands the saved policy over and ends without building a model or loading the train state
    # (before: both, beside the engine's start)
    handoff.reset(run)
    handoff.Partner(run, "engine").announce()
    events.unlink()
    proc = subprocess.run(trainer(1), cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert events.read_text().split() == ["published", "0"]                  # no 'built'
    assert "stage 1: every stage is trained; the last policy goes to its evaluation" in proc.stdout
