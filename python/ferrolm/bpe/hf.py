"""Hugging Face ``tokenizer.json`` files: writing ferrolm's tokenizer in HF's format, and
reading byte-level BPE files made elsewhere (GPT-2's, and the Split-regex + ByteLevel kind
of Llama-3, Qwen2 and others).

A ferrolm tokenizer directory holds these files beside its own (see ``files``), so
``AutoTokenizer.from_pretrained(dir)`` and ``tokenizers.Tokenizer.from_file`` load it as it
is. Token text is GPT-2's byte-to-unicode alphabet (``fileformat``).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ferrolm.bpe import patterns
from ferrolm.bpe.chat_format import CHAT_TEMPLATE, CHAT_TEMPLATE_FILE, CHAT_TOKENS, carries_chat
from ferrolm.bpe.fileformat import (
    EOT,
    FORMAT,
    TokenizerFileError,
    _json_bytes,
    _read_text,
    parse_json,
    str_to_token,
    token_to_str,
)

HF_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
HF_SPECIALS_FILE = "special_tokens_map.json"
# transformers' model_max_length when no model's context length is known (GPT-2's).
DEFAULT_MODEL_MAX_LENGTH = 1024

# HF tokenizers' regex engine (Oniguruma, Ruby syntax) reads `X{n,m}+` as "X{n,m}, one or
# more times", not as a possessive interval: cl100k's `\p{N}{1,3}+` would take a whole run of
# digits as one piece. Written for HF, a possessive interval becomes the atomic group that
# means the same in both engines.
_POSSESSIVE_INTERVAL = re.compile(r"(\\[pP]\{\w+\}|\\.|\[(?:\\.|[^\]\\])*\]|[^\\()\[\]|])(\{\d+(?:,\d*)?\})\+")


def hf_regex(pattern: str) -> str:
    """The Split regex of ``pattern`` as HF tokenizers reads it with ferrolm's meaning."""
    return _POSSESSIVE_INTERVAL.sub(r"(?>\1\2)", patterns.resolve(pattern))


def hf_tokenizer_json(
    vocab: dict[int, bytes], merges: Sequence[tuple[bytes, bytes]], special_ids: Sequence[tuple[str, int]], pattern: str
) -> dict:
    """An HF tokenizers ``tokenizer.json`` (ByteLevel BPE) encoding as ferrolm does.

    The pattern becomes a Split pre-tokenizer followed by a ByteLevel one that only maps
    bytes; special tokens become added tokens; ``ignore_merges`` makes a pre-token that is
    itself a token encode as that token, as ferrolm and tiktoken do.
    """
    special_set = {i for _, i in special_ids}
    model_vocab: dict[str, int] = {}
    for i in sorted(vocab):
        if i in special_set:
            continue
        model_vocab.setdefault(token_to_str(vocab[i]), i)
    # HF takes an added token's id from the model vocab when the content is there (and
    # otherwise numbers it after the vocab), so special tokens go in too, as in GPT-2's file.
    for s, i in special_ids:
        if model_vocab.setdefault(s, i) != i:
            raise ValueError(
                f"special token {s!r} (id {i}) has the same text as token {model_vocab[s]} in byte-level form; tokenizer.json cannot hold both"
            )
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for s, i in special_ids
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": hf_regex(pattern)},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": model_vocab,
            "merges": [f"{token_to_str(a)} {token_to_str(b)}" for a, b in merges],
        },
    }


# Special tokens that end a document in other vocabularies, for transformers' eos_token.
_EOS_NAMES = (EOT, "<|end_of_text|>", "<|im_end|>", "</s>", "<eos>", "<|eot_id|>")


def hf_special_roles(special_tokens: Sequence[str]) -> dict[str, str]:
    """transformers' ``eos_token`` and ``pad_token`` among ``special_tokens``.

    eos: <|endoftext|> (or another end-of-document name); pad: a token named "pad", else
    eos (padding is masked, so any id serves), else the first special token."""
    eos = next((s for s in _EOS_NAMES if s in special_tokens), None)
    pad = next((s for s in special_tokens if "pad" in s.lower()), None) or eos
    if pad is None and special_tokens:
        pad = special_tokens[0]
    return {k: v for k, v in (("eos_token", eos), ("pad_token", pad)) if v is not None}


