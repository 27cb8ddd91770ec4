"""One engine's shards of a stage (generate.py's): their prompts rendered into vLLM requests (G samples each, its
own sampling seed), fed to the engine back to back, and each shard's responses graded (reward.py), given their
group advantages (loss.py) and written (mu_grpo/rollouts.py) in the background while the engine goes on. The stage's
settings come in its plan (generate.py's plan_of: what the stage's plan.json records), so a shard is the same
whichever engine, process or resumed attempt samples it.
"""
import concurrent.futures
import dataclasses
import functools
import time
from pathlib import Path

from tqdm import tqdm

import loss
from mu_grpo import common, grading, rollouts
import reward


@dataclasses.dataclass(frozen=True)
class Job:
    """One engine's part of a stage: the stage's plan (its index, its policy's label, the sampling, prompt and
    grading settings), where its shards go, this engine's index among the run's (each shard's stats record it), its
    grading processes and their timeout per response, and whether it shows a progress bar."""
    plan: dict
    out_dir: Path
    engine: int
    graders: int
    grader_timeout_s: float
    progress_bar: bool = True


def shard_requests(job, tokenizer, rows, positions):
    """The engine requests for the stage's prompts at `positions`: [(position, row, prompt ids)] of the
    prompts kept, their SamplingParams (G samples each, its own seed), and the number skipped as too long."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams   # (vLLM: only in a process that has an engine)
    plan = job.plan
    kept, skipped = [], 0
    for pos, row in zip(positions, rows):
        ids = common.build_prompt_ids(tokenizer, row["problem"], plan["prompt_template"], plan["chat_template"])
        if len(ids) > plan["max_prompt_tokens"]:
            skipped += 1
            continue
        kept.append((pos, row, ids))
    stops = common.stop_token_ids(tokenizer, plan["chat_template"])      # EOS and the chat turn's end
    # detokenize=False: with log-probs on, vLLM decodes every sampled token to text a second time for its
    # Logprob entries (vllm/v1/engine/logprobs.py, _update_sample_logprobs), which cost 40 % of the
    # throughput here (bench/bench_generate.py); the responses are decoded once per shard in the grading
    # thread instead (response_texts). FINAL_ONLY: one output per prompt, its G samples together
    # (vllm/v1/engine/parallel_sampling.py, ParentRequest.get_outputs), as LLM.generate asks for.
    seeded = plan.get("per_request_seed", True)      # (plan.json leaves the default out)
    params = [SamplingParams(n=plan["group_size"], temperature=plan["temperature"], top_p=plan["top_p"],
                             top_k=plan["top_k"], max_tokens=plan["max_response_tokens"], logprobs=0,
                             flat_logprobs=True, stop_token_ids=stops, detokenize=False,
                             output_kind=RequestOutputKind.FINAL_ONLY,
                             seed=common.sample_seed(plan["seed"], plan["stage"], pos) if seeded else None)
              for pos, _, _ in kept]
    return kept, params, skipped


def response_texts(tokenizer, token_id_lists):
    """The responses as text, as vLLM's incremental detokenizer would give them with
    skip_special_tokens=True: special tokens dropped, and a trailing incomplete UTF-8 sequence (a
    response cut off mid-character) left out rather than shown as U+FFFD."""
    texts = tokenizer.batch_decode(token_id_lists, skip_special_tokens=True)
    return [t.rstrip("\ufffd") for t in texts]


def grade_and_write(job, k, shard, policy_id, tokenizer):
    """Grade shard k of the stage, compute group advantages and write the shard (its stats last). shard:
    generate_shards' record of it (its kept prompts and their outputs, the prompts skipped as too long, its generation
    seconds, when it started, the engine's largest batch); policy_id: the fingerprint of the policy that sampled it
    (its label: the plan's)."""
    s, label, group_size = job.plan["stage"], job.plan["policy"], job.plan["group_size"]
    kept = shard["kept"]
    samples = []  # (position in stage, row, prompt ids, completion) in group order
    for (pos, row, ids), out in zip(kept, shard["outputs"]):
        completions = sorted(out.outputs, key=lambda c: c.index)
        if len(completions) != group_size:
            raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {row['id']}, "
                               f"expected {group_size}")
        samples += [(pos, row, ids, c) for c in completions]
    token_lists = [list(c.token_ids) for _, _, _, c in samples]
    texts = response_texts(tokenizer, token_lists)
    items = [(text, row["answer"], row.get("source")) for (_, row, _, _), text in zip(samples, texts)]
    graded = grading.grade_batch(items, workers=job.graders, timeout_s=job.grader_timeout_s,
                                reward_fn=functools.partial(reward.grade, format_bonus=job.plan["format_bonus"]))
    rewards = [r for r, _ in graded]
    advantages, zero_var = (loss.group_advantages(rewards, group_size, job.plan["normalize_std"]) if samples
                            else ([], []))
    lines = []
    for i, ((pos, row, ids, c), token_ids, text, (r, info)) in enumerate(zip(samples, token_lists, texts, graded)):
        logprobs = sampled_logprobs(c.logprobs, token_ids)
        lines.append({
            "prompt_id": row["id"], "group": pos, "sample_idx": c.index, "stage": s, "policy": label,
            "policy_id": policy_id, "prompt_token_ids": ids, "response_token_ids": token_ids,
            "behavior_logprobs": logprobs, "finish_reason": finish_reason(c),
            "reward": r, "advantage": round(float(advantages[i]), 6), "zero_variance": bool(zero_var[i // group_size]),
            "prompt": row["problem"], "response": text, "answer": row["answer"], "source": row.get("source"),
            "reward_info": {"reason": info["reason"], "extracted": info.get("extracted")},
        })
    stats = {"shard": k, "prompts": len(kept), "skipped_long_prompts": shard["skipped"],
             **rollouts.shard_counts(lines, group_size), "generation_seconds": shard["seconds"],
             "started_at": shard["started_at"], "engine": job.engine, "max_num_seqs": shard["max_num_seqs"]}
    rollouts.write_shard(rollouts.shard_path(job.out_dir, k), lines)          # JSONL and its columns
    stats["finished_at"] = time.time()
    common.atomic_write_json(rollouts.stats_path(job.out_dir, k), stats)      # a shard counts once its stats exist too
    return stats


def sampled_logprobs(flat, token_ids):
    """The sampled tokens' log-probs from vLLM's FlatLogprobs (logprobs=0: one entry per position,
    the sampled token's; vllm/logprobs.py), rounded to 6 decimals."""
    if flat.token_ids != token_ids:
        raise RuntimeError(f"vLLM returned log-probs for tokens other than the sampled ones "
                           f"({len(flat.token_ids)} entries for {len(token_ids)} tokens)")
    return [round(x, 6) for x in flat.logprobs]


def finish_reason(completion):
    """stop | length | abort | error, as vLLM says (None: the request did not finish, an abort);
    optimize.py refuses to train on abort and error."""
    reason = completion.finish_reason or "abort"
    return reason if reason in rollouts.FINISH_REASONS else "error"


def generate_shards(llm, job, policy_id, shard_ids, shards):
    """The stage's shards `shard_ids` ({k: (positions, problem rows)} in `shards`) with this process's engine `llm`,
    sampled by the policy of fingerprint policy_id.

    The shards flow through the engine back to back: the next shard's requests wait in the engine's
    queue and take the places of the current shard's finished responses, so the batch stays full until
    the stage's last responses. (One LLM.generate call per shard returns only when its longest response
    is done; the batch shrinks to a few sequences meanwhile, once per shard.) The engine is driven as
    LLM.generate drives it (vllm/entrypoints/common/offline.py `_run_engine`: LLMEngine.add_request,
    then step() until nothing is unfinished). A shard whose last response has arrived is graded and
    written in a background thread (its graders are processes) while the engine goes on."""
    if not shard_ids:
        return
    s = job.plan["stage"]
    job.out_dir.mkdir(parents=True, exist_ok=True)     # an engine may start before the main process prepared it
    tokenizer = llm.get_tokenizer()
    core = llm.llm_engine
    max_num_seqs = core.vllm_config.scheduler_config.max_num_seqs   # the engine's largest batch
    waiting = list(shard_ids)   # shards not yet given to the engine, in order
    running = {}                # shard → its requests and the outputs received so far
    last_finished = time.perf_counter()  # when the engine last finished a shard (or started)
    progress = tqdm(total=sum(len(shards[k][0]) for k in shard_ids), desc=f"stage {s} prompts",
                    disable=not job.progress_bar)

    def submit_next():
        k = waiting.pop(0)
        positions, rows = shards[k]
        kept, params, skipped = shard_requests(job, tokenizer, rows, positions)
        # rendered as LLM.generate renders them (vllm/entrypoints/common/offline.py `_preprocess_cmpl`);
        # a raw prompt given to add_request takes the same path one by one, with a deprecation warning
        # (vllm/v1/engine/input_processor.py `process_inputs`)
        engine_inputs = llm.renderer.render_cmpl([{"prompt_token_ids": ids} for _, _, ids in kept]) if kept else []
        for i, (engine_input, p) in enumerate(zip(engine_inputs, params)):
            core.add_request(f"{s}/{k}/{i}", engine_input, p)
        running[k] = {"kept": kept, "outputs": [None] * len(kept), "left": len(kept), "skipped": skipped,
                      "submitted": time.perf_counter(), "started_at": time.time()}
        progress.update(skipped)

    def finish(k, grading):
        """Shard k's responses are all in: grade and write it in the background. Its generation time is
        the engine's time from the later of its submission and the previous shard's finish to its own
        finish, so the shards' times add up to the engine's."""
        nonlocal last_finished
        r, now = running.pop(k), time.perf_counter()
        seconds, last_finished = now - max(r["submitted"], last_finished), now
        return grading.submit(grade_and_write, job, k, {**r, "seconds": seconds, "max_num_seqs": max_num_seqs},
                              policy_id, tokenizer)

    def report(future):
        st = future.result()
        print(f"[engine {job.engine}] stage {s} shard {st['shard']}: {st['responses']} responses, mean reward "
              f"{st['reward_sum'] / max(1, st['responses']):.3f}, "
              f"{st['response_tokens'] / max(st['generation_seconds'], 1e-9):.0f} tokens/s", flush=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as grading:
        written = []
        while waiting or running:
            while waiting and len(running) < 2:      # the shard being generated and the next one
                submit_next()
            for k in [k for k, r in running.items() if r["left"] == 0]:  # every prompt too long
                written.append(finish(k, grading))
            if running and not core.has_unfinished_requests():
                raise RuntimeError(f"the engine finished every request, yet shards {sorted(running)} lack responses")
            for out in core.step() if running else []:
                if out.finished:
                    _, k, i = map(int, out.request_id.split("/"))
                    r = running[k]
                    r["outputs"][i], r["left"] = out, r["left"] - 1
                    progress.update(1)
                    if r["left"] == 0:
                        written.append(finish(k, grading))
            while written and written[0].done():
                report(written.pop(0))
        progress.close()
        for future in written:
            report(future)
