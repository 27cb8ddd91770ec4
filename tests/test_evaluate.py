"""evaluate.py's glue in process, no engine (its sampling replaced by given graded samples): the rows and sample files
it writes, and the evaluations generate.py's engines make (before a stage, and resident after the last), which must
write the same bytes from the same samples."""
import importlib
import json
import socket
import subprocess
import sys
import types

import pytest

from mu_grpo import benchmarks, common, nodes, stage_rules
from conftest import whole_checkpoint, ROOT

# a: problem 0 right in 1 of 2 samples, problem 1 in none → avg@2 = 0.25, pass@2 = 0.5; b: problem 0 right in both,
# problem 1 never sampled (its prompt too long) → avg@2 = pass@2 = 1, one skipped
RIGHT, WRONG = {"reason": "correct", "extracted": "1"}, {"reason": "wrong", "extracted": "7"}
SAMPLES = [("a", 0, 1, "t", 0.0, WRONG), ("a", 0, 0, "t", 1.0, RIGHT), ("a", 1, 0, "t", 0.0, WRONG),
           ("a", 1, 1, "t", 0.0, WRONG), ("b", 0, 0, "t", 1.0, RIGHT), ("b", 0, 1, "t", 1.0, RIGHT)]
PROMPTS = ["--prompt_template={problem}", "--max_prompt_tokens=64", "--max_response_tokens=8", "--grader_workers=1"]
CLOCK = types.SimpleNamespace(time=lambda: 1000.0 + 3600.0, perf_counter=lambda: 5.0)   # an hour into the run


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Two benchmarks, a policy the trainer wrote after 12 updates, and a clock the rows' times read."""
    (tmp_path / "bench").mkdir()
    for name in ("a", "b"):
        common.atomic_write_lines(tmp_path / "bench" / f"{name}.jsonl", [
            {"id": f"{name}{j}", "problem": f"{name} {j}", "answer": str(j), "source": name} for j in range(2)])
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text(json.dumps({"architectures": ["Toy"]}))
    whole_checkpoint(policy)
    (policy / common.POLICY_ID_FILE).write_text(json.dumps({"run_updates": 12}))
    monkeypatch.setattr(benchmarks, "time", CLOCK)
    return tmp_path, policy


def import_script(monkeypatch, name, *argv):
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def evaluate_alone(monkeypatch, tmp_path, policy):
    """evaluate.py --stage=3 on the policy, its engine's samples SAMPLES: its output lines."""
    evaluate = import_script(monkeypatch, "evaluate", f"--policy={policy}", "--benchmarks=a,b",
                             f"--data_dir={tmp_path / 'bench'}", "--k=2", "--top_p=0.7", "--stage=3", "--run_start=1000",
                             f"--results={tmp_path / 'alone' / 'results.jsonl'}", "--engines=1", *PROMPTS)
    monkeypatch.setattr(evaluate, "time", CLOCK)
    monkeypatch.setattr(evaluate, "sample_and_grade", lambda policies, ev, rank, n: ([list(SAMPLES)], 4600.0))
    evaluate.main()
    return evaluate


def test_evaluate_writes_a_row_per_benchmark_and_its_graded_samples(files, monkeypatch, capsys):
    tmp_path, policy = files
    evaluate_alone(monkeypatch, tmp_path, policy)
    rows = common.read_jsonl(tmp_path / "alone" / "results.jsonl")
    assert [(r["benchmark"], r["avg_at_k"], r["pass_at_k"], r["problems"], r["skipped_long_prompts"]) for r in rows] \
        == [("a", 0.25, 0.5, 2, 0), ("b", 1.0, 1.0, 1, 1)]
    # labelled with the stage, the trainer's updates (policy_id.json), hours since run_start, the policy, the seconds
    # per policy and the engines, in that order (the rows' bytes)
    assert [list(r)[:7] for r in rows] == [["stage", "updates", "hours", "policy", "seconds", "engines", "benchmark"]] * 2
    assert all((r["stage"], r["updates"], r["hours"], r["policy"], r["seconds"], r["engines"], r["k"], r["top_p"])
               == (3, 12, 1.0, str(policy), 0.0, 1, 2, 0.7) for r in rows)
    written = common.read_jsonl(tmp_path / "alone" / "eval_samples" / "stage_3" / "a.jsonl")
    assert [(s["id"], s["sample_idx"], s["reward"]) for s in written] == [("a0", 0, 1.0), ("a0", 1, 0.0),
                                                                           ("a1", 0, 0.0), ("a1", 1, 0.0)]
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["a: avg@2 0.2500  pass@2 0.5000  (2 problems)", "b: avg@2 1.0000  pass@2 1.0000  (1 problems)"]


