"""`ferrolm export` of a chat model (tests/tiny_chat.py): the folder carries the chat
template and the chat tokens, and transformers' generate stops at <|end|>."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_chat import CONVERSATIONS, messages, tiny_chat_run

from ferrolm.bpe.chat_format import CHAT_TEMPLATE, CHAT_TEMPLATE_FILE
from ferrolm.lm import chat

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from ferrolm.lm.export import export_hf

    root = tmp_path_factory.mktemp("chat_export")
    ckpt, tok = tiny_chat_run(root)
    return export_hf(ckpt, root / "hf"), tok


def test_the_export_carries_the_template_and_renders_ferrolm_ids(exported):
    out, tok = exported
    assert (out / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8") == CHAT_TEMPLATE
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert set(chat.CHAT_TOKENS) <= set(hf.all_special_tokens)
    conversation = messages("Hello", "Hi", system="Be brief.")
    got = hf.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert (list(got["input_ids"]), list(got["assistant_masks"])) == chat.render(tok, conversation)
    prompt = hf.apply_chat_template(messages("Hello"), tokenize=True, add_generation_prompt=True, return_dict=True)
    assert list(prompt["input_ids"]) == chat.render_prompt(tok, messages("Hello"))


def test_generation_config_ends_at_the_chat_end_token(exported):
    out, tok = exported
    ids = chat.chat_token_ids(tok)
    gen = json.loads((out / "generation_config.json").read_text(encoding="utf-8"))
    assert gen["eos_token_id"] == [tok.eos_id, ids["<|end|>"]]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    for user, reply in CONVERSATIONS:
        prompt = torch.tensor([chat.render_prompt(tok, messages(user))])
        new = model.generate(prompt, do_sample=False, max_new_tokens=40)[0, prompt.shape[1] :].tolist()
        assert new[-1] == ids["<|end|>"]  # stopped there, not at max_new_tokens
        assert hf.decode(new, skip_special_tokens=True) == reply
