"""The conversation format's tokens and its Jinja chat template, on the tokenizer side.

A tokenizer folder carries the template (``tokenizer_config.json``'s ``chat_template`` and
``chat_template.jinja``) when its tokenizer has the chat tokens, so this lives here, without
torch; ``ferrolm.lm.chat`` renders conversations with the same tokens.

A conversation renders as

    <|endoftext|> [<|system|> text <|end|>] <|user|> text <|end|> <|assistant|> text <|end|> ...

and a prompt for generation ends with ``<|assistant|>``.
"""

from __future__ import annotations

from collections.abc import Iterable

from ferrolm.bpe.fileformat import EOT

__all__ = [
    "CHAT_TEMPLATE",
    "CHAT_TEMPLATE_FILE",
    "CHAT_TOKENS",
    "END_TOKEN",
    "ROLE_TOKENS",
    "START_TOKEN",
    "carries_chat",
]

ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_TOKEN = "<|end|>"
#: The chat tokens, in the order their ids are appended.
CHAT_TOKENS = (*ROLE_TOKENS.values(), END_TOKEN)
#: The document boundary the base model saw in pretraining opens every conversation.
START_TOKEN = EOT
#: Where transformers keeps a tokenizer's template beside tokenizer_config.json.
CHAT_TEMPLATE_FILE = "chat_template.jinja"

#: The rendering above as a Jinja chat template (transformers' ``apply_chat_template``):
#: the same text, so the same ids, and the assistant's part inside ``{% generation %}``.
CHAT_TEMPLATE = (
    "{%- if messages | length == 0 %}{{ raise_exception('a conversation needs at least one message') }}{% endif %}"
    "{%- if messages | length == 1 and messages[0]['role'] == 'system' %}"
    "{{ raise_exception('the conversation has only a system message') }}{% endif %}"
    "{{- '" + START_TOKEN + "' }}"
    "{%- for message in messages %}"
    "{%- set first = 1 if messages[0]['role'] == 'system' else 0 %}"
    "{%- if message['role'] == 'system' and loop.index0 != 0 %}"
    "{{ raise_exception('a system message may only come first') }}"
    "{%- elif message['role'] != 'system' and message['role'] != ['user', 'assistant'][(loop.index0 - first) % 2] %}"
    "{{ raise_exception('after an optional system message, user and assistant messages take turns, "
    "starting with the user') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|assistant|>' }}{% generation %}{{ message['content'] }}{{ '<|end|>' }}{% endgeneration %}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{% endif %}"
)


def carries_chat(special_tokens: Iterable[str]) -> bool:
    """Whether a tokenizer with these special tokens has the whole conversation format."""
    have = set(special_tokens)
    return START_TOKEN in have and all(t in have for t in CHAT_TOKENS)
