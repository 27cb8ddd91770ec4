"""The five models of the paper's Table 1 (arXiv 2605.17570v1): each one's run_stages.sh settings, chosen with MODEL=
alone, and the prompt its model card shows, which its tokenizer must render before any compute.

    PRESET=paper MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-7B bash run_stages.sh

A model is known by its hub name or a directory of the same last name (/models/Qwen2.5-Math-7B). A setting given in
the environment wins over the model's. An unknown model runs on the paper preset's defaults, with one line saying so.

The TEMPLATE knob (run_stages.sh) says how a problem becomes a prompt:
  default      the problem and the instruction (PROMPT_TEMPLATE), in the tokenizer's chat template when
               it has one
  chat         the same, the chat template required (an Instruct or distilled model's user turn)
  chat-system  the problem alone in the chat template, whose system prompt carries the instruction (Qwen2.5-Math's)
  plain        the problem alone, as the toy and lab tasks are trained (their tokenizers have no chat template)
"""
import os
import sys

from mu_grpo import common

TEMPLATES = ("default", "chat", "chat-system", "plain")
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PROMPT_TEMPLATE = "{problem}\n" + INSTRUCTION.replace("{}", "{{}}")   # the paper's prompt: the problem, then the instruction
EXAMPLE = "What is $1+1$?"     # the problem the checks render

