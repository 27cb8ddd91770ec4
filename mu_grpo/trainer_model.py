"""The trainer's policy (docs/design.md §2): built on the meta device, sharded with FSDP2 under
torchrun, filled from an HF checkpoint (each rank reads only its own rows). Also the
packed-attention kernels and a meter of the activations autograd saves. What the trainer saves and
restores (the policy vLLM loads, the train state): mu_grpo/checkpoint.py.

Placement (rank, world size, device) is read from torch (`placement()`), and so are the trainer's
collectives built on it (barrier, gathers, broadcast, the stats' sum); everything else is an
argument. This module reads no script's globals: optimize.py holds the hyperparameters and the stage
loop, update.py the update.
"""
import contextlib
import datetime
import functools
import gc
import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open


ATTENTION = ("auto", "flash_attention_2", "varlen_attn", "flex_attention", "varlen_sdpa",
             "sdpa", "eager")


def log(*args):
    """print on rank 0 only (placement from torch); nothing for a None alone."""
    if placement()[0] == 0 and any(args):
        print(*args, flush=True)


def placement():
    """(rank, world size, device) of this process: torch.distributed's when a process group is up,
    and the current CUDA device (the caller sets it from LOCAL_RANK) or the CPU."""
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    return rank, world, device


def barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def gather_values(values):
    """Every rank's 1-D tensor of values, concatenated in rank order (ranks may hold different
    numbers)."""
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
    """Rank 0's picklable object, on every rank (decisions taken from the filesystem: one rank
    decides)."""
    if placement()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def reduce_stats(stats):
    """Sum the ranks' stats (extremes: min/max), a collective for each kind the stats have (every
    rank's stats have the same names)."""
    if placement()[1] == 1:
        return stats
    names = sorted(stats)
    sums = [n for n in names if not n.endswith(("_min", "_max"))]
    extremes = [n for n in names if n.endswith(("_min", "_max"))]
    out = {}
    if sums:       # 0-d sums and histograms' counts, in one flat tensor
        total = torch.cat([stats[n].double().reshape(-1) for n in sums])
        dist.all_reduce(total)
        at = 0
        for n in sums:
            out[n] = total[at:at + stats[n].numel()].reshape(stats[n].shape).float()
            at += stats[n].numel()
    if extremes:
        ext = torch.stack([(stats[n] if n.endswith("_max") else -stats[n]).double()
                           for n in extremes])
        dist.all_reduce(ext, op=dist.ReduceOp.MAX)
        out.update({n: (ext[i] if n.endswith("_max") else -ext[i]).float()
                    for i, n in enumerate(extremes)})
    return out


# every collective's limit: rank 0 may build rollout columns or save a 15 GB policy while the others
# wait
PROCESS_GROUP_TIMEOUT = datetime.timedelta(hours=1)


def start_process_group(device, timeout=PROCESS_GROUP_TIMEOUT):
    """Join torchrun's process group (NCCL on GPUs, gloo on CPUs) and run a first collective, which
    is where NCCL sets up its transports: a failure there (most often Docker's 64 MB /dev/shm, which
    NCCL's shared-memory transport outgrows) is one message with the way out, not a stack of NCCL
    internals."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    # the rank's GPU, bound to the group: barrier() then uses it (torch 2.13
    # torch/distributed/distributed_c10d.py:5333, "Use device id from
    # `init_process_group(device_id=...)`"); without it the device is "the global rank mod local
    # device count" (:5313) or whatever is current (:5339, "may use default device 0"), wrong on a
    # second node with fewer ranks than GPUs; NCCL also forms its communicator here, not at the
    # first collective (:1741). gloo takes no device: a CPU device_id is refused (:2014)
    dist.init_process_group(backend, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    try:
        barrier()
    except Exception as e:
        raise SystemExit(process_group_hint(backend, e, shutil.disk_usage("/dev/shm").free
                                            if os.path.isdir("/dev/shm") else None)) from None


def process_group_hint(backend, error, shm_free_bytes):
    """The message of a process group that could not start."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    shm = ("no /dev/shm" if shm_free_bytes is None
           else f"/dev/shm has {shm_free_bytes / 2**20:.0f} MiB free")
    return (f"the {backend} process group could not start ({type(error).__name__}: {first}). NCCL "
            f"puts its shared-memory buffers in /dev/shm ({shm}): in Docker run the container with "
            "--ipc=host or a large --shm-size (e.g. 16g); NCCL_DEBUG=INFO says which transport "
            "failed")


