"""The bad-input corpus: what a new user gets wrong, each case one line naming it (and what is allowed) before any
compute, the right exit status, no traceback and nothing half-written. Here the checks themselves, in process
(seconds); the same cases through run_stages.sh where only a whole run can show them: tests/test_loop.py
(test_a_rerun_*, test_a_refused_run_*, test_ctrl_c_*). The knob table's every rule: tests/test_launch.py."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT))
from mu_grpo import common  # noqa: E402
from mu_grpo import launch  # noqa: E402
from mu_grpo import records  # noqa: E402
from test_launch import TOY  # noqa: E402


# ----------------------------------------------------------------------------- knobs a phase would refuse later

@pytest.mark.parametrize("settings,message", [
    # vLLM's own sampling rules (vllm/sampling_params.py SamplingParams._verify_args, _verify_greedy_sampling), which it
    # would raise in a traceback after an engine started
    ({"TEMPERATURE": "0"}, "TEMPERATURE=0 samples greedily, one response per prompt: a group of GROUP_SIZE=8 needs "
                           "TEMPERATURE > 0"),
    ({"TEMPERATURE": "0.000001"}, "TEMPERATURE=0.000001 samples greedily"),
    ({"TEMPERATURE": "2.5"}, "TEMPERATURE must be a number in [0, 2], got '2.5'"),
    ({"EVAL_TEMPERATURE": "0"}, "EVAL_TEMPERATURE=0 samples greedily, one response per problem: EVAL_K=4 needs "
                                "EVAL_TEMPERATURE > 0, or EVAL_K=1"),
    ({"EVAL_TOP_P": "2"}, "EVAL_TOP_P must be a number in (0, 1], got '2'"),
    ({"EVAL_TOP_P": "0"}, "EVAL_TOP_P must be a number in (0, 1], got '0'"),
    ({"EVAL_K": "0"}, "EVAL_K must be at least 1, got '0'"),
    ({"MAX_RESPONSE": "0"}, "MAX_RESPONSE must be at least 1, got '0'"),
    ({"MAX_PROMPT": "0"}, "MAX_PROMPT must be at least 1, got '0'"),
    # the cases a new user tried that were refused already (kept here with the rest)
    ({"STAGES": "-1"}, "STAGES must be a whole number, got '-1'"),
    ({"LR": "-1e-4"}, "LR must be a non-negative number, got '-1e-4'"),
    ({"PRESET": "big"}, "PRESET must be paper, toy, lab or lab-fork, got 'big'"),
    # a knob's flags, parsed against their script: before, a misspelt drift flag failed when optimize_0 started, after
    # the whole generation and the initial evaluation, and the corrected rerun was refused (that generation finished)
    ({"STAGE_END": "drift", "DRIFT_ARGS": "--drift_windw=16"},
     "DRIFT_ARGS=--drift_windw=16: --drift_windw is no flag of optimize.py (did you mean --drift_window?)"),
    ({"LOSS_ARGS": "--clip_low=abc"}, "LOSS=mu-grpo with LOSS_ARGS=--clip_low=abc: clip_low must be a number, got 'abc'"),
    ({"LOSS_ARGS": "--eps_max=4"}, "LOSS_ARGS=--eps_max=4: --eps_max is no flag of optimize.py"),
    ({"LOSS": "cispo", "LOSS_ARGS": "--clip_high=1.2"}, "LOSS=cispo with LOSS_ARGS=--clip_high=1.2: objective cispo "
                                                        "has no setting clip_high; its settings: eps_max=5.0"),
    ({"LOSS": "cispo", "LOSS_ARGS": "--objective_args=eps_max=-1"}, "LOSS=cispo with LOSS_ARGS=--objective_args="
                                                                    "eps_max=-1: eps_max must be > 0, got -1.0"),
    ({"LOSS_ARGS": "--loss=grpo"}, "LOSS_ARGS=--loss=grpo names a loss preset: that is LOSS's (LOSS=grpo)"),
    ({"LOSS": "topr", "LOSS_ARGS": "--advantage=raw"}, "LOSS=topr with LOSS_ARGS=--advantage=raw: advantage must be "
                                                       "one of group, signed-reward, soft-value, got 'raw'"),
    ({"LOSS_ARGS": "clip_low=0.8"}, "LOSS_ARGS=clip_low=0.8: 'clip_low=0.8' is not a --key=value flag of optimize.py"),
    ({"PREFLIGHT_ARGS": "--prompt=8"}, "PREFLIGHT_ARGS=--prompt=8: --prompt is no flag of mu_grpo/preflight.py (did "
                                      "you mean --prompts?)"),
    # a value that passes its own rule but switches its mechanism off, or a schedule the run never reaches
    ({"LOSS_ARGS": "--nav_delta=0"}, "NAV δ 0 (LOSS=mu-grpo, NAV_DELTA or LOSS_ARGS) never triggers"),
    ({"LOSS_ARGS": "--clip_low=2 --clip_high=1"}, "the clip interval [2, 1] (LOSS=mu-grpo, LOSS_ARGS) is empty"),
    ({"STAGE_END": "drift", "DRIFT_ARGS": "--drift_window=0"}, "STAGE_END=drift with --drift_window=0 (DRIFT_ARGS): "
                                                               "the warning never comes"),
    ({"DRIFT_ARGS": "--drift_window=8"}, "DRIFT_ARGS=--drift_window=8 sets the drift warning, which only "
                                         "STAGE_END=drift uses (it is fixed)"),
    ({"WARMUP": "24"}, "WARMUP=24 updates is at least the run's 24: the learning rate never reaches LR=2e-4"),
    # the drift plan's knobs on fixed stages: before, ignored, the run 3 × 8 = 24 updates whatever they said
    ({"TOTAL_UPDATES": "4096"}, "TOTAL_UPDATES=4096, and with STAGE_END=fixed the run has STAGES × UPDATES_PER_STAGE "
                                "= 3 × 8 = 24 updates: set STAGES (TOTAL_UPDATES is the drift plan's)"),
    ({"DRIFT_MAX_UPDATES": "64"}, "DRIFT_MAX_UPDATES=64 sizes drift stages, which STAGE_END=fixed has none of"),
    ({"STAGE_WARMUP": "8"}, "STAGE_WARMUP=8 updates is at least a stage's 8"),
    ({"SAVE_POLICY_EVERY": "8"}, "SAVE_POLICY_EVERY=8 saves a policy within a stage every so many updates, and a "
                                 "stage has 8: none would be saved"),
])
def test_a_value_a_phase_would_refuse_is_refused_by_the_settings_check(settings, message):
    _, problem = launch.resolve({**TOY, **settings})
    assert problem is not None and problem.startswith(message), problem


def test_the_values_next_to_those_refused_are_allowed(tmp_path):
    for allowed in ({"WARMUP": "23"}, {"TOTAL_UPDATES": "24"}, {"STAGE_WARMUP": "7"}, {"SAVE_POLICY_EVERY": "7"}, {"LOSS_ARGS": "--nav_delta=none"},
                    {"STAGE_END": "drift", "DRIFT_ARGS": "--drift_window=1"}, {"EVAL_CACHE": str(tmp_path / "cache")}):
        assert launch.resolve({**TOY, **allowed})[1] is None, allowed
    (tmp_path / "file").write_text("")
    assert launch.resolve({**TOY, "EVAL_CACHE": str(tmp_path / "file")})[1] == (
        f"EVAL_CACHE={tmp_path / 'file'} is a file: it names a directory of kept evaluations")


def test_greedy_evaluation_with_one_sample_is_allowed():
    assert launch.resolve({**TOY, "EVAL_TEMPERATURE": "0", "EVAL_K": "1"})[1] is None


def test_a_misspelt_knob_is_named_with_the_knob_it_is_close_to():
    env = {"UPDATE_PER_STAGE": "4", "PATH": "/bin", "SEEDS": "0 1", "MUS": "4 64", "CUDA_VISIBLE_DEVICES": "0",
           "LR": "1e-4", "GROUPSIZE": "4", "HOME": "/root", "OMP_NUM_THREADS": "1", "NAV_DELTA": "1e-4",
           "LAB_DIR": "data/lab", "VARIANTS": "grpo"}
    # the frontier's and table's knobs (SEEDS, MUS), run_stages.sh's NAV_DELTA, presets.sh's and ablate.sh's (LAB_DIR,
    # VARIANTS) are knobs, not typos
    assert launch.misspelt_knobs(env) == [("UPDATE_PER_STAGE", "UPDATES_PER_STAGE"), ("GROUPSIZE", "GROUP_SIZE")]
    proc = subprocess.run([sys.executable, "-m", "mu_grpo.launch", "--command=settings"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **TOY, "UPDATE_PER_STAGE": "4"}, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "UPDATE_PER_STAGE=4 is not a knob: did you mean UPDATES_PER_STAGE? (run_stages.sh's variables)"


# ----------------------------------------------------------------------------- a rerun with other settings


FINISHED = {   # what a run computed, as its records show it (records.finished_work), each made by hand
    "a shard": lambda run: write(run / "stage_0" / "rollouts" / "shard_00000.jsonl", "{}\n"),
    "rollouts": lambda run: write(run / "stage_0" / "rollouts" / records.MANIFEST, "{}"),
    "a train state": lambda run: write(run / "stage_0" / records.TRAIN_STATE / "progress.json", "{}"),
    "training": lambda run: (write(run / "stage_0" / records.STAGE_END, "{}"),
                             write(run / "stage_0" / records.POLICY / common.POLICY_ID_FILE, "{}")),
    "a results row": lambda run: write(run / records.RESULTS, '{"stage": -1}\n'),
}


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def recorded_run(tmp_path, done=("a shard",), **changes):
    """A run directory whose first attempt ran at TOY's settings (its record) and left the finished work `done`
    (FINISHED's keys); returns the knobs of a rerun with `changes`."""
    run = tmp_path / "run"
    (run / ".done").mkdir(parents=True)
    (run / ".done" / "start").write_text("")
    for name in done:
        FINISHED[name](run)
    first, _ = launch.resolve({**TOY, "RUN": str(run)})
    common.atomic_write_json(run / records.RUN_SETTINGS, launch.run_settings(first))
    again, problem = launch.resolve({**TOY, "RUN": str(run), **changes})
    assert problem is None
    return run, again


def refusal(k):
    with pytest.raises(SystemExit) as e:
        launch.rerun_check(k)
    return e.value.code


def test_a_rerun_with_a_changed_setting_is_refused_naming_each(tmp_path, capsys):
    run, k = recorded_run(tmp_path, LR="1e-3", LOSS_ARGS="--clip_low=0.8")
    assert refusal(k) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"RUN={run} was run with other settings: LOSS_ARGS (empty) → --clip_low=0.8; "
                           f"LR 2e-4 → 1e-3; loss settings {{'clip_high': 5.0, 'clip_low': 0.0}} → {{'clip_low': 0.8, "
                           f"'clip_high': 5.0}}. It holds finished work (1 rollout shard(s) of stage 0), which is kept: "
                           f"rerun with its settings ({run}/{records.RUN_SETTINGS}), or choose a new RUN"), line
    assert "\n" not in line


