"""Host memory of optimize.py's model loading: peak RSS of each torchrun rank, FSDP2 over gloo on CPU.

    python bench/bench_load.py                              # this checkout, 2 ranks, a ~440 MB bf16 model
    python bench/bench_load.py --before=/tmp/old-checkout   # and another checkout of the repo, same inputs

Runs `torchrun --nproc_per_node=<ranks> optimize.py --updates_per_stage=1` on a small synthetic stage
with a randomly initialized Llama saved in bf16 (no download), sampling every rank's resident set
size every 20 ms (psutil). A rank that loads the whole fp32 model before sharding peaks at ≥ 4 bytes ×
parameters; one that reads only its own rows of each tensor peaks at its shard plus the runtime.
"""
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import records  # noqa: E402
import rollouts  # noqa: E402

# ----------------------------------------------------------------------------- hyperparameters
ranks = 2
hidden = 1024                 # Llama: 12 layers × 1024 wide, vocab 32000: 0.22 B parameters (0.44 GB in bf16)
layers = 12
vocab = 32000
before = ""                   # another checkout (e.g. a git worktree of an older commit) to compare with
out_dir = str(ROOT / "bench" / "out" / "load")
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])


def build(out):
    import torch  # torch, transformers: only when the model is built
    from transformers import LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, str(ROOT / "data"))
    import toy  # data/ is on the path only now
    model_dir, stage = out / "model", out / "stage"
    if not (model_dir / "config.json").exists():
        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                          num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, vocab_size=vocab,
                          max_position_embeddings=2048, tie_word_embeddings=False)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
        toy.build_tokenizer(["What is 1 + 2? \\boxed{3}"] * 10, 300).save_pretrained(model_dir)
    rows = [{"prompt_id": f"p{g}", "group": g, "sample_idx": i, "prompt_token_ids": [5, 6, 7, 8],
             "response_token_ids": [9 + i, 10, 11], "behavior_logprobs": [-10.0, -10.0, -10.0], "finish_reason": "stop",
             "reward": float(i == 0), "advantage": 1.5 if i == 0 else -0.5, "stage": 0, "policy": str(model_dir)}
            for g in range(4) for i in range(4)]
    (stage / records.ROLLOUTS).mkdir(parents=True, exist_ok=True)
    common.atomic_write_lines(rollouts.shard_path(stage / records.ROLLOUTS, 0), rows)
    common.atomic_write_json(stage / records.ROLLOUTS / records.MANIFEST, {
        "complete": True, "stage": 0, "policy": str(model_dir), "shards": ["shard_00000.jsonl"],
        "sampling": {"n": 4, "temperature": 1.0, "top_p": 1.0, "max_tokens": 3}})
    return model_dir, stage


def peak_rss_per_rank(checkout, model_dir, stage, out):
    """Run the checkout's optimize.py under torchrun: peak RSS (GiB) of each rank while loading (until rank 0
    starts its first update: the "stage 0 updates:" bar) and over the whole run, and the seconds."""
    import psutil  # psutil: only the rank-memory rows read it
    subprocess.run(["rm", "-rf", str(out)], check=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(Path(checkout) / "optimize.py"), f"--stage_dir={stage}", f"--policy={model_dir}",
           f"--out={out / 'policy'}", "--updates_per_stage=1", "--prompts_per_update=4"]
    proc = subprocess.Popen(cmd, cwd=checkout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks, loading_peaks, done, training, output = {}, {}, threading.Event(), threading.Event(), []

    def read():
        while char := proc.stdout.read(1):
            output.append(char)
            if not training.is_set() and "updates:" in "".join(output[-200:]):
                training.set()

    def sample():
        parent = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                for child in parent.children(recursive=True):
                    try:
                        if any(a.endswith("optimize.py") for a in child.cmdline()):
                            rss = child.memory_info().rss / 2**30
                            peaks[child.pid] = max(peaks.get(child.pid, 0.0), rss)
                            if not training.is_set():
                                loading_peaks[child.pid] = max(loading_peaks.get(child.pid, 0.0), rss)
                    except psutil.Error:
                        pass
            except psutil.Error:
                return
            time.sleep(0.02)

    threads = [threading.Thread(target=f, daemon=True) for f in (sample, read)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    proc.wait()
    done.set()
    for t in threads:
        t.join()
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: optimize.py failed:\n{''.join(output)[-3000:]}")
    ranked = sorted(peaks, key=lambda pid: -loading_peaks.get(pid, 0.0))
    return [loading_peaks.get(pid, 0.0) for pid in ranked], [peaks[pid] for pid in ranked], time.perf_counter() - t0


if __name__ == "__main__":
    out = Path(out_dir)
    model_dir, stage = build(out)
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**30
    n_params = size * 2**30 / 2
    print(f"model: {n_params / 1e9:.2f} B parameters, {size:.2f} GiB of bf16 safetensors "
          f"(fp32 in memory: {4 * n_params / 2**30:.2f} GiB); {ranks} gloo ranks on CPU")
    table = []
    for label, checkout in [("before: " + before, before), ("this checkout", str(ROOT))]:
        if checkout:
            table.append((label, *peak_rss_per_rank(checkout, model_dir, stage, out / ("run-" + str(len(table))))))
    print(f"| {'optimize.py':<40} | {'loading: peak RSS/rank GiB':>26} | {'whole run (1 update)':>20} | {'seconds':>7} |")
    print(f"|{'-' * 42}|{'-' * 28}|{'-' * 22}|{'-' * 9}|")
    for label, loading, whole, seconds in table:
        print(f"| {label[:40]:<40} | {', '.join(f'{p:.2f}' for p in loading):>26} | "
              f"{', '.join(f'{p:.2f}' for p in whole):>20} | {seconds:7.1f} |")
    print(json.dumps({"parameters": n_params, "ranks": ranks, "rows": table}))
