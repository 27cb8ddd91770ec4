"""Optimize one stage: μ minibatch updates of the stage policy on its (increasingly stale) rollouts.

    python optimize.py --stage_dir=runs/toy/stage_0                     # one process: CPU or one GPU
    torchrun --nproc_per_node=4 optimize.py --stage_dir=runs/x/stage_0  # FSDP2 over 4 GPUs

The stage's groups are put once in a seeded order and cut into `updates_per_stage` minibatches of
`prompts_per_update` groups: update u trains on minibatch u, data exactly u updates stale, no
response used twice (DESIGN.md §4). An update is one AdamW step on loss.policy_loss: the loss is
summed over packed micro-batches and ranks and divided by the minibatch's kept-token count.

Writes next to --out (default <stage_dir>/policy): the next policy (an HF directory vLLM loads, in the
initial model's dtype), metrics.jsonl (one line per update), optimize_timing.json, and train_state/
(fp32 weights and AdamW moments; DCP, sharded), from which a rerun resumes and the next stage
continues (--init_state): a run's stages are one optimization whose rollouts are refreshed. Derived
caches of the stage (rollout columns, per-stage log-prob passes) go into the stage directory.
"""
import contextlib
import datetime
import gc
import importlib.util
import json
import math
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import common
import loss as L
import rollouts

# ----------------------------------------------------------------------------- hyperparameters
stage_dir = "runs/toy/stage_0"  # holds rollouts/ (JSONL read only; its columns are built there if missing)
policy = ""                     # stage policy to start from (default: the one that generated the rollouts)
out = ""                        # next policy directory (default: <stage_dir>/policy); metrics.jsonl,
                                # train_state/ and the other outputs go next to it (replays: elsewhere)
init_state = ""                 # the previous stage's train_state/: continue its fp32 weights, AdamW moments
                                # and update count (run_stages.sh passes it); empty: `policy`, fresh AdamW
save_train_state = True         # keep train_state/ at the end (the next stage's --init_state)
updates_per_stage = 16          # μ: optimizer updates on this stage's rollouts (paper: 1024; GRPO: 4)
prompts_per_update = 8          # whole groups per update (paper: 64 prompts × G=8 = 512 responses)
skip_zero_variance = False      # True: leave out groups whose rewards are all equal and draw minibatches from
                                # repeated passes over the rest (responses reused: an ablation, not the paper)
seed = 0                        # the seeded order in which the stage's groups become minibatches
lr = 1e-6                       # AdamW learning rate (constant after warmup)
warmup_updates = 0              # linear warmup over the run's first updates (counted across stages)
weight_decay = 0.01
adam_betas = "0.9,0.999"
grad_clip = 1.0                 # max global grad norm
temperature = 0.0               # log-prob temperature; 0: the sampling temperature from the manifest
clip_low = 0.0                  # ratio clip bounds (μ-GRPO 0 and 5; GRPO 0.8 and 1.2; DAPO 0.8 and 1.28)
clip_high = 5.0
dual_clip = None                # c > 1 caps the A<0 loss at −c·A (None: off)
nav_delta = 1e-4                # NAV trigger threshold on the ratio (None: NAV off)
nav_scope = "H"                 # none | T | H | S | seq
m2po_tau = None                 # M2PO second-moment threshold over the whole minibatch (None: off; M2PO: 0.04)
tis_cap = None                  # truncated importance weight cap for engine/trainer mismatch (None: off)
kl_coef = 0.0                   # β of the KL(π ‖ π_ref) penalty (0: none); needs ref_policy's log-probs
kl_estimator = "k3"             # k1 | k2 | k3
ref_policy = ""                 # π_ref (run_stages.sh: the run's first MODEL); empty: the stage policy when
                                # kl_coef > 0, else none. With kl_coef = 0 the KL is logged, not optimized