@pytest.mark.parametrize("work", sorted(FINISHED))
def test_any_finished_work_keeps_the_runs_settings_and_nothing_is_removed(tmp_path, work, capsys):
    # before: only .done/ markers counted, which resident mode never writes, so a changed knob cleared a killed
    # resident run's trained stages (and a per-phase run's shards of its first generation)
    run, k = recorded_run(tmp_path, done=(work,), LR="1e-3")
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    assert refusal(k) == 2 and "LR 2e-4 → 1e-3" in capsys.readouterr().err
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before


def test_a_rerun_may_change_what_does_not_change_the_science(tmp_path):
    _, k = recorded_run(tmp_path, EVAL_EVERY="2", REPORT_TO="tensorboard", GPUS="0", MICRO_BATCH_TOKENS="2048",
                        RESIDENT="true", SAVE_POLICY_EVERY="4")
    assert launch.rerun_check(k) == {"FRESH": "0", "EXTEND": "0"}


def test_an_edited_default_in_a_phase_scripts_block_is_a_changed_setting(tmp_path, monkeypatch, capsys):
    run, k = recorded_run(tmp_path)
    real = common.script_defaults
    monkeypatch.setattr(common, "script_defaults", lambda name, **kw: {**real(name, **kw), **(
        {"weight_decay": 0.1, "checkpoint_every": 5} if name == "optimize.py" else {})})
    assert refusal(k) == 2
    line = capsys.readouterr().err
    assert "optimize.py weight_decay 0.01 → 0.1" in line and "checkpoint_every" not in line    # (a safe one)


