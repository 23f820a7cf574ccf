"""Score a checkpoint on token shards: mean loss, perplexity, bits per byte, tokens/s.

The shards are read as one token stream cut into consecutive windows of the model's
context length; every token after the first is predicted once, from the tokens before
it in its window. Bits per byte do not depend on the tokenizer, so models with different
vocabularies compare:

    bits_per_byte = total nats / ln 2 / total UTF-8 bytes of the predicted tokens

where a special token (the document separator) counts 0 bytes: the bytes are those of
the text itself.

    evaluate("runs/x/best.pt", "shards/val")   # {"loss": ..., "perplexity": ..., ...}

Conversation data (JSON Lines or Parquet files of ``messages``, as training reads them) is
scored as a fine-tuning run validates: the conversations packed into rows in order, the
loss averaged over the assistant's tokens only (what the model is trained to say).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from typing import Any, Optional, Union

import numpy as np
import torch
from tqdm.auto import tqdm

from ferrolm._util import ForgivingStream
from ferrolm.lm.checkpoint import load_model
from ferrolm.lm.conversations import is_conversation_source, read_conversations
from ferrolm.lm.data import ShardError, TokenShards, masked_targets, packed_rows
from ferrolm.lm.device import resolve_device
from ferrolm.lm.functional import cross_entropy, document_ids

__all__ = ["evaluate", "token_byte_lengths"]

PathLike = Union[str, "os.PathLike[str]"]


def token_byte_lengths(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """UTF-8 bytes of each id's token, 0 for special tokens and ids the tokenizer lacks (float64)."""
    lengths = torch.zeros(vocab_size, dtype=torch.float64)
    special = set(tokenizer.special_token_ids.values())
    for i, b in tokenizer.vocab.items():
        if i < vocab_size and i not in special:
            lengths[i] = len(b)
    return lengths


def _windows(n: int, context: int) -> list[tuple[int, int]]:
    """(start, length) of consecutive windows over a stream of n tokens; a window of
    length L predicts tokens start+1 .. start+L."""
    return [(s, min(context, n - 1 - s)) for s in range(0, n - 1, context)]


def _check_ids(tokens, vocab_size: int, shards) -> None:
    """A ShardError naming the first id the model has no row for (the model would fail on it
    with an IndexError, or a device-side assert on CUDA)."""
    if len(tokens) and int(tokens.max()) >= vocab_size:
        pos = int(np.argmax(tokens >= vocab_size))
        raise ShardError(
            f"{shards.paths[0]}: token {pos:,} of the data is id {int(tokens[pos])}, "
            f"not below the model's vocab_size {vocab_size}: the data is corrupt or from another tokenizer"
        )


def _progress_bar(enabled: bool, total: int):
    """A bar of tokens scored on stderr (nothing when not ``enabled``)."""
    if not enabled:
        return contextlib.nullcontext(None)
    return tqdm(
        total=total, desc="eval", unit="tok", unit_scale=True, file=ForgivingStream(sys.stderr), mininterval=1.0
    )


@torch.inference_mode()
def _score(model, tokens, windows, batch_size, device, lengths, bar=None):
    """(total nats, total bytes) over ``windows`` of the numpy ``tokens`` (batches of equal widths)."""
    nats = torch.zeros((), dtype=torch.float64)
    nbytes = torch.zeros((), dtype=torch.float64)
    full = [w for w in windows if w[1] == windows[0][1]]
    groups = [full[i : i + batch_size] for i in range(0, len(full), batch_size)] + [[w] for w in windows[len(full) :]]
    for group in groups:
        width = group[0][1]
        rows = torch.stack([torch.from_numpy(tokens[s : s + width + 1].astype("int64")) for s, _ in group])
        x, y = rows[:, :-1].to(device), rows[:, 1:].to(device)
        logits = model(x).float()
        loss = cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        nats += loss.double().cpu() * y.numel()
        if lengths is not None:
            nbytes += lengths[y.cpu()].sum()
        if bar is not None:
            bar.update(y.numel())
    return float(nats), float(nbytes)