def test_generate_pys_evaluations_write_evaluate_pys_rows_and_samples_byte_for_byte(files, monkeypatch, capsys):
    tmp_path, policy = files
    evaluate = evaluate_alone(monkeypatch, tmp_path, policy)
    alone = capsys.readouterr().out.splitlines()[:2]
    generate = import_script(monkeypatch, "generate", f"--run_dir={tmp_path / 'run'}",
                             "--evaluate=true", f"--eval_args=--benchmarks=a,b --data_dir={tmp_path / 'bench'} --k=2 "
                             f"--top_p=0.7", "--run_start=1000", "--engines=1",
                             f"--results={tmp_path / 'generate' / 'results.jsonl'}", *PROMPTS)
    monkeypatch.setattr(generate, "time", CLOCK)
    ev = generate.evaluation()
    assert ev == evaluate.evaluation()            # the same protocol from the same settings
    assert not benchmarks.evaluated(generate.results, 3, ev)
    # the engine's samples of the policy trained on stage 3, left as its part and scored as the flag of the policy
    # names it (the seconds: evaluate.py's, 0 on this clock)
    monkeypatch.setattr(benchmarks, "sample_and_grade", lambda llm, ev, rank, n: list(SAMPLES))
    generate.sample_evaluation(None, ev, tmp_path / "parts")
    row = generate.score_evaluation(ev, 3, str(policy), common.policy_record(policy)["run_updates"], tmp_path / "parts")
    assert row == {"phase": "eval", "name": "eval_3", "stage": 3, "start": 4600.0, "end": 4600.0}
    assert benchmarks.evaluated(generate.results, 3, ev) and not benchmarks.evaluated(generate.results, 4, ev)
    for name in ("results.jsonl", "eval_samples/stage_3/a.jsonl", "eval_samples/stage_3/b.jsonl"):
        assert (tmp_path / "generate" / name).read_bytes() == (tmp_path / "alone" / name).read_bytes(), name
    assert capsys.readouterr().out.splitlines() == [f"stage 3 {line}" for line in alone]


def test_an_evaluation_scored_after_the_stages_shards_is_timed_by_its_sampling(files, monkeypatch):
    # per phase the engines sample the evaluation (10-14 s on engine 0, 11-13 s on engine 1), generate their shards,
    # and only then (at 100 s) is it scored: the row's seconds and the timeline row are the sampling, not the shards
    tmp_path, policy = files
    generate = import_script(monkeypatch, "generate", f"--run_dir={tmp_path / 'run'}", "--evaluate=true",
                             f"--eval_args=--benchmarks=a,b --data_dir={tmp_path / 'bench'} --k=2", "--engines=2", f"--results={tmp_path / 'run' / 'results.jsonl'}", *PROMPTS)
    monkeypatch.setattr(generate, "time", types.SimpleNamespace(time=lambda: 100.0))
    benchmarks.write_part(tmp_path / "parts", 0, [SAMPLES[:3]], 10.0, 14.0)
    benchmarks.write_part(tmp_path / "parts", 1, [SAMPLES[3:]], 11.0, 13.0)
    row = generate.score_evaluation(generate.evaluation(), 0, str(policy), 12, tmp_path / "parts")
    assert (row["start"], row["end"]) == (10.0, 14.0)
    assert [r["seconds"] for r in common.read_jsonl(generate.results)] == [4.0, 4.0]


