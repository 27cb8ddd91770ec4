"""mu_grpo/launch.py, run_stages.sh's machinery: every knob checked against one table, the defaults
resolved once, the stage plan, the run directory's lock and the resident pair's supervision (fast,
in process or with tiny child processes)."""
import errno
import json
import os
import subprocess
import sys
import time
import types

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT))
from mu_grpo import common  # noqa: E402
from mu_grpo import launch  # noqa: E402

# the toy preset's knobs as run_stages.sh exports them, before resolution (empty: a default still to
# resolve, a phase knob's its script's block)
TOY = {"PRESET": "toy", "LOSS": "mu-grpo", "LOSS_ARGS": "", "NAV_DELTA": "", "RUN": "",
       "MODEL": "data/toy/model", "TRAIN_DATA": "data/toy/train.jsonl", "EVAL_DATA_DIR": "data/toy",
       "BENCHMARKS": "test", "TEMPLATE": "plain", "STAGES": "3", "UPDATES_PER_STAGE": "8",
       "PROMPTS_PER_UPDATE": "16", "GROUP_SIZE": "8", "STAGE_END": "fixed", "TOTAL_UPDATES": "",
       "DRIFT_GROWTH": "1.25", "DRIFT_MAX_UPDATES": "", "DRIFT_ARGS": "", "LR": "2e-4",
       "WARMUP": "", "KL_COEF": "", "MAX_PROMPT": "64", "MAX_RESPONSE": "16", "TEMPERATURE": "",
       "SEED": "0", "PER_REQUEST_SEED": "", "OPTIMIZER_BOUNDARY": "", "ADAM_BETAS": "",
       "STAGE_WARMUP": "", "SAVE_POLICY_EVERY": "", "MICRO_BATCH_TOKENS": "4096",
       "GRAD_CKPT": "false", "SHARD_PROMPTS": "64", "EVAL_K": "", "EVAL_TEMPERATURE": "",
       "EVAL_TOP_P": "1.0", "EVAL_EVERY": "1", "SAVE_EVERY": "", "KEEP_TRAIN_STATES": "false",
       "EVAL_CACHE": "", "CHECKPOINT_EVERY": "64", "GPUS": "0", "ENGINES": "", "TRAIN_RANKS": "",
       "RESIDENT": "false", "RESIDENT_GPU_MEMORY": "auto", "HANDOFF": "transfer",
       "PREFLIGHT": "auto", "PREFLIGHT_ARGS": "", "PREFLIGHT_ONLY": "false", "PREFLIGHT_REPORT": "",
       "NNODES": "1", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
       "JOIN_TIMEOUT": "600", "DEAD_AFTER": "10", "COLLECTIVE_TIMEOUT": "60", "HSDP": "false",
       "REPORT_TO": "none", "TRACKER_GROUP": ""}


def test_the_table_holds_every_knob_the_toy_preset_sets_and_no_other():
    assert set(TOY) == set(launch.KNOBS)


def test_the_defaults_are_resolved_once_from_the_knobs():
    k, problem = launch.resolve(TOY)
    assert problem is None
    assert (k["ENGINES"], k["TRAIN_RANKS"], k["SAVE_EVERY"], k["KL_COEF"], k["RUN"]) == (
        "1", "1", "1", "0.0", "runs/toy-mu-grpo")
    # 3 · 8, 4 · 8, not paper
    assert (k["TOTAL_UPDATES"], k["DRIFT_MAX_UPDATES"], k["PREFLIGHT"]) == ("24", "32", "0")
    d = launch.derived(k)
    assert (d["PROMPTS_PER_STAGE"], d["RUN_UPDATES"], d["LOGS"], d["LOCK"]) == (
        # 8 · 16 prompts, 3 · 8 updates
        "128", "24", "runs/toy-mu-grpo/logs", "runs/toy-mu-grpo/.lock")
    k4, _ = launch.resolve({**TOY, "GPUS": "4", "PRESET": "paper", "NODE_RANK": "0",
                            "EVAL_EVERY": "2", "STAGE_END": "drift", "TOTAL_UPDATES": "100"})
    assert (k4["ENGINES"], k4["TRAIN_RANKS"], k4["SAVE_EVERY"], k4["PREFLIGHT"]) == (
        "4", "4", "2", "1")
    # drift: the run's updates
    assert launch.derived(k4)["RUN_UPDATES"] == "100"
    # the plan's first stage: 4 updates,
    short = launch.resolve({**TOY, "STAGE_END": "drift", "TOTAL_UPDATES": "4"})[0]
    # 4 · 16 prompts, not 8 · 16
    assert launch.derived(short)["PROMPTS_PER_STAGE"] == "64"
    node1 = launch.derived(launch.resolve({**TOY, "NNODES": "2", "NODE_RANK": "1"})[0])
    assert (node1["LOGS"], node1["LOCK"]) == ("runs/toy-mu-grpo/logs/node1",
                                              "runs/toy-mu-grpo/.lock.node1")


