"""Preflight: the paper run in miniature on this box, with its model and all its GPUs, checking every path
that only a GPU exercises before days of compute are spent (run_stages.sh runs it first on the paper
preset; PREFLIGHT=0 skips it, PREFLIGHT=force runs on after a FAIL).

    python preflight.py --policy=Qwen/Qwen2.5-Math-7B --data=data/deepscaler.jsonl --out=runs/x/preflight.json

One small stage (`prompts` × G at the preset's response length) with generate.py, a few updates with
optimize.py (torchrun over the GPUs, the preset's micro-batch), a second small stage sampled by vLLM
from the saved policy and read back by the trainer from its own fp32 state, two one-update runs
with and without gradient checkpointing, and a tiny evaluation. Each check prints PASS / FAIL /
SKIPPED with its measured number and threshold; preflight.json keeps them. A pass is cached for the
same model, code and GPU count. Exit status 1 after a FAIL (0 with --force=true).
"""
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import common
import reward

ROOT = Path(__file__).resolve().parent

# ----------------------------------------------------------------------------- hyperparameters
policy = "data/toy/model"       # the run's initial model (HF name or directory)
data = "data/toy/train.jsonl"   # the run's training problems
out = "runs/preflight.json"     # the report; the miniature run lives in <out without .json>/
gpus = -1                       # GPUs (-1: all visible; 0: CPU)
prompts = 32                    # prompts in the miniature stage (× group_size responses)
group_size = 8
updates = 3                     # updates of the miniature optimize run
max_prompt_tokens = 1536        # the preset's limits
max_response_tokens = 2560
temperature = 1.0
micro_batch_tokens = 16384      # the preset's micro-batch (the headroom check runs at this size)
prompt_template = common.DEFAULT_PROMPT_TEMPLATE
optimize_args = ""              # extra optimize.py flags, space-separated (what the run passes)
estimate_stage_prompts = 65536  # prompts per stage of the real run, for the hours-per-stage estimate
peak_tflops = 989.0             # dense bf16 peak per GPU (H100/H200 SXM), for MFU
force = False                   # exit 0 even after a FAIL
# thresholds: on a GPU the engine (vLLM, bf16) and the trainer (FSDP2, bf16 compute on fp32 weights) round
# differently; per-token |Δ log p| has a mean of ~1e-3..1e-2 and rare tails near 1 on low-probability tokens.
# A wrong temperature, truncated sampling, a mis-saved checkpoint or a broken mask shifts the mean by > 0.05.
agreement_mean = 0.05           # mean |log π_trainer − log π_engine| (GPU, bf16); CPU fp32 uses 1e-3
agreement_max = 3.0             # max over tokens (GPU); CPU fp32 uses 0.05
packing_max = 0.25              # packed vs one-sequence forwards, max |Δ log p| (GPU bf16); CPU fp32 1e-4
max_truncation_rate = 0.25      # responses hitting max_response_tokens
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])
n_gpus = common.gpu_count() if gpus < 0 else gpus
on_gpu = n_gpus > 0
if not on_gpu:
    agreement_mean, agreement_max, packing_max = 1e-3, 0.05, 1e-4
report_path = Path(out)
work = report_path.with_suffix("")            # runs/x/preflight/
HINTS = {
    "engine/trainer agreement": "check --temperature (must equal sampling's), top_p=1/top_k=0 and that the "
                                "trainer loads the engine's checkpoint; on a GPU, the bf16 kernels (vLLM version)",
    "stop tokens": "the chat template's end-of-turn token is not stopping generation: check the tokenizer's "
                   "chat template and eos_token (common.stop_token_ids)",
    "truncation": "too many responses hit max_response_tokens: raise MAX_RESPONSE or check the stop tokens",
    "packed attention": "packed sequences see each other: use --attn_implementation=varlen_sdpa or sdpa, and "
                        "report the transformers/flash-attn versions",
    "gradient checkpointing": "checkpointing does not engage: the model must run in train mode with "
                              "gradient_checkpointing_enable (transformers version?)",
    "round trip": "the saved policy is not the trained one: check the saved dtype, tied weights and the "
                  "FSDP2 gather in optimize.save_policy",
    "evaluation": "evaluate.py failed on the saved policy: see its log",
    "headroom": "peak GPU memory near the limit: lower MICRO_BATCH_TOKENS; low MFU: check the attention "
                "implementation (flash-attn installed?) and GRAD_CKPT",
}


