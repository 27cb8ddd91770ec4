"""The trainer's passes over a stage and the checks around its updates (docs/design.md §2): the
stage opened on every rank and checked against the policy; packed micro-batches (the responses back
to back in one row, at most a token budget each, so no compute goes to padding) and the forward pass
over one; the per-stage log-prob passes (TIS's old, KL's reference), stored once as columns of the
stage; the check that the engines' log-probs are the trainer's before a stage's first update, and
that packing keeps sequences apart; what AdamW's step read and took. update.py makes an update from
these passes.

Placement (rank, world size, device) is read from torch (model.placement()); the knobs are
arguments. This module reads no script's globals.
"""
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
import torch.distributed as dist

import loss as L
from mu_grpo import common, records, rollouts
from mu_grpo import trainer_model as M
from mu_grpo.trainer_model import log


# -------------------------------------------------------------------------- the stage's minibatches


def open_stage(directory):
    """A stage directory's rollouts (rollouts.open_stage) on every rank (placement from torch; rank
    0 decides what the filesystem says); a file that cannot be trained on stops the run in one line
    naming its file and line."""
    rank, world, _ = M.placement()
    try:
        return rollouts.open_stage(Path(directory) / records.ROLLOUTS, rank, world, M.barrier,
                                   decide=M.broadcast)
    except rollouts.RolloutError as e:
        raise SystemExit(str(e)) from None


def check_fits(stage, policy):
    """Refuse in one line rollouts the policy cannot take: a token id past its vocabulary (another
    tokenizer), or a prompt and response longer than it holds (common.model_max_len, as vLLM derives
    it: another model or longer length flags), which the trainer would run past its positions
    silently."""
    if stage.max_token_id() >= (vocab := M.vocab_size(policy)):
        raise SystemExit(f"{stage.directory}: token id {stage.max_token_id()} ≥ the policy's "
                         f"vocabulary size {vocab}: rollouts made with another tokenizer?")
    limit, key = common.model_max_len(policy)
    longest = int((stage.prompt_len + stage.response_len).max(initial=0))
    if limit is not None and longest > limit:
        raise SystemExit(f"{stage.directory}: a prompt and response of {longest} tokens, more than "
                         f"the policy {policy} holds ({key} = {limit}): rollouts made with another "
                         "model, or with --max_prompt_tokens + --max_response_tokens above its "
                         "limit?")


# ----------------------------------------------------------------------------- packed micro-batches