def test_settings_are_every_knob_but_a_nodes_own():
    k, _ = launch.resolve(TOY)
    settings = dict(line.split("=", 1) for line in launch.derived(k)["SETTINGS"].splitlines())
    assert settings["UPDATES_PER_STAGE"] == "8" and settings["TOTAL_UPDATES"] == "24"
    assert set(settings) == set(launch.SHARED) == {
        n for n, knob in launch.KNOBS.items() if not knob.own}
    assert ("NODE_RANK" not in settings and "REPORT_TO" not in settings
            and "MASTER_ADDR" not in settings)


@pytest.mark.parametrize("settings,message", [
    ({"STAGES": "abc"}, "STAGES must be a whole number, got 'abc'"),
    ({"STAGES": "0"}, "STAGES must be at least 1, got '0'"),
    # bash: octal 14
    ({"PROMPTS_PER_UPDATE": "016"}, "PROMPTS_PER_UPDATE must be a whole number, got '016'"),
    ({"LR": "1e-4\n"}, "LR must be a non-negative number"),
    ({"LR": "1e-x"}, "LR must be a non-negative number, got '1e-x'"),
    ({"GROUP_SIZE": "1"}, "GROUP_SIZE must be at least 2, got '1'"),
    ({"GRAD_CKPT": "yes"}, "GRAD_CKPT must be true or false, got 'yes'"),
    ({"STAGE_END": "early"}, "STAGE_END must be fixed or drift, got 'early'"),
    ({"PREFLIGHT": "2"}, "PREFLIGHT must be auto, 0, 1 or force, got '2'"),
    ({"DRIFT_GROWTH": "0"}, "DRIFT_GROWTH must be a positive number, got '0'"),
    ({"RESIDENT_GPU_MEMORY": "1.5"}, "RESIDENT_GPU_MEMORY must be auto or a fraction in (0, 1], "
                                     "got '1.5'"),
    ({"RESIDENT_GPU_MEMORY": "0"}, "RESIDENT_GPU_MEMORY must be auto or a fraction in (0, 1], got "
                                   "'0'"),
    ({"TEMPLATE": "chatml"}, "TEMPLATE must be default, chat, chat-system or plain, got 'chatml'"),
    ({"GPUS": "2", "ENGINES": "3"}, "ENGINES=3 is more than GPUS=2"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK must be in 0..1 (NNODES=2), got 2"),
    ({"NNODES": "2", "RESIDENT": "true"}, "RESIDENT=true runs on one node"),
    ({"NNODES": "2", "EVAL_CACHE": "runs/cache"}, "EVAL_CACHE reuses evaluations on one node"),
    ({"OPTIMIZER_BOUNDARY": "fresh"}, "OPTIMIZER_BOUNDARY must be carry or reset, got 'fresh'"),
    ({"ADAM_BETAS": "0.9"}, "ADAM_BETAS must be two numbers in [0, 1), β1,β2 (e.g. 0.9,0.999), got "
                            "'0.9'"),
    ({"ADAM_BETAS": "0.9,1"}, "ADAM_BETAS must be two numbers in [0, 1)"),
    ({"STAGE_WARMUP": "-1"}, "STAGE_WARMUP must be a whole number, got '-1'"),
    ({"SAVE_POLICY_EVERY": "x"}, "SAVE_POLICY_EVERY must be a whole number, got 'x'"),
    ({"HANDOFF": "ipc"}, "HANDOFF must be transfer or files, got 'ipc'"),
    # CUDA IPC shares a GPU's memory with the engine on that GPU: an engine without a trainer rank
    # beside it, and a trainer rank without an engine (its buffer never opened, never freed)
    ({"GPUS": "4", "RESIDENT": "true", "ENGINES": "4", "TRAIN_RANKS": "2"},
     "HANDOFF=transfer hands each trainer rank's weights to the engine on its GPU (CUDA IPC): "
     "every trainer rank's GPU needs an engine and every engine's GPU a trainer rank, so ENGINES "
     "must equal TRAIN_RANKS, got ENGINES=4 and TRAIN_RANKS=2; or HANDOFF=files"),
    ({"GPUS": "4", "RESIDENT": "true", "ENGINES": "2", "TRAIN_RANKS": "4"},
     "HANDOFF=transfer hands each trainer rank's"),
    # ENGINES: 4
    ({"GPUS": "4", "RESIDENT": "true", "TRAIN_RANKS": "2"},
     "HANDOFF=transfer hands each trainer rank's"),
])
def test_a_bad_knob_is_named_with_what_is_allowed(settings, message):
    _, problem = launch.resolve({**TOY, **settings})
    assert problem is not None and problem.startswith(message), problem


def test_fractions_that_are_shares():
    for good in ("auto", "0.78", ".5", "1", "1.0"):
        assert launch.share_or_auto("S", good) is None, good
    for bad in ("0.0", "1.01", "x", ""):
        assert launch.share_or_auto("S", bad) is not None, bad


def run_launch(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "mu_grpo.launch", *args], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=120, **kw)


