"""mu_grpo/engine.py's contract, in process (no engine is started): GPU groups and environments per
engine, lengths a model cannot hold, one compile cache per run. The evaluation protocol's tests are
test_benchmarks.py's."""
import os
from pathlib import Path

import pytest

from mu_grpo import common, engine, processes
from conftest import needs_vllm


def test_each_engine_gets_its_own_consecutive_gpus_from_the_visible_list():
    assert engine.engine_gpu_groups(2, 2, visible="4,5,6,7") == ["4,5", "6,7"]
    # nothing set: 0..n−1
    assert engine.engine_gpu_groups(4, 1, visible="") == ["0", "1", "2", "3"]
    with pytest.raises(SystemExit, match="2 engines × tensor_parallel 2 need 4 GPUs; "
                                         "CUDA_VISIBLE_DEVICES has 3"):
        engine.engine_gpu_groups(2, 2, visible="0,1,2")
    # a CPU: one engine
    assert engine.n_engines(0, 1) == 1 and engine.n_engines(8, 2) == 4


def test_each_engine_process_starts_on_its_gpus_without_torchruns_variables(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("LOCAL_RANK", "1")
    envs = engine.worker_environments(2, 2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5", "6,7"]
    assert all("LOCAL_RANK" not in e and e["PATH"] == os.environ["PATH"] for e in envs)


# ------------------------------------------------------- lengths a model cannot hold (issue 45, 17)


def write_config(directory, **config):
    import json
    directory.mkdir(parents=True, exist_ok=True)
    (directory
     / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], **config}))
    return directory


def test_lengths_a_model_cannot_hold_are_refused_in_one_line_naming_the_flags_and_the_limit(
        tmp_path, monkeypatch):
    # a lab policy: 2048 positions; the paper's 1536 + 2560 = 4096 do not fit, 1536 + 512 = 2048 do
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    policy = write_config(tmp_path / "lab", max_position_embeddings=2048)
    assert common.model_max_len(policy) == (2048, "max_position_embeddings")
    common.check_lengths(policy, 1536, 512)
    with pytest.raises(SystemExit) as e:
        common.check_lengths(policy, 1536, 2560)
    assert "\n" not in str(e.value)
    assert str(e.value) == ("--max_prompt_tokens=1536 + --max_response_tokens=2560 = 4096 tokens, "
                            f"more than the model {policy} holds (max_position_embeddings = 2048): "
                            "lower them to a sum of at most 2048 (run_stages.sh: MAX_PROMPT and "
                            "MAX_RESPONSE)")
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")         # vLLM's own way past its check
    common.check_lengths(policy, 1536, 2560)


def test_the_models_limit_is_derived_as_vllm_derives_it(tmp_path):
    # the smallest position key; a linear RoPE scaling of factor 2 doubles it, a YaRN one is already
    # scaled; model_max_length wins; a multimodal config's text_config; a smaller tokenizer limit;
    # no key: vLLM decides
    assert common.model_max_len(write_config(tmp_path / "a", max_position_embeddings=4096,
                                             n_positions=1024)) == \
        (1024, "n_positions")
    assert common.model_max_len(write_config(tmp_path / "b", max_position_embeddings=4096,
                                             rope_scaling={"type": "linear",
                                                           "factor": 2.0}))[0] == 8192
    assert common.model_max_len(write_config(tmp_path / "c", max_position_embeddings=4096,
                                             rope_scaling={"rope_type": "yarn",
                                                           "factor": 4.0}))[0] == 4096
    assert common.model_max_len(write_config(tmp_path / "d", max_position_embeddings=4096,
                                             model_max_length=8192)) == \
        (8192, "model_max_length")
    multimodal = write_config(tmp_path / "e", text_config={"max_position_embeddings": 32768})
    assert common.model_max_len(multimodal)[0] == 32768
    (write_config(tmp_path / "f",
                  max_position_embeddings=4096) / "tokenizer_config.json").write_text(
        '{"model_max_length": 2048}')
    assert common.model_max_len(tmp_path / "f") == (
        2048, "model_max_length in tokenizer_config.json")
    assert common.model_max_len(write_config(tmp_path / "g")) == (None, None)
    # a hub name: vLLM checks it
    assert common.model_max_len("Qwen/Qwen2.5-Math-7B") == (None, None)


@pytest.mark.slow
@pytest.mark.parametrize("script,flags", [
    (["generate.py"], ["--data=/nonexistent.jsonl", "--run_dir=/nonexistent"]),
    (["evaluate.py"], ["--benchmarks=heldout", "--data_dir=/nonexistent"]),
    (["-m", "mu_grpo.preflight"],
     ["--data=/nonexistent.jsonl", "--out=/nonexistent/preflight.json"]),
])
def test_every_script_refuses_lengths_its_model_cannot_hold_before_anything_else(
    tmp_path, script, flags):
    # `python evaluate.py --policy=<a lab policy>` without the run's length flags took the scripts'
    # defaults (1536 + 2560) and ended in vLLM's 40-line pydantic traceback; now one line, before
    # data, engines or files
    from conftest import run_script, whole_checkpoint
    policy = write_config(tmp_path / "lab", max_position_embeddings=2048)
    # (the policy's own check comes first: common.require_policy)
    whole_checkpoint(policy)
    proc = run_script(*script, f"--policy={policy}", *flags, check=False,
                      env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "0"})
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()
    assert len(last) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last[0].startswith("--max_prompt_tokens=1536 + --max_response_tokens=2560 = 4096 "
                              "tokens, more than the model")
    assert "(max_position_embeddings = 2048)" in last[0]


