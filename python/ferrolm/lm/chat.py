"""Conversations: the chat tokens, one rendering to ids and a loss mask, and row checks.

A conversation is a list of ``{"role": "system" | "user" | "assistant", "content": str}``
(the OpenAI and Hugging Face shape): an optional system message first, then user and
assistant messages in turn, starting with the user. It is rendered as

    <|endoftext|> [<|system|> text <|end|>] <|user|> text <|end|> <|assistant|> text <|end|> ...

where each ``<|role|>`` and ``<|end|>`` is one special token appended after the tokenizer's
vocabulary (``add_chat_tokens``), and each text is encoded as ordinary text: content that
holds the strings of special tokens stays text and can never open or close a turn. The
leading ``<|endoftext|>`` is the document boundary the base model saw in pretraining.

The loss mask is 1 on the assistant's tokens and its ``<|end|>`` (what the model must learn
to say, and when to stop), 0 elsewhere. A prompt for generation (``render_prompt``) is the
conversation so far followed by ``<|assistant|>``; the reply ends at ``<|end|>``.

The tokenizer folder carries the same rendering as a Jinja ``chat_template`` (see
``CHAT_TEMPLATE``), whose ``{% generation %}`` blocks mark the masked part for transformers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "CHAT_TOKENS",
    "CHAT_TEMPLATE",
    "END_TOKEN",
    "ROLE_TOKENS",
    "ConversationError",
    "add_chat_tokens",
    "chat_token_ids",
    "check_conversation",
    "grow_vocab",
    "has_chat_tokens",
    "render",
    "render_prompt",
]

ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_TOKEN = "<|end|>"
#: The chat tokens, in the order their ids are appended.
CHAT_TOKENS = (*ROLE_TOKENS.values(), END_TOKEN)
_START = "<|endoftext|>"

#: The rendering above as a Jinja chat template (transformers' ``apply_chat_template``):
#: the same text, so the same ids, and the assistant's part inside ``{% generation %}``.
CHAT_TEMPLATE = (
    "{%- if messages | length == 0 %}{{ raise_exception('a conversation needs at least one message') }}{% endif %}"
    "{{- '" + _START + "' }}"
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


class ConversationError(ValueError):
    """A conversation that is not a list of role/content messages in a usable order."""


def has_chat_tokens(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` has every chat token as a special token."""
    ids = tokenizer.special_token_ids
    return all(t in ids for t in CHAT_TOKENS)


def add_chat_tokens(tokenizer: Any) -> Any:
    """``tokenizer`` with the chat tokens as special tokens, their ids appended after the
    current vocabulary (the merges and every existing id unchanged); ``tokenizer`` itself
    when it has them. Raises ValueError when it has some but not all of them."""
    have = [t for t in CHAT_TOKENS if t in tokenizer.special_token_ids]
    if len(have) == len(CHAT_TOKENS):
        return tokenizer
    if have:
        raise ValueError(f"the tokenizer has only some of the chat tokens ({', '.join(have)}); it cannot be extended")
    if _START not in tokenizer.special_token_ids:
        raise ValueError(f"the tokenizer has no {_START} special token, which starts every conversation")
    cls = type(tokenizer)
    return cls(tokenizer.vocab, tokenizer.merges, [*tokenizer.special_tokens, *CHAT_TOKENS], tokenizer.pattern)


def chat_token_ids(tokenizer: Any) -> dict[str, int]:
    """{token string: id} of the chat tokens and the conversation start; ValueError naming
    what is missing (``add_chat_tokens`` adds them)."""
    ids = tokenizer.special_token_ids
    missing = [t for t in (_START, *CHAT_TOKENS) if t not in ids]
    if missing:
        raise ValueError(
            f"the tokenizer lacks the chat tokens {', '.join(missing)} (a chat model's tokenizer has them: "
            "fine-tune with --config sft, which adds them)"
        )
    return {t: ids[t] for t in (_START, *CHAT_TOKENS)}