def evaluate(
    checkpoint: PathLike,
    data: Any,
    tokenizer: Any = None,
    *,
    batch_size: int = 8,
    max_tokens: Optional[int] = None,
    device: str = "cpu",
    progress: bool = False,
) -> dict:
    """Score ``checkpoint`` (anything ``ferrolm.lm.checkpoint.load_model`` reads) on the
    shards ``data`` (a prefix, a list, ... as for training).

    ``tokenizer`` (a Tokenizer or its folder; default the one the checkpoint names) is
    needed for bits per byte only (None without one). ``max_tokens``: score only the first
    that many tokens. ``progress``: a bar of the tokens scored on stderr. Returns loss (mean nats per token), perplexity, bits_per_byte,
    tokens, bytes, seconds and tokens_per_s.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    dev = resolve_device(device)
    if is_conversation_source(data):
        if max_tokens is not None:
            raise ValueError("max_tokens (--max-tokens) is for token shards; conversations are scored whole")
        return evaluate_conversations(checkpoint, data, tokenizer, batch_size=batch_size, device=dev)
    model, tok, info = load_model(checkpoint, dev, tokenizer=tokenizer)
    shards = TokenShards(data)
    want = info.get("tokenizer_fingerprint")
    if want and shards.fingerprint != want:
        raise ShardError(
            f"{shards.paths[0]} was encoded with another tokenizer than {os.fspath(checkpoint)} was trained on"
        )
    n = len(shards) if max_tokens is None else min(len(shards), max_tokens)
    if n < 2:
        raise ValueError(f"{shards.paths[0]}: needs at least 2 tokens to score, has {n}")
    vocab = model.config.vocab_size
    if shards.vocab_size is not None and shards.vocab_size > vocab:
        raise ShardError(
            f"{shards.paths[0]} was encoded with a {shards.vocab_size}-token vocabulary, "
            f"but the model in {info['source']} has {vocab} tokens"
        )
    tokens = shards[:n]
    _check_ids(tokens, vocab, shards)
    windows = _windows(n, model.config.context_length)
    lengths = token_byte_lengths(tok, vocab) if tok is not None else None
    t0 = time.perf_counter()
    with _progress_bar(progress, n - 1) as bar:
        nats, nbytes = _score(model, tokens, windows, batch_size, dev, lengths, bar)
    seconds = time.perf_counter() - t0
    scored = n - 1
    loss = nats / scored
    return {
        "checkpoint": os.fspath(checkpoint),
        "data": shards.paths,
        "tokens": scored,
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bits_per_byte": nats / math.log(2) / nbytes if nbytes else None,
        "bytes": int(nbytes) if lengths is not None else None,
        "seconds": seconds,
        "tokens_per_s": scored / seconds if seconds > 0 else None,
    }


def evaluate_conversations(
    checkpoint: PathLike, data: Any, tokenizer: Any = None, *, batch_size: int = 8, device="cpu"
) -> dict:
    """The loss of ``checkpoint`` over the assistant's tokens of the conversations ``data``
    (files or an iterable, as ``ferrolm.lm.conversations.read_conversations`` reads them),
    packed into rows of the model's context in order. Malformed rows are skipped and
    counted (``bad_rows``); the data is refused when more than 1 % are. Returns loss,
    perplexity, bits_per_byte (of the assistant's text), tokens (assistant tokens scored),
    conversations, bad_rows, cropped, seconds and tokens_per_s."""
    model, tok, info = load_model(checkpoint, device, tokenizer=tokenizer, require_tokenizer=True)
    convs = read_conversations(data, tok, row_len=model.config.context_length + 1, name="--data")
    ids, mask = (torch.from_numpy(a) for a in packed_rows(convs, model.config.context_length))
    _check_ids(ids.numpy(), model.config.vocab_size, convs)
    lengths = token_byte_lengths(tok, model.config.vocab_size)
    nats = nbytes = 0.0
    count = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(ids), batch_size):
            x, y = masked_targets(ids[i : i + batch_size], mask[i : i + batch_size])
            n = int(mask[i : i + batch_size, 1:].sum())
            docs = document_ids(x, convs.eos_id).to(device) if model.config.doc_mask else None
            loss = model(x.to(device), targets=y.to(device), document_ids=docs)
            nats += float(loss) * n
            count += n
            nbytes += float(lengths[y[y >= 0]].sum())
    seconds = time.perf_counter() - t0
    loss = nats / max(count, 1)
    return {
        "checkpoint": os.fspath(checkpoint),
        "data": convs.paths,
        "tokens": count,
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bits_per_byte": nats / math.log(2) / nbytes if nbytes else None,
        "bytes": int(nbytes),
        "conversations": convs.kept,
        "bad_rows": convs.bad,
        "cropped": convs.cropped,
        "seconds": seconds,
        "tokens_per_s": count / seconds if seconds > 0 else None,
    }
