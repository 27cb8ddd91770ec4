"""update.py in process, on a tiny random Llama and a 12-response stage written here: the
micro-batches and the packed row by hand, the packed update against the loss of each response
computed alone, the stored log-prob passes, the stats of a rank without responses. Seconds, no
subprocess."""
import json

import numpy as np
import pytest
import torch

import loss as L
from mu_grpo import common, passes, rollouts
from mu_grpo import trainer_model as M
import update

G = 4
PROMPT_LEN = (4, 2, 3)                                            # per group
RESPONSE_LEN = ((6, 3, 1, 5), (8, 5, 1, 2), (4, 7, 2, 3))          # per group, per sample
REWARDS = ((1, 0, 0, 1), (0, 1, 0, 0), (1, 1, 0, 0))


def alone(model, prompt, response, temp=1.0):
    """The log-probs of one response's tokens from a forward of its sequence alone (no packing)."""
    ids = torch.tensor(np.concatenate([prompt, response]), dtype=torch.long)[None]
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1]
    return L.token_logprobs(logits, torch.tensor(response, dtype=torch.long), temp)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(a random 2-layer Llama's checkpoint, a stage of 3 groups × G=4 random responses of
    RESPONSE_LEN tokens whose behavior log-probs are the checkpoint's own, moved by N(0, 0.5²) noise
    so the ratios spread around 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    root = tmp_path_factory.mktemp("update")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    net = LlamaForCausalLM(config).eval()
    net.save_pretrained(root / "policy")
    rng = np.random.default_rng(0)
    rows = []
    for g, (p_len, lens, rewards) in enumerate(zip(PROMPT_LEN, RESPONSE_LEN, REWARDS)):
        prompt = rng.integers(3, 64, p_len).tolist()
        advantages, _ = L.group_advantages(list(map(float, rewards)), G)
        for k, n in enumerate(lens):
            response = rng.integers(3, 64, n).tolist()
            with torch.no_grad():
                behavior = alone(net, prompt, response).numpy() + rng.normal(0, 0.5, n)
            rows.append({"prompt_id": f"p{g}", "group": g, "sample_idx": k,
                         "prompt_token_ids": prompt, "response_token_ids": response,
                         "behavior_logprobs": behavior.tolist(), "finish_reason": "stop",
                         "reward": float(rewards[k]), "advantage": float(advantages[k]), "stage": 0,
                         "policy": str(root / "policy")})
    directory = root / "stage_0" / "rollouts"
    directory.mkdir(parents=True)
    common.atomic_write_lines(directory / "shard_00000.jsonl", rows)
    common.atomic_write_json(directory / "manifest.json", {
        "complete": True, "stage": 0, "policy": str(root / "policy"),
        "shards": ["shard_00000.jsonl"],
        "sampling": {"n": G, "temperature": 1.0, "top_p": 1.0, "max_tokens": 12}})
    return root / "policy", rollouts.open_stage(directory, workers=1)


def trainer(policy):
    return M.build(policy, attention=M.choose_attention("auto", torch.device("cpu")))


def test_micro_batches_fill_the_budget_longest_first_and_hold_each_response_once(tiny):
    _, stage = tiny
    # responses 0, 1, 2 (prompt 4; responses 6, 3, 1) and 4, 5, 6 (prompt 2; responses 8, 5, 1): 10,
    # 7, 5, 10, 7, 3 tokens; longest first (ties in the order given): 10 10 | 7 7 5 | 3 under 20
    # tokens (a batch may reach the budget)
    assert (stage.prompt_len + stage.response_len)[[0, 1, 2, 4, 5, 6]].tolist() == [
        10, 7, 5, 10, 7, 3]
    assert passes.micro_batches(stage, [0, 1, 2, 4, 5, 6], 20) == [[0, 4], [1, 5, 2], [6]]
    # under 9 a response longer than the budget is a micro-batch of its own
    assert passes.micro_batches(stage, [0, 1, 2, 4, 5, 6], 9) == [[0], [4], [1], [5], [2, 6]]
    assert passes.micro_batches(stage, [], 9) == []
    # the whole stage: every response exactly once, under the budget if it can
    for budget in (1, 12, 30, 1000):
        batches = passes.micro_batches(stage, np.arange(stage.n), budget)
        assert sorted(i for mb in batches for i in mb) == list(range(stage.n))
        tokens = [int((stage.prompt_len[mb] + stage.response_len[mb]).sum()) for mb in batches]
        assert all(t <= budget or len(mb) == 1 for t, mb in zip(tokens, batches))


def test_the_packed_row_restarts_positions_and_keeps_the_response_predictions(tiny):
    _, stage = tiny
    # prompt 4 + response 6, then prompt 4 + response 3
    x = passes.pack(stage, [0, 1], {})
    (p0, r0, b0), (p1, r1, b1) = stage.tokens(0), stage.tokens(1)
    assert x["ids"][0].tolist() == [*p0, *r0, *p1, *r1]
    assert x["pos"][0].tolist() == [*range(10), *range(7)]
    # the logits at position t predict token t + 1: the response of the first sequence starts at 4,
    # so 3..8; the second sequence starts at 10, its response at 14: 13..15
    assert x["keep"].tolist() == [3, 4, 5, 6, 7, 8, 13, 14, 15]
    assert x["targets"].tolist() == [*r0, *r1]
    assert x["mask"].tolist() == [[True] * 6, [True] * 3 + [False] * 3]
    assert x["behavior"][0].tolist() == b0.tolist() and x["behavior"][1].tolist() == [
        *b1, 0.0, 0.0, 0.0]
    assert x["adv"].tolist() == stage.advantage[[0, 1]].tolist()


def test_packed_log_probs_are_each_responses_alone(tiny):
    policy, stage = tiny
    model = trainer(policy)
    with torch.no_grad():
        x = passes.forward(model, stage, [4, 0, 9, 2], 0.7)
        for j, i in enumerate([4, 0, 9, 2]):
            p, r, _ = stage.tokens(i)
            torch.testing.assert_close(x["lp"][j, :len(r)], alone(model, p, r, 0.7), rtol=0,
                                       atol=1e-5)
            assert (x["lp"][j, len(r):] == 0).all()


def reference_update(policy, stage, batch, loss_kw):
    """The loss and gradients of one update computed the plain way: each response's log-probs from a
    forward of its sequence alone, padded into one [b, T] batch, loss.policy_loss over it in one
    call (its own token counts)."""
    model = trainer(policy)
    lps = [alone(model, *stage.tokens(i)[:2]) for i in batch]
    T = max(len(lp) for lp in lps)
    lp = torch.stack([torch.nn.functional.pad(v, (0, T - len(v))) for v in lps])
    behavior = torch.stack(
        [torch.nn.functional.pad(torch.from_numpy(np.array(stage.tokens(i)[2])), (0, T - len(v)))
                            for i, v in zip(batch, lps)])
    mask = torch.arange(T)[None, :] < torch.tensor([len(v) for v in lps])[:, None]
    loss, stats = L.policy_loss(lp, behavior, torch.from_numpy(stage.advantage[batch]),
                                mask, loss_kw)
    loss.backward()
    return loss, stats, {n: p.grad for n, p in model.named_parameters()}


# μ-GRPO's clip with NAV (a trigger at ρ < 0.5 fires here), GRPO's clip with M2PO (τ = 0.2: it masks
# 2 harmful tokens of the minibatch here, where a cutoff of each micro-batch's own would mask 5),
# the sequence means; and the objectives of whole responses (their sequence ratio needs each
# response whole in one micro-batch), CISPO with NAV
LOSSES = {
    "mu-grpo": L.build(clip_low=0.0, clip_high=5.0, nav_delta=0.5, nav_scope="H"),
    "grpo-m2po": L.build(clip_low=0.8, clip_high=1.2, m2po_tau=0.2),
    "seq-mean": L.build(clip_low=0.8, clip_high=1.2, nav_delta=0.5, agg="seq-mean-token-mean"),
    "dr-grpo": L.build(clip_low=0.8, clip_high=1.2, agg="seq-mean-token-sum-norm", norm_len=12),
    **{name: L.preset(name) for name in ("topr", "oapl", "gspo", "vespo", "dppo-tv")},
    "cispo-nav": L.preset("cispo-nav", nav_delta=0.5),
}


@pytest.mark.parametrize("name,micro_batch_tokens",
                         [(name, size) for name in LOSSES for size in (12, 1000) if size == 12
                          or name in ("mu-grpo", "grpo-m2po", "seq-mean", "dr-grpo")])
def test_the_packed_update_is_the_plain_one(tiny, name, micro_batch_tokens):
    # micro-batches of at most 12 tokens (one to three responses each) or one for the minibatch: the
    # loss and every gradient those of the plain computation, up to float noise; a response lost or
    # counted twice, a micro-batch divided by its own token count or the wrong kept count would move
    # them by far more
    policy, stage = tiny
    loss_kw = LOSSES[name]
    batch = stage.groups[[0, 1]].ravel()
    ref_loss, ref_stats, ref_grads = reference_update(policy, stage, batch, loss_kw)
    model = trainer(policy)
    # steps nothing: the gradients stay to read
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    m, stepped = update.run_update(model, optimizer, stage, batch, 1.0, {},
                                   update.Recipe(
                                       loss_kw, micro_batch_tokens=micro_batch_tokens,
                                       grad_clip=1e9))
    # 6+3+1+5 + 8+5+1+2
    assert stepped and m["loss/tokens"] == int(stage.response_len[batch].sum()) == 31
    assert m["loss/kept_tokens"] == ref_stats["kept"].item()
    # the masks take tokens out, so the kept count matters
    if name in ("mu-grpo", "grpo-m2po", "cispo-nav"):
        assert m["loss/kept_tokens"] < 31
    assert m["loss/policy"] == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-7)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-7, msg=n)
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
    assert m["grad_norm"] == pytest.approx(ref_norm.item(), rel=1e-4)