agg = "token-mean"              # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
token_normalizer = "kept"       # means divide by kept tokens (vetoed/masked ones leave, as verl) | all
norm_len = 0                    # Dr. GRPO constant length (0: the manifest's max response tokens)
micro_batch_tokens = 16384      # tokens (prompt + response) packed into one micro-batch, per GPU
gradient_checkpointing = False  # recompute each layer in backward: activations of one layer at a time
attn_implementation = "auto"    # auto | flash_attention_2 | flex_attention | varlen_sdpa | sdpa (see README)
lora_rank = 0                   # > 0: train LoRA adapters (peft) on all linear layers; merged at save
lora_alpha = 32
checkpoint_every = 0            # updates between resumable states (0: only the final one)
save_policy_every = 0           # also write the policy every K updates, to <out>_u<k> (curves within a stage)
max_nonfinite = 3               # consecutive non-finite updates before the run stops
mismatch_warn = 0.05            # warn when the first update's mean |log ratio| exceeds this
check_packing = False           # update 0: log check/packed_max_abs_diff (packed vs one-sequence forwards)
# -----------------------------------------------------------------------------
common.apply_overrides(globals(), sys.argv[1:])
common.check_choice("nav_scope", nav_scope, L.NAV_SCOPES)
common.check_choice("agg", agg, L.AGG_MODES)
common.check_choice("token_normalizer", token_normalizer, L.TOKEN_NORMALIZERS)
common.check_choice("kl_estimator", kl_estimator, L.KL_ESTIMATORS)
ATTENTION = ("auto", "flash_attention_2", "flex_attention", "varlen_sdpa", "sdpa", "eager")
common.check_choice("attn_implementation", attn_implementation, ATTENTION)
betas = tuple(float(b) for b in adam_betas.split(","))
if updates_per_stage < 0 or prompts_per_update < 1 or micro_batch_tokens < 1:
    sys.exit("--updates_per_stage must be >= 0, --prompts_per_update and --micro_batch_tokens >= 1")

# distributed is an if: torchrun sets WORLD_SIZE
distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
if distributed:  # an hour: rank 0 may build rollout columns or save a 15 GB policy while the others wait
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=1))
is_main = rank == 0
if distributed and lora_rank:
    sys.exit("--lora_rank with torchrun is not supported: LoRA runs in one process (its adapters are small)")
stage_path = Path(stage_dir)
out_dir = Path(out) if out else stage_path / "policy"
work_dir = out_dir.parent                       # everything this run writes lives here
state_dir = work_dir / "train_state"
metrics_path = work_dir / "metrics.jsonl"
deferred_norm = agg == "token-mean" and token_normalizer == "kept"   # divide by the kept count at the end


def log(*args):
    if is_main:
        print(*args, flush=True)


def barrier():
    if distributed:
        dist.barrier()


# ----------------------------------------------------------------------------- packed attention


def varlen_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None, **kwargs):
    """Attention over packed sequences one sequence at a time: causal sdpa within each (position ids
    restart at 0 where a sequence starts), so cost grows with Σ Lᵢ², not N², and no [N, N] mask is
    built. query [1, H, N, D], key/value [1, H_kv, N, D] → [1, N, H, D]. The CPU default (flex
    attention has no backward on CPU); on a GPU each call runs sdpa's flash kernel."""
    starts = torch.nonzero(position_ids[0] == 0).flatten().tolist() + [query.shape[2]]
    gqa = key.shape[1] != query.shape[1]
    outs = [torch.nn.functional.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                             is_causal=True, scale=scaling, enable_gqa=gqa)
            for a, b in zip(starts, starts[1:])]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def register_varlen_sdpa():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register("varlen_sdpa", varlen_sdpa)
    AttentionMaskInterface.register("varlen_sdpa", lambda *args, **kwargs: None)   # no mask to build


def choose_attention():
    """flash-attn's varlen kernel when the package is installed, else varlen_sdpa (sdpa's flash kernel
    per sequence on a GPU). Not flex attention by default: on an H100 (torch 2.11, transformers 5.17)
    its first packed forward was still compiling (transformers' torch.compile'd create_block_mask,
    Triton) after 135 s, while varlen_sdpa ran two updates in 18 s. sdpa builds a dense [N, N]
    block-diagonal mask: the fallback."""
    if attn_implementation != "auto":
        return attn_implementation
    if device.type == "cuda" and importlib.util.find_spec("flash_attn"):
        return "flash_attention_2"
    return "varlen_sdpa"


# ----------------------------------------------------------------------------- the stage's rollouts


