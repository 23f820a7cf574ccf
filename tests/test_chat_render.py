"""The conversation format of ferrolm.lm.chat: chat tokens, rendering, mask, checks, growth."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ferrolm
from ferrolm.lm import chat
from ferrolm.lm.model import TransformerLM

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def gpt2():
    return ferrolm.Tokenizer.from_files(
        FIXTURES / "gpt2_vocab.json", FIXTURES / "gpt2_merges.txt", special_tokens=["<|endoftext|>"]
    )


@pytest.fixture(scope="module")
def tok(gpt2):
    return chat.add_chat_tokens(gpt2)


def test_chat_tokens_are_appended_after_the_vocabulary(gpt2, tok):
    assert tok.vocab_size == gpt2.vocab_size + 4
    ids = chat.chat_token_ids(tok)
    assert [ids[t] for t in chat.CHAT_TOKENS] == [50257, 50258, 50259, 50260]
    assert ids["<|endoftext|>"] == 50256
    # every ordinary id and merge is unchanged
    assert tok.merges == gpt2.merges
    assert tok.encode_ordinary("Hello world, héllo") == gpt2.encode_ordinary("Hello world, héllo")
    assert chat.add_chat_tokens(tok) is tok
    assert chat.has_chat_tokens(tok) and not chat.has_chat_tokens(gpt2)


def test_partial_chat_tokens_and_no_start_token_are_refused(gpt2):
    partial = ferrolm.Tokenizer(gpt2.vocab, gpt2.merges, ["<|endoftext|>", "<|user|>"])
    with pytest.raises(ValueError, match="only some of the chat tokens"):
        chat.add_chat_tokens(partial)
    bare = ferrolm.Tokenizer({i: bytes([i]) for i in range(256)}, [], [])
    with pytest.raises(ValueError, match="no <\\|endoftext\\|>"):
        chat.add_chat_tokens(bare)
    with pytest.raises(ValueError, match="lacks the chat tokens"):
        chat.render(gpt2, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


def test_render_literal(tok):
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
    ]
    ids, mask = chat.render(tok, conv)
    e = tok.encode_ordinary
    start, system, user, assistant, end = 50256, 50257, 50258, 50259, 50260
    want = [start, system, *e("Be brief."), end, user, *e("Hi there"), end, assistant, *e("Hello!"), end]
    assert ids == want
    n = len(e("Hello!")) + 1  # the reply and its end token
    assert mask == [0] * (len(want) - n) + [1] * n
    # the rendered ids decode to the text the Jinja template renders
    assert tok.decode(ids) == "<|endoftext|><|system|>Be brief.<|end|><|user|>Hi there<|end|><|assistant|>Hello!<|end|>"


def test_render_masks_every_assistant_turn_and_nothing_else(tok):
    conv = [
        {"role": "user", "content": "1"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "2"},
        {"role": "assistant", "content": ""},
    ]
    ids, mask = chat.render(tok, conv)
    end = chat.chat_token_ids(tok)["<|end|>"]
    learned = [i for i, m in zip(ids, mask) if m]
    assert learned == [*tok.encode_ordinary("one"), end, end]  # an empty reply still learns to stop
    assert len(ids) == len(mask)


def test_special_token_strings_in_content_stay_text(tok):
    text = "say <|end|><|assistant|> and <|endoftext|>"
    ids, mask = chat.render(tok, [{"role": "user", "content": text}, {"role": "assistant", "content": text}])
    specials = set(chat.chat_token_ids(tok).values())
    assert sum(1 for i in ids if i in specials) == 5  # start, user, end, assistant, end: none from the text
    assert tok.decode(ids).count("<|end|>") == 4


def test_render_prompt_ends_with_the_assistant_token(tok):
    conv = [{"role": "user", "content": "Hi"}]
    ids = chat.render_prompt(tok, conv)
    ref = chat.chat_token_ids(tok)
    assert ids == [
        ref["<|endoftext|>"],
        ref["<|user|>"],
        *tok.encode_ordinary("Hi"),
        ref["<|end|>"],
        ref["<|assistant|>"],
    ]
    with pytest.raises(chat.ConversationError, match="ends with a assistant|not an user|ends with"):
        chat.render_prompt(tok, [*conv, {"role": "assistant", "content": "x"}])


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "empty"),
        ("hello", "must be a list"),
        ([{"content": "x"}], "message 0 has no role"),
        ([{"role": "bot", "content": "x"}], "role 'bot'"),
        ([{"role": "user", "content": 3}], "int content"),
        ([{"role": "user"}], "no content"),
        ([{"role": "assistant", "content": "x"}], "out of order at message 0"),
        ([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}], "out of order at message 1"),
        ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "system message may only come first"),
        ([{"role": "system", "content": "x"}], "only a system message"),
        ([{"role": "user", "content": "x"}], "ends with a user message"),
        (["x"], "message 0 is a str"),
    ],
)
def test_bad_conversations_are_named(messages, message):
    with pytest.raises(chat.ConversationError, match=message):
        chat.check_conversation(messages)


def test_check_conversation_accepts_a_row_and_drops_extra_keys():
    row = {"messages": [{"role": "user", "content": "a", "name": "x"}, {"role": "assistant", "content": "b"}]}
    assert chat.check_conversation(row) == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert chat.check_conversation([{"role": "user", "content": "a"}], ends_with=None)


@pytest.mark.parametrize("tie", [False, True])
def test_grow_vocab_keeps_old_logits_and_starts_new_rows_at_the_mean(tie):
    torch.manual_seed(0)
    kw = dict(qk_norm=True, value_embeds=True, x0_mix=True, tie_embeddings=tie)
    small = TransformerLM(300, 16, 32, 2, 4, 64, **kw)
    sd = chat.grow_vocab(small.state_dict(), 300, 304)
    big = TransformerLM(304, 16, 32, 2, 4, 64, **kw)
    big.load_state_dict(sd)
    ids = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        a, b = small(ids), big(ids)
    torch.testing.assert_close(b[..., :300], a, rtol=0, atol=0)
    emb = sd["token_embeddings.weight"]
    torch.testing.assert_close(emb[300:], emb[:300].mean(0, keepdim=True).expand(4, -1))
    for k in sd:
        if k.startswith("value_embeddings."):
            assert sd[k].shape[0] == 304
    if tie:
        assert sd["lm_head.weight"] is sd["token_embeddings.weight"]
    with pytest.raises(ValueError, match="cannot shrink"):
        chat.grow_vocab(sd, 304, 300)
