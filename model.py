"""The trainer's policy (docs/design.md §2): built on the meta device, sharded with FSDP2 under torchrun, filled
from an HF checkpoint (each rank reads only its own rows), saved as an HF directory vLLM loads, and its
resumable train state (fp32 weights and AdamW moments, DCP). Also the packed-attention kernels and a
meter of the activations autograd saves.

Placement (rank, world size, device) is read from torch (`placement()`), and so are the trainer's collectives
built on it (barrier, gathers, broadcast, the stats' sum); everything else is an argument. This module reads no
script's globals: optimize.py holds the hyperparameters and the stage loop, update.py the update.
"""
import contextlib
import datetime
import functools
import gc
import hashlib
import importlib.util
import json
import math
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

import common
import records

ATTENTION = ("auto", "flash_attention_2", "varlen_attn", "flex_attention", "varlen_sdpa", "sdpa", "eager")


def placement():
    """(rank, world size, device) of this process: torch.distributed's when a process group is up, and the
    current CUDA device (the caller sets it from LOCAL_RANK) or the CPU."""
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return rank, world, device


def barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def gather_values(values):
    """Every rank's 1-D tensor of values, concatenated in rank order (ranks may hold different numbers)."""
    _, world, device = placement()
    if world == 1:
        return values
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([values.numel()], device=device))
    longest = max(int(n) for n in sizes)
    parts = [torch.zeros(longest, device=device) for _ in range(world)]
    dist.all_gather(parts, torch.nn.functional.pad(values, (0, longest - values.numel())))
    return torch.cat([p[:int(n)] for p, n in zip(parts, sizes)])


def gather_lists(items):
    """Every rank's list of picklable items, concatenated in rank order."""
    _, world, _ = placement()
    if world == 1:
        return list(items)
    everyone = [None] * world
    dist.all_gather_object(everyone, list(items))
    return [x for part in everyone for x in part]


def broadcast(obj):
    """Rank 0's picklable object, on every rank (decisions taken from the filesystem: one rank decides)."""
    if placement()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def reduce_stats(stats):
    """Sum the ranks' stats (extremes: min/max), two collectives in all."""
    if placement()[1] == 1:
        return stats
    names = sorted(stats)
    sums = [n for n in names if not n.endswith(("_min", "_max"))]
    extremes = [n for n in names if n.endswith(("_min", "_max"))]
    total = torch.stack([stats[n].double() for n in sums])
    dist.all_reduce(total)
    ext = torch.stack([(stats[n] if n.endswith("_max") else -stats[n]).double() for n in extremes])
    dist.all_reduce(ext, op=dist.ReduceOp.MAX)
    out = {n: total[i].float() for i, n in enumerate(sums)}
    out.update({n: (ext[i] if n.endswith("_max") else -ext[i]).float() for i, n in enumerate(extremes)})
    return out


# every collective's limit: rank 0 may build rollout columns or save a 15 GB policy while the others wait
PROCESS_GROUP_TIMEOUT = datetime.timedelta(hours=1)


def start_process_group(device, timeout=PROCESS_GROUP_TIMEOUT):
    """Join torchrun's process group (NCCL on GPUs, gloo on CPUs) and run a first collective, which is where NCCL
    sets up its transports: a failure there (most often Docker's 64 MB /dev/shm, which NCCL's shared-memory
    transport outgrows) is one message with the way out, not a stack of NCCL internals."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    # the rank's GPU, bound to the group: barrier() then uses it (torch 2.13 torch/distributed/distributed_c10d.py:5333,
    # "Use device id from `init_process_group(device_id=...)`"); without it the device is "the global rank mod local
    # device count" (:5313) or whatever is current (:5339, "may use default device 0"), wrong on a second node with
    # fewer ranks than GPUs; NCCL also forms its communicator here, not at the first collective (:1741). gloo takes no
    # device: a CPU device_id is refused (:2014)
    dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    try:
        barrier()
    except Exception as e:
        raise SystemExit(process_group_hint(backend, e, shutil.disk_usage("/dev/shm").free
                                            if os.path.isdir("/dev/shm") else None)) from None


def process_group_hint(backend, error, shm_free_bytes):
    """The message of a process group that could not start."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    shm = "no /dev/shm" if shm_free_bytes is None else f"/dev/shm has {shm_free_bytes / 2**20:.0f} MiB free"
    return (f"the {backend} process group could not start ({type(error).__name__}: {first}). NCCL puts its "
            f"shared-memory buffers in /dev/shm ({shm}): in Docker run the container with --ipc=host or a large "
            f"--shm-size (e.g. 16g); NCCL_DEBUG=INFO says which transport failed")


