"""What the trainer writes and reads back (docs/design.md §2): the policy as the engines load it (policy_tensors:
LoRA merged, a tied head left out; their hashes and fingerprint), saved as an HF directory vLLM loads (save_policy) or
handed to mu_grpo/transfer.py tensor by tensor, and the resumable train state (fp32 weights and AdamW moments, DCP: save_state,
restore). mu_grpo/trainer_model.py builds the policy these read and write; this module reads no script's globals either.
"""
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from mu_grpo import common, records
from mu_grpo.trainer_model import barrier, placement, safetensors_index


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
    left out. What save_policy writes and transfer.PolicySource hands to the engines."""
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
# resume, the hand-off, evaluate.py, tools/plot.py), never recomputed from μ, so stages of any length stay labelled right:
#   stage_updates       updates done in its stage (a train state's "update": the next one to run)
#   run_updates         the run's updates up to it, across stages: what accuracy is plotted against
#   optimizer_updates   AdamW's steps since it was created or last reset; optimize.py's optimizer_boundary=reset
#                       starts it (and the warmup, which counts these) afresh each stage, while run_updates go on
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


def restore(model, optimizer, source, resume, start_policy):
    """Load `source` (state_source's) into the model and optimizer; returns (first update of this stage, the
    counts before this stage {run_updates, optimizer_updates}, the id of the weights the stage started from, a line
    saying what was done). A resume also restores the CPU RNG state and keeps the stage's own start id (its TIS pass
    was computed from those weights); the previous stage's state is known by its state id. Without a state the id is
    the start policy's fingerprint, the run's count continues from its record (a stage trained from a policy alone)
    and AdamW's starts at 0."""
    if source is None:
        run_updates = common.policy_record(start_policy).get("run_updates", 0)
        return 0, {"run_updates": run_updates, "optimizer_updates": 0}, common.policy_fingerprint(start_policy), \
            f"AdamW afresh from {start_policy} ({run_updates} run updates so far)" if run_updates else None
    meta = load_state(model, optimizer, source)
    if resume:
        torch.set_rng_state(torch.tensor(meta["rng"], dtype=torch.uint8))
        return (meta["update"], {k: meta[k] - meta["update"] for k in COUNTS}, meta["start_weights"],
                f"resuming from {source} at update {meta['update']}")
    return (0, {k: meta[k] for k in COUNTS}, meta["state_id"],
            f"continuing the previous stage's fp32 weights and AdamW state from {source} "
            f"({meta['run_updates']} updates so far)")