def minibatch_schedule(stage):
    """[updates_per_stage, prompts_per_update] group indices: the stage's groups in one seeded order,
    cut into consecutive minibatches, so update u sees groups it alone sees, u updates stale. A stage
    with too few groups wraps into a new seeded order (said loudly: responses are then reused)."""
    candidates = np.arange(len(stage.groups))
    if skip_zero_variance:
        candidates = candidates[~stage.zero_variance]
        log(f"skip_zero_variance: leaving out {int(stage.zero_variance.sum())} of {len(stage.groups)} groups "
            f"with zero reward variance")
    need = updates_per_stage * prompts_per_update
    if need == 0:
        return np.zeros((0, prompts_per_update), dtype=np.int64)
    if len(candidates) < prompts_per_update:
        raise SystemExit(f"{stage.directory}: {len(candidates)} usable groups, fewer than --prompts_per_update="
                         f"{prompts_per_update}")
    if need > len(candidates):
        log(f"WARNING: {updates_per_stage} updates × {prompts_per_update} prompts need {need} groups but the stage "
            f"has {len(candidates)} usable: the schedule wraps into {need / len(candidates):.2f} passes, so responses "
            f"are reused and update u is no longer exactly u updates stale")
    elif need < len(candidates):
        log(f"note: {len(candidates) - need} of the stage's {len(candidates)} groups are left unused "
            f"({updates_per_stage} updates × {prompts_per_update} prompts)")
    order = common.shuffled_window(candidates.tolist(), 0, need, seed)
    return np.asarray(order, dtype=np.int64).reshape(updates_per_stage, prompts_per_update)


def micro_batches(responses):
    """Micro-batches of at most micro_batch_tokens tokens (prompt + response), longest first; each
    is packed into one row, so no compute goes to padding."""
    lengths = stage.prompt_len[responses] + stage.response_len[responses]
    order = np.argsort(-lengths, kind="stable")
    batches, current, tokens = [], [], 0
    for i, n in zip(responses[order].tolist(), lengths[order].tolist()):
        if current and tokens + n > micro_batch_tokens:
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    return batches + ([current] if current else [])


def padded_micro_batches(responses):
    """This rank's micro-batches, padded with None to the largest count over the ranks: FSDP's
    collectives need every rank to run the same number of forward/backward passes."""
    mbs = micro_batches(np.asarray(responses, dtype=np.int64))
    if distributed:
        count = torch.tensor([len(mbs)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        mbs += [None] * (int(count) - len(mbs))
    return mbs


def pack(mb, columns):
    """One packed row for the model and per-response tensors for the loss, on the device.

    input_ids, position_ids [1, N]: the sequences back to back, positions restarting at 0 for each;
    keep [R]: the positions whose logits predict a response token; targets [R]; behavior and each
    extra column (TIS old, KL reference) [b, T]; mask [b, T]; advantages [b]."""
    parts = [stage.tokens(i) for i in mb]
    seq = [len(p) + len(r) for p, r, _ in parts]
    start = np.concatenate([[0], np.cumsum(seq)[:-1]])
    ids = np.concatenate([np.concatenate([p, r]) for p, r, _ in parts]).astype(np.int64)
    pos = np.concatenate([np.arange(n) for n in seq])
    keep = np.concatenate([np.arange(s + len(p) - 1, s + len(p) + len(r) - 1) for s, (p, r, _) in zip(start, parts)])
    lens = np.array([len(r) for _, r, _ in parts])
    mask = np.arange(lens.max())[None, :] < lens[:, None]                    # [b, T]

    def per_token(values):
        out = np.zeros(mask.shape, dtype=np.float32)
        out[mask] = np.concatenate(values)
        return torch.from_numpy(out).to(device)

    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)      # noqa: E731
    return dict(ids=t(ids)[None], pos=t(pos)[None], keep=t(keep), targets=t(np.concatenate([r for _, r, _ in parts])
                                                                               .astype(np.int64)),
                behavior=per_token([b for _, _, b in parts]), mask=t(mask), adv=t(stage.advantage[mb]),
                **{name: per_token([col.get(stage, i) for i in mb]) for name, col in columns.items()})


def forward(model, mb, columns=None, with_entropy=False):
    """Current log-probs [b, T] (0 on padding) of a micro-batch's response tokens, with the packed
    tensors. Logits are computed only at response positions ([R, V], bf16 on GPU);
    token_logprobs upcasts them chunk by chunk."""
    x = pack(mb, columns or {})
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" and not distributed):
        logits = model(input_ids=x["ids"], position_ids=x["pos"], logits_to_keep=x["keep"], use_cache=False).logits[0]
    lp_flat = L.token_logprobs(logits, x["targets"], temp)                          # [R] fp32
    x["lp"] = torch.zeros(x["mask"].shape, device=device).masked_scatter(x["mask"], lp_flat)
    if with_entropy:
        x["entropy_sum"] = L.token_entropy(logits.detach(), temp).sum()
    return x


# ----------------------------------------------------------------------------- the model


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no init cost) and their
    buffers as usual: non-persistent buffers (rotary frequencies) are computed in __init__ and are in
    no checkpoint."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        p = module._parameters[name]
        if p is not None and p.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def safetensors_index(path):
    """{tensor name: file} of an HF checkpoint directory."""
    index = Path(path) / "model.safetensors.index.json"
    if index.exists():
        return {k: Path(path) / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{path}: no *.safetensors weights (convert .bin checkpoints with save_pretrained first)")
    from safetensors import safe_open
    found = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            found.update({k: f for k in sf.keys()})
    return found


def checkpoint_dtype(path):
    """The floating dtype of a checkpoint's weights, read from the safetensors header."""
    from safetensors import safe_open
    index = safetensors_index(path)
    name, file = next(iter(index.items()))
    with safe_open(str(file), "pt") as sf:
        return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(
            sf.get_slice(name).get_dtype(), torch.float32)


@torch.no_grad()
def load_weights(model, path):
    """Fill the model's parameters from an HF checkpoint, each rank reading only its own rows: FSDP2
    shards every parameter along dim 0 in chunks of ceil(n / world) rows (torch.chunk), and
    safetensors' get_slice reads just those. No rank ever holds the whole model."""
    from safetensors import safe_open
    index = safetensors_index(path)
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), "pt")) for f in set(index.values())}
        for name, param in model.named_parameters():               # tied weights appear once
            if name not in index:
                raise SystemExit(f"{path}: the checkpoint has no tensor {name!r} (its names must match the "
                                 f"transformers class of its config)")
            local = param.to_local() if hasattr(param, "to_local") else param
            start = rank * math.ceil(param.shape[0] / world) if hasattr(param, "to_local") else 0
            if local.shape[0]:
                local.copy_(handles[index[name]].get_slice(name)[start:start + local.shape[0]])
        for name, buf in model.named_buffers():                     # persistent buffers, if any are saved
            if name in index:
                buf.copy_(handles[index[name]].get_tensor(name))