@pytest.mark.parametrize("every,due", [(1, [-1, 0, 1, 2, 3]), (2, [-1, 1, 3]), (3, [-1, 2, 3]), (0, [])])
def test_one_rule_says_which_policies_are_evaluated(files, monkeypatch, every, due):
    tmp_path, policy = files
    # a 4-stage run: the initial policy (−1), every every-th stage's, and the last (3) whatever every is; none at 0.
    # The policy trained on stage t is evaluated before stage t + 1 (its record's evaluate; t = 3: the run is over)
    plan = stage_rules.StagePlan(updates_per_stage=2, stages=4, eval_every=every)
    assert [t for t in range(-1, 4) if plan.stage(tmp_path, t + 1).evaluate] == due
    # the engines evaluate it when the record says so and the results table lacks it; without a table, never
    generate = import_script(monkeypatch, "generate", f"--results={tmp_path / 'r.jsonl'}",
                             f"--eval_args=--benchmarks=a,b --data_dir={tmp_path / 'bench'} --k=2", *PROMPTS)
    assert generate.evaluation_due(nodes.OneNode(), 1, {"evaluate": True}) \
        and not generate.evaluation_due(nodes.OneNode(), 1, {"evaluate": False})
    monkeypatch.setattr(benchmarks, "sample_and_grade", lambda llm, ev, rank, n: list(SAMPLES))
    generate.sample_evaluation(None, generate.evaluation(), tmp_path / "parts")
    generate.score_evaluation(generate.evaluation(), 0, str(policy), 0, tmp_path / "parts")
    assert not generate.evaluation_due(nodes.OneNode(), 1, {"evaluate": True})     # the table holds it: not again
    generate = import_script(monkeypatch, "generate")
    assert not generate.evaluation_due(nodes.OneNode(), 1, {"evaluate": True})


# a node's evaluate.py, its engines' sampling replaced: engine r of n gets every n-th prompt from r on (a0, a1, b0)
NODE = """
import json, sys, types
samples, sys.argv = json.loads(sys.argv[2]), ["evaluate.py", *json.loads(sys.argv[1])]
import evaluate
from mu_grpo import benchmarks
benchmarks.time = evaluate.time = types.SimpleNamespace(time=lambda: 4600.0, perf_counter=lambda: 5.0)
order = [("a", 0), ("a", 1), ("b", 0)]
evaluate.sample_and_grade = lambda policies, ev, rank, n: ([
    [s for s in samples if order.index((s[0], s[1])) % n == rank]], 4600.0)
evaluate.main()
"""