def end_process_group():
    """FSDP2's device mesh holds the process groups: the caller drops the model and optimizer first, so the
    groups' gloo/NCCL threads are shut down and joined here, by destroy_process_group, and not during
    interpreter teardown (a 3-rank gloo run once aborted there: "terminate called without an active exception")."""
    if placement()[1] > 1:
        release_memory()
        barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- packed attention


def sequence_bounds(position_ids, n_tokens):
    """Where the packed sequences start and end: position ids restart at 0 with every sequence.
    position_ids [1, N] → [s₀ = 0, s₁, …, N] (a Python list)."""
    return torch.nonzero(position_ids[0] == 0).flatten().tolist() + [n_tokens]


def varlen_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None, **kwargs):
    """Attention over packed sequences one sequence at a time: causal sdpa within each, so cost grows with
    Σ Lᵢ², not N², and no [N, N] mask is built. query [1, H, N, D], key/value [1, H_kv, N, D] → [1, N, H, D].
    The CPU default (flex attention has no backward on CPU); on a GPU each call runs sdpa's flash kernel."""
    bounds = sequence_bounds(position_ids, query.shape[2])
    gqa = key.shape[1] != query.shape[1]
    outs = [torch.nn.functional.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                             is_causal=True, scale=scaling, enable_gqa=gqa)
            for a, b in zip(bounds, bounds[1:])]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def varlen_attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None, **kwargs):
    """Attention over packed sequences in one kernel call per layer: torch's varlen attention
    (torch/nn/attention/varlen.py, FlashAttention-2 through aten._flash_attention_forward; CUDA only,
    causal as window_size=(-1, 0)). Same shapes as varlen_sdpa."""
    # torch's varlen kernel (1 s): only on CUDA when asked for
    from torch.nn.attention.varlen import varlen_attn as kernel
    bounds = sequence_bounds(position_ids, query.shape[2])
    cu = torch.tensor(bounds, dtype=torch.int32, device=query.device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    out = kernel(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu, cu, longest, longest,
                 scale=scaling, window_size=(-1, 0), enable_gqa=key.shape[1] != query.shape[1])   # [N, H, D]
    return out[None], None


def choose_attention(requested, device):
    """The attention implementation to build with, registered with transformers when it is ours.
    auto: flash-attn's varlen kernel when the package is installed on a GPU, else varlen_sdpa (sdpa's flash
    kernel per sequence on a GPU). Not flex attention by default: on an H100 (torch 2.11, transformers
    5.17) its first packed forward was still compiling (transformers' torch.compile'd create_block_mask)
    after 135 s, while varlen_sdpa ran two updates in 18 s. Nor torch's varlen_attn, which is one kernel call
    per layer instead of one per sequence but has not been measured against varlen_sdpa (no GPU was lent
    since it was added): ask for it by name. sdpa builds a dense [N, N] block-diagonal mask: the fallback."""
    if requested not in ATTENTION:
        raise SystemExit(f"--attn_implementation={requested!r}: allowed values are {', '.join(map(repr, ATTENTION))}")
    name = requested
    if name == "auto":
        name = "flash_attention_2" if device.type == "cuda" and importlib.util.find_spec("flash_attn") else "varlen_sdpa"
    if name == "varlen_attn" and device.type != "cuda":
        raise SystemExit("--attn_implementation=varlen_attn runs on CUDA only (torch's FlashAttention kernel); "
                         "use varlen_sdpa on a CPU")
    if name in ("varlen_sdpa", "varlen_attn"):
        from transformers import AttentionInterface  # transformers' attention registries: only for the varlen kernels
        from transformers.masking_utils import AttentionMaskInterface
        AttentionInterface.register(name, varlen_sdpa if name == "varlen_sdpa" else varlen_attn)
        AttentionMaskInterface.register(name, lambda *args, **kwargs: None)   # no mask to build
    return name


# ----------------------------------------------------------------------------- building and loading


def safetensors_index(path):
    """{tensor name: file} of an HF checkpoint directory."""
    index = Path(path) / "model.safetensors.index.json"
    if index.exists():
        return {k: Path(path) / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{path}: no *.safetensors weights (convert .bin checkpoints with save_pretrained first)")
    found = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            found.update({k: f for k in sf.keys()})
    return found


def checkpoint_dtype(path):
    """The floating dtype of a checkpoint's weights, read from the safetensors header."""
    name, file = next(iter(safetensors_index(path).items()))
    with safe_open(str(file), "pt") as sf:
        return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(
            sf.get_slice(name).get_dtype(), torch.float32)


def parameter_count(path):
    """Parameters of an HF checkpoint, from its safetensors headers (no tensor is read)."""
    total = 0
    for f in set(safetensors_index(path).values()):
        with safe_open(str(f), "pt") as sf:
            total += sum(math.prod(sf.get_slice(k).get_shape()) for k in sf.keys())
    return total


def vocab_size(path):
    from transformers import AutoConfig  # transformers: only for its config
    return AutoConfig.from_pretrained(path).vocab_size


@functools.cache
def hsdp_mesh(world, shard_ranks, device_type):
    """HSDP's 2-D mesh, built once per process (the trainer and KL's reference model share its groups):
    `world // shard_ranks` replicas (torchrun's nodes) × `shard_ranks` shards (a node's ranks, consecutive global
    ranks under torchrun: torch/distributed/elastic/agent/server/api.py, _assign_worker_ranks). FSDP2 then
    all-gathers and reduce-scatters within a node and all-reduces the gradient shards across nodes, divided by
    every rank's count as plain FSDP2 is (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py,
    _get_gradient_divide_factors). Its groups get the default group's timeout: without options a mesh dimension's
    group has the backend's default, 10 minutes for NCCL (torch/distributed/device_mesh.py, _init_one_process_group)."""
    from torch.distributed.device_mesh import init_device_mesh  # the mesh: only for HSDP
    if world % shard_ranks:
        raise SystemExit(f"HSDP: {world} ranks do not split into groups of {shard_ranks} (ranks per node)")
    def options():      # one object per mesh dimension: with the default group bound to a device (device_id),
        # NCCL's split_group modifies the options it is given (torch deep-copies its own default for this reason:
        # torch/distributed/distributed_c10d.py, split_group, "the option will be modified inside split")
        o = dist.ProcessGroupNCCL.Options() if device_type == "cuda" else dist.ProcessGroupGloo._Options()
        o._timeout = PROCESS_GROUP_TIMEOUT
        return o
    return init_device_mesh(device_type, (world // shard_ranks, shard_ranks), mesh_dim_names=("replicate", "shard"),
                            backend_override={"replicate": options(), "shard": options()})


def shard_start(param):
    """The first row of this rank's shard of an FSDP2 parameter (a DTensor): dim 0 is cut in chunks of
    ceil(n / shards) rows (torch.chunk) along the mesh dimension that shards it (the only one in plain FSDP2,
    HSDP's second), this rank's chunk at its coordinate there."""
    from torch.distributed.tensor import Shard  # DTensor's placements: only under FSDP2
    dim = next(i for i, p in enumerate(param.placements) if isinstance(p, Shard))
    return param.device_mesh.get_coordinate()[dim] * math.ceil(param.shape[0] / param.device_mesh.size(dim))


@torch.no_grad()
def load_weights(model, path):
    """Fill the model's parameters from an HF checkpoint, each rank reading only its own rows (shard_start), which
    safetensors' get_slice reads alone, cast to the parameter's dtype on copy. No rank ever holds the whole
    model."""
    index = safetensors_index(path)
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), "pt")) for f in set(index.values())}
        for name, param in model.named_parameters():               # tied weights appear once
            if name not in index:
                raise SystemExit(f"{path}: the checkpoint has no tensor {name!r} (its names must match the "
                                 f"transformers class of its config)")
            sharded = hasattr(param, "to_local")
            local = param.to_local() if sharded else param
            start = shard_start(param) if sharded else 0
            if local.shape[0]:
                local.copy_(handles[index[name]].get_slice(name)[start:start + local.shape[0]])
        for name, buf in model.named_buffers():                     # persistent buffers, if any are saved
            if name in index:
                buf.copy_(handles[index[name]].get_tensor(name))