def build_model(source, weights=True, trainable=True):
    """The policy as the trainer runs it: fp32 master weights (bf16 compute on a GPU), dropout off,
    train mode, the chosen attention, gradient checkpointing; FSDP2-sharded under torchrun. Built on
    the meta device, sharded, then filled from `source`'s safetensors shard by shard (weights=False:
    left empty for a DCP state)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(source)
    for key, value in list(vars(config).items()):    # RL log-probs must be deterministic in train mode
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)
    config.use_cache = False
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
    if gradient_checkpointing and trainable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if distributed:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                  reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
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
        from peft import LoraConfig, get_peft_model
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


def save_state(model, optimizer, update, final=False):
    """Resumable state, atomically: written to train_state.tmp, then renamed over train_state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    tmp = state_dir.with_name("train_state.tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    barrier()
    if is_main:
        common.atomic_write_json(tmp / "progress.json", {
            "update": update, "global_update": update_offset + update, "complete": final, "world": world,
            "state_id": uuid.uuid4().hex[:16], "start_weights": start_weights, "rng": torch.get_rng_state().tolist()})
        old = state_dir.with_name("train_state.old")
        shutil.rmtree(old, ignore_errors=True)
        if state_dir.exists():
            os.replace(state_dir, old)
        os.replace(tmp, state_dir)
        shutil.rmtree(old, ignore_errors=True)
        common.fsync_dir(work_dir)
    barrier()


def load_state(model, optimizer, directory):
    """Load a train_state (DCP; any number of ranks) into the model and optimizer; its progress.json."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads((Path(directory) / "progress.json").read_text())


def full_state(model, dtype):
    """{name: full tensor in dtype, on CPU} on rank 0 (None elsewhere), one parameter gathered at a time;
    LoRA adapters merged into their base weights without touching the model."""
    base = model.get_base_model() if lora_rank else model
    state = {}
    for name, t in base.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if is_main and "lora_" not in name:
            state[name.replace(".base_layer.", ".")] = full.detach().to(dtype).cpu()
    if lora_rank:
        from peft.tuners.lora import LoraLayer
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and "default" in module.lora_A:
                key = f"{name}.weight"
                state[key] = (state[key].float() + module.get_delta_weight("default").detach().float().cpu()).to(dtype)
    return state if is_main else None


def save_policy(model, source_dir, dtype, directory, updates):
    """The policy as an HF directory vLLM loads: full weights in `dtype` (the initial model's), a config
    that says so, the source's tokenizer and generation files, and policy_id.json (a content hash, the
    stage, and the updates done in the stage and in the run, for curves over updates)."""
    state = full_state(model, dtype)
    if is_main:
        bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
        if bad:
            raise SystemExit(f"refusing to save non-finite weights ({bad[:3]}...)")
        base = model.get_base_model() if lora_rank else model
        if getattr(base.config, "tie_word_embeddings", False):  # gathered per rank, the tie is two copies here:
            head = base.get_output_embeddings()                  # save it once, as the source checkpoint did
            state.pop(next(f"{n}.weight" for n, m in base.named_modules() if m is head), None)
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
        common.atomic_write_json(tmp / common.POLICY_ID_FILE, {
            "fingerprint": common.content_fingerprint(tmp), "stage": stage.manifest["stage"], "updates_in_stage": updates,
            "global_updates": update_offset + updates})
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
        common.fsync_dir(directory.parent)
    barrier()


# ----------------------------------------------------------------------------- per-stage log-prob passes


def logprob_pass(model, name, key, may_compute=True):
    """A model's log-probs of every response token of the stage, computed once: one no-grad pass
    (sharded like training) before the first update, stored as a TokenColumn in the stage's logprobs/
    and read like the behavior log-probs, so a resume or a replay with the same model reuses it. TIS's
    old log-probs (the stage policy) and KL's reference log-probs are both such passes."""
    root = stage_path / "logprobs" if os.access(stage_path, os.W_OK) else work_dir / "logprobs"
    path = root / f"{name}-{key}-T{temp}.f32"
    n_tokens = int(stage.token_offset[-1])
    if is_main:
        rollouts.TokenColumn(path, n_tokens, create=True)
    barrier()
    column = rollouts.TokenColumn(path, n_tokens, create=False)
    if column.complete:
        log(f"{name} log-probs: stored in {path}")
        return column, 0.0
    if not may_compute:
        raise SystemExit(f"{path} is incomplete but training already started: the stage policy's log-probs cannot "
                         f"be recomputed from moved weights; delete {state_dir} to restart the stage")
    t0 = time.perf_counter()
    mine = np.arange(rank, stage.n, world)
    todo = mine[column.missing(stage)[mine]]
    log(f"{name} log-probs: one pass over {stage.n} responses ({len(todo)} still to do on rank 0) → {path}")
    from tqdm import tqdm
    with torch.no_grad():
        for k, mb in enumerate(tqdm(padded_micro_batches(todo), disable=not is_main, desc=f"{name} pass")):
            x = forward(model, mb if mb is not None else [0])
            for j, i in enumerate(mb or []):
                column.put(stage, i, x["lp"][j, :stage.response_len[i]].cpu().numpy())
            if k % 64 == 63:
                column.flush()
    column.flush()
    barrier()
    if is_main:
        column.mark_complete({"model": key, "temperature": temp, "responses": stage.n})
    barrier()
    return rollouts.TokenColumn(path, n_tokens, create=False), time.perf_counter() - t0


# ----------------------------------------------------------------------------- one update


def m2po_minibatch_cutoff(model, mbs, columns):
    """M2PO's cutoff over the whole minibatch: a no-grad pass over this rank's micro-batches, then every
    rank's harmful (log ρ)² gathered, so the mask does not depend on the number of GPUs."""
    sq = [torch.zeros(0, device=device)]
    with torch.no_grad():
        for mb in mbs:
            x = forward(model, mb if mb is not None else [0], columns)
            if mb is None:
                continue
            reference = x["old"] if "old" in x and tis_cap is not None else x["behavior"]
            log_ratio = torch.clamp(x["lp"] - reference, -L.LOG_RATIO_LIMIT, L.LOG_RATIO_LIMIT) * x["mask"]
            sq.append((log_ratio ** 2)[L.m2po_harmful(log_ratio, x["adv"], x["mask"])])
    sq = torch.cat(sq)
    if distributed:
        sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([sq.numel()], device=device))
        longest = max(int(s) for s in sizes)
        parts = [torch.zeros(longest, device=device) for _ in range(world)]
        dist.all_gather(parts, torch.nn.functional.pad(sq, (0, longest - sq.numel())))
        sq = torch.cat([p[:int(s)] for p, s in zip(parts, sizes)])
    return L.m2po_cutoff(sq, m2po_tau)