def test_an_edited_default_the_loop_always_passes_is_no_changed_setting(tmp_path, monkeypatch, capsys):
    # the loop gives these flags on every call (tests/test_launch.py finds each in run_stages.sh), so the block's
    # value is never a run's: editing one (a git pull that changes it) must not refuse a rerun. Every one edited at once
    run, k = recorded_run(tmp_path)
    real = common.script_defaults
    edited = lambda name, **kw: {**real(name, **kw), **{knob: "edited" for knob in launch.LOOP_PASSED.get(name, ())}}  # noqa: E731
    monkeypatch.setattr(common, "script_defaults", edited)
    assert launch.rerun_check(k) == {"FRESH": "0", "EXTEND": "0"}
    planted = {script: safe - launch.LOOP_PASSED[script] for script, safe in launch.PHASE_SCRIPTS.items()}
    monkeypatch.setattr(launch, "PHASE_SCRIPTS", planted)         # planted: the loop's flags recorded and compared
    monkeypatch.setattr(launch, "LOOP_PASSED", {})
    assert refusal(k) == 2 and "optimize.py prompts_per_update" in capsys.readouterr().err


def test_more_stages_continue_a_run_finished_or_killed_and_fewer_are_refused(tmp_path, capsys):
    _, k = recorded_run(tmp_path, done=("rollouts", "training"), STAGES="5")
    assert launch.rerun_check(k) == {"FRESH": "0", "EXTEND": "1"}         # 3 → 5 stages: the run goes on
    _, k = recorded_run(tmp_path / "b", done=(), STAGES="5")
    assert launch.rerun_check(k) == {"FRESH": "0", "EXTEND": "1"}         # also with nothing finished yet
    _, k = recorded_run(tmp_path / "c", done=("rollouts",), STAGES="2")
    assert refusal(k) == 2 and "STAGES 3 → 2" in capsys.readouterr().err