# Per model: its settings, and the prompt of EXAMPLE its model card and tokenizer_config.json's chat template give.
# The evaluation protocol is the paper preset's for every model (avg@4 at temperature 1.0, top_p 0.7: docs/design.md
# §5), so each model's rows compare across methods (R1-distill's card samples its own evaluations at 0.6 / 0.95).
# Lengths: MAX_PROMPT + MAX_RESPONSE within the model's positions (config.json max_position_embeddings; common.
# check_lengths refuses more). Memory: the paper preset's micro-batch of 16,384 tokens with gradient checkpointing, sized
# for the 7–8B models on 4×H200 (an estimate, not measured here: no GPU was lent); the smaller ones fit in it too.
MODELS = {
    "Llama-3.2-3B-Instruct": {
        # an Instruct model: its user turn (model card: chat template; end of turn <|eot_id|>, read from the template
        # by common.end_of_turn_ids); 131,072 positions
        "settings": {"TEMPLATE": "chat", "MAX_PROMPT": "1536", "MAX_RESPONSE": "2560"},
        "prompt": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
                  "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
                  f"{EXAMPLE}\n{INSTRUCTION}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
    "Qwen2.5-Math-7B": {
        # its chat template's system prompt is the instruction (tokenizer_config.json): the problem alone in the user
        # turn; 4,096 positions: 1,536 + 2,560 fills them
        "settings": {"TEMPLATE": "chat-system", "MAX_PROMPT": "1536", "MAX_RESPONSE": "2560"},
        "prompt": f"<|im_start|>system\n{INSTRUCTION}<|im_end|>\n<|im_start|>user\n{EXAMPLE}<|im_end|>\n"
                  "<|im_start|>assistant\n"},
    "Qwen3-1.7B-Base": {
        # a base model whose tokenizer ships Qwen3's chat template (no system prompt): the instruction in the user
        # turn; it ends the turn with <|im_end|>, EOS being <|endoftext|> (both stop it); 32,768 positions
        "settings": {"TEMPLATE": "chat", "MAX_PROMPT": "1536", "MAX_RESPONSE": "2560"},
        "prompt": f"<|im_start|>user\n{EXAMPLE}\n{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"},
    "Qwen3-8B-Base": {
        "settings": {"TEMPLATE": "chat", "MAX_PROMPT": "1536", "MAX_RESPONSE": "2560"},      # as Qwen3-1.7B-Base
        "prompt": f"<|im_start|>user\n{EXAMPLE}\n{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"},
    "DeepSeek-R1-Distill-Qwen-7B": {
        # model card: no system prompt, the instruction in the user prompt, the answer opened with "<think>\n" (the
        # chat template writes it since the card's update; an older tokenizer without it is refused below);
        # 131,072 positions. Its responses think at length (the card evaluates with up to 32,768 tokens): 2,560 would
        # cut most of them. The paper does not give its length; its T_rollout for this model is 3.0× Qwen2.5-Math-7B's
        # at the same size and μ (26.0 h against 8.8 h, GRPO μ = 4), as responses about 3× longer would make it:
        # 8,192, an inference from the paper's hours, not its stated setting
        "settings": {"TEMPLATE": "chat", "MAX_PROMPT": "1536", "MAX_RESPONSE": "8192"},
        "prompt": f"<｜begin▁of▁sentence｜><｜User｜>{EXAMPLE}\n{INSTRUCTION}<｜Assistant｜><think>\n"},
}


def short_name(model):
    """A hub name's or directory's last part: Qwen/Qwen2.5-Math-7B → Qwen2.5-Math-7B."""
    return str(model).rstrip("/").rsplit("/", 1)[-1]


def known(model):
    """The model's entry name: its short name, compared without case; None for another model."""
    return next((k for k in MODELS if k.lower() == short_name(model).lower()), None)


def defaults_command():
    """run_stages.sh (presets.sh, the paper preset): the model's settings that the environment does not give (GIVEN:
    run_stages.sh's list of the knobs it gives), as assignments to eval; an unknown model: none, and one line saying
    that run_stages.sh's defaults hold."""
    model, name = os.environ["MODEL"], known(os.environ["MODEL"])
    if name is None:
        print(f"MODEL={model} is not one of the paper's five ({', '.join(MODELS)}): run_stages.sh's TEMPLATE, "
              f"MAX_PROMPT and MAX_RESPONSE hold", file=sys.stderr)
        return
    given = os.environ.get("GIVEN", "").split()
    print("\n".join(f"{k}={v}" for k, v in MODELS[name]["settings"].items() if k not in given))


def prompt_template(template):
    """The problem's text before the chat template: the instruction appended, or the problem alone."""
    return "{problem}" if template in ("plain", "chat-system") else PROMPT_TEMPLATE


def rendered(tokenizer, template, problem=EXAMPLE):
    """The prompt's text as the engines get it: build_prompt_ids' tokens, decoded."""
    ids = common.build_prompt_ids(tokenizer, problem, prompt_template(template))     # (generate.py's chat_template)
    return tokenizer.decode(ids)


def check_prompt(tokenizer, model, template):
    """None, or the one line refusing the run: TEMPLATE chat or chat-system without a chat template (chat-system: one
    whose prompt does not carry the instruction), or a known model's tokenizer rendering its model card's template
    otherwise. A known model with another TEMPLATE than its own is named in one line on stderr and run as asked."""
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if template in ("chat", "chat-system") and not has_chat:
        return f"TEMPLATE={template} needs a chat template and {model}'s tokenizer has none: use TEMPLATE=default or plain"
    text = rendered(tokenizer, template)
    if template == "chat-system" and INSTRUCTION not in text:
        return (f"TEMPLATE=chat-system: {model}'s chat template has no system prompt with the instruction (it renders "
                f"{text!r}): use TEMPLATE=chat")
    name = known(model)
    if name is None:
        return None
    own = MODELS[name]["settings"]["TEMPLATE"]
    if template != own:
        print(f"TEMPLATE={template} for {name}, whose model card's prompt is TEMPLATE={own}'s: run as given",
              file=sys.stderr)
        return None
    if text != MODELS[name]["prompt"]:
        return (f"{model}'s tokenizer renders {text!r} where {name}'s model card gives {MODELS[name]['prompt']!r}: "
                f"not its chat template (a tokenizer from another model or revision?)")
    return None


if __name__ == "__main__":
    defaults_command()