def test_the_settings_command_prints_shell_assignments_and_refuses_with_status_2():
    proc = run_launch("--command=settings", env={**TOY, "STAGES": "2"})
    assert proc.returncode == 0, proc.stderr
    out = subprocess.run(["bash", "-c", proc.stdout + '\necho "$TOTAL_UPDATES|$RUN|$SETTINGS"'],
                         capture_output=True, text=True).stdout
    total, run, settings = out.split("|", 2)
    # 2 · 8
    assert (total, run) == ("16", "runs/toy-mu-grpo") and "UPDATES_PER_STAGE=8\n" in settings
    bad = run_launch("--command=settings", env={**TOY, "LR": "fast"})
    assert (bad.returncode == 2
            and bad.stderr.strip() == "LR must be a non-negative number, got 'fast'")
    # the knob's old name is not ignored
    old = run_launch("--command=settings", env={**TOY, "UPDATES": "64"})
    assert (old.returncode == 2
            and old.stderr.strip() == "UPDATES=64: the knob is UPDATES_PER_STAGE now")
    old = run_launch("--command=settings", env={**TOY, "RESET_OPTIMIZER": "true"})
    assert old.returncode == 2 and old.stderr.strip() == \
        "RESET_OPTIMIZER=true: the knob is OPTIMIZER_BOUNDARY (carry | reset) now"


def test_only_the_presets_that_use_the_gpu_count_ask_torch_for_it(monkeypatch, capsys):
    counted = []
    monkeypatch.setattr(launch.common, "gpu_count", lambda: counted.append(1) or 4)
    said = {}
    for preset in ("toy", "lab", "lab-fork", "auto", "paper"):
        monkeypatch.setenv("PRESET", preset)
        launch.preset_command()
        said[preset] = (capsys.readouterr().out, len(counted))
    assert said["toy"] == ("PRESET=toy\n", 0) and said["lab-fork"] == ("PRESET=lab-fork\n", 0)
    assert (said["auto"] == ("PRESET=paper\nVISIBLE_GPUS=4\n", 1)
            and said["paper"] == ("PRESET=paper\nVISIBLE_GPUS=4\n", 2))
    monkeypatch.setenv("PRESET", "tiny")
    with pytest.raises(SystemExit):
        launch.preset_command()
    assert (capsys.readouterr().err.strip() == "PRESET must be auto, paper, toy, lab or lab-fork, "
                                               "got 'tiny'")