def build(source, *, attention, gradient_checkpointing=False, lora_rank=0, lora_alpha=32, trainable=True,
          weights=True, shard_ranks=0):
    """The policy as the trainer runs it: fp32 master weights (bf16 compute on a GPU), dropout off, train
    mode, the given attention, gradient checkpointing; FSDP2-sharded when a process group is up, over every rank
    or (shard_ranks > 0: HSDP) over groups of shard_ranks consecutive ranks, replicated across the groups. Built on
    the meta device (accelerate's init_empty_weights: parameters on meta, buffers as usual, since the rotary
    frequencies are computed in __init__ and are in no checkpoint), sharded, then filled from `source`'s
    safetensors shard by shard (weights=False: left empty for a DCP state)."""
    # transformers (1 s): only where a model is built (preflight.py, launch.py, transfer.py build none)
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    _, world, device = placement()
    config = AutoConfig.from_pretrained(source)
    for key, value in list(vars(config).items()):    # RL log-probs must be deterministic in train mode
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)
    config.use_cache = False
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
    # init_empty_weights patches register_parameter to put every parameter it sees on meta as a new Parameter,
    # so the tie post_init makes (lm_head.weight = embed_tokens.weight) comes out as two parameters
    # (accelerate/big_modeling.py:131, register_empty_parameter); tie them again before fully_shard, or FSDP2
    # shards the head as a parameter of its own, which the optimizer never steps (issue 26's tied test:
    # 2 ranks drifted 4.6 % of the update from 1 process from the second update on)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    if gradient_checkpointing and trainable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # FSDP2: only with more than one rank
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                  reduce_dtype=torch.float32)
        options = dict(mp_policy=mp, mesh=hsdp_mesh(world, shard_ranks, device.type) if shard_ranks else None)
        for layer in model.model.layers:
            fully_shard(layer, **options)
        fully_shard(model, **options)
    buffers = {name: b.detach().to(device, copy=True) for name, b in model.named_buffers()}
    model.to_empty(device=device)                  # uninitialized storage for this rank's shards (and buffers)
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
    # to_empty gives every module a new parameter, so tied weights come apart (the lm_head and embedding of
    # Qwen2.5-0.5B/1.5B/3B, whose checkpoints have no lm_head.weight); tie them again, so that there is one
    # parameter to load, optimize and save. FSDP2 tracks the embedding's parameter and sets the gathered
    # weight on both modules at unshard (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
    # _setattr_on_modules), which this keeps true of the sharded view too.
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    if weights:
        load_weights(model, source)
    if lora_rank and trainable:
        from peft import LoraConfig, get_peft_model  # peft (1 s): only for LoRA
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules="all-linear",
                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
    model.train(trainable)  # transformers checkpoints a layer only when `self.training` (modeling_layers.py)
    if not trainable:
        model.requires_grad_(False)
    live = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    live += [n for n, m in model.named_modules() if (getattr(m, "attention_dropout", 0) or 0) > 0]
    if live:
        raise SystemExit(f"dropout is still on in {live[:3]}: in train mode the log-probs would be random")
    return model


