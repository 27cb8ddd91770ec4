"""The whole loop (run_stages.sh) on the toy task; evaluate.py and tools/plot.py; data/prepare.py."""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import (ROOT, SHARED_DATA, TOY_SIZE, built_once, clone_repository, kill_when, needs_vllm, read_lines,
                      run_script)


def loop_env(toy, run_dir):
    return {"PRESET": "toy", "RUN": str(run_dir), "MODEL": str(toy / "model"), "TRAIN_DATA": str(toy / "train.jsonl"),
            "EVAL_DATA_DIR": str(toy), "BENCHMARKS": "test", "STAGES": "2", "UPDATES_PER_STAGE": "6",
            "PROMPTS_PER_UPDATE": "16", "LR": "5e-4", "MAX_RESPONSE": "12", "EVAL_K": "4"}


def read_log(path):
    return path.read_text(errors="replace") if path.exists() else ""


def run_loop(env):
    proc = subprocess.run(["bash", "run_stages.sh"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="session")
def finished_run(toy, tmp_path_factory):
    def build(out):
        proc = run_loop(loop_env(toy, out / "run"))
        (out / "run" / "terminal.txt").write_text(proc.stdout + proc.stderr)     # what the terminal showed
    return built_once(tmp_path_factory, "loop", build) / "run"


@pytest.mark.slow
@needs_vllm
def test_toy_loop_end_to_end(finished_run):
    results = read_lines(finished_run / "results.jsonl")
    acc = {r["stage"]: r["avg_at_k"] for r in results}
    assert sorted(acc) == [-1, 0, 1]
    assert acc[1] > acc[-1], acc
    for s in (0, 1):
        stage = finished_run / f"stage_{s}"
        assert json.loads((stage / "rollouts" / "manifest.json").read_text())["complete"]
        assert (stage / "policy" / "model.safetensors").exists()
        assert [m["update"] for m in read_lines(stage / "metrics.jsonl")] == list(range(6))
    attempt, *rows = read_lines(finished_run / "timeline.jsonl")      # the attempt's start (records.pauses), then
    assert (attempt["phase"], attempt["seconds"]) == ("attempt", 0) and attempt["start"] <= rows[0]["start"]  # phases
    phases = [t["name"] for t in rows if "process" not in t]
    assert phases == ["generate_0", "optimize_0", "generate_1", "optimize_1", "eval_1"]
    assert all((finished_run / "logs" / f"{p}.log").exists() for p in phases)
    # a stage's engines evaluate the policy they generate with first (the last policy: evaluate.py, eval_1): its row
    # is a part of the generate phase's, counted once in the run's evaluation and not again in its wall-clock
    parts = {t["name"]: t for t in rows if "process" in t}
    assert {name: t["process"] for name, t in parts.items()} == {"eval_-1": "generate", "eval_0": "generate"}
    for name, s in (("eval_-1", 0), ("eval_0", 1)):
        generate = next(t for t in rows if t["name"] == f"generate_{s}")
        assert generate["start"] < parts[name]["start"] < parts[name]["end"] < generate["end"]
    from mu_grpo import records
    split = records.time_split(records.load_run(finished_run))
    assert split["evaluation"] == pytest.approx(sum(t["seconds"] for t in rows if t["phase"] == "eval"))
    top = [t for t in rows if "process" not in t]
    assert split["wall"] == pytest.approx(top[-1]["end"] - top[0]["start"])
    assert split["switching"] == pytest.approx(sum(t["seconds"] for t in top) - split["evaluation"]
                                               - split["generation"] - split["training"])
    samples = read_lines(finished_run / "eval_samples" / "stage_1" / "test.jsonl")
    assert len(samples) == 4 * results[-1]["problems"]
    from mu_grpo import engine
    assert not engine.link_dir(finished_run).exists()          # the run's engine link went with it (mu_grpo/launch.py end)


@pytest.mark.slow
@needs_vllm
def test_the_terminal_shows_the_phases_without_library_chatter(finished_run):
    # each phase's log keeps everything; the terminal keeps our lines and progress bars, not vLLM's warnings
    terminal = (finished_run / "terminal.txt").read_text()
    log = (finished_run / "logs" / "generate_0.log").read_text()
    assert "WARNING" in log and "[cpu_worker.py" in log
    assert "[cpu_worker.py" not in terminal and " WARNING " not in terminal
    assert "[generate_0]" in terminal and "stage 0 rollouts:" in terminal and "stage 1 updates:" in terminal
    assert "test: avg@4" in terminal
    # the second stage's line: the first stage's KL to its rollouts over its (6 < 16) updates, from its metrics rows
    kl = [r["ratio/kl"] for r in read_lines(finished_run / "stage_0" / "metrics.jsonl")]
    assert f"[stage 1] update 6 of 12 · KL to its rollouts over stage 0's last 6 updates {sum(kl) / 6:.4f}" in terminal


@pytest.mark.slow
@needs_vllm
def test_a_killed_resident_run_goes_on_per_phase_to_more_stages_training_nothing_again(toy, finished_run, tmp_path):
    # a resident run killed once stage 0 is trained, rerun with one more stage and per phase. Before, the rerun took
    # it for a run that finished nothing (resident mode writes no phase markers) and cleared both trained stages; and
    # a resident run resumed per phase trained stage 0 again from MODEL
    from safetensors.torch import load_file
    run = tmp_path / "run"
    env = {**loop_env(toy, run), "RESIDENT": "true"}
    assert kill_when(["bash", "run_stages.sh"], lambda: (run / "stage_0" / "stage_end.json").exists() and (
        run / "stage_0" / "policy" / "policy_id.json").exists(), env=env)
    kept = finished_digest(run)
    # the silent mix of the past (stage 0 at one lr, later stages at another) is refused, and nothing is written
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    proc = subprocess.run(["bash", "run_stages.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env, "STAGES": "3", "LR": "1e-3"})
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert f"RUN={run} was run with other settings: LR 5e-4 → 1e-3. It holds finished work (stage 0's rollouts, " \
           f"stage 0's training" in proc.stderr and "Traceback" not in proc.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    # its settings, one stage more, per phase: it goes on from stage 0's train state
    proc = run_loop({**env, "RESIDENT": "false", "STAGES": "3"})
    assert "[generate_0] done already" in proc.stdout and "[optimize_0] done already" in proc.stdout, proc.stdout
    assert f"[run] {run} goes on to STAGES=3" in proc.stdout and "cleared" not in proc.stdout
    final = finished_digest(run)
    assert kept and all(final[name] == what for name, what in kept.items()), [k for k in kept if final[k] != kept[k]]
    assert_trained_once(run, 3, 6, 16)
    for s in (0, 1):       # the run that had 2 stages from the start, trained per phase: the same weights, bit for bit
        mine, theirs = (load_file(str(d / f"stage_{s}" / "policy" / "model.safetensors")) for d in (run, finished_run))
        assert all(mine[k].equal(theirs[k]) for k in theirs), s
    metrics = read_lines(run / "stage_2" / "metrics.jsonl")
    assert [m["run_update"] for m in metrics] == list(range(12, 18)) and metrics[0]["optimizer_update"] == 12
    assert sorted({r["stage"] for r in read_lines(run / "results.jsonl")}) == [-1, 0, 1, 2]
    assert json.loads((run / "run_settings.json").read_text())["knobs"]["STAGES"] == "3"
    assert "nothing to do" in run_loop({**env, "STAGES": "3"}).stdout


@pytest.mark.slow
@needs_vllm
def test_finished_run_rerun_does_nothing(toy, finished_run):
    before = (finished_run / "results.jsonl").read_text()
    proc = run_loop(loop_env(toy, finished_run))
    assert "nothing to do" in proc.stdout
    assert (finished_run / "results.jsonl").read_text() == before


# ----------------------------------------------------------------------------- the box's shape on the CPU

# a 4×H200 box's control flow: vLLM engines in child processes (one per GPU there), FSDP2 over torchrun ranks (gloo
# here). Its preflight at this shape: tests/test_preflight.py (mu_grpo/preflight.py itself, resident), test_launch.py (the
# flags run_stages.sh gives it) and test_frontier.py (run_stages.sh running it); not here, where it would add ~4 minutes
BOX = {"ENGINES": "2", "TRAIN_RANKS": "2"}


def processes_of(run_dir):
    """The processes still running for a run directory (an engine worker names it in its command line)."""
    import psutil
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(str(run_dir) in arg for arg in p.info["cmdline"] or []):
            found.append(" ".join(p.info["cmdline"]))
    return found


def assert_none_left(run_dir, timeout=60):
    """No process of the run outlives it (engine workers lead process groups of their own, outside run_stages.sh's:
    they end with their parent)."""
    deadline = time.time() + timeout
    while (left := processes_of(run_dir)) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, left


# ----------------------------------------------------------------------------- killed anywhere, in every mode
# The standard: a run SIGKILLed (run_stages.sh's whole process group) at points spread over its timeline, rerun until
# it finishes, ends with the uninterrupted run's weights and results rows; every stage trained exactly its planned
# prompts, each once (its metrics rows); nothing finished before a kill was generated, trained or evaluated again.
# One run per mode, shared by every assertion on it: box_run (per phase), resident_files_run (resident, files),
# resident_killed_run (resident, the transfer), each at the box's shape (two engines, two gloo ranks).

def finished_digest(run_dir):
    """What a run has finished, each with what a redo would change: {name: (file, bytes, mtime_ns)...} of every stage's
    complete rollouts (manifest and shards), every trained stage's policy record and weights, every results row."""
    from mu_grpo import records
    stamp = lambda p: (p.name, p.read_bytes(), p.stat().st_mtime_ns)  # noqa: E731
    found = {}
    for s, d in records.stage_dirs(run_dir):
        if records.rollouts_finished(run_dir, s):
            found[f"rollouts of stage {s}"] = [stamp(p) for p in sorted((d / "rollouts").glob("shard_*.jsonl"))] + \
                [stamp(d / "rollouts" / "manifest.json")]
        if s <= records.last_trained(run_dir) and (d / "policy" / "policy_id.json").exists():
            found[f"training of stage {s}"] = [stamp(d / "policy" / "policy_id.json"),
                                               (d / "policy" / "model.safetensors").stat().st_mtime_ns]
    for r in read_lines(run_dir / "results.jsonl") if (run_dir / "results.jsonl").exists() else []:
        found[f"evaluation of stage {r['stage']} on {r['benchmark']}"] = r
    return found


def killed_at_each(env, run_dir, points):
    """run_stages.sh SIGKILLed with everything under it once at each point (name, a condition on the run's files) in
    turn, each time from a rerun, then run to its end. Asserts after each kill that no process is left and that the
    kill came before the run's end; at the end that whatever was finished at a kill is untouched (finished_digest).
    Returns when each kill had been sent (Unix seconds), in order."""
    digests, killed = {}, []
    for name, condition in points:
        assert kill_when(["bash", "run_stages.sh"], condition, env=env, timeout=600), f"the run ended before {name}"
        killed.append(time.time())
        assert not (run_dir / ".done" / "all").exists(), name
        assert_none_left(run_dir)
        digests[name] = finished_digest(run_dir)
    run_loop(env)
    final = finished_digest(run_dir)
    for name, digest in digests.items():
        redone = sorted(k for k, v in digest.items() if final.get(k) != v)
        assert not redone, f"finished before the kill {name}, done again after it: {redone}"
    return killed


def assert_trained_once(run_dir, stages, updates, prompts_per_update):
    """Every stage trained exactly its planned updates, each once, on its planned prompts, each once (metrics rows:
    the update index and the groups, the stage positions of its prompts)."""
    for s in range(stages):
        rows = read_lines(run_dir / f"stage_{s}" / "metrics.jsonl")
        assert [r["update"] for r in rows] == list(range(updates)), s
        groups = [g for r in rows for g in r["groups"]]
        assert len(groups) == updates * prompts_per_update and len(set(groups)) == len(groups), s


@pytest.fixture(scope="session")
def box_run(toy, tmp_path_factory):
    """The process-per-phase loop at the box's shape, killed anywhere (killed_at_each: in generation, between
    generation and training, mid-training after a mid-stage checkpoint, in the evaluation stage 1's engines make
    first, in the final evaluation, before the end marker), then run to its end; reporting to TensorBoard and W&B
    (offline) throughout (tests/test_tracking.py reads them back)."""
    return built_once(tmp_path_factory, "box", lambda out: killed_in_each_phase(toy, out / "run")) / "run"


def killed_in_each_phase(toy, run_dir):
    env = {**loop_env(toy, run_dir), **BOX, "REPORT_TO": "tensorboard,wandb", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "TRACKER_GROUP": "box", "CHECKPOINT_EVERY": "2"}
    state = run_dir / "stage_1" / "train_state" / "progress.json"
    killed_at_each(env, run_dir, [
        ("in generation", lambda: (run_dir / "stage_0" / "rollouts" / "plan.json").exists()),
        ("between phases", lambda: (run_dir / "stage_0" / "rollouts" / "manifest.json").exists()),
        # the evaluation of stage 0's policy, which stage 1's engines make first (generate.py says so before they start)
        ("in evaluation", lambda: "the evaluation of stage 0 first" in read_log(run_dir / "logs" / "generate_1.log")),
        ("mid-training, after a mid-stage checkpoint",       # stage 1's state at update 2 or 4 of 6, not its final
         lambda: state.exists() and not json.loads(state.read_text() or "{}").get("complete", True)),
        ("in the final evaluation", lambda: (run_dir / "logs" / "eval_1.log").exists()),
        ("before the end marker", lambda: (run_dir / "logs" / "summary.log").exists())])
    assert_trained_once(run_dir, 2, 6, 16)


def assert_same_as_one_engine_one_rank(box, one, initial):
    """A run at the box's shape against the one-engine, one-process run: stage 0 (sampled from the same initial
    policy) byte-identical, later stages' rollouts the same responses (their log-probs differ by the float noise
    of the policy, summed over two ranks in another order), the final weights within the cross-rank tolerance."""
    from test_optimize import assert_same_weights
    text = lambda run, s: "".join(p.read_text() for p in sorted((run / f"stage_{s}" / "rollouts").glob(  # noqa: E731
        "shard_*.jsonl"))).replace(str(run), "RUN")
    assert text(box, 0) == text(one, 0)
    rows = lambda run: [json.loads(x) for x in text(run, 1).splitlines()]  # noqa: E731
    pairs = list(zip(rows(box), rows(one)))
    assert len(pairs) == 16 * 6 * 8
    same = [a for a, b in pairs if a["response_token_ids"] == b["response_token_ids"]]
    assert len(same) >= 0.99 * len(pairs)         # a near-tie at 1e-6 may flip a sampled token, rarely
    assert max(abs(x - y) for a, b in pairs if a["response_token_ids"] == b["response_token_ids"]
               for x, y in zip(a["behavior_logprobs"], b["behavior_logprobs"])) < 1e-5
    assert_same_weights(initial, one / "stage_1" / "policy", box / "stage_1" / "policy")
    for s in (0, 1):
        manifest = json.loads((box / f"stage_{s}" / "rollouts" / "manifest.json").read_text())
        assert manifest["engines_ran"] == 2 and manifest["plan"]["shards"] == 2
        assert json.loads((box / f"stage_{s}" / "optimize_timing.json").read_text())["world"] == 2


@pytest.mark.slow
@needs_vllm
def test_box_shape_killed_in_each_phase_ends_where_one_engine_and_one_rank_do(toy, box_run, finished_run):
    assert_same_as_one_engine_one_rank(box_run, finished_run, toy / "model")
    assert {r["engines"] for r in read_lines(box_run / "results.jsonl")} == {2}


@pytest.mark.slow
@needs_vllm
def test_a_run_killed_in_every_phase_and_resumed_continues_the_same_tracker_runs_without_duplicated_steps(box_run):
    # box_run (above): 2 stages × 6 updates at the box's shape with REPORT_TO=tensorboard,wandb, SIGKILLed
    # in generation, in optimization (after its first metrics line) and in evaluation, then run to its end
    from test_tracking import steps_of, tensorboard_scalars, wandb_history
    recorded = [r["run_update"] for s in (0, 1) for r in read_lines(box_run / f"stage_{s}" / "metrics.jsonl")]
    assert recorded == list(range(12))
    scalars = tensorboard_scalars(box_run)
    for tag in ("train/loss/policy", "train/ratio/mean_neg_adv", "train/clip/upper_frac", "train/nav/vetoed_frac",
                "train/ratio/kl", "train/grad_norm", "train/lr", "train/entropy", "train/staleness",
                "train/tokens_per_s", "train/wall_hours"):
        assert scalars[tag] == recorded, tag                       # every update once, at its recorded run update
    for tag in ("rollout/mean_reward", "rollout/mean_response_tokens", "rollout/truncation_rate",
                "rollout/frac_groups_zero_variance", "rollout/wall_tokens_per_s"):
        assert scalars[tag] == [0, 6], tag
    assert scalars["eval/test/avg_at_4"] == scalars["eval/test/pass_at_4"] == [0, 6, 12]   # initial, then each stage's
    # generate_0 was killed once its rollouts were whole, before run_stages.sh wrote its row: finished, it is not run
    # again, and its time is lost with the kill, as a killed phase's is (records.pauses)
    assert scalars["time/optimize_seconds"] == [6, 12] and scalars["time/generate_seconds"] in ([6], [0, 6])
    history, runs = wandb_history(box_run)
    assert steps_of(history, "train/loss/policy") == recorded
    assert steps_of(history, "eval/test/avg_at_4") == [0, 6, 12] and steps_of(history, "rollout/mean_reward") == [0, 6]
    assert len(runs) >= 2 and len({run_id for run_id, _, _ in runs}) == 1     # every rerun resumed the same W&B run
    assert runs[0][2]["run_stages"]["LOSS"] == "mu-grpo" and {g for _, g, _ in runs} == {"box"}


# ----------------------------------------------------------------------------- several nodes, on localhost


def free_port_pair():
    """A port whose next one is free too (the nodes' store, torchrun's rendezvous)."""
    import socket
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise AssertionError("no two free ports in a row")


def start_node(env, rank, cwd=ROOT):
    return subprocess.Popen(["bash", "run_stages.sh"], cwd=cwd, env={**os.environ, **env, "NODE_RANK": str(rank)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def two_nodes_env(toy, run_dir):
    return {**loop_env(toy, run_dir), "NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_pair())}


def cold_clone(tmp_path):
    """A clone with no data built, whose toy builder makes the tests' toy (TOY_SIZE) where the preset's is larger: the
    policy box_run starts from, built by node 0 itself."""
    clone = clone_repository(tmp_path / "clone")
    assert not (clone / "data" / "toy").exists()
    builder = clone / "data" / "toy.py"
    text = builder.read_text()
    for name, value in TOY_SIZE.items():
        text, n = re.subn(rf"^{name} = \S+", f"{name} = {value}", text, flags=re.M)
        assert n == 1, name
    builder.write_text(text)
    return clone


@pytest.mark.slow
@needs_vllm
def test_two_localhost_nodes_from_a_cold_start_end_where_one_node_does_and_a_dead_node_stops_the_other(
        toy, tmp_path, request):
    # two run_stages.sh "nodes" (NNODES=2), one engine and one trainer rank each, started as the README's Slurm line
    # starts them: from a clone with no data built (node 0 builds the toy task and policy), node 1 first, with the
    # preset's MODEL and data paths. Before: node 1 took data/toy/model for a hub name and ended, its watch stayed,
    # and node 0 waited JOIN_TIMEOUT. Against box_run's first stage: one node with two engines and two ranks (the same
    # shards to the same engine indices, the same ranks' minibatches). One stage: every phase of a stage runs on both
    # nodes, before and after the resume; a second stage would repeat them (about 2 CPU-minutes)
    clone, run_dir = cold_clone(tmp_path), tmp_path / "run"
    env = {k: v for k, v in two_nodes_env(toy, run_dir).items() if k not in ("MODEL", "TRAIN_DATA", "EVAL_DATA_DIR")}
    env["STAGES"] = "1"
    env["JOIN_TIMEOUT"] = "300"
    node1 = start_node(env, 1, clone)
    deadline = time.time() + 300             # node 1 waits for node 0, its watch started (it writes stderr.log)
    while not (run_dir / "logs" / "node1" / "stderr.log").exists() and time.time() < deadline and node1.poll() is None:
        time.sleep(0.05)
    assert not (clone / "data" / "toy" / "model").exists()
    node0 = start_node(env, 0, clone)
    deadline = time.time() + 600             # node 1 dies, all of it, as the trainers start: node 0 then waits for it
    while not (run_dir / "stage_0" / "rollouts" / "manifest.json").exists() and time.time() < deadline \
            and node0.poll() is None:
        time.sleep(0.05)
    os.killpg(node1.pid, signal.SIGKILL)
    t0 = time.time()
    out, err = node0.communicate(timeout=300)
    took = time.time() - t0
    node1.communicate(timeout=60)
    assert node0.returncode != 0 and "[node 0] node 1 stopped answering" in err, err[-3000:]
    assert took < 10 + 5 + 15              # DEAD_AFTER, the grace before SIGKILL, a few beats and exits under load
    assert "2 nodes joined" in out and "2 trainer ranks on 2 nodes reached each other over gloo" in out, out[-3000:]
    from mu_grpo import records
    assert records.last_trained(run_dir) == -1          # stage 0 not trained: node 0 stopped with node 1
    assert_none_left(run_dir)
    from mu_grpo.nodes import fingerprint
    assert fingerprint(clone / "data" / "toy" / "model") == fingerprint(toy / "model")   # box_run's initial policy
    node1 = start_node(env, 1, clone)        # both rerun, node 1 first again: the run resumes
    node0 = start_node(env, 0, clone)
    outs = [node0.communicate(timeout=900), node1.communicate(timeout=900)]
    assert [node0.returncode, node1.returncode] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    assert "2 nodes joined" in outs[0][0] and "[generate_0] done already" in outs[1][0]
    box_run = request.getfixturevalue("box_run")    # asked for here: this test runs beside its build (conftest)
    text = lambda run, s: "".join(p.read_text() for p in sorted((run / f"stage_{s}" / "rollouts").glob(  # noqa: E731
        "shard_*.jsonl"))).replace(str(run), "RUN").replace(str(toy / "model"), "MODEL").replace(
        '"data/toy/model"', '"MODEL"')
    assert text(run_dir, 0) == text(box_run, 0) and not (run_dir / "stage_1").exists()
    manifest = json.loads((run_dir / "stage_0" / "rollouts" / "manifest.json").read_text())
    assert manifest["engines_ran"] == 2 and manifest["plan"]["shards"] == 2
    assert json.loads((run_dir / "stage_0" / "optimize_timing.json").read_text())["world"] == 2
    from test_optimize import assert_same_weights
    assert_same_weights(toy / "model", box_run / "stage_0" / "policy", run_dir / "stage_0" / "policy")
    rows = {r["stage"]: (r["avg_at_k"], r["engines"]) for r in read_lines(run_dir / "results.jsonl")}
    assert rows == {r["stage"]: (r["avg_at_k"], 2) for r in read_lines(box_run / "results.jsonl") if r["stage"] < 1}
    # node 0 alone keeps the run-level records (an attempt's start row at each of its starts); node 1's phase logs
    # are its own; the time from the first attempt's last record to the rerun is not the run's (records.pauses)
    timeline = read_lines(run_dir / "timeline.jsonl")
    assert [t["name"] for t in timeline] == ["attempt", "eval_-1", "generate_0", "attempt", "optimize_0", "eval_0"]
    assert timeline[1]["process"] == "generate"     # the initial policy's, by generate_0's engines, one per node
    from mu_grpo import records
    assert records.pauses({"timeline": timeline}) == [(timeline[2]["end"], timeline[3]["start"])]
    assert (run_dir / "logs" / "node1" / "eval_0.log").exists() and (run_dir / ".done" / "all").exists()


@pytest.mark.slow
def test_a_wrong_interface_stops_every_node_right_after_the_join_in_one_line(toy, tmp_path):
    # the trainers' network, checked as the nodes join (one all-reduce over the trainers' backend, gloo here), not
    # first used in optimize_0 after the initial evaluation and stage 0's generation (before: no such line, hours later
    # on the paper preset, and NCCL's failure there a hang on every node)
    run_dir = tmp_path / "run"
    env = {**two_nodes_env(toy, run_dir), "GLOO_SOCKET_IFNAME": "no-such-if0"}
    node1, node0 = start_node(env, 1), start_node(env, 0)
    outs = [node0.communicate(timeout=300), node1.communicate(timeout=300)]
    assert node0.returncode != 0 and node1.returncode != 0
    assert "2 nodes joined" in outs[0][0]
    for _, err in outs:
        assert ("the trainers' gloo process group across 2 nodes (2 ranks) failed" in err and
                "likely the wrong interface (GLOO_SOCKET_IFNAME=no-such-if0" in err), err[-3000:]
    assert not (run_dir / "results.jsonl").exists() and not list(run_dir.glob("stage_*"))


@pytest.mark.slow
def test_a_node_pointed_at_a_run_directory_the_other_cannot_see_is_refused_before_any_compute(toy, tmp_path):
    env = two_nodes_env(toy, tmp_path / "run")
    node0 = start_node(env, 0)
    node1 = start_node({**env, "RUN": str(tmp_path / "elsewhere")}, 1)
    outs = [node0.communicate(timeout=300), node1.communicate(timeout=300)]
    assert node0.returncode != 0 and node1.returncode != 0
    for _, err in outs:
        assert ("refused before any compute: node 1 (" in err and
                f"the run directory {tmp_path / 'elsewhere'} is not the one node 0 writes to" in err), err[-3000:]
    for run in (tmp_path / "run", tmp_path / "elsewhere"):
        assert not list(run.glob("stage_*")) and not (run / "results.jsonl").exists()


@pytest.mark.slow
@needs_vllm
def test_plot_renders_every_figure(finished_run, tmp_path):
    proc = run_script("tools/plot.py", f"--run_dir={finished_run}", f"--out_dir={tmp_path}", "--summary=true")
    names = {p.name for p in tmp_path.glob("*.png")}
    assert names == {"accuracy_vs_hours.png", "training_update.png", "nav_warning.png", "clip_fractions.png",
                     "mismatch_per_stage.png"}
    assert all((tmp_path / n).stat().st_size > 5000 for n in names)
    assert "switching overhead" in proc.stdout


@pytest.mark.slow
@needs_vllm
@pytest.mark.skipif(not SHARED_DATA.exists(), reason="../shared/data not present")
def test_evaluate_grades_real_benchmark_rows_and_writes_their_samples(toy, tmp_path):
    data = tmp_path / "bench"
    run_script("data/prepare.py", "--name=aime24", f"--input={SHARED_DATA / 'aime24' / 'aime24.jsonl'}",
               f"--out={data / 'aime24.jsonl'}")
    results = tmp_path / "results.jsonl"
    run_script("evaluate.py", f"--policy={toy / 'model'}", "--benchmarks=aime24", f"--data_dir={data}",
               "--max_problems=3", "--k=2", "--max_response_tokens=8", "--max_prompt_tokens=1024",
               "--prompt_template={problem}", f"--results={results}", "--stage=0", "--grader_workers=1")
    row = read_lines(results)[0]
    samples = read_lines(tmp_path / "eval_samples" / "stage_0" / "aime24.jsonl")
    by_problem = {}
    for s in samples:
        by_problem.setdefault(s["id"], []).append(s["reward"])
    assert row["problems"] == 3 and len(samples) == 6
    assert row["avg_at_k"] == pytest.approx(sum(sum(v) / 2 for v in by_problem.values()) / 3)
    assert row["pass_at_k"] == pytest.approx(sum(max(v) for v in by_problem.values()) / 3)


@pytest.mark.slow
def test_prepare_local_file_refuses_rows_without_answer(tmp_path):
    src = tmp_path / "raw.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [
        {"question": "1+1?", "answer": "#### 2"}, {"problem": "no answer here"},
        {"problem": "p", "solution": "so \\boxed{\\frac12}"}, {"problem": "q", "answer": 27.0}]) + "\n")
    proc = run_script("data/prepare.py", "--name=mine", f"--input={src}", f"--out={tmp_path / 'out.jsonl'}")
    assert "refused 1 rows without an answer" in proc.stdout
    rows = read_lines(tmp_path / "out.jsonl")
    assert [r["answer"] for r in rows] == ["2", "\\frac12", "27"]
    assert all(set(r) == {"id", "problem", "answer", "source"} for r in rows)


def test_prepare_records_where_each_file_came_from(tmp_path, monkeypatch):
    # the hub path of prepare() (datasets.load_dataset) on a local dataset directory; the commit that a
    # rebuild asks for is the one recorded beside the file
    import hashlib
    sys.path.insert(0, str(ROOT / "data"))
    import prepare as P
    hub = tmp_path / "hub_dataset"
    hub.mkdir()
    (hub / "test.jsonl").write_text(json.dumps({"problem": "2+2?", "answer": "4"}) + "\n")
    out = tmp_path / "out" / "mini.jsonl"
    assert P.prepare("mini", out, sources={"mini": (str(hub), None, "test")}) == (1, 0)
    record = json.loads(P.source_record_path(out).read_text())
    assert record == {"name": "mini", "hub": str(hub), "config": None, "split": "test", "revision": None,
                      "rows": 1, "refused": 0}
    asked = []
    monkeypatch.setattr(P, "resolve_revision", lambda hub, revision: asked.append(revision) or None)
    P.source_record_path(out).write_text(json.dumps({**record, "revision": "a" * 40}))
    P.prepare("mini", out, sources={"mini": (str(hub), None, "test")})
    P.prepare("mini", out, revision="b" * 40, sources={"mini": (str(hub), None, "test")})
    assert asked == ["a" * 40, "b" * 40]
    src = tmp_path / "local.jsonl"
    src.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    P.prepare("local", tmp_path / "local_out.jsonl", input=src)
    record = json.loads(P.source_record_path(tmp_path / "local_out.jsonl").read_text())
    assert record["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_DATA.exists(), reason="../shared/data not present")
def test_prepare_keeps_the_shared_benchmark_files(tmp_path):
    src = SHARED_DATA / "math500" / "math500.jsonl"
    run_script("data/prepare.py", "--name=math500", f"--input={src}", f"--out={tmp_path / 'm.jsonl'}")
    assert read_lines(tmp_path / "m.jsonl") == read_lines(src)


@pytest.mark.slow
@needs_vllm
def test_toy_builder_model_loads_in_transformers_and_vllm(toy):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(toy / "model")
    tok = AutoTokenizer.from_pretrained(toy / "model")
    assert tok.padding_side == "left" and tok.eos_token == "</s>"
    code = ("from mu_grpo import engine; llm = engine.make_llm(%r, seed=0, max_model_len=64); "
            "print(len(llm.generate([{'prompt_token_ids': [1, 5, 6]}], use_tqdm=False)[0].outputs))" % str(toy / "model"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("1"), proc.stderr[-2000:]


@pytest.mark.slow
@needs_vllm
def test_notebook_cells_run_on_a_finished_run(finished_run, tmp_path, monkeypatch):
    nb = json.loads((ROOT / "notebooks" / "results.ipynb").read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["pytest"])
    monkeypatch.syspath_prepend(str(ROOT / "tools"))    # the frontier cell's tools/frontier.py (no frontier here)
    namespace = {}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            code = "".join(cell["source"]).replace("RUNS = ['../runs/toy-mu-grpo']", f"RUNS = [{str(finished_run)!r}]")
            exec(compile(code, "results.ipynb", "exec"), namespace)
    assert len(namespace["runs"]) == 1 and len(namespace["metrics"]) == 12
    assert len(list((tmp_path / "plots_notebook").glob("*.png"))) == 5


@pytest.mark.slow
@needs_vllm
def test_evaluate_rows_are_keyed_by_stage_and_benchmark_and_engines_agree(toy, tmp_path):
    results = tmp_path / "results.jsonl"
    common = [f"--policy={toy / 'model'}", f"--data_dir={toy}", "--max_problems=6", "--k=2", "--max_response_tokens=8",
              "--prompt_template={problem}", f"--results={results}", "--stage=0", "--grader_workers=1"]
    run_script("evaluate.py", *common, "--benchmarks=test", "--engines=2")          # two data-parallel engines
    [two_engines] = read_lines(results)
    assert two_engines["engines"] == 2
    # another benchmark for the same stage, with its own k: the first row stays
    run_script("evaluate.py", *common, "--benchmarks=train,test", "--k_per_benchmark=train:3")
    rows = {r["benchmark"]: r for r in read_lines(results)}
    assert set(rows) == {"test", "train"} and rows["train"]["k"] == 3 and rows["test"]["k"] == 2
    assert len(read_lines(tmp_path / "eval_samples" / "stage_0" / "train.jsonl")) == 3 * 6
    # per-problem seeds: one engine samples what two did
    assert rows["test"]["avg_at_k"] == two_engines["avg_at_k"] and rows["test"]["engines"] == 1


@pytest.mark.parametrize("settings,message", [       # every rule of the table: tests/test_launch.py (fast)
    ({"STAGES": "abc"}, "STAGES must be a whole number, got 'abc'"),
    ({"LOSS": "ppo"}, "LOSS must be one of"),
])
@pytest.mark.slow
def test_bad_settings_fail_before_any_phase(toy, tmp_path, settings, message):
    env = {**loop_env(toy, tmp_path / "run"), **settings}
    proc = subprocess.run(["bash", "run_stages.sh"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "run" / "logs").exists()          # nothing ran


@pytest.mark.slow
def test_training_data_without_answers_fails_before_any_phase(toy, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "problem": "1+1?"}) + "\n")
    env = {**loop_env(toy, tmp_path / "run"), "TRAIN_DATA": str(bad)}
    proc = subprocess.run(["bash", "run_stages.sh"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)
    assert proc.returncode == 2 and "has no field 'answer'" in proc.stderr
    assert not (tmp_path / "run").exists()        # a refused new run leaves nothing (mu_grpo/launch.py end)


@pytest.mark.slow
def test_a_second_run_on_the_same_directory_is_refused(toy, tmp_path):
    import fcntl
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / ".lock", "w") as held:           # as a running run_stages.sh holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = subprocess.run(["bash", "run_stages.sh"], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, **loop_env(toy, run_dir)}, timeout=300)
    assert proc.returncode == 1 and "another run_stages.sh is running" in proc.stderr


def lockless_flock(tmp_path):
    """A `flock` as util-linux's behaves on a filesystem without lock support (Lustre without -o flock, some NFS):
    flock(2) fails with ENOLCK, it says so and exits EX_OSERR (71) (util-linux flock.c, the default case of its
    error switch); a PATH with it first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "flock").write_text('#!/bin/sh\nfd=""; for a in "$@"; do fd=$a; done\n'
                                   'echo "flock: $fd: No locks available" >&2\nexit 71\n')
    (bin_dir / "flock").chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


@pytest.mark.slow
@needs_vllm
def test_offpolicy_grpo_preset_with_kl_and_sparse_evaluation_in_resident_mode(toy, tmp_path):
    # the second seed's objective: clip [0.8, 1.2] and β·KL to the initial policy, whose model the resident trainer
    # keeps beside the policy; evaluation at the end only, and so the run directory gets the last stage's policy
    # and train state only (SAVE_EVERY defaults to EVAL_EVERY). Meanwhile the hand-off directory (MU_GRPO_SHM here)
    # never holds more than the two policies it is sized for (before: policy 2 was written beside 0 and 1)
    import threading
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    env = {**loop_env(toy, run_dir), "LOSS": "offpolicy-grpo", "UPDATES_PER_STAGE": "2", "STAGES": "3", "EVAL_EVERY": "3",
           "RESIDENT": "true", "HANDOFF": "files", "MU_GRPO_SHM": str(shm)}
    most, done = [], threading.Event()

    def watch():
        while not done.is_set():
            most.append(max((sum(p.name.startswith("policy_") for p in d.iterdir()) for d in shm.glob("mu-grpo-*")),
                            default=0))
            time.sleep(0.005)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run_loop(env)
    finally:
        done.set()
        watcher.join()
    assert max(most) == 2
    rows = read_lines(run_dir / "timeline.jsonl")
    assert [t["name"] for t in rows if "process" not in t] == ["resident"]
    assert [t["name"] for t in rows if t["phase"] == "eval"] == ["eval_-1", "eval_2"]
    for s in (0, 1, 2):
        metrics = read_lines(run_dir / f"stage_{s}" / "metrics.jsonl")
        assert all(m["kl/in_loss"] == 1 and m["kl/ref_mean"] >= 0 for m in metrics)
        assert [m["run_update"] for m in metrics] == [2 * s, 2 * s + 1]             # one run across stages
        timing = json.loads((run_dir / f"stage_{s}" / "optimize_timing.json").read_text())
        assert timing["ref_pass_seconds"] > 0 and timing["train_seconds"] > 0
    first = read_lines(run_dir / "stage_0" / "metrics.jsonl")[0]
    assert first["kl/ref_mean"] == pytest.approx(0, abs=1e-5)       # π = π_ref before the first update
    for s in (0, 1):
        assert not (run_dir / f"stage_{s}" / "train_state").exists() and not (run_dir / f"stage_{s}" / "policy").exists()
    assert (run_dir / "stage_2" / "train_state" / "progress.json").exists()
    assert (run_dir / "stage_2" / "policy" / "model.safetensors").exists()
    assert {r["stage"] for r in read_lines(run_dir / "results.jsonl")} == {-1, 2}
    assert not list(shm.iterdir())                                   # handed over, then cleared


def fake_nvidia_smi(tmp_path, gpus):
    """An nvidia-smi on PATH that lists GPUs the process cannot use (none are visible to torch here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    lines = "\\n".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i})" for i in range(gpus))
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{lines}\\n'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "MU_GRPO_DEVICE": "cpu"}


@pytest.mark.slow
def test_gpus_are_those_torch_can_use_and_the_paper_preset_needs_them(toy, tmp_path):
    # nvidia-smi lists 4 GPUs, torch sees none (CUDA_VISIBLE_DEVICES, MIG, or no CUDA build): auto picks the toy
    # preset, and the paper preset is refused in one line instead of starting ranks on devices that do not exist
    env = {**os.environ, **loop_env(toy, tmp_path / "run"), **fake_nvidia_smi(tmp_path, 4), "STAGES": "abc"}
    auto = subprocess.run(["bash", "run_stages.sh"], cwd=ROOT, capture_output=True, text=True, env={**env, "PRESET": "auto"},
                          timeout=300)
    assert "using the 'toy' preset (no GPU found)" in auto.stderr and auto.returncode == 2   # then STAGES=abc stops it
    paper = subprocess.run(["bash", "run_stages.sh"], cwd=ROOT, capture_output=True, text=True,
                           env={**env, "PRESET": "paper"}, timeout=300)
    assert paper.returncode == 2 and paper.stderr.strip().startswith("PRESET=paper needs GPUs")
    assert len(paper.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_model_that_cannot_be_fetched_is_one_line(toy, tmp_path):
    env = {**os.environ, **loop_env(toy, tmp_path / "run"), "MODEL": "no-such-org/no-such-model", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(["bash", "run_stages.sh"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    run_line, *said = proc.stderr.strip().splitlines()      # the settings check's line of the run, then the failure's
    assert run_line.startswith(f"run {tmp_path / 'run'}: toy preset") and len(said) == 1 and said[0].startswith("could not")
    assert "'no-such-org/no-such-model'" in proc.stderr and "MODEL=/path/to/model" in proc.stderr


@pytest.mark.slow
def test_setup_refuses_a_driver_older_than_the_wheels_cuda(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 550.54.15\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    proc = subprocess.run(["bash", "setup.sh", "gpu"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("setup.sh: NVIDIA driver 550.54.15 is too old: vllm==0.32.0 / torch==2.13.0 are built "
                                   "for CUDA 13.0, which needs driver >= 580.65.06; upgrade the driver first")


# ----------------------------------------------------------------------------- resident mode


@pytest.fixture(scope="session")
def resident_run(toy, tmp_path_factory):
    """The resident loop at the box's shape: the engine process coordinates two engine processes, the trainer runs
    on two ranks."""
    return built_once(tmp_path_factory, "resident", lambda out: run_loop(
        {**loop_env(toy, out / "run"), **BOX, "RESIDENT": "true"})) / "run"


@pytest.fixture(scope="session")
def resident_files_run(toy, tmp_path_factory):
    """resident_run with each policy handed over as files (HANDOFF=files) instead of vLLM's weight-transfer API, killed
    anywhere (killed_at_each: in generation, right after a hand-over, while the trainer trains stage 1 with the engines
    asleep, in the final evaluation), then run to its end; killed_at: when each kill had been sent."""
    def build(out):
        run_dir = out / "run"
        env = {**loop_env(toy, run_dir), **BOX, "RESIDENT": "true", "HANDOFF": "files"}
        handed = lambda s: (run_dir / "resident" / f"trained_{s}.json").exists()  # noqa: E731 (mu_grpo/handoff.py)
        killed = killed_at_each(env, run_dir, [
            ("in generation", lambda: (run_dir / "stage_0" / "rollouts" / "plan.json").exists()),
            ("right after a hand-over", lambda: handed(0) and (run_dir / "stage_0" / "policy").exists()),
            ("mid-training", lambda: (run_dir / "stage_1" / "metrics.jsonl").exists()),
            ("in the final evaluation", lambda: handed(1))])
        (out / "killed_at").write_text(json.dumps(killed))
        assert_trained_once(run_dir, 2, 6, 16)
    return built_once(tmp_path_factory, "resident_files", build) / "run"


def _rows_without_run_dir(path, run_dir):
    """A JSONL file's rows with the run directory taken out of every string (policy names contain it)."""
    return [json.loads(line.replace(str(run_dir), "RUN")) for line in open(path)]


def _weights(policy_dir):
    from safetensors.torch import load_file
    return load_file(str(policy_dir / "model.safetensors"))


def assert_same_stages(one, two, stages=(0, 1)):
    import torch
    for s in stages:
        w1, w2 = _weights(one / f"stage_{s}" / "policy"), _weights(two / f"stage_{s}" / "policy")
        assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1), s
        for shard in sorted((one / f"stage_{s}" / "rollouts").glob("shard_*.jsonl")):
            assert _rows_without_run_dir(shard, one) == _rows_without_run_dir(
                two / f"stage_{s}" / "rollouts" / shard.name, two), (s, shard.name)
        # timings and memory/ (bytes of storage the allocator holds, not a result) are measurements of the machine
        measured = lambda k: k in ("time", "seconds", "tokens_per_s") or k.startswith("memory/")  # noqa: E731
        m1, m2 = (read_lines(d / f"stage_{s}" / "metrics.jsonl") for d in (one, two))
        assert [{k: v for k, v in r.items() if not measured(k)} for r in m1] == \
               [{k: v for k, v in r.items() if not measured(k)} for r in m2], s
    key = lambda rows: sorted((r["stage"], r["benchmark"], r["avg_at_k"], r["pass_at_k"], r["updates"], r["policy"])  # noqa: E731
                              for r in rows)
    assert key(_rows_without_run_dir(one / "results.jsonl", one)) == key(_rows_without_run_dir(two / "results.jsonl", two))


@pytest.mark.slow
@needs_vllm
def test_resident_run_equals_the_process_per_phase_run(toy, box_run, resident_run, finished_run):
    # the same seeds, stages, settings and shape through two long-lived processes: the same rollouts (every engine
    # reloads each policy in place), the same weights (the trainer keeps them and AdamW in memory), the same
    # metrics and evaluations as the process-per-phase loop, bit for bit
    assert_same_stages(box_run, resident_run)
    assert_same_as_one_engine_one_rank(resident_run, finished_run, toy / "model")
    rows = read_lines(resident_run / "timeline.jsonl")
    assert [r["name"] for r in rows if "process" not in r] == ["resident"]
    assert [r["stage"] for r in rows if r["phase"] == "generate"] == [0, 1]
    engines = {(r["stage"], r["engine"]): r for r in rows if r["phase"] == "engine"}   # every engine's own rows
    assert sorted(engines) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert engines[1, 0]["reload_seconds"] > 0 and engines[1, 1]["reload_seconds"] > 0
    assert engines[0, 0]["start_seconds"] > 0 and engines[0, 1]["start_seconds"] > 0
    trainer = [r for r in rows if r["phase"] == "optimize"]
    assert [r["gradient_bytes_kept"] for r in trainer] == [0, 0]       # freed before the engines wake
    assert [r["reserved_gib_per_rank"] for r in trainer] == [[None, None]] * 2    # each rank's allocator; no GPU here
    assert {r["name"] for r in rows if r["phase"] == "eval"} == {"eval_-1", "eval_0", "eval_1"}
    assert not (resident_run / "stage_0" / "train_state").exists()          # released once stage 1's was written
    assert (resident_run / "stage_1" / "train_state" / "progress.json").exists()
    from mu_grpo import handoff
    assert not any(d.exists() for d in handoff.policy_locations(resident_run))   # no policy went through files
    assert not handoff.transfer_buffers(resident_run)                         # the transfer's buffers are gone
    assert "policies are handed over through vLLM's weight-transfer API (mu-grpo-shm, 2 engine(s))" in (
        resident_run / "logs" / "trainer.log").read_text()
    # every hand-off: its seconds and rate in the trainer's rows, each engine's seconds and bytes in its own
    assert all(r["handoff"] == "transfer" and r["handoff_seconds"] > 0 and r["handoff_gb_per_s"] > 0 for r in trainer)
    assert all(engines[1, e]["handoff_bytes"] == engines[1, 1 - e]["handoff_bytes"] > 0 for e in (0, 1))
    summary = run_script("tools/plot.py", f"--run_dir={resident_run}", "--summary=true", f"--out_dir={resident_run / 'p'}")
    assert "resident processes: start-up" in summary.stdout


@pytest.mark.slow
@needs_vllm
def test_the_transfer_hand_off_gives_the_run_of_the_file_hand_off(resident_files_run, resident_run):
    # at the box's shape: the same rollouts, weights, metrics and evaluations whether each policy reaches the two
    # engines through vLLM's weight-transfer API (our shared-memory transport: two ranks' buffers) or as files (a run
    # killed while training stage 1 and resumed: it ends where the unbroken run does)
    assert_same_stages(resident_run, resident_files_run)
    logs = (resident_files_run / "logs" / "engine.log").read_text()
    assert "as it handed it over" not in logs and "as it handed it over" in (resident_run / "logs" / "engine.log").read_text()
    from mu_grpo import handoff
    assert not any(d.exists() for d in handoff.policy_locations(resident_files_run))   # cleared at the run's end


def assert_no_training_beside_an_awake_engine(run_dir):
    """Resident mode takes turns on each GPU: no trainer row (optimize_<s>) lies inside a span where an engine is awake:
    an engine's stage row (from the policy's arrival to its sleep), and from an engine's start to its first sleep (its
    start row's end when it slept at once, "asleep"; else its first stage's row's end, within the same attempt)."""
    rows = read_lines(run_dir / "timeline.jsonl")
    starts = sorted((r for r in rows if r["name"] == "engine_start"), key=lambda r: r["start"])
    stages = sorted((r for r in rows if r["phase"] == "engine"), key=lambda r: r["start"])
    spans = [(r["start"], r["end"]) for r in stages]
    for e, after in zip(starts, [*starts[1:], None]):
        until = after["start"] if after else math.inf             # the attempt's end
        first = next((r for r in stages if e["start"] <= r["start"] < until), None)
        spans.append((e["start"], e["end"] if e.get("asleep") else first["end"] if first else until))
    inside = [(t["name"], t["start"], t["end"], span) for t in rows if t["phase"] == "optimize"
              for span in spans if span[0] <= t["start"] and t["end"] <= span[1]]
    assert not inside, f"trainer rows inside an awake engine's span: {inside}"


@pytest.mark.slow
@needs_vllm
def test_a_resident_run_with_files_killed_while_training_resumes_with_its_engines_asleep(resident_files_run):
    # resident_files_run, killed while its trainer trained stage 1: the rerun's trainer trains stage 1 again before the
    # engines' first stage (2, the final evaluation), so with HANDOFF=files the engines start only once its policy is
    # there (test_the_transfer_hand_off_gives_the_run_of_the_file_hand_off: it ends where an unbroken run does; with
    # the transfer, which starts the engines at once: test_resident_run_killed_anywhere_resumes_to_the_same_weights)
    assert_no_training_beside_an_awake_engine(resident_files_run)
    rows = read_lines(resident_files_run / "timeline.jsonl")
    # the attempt killed while training stage 1 wrote no row of it, the rerun trained it again;
    # the one killed right after stage 0's hand-over may have left no row of that, and the one
    # killed in the final evaluation none of stage 1's (the trainer writes a stage's row once its
    # policy is handed over: the kill at trained_1.json can come before it; the metrics hold that
    # stage 1 was trained once, assert_trained_once)
    trained = [t["name"] for t in rows if t["phase"] == "optimize"]
    assert trained in (["optimize_0", "optimize_1"], ["optimize_1"], ["optimize_0"], [])
    attempts = sorted((r for r in rows if r["name"] == "resident"), key=lambda r: r["start"])
    assert [r["ended"] for r in attempts] == ["killed"] * 4 + ["completed"]
    # each attempt killed outright is closed by the rerun at its own last row, before its kill: the wait is a pause
    killed_at = json.loads((resident_files_run.parent / "killed_at").read_text())
    assert all(r["end"] <= t for r, t in zip(attempts, killed_at)), (attempts, killed_at)


@pytest.mark.slow
@needs_vllm
def test_resident_run_killed_anywhere_resumes_to_the_same_weights(toy, resident_run, tmp_path):
    # the transfer at the box's shape: SIGKILL to the engine process, then to the trainer, each at a random moment (a
    # partner's death stops the run within seconds); then run_stages.sh and everything under it killed at once
    # (killed_at_each) mid-training after a mid-stage checkpoint, after the last hand-over (in the final evaluation:
    # before, a rerun there stopped every time, its trainer having nothing to train), before the end marker. The run
    # ends where an unbroken one did
    import random
    from mu_grpo import handoff
    run_dir = tmp_path / "run"
    run_env = {**loop_env(toy, run_dir), **BOX, "RESIDENT": "true", "CHECKPOINT_EVERY": "2"}
    env = {**os.environ, **run_env}
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    pid = lambda role: json.loads((run_dir / "resident" / f"{role}.json").read_text())["pid"]  # noqa: E731
    points = [("engine", lambda: (run_dir / "stage_0" / "rollouts" / "manifest.json").exists()),
              ("trainer", lambda: (run_dir / "stage_0" / "metrics.jsonl").exists())]
    for target, ready in points:
        shutil.rmtree(run_dir / "resident", ignore_errors=True)     # the last attempt's pid files name dead processes
        proc = subprocess.Popen(["bash", "run_stages.sh"], cwd=ROOT, env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 600
        while not (ready() and (run_dir / "resident" / "engine.json").exists()
                   and (run_dir / "resident" / "trainer.json").exists()) and proc.poll() is None:
            assert time.time() < deadline, (target, seed)
            time.sleep(0.05)
        if proc.poll() is None:
            time.sleep(rng.uniform(0, 3))
        if proc.poll() is not None:              # the run finished first: nothing was interrupted this time
            assert proc.returncode == 0, (target, seed)
            continue
        killed_at = time.time()
        os.kill(pid(target), signal.SIGKILL)
        proc.wait(timeout=300)
        # within a poll and the other process's shutdown (seconds; about 40 s on 2 cores shared with another run),
        # not the START_GRACE_S (600 s) a partner that never announced itself gets, nor a hang
        assert time.time() - killed_at < handoff.START_GRACE_S / 5, (target, seed)
        assert_none_left(run_dir)            # no engine process outlives the run (engine: its workers end with it)
        assert proc.returncode != 0, (target, seed)
        # the failed run leaves no handed-over policy behind (up to two, 15 GB each at 7B, in /dev/shm)
        assert not any(d.exists() for d in handoff.policy_locations(run_dir)), (target, seed)
        assert not handoff.transfer_buffers(run_dir), (target, seed)
    state = run_dir / "stage_1" / "train_state" / "progress.json"
    killed_at_each(run_env, run_dir, [
        ("mid-training, after a mid-stage checkpoint",
         lambda: state.exists() and not json.loads(state.read_text() or "{}").get("complete", True)),
        ("after the last hand-over", lambda: (run_dir / "resident" / "trained_1.json").exists()),
        ("before the end marker", lambda: (run_dir / "logs" / "summary.log").exists())])
    assert_same_stages(resident_run, run_dir)
    assert_trained_once(run_dir, 2, 6, 16)
    assert_no_training_beside_an_awake_engine(run_dir)


@pytest.mark.slow
@needs_vllm
def test_ctrl_c_stops_the_run_in_one_line_saying_how_it_resumes(toy, tmp_path):
    # Ctrl-C: the terminal sends SIGINT to the whole foreground group (the script, the phase, its terminal view)
    run = tmp_path / "run"
    proc = subprocess.Popen(["bash", "run_stages.sh"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, **loop_env(toy, run), "STAGES": "1"})
    deadline = time.time() + 600
    while "stage 0 prompts" not in read_log(run / "logs" / "generate_0.log"):     # the stage's generation under way
        assert time.time() < deadline and proc.poll() is None, "the run never reached its generation"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == f"[run] stopped: rerun the same command to resume {run} where it stopped"
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err


@pytest.mark.slow
@needs_vllm
def test_each_knob_is_read_from_its_one_home_a_scripts_block_a_preset_a_loss_preset_or_the_environment(toy, tmp_path):
    # in a clone, one knob edited in each kind of home, then one run; each value read back where its phase records it.
    # Before, run_stages.sh passed WARMUP, TEMPERATURE and the evaluation protocol as flags from the presets, so an
    # edit of optimize.py's, generate.py's or evaluate.py's block changed nothing in a run
    clone = clone_repository(tmp_path / "clone")

    def edit(name, old, new):
        path = clone / name
        text = path.read_text()
        assert text.count(old) == 1, (name, old)
        path.write_text(text.replace(old, new))
    edit("optimize.py", "\nwarmup_updates = 0 ", "\nwarmup_updates = 1 ")                    # a phase script's block
    edit("generate.py", "\ntemperature = 1.0 ", "\ntemperature = 0.9 ")
    edit("evaluate.py", "\nk = 4 ", "\nk = 2 ")
    edit("presets.sh", " LR=2e-4 ", " LR=3e-4 ")                                            # a preset
    edit("loss.py", '"grpo": Preset("clip", dict(clip_low=0.8, clip_high=1.2)',                # a LOSS preset's row
         '"grpo": Preset("clip", dict(clip_low=0.8, clip_high=1.25)')
    run = tmp_path / "run"
    env = {**loop_env(toy, run), "LOSS": "grpo", "STAGES": "1", "UPDATES_PER_STAGE": "2", "EVAL_TOP_P": "0.9"}
    del env["LR"], env["EVAL_K"]                        # (the tests' loop sets these: here their homes decide)
    proc = subprocess.run(["bash", "run_stages.sh"], cwd=clone, capture_output=True, text=True,
                          env={**os.environ, **env, "PROMPTS_PER_UPDATE": "8"}, timeout=900)   # the environment
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    config = json.loads((run / "stage_0" / "optimize_config.json").read_text())
    config, loss = config["hyperparameters"], config["resolved"]["loss"]
    assert (config["warmup_updates"], config["lr"], loss["settings"]["clip_high"], config["prompts_per_update"]) == (
        1, 3e-4, 1.25, 8)
    manifest = json.loads((run / "stage_0" / "rollouts" / "manifest.json").read_text())
    assert manifest["sampling"]["temperature"] == 0.9
    rows = read_lines(run / "results.jsonl")
    assert {(r["k"], r["top_p"]) for r in rows} == {(2, 0.9)} and {r["stage"] for r in rows} == {-1, 0}
