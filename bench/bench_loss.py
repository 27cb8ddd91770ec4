"""Time and peak memory of token log-probs + policy loss, forward and backward, on CPU.

Compares loss.token_logprobs (chunked, recomputing softmax in backward) with the naive path
log_softmax(logits.float() / T).gather(...), both behind the same hidden→vocab projection and the
same loss.policy_loss. Each variant runs in a fresh process; peak memory is that process's peak
resident set size above its baseline after the inputs are built.

    python bench/bench_loss.py                       # 16 responses × 1024 tokens, vocab 32k
    python bench/bench_loss.py --responses=64        # the issue's full shape (needs ~40 GB naive)
"""
import multiprocessing as mp
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ----------------------------------------------------------------------------- hyperparameters
responses = 16          # sequences in the minibatch
tokens = 1024           # response tokens per sequence
hidden = 512            # model width (hidden → vocab projection)
vocab = 32000           # vocabulary size
dtype = "bfloat16"      # dtype of hidden states, projection and logits (training uses bf16)
temperature = 1.0
repeats = 3             # timed repetitions (the first, warm-up, run is not counted)
# -----------------------------------------------------------------------------
for arg in sys.argv[1:]:
    key, _, value = arg.removeprefix("--").partition("=")
    if key not in globals() or key.startswith("_"):
        sys.exit(f"unknown option --{key}")
    globals()[key] = type(globals()[key])(value)


def _peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _run(variant, queue):
    import torch  # in the child: its peak memory is this variant's alone
    import loss as L
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    n = responses * tokens
    h = torch.randn(n, hidden, dtype=dt) * 0.5
    w = (torch.randn(vocab, hidden, dtype=dt) * hidden ** -0.5).requires_grad_(True)
    target = torch.randint(0, vocab, (n,))
    behavior = -torch.rand(responses, tokens) * 2
    adv = torch.randn(responses)
    mask = torch.ones(responses, tokens, dtype=torch.bool)
    base = _peak_rss_mb()
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        logits = h @ w.T                                                    # [n, V] in `dtype`
        if variant == "naive":
            lp = torch.log_softmax(logits.float() / temperature, -1).gather(1, target[:, None]).squeeze(1)
        else:
            lp = L.token_logprobs(logits, target, temperature)
        out, _ = L.policy_loss(lp.view(responses, tokens), behavior, adv, mask, clip_low=0.0,
                               clip_high=5.0, nav_delta=1e-4, return_metrics=False)
        out.backward()
        w.grad = None
        del logits, lp, out
        times.append(time.perf_counter() - t0)
    queue.put((min(times[1:]), _peak_rss_mb() - base))


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    print(f"{responses} responses × {tokens} tokens = {responses * tokens} tokens, hidden {hidden}, "
          f"vocab {vocab}, {dtype}; logits alone: {responses * tokens * vocab * 2 / 2**30:.2f} GiB in bf16, "
          f"{responses * tokens * vocab * 4 / 2**30:.2f} GiB in fp32")
    print(f"| {'path':<28} | {'fwd+bwd s':>9} | {'peak extra MB':>13} |")
    print(f"|{'-' * 30}|{'-' * 11}|{'-' * 15}|")
    for variant, name in [("naive", "naive log_softmax (fp32)"), ("chunked", "loss.token_logprobs")]:
        q = ctx.Queue()
        p = ctx.Process(target=_run, args=(variant, q))
        p.start()
        p.join()
        if p.exitcode != 0:
            print(f"| {name:<28} | {'failed':>9} | {'(exit ' + str(p.exitcode) + ')':>13} |")
            continue
        seconds, peak = q.get()
        print(f"| {name:<28} | {seconds:9.2f} | {peak:13.0f} |")
