"""preflight.py on the toy model on CPU: every check's code path runs (GPU-only ones are SKIPPED), a pass
is cached, and a wrong setting is caught for the right reason."""
import json
import shutil

import pytest

from conftest import needs_vllm, read_lines, run_script

pytestmark = needs_vllm


def preflight(toy, out, *extra, check=True):
    return run_script("preflight.py", f"--policy={toy / 'model'}", f"--data={toy / 'train.jsonl'}", f"--out={out}",
                      "--gpus=0", "--prompts=8", "--group_size=4", "--updates=2", "--max_prompt_tokens=64",
                      "--max_response_tokens=12", "--micro_batch_tokens=4096", "--prompt_template={problem}",
                      "--estimate_stage_prompts=64", *extra, check=check)


@pytest.fixture(scope="module")
def passed(toy, tmp_path_factory):
    out = tmp_path_factory.mktemp("preflight") / "preflight.json"
    return out, preflight(toy, out)


def test_preflight_passes_on_the_toy_model_with_its_table(passed):
    out, proc = passed
    report = json.loads(out.read_text())
    status = {r["check"].split(":")[0]: r["status"] for r in report["checks"]}
    assert report["passed"] and set(status.values()) == {"PASS", "SKIPPED"}
    assert {k for k, v in status.items() if v == "SKIPPED"} == {"headroom"}          # GPU-only
    assert {"stop tokens", "truncation", "engine/trainer agreement", "packed attention", "gradient checkpointing",
            "round trip", "evaluation"} <= set(status)
    assert "| stop tokens" in proc.stdout and "ESTIMATE for a stage of 64 prompts" in proc.stdout
    assert report["figures"]["train_tokens_per_s"] > 0 and report["figures"]["grader_responses_per_s"] > 0


def test_a_pass_is_cached_for_the_same_model_code_and_gpus(toy, passed):
    out, _ = passed
    assert "passed before" in preflight(toy, out).stdout


def test_a_wrong_temperature_fails_the_agreement_check(toy, passed, tmp_path):
    # the trainer at another temperature than sampling, on the preflight's own stage-0 rollouts: its update-0
    # |Δ log p| is what the agreement check compares with its CPU threshold (1e-3), which the passing run met
    _, proc = passed
    report = json.loads(passed[0].read_text())
    agreement = next(r for r in report["checks"] if r["check"].startswith("engine/trainer agreement: mean"))
    assert agreement["status"] == "PASS" and agreement["threshold"] == 1e-3
    run_script("optimize.py", f"--stage_dir={passed[0].with_suffix('') / 'stage_0'}", f"--policy={toy / 'model'}",
               f"--out={tmp_path / 'policy'}", "--updates_per_stage=1", "--prompts_per_update=4",
               "--micro_batch_tokens=4096", "--save_train_state=false", "--temperature=0.5")
    wrong = read_lines(tmp_path / "metrics.jsonl")[0]["mismatch/mean_abs_log_ratio"]
    assert wrong > 10 * agreement["threshold"] > 100 * agreement["value"]


def test_a_failed_phase_stops_the_run_and_names_its_log(toy, passed, tmp_path):
    # a phase that cannot run (an unknown optimize.py setting) is a failed check: table, exit 1, the log named
    out = tmp_path / "preflight.json"
    shutil.copytree(passed[0].with_suffix(""), out.with_suffix(""))      # its stage-0 rollouts are reused
    proc = preflight(toy, out, "--optimize_args=--no_such_setting=1", check=False)
    assert proc.returncode == 1 and "the run will not start" in proc.stdout
    report = json.loads(out.read_text())
    status = {r["check"].split(":")[0]: r["status"] for r in report["checks"]}
    assert status["optimize_0"] == "FAIL" and status["stop tokens"] == "PASS"
    failed = next(r for r in report["checks"] if r["status"] == "FAIL")
    assert "unknown option --no_such_setting" in failed["value"] and "optimize_0.log" in failed["value"]
