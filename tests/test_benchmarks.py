"""mu_grpo/benchmarks.py, the evaluation protocol, in process and by hand (no engine): benchmark sets, samples per problem,
avg@k, pass@k and avg@k's standard error, the rows and sample files a policy's graded samples give, the results
table a rerun updates in place, the engines' parts read back."""
import math

import pytest

from mu_grpo import benchmarks, common


def test_benchmark_sets_are_read_from_the_data_dir_and_cut_to_max_problems(tmp_path):
    rows = [{"id": f"x{i}", "problem": f"{i} + 1", "answer": str(i + 1), "source": "x"} for i in range(3)]
    common.atomic_write_lines(tmp_path / "x.jsonl", rows)
    common.atomic_write_lines(tmp_path / "y.jsonl", rows[:1])
    assert benchmarks.benchmark_sets(["x", "y"], tmp_path) == {"x": rows, "y": rows[:1]}
    assert benchmarks.benchmark_sets(["x", "y"], tmp_path, max_problems=2) == {"x": rows[:2], "y": rows[:1]}
    # a missing file that data/prepare.py cannot fetch (no such hub dataset): one line naming the way offline
    with pytest.raises(SystemExit, match=r"benchmark 'nonexistent' is not at .*nonexistent\.jsonl and could not be "
                                         r"fetched \(ValueError: unknown dataset 'nonexistent'.*\)\. Offline: place"):
        benchmarks.benchmark_sets(["x", "nonexistent"], tmp_path)


def test_k_is_per_benchmark_when_listed():
    sets = {"aime24": [], "math500": []}
    assert benchmarks.samples_per_problem(sets, 4, "aime24:32") == {"aime24": 32, "math500": 4}
    assert benchmarks.samples_per_problem(sets, 4) == {"aime24": 4, "math500": 4}
    # an empty item is skipped; a benchmark listed but not evaluated is ignored; the k are whole numbers
    assert benchmarks.samples_per_problem(sets, 2, "math500:8,,gsm8k:16") == {"aime24": 2, "math500": 8}