def init_optimizer_state(optimizer):
    """AdamW's state for every trainable parameter, made now, before the first activation, as torch's first step
    would make it (torch/optim/adam.py `_init_group`, neither fused nor capturable: `step` a float32 scalar on the
    CPU, `exp_avg` and `exp_avg_sq` zeros like the parameter), so the updates are the same bit for bit. Made lazily,
    after the first backward, the moments (8 bytes per parameter) take blocks beside that pass's activations in the
    caching allocator, and the segments those blocks sit in stay reserved for the run. A restored state overwrites
    them in place (DCP's own _init_optim_state makes nothing once a state exists)."""
    for group in optimizer.param_groups:
        assert not group.get("fused") and not group.get("capturable") and not group.get("amsgrad"), group
        for p in group["params"]:
            if p.requires_grad and not optimizer.state[p]:
                optimizer.state[p].update(step=torch.tensor(0.0, dtype=torch.float32),
                                          exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                          exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))


def reserved_gib():
    """The GiB this process's CUDA caching allocator holds (torch.cuda.memory_reserved: its segments, free blocks
    in them included; not the CUDA context or NCCL's buffers); None without a GPU."""
    return torch.cuda.memory_reserved() / 2**30 if torch.cuda.is_available() else None


def release_gradients(optimizer):
    """Free the gradients (fp32, 4 bytes per parameter) and the CUDA cache's blocks: what the resident trainer does
    before the engine wakes. Returns the gradient bytes still held on this rank (0)."""
    optimizer.zero_grad(set_to_none=True)
    release_memory()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def release_memory():
    """Collect the garbage of models the caller has dropped (`del`), and return the CUDA cache's blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- the saved policy


def _base(model):
    """The transformers model under a LoRA wrapper (peft), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def weights_digest(hashes):
    """The fingerprint of a policy's weights (policy_id.json's, the rollouts' policy_id): sha256 over its tensors'
    names and common.tensor_hash values in the saved dtype (hashes: {name: int}), in name order, 16 hex digits.
    The same number whether the policy was saved as files (save_policy), recomputed from them (weights_fingerprint)
    or handed over through vLLM's weight-transfer API (transfer.PolicySource), so a stage's rollouts name their
    policy alike in every mode."""
    return hashlib.sha256("".join(f"{k}\0{hashes[k]:016x}\n" for k in sorted(hashes)).encode()).hexdigest()[:16]


