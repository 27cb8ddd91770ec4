"""preflight.py on the toy model on CPU: every check's code path runs (GPU-only ones are SKIPPED), the run's
optimize flags reach the miniature, a pass is cached, the miniature's weights are deleted, and each check FAILS
on the fault it exists for (a wrong temperature, a stale save, a train state not loaded, sequences that see
each other, a response that runs past its turn)."""
import json
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, needs_vllm, read_lines, run_script

pytestmark = needs_vllm


def preflight(toy, out, *extra, check=True):
    return run_script("preflight.py", f"--policy={toy / 'model'}", f"--data={toy / 'train.jsonl'}", f"--out={out}",
                      "--gpus=0", "--prompts=8", "--group_size=4", "--updates=2", "--max_prompt_tokens=64",
                      "--max_response_tokens=12", "--micro_batch_tokens=4096", "--prompt_template={problem}",
                      "--estimate_stage_prompts=64", *extra, check=check)


def run_flags(toy):
    """What run_stages.sh passes for GRAD_CKPT=true LOSS=offpolicy-grpo KL_COEF=0.05."""
    return (f"--optimize_args=--gradient_checkpointing=true --clip_low=0.8 --clip_high=1.2 --nav_delta=none "
            f"--kl_coef=0.05 --ref_policy={toy / 'model'}")


@pytest.fixture(scope="session")
def passed(toy, tmp_path_factory):
    out = tmp_path_factory.mktemp("preflight") / "preflight.json"
    return out, preflight(toy, out, run_flags(toy), "--resident=true")


@pytest.fixture
def check_functions(monkeypatch):
    """preflight.py's check functions, imported with the CPU thresholds."""
    monkeypatch.setattr(sys, "argv", ["preflight.py", "--gpus=0"])
    sys.modules.pop("preflight", None)
    import preflight as P
    return P


@pytest.mark.slow
def test_preflight_passes_on_the_toy_model_with_its_table(passed):
    out, proc = passed
    report = json.loads(out.read_text())
    status = {}
    for r in report["checks"]:
        status.setdefault(r["check"].split(":")[0], set()).add(r["status"])
    assert report["passed"] and set().union(*status.values()) == {"PASS", "SKIPPED", "INFO"}
    assert {k for k, v in status.items() if "SKIPPED" in v} == {"headroom", "resident hand-off"}   # GPU-only rows
    assert {"stop tokens", "truncation", "engine/trainer agreement", "packed attention", "gradient checkpointing",
            "round trip", "evaluation", "resident hand-off"} <= set(status)
    gated = {r["check"] for r in report["checks"] if r["status"] == "PASS"}       # mean and p99.9, not the max
    assert {"engine/trainer agreement: mean |Δ log p| at update 0",
            "packed attention: p99.9 |Δ log p| packed vs one sequence",
            "round trip: saved weights equal the trainer's state (max |Δ|)"} <= gated
    assert "| stop tokens" in proc.stdout and "ESTIMATE for a stage of 64 prompts" in proc.stdout
    assert report["figures"]["train_tokens_per_s"] > 0 and report["figures"]["grader_responses_per_s"] > 0
    assert report["figures"]["engines_ran"] == 1 and 0 < report["figures"]["batch_saturation"] < 1


@pytest.mark.slow
def test_the_runs_optimize_flags_reach_the_miniature_and_its_weights_are_deleted(toy, passed):
    out, _ = passed
    work = out.with_suffix("")
    trained = json.loads((work / "stage_0" / "optimize_config.json").read_text())["hyperparameters"]
    assert trained["gradient_checkpointing"] is True and trained["kl_coef"] == 0.05 and trained["clip_low"] == 0.8
    assert trained["micro_batch_tokens"] == 4096
    assert "ref log-probs: one pass" in (work / "logs" / "optimize_0.log").read_text()     # KL's reference pass ran
    off = json.loads((work / "ckpt_off" / "optimize_config.json").read_text())["hyperparameters"]
    assert off["gradient_checkpointing"] is False                  # the check's own setting wins over the run's
    assert json.loads(out.read_text())["key"]["optimize_args"] == run_flags(toy).split("=", 1)[1]
    assert not list(work.rglob("*.safetensors")) and not list(work.rglob("train_state*"))
    import handoff
    assert not handoff.fast_dir(work / "resident").exists()           # the hand-off directory (in /dev/shm) too
    assert (work / "stage_0" / "rollouts" / "manifest.json").exists() and (work / "logs" / "optimize_0.log").exists()


@pytest.mark.slow
def test_a_pass_is_cached_for_the_same_model_code_gpus_and_settings(toy, passed):
    out, _ = passed
    assert "passed before" in preflight(toy, out, run_flags(toy), "--resident=true").stdout


@pytest.mark.slow
def test_a_wrong_temperature_fails_the_agreement_check(toy, passed, tmp_path):
    # the trainer at another temperature than sampling, on the preflight's own stage-0 rollouts: its update-0
    # |Δ log p| is what the agreement check compares with its CPU threshold (1e-3), which the passing run met
    report = json.loads(passed[0].read_text())
    agreement = next(r for r in report["checks"] if r["check"].startswith("engine/trainer agreement: mean"))
    assert agreement["status"] == "PASS" and agreement["threshold"] == 1e-3
    run_script("optimize.py", f"--stage_dir={passed[0].with_suffix('') / 'stage_0'}", f"--policy={toy / 'model'}",
               f"--out={tmp_path / 'policy'}", "--updates_per_stage=1", "--prompts_per_update=4",
               "--micro_batch_tokens=4096", "--save_train_state=false", "--temperature=0.5")
    wrong = read_lines(tmp_path / "metrics.jsonl")[0]["mismatch/mean_abs_log_ratio"]
    assert wrong > 10 * agreement["threshold"] > 100 * agreement["value"]