def test_the_first_update_of_mu_grpo_is_its_equation_by_hand(tiny):
    # the loss without NAV, from the docstring of loss.py: −Σ_t min(ρ_t A, clip(ρ_t, 0, 5) A) / N
    # over the 31 tokens, ρ_t = exp(ℓ_t − b_t) from each response alone; nothing of loss.policy_loss
    # in the reference
    policy, stage = tiny
    model = trainer(policy)
    batch = stage.groups[[0, 1]].ravel()
    total = 0.0
    with torch.no_grad():
        for i in batch:
            p, r, b = stage.tokens(i)
            rho = torch.exp(alone(model, p, r) - torch.from_numpy(np.array(b)))
            adv = float(stage.advantage[i])
            total += -torch.minimum(rho * adv, rho.clamp(0.0, 5.0) * adv).sum().item()
    m, _ = update.run_update(model, torch.optim.SGD(model.parameters(), lr=0.0), stage, batch, 1.0,
                             {},
                             update.Recipe(L.build(clip_low=0.0, clip_high=5.0),
                                           micro_batch_tokens=12, grad_clip=1.0))
    assert m["loss/policy"] == pytest.approx(total / 31, rel=1e-5)


def test_a_stored_pass_is_each_responses_log_probs_computed_once(tiny, tmp_path):
    policy, stage = tiny
    model = trainer(policy)
    with torch.no_grad():
        column, seconds = passes.logprob_pass(model, stage, 0.7, "old", "k1", tmp_path,
                                              micro_batch_tokens=12)
        for i in range(stage.n):
            p, r, _ = stage.tokens(i)
            np.testing.assert_allclose(column.get(stage, i), alone(model, p, r, 0.7).numpy(),
                                       rtol=0, atol=1e-5)
    # beside the rollouts, the stage's cache
    path = stage.directory.parent / "logprobs" / "old-k1-T0.7.f32"
    assert seconds > 0 and column.path == path and column.values.mode == "r"
    assert json.loads((path.parent / "old-k1-T0.7.f32.complete").read_text()) == {
        "model": "k1", "temperature": 0.7, "responses": 12}
    # stored:
    again, seconds = passes.logprob_pass(None, stage, 0.7, "old", "k1", tmp_path,
                                         micro_batch_tokens=12)
    # no model run
    assert seconds == 0.0 and np.array_equal(again.values, column.values)
    with pytest.raises(SystemExit, match=f"delete {tmp_path / 'train_state'} to restart the stage"):
        passes.logprob_pass(None, stage, 0.7, "old", "k2", tmp_path, 12,
                            resumed_state=tmp_path / "train_state")


