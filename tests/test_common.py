"""mu_grpo/common.py: overrides, strict JSONL, atomic files; stage_rules.py's prompt order."""
import pytest

from mu_grpo import common, engine, stage_rules


def test_shuffled_window_covers_each_epoch_once_then_reshuffles():
    items = list(range(10))
    first = stage_rules.shuffled_window(items, 0, 10, seed=3)
    assert sorted(first) == items and first != items                  # a permutation, not the identity
    second = stage_rules.shuffled_window(items, 10, 10, seed=3)
    assert sorted(second) == items and second != first               # the next epoch is shuffled anew
    # a window across the epoch boundary is the tail of one and the head of the next
    assert stage_rules.shuffled_window(items, 7, 6, seed=3) == first[7:] + second[:3]
    again = stage_rules.shuffled_window(items, 7, 6, seed=3)
    assert stage_rules.shuffled_window(items, 7, 6, seed=3) == again
    assert stage_rules.shuffled_window(items, 0, 10, seed=4) != first


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


def _chat_tokenizer(toy, template, end_token):
    """The toy tokenizer with a chat template whose assistant turns end with `end_token`."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy / "model")
    if end_token not in tok.all_special_tokens:
        tok.add_special_tokens({"additional_special_tokens": [end_token]})
    tok.chat_template = template
    return tok


QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_LIKE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
               "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
               "\n\n{% endif %}")


@pytest.mark.parametrize("template,end", [(QWEN_LIKE, "<|im_end|>"), (LLAMA3_LIKE, "<|eot_id|>")])
def test_end_of_turn_token_is_read_from_the_chat_template(toy, template, end):
    tok = _chat_tokenizer(toy, template, end)
    assert common.end_of_turn_ids(tok) == [tok.convert_tokens_to_ids(end)]
    assert common.stop_token_ids(tok) == [tok.eos_token_id, tok.convert_tokens_to_ids(end)]
    assert common.stop_token_ids(tok, chat_template=False) == [tok.eos_token_id]


def test_no_chat_template_means_eos_only(toy):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy / "model")
    assert common.stop_token_ids(tok) == [tok.eos_token_id] == [2]


def test_engines_take_their_gpus_from_the_visible_list():
    assert engine.engine_gpu_groups(4, 1, "4,5,6,7") == ["4", "5", "6", "7"]
    assert engine.engine_gpu_groups(2, 2, "4,5,6,7") == ["4,5", "6,7"]
    assert engine.engine_gpu_groups(2, 1, "") == ["0", "1"]
    with pytest.raises(SystemExit, match="need 4 GPUs"):
        engine.engine_gpu_groups(2, 2, "3,4,5")


def test_sample_seeds_are_well_separated():
    # vLLM seeds a request's G children seed, seed+1, ...: neighbouring prompts must not share those streams
    # (the old seed + position gave neighbours 7 of 8 shared children for G = 8)
    seeds = sorted(common.sample_seed(0, 0, pos) for pos in range(1000))
    assert min(b - a for a, b in zip(seeds, seeds[1:])) >= 8
    assert common.sample_seed(0, 0, 5) == common.sample_seed(0, 0, 5) != common.sample_seed(0, 1, 5)
    assert all(0 <= s < 2**31 for s in seeds)


@pytest.mark.parametrize("template,end,openings", [
    (QWEN_LIKE, "<|im_end|>", ["<|im_start|>user", "<|im_start|>assistant"]),
    (LLAMA3_LIKE, "<|eot_id|>", ["<|start_header_id|>user<|end_header_id|>",
                                 "<|start_header_id|>assistant<|end_header_id|>"])])
def test_turn_markers_are_the_special_tokens_and_the_templates_turn_openings(toy, template, end, openings):
    tok = _chat_tokenizer(toy, template, end)
    assert common.turn_markers(tok) == sorted(["<s>", "</s>", "<pad>", end, *openings])
    assert common.turn_markers(tok, chat_template=False) == sorted(["<s>", "</s>", "<pad>", end])


def test_terminal_view_drops_library_chatter_and_keeps_bars_and_errors():
    import io
    out = io.BytesIO()
    common.terminal_view(io.BufferedReader(io.BytesIO(
        b"stage 0: 128 prompts\n"
        b"(MainProcess pid=3870) WARNING 11-23 13:57:32 [cpu_worker.py:140] CPU backend doesn't allow\n"
        b"INFO 11-23 13:57:27 [vllm.py:725] Model Runner V2\n"
        b"[W1123 13:57:29.626771478 utils.cpp:68] Warning: NUMA binding\n"
        b"/x/dispatcher.py:139: FutureWarning: `reduce_op` is deprecated\n  if hasattr(value, '__dict__'):\n"
        b"updates:  0%|\rupdates: 50%|\rupdates: 100%|\n"
        b"(EngineCore pid=1) ERROR 11-23 13:57:32 [core.py:1] engine died\n"
        b"Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: boom")), out)
    assert out.getvalue() == (b"stage 0: 128 prompts\nupdates:  0%|\rupdates: 50%|\rupdates: 100%|\n"
                              b"(EngineCore pid=1) ERROR 11-23 13:57:32 [core.py:1] engine died\n"
                              b"Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: boom")


def test_missing_disk_space_is_named_before_any_work(tmp_path):
    import shutil
    free = shutil.disk_usage(tmp_path).free
    assert common.require_free_disk(tmp_path / "not" / "yet", 1, "one byte") == free   # its nearest existing parent
    with pytest.raises(SystemExit, match=r"the state need about 1000000000.0 GB in .*, but .* GB are free"):
        common.require_free_disk(tmp_path, 10**18, "the state")
