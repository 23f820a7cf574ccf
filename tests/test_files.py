"""Tokenizer folders: what HF loads from them, what ferrolm loads from HF, and that no
damaged, incomplete or half-written folder loads silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from texts import CORPORA, corpus_text, fixture_file, stdlib_text

from ferrolm import Tokenizer
from ferrolm.bpe import files as tf
from ferrolm.bpe import patterns
from ferrolm.bpe.files import TokenizerFileError
from ferrolm.bpe.hf import hf_special_roles

EOT = "<|endoftext|>"
SLICE = 100_000  # chars of each corpus compared
LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def corpus_texts() -> list[str]:
    return [corpus_text(name, SLICE) for name in CORPORA] + [f"one{EOT}two <|pad|> three {EOT}"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A ferrolm-trained tokenizer (cl100k pattern, two specials) saved as a folder."""
    src = tmp_path_factory.mktemp("text") / "code.txt"
    src.write_text(stdlib_text(1_600_000), encoding="utf-8")
    tok = Tokenizer.train(str(src), 1200, [EOT, "<|pad|>"], pattern="cl100k", progress=False)
    return tok, tok.save(tmp_path_factory.mktemp("tok") / "tok")


# --------------------------------------------------------------------------- HF loads ours


def test_saved_folder_loads_in_tokenizers_and_transformers(trained):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok, d = trained
    hf = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(str(d))
    for text in corpus_texts():
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False).ids == ids
        assert auto(text, add_special_tokens=False)["input_ids"] == ids
        assert auto.decode(ids) == tok.decode(ids)
    assert auto.eos_token == EOT and auto.eos_token_id == tok.eos_id
    assert auto.pad_token == "<|pad|>" and auto.pad_token_id == tok.special_token_ids["<|pad|>"]
    assert auto.model_max_length == tf.DEFAULT_MODEL_MAX_LENGTH
    batch = auto(["a longer first line", "b"], padding=True)
    assert len(set(map(len, batch["input_ids"]))) == 1 and batch["attention_mask"][1][-1] == 0
    assert set(auto.all_special_tokens) >= {EOT, "<|pad|>"}


@pytest.mark.parametrize("pattern", ["gpt2", "cl100k", "o200k"])
def test_numbers_split_in_hf_as_in_ferrolm(pattern, tmp_path):
    # cl100k takes digits three at a time (a possessive interval, `\p{N}{1,3}+`, which HF's
    # regex engine would read as a repeat): "2010" is "201" + "0", never "20" + "10".
    tokenizers = pytest.importorskip("tokenizers")
    merges = [(b"1", b"0"), (b"2", b"0"), (b"20", b"1"), (b"10", b"0")]
    vocab = {i: bytes([i]) for i in range(256)} | {256 + k: a + b for k, (a, b) in enumerate(merges)}
    tok = Tokenizer(vocab, merges, [EOT], pattern=pattern)
    hf = tokenizers.Tokenizer.from_file(str(tok.save(tmp_path / "t") / "tokenizer.json"))
    text = "in 2010, 1000 or 201000 and 12345678901 ١٢٣٤ ٢٠١٠"
    assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text)
    assert Tokenizer.from_hf(tmp_path / "t").pattern == tok.pattern


def test_save_hf_writes_what_save_writes(trained, tmp_path):
    tok, d = trained
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    tok.save_hf(d)  # into the folder: the same bytes, so the folder still loads
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    assert Tokenizer.load(d).fingerprint == tok.fingerprint
    out = tmp_path / "hf"
    out.mkdir()
    tok.save_hf(out, model_max_length=256)
    assert sorted(p.name for p in out.iterdir()) == [tf.HF_SPECIALS_FILE, tf.HF_FILE, tf.HF_CONFIG_FILE]
    assert (out / tf.HF_FILE).read_bytes() == before[tf.HF_FILE]
    assert json.loads((out / tf.HF_CONFIG_FILE).read_text())["model_max_length"] == 256
    assert Tokenizer.load(out / tf.HF_FILE).fingerprint == tok.fingerprint  # the file itself too
    # a folder of the HF files alone loads in ferrolm as the same tokenizer
    assert Tokenizer.load(out).fingerprint == tok.fingerprint
    # GPT-2's only special token is eos and pad both
    assert hf_special_roles([EOT]) == {"eos_token": EOT, "pad_token": EOT}