@pytest.mark.slow
def test_the_round_trip_fails_on_a_stale_save_and_on_a_train_state_not_loaded(toy, passed, tmp_path, check_functions):
    work = passed[0].with_suffix("")
    shutil.copytree(work / "stage_0", tmp_path / "stage_0")
    run_script("optimize.py", f"--stage_dir={tmp_path / 'stage_0'}", f"--policy={toy / 'model'}", "--updates_per_stage=2",
               "--prompts_per_update=4", "--lr=1e-4")
    policy, state = tmp_path / "stage_0" / "policy", tmp_path / "stage_0" / "train_state"
    results = []
    check_functions.round_trip_checks(results, toy / "model", policy, state)
    assert [r["status"] for r in results] == ["PASS", "PASS"]
    stale = []                              # a save of the initial weights instead of the trained ones
    check_functions.round_trip_checks(stale, toy / "model", toy / "model", state)
    assert [r["status"] for r in stale] == ["FAIL", "FAIL"] and stale[0]["value"] == 0
    # the next stage's trainer started from --policy (the initial model) instead of the train state: vLLM sampled
    # stage 1 from the trained policy, so update 0's mismatch fails the agreement check the preflight passed
    report = json.loads(passed[0].read_text())
    round_trip = next(r for r in report["checks"] if r["check"].startswith("round trip: vLLM on the saved policy") and
                      "mean" in r["check"])
    assert round_trip["status"] == "PASS"
    shutil.copytree(work / "stage_1", tmp_path / "stage_1")
    run_script("optimize.py", f"--stage_dir={tmp_path / 'stage_1'}", f"--policy={toy / 'model'}", "--updates_per_stage=1",
               "--prompts_per_update=4", "--save_train_state=false")
    first = read_lines(tmp_path / "stage_1" / "metrics.jsonl")[0]
    results = []
    check_functions.agreement_checks(results, first, "round trip")
    assert results[0]["status"] == "FAIL", first["mismatch/mean_abs_log_ratio"]


@pytest.mark.slow
def test_the_packing_check_fails_when_sequences_see_each_other(toy, passed, tmp_path, check_functions):
    # the planted fault: the packed attention treats the whole row as one causal sequence
    shutil.copytree(passed[0].with_suffix("") / "stage_0", tmp_path / "stage_0")
    args = ["optimize.py", f"--stage_dir={tmp_path / 'stage_0'}", f"--policy={toy / 'model'}", "--updates_per_stage=1",
            "--prompts_per_update=4", "--micro_batch_tokens=4096", "--save_train_state=false", "--check_packing=true"]
    code = ("import runpy, sys, model; model.sequence_bounds = lambda position_ids, n: [0, n]; "
            f"sys.argv = {args!r}; runpy.run_path('optimize.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = []
    check_functions.packing_checks(results, read_lines(tmp_path / "stage_0" / "metrics.jsonl")[0])
    assert [r["status"] for r in results] == ["FAIL", "FAIL", "INFO"]
    report = json.loads(passed[0].read_text())
    assert [r["status"] for r in report["checks"] if r["check"].startswith("packed attention")] == ["PASS", "PASS", "INFO"]


def test_the_stop_token_check_fails_on_a_special_token_or_a_new_turn_inside(toy, tmp_path, check_functions):
    from test_common import QWEN_LIKE, _chat_tokenizer
    tok = _chat_tokenizer(toy, QWEN_LIKE, "<|im_end|>")     # <|im_start|> stays plain text here
    tok.save_pretrained(tmp_path / "tok")
    end, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id

    def rows(*responses):
        return [{"prompt_id": f"p{i}", "response_token_ids": r, "finish_reason": "stop"} for i, r in enumerate(responses)]
    clean = tok.encode(" 1 + 1 = \\boxed{2}", add_special_tokens=False)
    for responses, inside in [((clean + [end], clean + [eos]), 0),
                              ((clean + [end] + clean + [eos], clean + [end]), 1),            # ran past the end token
                              ((clean + tok.encode("\n<|im_start|>user\nand", add_special_tokens=False) + [eos],), 1)]:
        results = []
        check_functions.stop_token_check(results, rows(*responses), tmp_path / "tok")
        assert results[0]["status"] == ("FAIL" if inside else "PASS"), results[0]
        assert str(results[0]["value"]).startswith(str(inside))


@pytest.mark.slow
def test_a_failed_phase_stops_the_run_and_names_its_log(toy, passed, tmp_path):
    # a phase that cannot run (an unknown optimize.py setting) is a failed check: table, exit 1, the log named.
    # Other optimize flags than the passing run's: its cached pass does not apply
    out = tmp_path / "preflight.json"
    shutil.copytree(passed[0].with_suffix(""), out.with_suffix(""))      # its stage-0 rollouts are reused
    shutil.copy(passed[0], out)
    proc = preflight(toy, out, "--optimize_args=--no_such_setting=1", check=False)
    assert proc.returncode == 1 and "the run will not start" in proc.stdout and "passed before" not in proc.stdout
    report = json.loads(out.read_text())
    status = {r["check"].split(":")[0]: r["status"] for r in report["checks"]}
    assert status["optimize_0"] == "FAIL" and status["stop tokens"] == "PASS"
    failed = next(r for r in report["checks"] if r["status"] == "FAIL")
    assert "unknown option --no_such_setting" in failed["value"] and "optimize_0.log" in failed["value"]
