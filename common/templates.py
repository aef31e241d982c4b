"""Built-in chat templates for base models that ship without one, and the end-of-turn token each one closes turns with.

`setup_chat_template(tokenizer, "auto")` keeps a tokenizer's own template and falls back to ChatML. The template's
end-of-turn token becomes `tokenizer.eos_token` (as TRL's `clone_chat_template` does), so one id means "stop" for
generation, closes standard (string) completions, and is part of every completion's loss mask.
"""

import warnings

import jinja2

# ChatML (OpenAI / Qwen): <|im_start|>role\ncontent<|im_end|>\n
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2.5's template without tools: ChatML, plus Qwen's default system prompt when the conversation has none.
QWEN = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}" + CHATML
)

# Llama 3 / 3.1 instruct (without tools); Meta's template trims each message's content, so we do too.
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

TEMPLATES = {"chatml": CHATML, "qwen": QWEN, "llama3": LLAMA3}
# Every special token a template writes, end-of-turn first: each must be ONE token in the tokenizer's vocab.
SPECIALS = {
    "chatml": ["<|im_end|>", "<|im_start|>"],
    "qwen": ["<|im_end|>", "<|im_start|>"],
    "llama3": ["<|eot_id|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"],
}


def _is_single_token(tokenizer, text: str) -> bool:
    # The string must encode to exactly one id; a non-special "<|im_end|>" would be split into byte pieces, and the
    # model would have to learn to stop by emitting a multi-token sequence that generation never stops on.
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 1


def end_of_turn_token(tokenizer, template_name: str) -> str:
    """The token that closes an assistant turn under `template_name` ("tokenizer" = the tokenizer's own template)."""
    if template_name in SPECIALS:
        return SPECIALS[template_name][0]
    # An unknown template: render one exchange and take the first added (special) token after the assistant's text,
    # e.g. <|im_end|>, <|eot_id|>, <end_of_turn>, <|end|>, </s>.
    probe = "Probe-7c1e"
    try:
        chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": probe}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except jinja2.TemplateError:  # the template refuses the probe (raise_exception, e.g. it demands a system turn)
        return tokenizer.eos_token
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # a broken template: say so now, not mid-run
        raise ValueError(f"the tokenizer's chat template fails to render a user/assistant chat: {e}") from None
    if probe not in text:
        return tokenizer.eos_token
    added = set(tokenizer.added_tokens_decoder)
    for token_id in tokenizer(text.split(probe, 1)[1], add_special_tokens=False)["input_ids"]:
        if token_id in added:
            return tokenizer.convert_ids_to_tokens(token_id)
    # The template closes turns with plain text: eos is the best stop signal we have, but no rendered completion
    # holds it, so nothing in the loss teaches the model to stop (TRL's SFTTrainer warns about the same case).
    warnings.warn(
        "the chat template ends the assistant's turn with plain text, not a special token: completions carry no "
        "stop token, so the model will not learn to stop (generation runs on to the limit). Pick a template that "
        f"ends turns with a special token (e.g. --template chatml) or add {tokenizer.eos_token!r} to the template."
    )
    return tokenizer.eos_token


def setup_chat_template(tokenizer, template: str = "auto") -> str:
    """Install a chat template and make its end-of-turn token the tokenizer's eos; returns the template name used.
    "auto" keeps the tokenizer's own template ("tokenizer") when it has one, else installs ChatML; a name from
    TEMPLATES overrides the tokenizer's. Callers should copy `tokenizer.eos_token_id` to the model's generation config
    so generation stops at the end of a turn."""
    if template == "auto":
        template = "tokenizer" if tokenizer.chat_template else "chatml"
    if template == "tokenizer" and not tokenizer.chat_template:
        raise ValueError(
            "chat_template='tokenizer' but this tokenizer has no chat template; pick one of "
            f"{sorted(TEMPLATES)} (or 'auto')"
        )
    if template not in TEMPLATES and template != "tokenizer":
        raise ValueError(f"unknown chat template {template!r}; use 'auto', 'tokenizer' or one of {sorted(TEMPLATES)}")
    if template in TEMPLATES:
        # We do not add missing specials ourselves: that would need an embedding resize and leave the new rows
        # untrained, which silently hurts quality. Make the user pick a template the tokenizer already speaks.
        if missing := [t for t in SPECIALS[template] if not _is_single_token(tokenizer, t)]:
            raise ValueError(
                f"chat template {template!r} needs the special tokens {missing}, which this tokenizer "
                "does not have as single tokens. Pick a template whose tokens it has; its added tokens "
                f"are {sorted(tokenizer.added_tokens_encoder)[:20]}."
            )
        tokenizer.chat_template = TEMPLATES[template]
    # The completion's closing token must be the one generation stops on, or the model learns to stop with a token
    # that `generate` ignores (a base Qwen tokenizer's eos is <|endoftext|> while ChatML closes turns with <|im_end|>).
    tokenizer.eos_token = end_of_turn_token(tokenizer, template)
    return template