def weights_fingerprint(path):
    """weights_digest of a saved policy directory, recomputed from its safetensors."""
    hashes = {}
    for name, file in safetensors_index(path).items():
        with safe_open(str(file), "pt") as sf:
            hashes[name] = common.tensor_hash(sf.get_tensor(name))
    return weights_digest(hashes)


def engine_weight_hashes(path):
    """{tensor name: common.tensor_hash} of a saved policy directory's safetensors as the engines hold them (in
    common.engine_dtype()): what save_policy records in policy_id.json, recomputed from the files."""
    held = getattr(torch, common.engine_dtype())
    hashes = {}
    for name, file in safetensors_index(path).items():
        with safe_open(str(file), "pt") as sf:
            hashes[name] = common.tensor_hash(sf.get_tensor(name).to(held))
    return hashes


def _tied_head(base):
    """The output head's state-dict name when it is tied to the embeddings (saved once, as the source checkpoint
    did: gathered per rank, the tie would be two copies), else None."""
    if not getattr(base.config, "tie_word_embeddings", False):
        return None
    head = base.get_output_embeddings()
    return next(f"{n}.weight" for n, m in base.named_modules() if m is head)


def policy_shapes(model):
    """(checkpoint name, full shape) of every tensor policy_tensors yields, in its order, without gathering."""
    base = _base(model)
    head = _tied_head(base)
    for name, t in base.state_dict().items():
        name = name.replace(".base_layer.", ".")
        if "lora_" not in name and name != head:
            yield name, tuple(t.shape)


def policy_tensors(model, dtype):
    """(checkpoint name, full tensor in `dtype`, on the trainer's device) of every tensor of the policy as vLLM loads
    it, one at a time and on every rank (a sharded parameter's full_tensor() is a collective: every rank iterates, in
    the same order): LoRA adapters merged into their base weights without touching the model, a tied output head
    left out. What model.save_policy writes and transfer.PolicySource hands to the engines."""
    base = _base(model)
    head = _tied_head(base)
    adapters = {}
    if hasattr(model, "get_base_model"):
        from peft.tuners.lora import LoraLayer  # peft: only for LoRA
        adapters = {f"{n}.weight": m for n, m in base.named_modules() if isinstance(m, LoraLayer) and "default" in m.lora_A}
    for name, t in base.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        name = name.replace(".base_layer.", ".")
        if "lora_" in name or name == head:
            continue
        saved = full.detach().to(dtype)
        if name in adapters:
            delta = adapters[name].get_delta_weight("default").detach()
            saved = (saved.float() + delta.float().to(saved.device)).to(dtype)
        yield name, saved


