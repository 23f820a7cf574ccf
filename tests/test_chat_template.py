"""The chat template a tokenizer folder carries: transformers' ``apply_chat_template`` on a
folder saved by ferrolm gives ``ferrolm.lm.chat``'s ids and assistant mask, and refuses the
conversations ``check_conversation`` refuses."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrolm import Tokenizer
from ferrolm.bpe.chat_format import CHAT_TEMPLATE, CHAT_TEMPLATE_FILE
from ferrolm.lm import chat

transformers = pytest.importorskip("transformers")

TEXT = (
    "Hello there! How are you today?\nI am fine, thank you.\n\n"
    "Grüße aus München. Привет, мир. 你好，世界。 こんにちは 🙂 naïve café\n"
) * 20


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """(ferrolm tokenizer with the chat tokens, its folder, transformers' tokenizer of it)."""
    base = Tokenizer.train(iter([TEXT]), 400, ["<|endoftext|>"], progress=False)
    tok = chat.add_chat_tokens(base)
    folder = tok.save(tmp_path_factory.mktemp("chat_tok"))
    return tok, folder, transformers.AutoTokenizer.from_pretrained(folder)


def hf_render(hf, messages, **kw):
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kw)
    return list(out["input_ids"]), list(out["assistant_masks"])


def test_the_folder_carries_the_template_and_marks_the_chat_tokens_special(chat_folder, tmp_path):
    tok, folder, hf = chat_folder
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == CHAT_TEMPLATE
    assert (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8") == CHAT_TEMPLATE
    specials = json.loads((folder / "special_tokens_map.json").read_text(encoding="utf-8"))
    assert specials["additional_special_tokens"] == list(chat.CHAT_TOKENS)
    assert set(chat.CHAT_TOKENS) <= set(hf.all_special_tokens)
    ids = chat.chat_token_ids(tok)
    assert hf.decode([ids["<|user|>"], ids["<|end|>"]], skip_special_tokens=True) == ""
    assert Tokenizer.load(folder).special_tokens == tok.special_tokens  # the folder still loads whole

    # A tokenizer without the chat tokens carries no template.
    plain = Tokenizer.train(iter([TEXT]), 300, ["<|endoftext|>"], progress=False).save(tmp_path / "plain")
    assert "chat_template" not in json.loads((plain / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert not (plain / CHAT_TEMPLATE_FILE).exists()
    assert "additional_special_tokens" not in json.loads((plain / "special_tokens_map.json").read_text())


# Content: ASCII, non-ASCII, newlines and spaces, nothing that spells a special token.
_ALPHABET = list("abcdefghij XYZ.,!?'\n\t") + list("üéßПривет你好こ🙂") + ["<", "|", ">"]
content = st.text(st.sampled_from(_ALPHABET), max_size=40).filter(lambda s: "<|" not in s)


@st.composite
def conversations(draw, ends_with: str = "assistant"):
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(content)})
    turns = draw(st.integers(1, 4))
    for _ in range(turns):
        messages.append({"role": "user", "content": draw(content)})
        messages.append({"role": "assistant", "content": draw(content)})
    if ends_with == "user":
        messages.append({"role": "user", "content": draw(content)})
    return messages


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversations())
def test_transformers_renders_the_ids_and_mask_of_render(chat_folder, messages):
    tok, _, hf = chat_folder
    ids, mask = chat.render(tok, messages)
    assert hf_render(hf, messages) == (ids, mask)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversations(ends_with="user"))
def test_the_generation_prompt_is_render_prompt(chat_folder, messages):
    tok, _, hf = chat_folder
    ids, mask = hf_render(hf, messages, add_generation_prompt=True)
    assert ids == chat.render_prompt(tok, messages)
    # The earlier assistant turns are masked as in training; the new turn's role token is not.
    assert (ids, mask) == chat._render(tok, messages, prompt=True)
    assert mask[-1] == 0


def test_edge_conversations_render_alike(chat_folder):
    tok, _, hf = chat_folder
    for messages in (
        [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "\n"}, {"role": "assistant", "content": " "}],
        [{"role": "user", "content": "  two\n\nlines  "}, {"role": "assistant", "content": "Привет 🙂\r\n"}],
    ):
        assert hf_render(hf, messages) == chat.render(tok, messages)


def test_a_content_spelling_a_special_token_stays_text_in_ferrolm_only(chat_folder):
    """The one known difference: ferrolm encodes content as ordinary text, so "<|end|>" in a
    message cannot end its turn; transformers' template re-tokenizes the rendered text, and
    the same characters become the special token."""
    tok, _, hf = chat_folder
    special = chat.chat_token_ids(tok)
    messages = [{"role": "user", "content": "say <|end|> now"}, {"role": "assistant", "content": "<|user|>ok"}]
    ids, mask = chat.render(tok, messages)
    # ferrolm: each special id where the format puts it, and nowhere else.
    assert ids.count(special["<|end|>"]) == 2 and ids.count(special["<|user|>"]) == 1
    assert tok.decode(ids) == "<|endoftext|><|user|>say <|end|> now<|end|><|assistant|><|user|>ok<|end|>"
    # transformers: the content's strings became special tokens (one more of each).
    hf_ids, _ = hf_render(hf, messages)
    assert hf_ids != ids
    assert hf_ids.count(special["<|end|>"]) == 3 and hf_ids.count(special["<|user|>"]) == 2
    assert hf.decode(hf_ids) == tok.decode(ids)  # the same text, other ids


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "system", "content": "s"}],
        [{"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "u"}, {"role": "user", "content": "u"}],
        [{"role": "user", "content": "u"}, {"role": "system", "content": "s"}],
        [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "u"}, {"role": "tool", "content": "t"}],
    ],
)
def test_the_template_refuses_what_check_conversation_refuses(chat_folder, messages):
    tok, _, hf = chat_folder
    with pytest.raises(chat.ConversationError):
        chat.check_conversation(messages, ends_with=None)
    with pytest.raises(Exception, match="message|conversation|turns"):
        hf.apply_chat_template(messages, tokenize=True)


def test_seeded_conversations_with_every_role_order_agree(chat_folder):
    """Random role sequences (most of them wrong): the template raises exactly where
    check_conversation does, and renders the same ids where it does not."""
    tok, _, hf = chat_folder
    rng = random.Random(0)
    for _ in range(200):
        messages = [
            {"role": rng.choice(["system", "user", "assistant"]), "content": rng.choice(["", "a b", "é\n"])}
            for _ in range(rng.randint(1, 5))
        ]
        try:
            chat.check_conversation(messages, ends_with=None)
        except chat.ConversationError:
            with pytest.raises(Exception, match="message|conversation|turns"):
                hf.apply_chat_template(messages, tokenize=True)
            continue
        ids = list(hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        assert ids == chat._render(tok, messages, prompt=False)[0]