def check_conversation(messages: Any, *, ends_with: str | None = "assistant") -> list[dict[str, str]]:
    """The messages of one conversation as a list of {"role", "content"} dicts, checked:
    a non-empty list of objects with a known ``role`` and a string ``content``, an optional
    system message first, then user and assistant in turn from the user. ``ends_with``: the
    role the last message must have ("assistant" for training, "user" for a prompt, None
    for either). ConversationError says the first thing wrong, naming the message."""
    if isinstance(messages, Mapping) and "messages" in messages:
        messages = messages["messages"]
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ConversationError(f"messages must be a list of {{role, content}} objects, got {type(messages).__name__}")
    if not messages:
        raise ConversationError("the conversation is empty")
    out: list[dict[str, str]] = []
    first = 1 if isinstance(messages[0], Mapping) and messages[0].get("role") == "system" else 0
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ConversationError(f"message {i} is a {type(m).__name__}, not a {{role, content}} object")
        role, content = m.get("role"), m.get("content")
        if role is None:
            raise ConversationError(f"message {i} has no role")
        if role not in ROLE_TOKENS:
            raise ConversationError(f"message {i} has the role {role!r}; roles are system, user and assistant")
        if not isinstance(content, str):
            what = "no content" if content is None else f"a {type(content).__name__} content, not a string"
            raise ConversationError(f"message {i} ({role}) has {what}")
        expected = "system" if i < first else ("user", "assistant")[(i - first) % 2]
        if role != expected:
            where = "a system message may only come first" if role == "system" else f"message {i} should be {expected}"
            raise ConversationError(
                f"roles out of order at message {i} ({role}): {where} (an optional system message, then user "
                "and assistant in turn, starting with the user)"
            )
        out.append({"role": role, "content": content})
    if len(out) == first:
        raise ConversationError("the conversation has only a system message")
    if ends_with is not None and out[-1]["role"] != ends_with:
        raise ConversationError(f"the conversation ends with a {out[-1]['role']} message, not an {ends_with} one")
    return out


def render(tokenizer: Any, messages: Any) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a whole conversation (checked as ``check_conversation`` does,
    ending with the assistant): the mask is 1 on each assistant message's tokens and its
    end token, 0 elsewhere."""
    return _render(tokenizer, check_conversation(messages, ends_with="assistant"), prompt=False)


def render_prompt(tokenizer: Any, messages: Any) -> list[int]:
    """The ids that ask the model for the assistant's next message: the conversation so
    far (ending with the user) followed by the assistant's role token."""
    return _render(tokenizer, check_conversation(messages, ends_with="user"), prompt=True)[0]


def _render(tokenizer: Any, messages: list[dict[str, str]], *, prompt: bool) -> tuple[list[int], list[int]]:
    special = chat_token_ids(tokenizer)
    ids, mask = [special[_START]], [0]
    end = special[END_TOKEN]
    for m in messages:
        text = tokenizer.encode_ordinary(m["content"])
        ids.append(special[ROLE_TOKENS[m["role"]]])
        mask.append(0)
        ids += text
        ids.append(end)
        learn = 1 if m["role"] == "assistant" else 0
        mask += [learn] * (len(text) + 1)
    if prompt:
        ids.append(special[ROLE_TOKENS["assistant"]])
        mask.append(0)
    return ids, mask


#: State-dict tensors with one row per token id.
def _vocab_tables(state_dict: Mapping[str, torch.Tensor], vocab_size: int) -> list[str]:
    names = ["token_embeddings.weight", "lm_head.weight"]
    names += [k for k in state_dict if k.startswith("value_embeddings.") and k.endswith(".weight")]
    return [k for k in names if k in state_dict and state_dict[k].shape[0] == vocab_size]


def grow_vocab(state_dict: Mapping[str, torch.Tensor], vocab_size: int, new_vocab_size: int) -> dict[str, torch.Tensor]:
    """A copy of a ``TransformerLM`` state dict whose token tables (embeddings, LM head,
    value embeddings) have ``new_vocab_size`` rows: the first ``vocab_size`` as they were,
    each new row the mean of the old ones. A mean embedding row is a typical input and a mean
    head row scores every position like an average token, so the new tokens start neither
    loud nor silent, and the logits of the old ids are unchanged."""
    if new_vocab_size < vocab_size:
        raise ValueError(f"cannot shrink the vocabulary from {vocab_size} to {new_vocab_size}")
    out = dict(state_dict)
    grown: dict[tuple, torch.Tensor] = {}  # one grown tensor per storage: tied tables stay one
    for name in _vocab_tables(state_dict, vocab_size):
        old = state_dict[name]
        key = (old.untyped_storage().data_ptr(), old.storage_offset(), tuple(old.shape))
        if key not in grown:
            extra = old.float().mean(dim=0, keepdim=True).expand(new_vocab_size - vocab_size, -1).to(old.dtype)
            grown[key] = torch.cat([old, extra], dim=0)
        out[name] = grown[key]
    return out