def nonfinite_parameters(model):
    """The names of the parameters that hold a non-finite value on any rank: each rank checks its own shards (an
    FSDP2 parameter's local tensor), one all-reduce of the per-parameter counts; every rank gets the same list."""
    from torch.distributed.tensor import DTensor  # DTensor: only under FSDP2
    names, bad = [], []
    for name, param in model.named_parameters():
        local = (param.to_local() if isinstance(param, DTensor) else param).detach()
        names.append(name)
        bad.append(torch.logical_not(torch.isfinite(local).all()))     # an empty shard: all() is True
    if not names:
        return []
    counts = torch.stack(bad).to(torch.int32)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    return [name for name, n in zip(names, counts.tolist()) if n]


def full_state(model, dtype):
    """({name: full tensor in dtype, on CPU}, weights_digest of them, {name: common.tensor_hash of it as the engines
    hold it}) on rank 0, (None, None, None) elsewhere: policy_tensors one at a time, checked for non-finite values and
    hashed on their device as they are gathered (one sync at the end, not a pass over the CPU copies). The engines'
    hashes are of the saved dtype cast to common.engine_dtype(), as vLLM casts a checkpoint's tensors into its
    parameters (exact from bf16 to fp32; fp32 to bf16 rounds as vLLM's copy_ does)."""
    rank, _, _ = placement()
    held = getattr(torch, common.engine_dtype())
    state, finite, saved_hashes, engine_hashes = {}, {}, {}, {}
    for name, saved in policy_tensors(model, dtype):
        if rank == 0:
            finite[name] = torch.isfinite(saved).all()
            saved_hashes[name], engine_hashes[name] = hashes_of(saved, held)
            state[name] = saved.cpu()
    if rank != 0:
        return None, None, None
    bad = [k for k, ok in zip(finite, torch.stack(list(finite.values())).tolist()) if not ok]
    if bad:
        raise SystemExit(f"refusing to save non-finite weights ({bad[:3]}...)")
    return state, weights_digest(saved_hashes), engine_hashes


def hashes_of(saved, held):
    """(common.tensor_hash of a saved tensor, of it as the engines hold it in dtype `held`): one pass when they agree."""
    own = common.tensor_hash(saved)
    return own, own if saved.dtype == held else common.tensor_hash(saved.to(held))


def save_policy(model, source_dir, dtype, directory, identity):
    """The policy as an HF directory vLLM loads, atomically: full weights in `dtype` (the initial model's), a
    config that says so, the source's tokenizer and generation files, and policy_id.json (the weights'
    fingerprint and `identity`: the stage and the updates done, for curves over updates)."""
    rank, _, _ = placement()
    directory = Path(directory)
    state, fingerprint, engine_hashes = full_state(model, dtype)
    if rank == 0:
        base = _base(model)
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        base.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        config = json.loads((tmp / "config.json").read_text())     # save_pretrained writes the fp32 master's dtype
        config.update(dtype=str(dtype).removeprefix("torch."), use_cache=True)
        config.pop("torch_dtype", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for f in Path(source_dir).iterdir():   # tokenizer, chat template, generation config
            if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".safetensors.index.json", ".pt")) \
                    and f.name not in ("config.json", common.POLICY_ID_FILE):
                shutil.copy2(f, tmp / f.name)
        hashes = {k: f"{v:016x}" for k, v in engine_hashes.items()}      # what the engines check they hold
        common.atomic_write_json(tmp / common.POLICY_ID_FILE, {
            "fingerprint": fingerprint, **identity,
            "engine_weights": {"dtype": common.engine_dtype(), "hash": common.TENSOR_HASH, "hashes": hashes}})
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
        common.fsync_dir(directory.parent)
    barrier()


# ----------------------------------------------------------------------------- the train state


