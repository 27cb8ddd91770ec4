"""What the trainer benchmarks (bench_train.py, gpu_check.py) run on, built on the spot with no download: a
Qwen2-shaped model with random weights from a config, and a synthetic stage of random tokens whose prompt and response
lengths follow a math RL stage's mix. Nothing here parses a command line."""
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mu_grpo import common  # noqa: E402
from mu_grpo import records  # noqa: E402
from mu_grpo import rollouts  # noqa: E402

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings (the models' config.json)
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, False),
    "tiny": (64, 2, 2, 2, 128, 512, True),
}


def build_model(path, shape, layers=0):
    """The shape's model (bf16, random weights, seed 0; `layers` > 0: that many layers) and a small local tokenizer,
    saved at `path`. Returns (parameters, layers, hidden, vocab, tied)."""
    import torch  # torch, transformers: only when the model is built
    from transformers import Qwen2Config, Qwen2ForCausalLM
    sys.path.insert(0, str(ROOT / "data"))
    import toy  # data/ is on the path only now
    hidden, n_layers, heads, kv, inter, vocab, tied = SHAPES[shape]
    cfg = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers or n_layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab, max_position_embeddings=4096,
                      tie_word_embeddings=tied, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    toy.build_tokenizer(["What is 1 + 2? \\boxed{3}"] * 10, 300).save_pretrained(path)
    return sum(p.numel() for p in model.parameters()), layers or n_layers, hidden, vocab, tied


def write_stage(stage, vocab, groups, mean_prompt_tokens, mean_response_tokens, max_response_tokens):
    """A complete stage of `groups` prompts × G=8 responses of random tokens: prompt lengths uniform in
    [mean/2, 3·mean/2], lognormal response lengths (σ 0.6) around the mean, capped; rewards alternate, advantages ±1,
    behavior log-probs −12 (about a random policy's over a 150k vocabulary). Returns [(prompt, response tokens)]."""
    rng = np.random.default_rng(0)
    rows, lengths = [], []
    for g in range(groups):
        n_prompt = int(rng.integers(mean_prompt_tokens // 2, 3 * mean_prompt_tokens // 2 + 1))
        prompt = rng.integers(3, vocab, n_prompt).tolist()
        for i in range(8):
            n = int(min(max_response_tokens, rng.lognormal(np.log(mean_response_tokens) - 0.18, 0.6) + 1))
            rows.append({"prompt_id": f"p{g}", "group": g, "sample_idx": i, "prompt_token_ids": prompt,
                         "response_token_ids": rng.integers(3, vocab, n).tolist(), "behavior_logprobs": [-12.0] * n,
                         "finish_reason": "length", "reward": float(i % 2), "advantage": 1.0 if i % 2 else -1.0,
                         "stage": 0, "policy": "bench"})
            lengths.append((len(prompt), n))
    out = Path(stage) / records.ROLLOUTS
    out.mkdir(parents=True, exist_ok=True)
    common.atomic_write_lines(rollouts.shard_path(out, 0), rows)
    common.atomic_write_json(out / records.MANIFEST, {
        "complete": True, "stage": 0, "policy": "bench", "shards": ["shard_00000.jsonl"],
        "sampling": {"n": 8, "temperature": 1.0, "max_tokens": max_response_tokens}})
    return lengths


def trained_lengths(stage, group_keys):
    """[(prompt, response tokens)] of the responses of the groups an update trained (its metrics row's "groups")."""
    data = rollouts.open_stage(stage / records.ROLLOUTS, workers=1)
    index = {json.dumps(k): i for i, k in enumerate(data.group_keys)}
    responses = [r for k in group_keys for r in data.groups[index[json.dumps(k)]]]
    return [(int(data.prompt_len[r]), int(data.response_len[r])) for r in responses]


def count_parameters(model_dir):
    from safetensors import safe_open  # safetensors: only to count a saved model's parameters
    total = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            total += sum(math.prod(sf.get_slice(k).get_shape()) for k in sf.keys())
    return total


def model_flops(lengths, n_params, layers, hidden, vocab, tied):
    """Forward + backward model FLOPs of responses [(prompt, response tokens)]: 2·N_body per token for every token,
    the lm_head (2·V·H) only at response positions (the trainer computes logits only there), causal attention
    2·layers·hidden·s² per sequence; ×3 for forward + backward (recomputation under gradient checkpointing is not
    counted: MFU is model FLOPs)."""
    body = n_params - vocab * hidden * (1 if tied else 2)          # without embedding and lm_head
    total = 0.0
    for p, r in lengths:
        s = p + r
        total += 2 * body * s + 2 * vocab * hidden * r + 2 * layers * hidden * s * s
    return 3 * total
