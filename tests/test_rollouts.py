"""mu_grpo/rollouts.py's contract, in process: the stage directory's names, a killed writer's leftovers, the columns built
from the JSONL (and rebuilt when it changes), a complete stage read back, and bad files named by file and line."""
import json
import os

import numpy as np
import pytest

from mu_grpo import common, records, rollouts


def response(group, sample_idx, prompt, ids, logprobs, reward, advantage):
    return {"prompt_id": f"p{group}", "group": group, "sample_idx": sample_idx, "prompt_token_ids": prompt,
            "response_token_ids": ids, "behavior_logprobs": logprobs, "finish_reason": "stop", "reward": reward,
            "advantage": advantage, "stage": 0, "policy": "model"}


# two groups of G = 2; the responses' tokens and log-probs are written out so every column can be checked by eye
ROWS = [response(0, 0, [1, 2], [5, 6, 7], [-0.5, -1.0, -0.25], 1.0, 0.7071),
        response(0, 1, [1, 2], [8], [-2.0], 0.0, -0.7071),
        response(1, 1, [3], [9, 10], [-0.125, -3.0], 0.0, 0.0),        # out of sample order on purpose
        response(1, 0, [3], [11], [-1.5], 0.0, 0.0)]


def complete_stage(directory, shards):
    """A stage directory whose shard k holds `shards[k]`, with columns, stats and a manifest."""
    for k, rows in enumerate(shards):
        rollouts.write_shard(rollouts.shard_path(directory, k), rows)
        common.atomic_write_json(rollouts.stats_path(directory, k), {"shard": k})
    common.atomic_write_json(directory / records.MANIFEST, {
        "stage": 0, "shards": [rollouts.shard_path(directory, k).name for k in range(len(shards))],
        "sampling": {"n": 2, "temperature": 1.0, "max_tokens": 4}})


def test_a_shard_is_named_by_its_index_and_done_only_once_its_stats_exist(tmp_path):
    assert rollouts.shard_path(tmp_path, 3) == tmp_path / "shard_00003.jsonl"
    assert rollouts.stats_path(tmp_path, 3) == tmp_path / "shard_00003.stats.json"
    rollouts.write_shard(rollouts.shard_path(tmp_path, 3), ROWS)
    assert not rollouts.shard_done(tmp_path, 3)                 # killed between the JSONL and its stats: redone
    common.atomic_write_json(rollouts.stats_path(tmp_path, 3), {"shard": 3})
    assert rollouts.shard_done(tmp_path, 3) and not rollouts.shard_done(tmp_path, 4)


def test_a_killed_writers_leftovers_are_removed_and_nothing_else(tmp_path):
    complete_stage(tmp_path, [ROWS])
    leftovers = [tmp_path / f".shard_00001.jsonl.tmp{os.getpid()}", tmp_path / "columns" / ".shard_00001.tmp77",
                 tmp_path / "columns" / ".shard_00000.old77"]
    leftovers[0].write_text("half a line")
    for d in leftovers[1:]:
        d.mkdir()
        (d / "response_ids.bin").write_bytes(b"\0" * 8)
    kept = sorted(p for p in tmp_path.rglob("*") if p not in leftovers and not any(q in p.parents for q in leftovers))
    assert rollouts.remove_temporaries(tmp_path) == sorted(str(p.relative_to(tmp_path)) for p in leftovers)
    assert sorted(tmp_path.rglob("*")) == kept
    assert rollouts.remove_temporaries(tmp_path) == []


def test_a_stage_reads_back_what_was_written_grouped_by_sample_index(tmp_path):
    complete_stage(tmp_path, [ROWS[:2], ROWS[2:]])
    stage = rollouts.open_stage(tmp_path)
    assert stage.n == 4 and stage.groups.tolist() == [[0, 1], [3, 2]]   # group 1's sample 0 is the 4th line
    assert stage.response_len.tolist() == [3, 1, 2, 1] and stage.prompt_len.tolist() == [2, 2, 1, 1]
    assert stage.token_offset.tolist() == [0, 3, 4, 6, 7]
    prompt, ids, logprobs = stage.tokens(2)
    assert prompt.tolist() == [3] and ids.tolist() == [9, 10] and logprobs.tolist() == [-0.125, -3.0]
    assert stage.advantage.tolist() == pytest.approx([0.7071, -0.7071, 0.0, 0.0])
    assert stage.zero_variance.tolist() == [False, True] and stage.max_token_id() == 11
    assert stage.where(3) == f"{rollouts.shard_path(tmp_path, 1)}:2"


def test_columns_are_rebuilt_from_the_jsonl_when_it_changes(tmp_path):
    complete_stage(tmp_path, [ROWS])
    path = rollouts.shard_path(tmp_path, 0)
    assert rollouts.columns_fresh(path)
    edited = [dict(ROWS[0], behavior_logprobs=[-0.5, -1.0, -0.75]), *ROWS[1:]]
    common.atomic_write_lines(path, edited)                    # an edited shard: its columns are stale
    assert not rollouts.columns_fresh(path)
    stage = rollouts.open_stage(tmp_path)
    assert stage.tokens(0)[2].tolist() == [-0.5, -1.0, -0.75] and rollouts.columns_fresh(path)