def save_state(model, optimizer, state_dir, progress):
    """Resumable state (fp32 weights, AdamW moments; DCP, every rank its shards), atomically: written to
    train_state.tmp, then renamed over train_state. progress.json holds `progress`, a new state id and the
    CPU RNG state."""
    import torch.distributed.checkpoint as dcp  # DCP: only the trainer saves its state
    from torch.distributed.checkpoint.state_dict import get_state_dict
    rank, world, _ = placement()
    state_dir = Path(state_dir)
    tmp = state_dir.with_name("train_state.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    barrier()
    if rank == 0:
        common.atomic_write_json(tmp / "progress.json", {**progress, "world": world, "state_id": uuid.uuid4().hex[:16],
                                                         "rng": torch.get_rng_state().tolist()})
        old = state_dir.with_name("train_state.old")
        shutil.rmtree(old, ignore_errors=True)
        if state_dir.exists():
            os.replace(state_dir, old)
        os.replace(tmp, state_dir)
        shutil.rmtree(old, ignore_errors=True)
        common.fsync_dir(state_dir.parent)
    barrier()


def load_state(model, optimizer, directory):
    """Load a train_state (DCP; written by any number of ranks) into the model and optimizer; returns its
    progress.json."""
    import torch.distributed.checkpoint as dcp  # DCP: only the trainer loads a state
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads((Path(directory) / "progress.json").read_text())


def state_source(state_dir, init_state):
    """The train state a stage starts from: its own (a resume) when state_dir holds one, else init_state (the
    previous stage's), else None (the weights of the policy, AdamW afresh)."""
    if (Path(state_dir) / "progress.json").exists():
        return Path(state_dir)
    if init_state:
        if not (Path(init_state) / "progress.json").exists():
            raise SystemExit(f"--init_state={init_state}: no progress.json there (not a train_state directory)")
        return Path(init_state)
    return None


# ----------------------------------------------------------------------------- the training records
# Where a policy or a train state stands in the run is recorded by name where it is written (policy_id.json, read
# by common.policy_record; progress.json; every metrics line) and read back by every consumer (the next stage, a
# resume, the hand-off, evaluate.py, plot.py), never recomputed from μ, so stages of any length stay labelled right:
#   stage_updates       updates done in its stage (a train state's "update": the next one to run)
#   run_updates         the run's updates up to it, across stages: what accuracy is plotted against
#   optimizer_updates   AdamW's steps since it was created; RESET_OPTIMIZER=true starts it (and the warmup, which
#                       counts these) afresh each stage, while run_updates go on
COUNTS = ("run_updates", "optimizer_updates")


def newest_state(run_dir):
    """(stage, progress.json) of the newest train state in a run directory's stage_<s>/ (a resident trainer's
    resume), or (None, None)."""
    states = [(s, d / records.TRAIN_STATE / "progress.json") for s, d in records.stage_dirs(run_dir)
              if (d / records.TRAIN_STATE / "progress.json").exists()]
    if not states:
        return None, None
    s, path = max(states)
    return s, json.loads(path.read_text())


def restore(model, optimizer, source, resume, start_weights, start_policy):
    """Load `source` (state_source's) into the model and optimizer; returns (first update of this stage, the
    counts before this stage {run_updates, optimizer_updates}, the id of the weights the stage started from, a line
    saying what was done). A resume also restores the CPU RNG state and keeps the stage's own start id (its TIS pass
    was computed from those weights); the previous stage's state is known by its state id. Without a state the run's
    count continues from the start policy's record (RESET_OPTIMIZER) and AdamW's starts at 0."""
    if source is None:
        run_updates = common.policy_record(start_policy).get("run_updates", 0)
        return 0, {"run_updates": run_updates, "optimizer_updates": 0}, start_weights, \
            f"AdamW afresh from {start_policy} ({run_updates} run updates so far)" if run_updates else None
    meta = load_state(model, optimizer, source)
    if resume:
        torch.set_rng_state(torch.tensor(meta["rng"], dtype=torch.uint8))
        return (meta["update"], {k: meta[k] - meta["update"] for k in COUNTS}, meta["start_weights"],
                f"resuming from {source} at update {meta['update']}")
    return (0, {k: meta[k] for k in COUNTS}, meta["state_id"],
            f"continuing the previous stage's fp32 weights and AdamW state from {source} "
            f"({meta['run_updates']} updates so far)")


# ----------------------------------------------------------------------------- memory


class SavedActivations:
    """Counts the bytes autograd saves for backward (parameters aside) inside `with meter:`: what gradient
    checkpointing exists to cut. enabled=False: counts nothing (0)."""

    def __init__(self, enabled=True):
        self.bytes, self._seen = 0, set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t) if enabled \
            else contextlib.nullcontext()

    def _pack(self, t):
        if not isinstance(t, torch.nn.Parameter):
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += key[1]
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)
