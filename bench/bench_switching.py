"""Switching overhead per stage: resident mode (two long-lived processes) with each policy handed over through vLLM's
weight-transfer API (HANDOFF=transfer) or as files (HANDOFF=files), and the process-per-phase loop, on the toy
task, measured from the runs' own records (timeline.jsonl, the manifests, metrics.jsonl, optimize_timing.json).

    python bench/bench_switching.py                              # STAGES=32 UPDATES_PER_STAGE=2, all three (~30 min, 2 cores)
    python bench/bench_switching.py --stages=16 --modes=transfer,files

Modes: phases (process-per-phase), transfer and files (resident). Each pair of modes run is checked to give the same
run (same seeds): the final weights bit-identical and the rollouts of every stage identical.

Overhead is everything that is not generation compute (the engine's time on the stage's requests, from the
manifests), training compute (the updates' seconds, from metrics.jsonl) or evaluation (none here:
EVAL_EVERY=0): process starts, model and engine builds, weight loading and reloading, saves, rollout columns,
the grading of a stage's last shard, waiting on files. Its parts:
- process-per-phase: each generate phase beyond its generation compute (Python and vLLM start-up, the engine
  build, grading the last shard), each optimize phase's load (imports, model build and load, the train state)
  and save (policy, train state), and the rest of each optimize phase (its Python start, rollout columns);
- resident: the two processes' start-up (the slower one; once), the hand-off (files: the trainer's saves of the
  policy to the hand-off directory and the engines' reloads from it; transfer: the trainer's send, during which
  the engines load each chunk), the train state's saves every SAVE_EVERY stages, the rest of each process's
  per-stage work beyond compute, and the hand-off latency (time neither process worked).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import records  # noqa: E402

# ----------------------------------------------------------------------------- hyperparameters
stages = 32                     # stages of each run
updates = 2                     # μ (updates per stage)
prompts_per_update = 16         # × G=8 responses
modes = "phases,transfer,files" # which loops to run: phases (process-per-phase), transfer, files (resident, by HANDOFF)
toy_dir = str(ROOT / "data" / "toy")   # the toy task and policy (built by data/toy.py if missing)
out_dir = str(ROOT / "bench" / "out" / "switching")
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])


def measure(run):
    """Wall, compute and overhead parts (seconds) of a finished run directory."""
    records_of = records.load_run(run)      # the timeline, the manifests and metrics, read once
    timeline = records_of["timeline"]
    timing = [json.loads(p.read_text()) for _, d in records.stage_dirs(run)
              if (p := d / "optimize_timing.json").exists()]
    wall = records.time_split(records_of)["wall"]       # the run's wall-clock, pauses out
    generation = sum(m["generation_seconds"] for m in records_of["manifests"].values())
    training = sum(m["seconds"] for m in records_of["metrics"])
    parts = {}
    if any(t["phase"] == "resident" for t in timeline):
        proc = [t for t in timeline if "process" in t]
        resident = records.resident_parts({"timeline": timeline})
        parts["start-up (once)"], parts["save"] = resident["start-up"], resident["save"]
        engine_rows = sum(t["seconds"] for t in proc if t["phase"] == "generate")
        trainer_rows = sum(t["seconds"] for t in proc if t["phase"] == "optimize")
        send = sum(t.get("handoff_seconds", 0.0) for t in proc if t["phase"] == "optimize")
        if send:      # transfer: the engines load while the trainer sends, before their stage's row starts
            parts["send (engines loading)"] = send
            parts["engine, beyond generation"] = engine_rows - generation
        else:
            parts["reload"] = resident["reload"]
            parts["engine, beyond generation"] = engine_rows - parts["reload"] - generation
        parts["trainer, beyond training"] = trainer_rows - parts["save"] - send - training
        parts["hand-off latency"] = wall - parts["start-up (once)"] - engine_rows - trainer_rows
    else:
        phase = lambda kind: sum(t["seconds"] for t in timeline if t["phase"] == kind)  # noqa: E731
        load, save = sum(t["load_seconds"] for t in timing), sum(t["save_seconds"] for t in timing)
        parts["generate, beyond generation"] = phase("generate") - generation
        parts["optimize load"] = load
        parts["optimize save"] = save
        parts["optimize, the rest"] = phase("optimize") - load - save - training
    return {"wall": wall, "generation": generation, "training": training,
            "overhead": wall - generation - training, "parts": parts}


def same_runs(one, two):
    """Two loops' outputs, compared: the final policy's tensors (torch.equal) and every stage's rollout shards
    (the same rows once each run's own directory is taken out of them). Returns (same weights, same rollouts)."""
    import torch  # torch: only to compare the two runs' weights
    from safetensors.torch import load_file
    last = records.stage_dir("", stages - 1) / records.POLICY / "model.safetensors"
    w1, w2 = load_file(one / last), load_file(two / last)
    same_weights = w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)

    def rows(path, run):
        return [json.loads(line.replace(str(run), "RUN")) for line in path.read_text().splitlines()]
    shards = sorted(p.relative_to(one) for _, d in records.stage_dirs(one)
                    for p in (d / records.ROLLOUTS).glob("shard_*.jsonl"))
    same_rollouts = len(shards) >= stages and all(
        (two / p).exists() and rows(one / p, one) == rows(two / p, two) for p in shards)
    return same_weights, same_rollouts


