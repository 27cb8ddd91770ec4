"""preflight.py on the toy model on CPU: every check's code path runs (GPU-only ones are SKIPPED), a pass
is cached, and a wrong setting is caught for the right reason."""
import json
import shutil

import pytest

from conftest import needs_vllm, run_script

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


def test_a_wrong_temperature_fails_the_agreement_checks(toy, passed, tmp_path):
    out = tmp_path / "preflight.json"
    shutil.copytree(passed[0].with_suffix(""), out.with_suffix(""))      # its stage-0 rollouts are reused
    proc = preflight(toy, out, "--optimize_args=--temperature=0.5", check=False)
    assert proc.returncode == 1 and "the run will not start" in proc.stdout
    report = json.loads(out.read_text())
    failed = {r["check"].split(":")[0] for r in report["checks"] if r["status"] == "FAIL"}
    assert "engine/trainer agreement" in failed and "stop tokens" not in failed
    assert "hint: check --temperature" in proc.stdout