def test_an_attempt_that_finished_nothing_does_not_block_the_corrected_one(tmp_path, monkeypatch, capsys):
    # the first attempt (GROUP_SIZE=8) failed inside its first phase: its stage's plan is left behind, no shard
    run, k = recorded_run(tmp_path, done=(), GROUP_SIZE="4")
    (run / "stage_0" / "rollouts").mkdir(parents=True)
    (run / "stage_0" / "rollouts" / records.PLAN).write_text(json.dumps({"group_size": 8}))
    (run / "logs").mkdir()
    (run / "logs" / "generate_0.log").write_text("the failure\n")
    (run / records.TIMELINE).write_text("{}\n")
    assert launch.rerun_check(k) == {"FRESH": "1", "EXTEND": "0"}
    for name, value in {**k, "FRESH": "1", "EXTEND": "0"}.items():
        monkeypatch.setenv(name, value)
    launch.settle_record()
    launch.record_settings()
    assert "finished nothing and had other settings: what it left (.done, run_settings.json, stage_0, " \
           "timeline.jsonl) is cleared" in capsys.readouterr().out
    assert sorted(p.name for p in run.iterdir()) == [".done", "logs", records.RUN_SETTINGS]    # the logs stay
    assert json.loads((run / records.RUN_SETTINGS).read_text())["knobs"]["GROUP_SIZE"] == "4"
    # the same attempt's settings again: nothing to clear
    assert launch.rerun_check(k) == {"FRESH": "0", "EXTEND": "0"}


def test_a_directory_that_holds_no_run_is_refused_before_anything_is_written(tmp_path, capsys):
    # before: RUN=runs (the directory of every run) took a record, and the corrected attempt cleared every run in it
    runs = tmp_path / "runs"
    (runs / "finished-run" / ".done").mkdir(parents=True)
    (runs / "notes.txt").write_text("mine")
    k, _ = launch.resolve({**TOY, "RUN": str(runs)})
    assert refusal(k) == 2
    assert capsys.readouterr().err.strip() == (
        f"RUN={runs} is a directory that holds no run (finished-run, notes.txt): a run's directory holds only what "
        f"the run writes, choose a new RUN (e.g. {runs}/<name>)")
    assert sorted(p.name for p in runs.iterdir()) == ["finished-run", "notes.txt"]
    # a run killed before its record (its logs, its start marker) and an empty directory are runs' directories
    fresh = tmp_path / "fresh"
    (fresh / "logs").mkdir(parents=True)
    (fresh / ".done").mkdir()
    k, _ = launch.resolve({**TOY, "RUN": str(fresh)})
    assert launch.rerun_check(k) == {"FRESH": "0", "EXTEND": "0"}


