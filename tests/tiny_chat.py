"""A tiny chat model: the tiny language model of ``tiny_lm`` with the chat tokens added
(``chat.add_chat_tokens`` and ``chat.grow_vocab``, as fine-tuning for chat starts) and then
fitted a few dozen steps to a handful of conversations on the assistant's tokens only, so
that its greedy reply to each is that conversation's reply, ended by ``<|end|>``."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_lm import tiny_run

#: (user message, the reply the model learns).
CONVERSATIONS = (
    ("Hello", "Hi there, how can I help?"),
    ("What is JSON?", "A text format for data."),
    ("Bye", "Goodbye!"),
)


def messages(user: str, reply: str | None = None, system: str | None = None) -> list[dict[str, str]]:
    out = [{"role": "system", "content": system}] if system is not None else []
    out.append({"role": "user", "content": user})
    if reply is not None:
        out.append({"role": "assistant", "content": reply})
    return out


def tiny_chat_run(root, *, steps: int = 80):
    """(checkpoint path, tokenizer with the chat tokens) under ``root``; the checkpoint's
    config names the saved tokenizer folder, as `ferrolm train` writes it."""
    from ferrolm.lm import chat
    from ferrolm.lm.checkpoint import load_model, save_checkpoint
    from ferrolm.lm.model import TransformerLM

    root = Path(root)
    base_ckpt, base_tok, _ = tiny_run(root / "base", steps=10)
    base, _, _ = load_model(base_ckpt, "cpu", tokenizer=False)
    tok = chat.add_chat_tokens(base_tok)
    tokdir = tok.save(root / "chat_tok")
    config = {**base.config.to_dict(), "vocab_size": tok.vocab_size}
    model = TransformerLM(**config)
    model.load_state_dict(chat.grow_vocab(base.state_dict(), base_tok.vocab_size, tok.vocab_size))
    rows = [chat.render(tok, messages(u, r)) for u, r in CONVERSATIONS]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = 0.0
        for ids, mask in rows:
            x, y = torch.tensor([ids[:-1]]), torch.tensor(ids[1:])
            y = torch.where(torch.tensor(mask[1:]) == 1, y, -100)
            loss = loss + torch.nn.functional.cross_entropy(model(x)[0], y, ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    ckpt = root / "chat.pt"
    save_checkpoint(
        model,
        None,
        steps,
        ckpt,
        config={"model": config, "data": {"tokenizer": str(tokdir)}},
        tokenizer_fingerprint=tok.fingerprint,
    )
    return ckpt, tok