def run(name, cmd):
    """One phase of the miniature run, logged to <work>/logs/<name>.log; its output on failure."""
    (work / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True)
    (work / "logs" / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise PhaseError(name, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
    return time.perf_counter() - t0


class PhaseError(RuntimeError):
    def __init__(self, phase, message):
        super().__init__(f"{phase} failed: {message} (see {work / 'logs' / (phase + '.log')})")
        self.phase = phase


def optimize_cmd(stage_dir, out_dir, n_updates, *extra):
    launcher = [ROOT / ".venv" / "bin" / "torchrun", "--standalone", f"--nproc_per_node={n_gpus}"] if n_gpus > 1 \
        else [sys.executable]
    return [*launcher, "optimize.py", f"--stage_dir={stage_dir}", f"--out={out_dir}", f"--updates_per_stage={n_updates}",
            f"--prompts_per_update={max(1, prompts // max(1, updates))}", f"--micro_batch_tokens={micro_batch_tokens}",
            "--lr=1e-6", *extra, *optimize_args.split()]


def generate_cmd(model, stage):
    return [sys.executable, "generate.py", f"--policy={model}", f"--data={data}", f"--run_dir={work}", f"--stage={stage}",
            f"--prompts_per_stage={prompts}", f"--group_size={group_size}", f"--temperature={temperature}",
            f"--max_prompt_tokens={max_prompt_tokens}", f"--max_response_tokens={max_response_tokens}",
            f"--shard_prompts={prompts}", f"--gpus={n_gpus}", f"--prompt_template={prompt_template}"]


def check(results, name, passed, value, threshold, unit=""):
    status = "SKIPPED" if passed is None else ("PASS" if passed else "FAIL")
    results.append({"check": name, "status": status, "value": value, "threshold": threshold, "unit": unit,
                    "hint": HINTS.get(name.split(":")[0]) if status == "FAIL" else None})


def stop_token_check(results, rollouts_dir, model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    stops = set(common.stop_token_ids(tok))
    rows = [r for f in sorted(rollouts_dir.glob("shard_*.jsonl")) for r in common.read_jsonl(f)]
    inside = sum(any(t in stops for t in r["response_token_ids"][:-1]) for r in rows)
    check(results, "stop tokens: responses with EOS/end-of-turn before their end", inside == 0, inside, 0, "responses")
    truncated = sum(r["finish_reason"] == "length" for r in rows) / max(1, len(rows))
    check(results, "truncation: rate at max_response_tokens", truncated <= max_truncation_rate, round(truncated, 4),
          max_truncation_rate)
    return rows


def grader_throughput(rows):
    """Responses graded per second on this box's CPUs (the stage's own responses, repeated to ≥ 2,000)."""
    items = [(r["response"], r["answer"], r.get("source")) for r in rows] * max(1, math.ceil(2000 / max(1, len(rows))))
    t0 = time.perf_counter()
    reward.grade_batch(items, workers=max(1, (os.cpu_count() or 2) - 1))
    return len(items) / (time.perf_counter() - t0)


def parameter_count(model):
    from safetensors import safe_open
    total = 0
    for f in Path(model).glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            total += sum(math.prod(sf.get_slice(k).get_shape()) for k in sf.keys())
    return total


def code_version():
    h = hashlib.sha256()
    for name in ("common.py", "generate.py", "optimize.py", "evaluate.py", "loss.py", "reward.py", "rollouts.py",
                 "preflight.py"):
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()[:16]


def main():
    model = common.local_dir(policy)        # a hub name: the same local snapshot every phase reads
    key = {"model": common.policy_fingerprint(model), "code": code_version(), "gpus": n_gpus,
           "micro_batch_tokens": micro_batch_tokens, "optimize_args": optimize_args}
    if report_path.exists():
        old = json.loads(report_path.read_text())
        if old.get("key") == key and old.get("passed"):
            print(f"preflight: passed before for this model, code and GPU count ({report_path}); skipping")
            return
    print(f"preflight on {n_gpus} GPU(s) ({'bf16' if on_gpu else 'CPU, fp32'}): {prompts} prompts × G={group_size}, "
          f"{updates} updates, micro-batches of {micro_batch_tokens} tokens; model {model}; work dir {work}")
    for d in ("stage_0/policy", "stage_0/train_state", "stage_0/metrics.jsonl", "stage_1", "ckpt_on", "ckpt_off", "eval"):
        p = work / d
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    results, figures = [], {}
    try:
        figures["generate_seconds"] = run("generate_0", generate_cmd(model, 0))
        manifest = json.loads((work / "stage_0" / "rollouts" / "manifest.json").read_text())
        rows = stop_token_check(results, work / "stage_0" / "rollouts", model)

        run("optimize_0", optimize_cmd(work / "stage_0", work / "stage_0" / "policy", updates, f"--policy={model}",
                                       "--check_packing=true"))
        metrics = common.read_jsonl(work / "stage_0" / "metrics.jsonl")
        first = metrics[0]
        check(results, "engine/trainer agreement: mean |Δ log p| at update 0", first["mismatch/mean_abs_log_ratio"]
              <= agreement_mean, first["mismatch/mean_abs_log_ratio"], agreement_mean)
        check(results, "engine/trainer agreement: max |Δ log p| at update 0", first["mismatch/max_abs_log_ratio"]
              <= agreement_max, first["mismatch/max_abs_log_ratio"], agreement_max)
        packed = first.get("check/packed_max_abs_diff")
        check(results, "packed attention: max |Δ log p| packed vs one sequence", packed is not None and packed <= packing_max,
              packed, packing_max)

        small = min(micro_batch_tokens, 2048)      # a micro-batch that fits without checkpointing
        saved = {}
        for ckpt in (False, True):
            d = work / f"ckpt_{'on' if ckpt else 'off'}"
            run(f"optimize_ckpt_{ckpt}", optimize_cmd(work / "stage_0", d / "policy", 1, f"--policy={model}",
                                                      f"--gradient_checkpointing={ckpt}", f"--micro_batch_tokens={small}",
                                                      "--save_train_state=false"))
            m = common.read_jsonl(d / "metrics.jsonl")[0]
            saved[ckpt] = (m["memory/saved_activations_gib"], m.get("memory/peak_gib"))
        check(results, "gradient checkpointing: saved activations with / without", saved[True][0] < 0.5 * saved[False][0],
              round(saved[True][0] / max(saved[False][0], 1e-12), 4), 0.5, "ratio")

        # round trip: vLLM samples from the saved policy; the trainer reads the samples from its own fp32 state
        run("generate_1", generate_cmd(work / "stage_0" / "policy", 1))
        run("optimize_1", optimize_cmd(work / "stage_1", work / "stage_1" / "policy", 1,
                                       f"--policy={work / 'stage_0' / 'policy'}",
                                       f"--init_state={work / 'stage_0' / 'train_state'}", "--save_train_state=false"))
        rt = common.read_jsonl(work / "stage_1" / "metrics.jsonl")[0]
        check(results, "round trip: mean |Δ log p|, saved policy in vLLM vs trainer state", rt["mismatch/mean_abs_log_ratio"]
              <= agreement_mean, rt["mismatch/mean_abs_log_ratio"], agreement_mean)

        (work / "eval").mkdir(parents=True, exist_ok=True)
        shutil.copy(data, work / "eval" / "train.jsonl")
        run("evaluate", [sys.executable, "evaluate.py", f"--policy={work / 'stage_0' / 'policy'}", "--benchmarks=train",
                         f"--data_dir={work / 'eval'}", "--max_problems=16", "--k=2", f"--gpus={n_gpus}",
                         f"--max_prompt_tokens={max_prompt_tokens}", f"--max_response_tokens={max_response_tokens}",
                         f"--prompt_template={prompt_template}", f"--results={work / 'eval' / 'results.jsonl'}"])
        ev = common.read_jsonl(work / "eval" / "results.jsonl")[0]
        check(results, "evaluation: avg@2 of the saved policy on 16 training problems", True, round(ev["avg_at_k"], 4), "runs")

        # headroom and throughput
        steady = metrics[1:] or metrics
        train_tps = sum(m["tokens"] for m in steady) / sum(m["seconds"] for m in steady)
        peak = max((m.get("memory/peak_gib") or 0.0) for m in metrics)
        if on_gpu:
            import torch
            total = torch.cuda.get_device_properties(0).total_memory / 2**30
            check(results, "headroom: peak GPU memory per rank at the preset micro-batch", peak <= 0.9 * total,
                  round(peak, 2), round(0.9 * total, 1), "GiB")
        else:
            check(results, "headroom: peak GPU memory per rank at the preset micro-batch", None, None, "no GPU", "GiB")
        if on_gpu:
            mfu = 6 * parameter_count(model) * train_tps / (peak_tflops * 1e12 * n_gpus)
            check(results, "headroom: training MFU (6·N·tokens/s over bf16 peak)", mfu >= 0.1, round(mfu, 3), 0.1)
        else:
            check(results, "headroom: training MFU (6·N·tokens/s over bf16 peak)", None, None, "no GPU")
        grader_rps = grader_throughput(rows)
        mean_response = manifest["mean_response_tokens"]
        mean_prompt = sum(len(r["prompt_token_ids"]) for r in rows) / max(1, len(rows))
        stage_responses = estimate_stage_prompts * group_size
        hours = {"generate": stage_responses * mean_response / max(manifest["generated_tokens_per_s"], 1e-9) / 3600,
                 "optimize": stage_responses * (mean_prompt + mean_response) / max(train_tps, 1e-9) / 3600,
                 "grade": stage_responses / grader_rps / 3600}
        figures.update({"train_tokens_per_s": train_tps, "generated_tokens_per_s": manifest["generated_tokens_per_s"],
                        "grader_responses_per_s": grader_rps, "peak_gpu_gib": peak or None,
                        "estimated_hours_per_stage": hours, "mean_response_tokens": mean_response,
                        "saved_activations_gib": {"with_ckpt": saved[True][0], "without": saved[False][0]}})
    except PhaseError as e:
        check(results, f"{e.phase}: the phase ran", False, str(e), "exit 0")
    passed = all(r["status"] != "FAIL" for r in results)
    common.atomic_write_json(report_path, {"passed": passed, "key": key, "checks": results, "figures": figures,
                                           "time": time.time()})
    print_table(results, figures)
    if not passed:
        print(f"preflight FAILED ({report_path}); " + ("--force=true: going on anyway" if force else
                                                       "the run will not start (PREFLIGHT=force to start anyway)"))
        if not force:
            sys.exit(1)


def print_table(results, figures):
    print(f"| {'check':<72} | {'status':<7} | {'measured':>12} | {'threshold':>10} |")
    print(f"|{'-' * 74}|{'-' * 9}|{'-' * 14}|{'-' * 12}|")
    for r in results:
        value = f"{r['value']:.3g}" if isinstance(r["value"], float) else str(r["value"])
        print(f"| {r['check'][:72]:<72} | {r['status']:<7} | {value[:12]:>12} | {str(r['threshold'])[:10]:>10} |")
        if r["hint"]:
            print(f"|   hint: {r['hint']}")
    if "train_tokens_per_s" in figures:
        h = figures["estimated_hours_per_stage"]
        print(f"throughput here: generation {figures['generated_tokens_per_s']:.0f} tokens/s, training "
              f"{figures['train_tokens_per_s']:.0f} tokens/s, grading {figures['grader_responses_per_s']:.0f} responses/s")
        print(f"ESTIMATE for a stage of {estimate_stage_prompts} prompts × G={group_size} at this response length "
              f"({figures['mean_response_tokens']:.0f} tokens): generate {h['generate']:.2f} h, optimize {h['optimize']:.2f} h "
              f"(grading {h['grade']:.2f} h, overlapped with generation)")


if __name__ == "__main__":
    main()