def hf_tokenizer_config(special_ids: Sequence[tuple[str, int]], model_max_length: int | None = None) -> dict:
    """``tokenizer_config.json`` for transformers: the fast tokenizer class, the special
    tokens' roles, the model's maximum length, no clean-up of spaces on decode."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(model_max_length or DEFAULT_MODEL_MAX_LENGTH),
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for s, i in special_ids
        },
    }
    config.update(hf_special_map([s for s, _ in special_ids]))
    if carries_chat(s for s, _ in special_ids):
        config["chat_template"] = CHAT_TEMPLATE
    return config


def hf_special_map(special_tokens: Sequence[str]) -> dict[str, Any]:
    """``special_tokens_map.json``: the roles (``hf_special_roles``) and, for a chat
    tokenizer, its chat tokens as ``additional_special_tokens`` (the key transformers 4 and 5
    read), so that transformers counts them among its special tokens."""
    out: dict[str, Any] = dict(hf_special_roles(special_tokens))
    if carries_chat(special_tokens):
        out["additional_special_tokens"] = list(CHAT_TOKENS)
    return out


def hf_files(
    vocab: dict[int, bytes],
    merges: Sequence[tuple[bytes, bytes]],
    special_ids: Sequence[tuple[str, int]],
    pattern: str,
    model_max_length: int | None = None,
) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json, by name; with the
    chat tokens, also chat_template.jinja (the template in both places, as transformers
    saves it)."""
    hf = json.dumps(hf_tokenizer_json(vocab, merges, special_ids, pattern), ensure_ascii=False).encode("utf-8")
    config = hf_tokenizer_config(special_ids, model_max_length)
    files = {
        HF_FILE: hf,
        HF_CONFIG_FILE: _json_bytes(config),
        HF_SPECIALS_FILE: _json_bytes(hf_special_map([s for s, _ in special_ids])),
    }
    if "chat_template" in config:
        files[CHAT_TEMPLATE_FILE] = CHAT_TEMPLATE.encode("utf-8")
    return files


# --------------------------------------------------------------------------------------
# Reading HF tokenizer.json files made elsewhere
# --------------------------------------------------------------------------------------

_MODEL_HINTS = {"Unigram": " (SentencePiece Unigram)", "WordPiece": " (BERT-style WordPiece)", "WordLevel": ""}