def reduce_stats(stats):
    """Sum the ranks' stats (extremes: min/max), two collectives in all."""
    if not distributed:
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


def saved_activation_bytes():
    """A context counting the bytes autograd saves for backward (parameters aside): what gradient
    checkpointing exists to cut. Returns (context, counter list)."""
    total, seen = [0], set()

    def pack_hook(t):
        if not isinstance(t, torch.nn.Parameter):
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total[0] += key[1]
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t), total


def packing_check(model, mb):
    """Largest |log-prob difference| between the packed forward of micro-batch `mb` and forwards of
    its sequences one at a time (the first 8): the attention implementation keeps sequences apart."""
    with torch.no_grad():
        packed = forward(model, mb or [0])
        worst = torch.zeros((), device=device)
        singles = (mb or [])[:8]
        count = torch.tensor([len(singles)], device=device)
        if distributed:
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        for j in range(int(count)):
            if j < len(singles):
                one = forward(model, [singles[j]])["lp"][0]
                n = int(stage.response_len[singles[j]])
                worst = torch.maximum(worst, (one[:n] - packed["lp"][j, :n]).abs().max())
            else:
                forward(model, [0])
    return worst


def empty_stats(columns, cutoff):
    """policy_loss's stats of no tokens (zeros; extremes ±inf), with the same names as a real call's."""
    zero, none = torch.zeros(1, 1, device=device), torch.zeros(1, 1, dtype=torch.bool, device=device)
    stats = L.policy_loss(zero, zero, zero[0], none, **loss_kw, m2po_cutoff=cutoff,
                          old_logprobs=zero if tis_cap is not None else None,
                          ref_logprobs=zero if "ref" in columns else None)[1]
    stats["entropy_sum"] = stats["saved_activations_gib_max"] = torch.zeros((), device=device)
    return stats


