"""The paper's five models (model_cards.py): each one's settings chosen with MODEL= alone, and its prompt rendered by a
tokenizer carrying its chat template (tokenizer_config.json's, reduced to its branches for one user message without
tools) exactly as its model card shows it; a tokenizer that renders another is refused in one line."""
import os
import subprocess

import pytest

from mu_grpo import model_cards
from conftest import whole_checkpoint, ROOT

LLAMA_3_2 = (  # meta-llama/Llama-3.2-3B-Instruct
    "{{- bos_token }}{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now(\"%d %b %Y\") %}{%- else %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}"
    "{%- endif %}{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = \"\" %}{%- endif %}"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}{{- \"Cutting Knowledge Date: December 2023\\n\" }}"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}{{- system_message }}{{- \"<|eot_id|>\" }}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
QWEN2_5_MATH = (  # Qwen/Qwen2.5-Math-7B: the system prompt is the instruction
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nPlease reason step by step, and put your final answer within \\\\boxed{}."
    "<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == \"user\") or "
    "(message.role == \"system\" and not loop.first) or (message.role == \"assistant\") %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
QWEN3 = (  # Qwen/Qwen3-1.7B-Base, Qwen/Qwen3-8B-Base: Qwen3's, no system prompt
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
R1_DISTILL = (  # deepseek-ai/DeepSeek-R1-Distill-Qwen-7B, the template since the card's "<think>\n" update
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='') %}{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor -%}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")
R1_DISTILL_BEFORE_UPDATE = R1_DISTILL.replace("<｜Assistant｜><think>\\n' }}{% endif %}", "<｜Assistant｜>' }}{% endif %}")

# each model's special tokens: (bos, eos, the others) as its tokenizer has them
SPECIAL = {"llama": ("<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"]),
           "qwen": (None, "<|endoftext|>", ["<|im_start|>", "<|im_end|>"]),
           "r1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", ["<｜User｜>", "<｜Assistant｜>"])}
CASES = {"Llama-3.2-3B-Instruct": (LLAMA_3_2, "llama"), "Qwen2.5-Math-7B": (QWEN2_5_MATH, "qwen"),
         "Qwen3-1.7B-Base": (QWEN3, "qwen"), "Qwen3-8B-Base": (QWEN3, "qwen"),
         "DeepSeek-R1-Distill-Qwen-7B": (R1_DISTILL, "r1")}


def tokenizer(template, family):
    """A byte-level BPE tokenizer (its text round-trips) with the family's special tokens and this chat template."""
    from tokenizers import Tokenizer, decoders, models as tm, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bos, eos, others = SPECIAL[family]
    tok = Tokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["What is 1+1? Please reason step by step."], trainers.BpeTrainer(
        vocab_size=300, special_tokens=[t for t in (bos, eos, *others) if t],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    fast.chat_template = template
    return fast


@pytest.mark.parametrize("name", list(model_cards.MODELS))
def test_each_models_prompt_renders_as_its_model_card_shows(name):
    template, family = CASES[name]
    tok = tokenizer(template, family)
    own = model_cards.MODELS[name]["settings"]["TEMPLATE"]
    hub = {"Llama-3.2-3B-Instruct": "meta-llama", "DeepSeek-R1-Distill-Qwen-7B": "deepseek-ai"}.get(name, "Qwen")
    assert model_cards.check_prompt(tok, f"{hub}/{name}", own) is None
    assert model_cards.check_prompt(tok, f"/models/{name.lower()}/", own) is None      # a local copy of the same name
    prompt = model_cards.rendered(tok, own)
    assert prompt.count("Please reason step by step") == 1       # the instruction once: Qwen2.5-Math's system prompt
    assert prompt.count(tok.bos_token or "\0") <= 1             # one BOS (the template writes it; no second one)


def test_llamas_prompt_does_not_change_with_the_date():
    # the template writes today's date (strftime_now) unless given one: pinned, the same prompt any day
    tok = tokenizer(LLAMA_3_2, "llama")
    assert "Today Date: 26 Jul 2024\n" in model_cards.rendered(tok, "chat")


@pytest.mark.parametrize("model,template,family,given,line", [
    # R1-distill's tokenizer from before its card's update: its answer would not open with <think>
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", R1_DISTILL_BEFORE_UPDATE, "r1", "chat",
     "tokenizer renders '<｜begin▁of▁sentence｜><｜User｜>What is $1+1$?\\nPlease reason step by step, and put your final "
     "answer within \\\\boxed{}.<｜Assistant｜>' where DeepSeek-R1-Distill-Qwen-7B's model card gives"),
    # another model's tokenizer under Llama's name
    ("meta-llama/Llama-3.2-3B-Instruct", QWEN3, "qwen", "chat", "not its chat template"),
    # the chat templates refused where the tokenizer has none, or no system prompt with the instruction
    ("my/model", None, "qwen", "chat", "TEMPLATE=chat needs a chat template and my/model's tokenizer has none"),
    ("my/model", QWEN3, "qwen", "chat-system", "TEMPLATE=chat-system: my/model's chat template has no system prompt"),
])
def test_a_wrong_template_is_refused_in_one_line(model, template, family, given, line):
    problem = model_cards.check_prompt(tokenizer(template, family), model, given)
    assert problem is not None and line in problem and "\n" not in problem


def test_another_template_than_the_models_own_is_named_and_run(capsys):
    tok = tokenizer(QWEN2_5_MATH, "qwen")
    assert model_cards.check_prompt(tok, "Qwen/Qwen2.5-Math-7B", "chat") is None
    assert capsys.readouterr().err == ("TEMPLATE=chat for Qwen2.5-Math-7B, whose model card's prompt is "
                                       "TEMPLATE=chat-system's: run as given\n")
    # its instruction twice: the system prompt's and the user turn's
    assert model_cards.rendered(tok, "chat").count("Please reason step by step") == 2


def defaults(env):
    # as run_stages.sh runs it: GIVEN, the knobs the environment gave (the others hold run_stages.sh's defaults)
    proc = subprocess.run([os.environ["MU_GRPO_VENV"] + "/bin/python", "-m", "mu_grpo.model_cards"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "MAX_RESPONSE": "2560", "MAX_PROMPT": "1536",
                                                               "TEMPLATE": "default", **env,
                                                               "GIVEN": " ".join(env)})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split(), proc.stderr


def test_a_models_settings_are_chosen_by_its_name_and_the_environment_wins():
    assert defaults({"MODEL": "Qwen/Qwen2.5-Math-7B"}) == (
        ["TEMPLATE=chat-system", "MAX_PROMPT=1536", "MAX_RESPONSE=2560"], "")
    assert defaults({"MODEL": "/models/deepseek-r1-distill-qwen-7b", "MAX_RESPONSE": "4096"})[0] == \
        ["TEMPLATE=chat", "MAX_PROMPT=1536"]
    out, err = defaults({"MODEL": "org/Other-7B"})
    assert out == [] and err.count("\n") == 1 and err.startswith("MODEL=org/Other-7B is not one of the paper's five")


def test_run_stages_start_up_refuses_a_wrong_template_before_any_compute(tmp_path, capsys):
    from mu_grpo import launch
    model = tmp_path / "DeepSeek-R1-Distill-Qwen-7B"
    model.mkdir()
    whole_checkpoint(model)                                   # a whole checkpoint but for its tokenizer's template
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    tokenizer(R1_DISTILL_BEFORE_UPDATE, "r1").save_pretrained(model)
    (tmp_path / "train.jsonl").write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\n')
    env = {"MODEL": str(model), "MODEL_IS_DIR": "1", "TRAIN_DATA": str(tmp_path / "train.jsonl"), "TEMPLATE": "chat",
           "RESIDENT": "false", "RESIDENT_GPU_MEMORY": "auto", "GPUS": "0"}
    with pytest.raises(SystemExit) as e:
        launch.prepared(env)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "where DeepSeek-R1-Distill-Qwen-7B's model card gives" in err
    tokenizer(R1_DISTILL, "r1").save_pretrained(model)       # the updated tokenizer passes
    assert launch.prepared(env)["MODEL"] == str(model)


def test_each_models_lengths_fit_its_positions():
    # config.json max_position_embeddings (model cards): Qwen2.5-Math-7B's 4,096 is the one the paper's lengths fill
    positions = {"Llama-3.2-3B-Instruct": 131072, "Qwen2.5-Math-7B": 4096, "Qwen3-1.7B-Base": 32768,
                 "Qwen3-8B-Base": 32768, "DeepSeek-R1-Distill-Qwen-7B": 131072}
    for name, entry in model_cards.MODELS.items():
        s = entry["settings"]
        assert int(s["MAX_PROMPT"]) + int(s["MAX_RESPONSE"]) <= positions[name]
    assert sum(int(v) for k, v in model_cards.MODELS["Qwen2.5-Math-7B"]["settings"].items() if k.startswith("MAX")) == 4096
