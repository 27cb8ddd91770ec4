"""Packed attention: sequences back to back in one row (position ids restarting at 0) must give the
log-probs of separate forwards under every implementation optimize.py offers, and cost memory that
grows with Σ Lᵢ², not with the packed length N²."""
import pytest
import torch

import loss as L
from mu_grpo import trainer_model as M

M.choose_attention("varlen_sdpa", torch.device("cpu"))       # registers it with transformers


def model_with(toy, implementation, layers=None):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(toy / "model")
    if layers:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=implementation).eval()


def packed_and_single_logprobs(model, lengths):
    """(packed, per-sequence) log-probs of random sequences of the given lengths: [Σ (L−1)] each."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, model.config.vocab_size, (n,), generator=g) for n in lengths]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        singles = [model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
    starts = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)
    a = torch.cat([L.token_logprobs(packed[s:s + n - 1], seq[1:], 1.0) for s, n, seq in zip(starts, lengths, seqs)])
    b = torch.cat([L.token_logprobs(out[:-1], seq[1:], 1.0) for out, seq in zip(singles, seqs)])
    return a, b


@pytest.mark.parametrize("implementation", ["varlen_sdpa", "sdpa", "eager", "flex_attention"])
def test_packed_forward_equals_separate_forwards(toy, implementation):
    model = model_with(toy, implementation)
    packed, single = packed_and_single_logprobs(model, [7, 20, 3, 12])
    assert packed.shape == single.shape == (38,)
    # float32 noise of one forward is ~1e-6 per log-prob; a sequence that sees another moves it by ≫ 1e-3
    assert (packed - single).abs().max() < 1e-5


def saved_bytes(model, n_tokens, seq_len):
    """Bytes autograd saves for backward in one forward of a packed row of n_tokens (sequences of seq_len)."""
    ids = torch.randint(3, model.config.vocab_size, (1, n_tokens))
    pos = torch.arange(n_tokens)[None] % seq_len
    with M.SavedActivations() as saved:
        model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1).logits.sum().backward()
    return saved.bytes


def test_packed_attention_memory_grows_linearly_not_quadratically(toy):
    # four times the packed tokens (same sequence length): a per-sequence kernel saves 4× the bytes;
    # a dense [N, N] mask with the math kernel saves its N² scores: ~16× for the attention part
    varlen, dense = model_with(toy, "varlen_sdpa").train(), model_with(toy, "eager").train()
    small, large = 512, 2048
    ratio_varlen = saved_bytes(varlen, large, 128) / saved_bytes(varlen, small, 128)
    ratio_dense = saved_bytes(dense, large, 128) / saved_bytes(dense, small, 128)
    assert 3.5 < ratio_varlen <= 4.05, (ratio_varlen, ratio_dense)       # linear (a few fixed-size tensors aside)
    assert ratio_dense > 8.0, ratio_dense