def run_update(model, optimizer, u, batch, columns, trainable):
    """One AdamW update on the minibatch `batch` (response indices). Returns (metrics, stepped)."""
    lengths = stage.prompt_len[batch] + stage.response_len[batch]
    mine = batch[np.argsort(-lengths, kind="stable")][rank::world]              # balanced by length
    mbs = padded_micro_batches(mine)
    cutoff = m2po_minibatch_cutoff(model, mbs, columns) if m2po_tau is not None else None
    optimizer.zero_grad(set_to_none=True)
    n_tokens = int(stage.response_len[batch].sum())
    stats = empty_stats(columns, cutoff)     # a rank may have no response of this minibatch
    for k, mb in enumerate(mbs):
        measure, saved = saved_activation_bytes() if u == start and k == 0 else (contextlib.nullcontext(), [0])
        with measure:
            x = forward(model, mb if mb is not None else [0], columns, with_entropy=True)
        if mb is None:                 # padding pass: keeps FSDP's collectives in step, adds nothing
            (x["lp"].sum() * 0.0).backward()
            continue
        part, s = L.policy_loss(x["lp"], x["behavior"], x["adv"], x["mask"], **loss_kw, m2po_cutoff=cutoff,
                                old_logprobs=x.get("old") if tis_cap is not None else None, ref_logprobs=x.get("ref"),
                                num_tokens=1.0 if deferred_norm else n_tokens, num_seqs=len(batch))
        (part * world).backward()      # FSDP averages gradients over ranks; ×world makes it the sum
        s["entropy_sum"] = x["entropy_sum"]
        s["saved_activations_gib_max"] = torch.tensor(saved[0] / 2**30, device=device)
        stats = L.merge_stats(stats, s)
    if device.type == "cuda":
        stats["memory_peak_gib_max"] = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30, device=device)
    stats = reduce_stats(stats)
    if deferred_norm:              # Σ kept loss / N_kept: the count is known only now (NAV uses the current ratios)
        scale = 1.0 / stats["kept"].clamp(min=1.0)
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in trainable if p.grad is not None]
        torch._foreach_mul_(grads, scale)
        stats["loss"] = stats["loss"] * scale
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, grad_clip)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    extra = {"grad_norm": grad_norm, "entropy": stats["entropy_sum"] / stats["tokens"].clamp(min=1.0),
             "memory/saved_activations_gib": stats["saved_activations_gib_max"]}
    if "memory_peak_gib_max" in stats:
        extra["memory/peak_gib"] = stats["memory_peak_gib_max"]
    m = L.metrics(stats, extra)                                                   # the one host sync
    stepped = math.isfinite(m["grad_norm"]) and math.isfinite(m["loss/policy"])
    if stepped:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    return m, stepped


# ----------------------------------------------------------------------------- main