def test_the_handoff_command_falls_back_to_files_only_where_the_preflight_did(tmp_path):
    import json
    env = {**TOY, "RUN": str(tmp_path), "RESIDENT": "true"}
    said = lambda **e: run_launch("--command=handoff", env={**env, **e})  # noqa: E731
    # no preflight ran
    assert said().stdout == "transfer\n" and said(HANDOFF="files").stdout == "files\n"
    (tmp_path / "preflight.json").write_text(
        json.dumps({"passed": True, "figures": {"policy_handoff": "transfer"}}))
    assert said().stdout == "transfer\n"
    (tmp_path / "preflight.json").write_text(
        json.dumps({"passed": True, "figures": {"policy_handoff": "files"}}))
    fell = said()
    assert fell.stdout == "files\n" and fell.stderr == (
        "HANDOFF=transfer: the preflight found the weight transfer failing on this box "
        f"({tmp_path}/preflight.json); the policies are handed over as files\n")
    # a run that follows another's preflight (table1.sh's runs: their model's preparation's), not
    # its own: before, each read its own preflight.json, which never exists, and used the transfer
    # that preparation found failing
    (tmp_path / "preflight.json").unlink()
    prepared = tmp_path / "prepare"
    prepared.mkdir()
    (prepared / "preflight.json").write_text(
        json.dumps({"passed": True, "figures": {"policy_handoff": "files"}}))
    assert said(PREFLIGHT_REPORT=str(prepared / "preflight.json")).stdout == "files\n"
    assert said().stdout == "transfer\n"
    k, problem = launch.resolve({**TOY, "PREFLIGHT_REPORT": str(tmp_path / "missing.json")})
    assert problem == (f"PREFLIGHT_REPORT={tmp_path}/missing.json does not exist: run that "
                       "preflight first (table1.sh: its model's preparation, prepare.txt)")


def test_the_preflight_runs_at_the_runs_shape_and_settings(monkeypatch):
    # run_stages.sh's preflight line (mu_grpo/launch.py --command=preflight) at a 4-GPU box's shape,
    # resident: the engines, trainer ranks, hand-off, the trainer's flags and the run's lengths
    # reach mu_grpo/preflight.py, PREFLIGHT_ARGS last
    k, problem = launch.resolve({**TOY, "RUN": "runs/box", "ENGINES": "2", "TRAIN_RANKS": "2",
                                 "RESIDENT": "true", "GRAD_CKPT": "true", "PREFLIGHT": "1",
                                 "PREFLIGHT_ARGS": "--prompts=8 --updates=2", "STAGE_END": "drift",
                                 "DRIFT_ARGS": "--drift_min_updates=4 --drift_min_updates=6"})
    assert problem is None
    # (RESIDENT_GPU_MEMORY: the share mu_grpo/launch.py --command=start gives for auto, exported
    # before the preflight runs)
    monkeypatch.setattr(os, "environ",
                        {**k, **launch.derived(k), "KL": "", "RESIDENT_GPU_MEMORY": "0.1"})
    asked = []
    monkeypatch.setattr(subprocess, "run", lambda argv,
                        **kw: asked.append(argv) or subprocess.CompletedProcess(argv, 0))
    with pytest.raises(SystemExit) as done:
        launch.preflight_command()
    assert done.value.code is None
    (argv,) = asked
    assert argv[1:3] == ["-m", "mu_grpo.preflight"] and argv[-2:] == ["--prompts=8", "--updates=2"]
    flags = dict(a.split("=", 1) for a in argv[3:])
    assert {f: flags[f] for f in ("--out", "--engines", "--train_ranks", "--resident",
                                  "--policy_handoff", "--max_response_tokens",
                                  "--estimate_stage_prompts", "--drift_min_updates")} == {
        "--out": "runs/box/preflight.json", "--engines": "2", "--train_ranks": "2",
        # 8 · 16
        "--resident": "true", "--policy_handoff": "transfer", "--max_response_tokens": "16",
        # the trainer's: the last given
        "--estimate_stage_prompts": "128", "--drift_min_updates": "6"}
    # its row's β
    assert flags["--optimize_args"] == "--gradient_checkpointing=true --loss=mu-grpo --kl_coef=0.0"
    # every flag one mu_grpo/preflight.py takes, every value one it allows: its strict overrides and
    # checks run on import
    monkeypatch.setattr(sys, "argv", ["mu_grpo/preflight.py", *argv[3:]])
    monkeypatch.delitem(sys.modules, "mu_grpo.preflight", raising=False)
    preflight = __import__("importlib").import_module("mu_grpo.preflight")
    assert (preflight.n_engines, preflight.n_ranks, preflight.resident, preflight.prompts) == (
        2, 2, True, 8)