def test_a_run_whose_record_is_gone_or_damaged_is_refused_not_recorded_again(tmp_path, capsys):
    # before: a removed run_settings.json made the next attempt record its own settings, which the run never had
    run, k = recorded_run(tmp_path, done=("rollouts", "training"), STAGES="4", LR="1e-3")
    (run / records.RUN_SETTINGS).unlink()
    assert refusal(k) == 2
    assert capsys.readouterr().err.strip() == (
        f"RUN={run} holds a run's work (stage 0's rollouts, stage 0's training) but no {records.RUN_SETTINGS} (the "
        f"settings it was run with), so this attempt's cannot be checked against them: restore the file, or choose a "
        f"new RUN")
    assert not (run / records.RUN_SETTINGS).exists()
    (run / records.RUN_SETTINGS).write_text('{"knobs": ')
    assert refusal(k) == 2
    assert capsys.readouterr().err.startswith(f"{run / records.RUN_SETTINGS} is not valid JSON (")
    (run / records.RUN_SETTINGS).unlink()
    (run / records.RESULTS).write_text('{"stage": -1}\n{"sta')           # damaged by hand: written whole by the run
    assert refusal(k) == 2
    assert capsys.readouterr().err.strip() == (
        f"RUN={run}: a record cannot be read ({run / records.RESULTS}:2: truncated last line (no newline): the file "
        f"is incomplete): restore it from a copy, or choose a new RUN")


# ----------------------------------------------------------------------------- a model or policy that cannot load


def model_dir(tmp_path, name="m", shards=1):
    """A tiny checkpoint directory as save_pretrained writes one: config.json, safetensors (one file or an index and
    shards), a tokenizer."""
    from safetensors.torch import save_file
    d = tmp_path / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    tensors = {f"w{i}": torch.arange(6, dtype=torch.float32) + i for i in range(shards)}
    if shards == 1:
        save_file(tensors, str(d / "model.safetensors"))
    else:
        names = {k: f"model-0000{i + 1}-of-0000{shards}.safetensors" for i, k in enumerate(tensors)}
        for k, f in names.items():
            save_file({k: tensors[k]}, str(d / f))
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    (d / "tokenizer.json").write_text("{}")
    return d