def end_process_group():
    """FSDP2's device mesh holds the process groups: the caller drops the model and optimizer first,
    so the groups' gloo/NCCL threads are shut down and joined here, by destroy_process_group, and
    not during interpreter teardown (a 3-rank gloo run once aborted there: "terminate called without
    an active exception")."""
    if placement()[1] > 1:
        release_memory()
        barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- packed attention


def sequence_bounds(position_ids, n_tokens):
    """Where the packed sequences start and end: position ids restart at 0 with every sequence.
    position_ids [1, N] → [s₀ = 0, s₁, …, N] (a Python list)."""
    return torch.nonzero(position_ids[0] == 0).flatten().tolist() + [n_tokens]


def varlen_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                position_ids=None, **kwargs):
    """Attention over packed sequences one sequence at a time: causal sdpa within each, so cost
    grows with Σ Lᵢ², not N², and no [N, N] mask is built. query [1, H, N, D], key/value [1, H_kv,
    N, D] → [1, N, H, D]. The CPU default (flex attention has no backward on CPU); on a GPU each
    call runs sdpa's flash kernel."""
    bounds = sequence_bounds(position_ids, query.shape[2])
    gqa = key.shape[1] != query.shape[1]
    outs = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
        is_causal=True, scale=scaling, enable_gqa=gqa)
            for a, b in zip(bounds, bounds[1:])]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def varlen_attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                position_ids=None, **kwargs):
    """Attention over packed sequences in one kernel call per layer: torch's varlen attention
    (torch/nn/attention/varlen.py, FlashAttention-2 through aten._flash_attention_forward; CUDA
    only, causal as window_size=(-1, 0)). Same shapes as varlen_sdpa."""
    # torch's varlen kernel (1 s): only on CUDA when asked for
    from torch.nn.attention.varlen import varlen_attn as kernel
    bounds = sequence_bounds(position_ids, query.shape[2])
    cu = torch.tensor(bounds, dtype=torch.int32, device=query.device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    out = kernel(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu, cu,
                 # [N, H, D]
                 longest, longest, scale=scaling, window_size=(-1, 0),
                 enable_gqa=key.shape[1] != query.shape[1])
    return out[None], None


def choose_attention(requested, device):
    """The attention implementation to build with, registered with transformers when it is ours.
    auto: flash-attn's varlen kernel when the package is installed on a GPU, else varlen_sdpa
    (sdpa's flash kernel per sequence on a GPU). Not flex attention by default: on an H100 (torch
    2.11, transformers 5.17) its first packed forward was still compiling (transformers'
    torch.compile'd create_block_mask) after 135 s, while varlen_sdpa ran two updates in 18 s. Nor
    torch's varlen_attn, which is one kernel call per layer instead of one per sequence but has not
    been measured against varlen_sdpa (no GPU was lent since it was added): ask for it by name. sdpa
    builds a dense [N, N] block-diagonal mask: the fallback."""
    if requested not in ATTENTION:
        raise SystemExit(f"--attn_implementation={requested!r}: allowed values are "
                         f"{', '.join(map(repr, ATTENTION))}")
    name = requested
    if name == "auto":
        name = ("flash_attention_2" if device.type == "cuda"
                and importlib.util.find_spec("flash_attn") else "varlen_sdpa")
    if name == "varlen_attn" and device.type != "cuda":
        raise SystemExit("--attn_implementation=varlen_attn runs on CUDA only (torch's "
                         "FlashAttention kernel); use varlen_sdpa on a CPU")
    if name in ("varlen_sdpa", "varlen_attn"):
        # transformers' attention registries: only for the varlen kernels
        from transformers import AttentionInterface
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
        raise SystemExit(f"{path}: no *.safetensors weights (convert .bin checkpoints with "
                         "save_pretrained first)")
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
    """HSDP's 2-D mesh, built once per process (the trainer and KL's reference model share its
    groups): `world // shard_ranks` replicas (torchrun's nodes) × `shard_ranks` shards (a node's
    ranks, consecutive global ranks under torchrun: torch/distributed/elastic/agent/server/api.py,
    _assign_worker_ranks). FSDP2 then all-gathers and reduce-scatters within a node and all-reduces
    the gradient shards across nodes, divided by every rank's count as plain FSDP2 is
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, _get_gradient_divide_factors). Its
    groups get the default group's timeout: without options a mesh dimension's group has the
    backend's default, 10 minutes for NCCL (torch/distributed/device_mesh.py,
    _init_one_process_group)."""
    from torch.distributed.device_mesh import init_device_mesh  # the mesh: only for HSDP
    if world % shard_ranks:
        raise SystemExit(f"HSDP: {world} ranks do not split into groups of {shard_ranks} (ranks "
                         "per node)")
    # one object per mesh dimension: with the default group bound to a device (device_id),
    def options():
        # NCCL's split_group modifies the options it is given (torch deep-copies its own default for
        # this reason: torch/distributed/distributed_c10d.py, split_group, "the option will be
        # modified inside split")
        o = (dist.ProcessGroupNCCL.Options() if device_type == "cuda"
             else dist.ProcessGroupGloo._Options())
        o._timeout = PROCESS_GROUP_TIMEOUT
        return o
    return init_device_mesh(device_type, (world // shard_ranks, shard_ranks),
                            mesh_dim_names=("replicate", "shard"),
                            backend_override={"replicate": options(), "shard": options()})


def shard_start(param):
    """The first row of this rank's shard of an FSDP2 parameter (a DTensor): dim 0 is cut in chunks
    of ceil(n / shards) rows (torch.chunk) along the mesh dimension that shards it (the only one in
    plain FSDP2, HSDP's second), this rank's chunk at its coordinate there."""
    from torch.distributed.tensor import Shard  # DTensor's placements: only under FSDP2
    dim = next(i for i, p in enumerate(param.placements) if isinstance(p, Shard))
    return param.device_mesh.get_coordinate()[dim] * math.ceil(
        param.shape[0] / param.device_mesh.size(dim))


@torch.no_grad()
def load_weights(model, path):
    """Fill the model's parameters from an HF checkpoint, each rank reading only its own rows
    (shard_start), which safetensors' get_slice reads alone, cast to the parameter's dtype on copy.
    No rank ever holds the whole model."""
    index = safetensors_index(path)
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), "pt")) for f in set(index.values())}
        for name, param in model.named_parameters():               # tied weights appear once
            if name not in index:
                raise SystemExit(f"{path}: the checkpoint has no tensor {name!r} (its names must "
                                 "match the transformers class of its config)")
            sharded = hasattr(param, "to_local")
            local = param.to_local() if sharded else param
            start = shard_start(param) if sharded else 0
            if local.shape[0]:
                local.copy_(handles[index[name]].get_slice(name)[start:start + local.shape[0]])
        # persistent buffers, if any are saved
        for name, buf in model.named_buffers():
            if name in index:
                buf.copy_(handles[index[name]].get_tensor(name))


