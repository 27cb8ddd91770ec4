"""The evaluation protocol: benchmark sets, avg@k sampling and grading, the results file. generate.py (the evaluations its
engines make before a stage's rollouts) and evaluate.py share it: every benchmark's prompts sampled k times each by the engine (the share
of one data-parallel engine), graded by reward.py; per benchmark avg@k, pass@k and avg@k's standard error, one
results row (results.jsonl, keyed on stage, benchmark and policy) and the graded samples.

A policy's evaluation can be kept in a cache directory and reused by every later run that evaluates the same policy
under the same protocol (evaluate.py --cache, run_stages.sh EVAL_CACHE: runs that start from one initial policy
evaluate it once).

Nothing here parses a command line; the scripts pass their settings.
"""
import dataclasses
import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

from mu_grpo import common, grading, records


@dataclasses.dataclass
class Evaluation:
    """The evaluation protocol: benchmark rows by name, samples per problem, sampling and grading."""
    sets: dict                          # {benchmark: [problem rows]}
    k: dict                             # {benchmark: samples per problem}
    temperature: float
    top_p: float
    max_prompt_tokens: int
    max_response_tokens: int
    prompt_template: str
    chat_template: bool
    seed: int
    grader_workers: int
    grader_timeout_s: float


def benchmark_sets(names, data_dir, max_problems=0):
    """{benchmark: problem rows} from <data_dir>/<benchmark>.jsonl (the first max_problems of each; 0: all); a
    missing file is fetched with data/prepare.py, or named in one line with the way to provide it offline."""
    sets = {}
    for name in names:
        path = Path(data_dir) / f"{name}.jsonl"
        if not path.exists():
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
            import prepare  # data/prepare.py, found once data/ is on the path (above)
            try:
                prepare.prepare(name, str(path))
            except Exception as e:
                raise SystemExit(f"benchmark {name!r} is not at {path} and could not be fetched ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:200] if str(e) else ''}). Offline: place a JSONL file with "
                                 f"fields id, problem, answer, source at {path} (data/prepare.py --input=<local file> "
                                 f"--out={path} converts one), or point EVAL_DATA_DIR at a directory of them") from None
        rows = common.load_problems(path)
        sets[name] = rows[:max_problems] if max_problems else rows
    return sets


def samples_per_problem(sets, k, k_per_benchmark=""):
    """{benchmark: k}: k, or the benchmark's entry in k_per_benchmark ("aime24:32,aime25:32")."""
    ks = dict(item.split(":") for item in k_per_benchmark.split(",") if item.strip()) if k_per_benchmark else {}
    return {name: int(ks.get(name, k)) for name in sets}


def protocol(benchmarks, data_dir, k, k_per_benchmark="", max_problems=0, **settings):
    """A command line's Evaluation: the benchmarks of the comma list `benchmarks` in data_dir (benchmark_sets), k
    samples per problem (samples_per_problem), and Evaluation's sampling and grading fields (`settings`)."""
    sets = benchmark_sets([b.strip() for b in benchmarks.split(",") if b.strip()], data_dir, max_problems)
    return Evaluation(sets=sets, k=samples_per_problem(sets, k, k_per_benchmark), **settings)


def avg_and_pass_at_k(correct):
    """correct: per problem, a list of k 0/1 rewards → (avg@k, pass@k)."""
    if not correct:
        return float("nan"), float("nan")
    avg = sum(sum(c) / len(c) for c in correct) / len(correct)
    passed = sum(any(x == 1.0 for x in c) for c in correct) / len(correct)
    return avg, passed


def avg_at_k_stderr(correct):
    """correct: per problem, a list of k 0/1 rewards → the standard error of avg@k: the spread of the problems'
    mean rewards over √(problems), sampling noise and problem-to-problem differences both in it (None below two)."""
    means = [sum(c) / len(c) for c in correct]
    if len(means) < 2:
        return None
    mean = sum(means) / len(means)
    return math.sqrt(sum((m - mean) ** 2 for m in means) / (len(means) - 1) / len(means))