@pytest.mark.parametrize("damage,problem", [
    (lambda d: (d / "config.json").unlink(), "no config.json (not a model directory)"),
    (lambda d: (d / "config.json").write_text("{"), "config.json is not valid JSON"),
    (lambda d: (d / "config.json").write_text("{}"), "config.json names no model (no architectures, no model_type)"),
    (lambda d: (d / "model.safetensors").unlink(), "no *.safetensors weights"),
    (lambda d: ((d / "model.safetensors").unlink(), (d / "pytorch_model.bin").write_bytes(b"x")),
     "no *.safetensors weights (only pytorch_model.bin: the trainer loads safetensors)"),
    # 8 bytes of header length, the header, then 6 float32s: 24 bytes of data; 10 of them cut off
    (lambda d: os.truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size - 10),
     "model.safetensors is cut short"),
    (lambda d: os.truncate(d / "model.safetensors", 5), "model.safetensors is cut short (5 bytes, its header unreadable)"),
    (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer (tokenizer.json, tokenizer.model, vocab.json"),
])
def test_a_damaged_checkpoint_is_named_by_what_is_wrong(tmp_path, damage, problem):
    d = model_dir(tmp_path)
    assert common.policy_problem(d) is None
    damage(d)
    found = common.policy_problem(d)
    assert found is not None and found.startswith(problem), found


def test_a_sharded_checkpoint_missing_a_shard_is_named(tmp_path):
    d = model_dir(tmp_path, shards=2)
    assert common.policy_problem(d) is None
    (d / "model-00002-of-00002.safetensors").unlink()
    assert common.policy_problem(d) == \
        "model.safetensors.index.json names shards that are not there: model-00002-of-00002.safetensors"


def test_a_runs_own_damaged_policy_says_which_phase_writes_it_again(tmp_path):
    run = tmp_path / "run"
    (run / ".done").mkdir(parents=True)
    policy = model_dir(run / "stage_1", "policy")
    whole = (policy / "model.safetensors").stat().st_size
    os.truncate(policy / "model.safetensors", whole - 8)
    (run / "stage_1" / "train_state").mkdir()
    (run / "stage_1" / "train_state" / "progress.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        common.require_policy(policy)
    assert str(e.value) == (f"--policy={policy}: model.safetensors is cut short: {whole - 8} bytes of the {whole} its "
                            f"header describes; it is optimize_1's output: `rm -r {policy}` and rerun to write it "
                            f"again from stage 1's train state")
    (run / "stage_1" / "train_state" / "progress.json").unlink()
    with pytest.raises(SystemExit) as e:
        common.require_policy(policy)
    assert str(e.value).endswith("it is optimize_1's output, and stage 1's train state is gone (only the last is "
                                 "kept): a new RUN starts over")


def test_a_local_path_that_does_not_exist_is_not_taken_for_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for missing in ("runs/x", "runs/x/stage_0/policy", str(tmp_path / "nothing"), "./model", "~/model"):
        assert common.looks_local(missing), missing
        with pytest.raises(SystemExit) as e:
            common.local_dir(missing)
        assert str(e.value) == f"{missing}: no such directory (a local path; a hub name is <organization>/<model>)"
    for hub in ("Qwen/Qwen2.5-Math-7B", "gpt2"):
        assert not common.looks_local(hub)


# ----------------------------------------------------------------------------- training data


@pytest.mark.parametrize("lines,problem", [
    ([b"42"], ":1: a problem is a JSON object with id, problem, answer, got 42"),
    ([b'{"id": "a", "problem": "1+1?", "answer": "2"}', b'["a", "b"]'], ":2: a problem is a JSON object"),
    ([b'{"id": "a", "problem": "caf\xe9", "answer": "2"}'], ":1: not UTF-8 (byte 0xe9 at column 28)"),
    ([b'{"id": "a", "problem": "1+1?", "answer": " "}'], ":1: the answer is empty (no response could be graded right)"),
    ([b'', b'{"id": "a", "problem": "1+1?"}'], ":2: has no field 'answer' (prepare it with data/prepare.py)"),
    ([b'{"id": "a", "problem": '], ":1: not valid JSON"),
])
def test_a_bad_training_row_is_named_by_file_and_line(tmp_path, lines, problem):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError) as e:
        common.load_problems(path)
    assert str(e.value).startswith(f"{path}{problem}"), str(e.value)


def test_a_file_cut_short_and_an_empty_one(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"id": "a", "problem": "1+1?", "answer": "2"}')
    with pytest.raises(ValueError, match=r"train.jsonl:1: truncated last line \(no newline\)"):
        common.load_problems(path)
    path.write_bytes(b"")
    assert common.load_problems(path) == []        # mu_grpo/launch.py: "has no problems", before any phase


def test_an_unknown_script_flag_names_the_known_ones():
    with pytest.raises(SystemExit) as e:
        common.apply_overrides({"lr": 1e-6, "seed": 0}, ["--lrate=1"])
    assert str(e.value) == "unknown option --lrate; known: lr, seed"


# ----------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_in_a_phases_view_is_no_traceback():
    # the terminal's view of a phase (run_stages.sh's `phase`) gets the SIGINT of a Ctrl-C with the phase: it ends
    # with 130 and says nothing (run_stages.sh says the run resumes on a rerun)
    proc = subprocess.Popen([sys.executable, "-m", "mu_grpo.launch", "--command=view"], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(b"a line\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == b"a line\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and b"Traceback" not in err and not err.strip(), err


def test_a_ctrl_c_test_passes_in_a_suite_started_in_the_background():
    # `bash test.sh &` starts pytest with SIGINT ignored, and every process it starts inherits that: the test above
    # would see its view never interrupted (exit 0, not 130) unless conftest.py restores the default dispositions
    ignore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)         # noqa: E731 (what `&` does)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
                           f"{__file__}::test_ctrl_c_in_a_phases_view_is_no_traceback"], cwd=ROOT,
                          capture_output=True, text=True, preexec_fn=ignore_sigint, timeout=120)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


# ----------------------------------------------------------------------------- what a run leaves when it ends


def test_a_run_ends_leaving_no_temporary_directory_and_a_refused_new_run_leaves_nothing(tmp_path):
    from mu_grpo import engine, handoff
    run = tmp_path / "run"

    def end(status, new_run):
        (run / ".done").mkdir(parents=True, exist_ok=True)
        for d in (engine.link_dir(run), handoff.transfer_socket(run, 0).parent):
            d.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "mu_grpo.launch", "--command=end", f"--status={status}",
                               f"--new_run={new_run}"], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "RUN": str(run), "NODE_RANK": "0"}, timeout=60)
        assert proc.returncode == 0 and not engine.link_dir(run).exists()
        assert not handoff.transfer_socket(run, 0).parent.exists()
        return proc.stderr
    assert end(0, "true") == "" and run.is_dir()               # a run that ended well keeps its directory
    assert end(2, "false") == "" and run.is_dir()              # a refused rerun keeps the run's
    assert end(2, "true") == "" and not run.exists()           # a refused new run leaves nothing
    assert end(130, "false") == f"[run] stopped: rerun the same command to resume {run} where it stopped\n"


