"""The toy task (docs/design.md §5): two-number addition, graded by reward.py, with a tiny policy built here.

    python data/toy.py --out_dir=data/toy            # writes train.jsonl, test.jsonl and model/

Everything is local: a byte-level BPE tokenizer trained on the task's own text, a 4-layer Llama
with random weights (head dimension 32, which vLLM's CPU backend supports), then a short supervised
warm start on *noisy* demonstrations: half of them answer correctly in `\\boxed{}`, a quarter give up
with `\\boxed{?}`, a quarter forget the box. The warm-started policy so solves a bit under half of the
problems when sampled at temperature 1. Both error modes are the same for every problem, so RL on
the training problems removes them on the held-out test problems too: test accuracy rises.
"""
import json
import os
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mu_grpo import common  # noqa: E402

# ----------------------------------------------------------------------------- hyperparameters
# the task: where it goes, its problems and their split (seed: the model's and the warm start's too)
out_dir = "data/toy"        # where train.jsonl, test.jsonl and model/ go
max_operand = 12            # problems a + b with 0 <= a, b < max_operand
test_fraction = 0.25        # share of problems held out as the test set
seed = 0

# the model: a tiny Llama and its byte-level BPE tokenizer
hidden_size = 128           # model width; head dimension is fixed at 32
layers = 4
vocab_size = 400            # byte-level BPE: 256 bytes + merges + 3 special tokens

# the warm start: supervised steps on noisy demonstrations
sft_steps = 500             # warm-start optimizer steps
sft_batch = 64              # sequences per warm-start step
sft_lr = 3e-3
p_correct = 0.5             # demonstration mix: correct / \boxed{?} / no box
p_give_up = 0.25
# -----------------------------------------------------------------------------

TEMPLATE = "Question: What is {a} + {b}? Answer:"


def problems(max_operand, test_fraction, seed):
    """All a + b problems as {id, problem, answer, source}, split by a seeded shuffle."""
    rows = [{"id": f"toy-{a}-{b}", "problem": TEMPLATE.format(a=a, b=b), "answer": str(a + b), "source": "toy"}
            for a in range(max_operand) for b in range(max_operand)]
    random.Random(seed).shuffle(rows)
    n_test = int(len(rows) * test_fraction)
    return rows[n_test:], rows[:n_test]


def demonstration(row, rng, p_correct, p_give_up):
    """One noisy warm-start response for a problem."""
    u = rng.random()
    if u < p_correct:
        return f" \\boxed{{{row['answer']}}}"
    if u < p_correct + p_give_up:
        return " \\boxed{?}"
    return f" {row['answer']}"


def build_tokenizer(texts, vocab_size):
    # tokenizers, transformers: only the build needs them (the task's functions do not)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", padding_side="left")


def build_model(tokenizer, hidden_size, layers, seed):
    import torch  # torch only after portable_kernels (ATEN_CPU_CAPABILITY is read at torch's import)
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                         num_hidden_layers=layers, num_attention_heads=hidden_size // 32,
                         num_key_value_heads=hidden_size // 32, head_dim=32, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
    return LlamaForCausalLM(config)


def warm_start(model, tokenizer, examples, steps, batch, lr, seed):
    """Supervised training on noisy demonstrations: examples(rng, batch) → [(problem text, response
    text)]; the loss is on the response tokens only."""
    import torch  # torch only after portable_kernels
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * (1 - s / steps))
    model.train()
    for step in range(steps):
        seqs, masks = [], []
        for problem, demo in examples(rng, batch):
            prompt = [tokenizer.bos_token_id] + tokenizer.encode(problem)
            response = tokenizer.encode(demo) + [tokenizer.eos_token_id]
            seqs.append(prompt + response)
            masks.append([0] * len(prompt) + [1] * len(response))
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs])
        loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none").view(ids.shape[0], -1)
        loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"warm start step {step:4d}/{steps}: loss {loss.item():.3f}", flush=True)
    model.eval()
    return model


def warm_start_problems(examples, steps, batch, seed):
    """The problem texts warm_start(..., examples, steps, batch, ..., seed) trains on, without training: its
    example stream replayed from the same seed."""
    rng = random.Random(seed)      # as warm_start's
    return {problem for _ in range(steps) for problem, _ in examples(rng, batch)}


def write_jsonl(path, rows):
    common.atomic_write(path, "".join(json.dumps(row) + "\n" for row in rows))


def build(out_dir, *, max_operand=12, test_fraction=0.25, seed=0, hidden_size=128, layers=4, vocab_size=400,
          sft_steps=500, sft_batch=64, sft_lr=3e-3, p_correct=0.5, p_give_up=0.25):
    """Write the toy train/test sets and a warm-started policy (HF directory) under out_dir."""
    import torch  # torch only after portable_kernels
    torch.set_num_threads(common.usable_cores())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = problems(max_operand, test_fraction, seed)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "test.jsonl", test)
    corpus_rng = random.Random(seed + 1)
    corpus = [r["problem"] + demonstration(r, corpus_rng, p_correct, p_give_up) for r in train + test] * 3
    tokenizer = build_tokenizer(corpus, vocab_size)
    model = build_model(tokenizer, hidden_size, layers, seed)
    if sft_steps:
        rows = train + test

        def examples(rng, batch):
            return [(row["problem"], demonstration(row, rng, p_correct, p_give_up)) for row in rng.choices(rows, k=batch)]
        warm_start(model, tokenizer, examples, sft_steps, sft_batch, sft_lr, seed)
    return save_model(model, tokenizer, out / "model")


def portable_kernels():
    """Make this process's torch compute the same on any x86-64 CPU: ATen's generic kernels, not the AVX2 or AVX512
    ones its dispatch picks by CPU, which sum in other orders (the same lab build gave three different policies here
    under the three; with the generic ones it is the same under MKL's AVX2 and AVX512 paths and on 1 or 2 threads).
    torch reads ATEN_CPU_CAPABILITY when it starts, so this runs before torch is imported (a lab builder's main);
    the cost of the build is the same within the noise. Returns the capability torch then uses."""
    os.environ["ATEN_CPU_CAPABILITY"] = "default"
    import torch  # after ATEN_CPU_CAPABILITY is set: torch reads it at import
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "DEFAULT":
        raise SystemExit(f"torch was imported before portable_kernels() and uses its {capability} kernels: the "
                         f"build would differ from other machines'")
    return capability


def save_model(model, tokenizer, final):
    """The policy as an HF directory (sampling defaults: temperature 1, untruncated), written whole or not at all."""
    from transformers import GenerationConfig  # transformers: only the build needs it
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=True,
                                               temperature=1.0, top_p=1.0, top_k=0)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


if __name__ == "__main__":
    common.apply_overrides(globals(), sys.argv[1:])
    path = build(**common.hyperparameters(globals()))
    print(f"toy task and policy written: {out_dir}/train.jsonl, {out_dir}/test.jsonl, {path}")