def test_the_start_up_gives_its_assignments_on_descriptor_3_and_the_runs_start_once(tmp_path):
    # run_stages.sh's line, on one node: MODEL a directory, not the preset's own (nothing to build);
    # its assignments on descriptor 3, its output on the script's stdout; the start time written
    # once, a rerun keeping it
    model, data, run = tmp_path / "model", tmp_path / "train.jsonl", tmp_path / "run"
    model.mkdir()
    from safetensors.torch import save_file
    # a whole checkpoint (common.policy_problem)
    save_file({"w": torch.zeros(2)}, str(model / "model.safetensors"))
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "tokenizer.json").write_text("{}")
    data.write_text(json.dumps({"id": "a", "problem": "1+1?", "answer": "2"}) + "\n")
    (run / ".done").mkdir(parents=True)
    env = {**os.environ, **TOY, "MODEL": str(model), "TRAIN_DATA": str(data), "RUN": str(run),
           "NNODES": "1", "NODE_RANK": "0", "JOIN_TIMEOUT": "10", "RESIDENT": "false",
           "RESIDENT_GPU_MEMORY": "auto", "GPUS": "0"}
    line = (f'{{ out=$("{sys.executable}" -m mu_grpo.launch --command=start 3>&1 >&4) || exit $?; '
            f'}} 4>&1; echo "[$out]"')
    runs = [subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
            for _ in range(2)]
    start = (run / ".done" / "start").read_text().strip()
    assert abs(int(start) - time.time()) < 120
    assert [r.stdout
            for r in runs] == [f"[MODEL={model}\nRESIDENT_GPU_MEMORY=0.1\nSTART={start}]\n"] * 2
    # a refusal: its line, its status, no assignments
    data.write_text("")
    bad = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert (bad.returncode,
            bad.stdout) == (2, "") and f"TRAIN_DATA={data} has no problems" in bad.stderr


def test_the_stage_command_is_the_stage_plans_record(tmp_path):
    env = {**TOY, "RUN": str(tmp_path), "TOTAL_UPDATES": "24", "DRIFT_MAX_UPDATES": "32",
           "EVAL_EVERY": "2"}
    out = [run_launch("--command=stage", f"--stage={s}", env=env) for s in (0, 1, 3)]
    # μ, μ · 16 prompts; evaluated: the initial policy, the one after stage 1 (2 % 2), the last (the
    # run is over)
    assert [p.stdout.strip() for p in out] == [
        "STAGE_UPDATES=8 STAGE_PROMPTS=128 EVALUATE=true",
        "STAGE_UPDATES=8 STAGE_PROMPTS=128 EVALUATE=false",
        "STAGE_UPDATES=0 STAGE_PROMPTS=0 EVALUATE=true"]
    # the stage's line
    assert out[0].stderr.startswith("[stage 0] update 0 of 24") and out[2].stderr == ""