def main():
    global stage, temp, attention, loss_kw, start, update_offset, start_weights
    t_start = time.perf_counter()
    try:
        stage = rollouts.open_stage(stage_path / "rollouts", rank, world, barrier)
    except rollouts.RolloutError as e:
        raise SystemExit(str(e)) from None
    manifest = stage.manifest
    start_policy = common.local_dir(policy or manifest["policy"])
    temp = temperature or manifest["sampling"]["temperature"]
    if temperature and temperature != manifest["sampling"]["temperature"]:
        log(f"WARNING: --temperature={temperature} differs from the sampling temperature "
            f"{manifest['sampling']['temperature']}: the ratios will not start at 1")
    attention = choose_attention()
    if attention == "varlen_sdpa":
        register_varlen_sdpa()
    schedule = minibatch_schedule(stage)
    G = stage.group_size
    tokens_per_group = stage.response_len.sum() / max(1, len(stage.groups))
    log(f"stage {manifest['stage']}: {len(stage.groups)} groups × G={G} ({int(stage.zero_variance.sum())} with zero "
        f"reward variance, kept: zero advantage); {updates_per_stage} updates of {prompts_per_update} prompts "
        f"({prompts_per_update * G} responses, ~{tokens_per_group * prompts_per_update:.0f} response tokens); "
        f"staleness 0..{max(updates_per_stage - 1, 0)} updates; {world} process(es) on {device.type}, attention "
        f"{attention}; temperature {temp}; clip [{clip_low}, {clip_high}], dual clip {dual_clip}, NAV δ={nav_delta} "
        f"scope {nav_scope}, M2PO τ={m2po_tau}, TIS cap {tis_cap}, KL β={kl_coef} ({kl_estimator}), agg {agg} "
        f"over {token_normalizer} tokens")

    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(start_policy).vocab_size
    if stage.max_token_id() >= vocab:
        raise SystemExit(f"{stage.directory}: token id {stage.max_token_id()} ≥ the policy's vocabulary size {vocab}: "
                         f"rollouts made with another tokenizer?")
    save_dtype = checkpoint_dtype(start_policy)           # every stage's policy keeps the initial model's dtype
    torch.manual_seed(seed)
    loss_kw = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, nav_delta=nav_delta,
                   nav_scope=nav_scope, m2po_tau=m2po_tau, tis_cap=tis_cap, kl_coef=kl_coef,
                   kl_estimator=kl_estimator, agg=agg, token_normalizer=token_normalizer,
                   norm_len=norm_len or manifest["sampling"]["max_tokens"])

    # π_ref's log-probs first (its model is freed before the trainer's is built)
    columns, timing = {}, {}
    reference = common.local_dir(ref_policy) if ref_policy else (start_policy if kl_coef else "")
    if reference:
        if not ref_policy:
            log(f"KL reference: the stage policy {start_policy} (pass --ref_policy=<the run's first model> for the usual π_ref)")
        ref_model = build_model(reference, trainable=False)
        columns["ref"], timing["ref_pass_seconds"] = logprob_pass(ref_model, "ref", common.policy_fingerprint(reference))
        del ref_model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    progress = state_dir / "progress.json"
    resume = progress.exists()
    source_state = state_dir if resume else (Path(init_state) if init_state else None)
    model = build_model(start_policy, weights=source_state is None)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=betas, weight_decay=weight_decay, eps=1e-8)
    start, update_offset, start_weights = 0, 0, common.policy_fingerprint(start_policy)
    if source_state is not None:
        if not (source_state / "progress.json").exists():
            raise SystemExit(f"--init_state={init_state}: no progress.json there (not a train_state directory)")
        meta = load_state(model, optimizer, source_state)
        if resume:
            start, update_offset = meta["update"], meta["global_update"] - meta["update"]
            torch.set_rng_state(torch.tensor(meta["rng"], dtype=torch.uint8))
            start_weights = meta["start_weights"]         # what TIS's old log-probs were computed from
            log(f"resuming from {state_dir} at update {start}")
        else:
            update_offset = meta["global_update"]
            start_weights = meta["state_id"]
            log(f"continuing the previous stage's fp32 weights and AdamW state from {init_state} "
                f"({update_offset} updates so far)")
    if tis_cap is not None:
        columns["old"], timing["old_pass_seconds"] = logprob_pass(model, "old", start_weights, may_compute=start == 0)
    if is_main:  # metrics lines after the resumed update are dropped, so the file matches an unbroken run
        work_dir.mkdir(parents=True, exist_ok=True)
        rows = common.read_jsonl(metrics_path) if metrics_path.exists() else []
        common.atomic_write_lines(metrics_path, [r for r in rows if r.get("update", 0) < start])
    timing["load_seconds"] = time.perf_counter() - t_start - sum(timing.values())
    if check_packing and start < updates_per_stage:
        first = stage.groups[schedule[start]].ravel()
        mb = padded_micro_batches(first[np.argsort(-stage.response_len[first], kind="stable")][rank::world])[0]
        packed_diff = packing_check(model, mb)
        if distributed:
            dist.all_reduce(packed_diff, op=dist.ReduceOp.MAX)
    nonfinite_in_row, skipped_total, train_seconds = 0, 0, 0.0
    from tqdm import tqdm
    bar = tqdm(range(start, updates_per_stage), disable=not is_main, desc=f"stage {manifest['stage']} updates",
               initial=start, total=updates_per_stage)
    for u in bar:
        t0 = time.perf_counter()
        g = update_offset + u                               # the run's update count (warmup spans stages)
        lr_now = lr * min(1.0, (g + 1) / warmup_updates) if warmup_updates else lr
        for group in optimizer.param_groups:
            group["lr"] = lr_now
        batch = stage.groups[schedule[u]].ravel()           # whole groups: response indices
        m, stepped = run_update(model, optimizer, u, batch, columns, trainable)
        if stepped:
            nonfinite_in_row = 0
        else:
            nonfinite_in_row += 1
            skipped_total += 1
            if nonfinite_in_row >= max_nonfinite:
                raise SystemExit(f"{nonfinite_in_row} non-finite updates in a row (at update {u}): stopping; "
                                 f"lower --lr or check the rollouts")
        seconds = time.perf_counter() - t0
        train_seconds += seconds
        row = {"update": u, "global_update": g, "stage": manifest["stage"], "staleness": u, "lr": lr_now,
               "reward/mean": float(stage.reward[batch].mean()),
               "minibatch/zero_variance_frac": float(stage.zero_variance[schedule[u]].mean()),
               "groups": [stage.group_keys[i] for i in schedule[u]],     # which prompts (stage positions)
               "skipped_nonfinite": skipped_total, "update_skipped": not stepped, "time": time.time(),
               "seconds": seconds, "tokens": int((stage.prompt_len[batch] + stage.response_len[batch]).sum())}
        row["tokens_per_s"] = row["tokens"] / seconds
        row.update({k: v for k, v in m.items() if u == 0 or not k.startswith("mismatch/")})
        if u == start and check_packing:
            row["check/packed_max_abs_diff"] = packed_diff.item()
        if u == 0 and m["mismatch/mean_abs_log_ratio"] > mismatch_warn:
            log(f"WARNING: before any update the mean |log ratio| between trainer and engine is "
                f"{m['mismatch/mean_abs_log_ratio']:.3f} (> {mismatch_warn}): check the temperature, top_p/top_k "
                f"and that --policy is the checkpoint that generated the rollouts")
        row = {k: (common.finite_or_none(v) if isinstance(v, float) else v) for k, v in row.items()}
        if is_main:
            common.append_jsonl(metrics_path, row)
            bar.set_postfix(loss=f"{m['loss/policy']:.4f}", reward=f"{row['reward/mean']:.2f}",
                            ratio_neg=f"{m['ratio/mean_neg_adv']:.3f}")
        done = u + 1
        if save_policy_every and done % save_policy_every == 0 and done < updates_per_stage:
            save_policy(model, start_policy, save_dtype, out_dir.with_name(f"{out_dir.name}_u{done:05d}"), done)
        if checkpoint_every and done % checkpoint_every == 0 and done < updates_per_stage:
            save_state(model, optimizer, done)
    t_save = time.perf_counter()
    if save_train_state:
        save_state(model, optimizer, updates_per_stage, final=True)
    save_policy(model, start_policy, save_dtype, out_dir, updates_per_stage)
    if not save_train_state and is_main:
        shutil.rmtree(state_dir, ignore_errors=True)
    peak_rss = torch.tensor([common.peak_rss_gib()], device=device)
    if distributed:
        parts = [torch.zeros(1, device=device) for _ in range(world)]
        dist.all_gather(parts, peak_rss)
        peak_rss = torch.cat(parts)
    if is_main:
        timing.update({"train_seconds": train_seconds, "save_seconds": time.perf_counter() - t_save,
                       "updates_this_run": updates_per_stage - start, "world": world, "attention": attention,
                       "peak_rss_gib_per_rank": peak_rss.tolist()})
        common.atomic_write_json(work_dir / "optimize_timing.json", timing)
        log(f"next policy written to {out_dir} ({', '.join(f'{k} {v:.1f}' for k, v in timing.items() if k.endswith('seconds'))})")
    if distributed:
        # FSDP2's device mesh holds the process groups: drop the model and optimizer first, so the groups'
        # gloo/NCCL threads are shut down and joined here, by destroy_process_group, and not during
        # interpreter teardown (a 3-rank gloo run once aborted there: "terminate called without an
        # active exception")
        del model, optimizer, trainable
        gc.collect()
        barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
