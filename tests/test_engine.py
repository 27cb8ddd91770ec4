"""engine.py's contract, in process (no engine is started): GPU groups per engine, samples per problem, the
evaluation rows a policy's graded samples give, and a results table a rerun updates in place."""
import pytest

import common
import engine


def test_each_engine_gets_its_own_consecutive_gpus_from_the_visible_list():
    assert engine.engine_gpu_groups(2, 2, visible="4,5,6,7") == ["4,5", "6,7"]
    assert engine.engine_gpu_groups(4, 1, visible="") == ["0", "1", "2", "3"]        # nothing set: 0..n−1
    with pytest.raises(SystemExit, match="2 engines × tensor_parallel 2 need 4 GPUs; CUDA_VISIBLE_DEVICES has 3"):
        engine.engine_gpu_groups(2, 2, visible="0,1,2")
    assert engine.n_engines(0, 1) == 1 and engine.n_engines(8, 2) == 4              # a CPU: one engine


def test_k_is_per_benchmark_when_listed():
    sets = {"aime24": [], "math500": []}
    assert engine.samples_per_problem(sets, 4, "aime24:32") == {"aime24": 32, "math500": 4}


def test_avg_at_k_is_the_mean_share_right_and_pass_at_k_the_share_with_one_right():
    avg, passed = engine.avg_and_pass_at_k([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert avg == pytest.approx((0.25 + 0 + 1) / 3)
    assert passed == pytest.approx(2 / 3)


def test_the_standard_error_of_avg_at_k_is_the_spread_of_the_problems_means():
    # problem means 1/4, 0, 1 (mean 5/12): squared deviations 1/36, 25/144, 49/144 sum to 13/24; over n − 1 = 2
    # and n = 3 problems: 13/144, whose root is √13 / 12 = 0.30046
    assert engine.avg_at_k_stderr([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]) == pytest.approx(13 ** 0.5 / 12)
    assert engine.avg_at_k_stderr([[1, 0]]) is None       # one problem: no spread to measure


def evaluation(sets, k):
    return engine.Evaluation(sets=sets, k=k, temperature=1.0, top_p=0.7, max_prompt_tokens=64, max_response_tokens=8,
                             prompt_template="{problem}", chat_template=False, seed=0, grader_workers=1,
                             grader_timeout_s=5.0)


def test_a_policys_samples_give_one_row_per_benchmark_with_avg_and_pass_at_k(tmp_path):
    # a: problem 0 right in 1 of 2 samples, problem 1 in none → avg@2 = (1/2 + 0) / 2 = 0.25, pass@2 = 1/2;
    # b: its one problem right in both → 1, 1; its second problem was skipped (prompt too long: no samples)
    sets = {"a": [{"id": "a0", "answer": "1"}, {"id": "a1", "answer": "2"}],
            "b": [{"id": "b0", "answer": "3"}, {"id": "b1", "answer": "4"}]}
    right, wrong = {"reason": "correct", "extracted": "x"}, {"reason": "wrong", "extracted": "y"}
    samples = [("a", 0, 1, "t", 0.0, wrong), ("a", 0, 0, "t", 1.0, right), ("a", 1, 0, "t", 0.0, wrong),
               ("a", 1, 1, "t", 0.0, wrong), ("b", 0, 0, "t", 1.0, right), ("b", 0, 1, "t", 1.0, right)]
    rows = engine.score(samples, evaluation(sets, {"a": 2, "b": 2}), {"stage": 3, "updates": 12, "policy": "p"},
                        tmp_path / "samples")
    got = {r["benchmark"]: (r["avg_at_k"], r["pass_at_k"], r["problems"], r["skipped_long_prompts"]) for r in rows}
    assert got == {"a": (0.25, 0.5, 2, 0), "b": (1.0, 1.0, 1, 1)}
    # a's problem means 1/2 and 0: deviations ±1/4, (1/16 + 1/16) / 1 / 2 = 1/16 → 1/4; b has one problem
    assert {r["benchmark"]: r["avg_at_k_stderr"] for r in rows} == {"a": 0.25, "b": None}
    assert all(r["stage"] == 3 and r["updates"] == 12 and r["k"] == 2 and r["top_p"] == 0.7 for r in rows)
    written = common.read_jsonl(tmp_path / "samples" / "a.jsonl")          # in problem, then sample order
    assert [(s["id"], s["sample_idx"], s["reward"]) for s in written] == [("a0", 0, 1.0), ("a0", 1, 0.0),
                                                                           ("a1", 0, 0.0), ("a1", 1, 0.0)]


def test_a_rerun_replaces_its_rows_and_keeps_the_others(tmp_path):
    path = tmp_path / "results.jsonl"
    row = lambda stage, bench, policy, acc: {"stage": stage, "benchmark": bench, "policy": policy, "avg_at_k": acc}  # noqa: E731
    engine.update_results(path, [row(0, "a", "p0", 0.1), row(0, "b", "p0", 0.2), row(1, "a", "p1", 0.3)])
    engine.update_results(path, [row(0, "a", "p0", 0.4)])                    # stage 0's "a" evaluated again
    assert [(r["stage"], r["benchmark"], r["avg_at_k"]) for r in common.read_jsonl(path)] == \
        [(0, "b", 0.2), (1, "a", 0.3), (0, "a", 0.4)]
    engine.update_results(path, [row(0, "a", "p0-other", 0.5)])              # another policy at the same stage
    assert len(common.read_jsonl(path)) == 4
