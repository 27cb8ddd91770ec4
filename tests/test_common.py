"""common.py: overrides, prompt windows, strict JSONL, atomic files."""
import pytest

import common


def test_shuffled_window_covers_each_epoch_once_then_reshuffles():
    items = list(range(10))
    first = common.shuffled_window(items, 0, 10, seed=3)
    assert sorted(first) == items and first != items                  # a permutation, not the identity
    second = common.shuffled_window(items, 10, 10, seed=3)
    assert sorted(second) == items and second != first               # the next epoch is shuffled anew
    # a window across the epoch boundary is the tail of one and the head of the next
    assert common.shuffled_window(items, 7, 6, seed=3) == first[7:] + second[:3]
    assert common.shuffled_window(items, 7, 6, seed=3) == common.shuffled_window(items, 7, 6, seed=3)
    assert common.shuffled_window(items, 0, 10, seed=4) != first


def test_overrides_are_typed_and_strict():
    config = {"lr": 1e-6, "steps": 4, "name": "x", "flag": True, "cap": None}
    changed = common.apply_overrides(config, ["--lr=3e-4", "--steps=7", "--flag=false", "--cap=2.5", "--name=y"])
    assert config == {"lr": 3e-4, "steps": 7, "name": "y", "flag": False, "cap": 2.5}
    assert set(changed) == {"lr", "steps", "flag", "cap", "name"}
    common.apply_overrides(config, ["--cap=none"])
    assert config["cap"] is None
    with pytest.raises(SystemExit, match="unknown option --lrr"):
        common.apply_overrides(config, ["--lrr=1"])
    with pytest.raises(SystemExit, match="expected int"):
        common.apply_overrides(config, ["--steps=1.5"])
    with pytest.raises(SystemExit, match="true/false"):
        common.apply_overrides(config, ["--flag=maybe"])
    with pytest.raises(SystemExit, match="--key=value"):
        common.apply_overrides(config, ["lr=1"])


def test_read_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(ValueError, match=r"x.jsonl:2: not valid JSON"):
        common.read_jsonl(path)
    path.write_text('{"a": 1}\n{"a": 2}')
    with pytest.raises(ValueError, match=r"x.jsonl:2: truncated last line"):
        common.read_jsonl(path)


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    common.atomic_write_lines(tmp_path / "a.jsonl", [{"x": 1}, {"x": 2}])
    common.atomic_write_json(tmp_path / "m.json", {"done": True})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "m.json"]
    assert common.read_jsonl(tmp_path / "a.jsonl") == [{"x": 1}, {"x": 2}]