def micro_batches(stage, responses, micro_batch_tokens):
    """This rank's micro-batches of at most micro_batch_tokens tokens (prompt + response), longest
    first, each packed into one row (no compute goes to padding); under torchrun padded with None to
    the largest count over the ranks, since FSDP's collectives need every rank to run as many
    passes."""
    _, world, device = M.placement()
    responses = np.asarray(responses, dtype=np.int64)
    lengths = stage.prompt_len[responses] + stage.response_len[responses]
    order = np.argsort(-lengths, kind="stable")
    batches, current, tokens = [], [], 0
    for i, n in zip(responses[order].tolist(), lengths[order].tolist()):
        if current and tokens + n > micro_batch_tokens:
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    batches += [current] if current else []
    if world > 1:
        count = torch.tensor([len(batches)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        batches += [None] * (int(count) - len(batches))
    return batches


def pack(stage, mb, columns):
    """One packed row for the model and per-response tensors for the loss, on the device.

    input_ids, position_ids [1, N]: the sequences back to back, positions restarting at 0 for each;
    keep [R]: the positions whose logits predict a response token; targets [R]; behavior and each
    extra column (TIS old, KL reference) [b, T]; mask [b, T]; advantages [b]."""
    _, _, device = M.placement()
    parts = [stage.tokens(i) for i in mb]
    seq = [len(p) + len(r) for p, r, _ in parts]
    start = np.concatenate([[0], np.cumsum(seq)[:-1]])
    ids = np.concatenate([np.concatenate([p, r]) for p, r, _ in parts]).astype(np.int64)
    pos = np.concatenate([np.arange(n) for n in seq])
    keep = np.concatenate(
        [np.arange(s + len(p) - 1, s + len(p) + len(r) - 1) for s, (p, r, _) in zip(start, parts)])
    lens = np.array([len(r) for _, r, _ in parts])
    mask = np.arange(lens.max())[None, :] < lens[:, None]                    # [b, T]

    def per_token(values):
        out = np.zeros(mask.shape, dtype=np.float32)
        out[mask] = np.concatenate(values)
        return torch.from_numpy(out).to(device)

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    targets = np.concatenate([r for _, r, _ in parts]).astype(np.int64)
    return dict(ids=t(ids)[None], pos=t(pos)[None], keep=t(keep), targets=t(targets),
                behavior=per_token([b for _, _, b in parts]), mask=t(mask),
                adv=t(stage.advantage[mb]),
                **{name: per_token([col.get(stage, i) for i in mb])
                   for name, col in columns.items()})


def forward(model, stage, mb, temp, columns=None, with_entropy=False, bf16=None):
    """Current log-probs [b, T] (0 on padding) of micro-batch `mb`'s response tokens at temperature
    temp, with the packed tensors; mb None (a padding pass) runs response 0. Logits are computed
    only at response positions ([R, V], bf16 on GPU); token_logprobs upcasts them chunk by chunk.
    bf16: autocast to bfloat16 (None: on one GPU, the trainer's rule; tools/gpu_check.py compares
    both)."""
    _, world, device = M.placement()
    x = pack(stage, mb if mb is not None else [0], columns or {})
    bf16 = device.type == "cuda" and world == 1 if bf16 is None else bf16
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=x["ids"], position_ids=x["pos"], logits_to_keep=x["keep"],
                       use_cache=False).logits[0]
    lp_flat = L.token_logprobs(logits, x["targets"], temp)                          # [R] fp32
    x["lp"] = torch.zeros(x["mask"].shape, device=device).masked_scatter(x["mask"], lp_flat)
    if with_entropy:
        x["entropy_sum"] = L.token_entropy(logits.detach(), temp).sum()
    return x


# ------------------------------------------------------------------------ per-stage log-prob passes


def logprob_pass(model, stage, temp, name, key, work_dir, micro_batch_tokens, resumed_state=None):
    """A model's log-probs of every response token of the stage, computed once: one no-grad pass
    (sharded like training) before the first update, stored as a TokenColumn in the stage's
    logprobs/ (or work_dir's, when the stage directory is read-only) and read like the behavior
    log-probs, so a resume or a replay with the same model reuses it. TIS's old log-probs (the stage
    policy) and KL's reference log-probs are both such passes. resumed_state: the train state of a
    stage already under way, whose weights have moved, so an incomplete pass cannot be computed any
    more. Returns the column and the seconds spent."""
    rank, world, _ = M.placement()
    stage_path = stage.directory.parent
    root = stage_path / "logprobs" if os.access(stage_path, os.W_OK) else work_dir / "logprobs"
    path = root / f"{name}-{key}-T{temp}.f32"
    n_tokens = int(stage.token_offset[-1])
    column = None
    if rank == 0:        # rank 0 alone writes the column: a killed pass's parts first
        column = rollouts.TokenColumn(path, n_tokens, create=True)
        if not column.complete and (parts := column.parts()):
            log(f"{name} log-probs: {column.merge_parts(stage, parts)} responses from a killed "
                "pass kept")
    complete, missing = M.broadcast((column.complete, column.missing(stage)) if rank == 0 else None)
    if complete:
        log(f"{name} log-probs: stored in {path}")
        return stored_column(path, n_tokens), 0.0
    if resumed_state is not None:
        raise SystemExit(f"{path} is incomplete but training already started: the stage policy's "
                         "log-probs cannot be recomputed from moved weights; delete "
                         f"{resumed_state} to restart the stage")
    t0 = time.perf_counter()
    mine = np.arange(rank, stage.n, world)
    todo = mine[missing[mine]]
    log(f"{name} log-probs: one pass over {stage.n} responses ({len(todo)} still to do on rank 0) "
        f"→ {path}")
    written, indices, values = [], [], []
    with torch.no_grad():
        batches = micro_batches(stage, todo, micro_batch_tokens)
        for k, mb in enumerate(tqdm(batches, disable=rank != 0, desc=f"{name} pass")):
            x = forward(model, stage, mb, temp)
            for j, i in enumerate(mb or []):
                indices.append(i)
                values.append(x["lp"][j, :stage.response_len[i]].cpu().numpy())
            if k % 64 == 63:                     # a killed pass keeps what its parts hold
                written.append(
                    rollouts.write_column_part(path, rank, len(written), indices, values))
                indices, values = [], []
    if indices:
        written.append(rollouts.write_column_part(path, rank, len(written), indices, values))
    everyone = M.gather_lists([str(p) for p in written])
    if rank == 0:
        common.wait_visible(everyone)           # other nodes' parts
        column.merge_parts(stage, [Path(p) for p in everyone])
        if (left := int(column.missing(stage).sum())):
            raise SystemExit(f"{path}: {left} responses have no {name} log-probs after the pass (a "
                             "rank's part lost?)")
        column.mark_complete({"model": key, "temperature": temp, "responses": stage.n})
    M.barrier()
    return stored_column(path, n_tokens), time.perf_counter() - t0


def stored_column(path, n_tokens):
    """A complete column, read-only (rank 0 wrote it; on other nodes, once visible)."""
    common.wait_visible([Path(str(path) + ".complete")])
    return rollouts.TokenColumn(path, n_tokens, create=False, readonly=True)


# -------------------------------------------------------------- checks: engines' log-probs, packing


def agreement_bound():
    """The largest mean |ℓ − b| per token between trainer and engine on the same weights, on this
    device (loss.AGREEMENT_MEAN: float32 noise on a CPU, measured ~5e-7 on the toy; bf16 rounding on
    a GPU, reasoned)."""
    return L.AGREEMENT_MEAN.get(M.placement()[2].type, L.AGREEMENT_MEAN["cuda"])


def response_engines(stage):
    """[n]: the engine that generated each response (its shard's stats.json, generate.py
    `engine_index`; 0 for a shard without one, written by other code than generate.py)."""
    stats = [sh.path.with_suffix(".stats.json") for sh in stage.shards]
    per_shard = [json.loads(p.read_text()).get("engine", 0) if p.exists() else 0 for p in stats]
    return np.asarray(per_shard,
                      dtype=np.int64)[stage.shard_of] if stage.n else np.zeros(0, np.int64)


def engine_agreement(model, stage, temp, responses, micro_batch_tokens):
    """Before a stage's first update, for up to `responses` responses of each engine's shards: the
    mean |ℓ − b| per token between the trainer's and the stored behavior log-probs, and the
    trainer's mean token entropy over them. Returns ({engine: its mean}, the entropy)."""
    rank, world, device = M.placement()
    engines = response_engines(stage)
    n_engines = int(engines.max()) + 1 if engines.size else 0
    chosen = np.concatenate([np.flatnonzero(engines == e)[:responses] for e in range(n_engines)])
    # Σ |ℓ − b|, tokens; last: Σ entropy
    sums = torch.zeros(n_engines + 1, 2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for mb in micro_batches(stage, chosen[rank::world], micro_batch_tokens):
            x = forward(model, stage, mb, temp, with_entropy=True)
            for j, i in enumerate(mb or []):
                k = int(stage.response_len[i])
                sums[engines[i], 0] += (x["lp"][j, :k] - x["behavior"][j, :k]).abs().sum().double()
                sums[engines[i], 1] += k
            if mb:
                sums[-1, 0] += x["entropy_sum"].double()
    if world > 1:
        dist.all_reduce(sums)
    means = (sums[:-1, 0] / sums[:-1, 1].clamp(min=1)).tolist()
    return dict(enumerate(means)), float(sums[-1, 0] / sums[:-1, 1].sum().clamp(min=1))


def agreement_gate(means, entropy, reference, bound, growth, entropy_ratio):
    """The verdict on the engines' agreement (engine_agreement) before a stage's first update. The
    weight hashes after every load already prove each engine holds the trainer's weights; this gate
    catches an engine that computes or samples otherwise (temperature, top_p/top_k, a cache kept
    across a load).
    - The run's first stage (reference None): hard, each engine's mean at most `bound` (the
      device's).
    - A later stage: relative to the run's own reference, (mean |ℓ − b|, entropy) measured at stage
      0's first update (or the preflight's): each engine's mean at most max(bound, growth × the
      reference's). Above it, a policy whose entropy has moved by more than `entropy_ratio`× from
      the reference's (either way) has collapsed: the gap grows with the policy's numerics (flat or
      saturated logits), so the stage is recorded as a result, not stopped.
    Returns (verdict "pass" | "collapsed" | "stop", the bound applied)."""
    worst = max(means.values(), default=0.0)
    if reference is None:
        applied = bound
        collapsed = False
    else:
        applied = max(bound, growth * reference[0])
        collapsed = (worst > applied and not reference[1]
                     / entropy_ratio <= entropy <= entropy_ratio * reference[1])
    return "pass" if worst <= applied else "collapsed" if collapsed else "stop", applied


def agreement_reference(stage):
    """The run's own reference for agreement_gate: (mean |ℓ − b|, entropy, where) of the first
    metrics row of the run's stage 0 (or, before it has one, of the preflight's miniature stage 0,
    <run>/preflight/stage_0); None when neither is there."""
    run_dir = Path(stage.directory).parent.parent
    for where in (records.stage_dir(run_dir, 0), records.stage_dir(run_dir / "preflight", 0)):
        path = where / records.METRICS
        first = common.read_jsonl(path)[:1] if path.exists() else []
        if (first and first[0].get("mismatch/mean_abs_log_ratio") is not None
            and first[0].get("entropy") is not None):
            return first[0]["mismatch/mean_abs_log_ratio"], first[0]["entropy"], str(path)
    return None


@dataclasses.dataclass(frozen=True)
class AgreementGate:
    """The engines' agreement check before a stage's first update (optimize.py's
    engine_mismatch_bound, agreement_growth, collapse_entropy_ratio, agreement_responses):
    agreement_gate's bound (< 0: the device's, agreement_bound), growth and entropy ratio, and the
    responses per engine it measures."""
    bound: float
    growth: float
    entropy_ratio: float
    responses: int


def check_engines(model, stage, temp, gate, micro_batch_tokens):
    """The engines' agreement before the stage's first update, gated (agreement_gate with `gate`'s
    settings): the run stops naming the engine, or the stage is recorded as collapsed. Returns the
    first metrics row's agreement/collapsed (the measured means are logged, not recorded: which
    responses each engine generated is the mode's, and rows are compared across modes; the row's
    mismatch/* and entropy measure the same on the first minibatch)."""
    means, entropy = engine_agreement(model, stage, temp, gate.responses, micro_batch_tokens)
    bound = agreement_bound() if gate.bound < 0 else gate.bound
    # read from the filesystem: rank 0 decides, so every rank reaches the same verdict
    reference = None if stage.index == 0 else M.broadcast(
        agreement_reference(stage) if M.placement()[0] == 0 else None)
    verdict, applied = agreement_gate(means, entropy, reference and reference[:2], bound,
                                      gate.growth, gate.entropy_ratio)
    row = {"agreement/collapsed": verdict == "collapsed"}
    uncalibrated = (", absolute: no stage 0 or preflight record to calibrate it" if stage.index
                    else "")
    against = (f"bound max({bound:g}, {gate.growth:g} × {reference[0]:.3g} of {reference[2]})"
               if reference else f"bound {bound:g}{uncalibrated}")
    each = ", ".join(f"engine {e} {v:.2e}" for e, v in means.items())
    log(f"engine agreement before update 0: mean |log ratio| {each}, entropy {entropy:.3g} "
        f"({against})")
    if verdict == "pass":
        return row
    engine, worst = max(means.items(), key=lambda kv: kv[1])
    if verdict == "collapsed":
        log(f"stage {stage.index}: the policy has collapsed (entropy {entropy:.3g} against "
            f"{reference[1]:.3g} at the reference; engine {engine} differs by {worst:.3g} nats per "
            f"token, above {applied:.3g}): recorded (agreement/collapsed), training goes on; the "
            "weight hashes guard the engines' weights")
        return row
    why = (f"the policy's entropy ({entropy:.3g}) is within {gate.entropy_ratio:g}× of the "
           f"reference's ({reference[1]:.3g}), so it has not collapsed: the engine holds the "
           "trainer's weights (their hashes) but computes or samples otherwise (temperature, "
           "top_p/top_k, a cache kept across a weight load)" if reference
           else "the engine did not serve the policy the trainer holds, or sampled otherwise "
                "(temperature, top_p/top_k)")
    raise SystemExit(f"stage {stage.index}, engine {engine}: before any update the trainer's "
                     f"log-probs differ from the engine's by {worst:.3g} nats per token on average "
                     f"({against}): {why}; stopping before training on its rollouts")


def packing_check(model, stage, temp, mb):
    """Whether the packed attention keeps sequences apart, measured two ways on micro-batch `mb`
    (every rank's):
    - differential (check/packed_*): the same sequences packed in the order given and in reverse.
      Both rows have the same length, so every GEMM has the same shape and rounds alike; a sequence
      that saw the ones packed before it sees other ones in the other order, which moves its
      log-probs by far more than rounding;
    - packed vs each of its first 8 sequences alone (check/alone_*, for information): on a GPU the
      bf16 GEMMs of a 16k-row micro-batch and of one sequence's rows are tiled differently (cuBLAS
      tile shapes, split-K), which moves a few tokens in a hundred by ~0.1 nats with no fault at
      all.
    The mean, the 99.9th percentile and the max of |Δ log p| over every rank's tokens."""
    _, world, device = M.placement()
    with torch.no_grad():
        packed = forward(model, stage, mb, temp)
        backwards = forward(model, stage, mb[::-1] if mb else None, temp)
        n = len(mb or [])
        reordered = [(packed["lp"][j]
                      - backwards["lp"][n - 1 - j]).abs()[:int(stage.response_len[i])]
                     for j, i in enumerate(mb or [])]
        alone = [torch.zeros(0, device=device)]
        singles = (mb or [])[:8]
        count = torch.tensor([len(singles)], device=device)
        if world > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        for j in range(int(count)):
            if j < len(singles):
                one = forward(model, stage, [singles[j]], temp)["lp"][0]
                k = int(stage.response_len[singles[j]])
                alone.append((one[:k] - packed["lp"][j, :k]).abs())
            else:
                forward(model, stage, None, temp)
    # a micro-batch of one sequence compares nothing: said so
    fewest = torch.tensor([n], device=device)
    if world > 1:
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
    out = {"check/packed_sequences_min": int(fewest)}
    for name, diffs in (("packed", reordered), ("alone", alone)):
        # a few thousand values per rank: gathered whole, the quantile exact
        values = M.gather_values(torch.cat(diffs) if diffs else torch.zeros(0, device=device))
        if values.numel():
            out.update({f"check/{name}_mean_abs_diff": values.mean().item(),
                        f"check/{name}_max_abs_diff": values.max().item(),
                        f"check/{name}_p999_abs_diff":
                            torch.quantile(values.double(), 0.999).item()})
    return out


# ------------------------------------------------------------------ what AdamW's step read and took


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t       # a DTensor's shard on this rank


def adam_sums(optimizer, after_step):
    """Per parameter group of `optimizer` (model.parameter_groups: "name"), this rank's sums of what
    AdamW's step reads (before it: after_step False) or took (after_step True), as 0-d tensors named
    adam_<group>_<what>: before, the squared (clipped) gradient g2 and the bias-corrected second
    moment so far v = v / (1 − β2^t) (t: its steps so far; NaN before the first); after, the squared
    step over lr, (m̂ / (√v̂ + ε))², as torch's AdamW computes it (torch/optim/adam.py,
    _single_tensor_adam: denom = v.sqrt() / √(1 − β2^t) + ε, step lr / (1 − β1^t) · m / denom; the
    decoupled weight decay left out), and the elements n."""
    sums, device = {}, M.placement()[2]
    for group in optimizer.param_groups:
        if "betas" not in group:           # not an Adam (a test's SGD): nothing to measure
            continue
        (beta1, beta2), eps, name = group["betas"], group["eps"], group.get("name", "all")
        # every rank names every group's sums, zero where its shards hold none: the ranks' dicts
        # reduce key by key
        zero = [torch.zeros((), device=device)]
        parts = {"step2": list(zero), "n": list(zero)} if after_step else {
            "g2": list(zero), "v": list(zero)}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            t, v = float(state["step"]), _local(state["exp_avg_sq"])
            if after_step:
                m = _local(state["exp_avg"])
                direction = m / (v.sqrt() / math.sqrt(1 - beta2 ** t) + eps) / (1 - beta1 ** t)
                parts["step2"].append(torch.linalg.vector_norm(direction) ** 2)
                parts["n"].append(torch.tensor(float(v.numel()), device=v.device))
            else:
                parts["g2"].append(torch.linalg.vector_norm(_local(p.grad)) ** 2)
                parts["v"].append(
                    v.sum() / (1 - beta2 ** t) if t > 0 else torch.tensor(
                        math.nan, device=v.device))
        for what, values in parts.items():
            sums[f"adam_{name}_{what}"] = torch.stack(values).sum()
    return sums


def adam_metrics(before, after):
    """The Adam measurements of an update from its ranks' summed adam_sums, per parameter group and
    over all: adam/step_rms/<group> the RMS of AdamW's step over lr (1 for every element at a new
    AdamW's first step, which is sign(g)), adam/g2_over_v/<group> Σ g² / Σ v̂ of the steps before
    (how much larger this gradient is than AdamW's second moment expects: >> 1 right after the data
    change at a stage boundary; None at AdamW's first step)."""
    out, total = {}, {"g2": 0.0, "v": 0.0, "step2": 0.0, "n": 0.0}
    sums = {**before, **after}
    for key in sorted(k for k in after if k.endswith("_n")):
        name = key[len("adam_"):-len("_n")]
        values = {what: float(sums[f"adam_{name}_{what}"]) for what in total}
        out[f"adam/step_rms/{name}"] = math.sqrt(values["step2"] / values["n"])
        out[f"adam/g2_over_v/{name}"] = values["g2"] / values["v"] if values["v"] > 0 else math.nan
        total = {what: total[what] + values[what] for what in total}
    if total["n"]:
        out["adam/step_rms/all"] = math.sqrt(total["step2"] / total["n"])
        out["adam/g2_over_v/all"] = total["g2"] / total["v"] if total["v"] > 0 else math.nan
    return out