def read_hf_tokenizer(
    path: str | os.PathLike, *, assume_normalized: bool = False
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]], list[str], str]:
    """(vocab, merges, special tokens, pattern) of an HF ``tokenizer.json`` (or a folder
    holding one) for a byte-level BPE: GPT-2's ByteLevel pre-tokenizer, or a Split regex
    followed by a ByteLevel that only maps bytes (Llama-3, Qwen2 and others).

    Every added token becomes a special token (matched in the text, never split). What
    ferrolm does not model is refused with a TokenizerFileError naming it: other models
    (Unigram, WordPiece, ...), normalizers, prefix spaces, added-token options. The
    post-processor is ignored: ferrolm's encode adds no BOS or template tokens. What HF
    refuses is refused (no merges, a merge of tokens not in the vocab); on the rest ids equal
    HF's: a merge listed twice keeps the rank of its last line, and ``ignore_merges: false``
    (HF's default: plain BPE) drops the tokens no merge makes from their own bytes, which
    plain BPE never outputs, while ``true`` takes a pre-token that is a token whole.
    ``assume_normalized``: accept a normalizer (Qwen2's NFC, say), on the promise that the
    text is already normalized: ids then equal the original's for such text only.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / HF_FILE).exists() and (path / "tokenizer.model").exists():
            raise TokenizerFileError(f"{path}: holds a SentencePiece tokenizer.model, which ferrolm does not read")
        path = path / HF_FILE
    if path.suffix == ".model":
        raise TokenizerFileError(
            f"{path}: a SentencePiece model file: ferrolm reads byte-level BPE tokenizer.json files"
        )
    data = parse_json(_read_text(path, "HF tokenizer.json"), path)
    if isinstance(data, dict) and data.get("format") == FORMAT:
        raise TokenizerFileError(
            f"{path}: is ferrolm's own record (a 0.1.0 folder): load the folder with Tokenizer.load"
        )
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise TokenizerFileError(f'{path}: not an HF tokenizers file (no "model" object)')
    _check_hf_model(path, data["model"])
    if not assume_normalized:
        _check_hf_normalizer(path, data.get("normalizer"))
    pattern = _hf_pattern(path, data.get("pre_tokenizer"))
    decoder = data.get("decoder")
    if decoder is not None and (not isinstance(decoder, dict) or decoder.get("type") != "ByteLevel"):
        raise TokenizerFileError(f"{path}: decoder {_describe(decoder)} is not supported (ferrolm decodes bytes)")
    added = _hf_added_tokens(path, data.get("added_tokens") or [])
    model = data["model"]
    vocab = _hf_vocab(path, model.get("vocab"), added)
    if "merges" not in model or model["merges"] is None:
        raise TokenizerFileError(f'{path}: the BPE model has no "merges" list (HF tokenizers refuses it too)')
    merges = _hf_merges(path, model["merges"], model["vocab"])
    ignore_merges = model.get("ignore_merges", False)
    if not isinstance(ignore_merges, bool):
        raise TokenizerFileError(f"{path}: ignore_merges must be true or false, got {ignore_merges!r}")
    specials = [s for s, _ in sorted(added.items(), key=lambda kv: kv[1])]
    if not ignore_merges:
        vocab, merges = _without_unmade_tokens(vocab, merges, specials)
    return vocab, merges, specials, pattern


def _describe(obj: Any) -> str:
    return repr(obj.get("type")) if isinstance(obj, dict) else repr(obj)


def _check_hf_model(path: Path, model: dict) -> None:
    kind = model.get("type", "BPE" if "merges" in model else None)
    if kind != "BPE":
        raise TokenizerFileError(
            f"{path}: a {kind} model{_MODEL_HINTS.get(str(kind), '')}: ferrolm reads byte-level BPE tokenizers only"
        )
    unsupported = {
        "dropout": model.get("dropout") not in (None, 0, 0.0),
        "continuing_subword_prefix": bool(model.get("continuing_subword_prefix")),
        "end_of_word_suffix": bool(model.get("end_of_word_suffix")),
        "byte_fallback (a SentencePiece-style BPE)": bool(model.get("byte_fallback")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise TokenizerFileError(f"{path}: the BPE model uses {', '.join(bad)}, which ferrolm does not model")


def _check_hf_normalizer(path: Path, normalizer: Any) -> None:
    if normalizer is None or (
        isinstance(normalizer, dict) and normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")
    ):
        return
    raise TokenizerFileError(
        f"{path}: normalizer {_describe(normalizer)} is not supported: ferrolm does not normalize text, so ids would "
        "differ (for text already normalized, pass assume_normalized=True)"
    )


def _hf_pattern(path: Path, pre: Any) -> str:
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    steps = steps if isinstance(steps, list) else [steps]
    kinds = [s.get("type") if isinstance(s, dict) else None for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        _check_byte_level(path, steps[0])
        return "gpt2"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        _check_byte_level(path, steps[1])
        split = steps[0]
        regex = split.get("pattern", {}).get("Regex") if isinstance(split.get("pattern"), dict) else None
        if regex is None or split.get("behavior") != "Isolated" or split.get("invert"):
            raise TokenizerFileError(
                f"{path}: the Split pre-tokenizer must be a Regex with behavior Isolated, not inverted; got {split}"
            )
        # A built-in pattern as hf_tokenizer_json writes it reads back as that pattern.
        return next((p for p in dict.fromkeys(patterns.NAMED.values()) if hf_regex(p) == regex), regex)
    raise TokenizerFileError(
        f"{path}: pre-tokenizer {kinds if len(kinds) > 1 else _describe(pre)} is not supported: ferrolm reads "
        "ByteLevel (GPT-2) or Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)]"
    )


def _check_byte_level(path: Path, step: dict) -> None:
    if step.get("add_prefix_space"):
        raise TokenizerFileError(f"{path}: ByteLevel add_prefix_space=true is not supported (ferrolm adds no space)")


def _hf_added_tokens(path: Path, added: Any) -> dict[str, int]:
    if not isinstance(added, list):
        raise TokenizerFileError(f"{path}: added_tokens must be a list")
    out: dict[str, int] = {}
    for t in added:
        content, i = (t.get("content"), t.get("id")) if isinstance(t, dict) else (None, None)
        if not isinstance(content, str) or not content or not isinstance(i, int) or i < 0:
            raise TokenizerFileError(f"{path}: added token {t!r} needs a non-empty content and an id")
        options = [k for k in ("lstrip", "rstrip", "single_word") if t.get(k)]
        if options:
            raise TokenizerFileError(
                f"{path}: added token {content!r} uses {', '.join(options)}, which ferrolm does not model"
            )
        if out.setdefault(content, i) != i:
            raise TokenizerFileError(f"{path}: added token {content!r} is listed with two ids")
    return out


def _hf_vocab(path: Path, raw: Any, added: dict[str, int]) -> dict[int, bytes]:
    if not isinstance(raw, dict):
        raise TokenizerFileError(f'{path}: the model has no "vocab" object')
    vocab: dict[int, bytes] = {}
    for token, i in itertools.chain(raw.items(), added.items()):
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise TokenizerFileError(f"{path}: id of {token!r} must be a non-negative integer, got {i!r}")
        b = token.encode("utf-8") if added.get(token) == i else str_to_token(token, where=f"{path}: token")
        if vocab.setdefault(i, b) != b:
            raise TokenizerFileError(f"{path}: id {i} is used by two tokens")
    singles = {b[0] for b in vocab.values() if len(b) == 1}
    if len(singles) < 256:
        missing = min(set(range(256)) - singles)
        raise TokenizerFileError(
            f"{path}: not a byte-level vocabulary: {256 - len(singles)} of the 256 bytes have no token (e.g. 0x{missing:02x})"
        )
    return vocab


def _hf_merges(path: Path, raw: Any, model_vocab: dict[str, int]) -> list[tuple[bytes, bytes]]:
    """The merges in effect, in rank order. Both sides and their concatenation must be in
    the model's vocab (HF refuses the file otherwise). A pair listed more than once has the
    rank of its last line, as in HF's tokenizers (its merge table keeps the last rank it
    reads), so only that line is kept."""
    if not isinstance(raw, list):
        raise TokenizerFileError(f"{path}: the model's merges must be a list")
    sides: list[str] = []
    for k, m in enumerate(raw):
        parts = m.split(" ") if isinstance(m, str) else m
        if not (isinstance(parts, list) and len(parts) == 2):
            _refuse_merge(path, k, m, model_vocab)
        a, b = parts
        if not (isinstance(a, str) and isinstance(b, str) and a in model_vocab and b in model_vocab):
            _refuse_merge(path, k, m, model_vocab)
        if a + b not in model_vocab:
            _refuse_merge(path, k, m, model_vocab)
        sides += parts
    # Each character is one byte: the sides are slices of the whole at the same offsets.
    data = str_to_token("".join(sides), where=f"{path}: merges")
    ends = list(itertools.accumulate(map(len, sides)))
    tokens = [data[e - len(t) : e] for t, e in zip(sides, ends)]
    merges = list(zip(tokens[0::2], tokens[1::2]))
    last = {pair: k for k, pair in enumerate(merges)}
    if len(last) == len(merges):
        return merges
    return [pair for k, pair in enumerate(merges) if last[pair] == k]


def _refuse_merge(path: Path, k: int, m: Any, model_vocab: dict[str, int]) -> None:
    parts = m.split(" ") if isinstance(m, str) else m
    if not isinstance(parts, list) or len(parts) != 2 or not all(isinstance(x, str) and x for x in parts):
        raise TokenizerFileError(f"{path}: merge {k} must be 'a b' or [a, b], got {m!r}")
    a, b = parts
    for token, what in ((a, "left token"), (b, "right token"), (a + b, "merged token")):
        if token not in model_vocab:
            raise TokenizerFileError(f"{path}: merge {k} ({a} {b}): the {what} {token!r} is not in the vocab")


def _without_unmade_tokens(
    vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]], specials: list[str]
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """The vocab and merges of plain BPE (HF's ``ignore_merges: false``) for ferrolm's
    encoder, which takes a pre-token that is a token as that token before merging.

    The two agree once the tokens that merging their own bytes does not make are gone:
    plain BPE never outputs those (inside a longer pre-token a token is made by the same
    merges as from its bytes alone), nor applies a merge that has one as a side or result.
    Their ids are then absent from the vocab: never produced, so never decoded."""
    from ferrolm import _core

    encoder = _core.Encoder(vocab, merges, specials, "gpt2")
    unmade = set(encoder.tokens_not_made_by_merges()) - {i for _, i in encoder.special_tokens}
    if not unmade:
        return vocab, merges
    kept = {i: b for i, b in vocab.items() if i not in unmade}
    gone = {vocab[i] for i in unmade if i in vocab} - set(kept.values())
    vocab = kept
    merges = [(a, b) for a, b in merges if a not in gone and b not in gone and a + b not in gone]
    return vocab, merges