def test_record_keeps_pattern_unicode_version_fingerprint(trained):
    tok, d = trained
    rec = json.loads((d / tf.RECORD_FILE).read_text())
    assert rec["pattern"] == "cl100k" and rec["special_tokens"] == [EOT, "<|pad|>"]
    assert rec["unicode_version"] == patterns.unicode_version()
    assert rec["fingerprint"] == tok.fingerprint
    assert set(rec["sha256"]) == {"vocab.json", "merges.txt", "tokenizer.json"}


# --------------------------------------------------------------------------- damage


def _corruptions(data: bytes) -> list[tuple[str, bytes]]:
    n = len(data)
    cuts = [("empty", b""), ("one byte", data[:1]), ("half", data[: n // 2]), ("all but one", data[:-1])]
    mid = n // 2
    flip = data[:mid] + bytes([data[mid] ^ 0x01]) + data[mid + 1 :]
    swapped = data[:mid] + data[mid + 1 : mid + 2] + data[mid : mid + 1] + data[mid + 2 :]
    at = next(i for i in range(mid, n) if data[i : i + 1].isalnum())
    edited = data[:at] + (b"q" if data[at : at + 1] != b"q" else b"x") + data[at + 1 :]
    edits = [("bit flip", flip), ("swap", swapped), ("edit", edited), ("appended", data + b" "), ("doubled", data * 2)]
    edits += [("first line cut", data.split(b"\n", 1)[-1]), ("crlf", data.replace(b"\n", b"\r\n"))]
    edits += [("ten bytes cut", data[:mid] + data[mid + 10 :])]
    return [(k, v) for k, v in cuts + edits if v != data]


def _same_json(data: bytes, value) -> bool:
    try:
        return json.loads(data) == value
    except ValueError:
        return False


@pytest.mark.parametrize("name", ["vocab.json", "merges.txt", "tokenizer.json", tf.RECORD_FILE])
def test_no_damaged_folder_loads(trained, tmp_path, name):
    tok, d = trained
    data = (d / name).read_bytes()
    cases = _corruptions(data)
    if name == tf.RECORD_FILE:
        rec = json.loads(data)
        cases = [(k, v) for k, v in cases if not _same_json(v, rec)]  # whitespace only: the same record
        for key, value in [("pattern", "gpt2"), ("special_tokens", [EOT]), ("fingerprint", "0" * 64)]:
            cases.append((f"{key} edited", json.dumps({**rec, key: value}).encode()))
    assert len(cases) >= 8
    for what, bad in cases:
        target = tmp_path / f"{what}"
        for p in d.iterdir():
            (target / p.name).parent.mkdir(exist_ok=True)
            (target / p.name).write_bytes(bad if p.name == name else p.read_bytes())
        with pytest.raises(TokenizerFileError) as e:
            Tokenizer.load(target)
        assert name in str(e.value) or tf.RECORD_FILE in str(e.value), (what, str(e.value))


def test_incomplete_folder_is_refused(trained, tmp_path):
    tok, d = trained
    for missing in ("vocab.json", "merges.txt", "tokenizer.json"):
        target = tmp_path / missing
        target.mkdir()
        for p in d.iterdir():
            if p.name != missing:
                (target / p.name).write_bytes(p.read_bytes())
        with pytest.raises(TokenizerFileError, match=f"incomplete.*{missing}"):
            Tokenizer.load(target)
    # what an interrupted 0.1.0 save left: the pair without any record
    pair = tmp_path / "pair"
    pair.mkdir()
    for name in ("vocab.json", "merges.txt"):
        (pair / name).write_bytes((d / name).read_bytes())
    with pytest.raises(TokenizerFileError, match="incomplete"):
        Tokenizer.load(pair)
    from ferrolm.bpe import reference

    with pytest.raises(TokenizerFileError, match="incomplete"):
        reference.Tokenizer.load(pair)


def test_folders_of_0_1_0_still_load(trained, tmp_path):
    tok, _ = trained
    old = tmp_path / "old"
    old.mkdir()
    (old / "vocab.json").write_bytes(tf.vocab_bytes(tok.vocab, tok.special_tokens))
    (old / "merges.txt").write_bytes(tf.merges_bytes(tok.merges))
    legacy = {"format": "ferrolm-tokenizer", "format_version": 1, "special_tokens": tok.special_tokens}
    legacy |= {"pattern": "cl100k", "fingerprint": tok.fingerprint}
    (old / "tokenizer.json").write_text(json.dumps(legacy))
    back = Tokenizer.load(old)
    assert back.fingerprint == tok.fingerprint and back.special_tokens == tok.special_tokens
    (old / "merges.txt").write_bytes(tf.merges_bytes(tok.merges[:-1]))  # damage: fingerprint differs
    with pytest.raises(TokenizerFileError, match="fingerprint"):
        Tokenizer.load(old)
    resaved = tok.save(old)  # saving over a 0.1.0 folder replaces it whole
    assert Tokenizer.load(resaved).fingerprint == tok.fingerprint


def test_unicode_version_change_warns(trained, tmp_path):
    tok, d = trained
    target = tmp_path / "t"
    target.mkdir()
    for p in d.iterdir():
        (target / p.name).write_bytes(p.read_bytes())
    rec = json.loads((d / tf.RECORD_FILE).read_text())
    (target / tf.RECORD_FILE).write_text(json.dumps({**rec, "unicode_version": "9.0.0"}))
    with pytest.warns(UserWarning, match="Unicode 9.0.0"):
        Tokenizer.load(target)


# --------------------------------------------------------------------------- whole or not at all

KILL_DURING_SAVE = """
import os, signal, sys
from ferrolm import Tokenizer
from ferrolm import _util
tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|other|>"])
_util._before_dir_rename = lambda: os.kill(os.getpid(), signal.SIGKILL)
tok.save(sys.argv[1])
"""


def test_killed_save_leaves_the_old_folder_or_none(trained, tmp_path):
    tok, _ = trained
    existing = tok.save(tmp_path / "existing")
    for target in (existing, tmp_path / "fresh"):
        run = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, str(target)], timeout=120)
        assert run.returncode == -9
    assert Tokenizer.load(existing).fingerprint == tok.fingerprint  # the old tokenizer, whole
    assert not (tmp_path / "fresh").exists()
    assert any(p.name.startswith(".fresh.") for p in tmp_path.iterdir())  # the killed write's leftovers
    tok.save(tmp_path / "fresh")
    assert Tokenizer.load(tmp_path / "fresh").fingerprint == tok.fingerprint
    assert not any(p.name.startswith(".fresh.") for p in tmp_path.iterdir())  # cleaned by the next save


def test_save_never_deletes_other_files(trained, tmp_path):
    tok, _ = trained
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        tok.save(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------- ferrolm loads HF


def _hf_gpt2(tokenizers):
    from tokenizers import decoders, models, pre_tokenizers

    bpe = models.BPE.from_file(str(fixture_file("gpt2_vocab.json")), str(fixture_file("gpt2_merges.txt")))
    hf = tokenizers.Tokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([EOT])
    return hf


def _hf_llama3_style(tokenizers):
    """A tokenizer built the way Llama-3's is: trained by `tokenizers` on multilingual text,
    Split(regex, isolated) + ByteLevel without its regex, ignore_merges, added specials, a BOS template."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(4)]
    hf = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    hf.train_from_iterator([t[:30_000] for t in corpus_texts()], trainer)
    hf.add_special_tokens(specials)
    hf.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", hf.token_to_id("<|begin_of_text|>"))]
    )
    return hf


@pytest.mark.parametrize("kind", ["gpt2", "llama3"])
def test_from_hf_equals_tokenizers(kind, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    hf = _hf_gpt2(tokenizers) if kind == "gpt2" else _hf_llama3_style(tokenizers)
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    tok = Tokenizer.from_hf(path)
    assert Tokenizer.from_hf(tmp_path).fingerprint == tok.fingerprint  # a folder too
    for text in corpus_texts():
        text += "<|end_of_text|> <|reserved_special_token_2|>x"
        ids = hf.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == ids
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)
    if kind == "gpt2":
        assert tok.pattern == patterns.GPT2 and tok.eos_id == 50256
    else:
        assert tok.pattern == LLAMA3 and len(tok.special_tokens) == 6
        assert tok.special_token_ids["<|begin_of_text|>"] == hf.token_to_id("<|begin_of_text|>")


def test_encode_cli_takes_an_hf_folder(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    import numpy as np

    from ferrolm.app.cli import main

    folder = tmp_path / "gpt2"
    folder.mkdir()
    hf = _hf_gpt2(tokenizers)
    hf.save(str(folder / "tokenizer.json"))
    text = fixture_file("tinystories_sample.txt").read_text(encoding="utf-8")
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    args = ["encode", "--tokenizer", str(folder), "--input", str(tmp_path / "in.txt"), "--out", str(tmp_path / "s")]
    assert main(args + ["--no-progress"]) == 0
    ids = np.fromfile(tmp_path / "s.bin", dtype="<u2").tolist()
    assert ids == hf.encode(text, add_special_tokens=False).ids


def _edit_hf(tokenizers, tmp_path, name, edit) -> Path:
    data = json.loads(_hf_gpt2(tokenizers).to_str())
    edit(data)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def test_from_hf_refuses_what_it_does_not_model(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models

    unigram = tokenizers.Tokenizer(models.Unigram([("a", -1.0), ("b", -2.0)], 0, byte_fallback=False))
    unigram.save(str(tmp_path / "unigram.json"))
    wordpiece = tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.save(str(tmp_path / "wordpiece.json"))
    cases = {
        tmp_path / "unigram.json": "Unigram",
        tmp_path / "wordpiece.json": "WordPiece",
        _edit_hf(tokenizers, tmp_path, "nfc", lambda d: d.update(normalizer={"type": "NFC"})): "normalizer 'NFC'",
        _edit_hf(tokenizers, tmp_path, "fallback", lambda d: d["model"].update(byte_fallback=True)): "byte_fallback",
        _edit_hf(
            tokenizers, tmp_path, "prefix", lambda d: d["pre_tokenizer"].update(add_prefix_space=True)
        ): "add_prefix_space",
        _edit_hf(
            tokenizers, tmp_path, "meta", lambda d: d.update(pre_tokenizer={"type": "Metaspace"})
        ): "pre-tokenizer 'Metaspace'",
        _edit_hf(tokenizers, tmp_path, "lstrip", lambda d: d["added_tokens"][0].update(lstrip=True)): "lstrip",
        _edit_hf(
            tokenizers, tmp_path, "decoder", lambda d: d.update(decoder={"type": "WordPiece"})
        ): "decoder 'WordPiece'",
    }
    (tmp_path / "tokenizer.model").write_bytes(b"\n\x0b\n\x05<unk>")
    cases[tmp_path / "tokenizer.model"] = "SentencePiece"
    for path, message in cases.items():
        with pytest.raises(TokenizerFileError, match=message):
            Tokenizer.from_hf(path)
    with pytest.raises(TokenizerFileError, match="SentencePiece"):
        Tokenizer.from_hf(tmp_path)  # a folder with tokenizer.model and no tokenizer.json


def test_from_hf_with_a_normalizer_for_normalized_text(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import normalizers

    hf = _hf_gpt2(tokenizers)
    hf.normalizer = normalizers.NFC()  # as Qwen2's
    hf.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerFileError, match="assume_normalized"):
        Tokenizer.from_hf(tmp_path)
    tok = Tokenizer.from_hf(tmp_path, assume_normalized=True)
    text = fixture_file("german.txt").read_text(encoding="utf-8")
    import unicodedata

    assert unicodedata.is_normalized("NFC", text)
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids


def test_saved_folder_respects_the_umask(trained, tmp_path):
    tok, _ = trained
    old = os.umask(0o027)
    try:
        d = tok.save(tmp_path / "t")
    finally:
        os.umask(old)
    assert d.stat().st_mode & 0o777 == 0o750
    assert {p.stat().st_mode & 0o777 for p in d.iterdir()} == {0o640}