def test_the_lock_tells_another_holder_from_a_filesystem_without_locks(tmp_path, monkeypatch):
    lock = tmp_path / ".lock"
    env = {"RUN": str(tmp_path), "LOCK": str(lock)}
    with open(lock, "w") as held:
        import fcntl
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = subprocess.run(f'exec 9>"{lock}"; "{sys.executable}" -m mu_grpo.launch '
                              '--command=lock', shell=True, cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, **env})
    assert proc.returncode == 1 and "another run_stages.sh is running" in proc.stderr
    # held by the shell once mu_grpo/launch.py has ended: a second taker is refused while the first
    # shell lives
    holding = tmp_path / "holding"
    first = subprocess.Popen(f'exec 9>"{lock}"; "{sys.executable}" -m mu_grpo.launch '
                             f'--command=lock && touch "{holding}" && sleep 60', shell=True,
                             cwd=ROOT, env={**os.environ, **env})
    try:
        deadline = time.time() + 60
        while not holding.exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert holding.exists()
        second = subprocess.run(f'exec 9>"{lock}"; "{sys.executable}" -m mu_grpo.launch '
                                '--command=lock', shell=True,
                                cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
        assert second.returncode == 1 and "another run_stages.sh is running" in second.stderr
    finally:
        first.kill()
        first.wait()
    # flock(2) failing with ENOLCK (Lustre without -o flock, some NFS): said as it is
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr("fcntl.flock", no_locks)
    with pytest.raises(SystemExit, match=rf"cannot lock {lock} \(No locks available\): RUN's "
                                         r"filesystem"):
        launch.lock_command()


def test_the_resident_pair_stops_the_other_when_one_fails_and_keeps_each_ones_output(
    tmp_path, monkeypatch, capfd):
    # the engine fails after a moment; the trainer (sleeping, with a child of its own) is stopped,
    # its child too
    (tmp_path / "logs").mkdir()
    child_pid = tmp_path / "child.pid"
    engine = [sys.executable, "-c", "import sys, time; print('engine up', flush=True); "
                                    "time.sleep(0.5); sys.exit(3)"]
    trainer = ["bash", "-c", f'sleep 60 & echo $! > "{child_pid}"; echo "trainer up"; wait']
    monkeypatch.setenv("RUN", str(tmp_path))
    monkeypatch.setenv("ENGINES", "1")
    monkeypatch.setenv("TRAIN_RANKS", "1")
    monkeypatch.setattr(launch, "logs", str(tmp_path / "logs"))
    monkeypatch.setattr(launch, "STOP_GRACE_S", 2.0)
    t0 = time.time()
    with pytest.raises(SystemExit) as stopped:
        launch.resident_command([*engine, "::", *trainer])
    assert stopped.value.code == 1 and time.time() - t0 < 30
    assert "[resident] failed (the engine exited with 3)" in capfd.readouterr().err
    assert (tmp_path / "logs" / "engine.log").read_text() == "engine up\n"
    assert (tmp_path / "logs" / "trainer.log").read_text() == "trainer up\n"
    pid = int(child_pid.read_text())
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
        time.sleep(0.1)
    assert (not os.path.exists(f"/proc/{pid}")
            or open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z")
    [row] = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    # no stage trained
    assert (row["phase"], row["ended"], row["stage"]) == ("resident", "failed", -1)
    assert not (tmp_path / "timeline.attempt.json").exists()


def test_the_resident_pair_that_ends_well_is_one_timeline_row(tmp_path, monkeypatch):
    (tmp_path / "logs").mkdir()
    (tmp_path / "stage_0").mkdir()
    (tmp_path / "stage_0" / "stage_end.json").write_text("{}")
    monkeypatch.setenv("RUN", str(tmp_path))
    monkeypatch.setenv("ENGINES", "1")
    monkeypatch.setenv("TRAIN_RANKS", "1")
    monkeypatch.setattr(launch, "logs", str(tmp_path / "logs"))
    launch.resident_command(["true", "::", "true"])
    [row] = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert (row["phase"], row["stage"], row["ended"]) == ("resident", 0, "completed")
    assert row["seconds"] == pytest.approx(row["end"] - row["start"])


def test_every_knob_run_stages_sh_sets_is_in_the_table():
    # the knob block (NAME=${NAME:-...}): a knob added there and not to the table would go unchecked
    # and uncompared between nodes; the presets (presets.sh: unless_given NAME=...) set only the
    # block's knobs
    import re
    text = (ROOT / "run_stages.sh").read_text()
    block = text[:text.index("# " + "-" * 78 + "\n\n")]
    knobs = set(re.findall(r"^([A-Z_]+)=\$\{\1:-", block, re.M))
    preset_knobs = set(re.findall(r"\b([A-Z_]+)=",
                                  (ROOT / "presets.sh").read_text().split("case")[1]))
    loop_knobs = {n for n, knob in launch.KNOBS.items() if not knob.phase}
    unknown = preset_knobs - {"LAB_DIR"} - set(launch.KNOBS)
    assert len(knobs) > 40 and not unknown, unknown
    # a phase knob's home is its script's block, not this one
    assert knobs == loop_knobs, knobs ^ loop_knobs


def test_each_phase_knob_is_declared_once_and_every_list_of_it_agrees():
    # KNOBS is the one declaration: a phase knob's home names a flag of its script's block whose
    # default its rule accepts, the flags run_stages.sh passes come from it, and docs/running.md's
    # table is its rows
    import re
    phase = launch.PHASE_KNOBS
    assert {"LR": ("optimize.py", "lr"),
            "EVAL_K": ("evaluate.py", "k")}.items() <= phase.items() and len(phase) == 15
    for name, (script, flag) in phase.items():
        assert flag in common.script_defaults(ROOT / script), (name, script, flag)
        # (kl_coef's None: the LOSS row's β, resolved by launch.resolve)
        default = launch.block_default(name)
        assert (default == "" if name == "KL_COEF"
                else launch.KNOBS[name].rule(name, default) is None), name
    rows = re.findall(r"^\| `([A-Z_]+)` \| (\S+) `([a-z_]+)` \|$",
                      (ROOT / "docs" / "running.md").read_text(), re.M)
    assert {n: (s, f) for n, s, f in rows} == phase
    k, problem = launch.resolve({**TOY, "LR": "3e-5", "EVAL_K": "2", "TEMPERATURE": ""})
    assert (problem is None
            and k["OPTIMIZE_FLAGS"] == "--lr=3e-5 --micro_batch_tokens=4096 "
                                       "--gradient_checkpointing=false")
    assert (k["EVALUATE_FLAGS"] == "--k=2 --top_p=1.0"
            and k["GENERATE_FLAGS"] == "--shard_prompts=64")
    assert launch.RERUN_SAFE >= {"MICRO_BATCH_TOKENS", "GPUS"}
    assert not launch.RERUN_SAFE & {"LR", "STAGES", "SEED"}


def test_every_flag_the_settings_record_leaves_out_as_the_loops_is_one_run_stages_sh_passes():
    # launch.LOOP_PASSED: a script's block values the loop always overrides, so they are no run's
    # settings; a name there that the loop does not pass would let an edit of a live default through
    # the rerun check unnoticed
    import re
    text = (ROOT / "run_stages.sh").read_text()
    passed = set(re.findall(r"--([a-z_]+)=", text))
    for script, flags in launch.LOOP_PASSED.items():
        assert flags <= passed, (script, flags - passed)
        assert flags <= set(common.script_defaults(ROOT / script)), (
            script, flags - set(common.script_defaults(ROOT / script)))
    # and the records leave them out: an edit of one changes no run's settings
    k, _ = launch.resolve(TOY)
    recorded = launch.run_settings(k)
    assert not any(set(recorded[script]) & flags for script, flags in launch.LOOP_PASSED.items())
    assert "lr" in recorded["optimize.py"] and "group_size" not in recorded["generate.py"]


def test_a_phase_knob_left_empty_is_its_blocks_value_and_passes_no_flag_a_given_one_its_flag():
    # the home of a phase knob is its script's block: empty, the block's value is checked and
    # recorded, no flag given
    k, problem = launch.resolve({**TOY, "LR": "", "TEMPERATURE": "0.7", "GRAD_CKPT": ""})
    assert problem is None
    # optimize.py's lr, evaluate.py's k
    assert (k["LR"], k["EVAL_K"], k["GRAD_CKPT"]) == ("1e-06", "4", "true")
    assert (k["TEMPERATURE"], k["PER_REQUEST_SEED"], k["WARMUP"]) == ("0.7", "true", "0")
    # the one optimize.py knob given
    assert k["OPTIMIZE_FLAGS"] == "--micro_batch_tokens=4096"
    assert k["GENERATE_FLAGS"] == "--temperature=0.7 --shard_prompts=64"
    # the toy's: top_p 1, not 0.7
    assert k["EVALUATE_FLAGS"] == "--top_p=1.0"


def test_a_resident_gpu_run_sizes_the_engines_share_from_its_checkpoint_and_gpu(
    tmp_path, monkeypatch):
    # the branch only a GPU box takes (RESIDENT=true, GPUS > 0), run here with the GPU's memory
    # given: the trainer's parameters are read from the checkpoint's headers (100 × 10 + 10 = 1010),
    # the share is the bound less its margin
    import torch
    from safetensors.torch import save_file

    from mu_grpo import handoff
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.zeros(100, 10), "b": torch.zeros(10)}, str(model / "model.safetensors"))
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "tokenizer.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text(
        json.dumps({"id": "1", "problem": "1+1", "answer": "2"}) + "\n")
    h100 = types.SimpleNamespace(total_memory=79.2 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: h100)
    env = {"MODEL": str(model), "MODEL_IS_DIR": "1", "TRAIN_DATA": str(tmp_path / "train.jsonl"),
           "TEMPLATE": "plain", "RESIDENT": "true", "GPUS": "1", "TRAIN_RANKS": "1",
           "RESIDENT_GPU_MEMORY": "auto", "KL_COEF": "0"}
    share = handoff.auto_engine_share(handoff.max_engine_share(1010, 1, h100.total_memory)[0])
    assert 0 < share < 1 and launch.prepared(env) == {
        "MODEL": str(model), "RESIDENT_GPU_MEMORY": str(share)}
    with pytest.raises(SystemExit, match="RESIDENT_GPU_MEMORY=1 is too much"):
        launch.prepared({**env, "RESIDENT_GPU_MEMORY": "1"})