def test_a_stored_column_is_read_only(tiny, tmp_path):
    _, stage = tiny
    n = int(stage.token_offset[-1])
    column = rollouts.TokenColumn(tmp_path / "c.f32", n, create=True)
    column.values[:] = np.arange(n)
    column.mark_complete({})
    stored = passes.stored_column(tmp_path / "c.f32", n)
    assert stored.values.tolist() == list(range(n)) and stored.values.mode == "r"
    with pytest.raises(ValueError, match="read-only"):
        stored.values[0] = 1.0


@pytest.mark.parametrize(
    "loss_kw,columns",
    [(LOSSES["mu-grpo"], {}),
     (L.build(clip_low=0.8, clip_high=1.2, m2po_tau=0.2, tis_cap=2.0, kl_coef=0.1), {"ref": None}),
     (LOSSES["topr"], {}), (LOSSES["oapl"], {})])
def test_a_rank_without_responses_adds_nothing(tiny, loss_kw, columns):
    # the stats a rank starts from (and sends when it has no response of the minibatch): the names
    # of a real call's (plus the update's own), sums zero, so that merging them with any stats
    # leaves those stats as they were; but kl_in_loss, a flag (> 0 after merging: the KL is in the
    # loss), not a count
    _, stage = tiny
    empty = update.empty_stats(loss_kw, columns, cutoff=None)
    x = passes.pack(stage, [0, 5], {})
    lp = x["behavior"] + 0.3 * x["mask"]
    extra = {"old_logprobs": x["behavior"]} if loss_kw.tis_cap is not None else {}
    real = L.policy_loss(lp, x["behavior"], x["adv"], x["mask"], loss_kw, **extra,
                         ref_logprobs=x["behavior"] if columns else None)[1]
    assert set(empty) == set(real) | {"entropy_sum", "saved_activations_gib_max"}
    counts = [k for k in empty if not k.endswith(("_min", "_max")) and k != "kl_in_loss"]
    assert {k: empty[k].abs().sum().item() for k in counts} == dict.fromkeys(counts, 0.0)
    assert empty["ratio_min"].item() == np.inf and empty["ratio_max"].item() == -np.inf
    merged = L.merge_stats(empty, {**real, "entropy_sum": torch.tensor(2.0),
                                   "saved_activations_gib_max": torch.tensor(0.5)})
    assert all(torch.equal(merged[k], real[k]) for k in real if k != "kl_in_loss")
    assert merged.get("kl_in_loss", 1) > 0