def sample_and_grade(llm, ev, rank=0, n=1):
    """Every benchmark's prompts at positions ≡ rank (mod n) (the share of one data-parallel engine), sampled in
    one generate call, then graded: [(benchmark, problem index, sample index, text, reward, info)]."""
    from vllm import SamplingParams  # vLLM: only in a process that runs an engine
    tokenizer = llm.get_tokenizer()
    stops = common.stop_token_ids(tokenizer, ev.chat_template)      # EOS and the chat turn's end
    fitting = [(name, j, row, ids) for name, rows in ev.sets.items() for j, row in enumerate(rows)
               if len(ids := common.build_prompt_ids(tokenizer, row["problem"], ev.prompt_template, ev.chat_template))
               <= ev.max_prompt_tokens]
    no_problem(ev, {name for name, *_ in fitting})          # (every engine alike, before any sampling)
    requests = fitting[rank::n]
    params = [SamplingParams(n=ev.k[name], temperature=ev.temperature, top_p=ev.top_p, max_tokens=ev.max_response_tokens,
                             stop_token_ids=stops, seed=common.sample_seed(ev.seed, name, j))
              for name, j, _, _ in requests]
    outputs = llm.generate([{"prompt_token_ids": ids} for *_, ids in requests], params, use_tqdm=rank == 0)
    samples = [(name, j, c.index, c.text, row["answer"], row.get("source", name))
               for (name, j, row, _), o in zip(requests, outputs) for c in sorted(o.outputs, key=lambda c: c.index)]
    graded = grading.grade_batch([(text, gold, source) for *_, text, gold, source in samples],
                                workers=ev.grader_workers, timeout_s=ev.grader_timeout_s)
    return [(name, j, i, text, r, {"reason": info["reason"], "extracted": info.get("extracted")})
            for (name, j, i, text, _, _), (r, info) in zip(samples, graded)]


def no_problem(ev, sampled):
    """Exit naming the first benchmark none of whose problems is among `sampled` (their prompts all too long): an
    evaluation of no problem has no accuracy (it would be a NaN row in results.jsonl, averaged into the summaries)."""
    if empty := [name for name in ev.sets if name not in sampled]:
        raise SystemExit(f"benchmark {empty[0]}: none of its {len(ev.sets[empty[0]])} problems fits in "
                         f"max_prompt_tokens={ev.max_prompt_tokens} (the prompt template's tokens included): an "
                         f"evaluation of no problem has no accuracy; raise MAX_PROMPT or leave it out of BENCHMARKS")


def score(samples, ev, labels, sample_dir=None):
    """One results row per benchmark for one policy's graded samples (labels: the row's other fields, e.g.
    stage, updates, policy, hours); the samples go to <sample_dir>/<benchmark>.jsonl."""
    by_problem = {}
    for name, j, i, text, r, info in samples:
        by_problem.setdefault((name, j), []).append((i, text, r, info))
    no_problem(ev, {name for name, _ in by_problem})
    rows = []
    for name, problems in ev.sets.items():
        done = sorted(j for b, j in by_problem if b == name)
        correct = [[r for _, _, r, _ in sorted(by_problem[name, j])] for j in done]
        avg, passed = avg_and_pass_at_k(correct)
        rows.append({**labels, "benchmark": name, "k": ev.k[name], "avg_at_k": avg,
                     "avg_at_k_stderr": avg_at_k_stderr(correct), "pass_at_k": passed,
                     "problems": len(done), "skipped_long_prompts": len(problems) - len(done),
                     **protocol_labels(ev), "time": time.time()})
        if sample_dir:
            Path(sample_dir).mkdir(parents=True, exist_ok=True)
            common.atomic_write_lines(Path(sample_dir) / f"{name}.jsonl", [
                {"id": problems[j]["id"], "sample_idx": i, "response": text, "answer": problems[j]["answer"],
                 "reward": r, "reason": info["reason"], "extracted": info.get("extracted")}
                for j in done for i, text, r, info in sorted(by_problem[name, j])])
    return rows


def hours_since(run_start):
    """A results row's hours: since the run's start (time.time()), 0.0 without one."""
    return (time.time() - run_start) / 3600 if run_start else 0.0


def policy_rows(samples, ev, labels, sample_dir=None, say=""):
    """One policy's results rows (score), labelled as results.jsonl has them (`labels`, in this order: the stage it
    was trained on, the trainer's updates behind it, hours_since the run's start, the policy, the seconds its
    evaluation took and the engines that sampled it). Each row is printed in one line, after `say`."""
    rows = score(samples, ev, labels, sample_dir)
    for r in rows:
        print(f"{say}{r['benchmark']}: avg@{r['k']} {r['avg_at_k']:.4f}  pass@{r['k']} {r['pass_at_k']:.4f}  "
              f"({r['problems']} problems)", flush=True)
    return rows


def stage_samples_dir(results, stage):
    """Where the graded samples of the policy trained on `stage` go: beside the results table."""
    return Path(results).parent / records.EVAL_SAMPLES / records.stage_dir("", stage)


def protocol_labels(ev):
    """What a results row says of its protocol besides k (records.PROTOCOL: the fields that key it)."""
    return {"temperature": ev.temperature, "top_p": ev.top_p, "max_prompt_tokens": ev.max_prompt_tokens,
            "max_response_tokens": ev.max_response_tokens, "prompt_template": ev.prompt_template, "seed": ev.seed}