def test_figures_of_a_directory_that_holds_no_run_are_refused(tmp_path):
    # before: five empty figures and exit 0, for an empty or misspelt directory alike
    (tmp_path / "empty").mkdir()
    for path, what in ((tmp_path / "empty", "it holds no run"), (tmp_path / "misspelt", "no such directory")):
        proc = subprocess.run([sys.executable, "tools/plot.py", f"--run_dir={path}", f"--out_dir={tmp_path / 'plots'}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and proc.stderr.strip() == (
            f"--run_dir={path}: {what} (no results.jsonl, metrics.jsonl or timeline.jsonl): a run_stages.sh or "
            f"optimize.py run directory"), proc.stderr
    assert not (tmp_path / "plots").exists()


def test_the_data_a_run_trains_and_evaluates_on_is_its_setting_by_content(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\n')
    (data / "test.jsonl").write_text('{"id": "b", "problem": "2+2?", "answer": "4"}\n')
    where = {"TRAIN_DATA": str(data / "train.jsonl"), "EVAL_DATA_DIR": str(data)}
    run, k = recorded_run(tmp_path, **where)
    common.atomic_write_json(run / records.RUN_SETTINGS, launch.run_settings(k))    # recorded at these paths
    assert sorted(launch.run_settings(k)["data"]) == [str(data / "test.jsonl"), str(data / "train.jsonl")]
    assert launch.rerun_check(k) == {"FRESH": "0", "EXTEND": "0"}
    (data / "train.jsonl").write_text('{"id": "a", "problem": "1+1?", "answer": "3"}\n')     # one answer changed
    assert refusal(k) == 2 and f"data {data / 'train.jsonl'} 'sha256:" in capsys.readouterr().err


def test_training_data_that_holds_benchmark_problems_is_named(tmp_path, capsys):
    (tmp_path / "test.jsonl").write_text('{"id": "b", "problem": "What is  2+2?", "answer": "4"}\n'
                                         '{"id": "c", "problem": "3+3?", "answer": "6"}\n')
    rows = [{"id": "a", "problem": "what is 2+2?", "answer": "4"}, {"id": "d", "problem": "5+5?", "answer": "10"}]
    launch.print_overlap(rows, {"TRAIN_DATA": "train.jsonl", "EVAL_DATA_DIR": str(tmp_path), "BENCHMARKS": "test"})
    assert capsys.readouterr().err == (f"[run] TRAIN_DATA=train.jsonl holds 1 of benchmark test's 2 problems "
                                       f"({tmp_path}/test.jsonl): its accuracy on them is not held-out\n")
    launch.print_overlap(rows[1:], {"TRAIN_DATA": "train.jsonl", "EVAL_DATA_DIR": str(tmp_path), "BENCHMARKS": "test"})
    assert capsys.readouterr().err == ""


def test_gpus_the_machine_does_not_have_are_refused():
    proc = subprocess.run([sys.executable, "-m", "mu_grpo.launch", "--command=settings"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **TOY, "GPUS": "2", "VISIBLE_GPUS": "0",
                                          "CUDA_VISIBLE_DEVICES": ""}, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == \
        "GPUS=2, and torch sees 0 GPU(s) here (CUDA_VISIBLE_DEVICES='')", proc.stderr


def test_a_directory_the_run_cannot_write_is_named_before_any_compute(tmp_path, monkeypatch, capsys):
    run, k = recorded_run(tmp_path)
    stuck = run / "stage_0" / "rollouts"
    real = common.unwritable
    monkeypatch.setattr(common, "unwritable", lambda d: "Read-only file system" if d == stuck else real(d))
    assert refusal(k) == 2
    assert capsys.readouterr().err.strip() == (f"RUN={run}: {stuck} cannot be written (Read-only file system): the "
                                               f"run writes there; make it writable")


def test_a_write_probe_tells_a_directory_that_cannot_be_written(tmp_path):
    assert common.unwritable(tmp_path) is None and not list(tmp_path.iterdir())
    assert common.unwritable(tmp_path / "missing") == "No such file or directory"


def test_figures_of_a_run_with_a_damaged_record_name_its_file_and_line(tmp_path):
    (tmp_path / "stage_0").mkdir()
    (tmp_path / "stage_0" / records.METRICS).write_text('{"update": 0}\n{"upd\n{"update": 2}\n')
    proc = subprocess.run([sys.executable, "tools/plot.py", f"--run_dir={tmp_path}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().startswith(
        f"{tmp_path}/stage_0/{records.METRICS}:2: not valid JSON (") and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("argument", ["--help", "LR=1e-3"])
def test_run_stages_sh_takes_no_arguments(argument):
    # before: `bash run_stages.sh --help` started a run (on a GPU box the paper run) and `LR=1e-3` as an argument was
    # ignored, both to exit 0 with a run the user did not ask for
    proc = subprocess.run(["bash", "run_stages.sh", argument], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (2, "") and proc.stderr == (
        f"run_stages.sh takes no arguments, got '{argument}': knobs are environment variables (LR=1e-3 bash "
        f"run_stages.sh)\n")


def test_a_record_made_before_the_loops_flags_were_left_out_still_matches_its_run(tmp_path):
    # a run recorded by the code before this change held its block values of the flags the loop always passes
    # (generate.py group_size, optimize.py seed, ...); its same-command rerun must not be refused over them
    run, k = recorded_run(tmp_path)
    old = json.loads((run / records.RUN_SETTINGS).read_text())
    for script, flags in launch.LOOP_PASSED.items():
        old[script].update({f: d for f, d in common.script_defaults(ROOT / script).items() if f in flags})
    old.pop("data")
    common.atomic_write_json(run / records.RUN_SETTINGS, old)
    assert launch.rerun_check(k) == {"FRESH": "0", "EXTEND": "0"}


def test_what_other_nodes_and_a_killed_write_leave_in_a_new_run_is_a_runs(tmp_path):
    # node 1 started first holds its lock file in RUN before node 0 records anything; a write probe or an atomic
    # write killed midway leaves its temporary name
    run = tmp_path / "run"
    run.mkdir()
    for name in (".lock.node1", ".write_probe.123", f".{records.RUN_SETTINGS}.tmp456", "logs"):
        (run / name).write_text("")
    k, _ = launch.resolve({**TOY, "RUN": str(run)})
    assert launch.rerun_check(k) == {"FRESH": "0", "EXTEND": "0"}


def test_flags_of_a_scripts_block_that_are_computed_are_flags_too():
    # mu_grpo/preflight.py's prompt_template is model_cards.PROMPT_TEMPLATE, not a literal: still one of its flags
    assert launch.knob_flags("PREFLIGHT_ARGS", "--prompt_template={problem} --prompts=8") == (
        {"prompt_template": "{problem}", "prompts": 8}, None)


def test_a_record_gains_the_hashes_of_data_fetched_after_it(tmp_path, monkeypatch):
    # the paper's benchmarks are fetched at the first evaluation, after the record: the next attempt records them
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\n')
    run, k = recorded_run(tmp_path, TRAIN_DATA=str(data / "train.jsonl"), EVAL_DATA_DIR=str(data))
    common.atomic_write_json(run / records.RUN_SETTINGS, launch.run_settings(k))
    (data / "test.jsonl").write_text('{"id": "b", "problem": "2+2?", "answer": "4"}\n')      # fetched meanwhile
    for name, value in {**k, "FRESH": "0", "EXTEND": "0"}.items():
        monkeypatch.setenv(name, value)
    launch.record_settings()
    assert sorted(json.loads((run / records.RUN_SETTINGS).read_text())["data"]) == [
        str(data / "test.jsonl"), str(data / "train.jsonl")]
    (data / "test.jsonl").write_text('{"id": "b", "problem": "2+2?", "answer": "5"}\n')      # then edited
    assert refusal(k) == 2


def test_the_runs_loss_is_recorded_whole_so_an_edited_preset_row_is_a_changed_setting(tmp_path, monkeypatch, capsys):
    # the LOSS row lives in loss.py, no phase script's block: before the Loss was recorded, editing mu-grpo's row
    # between attempts changed a run's loss unseen. A record made before (its optimize.py loss block's values, no
    # Loss) still matches its run
    import loss as L
    run, k = recorded_run(tmp_path)
    monkeypatch.setitem(L.PRESETS, "mu-grpo", L.Preset("clip", dict(clip_low=0.0, clip_high=4.0, nav_delta=1e-4),
                                                        "an edited row"))
    assert refusal(k) == 2
    assert "loss settings {'clip_high': 5.0, 'clip_low': 0.0} → {'clip_low': 0.0, 'clip_high': 4.0}" in \
        capsys.readouterr().err
    monkeypatch.undo()
    record = json.loads((run / records.RUN_SETTINGS).read_text())
    del record["loss"]
    record["optimize.py"].update(clip_low=0.0, clip_high=5.0, nav_delta=0.0001, nav_scope="H")   # the old block's
    common.atomic_write_json(run / records.RUN_SETTINGS, record)
    assert launch.rerun_check(k) == {"FRESH": "0", "EXTEND": "0"}