def run_mode(mode, out):
    env = {**os.environ, "PRESET": "toy", "LOSS": "grpo", "RUN": str(out), "MODEL": f"{toy_dir}/model",
           "TRAIN_DATA": f"{toy_dir}/train.jsonl", "EVAL_DATA_DIR": toy_dir, "STAGES": str(stages),
           "UPDATES_PER_STAGE": str(updates), "PROMPTS_PER_UPDATE": str(prompts_per_update), "EVAL_EVERY": "0",
           "RESIDENT": "false" if mode == "phases" else "true", "HANDOFF": "files" if mode == "files" else "transfer"}
    subprocess.run(["rm", "-rf", str(out)], check=True)
    proc = subprocess.run(["bash", "run_stages.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: run_stages.sh failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


if __name__ == "__main__":
    if not (Path(toy_dir) / "model" / "config.json").exists():
        subprocess.run([sys.executable, "data/toy.py", f"--out_dir={toy_dir}"], cwd=ROOT, check=True)
    results = {}
    for mode in modes.split(","):
        out = Path(out_dir) / mode
        run_mode(mode, out)
        results[mode] = measure(out)
    print(f"toy, LOSS=grpo, {stages} stages × {updates} updates × {prompts_per_update} prompts × G=8, EVAL_EVERY=0; "
          f"{os.cpu_count()} CPUs")
    print("| mode | wall s | generation s | training s | overhead s | overhead per stage s |")
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['wall']:.0f} | {r['generation']:.0f} | {r['training']:.0f} | {r['overhead']:.0f} | "
              f"{r['overhead'] / stages:.2f} |")
    for mode, r in results.items():
        print(f"\n{mode}: " + "; ".join(f"{k} {v:.1f} s ({v / stages:.2f} s/stage)" for k, v in r["parts"].items()))
    ran = list(results)
    for i, one in enumerate(ran):
        for two in ran[i + 1:]:
            ratio = results[one]["overhead"] / max(results[two]["overhead"], 1e-9)
            same_weights, same_rollouts = same_runs(Path(out_dir) / one, Path(out_dir) / two)
            print(f"\n{one} vs {two}: overhead per stage {results[one]['overhead'] / stages:.2f} s vs "
                  f"{results[two]['overhead'] / stages:.2f} s ({ratio:.2f}×); final weights bit-identical "
                  f"{same_weights}, rollouts of all {stages} stages identical {same_rollouts}")
    print(json.dumps({m: {k: v for k, v in r.items()} for m, r in results.items()}))