def test_avg_at_k_is_the_mean_share_right_and_pass_at_k_the_share_with_one_right():
    avg, passed = benchmarks.avg_and_pass_at_k([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert avg == pytest.approx((0.25 + 0 + 1) / 3)
    assert passed == pytest.approx(2 / 3)
    # a reward below 1 (a format bonus for a boxed wrong answer) counts in avg@k but is no pass:
    # problem means (0.1 + 0) / 2 = 0.05 and (1 + 0.1) / 2 = 0.55 → avg@2 = 0.3; one problem of two passed
    avg, passed = benchmarks.avg_and_pass_at_k([[0.1, 0.0], [1.0, 0.1]])
    assert avg == pytest.approx(0.3) and passed == 0.5
    # every problem weighs the same, whatever its samples: means 1 and 0 → 1/2 (not the pooled 4 right of 6)
    assert benchmarks.avg_and_pass_at_k([[1, 1, 1, 1], [0, 0]]) == (0.5, 0.5)
    assert all(math.isnan(x) for x in benchmarks.avg_and_pass_at_k([]))     # no problem: no number


def test_the_standard_error_of_avg_at_k_is_the_spread_of_the_problems_means():
    # problem means 1/4, 0, 1 (mean 5/12): squared deviations 1/36, 25/144, 49/144 sum to 13/24; over n − 1 = 2
    # and n = 3 problems: 13/144, whose root is √13 / 12 = 0.30046
    assert benchmarks.avg_at_k_stderr([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]) == pytest.approx(13 ** 0.5 / 12)
    # means 1 and 0: deviations ±1/2, (1/4 + 1/4) / 1 / 2 = 1/4 → 1/2
    assert benchmarks.avg_at_k_stderr([[1], [0]]) == pytest.approx(0.5)
    assert benchmarks.avg_at_k_stderr([[1, 0], [0, 1]]) == 0.0        # equal means: no spread
    assert benchmarks.avg_at_k_stderr([[1, 0]]) is None       # one problem: no spread to measure
    assert benchmarks.avg_at_k_stderr([]) is None


def evaluation(sets, k):
    return benchmarks.Evaluation(sets=sets, k=k, temperature=1.0, top_p=0.7, max_prompt_tokens=64,
                                 max_response_tokens=8, prompt_template="{problem}", chat_template=False, seed=0,
                                 grader_workers=1, grader_timeout_s=5.0)


def test_a_policys_samples_give_one_row_per_benchmark_with_avg_and_pass_at_k(tmp_path):
    # a: problem 0 right in 1 of 2 samples, problem 1 in none → avg@2 = (1/2 + 0) / 2 = 0.25, pass@2 = 1/2;
    # b: its one problem right in both → 1, 1; its second problem was skipped (prompt too long: no samples)
    sets = {"a": [{"id": "a0", "answer": "1"}, {"id": "a1", "answer": "2"}],
            "b": [{"id": "b0", "answer": "3"}, {"id": "b1", "answer": "4"}]}
    right, wrong = {"reason": "correct", "extracted": "x"}, {"reason": "wrong", "extracted": "y"}
    samples = [("a", 0, 1, "t1", 0.0, wrong), ("a", 0, 0, "t0", 1.0, right), ("a", 1, 0, "t", 0.0, wrong),
               ("a", 1, 1, "t", 0.0, {"reason": "no answer"}), ("b", 0, 0, "t", 1.0, right),
               ("b", 0, 1, "t", 1.0, right)]
    rows = benchmarks.score(samples, evaluation(sets, {"a": 2, "b": 2}),
                            {"stage": 3, "updates": 12, "policy": "p"}, tmp_path / "samples")
    assert [r["benchmark"] for r in rows] == ["a", "b"]                     # the sets' order
    got = {r["benchmark"]: (r["avg_at_k"], r["pass_at_k"], r["problems"], r["skipped_long_prompts"]) for r in rows}
    assert got["a"] == (0.25, 0.5, 2, 0) and got["b"] == (1.0, 1.0, 1, 1)
    # a's problem means 1/2 and 0: deviations ±1/4, (1/16 + 1/16) / 1 / 2 = 1/16 → 1/4; b has one problem
    assert {r["benchmark"]: r["avg_at_k_stderr"] for r in rows} == {"a": 0.25, "b": None}
    assert [r["k"] for r in rows] == [2, 2]
    assert all(r["stage"] == 3 and r["updates"] == 12 and r["policy"] == "p" and r["temperature"] == 1.0
               and r["top_p"] == 0.7 and isinstance(r["time"], float) for r in rows)
    written = common.read_jsonl(tmp_path / "samples" / "a.jsonl")          # in problem, then sample order
    assert written == [
        {"id": "a0", "sample_idx": 0, "response": "t0", "answer": "1", "reward": 1.0, "reason": "correct",
         "extracted": "x"},
        {"id": "a0", "sample_idx": 1, "response": "t1", "answer": "1", "reward": 0.0, "reason": "wrong",
         "extracted": "y"},
        {"id": "a1", "sample_idx": 0, "response": "t", "answer": "2", "reward": 0.0, "reason": "wrong",
         "extracted": "y"},
        {"id": "a1", "sample_idx": 1, "response": "t", "answer": "2", "reward": 0.0, "reason": "no answer",
         "extracted": None}]
    assert [s["id"] for s in common.read_jsonl(tmp_path / "samples" / "b.jsonl")] == ["b0", "b0"]
    # no sample directory: the rows alone
    assert len(benchmarks.score(samples, evaluation(sets, {"a": 2, "b": 2}), {"stage": 0}, None)) == 2
    # c: its only problem skipped (its prompt too long): no accuracy, an error naming it (before: a NaN row)
    with pytest.raises(SystemExit) as e:
        benchmarks.score(samples, evaluation({**sets, "c": [{"id": "c0", "answer": "5"}]}, {"a": 2, "b": 2, "c": 4}),
                         {"stage": 0})
    assert str(e.value).startswith("benchmark c: none of its 1 problems fits in max_prompt_tokens=")


def test_a_rerun_replaces_its_rows_and_keeps_the_others(tmp_path):
    path = tmp_path / "run" / "results.jsonl"                                 # its directory is made
    row = lambda stage, bench, policy, acc: {"stage": stage, "benchmark": bench, "policy": policy, "avg_at_k": acc}  # noqa: E731
    benchmarks.update_results(path, [row(0, "a", "p0", 0.1), row(0, "b", "p0", 0.2), row(1, "a", "p1", 0.3)])
    benchmarks.update_results(path, [row(0, "a", "p0", 0.4)])                # stage 0's "a" evaluated again
    assert [(r["stage"], r["benchmark"], r["avg_at_k"]) for r in common.read_jsonl(path)] == \
        [(0, "b", 0.2), (1, "a", 0.3), (0, "a", 0.4)]
    benchmarks.update_results(path, [row(0, "a", "p0-other", 0.5)])          # another policy at the same stage
    assert len(common.read_jsonl(path)) == 4
    # an older row without a policy is another policy's: kept
    common.atomic_write_lines(path, [{"stage": 0, "benchmark": "a", "avg_at_k": 0.6}])
    benchmarks.update_results(path, [row(0, "a", "p0", 0.7)])
    assert [r["avg_at_k"] for r in common.read_jsonl(path)] == [0.6, 0.7]


def test_a_hand_evaluation_under_another_protocol_adds_rows_and_the_runs_summaries_keep_its_own(tmp_path):
    from mu_grpo import records
    path = tmp_path / "results.jsonl"
    row = lambda k, top_p, acc, t: {"stage": 0, "benchmark": "a", "policy": "p", "k": k, "temperature": 1.0,  # noqa: E731
                                    "top_p": top_p, "max_prompt_tokens": 64, "max_response_tokens": 16,
                                    "prompt_template": "{problem}", "seed": 0, "avg_at_k": acc, "time": t}
    benchmarks.update_results(path, [row(4, 1.0, 0.5, 1.0)])                 # the run's own
    benchmarks.update_results(path, [row(1, 0.7, 0.9, 2.0)])                 # by hand, k=1 and top_p 0.7
    assert [r["avg_at_k"] for r in common.read_jsonl(path)] == [0.5, 0.9]    # before: 0.9 replaced the run's row
    assert [r["avg_at_k"] for r in records.own_results(common.read_jsonl(path))] == [0.5]
    benchmarks.update_results(path, [row(4, 1.0, 0.6, 3.0)])                 # the run's protocol again: replaced
    assert [r["avg_at_k"] for r in common.read_jsonl(path)] == [0.9, 0.6]
    ev = evaluation({"a": [{"id": "a0", "answer": "1"}]}, {"a": 4})
    ev.top_p, ev.max_prompt_tokens, ev.max_response_tokens, ev.prompt_template, ev.seed = 1.0, 64, 16, "{problem}", 0
    assert benchmarks.evaluated(path, 0, ev)
    ev.top_p = 0.7
    assert not benchmarks.evaluated(path, 0, ev)                             # k=1 by hand is not this protocol's


def test_the_engines_parts_merge_in_rank_order_with_their_span(tmp_path):
    # engine r's samples of two policies ([policy][sample]), written out of rank order, and when each sampled
    a0, b0 = ["a", 0, 0, "t", 1.0, {"reason": "correct"}], ["a", 0, 0, "v", 0.0, {"reason": "wrong"}]
    a1, b1 = ["a", 1, 0, "u", 0.0, {"reason": "wrong"}], ["a", 1, 0, "w", 1.0, {"reason": "correct"}]
    parts = {0: ([[a0], [b0]], 10.0, 14.0), 1: ([[], []], 11.0, 12.0), 2: ([[a1], [b1]], 9.5, 13.0)}
    for r in (2, 0, 1):
        benchmarks.write_part(tmp_path, r, *parts[r])
    assert benchmarks.merge_parts(tmp_path, 3) == ([[a0, a1], [b0, b1]], 9.5, 14.0)   # first start, last end
    assert benchmarks.merge_parts(tmp_path, 2) == ([[a0], [b0]], 10.0, 14.0)
    with pytest.raises(FileNotFoundError, match="part_3.json"):              # an engine that left none
        benchmarks.merge_parts(tmp_path, 4)