@pytest.mark.parametrize("line,message", [
    (None, "shard_00000.jsonl:4: truncated last line"),
    (dict(ROWS[1], behavior_logprobs=[]), "shard_00000.jsonl:2: .*behavior_logprobs"),
    (dict(ROWS[1], reward=float("nan")), "shard_00000.jsonl:2: non-finite reward or advantage"),
    ({k: v for k, v in ROWS[1].items() if k != "advantage"}, "shard_00000.jsonl:2: .*advantage"),
])
def test_a_bad_line_is_named_by_its_file_and_line(tmp_path, line, message):
    complete_stage(tmp_path, [ROWS])
    path = rollouts.shard_path(tmp_path, 0)
    if line is None:
        path.write_text(path.read_text()[:-1])                  # the last line cut short
    else:
        common.atomic_write_lines(path, [ROWS[0], line, *ROWS[2:]])
    with pytest.raises(rollouts.RolloutError, match=message):
        rollouts.open_stage(tmp_path)


def test_a_stage_without_its_manifest_is_refused_as_incomplete(tmp_path):
    complete_stage(tmp_path, [ROWS])
    (tmp_path / records.MANIFEST).unlink()
    with pytest.raises(rollouts.RolloutError, match="no manifest.json \\(1 shards present\\)"):
        rollouts.open_stage(tmp_path)
    assert json.loads(rollouts.stats_path(tmp_path, 0).read_text()) == {"shard": 0}
    assert np.fromfile(rollouts.columns_dir(rollouts.shard_path(tmp_path, 0)) / "response_ids.bin", "<i4").tolist() \
        == [5, 6, 7, 8, 9, 10, 11]


def test_a_shards_counts_and_the_stages_summary_by_hand():
    # two groups of G = 2: rewards (1, 1): all correct, zero variance; (0, 1): mixed
    line = lambda reward, length, finish, reason, zero: {  # noqa: E731
        "reward": reward, "response_token_ids": [7] * length, "finish_reason": finish,
        "reward_info": {"reason": reason}, "zero_variance": zero}
    lines = [line(1.0, 3, "length", "correct", True), line(1.0, 2, "stop", "correct", True),
             line(0.0, 4, "stop", "wrong", False), line(1.0, 1, "length", "correct", False)]
    assert rollouts.shard_counts(lines, group_size=2) == {
        "responses": 4, "reward_sum": 3.0, "groups_all_correct": 1, "groups_all_wrong": 0, "groups_zero_variance": 1,
        "response_tokens": 10, "max_response_tokens": 4, "truncated": 2, "reasons": {"correct": 3, "wrong": 1}}
    # that shard from engine 0 (2 s, from t = 100 to 103) and another from engine 1 (1 s, 101 to 105)
    first = {"shard": 0, "prompts": 2, "skipped_long_prompts": 1, **rollouts.shard_counts(lines, 2),
             "generation_seconds": 2.0, "started_at": 100.0, "finished_at": 103.0, "engine": 0, "max_num_seqs": 8}
    second = {"shard": 1, "prompts": 2, "skipped_long_prompts": 0, "responses": 4, "reward_sum": 1.0,
              "groups_all_correct": 0, "groups_all_wrong": 1, "groups_zero_variance": 1, "response_tokens": 6,
              "max_response_tokens": 2, "truncated": 0, "reasons": {"wrong": 3, "correct": 1},
              "generation_seconds": 1.0, "started_at": 101.0, "finished_at": 105.0, "engine": 1, "max_num_seqs": 8}
    summary = rollouts.stage_summary([first, second], {"prompts_per_stage": 4, "shards": 2, "group_size": 2})
    assert summary == {
        "prompts": 4, "responses": 8, "skipped_long_prompts": 1, "mean_reward": 0.5,          # 4 / 8
        "frac_groups_all_correct": 0.25, "frac_groups_all_wrong": 0.25, "frac_groups_zero_variance": 0.5,
        "mean_response_tokens": 2.0, "max_response_tokens": 4, "truncation_rate": 0.25,      # 16 / 8, 2 / 8
        "grader_reasons": {"correct": 4, "wrong": 4}, "engines_ran": 2,
        "generation_seconds": 2.0, "generated_tokens_per_s": 8.0,                            # the slower engine's
        "tokens_per_s_per_engine": pytest.approx(16 / 3),
        # 8 responses on 2 engines: 4 at once each, of the 2 shards × 2 prompts × G = 8 they could hold, / 8 seqs
        "batch_saturation": 0.5,
        "wall_seconds": 5.0, "wall_tokens_per_s": 3.2}                                       # 100 to 105