def test_the_adam_measurements_are_adamws_own_arithmetic_by_hand():
    # one parameter of two elements, gradients g1 = (1, 2) then g2 = (3, 1), β = (0.9, 0.999), no
    # weight decay: step 1: m = 0.1·g1, v = 0.001·g1²; a new AdamW's step is g/|g| (RMS 1) and it
    # has no v̂ before it. step 2: v̂ before it = v / (1 − 0.999) = g1² = (1, 4): Σ g2² / Σ v̂ = 10
    # / 5 = 2; its step over lr is m̂ / (√v̂ + ε) with m = 0.9·m + 0.1·g2, v = 0.999·v + 0.001·g2²,
    # m̂ = m / (1 − 0.9²), v̂ = v / (1 − 0.999²)
    w = torch.nn.Parameter(torch.zeros(2))
    net = torch.nn.Module()
    net.register_parameter("mlp_weight", w)
    optimizer = torch.optim.AdamW(M.parameter_groups(net), lr=1e-3, betas=(0.9, 0.999),
                                  weight_decay=0.0, eps=1e-8)
    assert [g["name"] for g in optimizer.param_groups] == ["mlp"]
    M.init_optimizer_state(optimizer)
    rows = []
    for g in ((1.0, 2.0), (3.0, 1.0)):
        w.grad = torch.tensor(g)
        before = passes.adam_sums(optimizer, after_step=False)
        optimizer.step()
        rows.append(passes.adam_metrics(before, passes.adam_sums(optimizer, after_step=True)))
    # |g| ≫ ε: g / (|g| + ε) = ±1
    assert rows[0]["adam/step_rms/mlp"] == pytest.approx(1.0, abs=1e-7)
    assert np.isnan(rows[0]["adam/g2_over_v/mlp"])
    assert rows[1]["adam/g2_over_v/mlp"] == pytest.approx(2.0, rel=1e-5)
    m = [0.9 * 0.1 * a + 0.1 * b for a, b in zip((1, 2), (3, 1))]
    v = [0.999 * 0.001 * a * a + 0.001 * b * b for a, b in zip((1, 2), (3, 1))]
    d = [(mi / (1 - 0.9 ** 2)) / ((vi / (1 - 0.999 ** 2)) ** 0.5 + 1e-8) for mi, vi in zip(m, v)]
    assert rows[1]["adam/step_rms/mlp"] == pytest.approx(
        ((d[0] ** 2 + d[1] ** 2) / 2) ** 0.5, rel=1e-5)
    assert rows[1]["adam/step_rms/all"] == rows[1]["adam/step_rms/mlp"]
    # a reset makes the next step a new AdamW's first again: step RMS 1, no v̂ before it
    M.reset_optimizer_state(optimizer)
    w.grad = torch.tensor((3.0, 1.0))
    before = passes.adam_sums(optimizer, after_step=False)
    optimizer.step()
    again = passes.adam_metrics(before, passes.adam_sums(optimizer, after_step=True))
    assert (again["adam/step_rms/mlp"] == pytest.approx(1.0, abs=1e-7)
            and np.isnan(again["adam/g2_over_v/mlp"]))
    assert int(optimizer.state[w]["step"]) == 1


def test_the_parameter_groups_are_named_by_kind():
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight",
             "model.norm.weight", "lm_head.weight",
             "model.layers.0.self_attn.q_proj.lora_A.default.weight", "model.rotary.scale"]
    assert [M.parameter_kind(n) for n in names] == [
        "embed", "attn", "mlp", "norm", "norm", "head", "lora", "other"]