def fsdp2(model, device, shard_ranks=0, param_dtype=None):
    """FSDP2 over the process group, as the box's trainer ranks run: every layer, then the root,
    computing in param_dtype (default: bf16 on a GPU, fp32 on a CPU) from fp32 master shards,
    gradients reduced in fp32; over groups of shard_ranks ranks (HSDP) when given.
    tools/gpu_check.py runs it on one rank."""
    # FSDP2: only with a process group
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    world = dist.get_world_size()
    param_dtype = param_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    options = dict(mp_policy=mp,
                   mesh=hsdp_mesh(world, shard_ranks, device.type) if shard_ranks else None)
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def build(source, *, attention, gradient_checkpointing=False, lora_rank=0, lora_alpha=32,
          trainable=True, weights=True, shard_ranks=0):
    """The policy as the trainer runs it: fp32 master weights (bf16 compute on a GPU), dropout off,
    train mode, the given attention, gradient checkpointing; FSDP2-sharded when a process group is
    up, over every rank or (shard_ranks > 0: HSDP) over groups of shard_ranks consecutive ranks,
    replicated across the groups. Built on the meta device (accelerate's init_empty_weights:
    parameters on meta, buffers as usual, since the rotary frequencies are computed in __init__ and
    are in no checkpoint), sharded, then filled from `source`'s safetensors shard by shard
    (weights=False: left empty for a DCP state)."""
    # transformers (1 s): only where a model is built (mu_grpo/preflight.py, mu_grpo/launch.py,
    # mu_grpo/transfer.py build none)
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    _, world, device = placement()
    config = AutoConfig.from_pretrained(source)
    # RL log-probs must be deterministic in train mode
    for key, value in list(vars(config).items()):
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)
    config.use_cache = False
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attention)
    # init_empty_weights patches register_parameter to put every parameter it sees on meta as a new
    # Parameter, so the tie post_init makes (lm_head.weight = embed_tokens.weight) comes out as two
    # parameters (accelerate/big_modeling.py:131, register_empty_parameter); tie them again before
    # fully_shard, or FSDP2 shards the head as a parameter of its own, which the optimizer never
    # steps (issue 26's tied test: 2 ranks drifted 4.6 % of the update from 1 process from the
    # second update on)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    if gradient_checkpointing and trainable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if world > 1:
        fsdp2(model, device, shard_ranks)
    buffers = {name: b.detach().to(device, copy=True) for name, b in model.named_buffers()}
    # uninitialized storage for this rank's shards (and buffers)
    model.to_empty(device=device)
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
    # to_empty gives every module a new parameter, so tied weights come apart (the lm_head and
    # embedding of Qwen2.5-0.5B/1.5B/3B, whose checkpoints have no lm_head.weight); tie them again,
    # so that there is one parameter to load, optimize and save. FSDP2 tracks the embedding's
    # parameter and sets the gathered weight on both modules at unshard
    # (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _setattr_on_modules), which this keeps
    # true of the sharded view too.
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    if weights:
        load_weights(model, source)
    if lora_rank and trainable:
        from peft import LoraConfig, get_peft_model  # peft (1 s): only for LoRA
        model = get_peft_model(
            model, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules="all-linear",
                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
    # transformers checkpoints a layer only when `self.training` (modeling_layers.py)
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    live = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    live += [n for n, m in model.named_modules() if (getattr(m, "attention_dropout", 0) or 0) > 0]
    if live:
        raise SystemExit(f"dropout is still on in {live[:3]}: in train mode the log-probs would be "
                         "random")
    return model


def init_optimizer_state(optimizer):
    """AdamW's state for every trainable parameter, made now, before the first activation, as
    torch's first step would make it (torch/optim/adam.py `_init_group`, neither fused nor
    capturable: `step` a float32 scalar on the CPU, `exp_avg` and `exp_avg_sq` zeros like the
    parameter), so the updates are the same bit for bit. Made lazily, after the first backward, the
    moments (8 bytes per parameter) take blocks beside that pass's activations in the caching
    allocator, and the segments those blocks sit in stay reserved for the run. A restored state
    overwrites them in place (DCP's own _init_optim_state makes nothing once a state exists)."""
    for group in optimizer.param_groups:
        assert not any(group.get(k) for k in ("fused", "capturable", "amsgrad")), group
        for p in group["params"]:
            if p.requires_grad and not optimizer.state[p]:
                optimizer.state[p].update(step=torch.tensor(0.0, dtype=torch.float32),
                                          exp_avg=torch.zeros_like(
                                              p, memory_format=torch.preserve_format),
                                          exp_avg_sq=torch.zeros_like(
                                              p, memory_format=torch.preserve_format))


# the optimizer's parameter groups
PARAMETER_KINDS = ("lora", "embed", "head", "norm", "attn", "mlp", "other")


def parameter_kind(name):
    """The optimizer's group of a parameter, by its name (model.named_parameters()): LoRA adapters,
    the embedding, the output head, norms, attention, MLP, anything else."""
    for kind, marks in (("lora", ("lora_",)), ("embed", ("embed",)), ("head", ("lm_head",)),
                        ("norm", ("norm",)), ("attn", ("attn",)), ("mlp", ("mlp",))):
        if any(m in name for m in marks):
            return kind
    return "other"


def parameter_groups(model):
    """The trainable parameters as AdamW's parameter groups, one per kind (parameter_kind) in
    PARAMETER_KINDS' order, each named ("name"), so that every update's Adam measurements are per
    group (passes.adam_metrics). AdamW is elementwise: the groups change no update."""
    groups = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(parameter_kind(name), []).append(p)
    return [{"params": groups[k], "name": k} for k in PARAMETER_KINDS if k in groups]


def reset_optimizer_state(optimizer):
    """AdamW afresh, in place: every moment zeroed and every step count 0, as init_optimizer_state
    makes them, so the next update is the first of a new AdamW (its bias corrections and the warmup
    start again); the parameters (the fp32 master weights) are untouched."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            for key in ("step", "exp_avg", "exp_avg_sq"):
                state[key].zero_()


def reserved_gib():
    """The GiB this process's CUDA caching allocator holds (torch.cuda.memory_reserved: its
    segments, free blocks in them included; not the CUDA context or NCCL's buffers); None without a
    GPU."""
    return torch.cuda.memory_reserved() / 2**30 if torch.cuda.is_available() else None


def release_gradients(optimizer):
    """Free the gradients (fp32, 4 bytes per parameter) and the CUDA cache's blocks: what the
    resident trainer does before the engine wakes. Returns the gradient bytes still held on this
    rank (0)."""
    optimizer.zero_grad(set_to_none=True)
    release_memory()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def release_memory():
    """Collect the garbage of models the caller has dropped (`del`), and return the CUDA cache's
    blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- memory


class SavedActivations:
    """Counts the bytes autograd saves for backward (parameters aside) inside `with meter:`: what
    gradient checkpointing exists to cut. enabled=False: counts nothing (0)."""

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