def update_results(path, rows):
    """Write rows into a results table (JSONL), keyed on (stage, benchmark, policy, protocol): a rerun replaces its
    rows and keeps the others; an evaluation under another protocol (a hand evaluation at another k or top_p) adds
    its rows beside the run's, never in their place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replaced = lambda old: any((old["stage"], old["benchmark"], old.get("policy")) == (r["stage"], r["benchmark"],  # noqa: E731
                                                                                    r["policy"])
                               and records.same_protocol(old, r) for r in rows)
    common.atomic_write_lines(path, [r for r in read_results(path) if not replaced(r)] + rows)


def read_results(path):
    """A results table's rows ([] where there is none); a damaged one is named in one line with what to do."""
    try:
        return common.read_jsonl(path, missing_ok=True)
    except ValueError as e:
        raise SystemExit(f"{e}: results.jsonl is written whole (never appended), so this is damage from outside the "
                         f"run: restore it from a copy, or remove the damaged line to evaluate those policies again")


def evaluated(results, stage, ev):
    """Whether the results table holds a row of every benchmark of ev for `stage` under ev's protocol (a resumed
    run does not redo them; an evaluation under another protocol does not count)."""
    rows = [r for r in read_results(results) if r["stage"] == stage]
    return all(any(r["benchmark"] == name and records.same_protocol(r, {"k": k, **protocol_labels(ev)}) for r in rows)
               for name, k in ev.k.items())


def part_path(directory, r):
    """Where data-parallel engine r leaves its graded samples for the process that scores them."""
    return Path(directory) / f"part_{r}.json"


def write_part(directory, r, samples, start, end):
    """Engine r's part of an evaluation: its graded samples of each policy it sampled ([policy][sample]), and when
    it sampled them (Unix seconds)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    common.atomic_write_json(part_path(directory, r), {"start": start, "end": end, "samples": samples})


def merge_parts(directory, n):
    """The parts n data-parallel engines left in directory (write_part) as one evaluation, the one merge every mode
    takes: each policy's samples from every engine in engine order, and the span they sampled in (the first start,
    the last end)."""
    parts = [json.loads(part_path(directory, r).read_text()) for r in range(n)]
    samples = [[x for part in parts for x in part["samples"][i]] for i in range(len(parts[0]["samples"]))]
    return samples, min(part["start"] for part in parts), max(part["end"] for part in parts)


# ----------------------------------------------------------------------------- evaluations reused across runs


def evaluation_key(ev, policy):
    """What one policy's evaluation depends on, as sha256 (16 hex digits): the policy's fingerprint (its files), every
    field of the protocol but the graders' count (the benchmarks' problems included), the libraries, this code's
    commit and the engines' dtype. Every request samples from its own seed (sample_and_grade), so two evaluations
    with one key give the same rows whichever run, mode or engine count makes them."""
    protocol = {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev) if f.name != "grader_workers"}
    return hashlib.sha256(json.dumps({"policy": common.policy_fingerprint(str(policy)), "protocol": protocol,
                                      "versions": common.versions(), "dtype": common.engine_dtype()},
                                     sort_keys=True).encode()).hexdigest()[:16]


def cache_entry(cache_dir, key):
    """Where an evaluation is kept: <cache_dir>/<key>/ with rows.json (its results rows) and the graded samples
    (<benchmark>.jsonl), renamed into place whole; beside it <key>.lock, held while one process evaluates it."""
    return Path(cache_dir) / key


def keep(entry, rows, sample_dir):
    """Put an evaluation into the cache: its rows and the sample files policy_rows wrote into sample_dir."""
    tmp = entry.with_name(f".{entry.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for row in rows:
        shutil.copy2(Path(sample_dir) / f"{row['benchmark']}.jsonl", tmp / f"{row['benchmark']}.jsonl")
    common.atomic_write_json(tmp / "rows.json", rows)
    tmp.replace(entry)
    common.fsync_dir(entry.parent)


def reuse(entry, results, *, stage, updates, policy, run_start, sample_dir):
    """A kept evaluation as this run's: its rows labelled as policy_rows labels them (stage, updates, hours since
    run_start, policy), with "reused": the entry and "seconds" the copy's, written into the results table; its samples
    copied into sample_dir. Returns the rows."""
    t0 = time.perf_counter()
    kept = json.loads((entry / "rows.json").read_text())
    Path(sample_dir).mkdir(parents=True, exist_ok=True)
    for row in kept:
        common.atomic_write((Path(sample_dir) / f"{row['benchmark']}.jsonl"),
                            (entry / f"{row['benchmark']}.jsonl").read_bytes())
    hours = (time.time() - run_start) / 3600 if run_start else 0.0
    rows = [{**row, "stage": stage, "updates": updates, "hours": hours, "policy": str(policy), "time": time.time(),
             "seconds": time.perf_counter() - t0, "reused": str(entry)} for row in kept]
    update_results(results, rows)
    return rows