def test_the_trainer_refuses_rollouts_its_policy_cannot_take(tmp_path):
    # optimize.py has no length flags: its rollouts' longest prompt + response and largest token id
    # are checked against the policy (passes.check_fits)
    import types

    import numpy as np
    from mu_grpo import passes
    policy = write_config(tmp_path / "lab", model_type="qwen2", max_position_embeddings=2048,
                          vocab_size=1000)

    def stage(second_response, max_token_id=999):
        return types.SimpleNamespace(directory=tmp_path / "stage_0",
                                     prompt_len=np.array([100, 1500]),
                                     response_len=np.array([1948, second_response]),
                                     max_token_id=lambda: max_token_id)
    # 2048 and 2048 tokens: at the limit; ids < 1000
    passes.check_fits(stage(548), policy)
    with pytest.raises(SystemExit, match="token id 1000 ≥ the policy's vocabulary size 1000: "
                                         "rollouts made with another tokenizer"):
        passes.check_fits(stage(548, max_token_id=1000), policy)
    with pytest.raises(SystemExit) as e:
        passes.check_fits(stage(549), policy)
    assert "\n" not in str(e.value) and str(e.value).startswith(
        f"{tmp_path / 'stage_0'}: a prompt and response of 2049 tokens, more than the policy "
        f"{policy} holds (max_position_embeddings = 2048)")


# --------------------------------------------------------- one compile cache per run (issue 45, 13)


@needs_vllm
def test_every_phases_engine_shows_vllm_one_model_path_per_run_and_counts_ranks_eagerly_on_a_cpu(
        tmp_path, monkeypatch):
    # vLLM keys its torch.compile cache on a hash of its config, the model path included: each
    # stage's new policy directory compiled afresh. The engines of a run see one path, a link named
    # after the run, to the phase's policy (outside the run directory, which stays a plain tree)
    one, two = write_config(tmp_path / "stage_0" / "policy"), write_config(
        tmp_path / "stage_1" / "policy")
    run = tmp_path / "run"
    run.mkdir()
    first = engine.engine_model_path(one, run)
    assert first != str(one) and Path(first).resolve() == one.resolve() and not list(run.iterdir())
    assert engine.engine_model_path(two, run) == first and Path(first).resolve() == two.resolve()
    # one link per run
    assert engine.engine_model_path(one, tmp_path / "another_run") != first
    # no run (evaluate.py alone): the policy itself
    assert engine.engine_model_path(one, None) == str(one)
    # a hub name: vLLM's
    assert engine.engine_model_path("Qwen/Qwen2.5-Math-7B", run) == "Qwen/Qwen2.5-Math-7B"
    # make_llm gives vLLM that path
    import vllm
    for name in ("VLLM_LOGGING_LEVEL", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):
        # make_llm's setdefault leaves them; restored after the test
        monkeypatch.setenv(name, "")
    monkeypatch.setattr(processes, "exit_on_sigterm", lambda: None)
    seen = {}
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: seen.update(kwargs))
    # the rank count compiled, as vLLM's import leaves it (an engine made earlier in this process
    # swapped it already)
    import torch
    from vllm.v1.sample import sampler
    count = sampler.batched_count_greater_than
    monkeypatch.setattr(sampler, "batched_count_greater_than",   # restored after the test
                        torch.compile(getattr(count, "_torchdynamo_orig_callable", count)))
    engine.make_llm(one, seed=0, max_model_len=64, run_dir=run)
    assert seen["model"] == first
    # on a CPU the sampled tokens' ranks are counted eagerly (engine.eager_rank_count), not compiled
    # by inductor
    count = sampler.batched_count_greater_than
    assert not hasattr(count, "_torchdynamo_orig_callable")
    assert count(torch.tensor([[0.1, 0.5, 0.3], [0.2, 0.1, 0.0]]),
                 torch.tensor([[0.3], [0.2]])).tolist() == [2, 1]


@needs_vllm
def test_vllms_config_hash_is_the_same_for_every_policy_of_a_run_and_not_another_models(tmp_path):
    # the hash both compile caches are keyed on (vllm/compilation/backends.py VllmBackend.__call__
    # and, torch >= 2.10's default AOT compile, vllm/compilation/decorators.py via caching.py
    # aot_compile_hash_factors): vllm_config.compute_hash(), whose ModelConfig part hashes the model
    # path and the model's config
    from vllm.config import ModelConfig
    shape = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 max_position_embeddings=128)
    one = write_config(tmp_path / "stage_0" / "policy", **shape)
    two = write_config(tmp_path / "stage_1" / "policy", **shape)
    other = write_config(tmp_path / "other", **{**shape, "hidden_size": 64})
    run = tmp_path / "run"
    run.mkdir()

    def config_hash(model):
        return ModelConfig(model=model, skip_tokenizer_init=True, max_model_len=64).compute_hash()
    # what each phase compiled anew for
    assert config_hash(str(one)) != config_hash(str(two))
    one_hash, two_hash, other_hash = (config_hash(engine.engine_model_path(policy, run))
                                      for policy in (one, two, other))
    assert one_hash == two_hash and other_hash != one_hash