def test_two_nodes_evaluate_and_node_0_writes_the_rows_one_node_would(files, monkeypatch):
    tmp_path, policy = files
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        where = f"127.0.0.1:{s.getsockname()[1]}"
    store = nodes.Nodes(2, 0, where, timeout_s=60, serve=True)     # node 0's watch process serves it in a run
    shared = tmp_path / "two" / ".nodes" / "eval_stage_3"
    shared.mkdir(parents=True)
    (shared / "part_1.json").write_text("[]")                      # a killed attempt's: cleared before any node writes
    flags = [f"--policy={policy}", "--benchmarks=a,b", f"--data_dir={tmp_path / 'bench'}", "--k=2", "--top_p=0.7",
             "--stage=3", "--run_start=1000", f"--results={tmp_path / 'two' / 'results.jsonl'}", "--engines=1",
             "--nnodes=2", f"--store={where}", *PROMPTS]
    runs = [subprocess.Popen([sys.executable, "-c", NODE, json.dumps([*flags, f"--node_rank={r}"]), json.dumps(SAMPLES)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in runs]
    assert [p.returncode for p in runs] == [0, 0], outs
    assert "node 1: its 1 engine(s)' samples handed to node 0" in outs[1][0]
    assert not shared.exists() and store.n == 2
    evaluate_alone(monkeypatch, tmp_path, policy)
    two = common.read_jsonl(tmp_path / "two" / "results.jsonl")
    one = common.read_jsonl(tmp_path / "alone" / "results.jsonl")
    assert [r["engines"] for r in two] == [2, 2]
    assert [{**r, "engines": 1} for r in two] == one
    for name in ("a", "b"):
        assert (tmp_path / "two" / "eval_samples" / "stage_3" / f"{name}.jsonl").read_bytes() == \
            (tmp_path / "alone" / "eval_samples" / "stage_3" / f"{name}.jsonl").read_bytes()


def evaluate_kept(monkeypatch, tmp_path, policy, out, *flags):
    """evaluate.py --cache on the initial policy into <out>/results.jsonl, its engine's samples SAMPLES: the policies
    its engine was asked to sample (none when the evaluation was reused)."""
    evaluate = import_script(monkeypatch, "evaluate", f"--policy={policy}", "--benchmarks=a,b",
                             f"--data_dir={tmp_path / 'bench'}", "--k=2", "--top_p=0.7", "--stage=-1",
                             "--run_start=1000", f"--results={tmp_path / out / 'results.jsonl'}", "--engines=1",
                             f"--cache={tmp_path / 'cache'}", *PROMPTS, *flags)
    asked = []
    monkeypatch.setattr(evaluate, "time", CLOCK)
    monkeypatch.setattr(evaluate, "sample_and_grade",
                        lambda policies, ev, rank, n: asked.append(policies) or ([list(SAMPLES)], 4600.0))
    evaluate.main()
    return asked


def test_a_kept_evaluation_is_reused_only_for_the_same_policy_under_the_same_protocol(files, monkeypatch, capsys):
    tmp_path, _ = files
    initial, other = tmp_path / "initial", tmp_path / "other"        # two initial models (no policy_id.json)
    for policy, width in ((initial, 128), (other, 256)):
        policy.mkdir()
        (policy / "config.json").write_text(json.dumps({"architectures": ["Toy"], "hidden_size": width}))
        whole_checkpoint(policy)
    assert evaluate_kept(monkeypatch, tmp_path, initial, "first") == [[str(initial)]]       # evaluated and kept
    [entry] = (tmp_path / "cache").glob("*/rows.json")
    # the next run of the same policy and protocol (another grader count too) reuses it: no engine, the same numbers
    # and samples, labelled as this run's rows (stage, updates, policy, hours) and saying where they came from
    assert evaluate_kept(monkeypatch, tmp_path, initial, "second", "--grader_workers=2") == []
    first, second = (common.read_jsonl(tmp_path / out / "results.jsonl") for out in ("first", "second"))
    assert [r["reused"] for r in second] == [str(entry.parent)] * 2 and all("reused" not in r for r in first)
    assert [{k: v for k, v in r.items() if k not in ("reused", "seconds")} for r in second] == \
        [{k: v for k, v in r.items() if k != "seconds"} for r in first]
    assert [(r["benchmark"], r["avg_at_k"], r["stage"], r["updates"]) for r in second] == [("a", 0.25, -1, 0),
                                                                                         ("b", 1.0, -1, 0)]
    for name in ("a", "b"):
        assert (tmp_path / "second" / "eval_samples" / "stage_-1" / f"{name}.jsonl").read_bytes() == \
            (tmp_path / "first" / "eval_samples" / "stage_-1" / f"{name}.jsonl").read_bytes()
    assert "reused: " in capsys.readouterr().out
    # another protocol (k, top_p, the benchmarks' problems) or another policy: evaluated again, and kept beside
    assert evaluate_kept(monkeypatch, tmp_path, initial, "k1", "--k=1") == [[str(initial)]]
    assert evaluate_kept(monkeypatch, tmp_path, initial, "top_p", "--top_p=1.0") == [[str(initial)]]
    assert evaluate_kept(monkeypatch, tmp_path, other, "other") == [[str(other)]]
    common.atomic_write_lines(tmp_path / "bench" / "b.jsonl", [{"id": "b0", "problem": "b 0", "answer": "1", "source": "b"},
                                                              {"id": "b1", "problem": "b 1", "answer": "1", "source": "b"}])
    assert evaluate_kept(monkeypatch, tmp_path, initial, "new_answers") == [[str(initial)]]
    assert len(list((tmp_path / "cache").glob("*/rows.json"))) == 5
    with pytest.raises(SystemExit, match="--cache reuses one policy's evaluation"):
        evaluate_kept(monkeypatch, tmp_path, f"{initial},{initial}", "two")
