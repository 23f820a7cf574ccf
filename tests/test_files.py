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

from ferrolm import Tokenizer, reference
from ferrolm.bpe import fileformat, patterns
from ferrolm.bpe import files as tf
from ferrolm.bpe.files import TokenizerFileError
from ferrolm.bpe.hf import DEFAULT_MODEL_MAX_LENGTH, hf_special_roles

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
    assert auto.model_max_length == DEFAULT_MODEL_MAX_LENGTH
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
    assert set(rec["sha256"]) == set(tf.CHECKED_FILES)


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


def _same_special_tokens(data: bytes, config: dict) -> bool:
    try:
        edited = json.loads(data)
    except ValueError:
        return False
    return isinstance(edited, dict) and all(edited.get(k) == config.get(k) for k in tf.HF_CONFIG_TOKEN_KEYS)


@pytest.mark.parametrize("name", [*tf.CHECKED_FILES, tf.RECORD_FILE])
def test_no_damaged_folder_loads(trained, tmp_path, name):
    tok, d = trained
    data = (d / name).read_bytes()
    cases = _corruptions(data)
    if name == tf.RECORD_FILE:
        rec = json.loads(data)
        cases = [(k, v) for k, v in cases if not _same_json(v, rec)]  # whitespace only: the same record
        for key, value in [("pattern", "gpt2"), ("special_tokens", [EOT]), ("fingerprint", "0" * 64)]:
            cases.append((f"{key} edited", json.dumps({**rec, key: value}).encode()))
    if name == tf.HF_CONFIG_FILE:  # its fields other than the special tokens may be edited
        cases = [(k, v) for k, v in cases if not _same_special_tokens(v, json.loads(data))]
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
from ferrolm import Tokenizer, reference
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


# --------------------------------------------------------------------------- HF's ids on what HF accepts


def _source_text() -> str:
    """Varied text made here: Python's own source, plus other scripts, digits and spaces."""
    import inspect
    import json as json_module

    return inspect.getsource(json_module.decoder) + "\nnaïve café 東京 ÿ 1234567 \t\n  zq zzq qz  x\n"


@pytest.fixture(scope="module")
def small_hf():
    """(tokenizer.json of a small trained tokenizer with three tokens no merge makes, texts)."""
    from ferrolm.bpe.hf import hf_tokenizer_json

    text = _source_text()
    tok = Tokenizer.train(iter([text]), 420, [EOT], progress=False)
    vocab = dict(tok.vocab)
    for extra in (b"zq", b" zzq", b"ecode"):  # "zq" and " zzq" no merge makes; "ecode" maybe
        if extra not in vocab.values():
            vocab[max(vocab) + 1] = extra
    data = hf_tokenizer_json(vocab, tok.merges, [(EOT, tok.eos_id)], "gpt2")
    lines = text.splitlines(keepends=True)
    texts = ["".join(lines[i : i + 40]) for i in range(0, len(lines), 40)] + ["zq", " zzq", "decode", EOT + "zq"]
    return data, texts


def _ids_or_refusal(tmp_path, data: dict, texts: list[str]):
    """(HF's ids of each text or None when it refuses the file, ferrolm's alike)."""
    import tokenizers

    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    try:
        hf = tokenizers.Tokenizer.from_file(str(path))
    except Exception:  # tokenizers raises a bare Exception for a file it refuses
        hf_ids = None
    else:
        hf_ids = [hf.encode(t, add_special_tokens=False).ids for t in texts]
    try:
        tok = Tokenizer.from_hf(path)
    except TokenizerFileError:
        return hf_ids, None
    return hf_ids, [tok.encode(t) for t in texts]


def _with(data: dict, **model) -> dict:
    out = json.loads(json.dumps(data))
    for key, value in model.items():
        if value is ...:
            del out["model"][key]
        else:
            out["model"][key] = value
    return out


def test_from_hf_refuses_what_hf_refuses_and_equals_hf_on_the_rest(small_hf, tmp_path):
    pytest.importorskip("tokenizers")
    data, texts = small_hf
    merges = data["model"]["merges"]
    early, late = merges[:5], merges[-5:]
    cases = {
        "merges missing": _with(data, merges=...),
        "merges null": _with(data, merges=None),
        "merges empty": _with(data, merges=[]),
        "merges as pairs": _with(data, merges=[m.split(" ") for m in merges]),
        "a merge of three": _with(data, merges=merges + [merges[0] + " x"]),
        "a merge of a token not in the vocab": _with(data, merges=merges + ["zq zq"]),
        # repeats: the later line ranks a pair (HF's merge table keeps the last rank it reads)
        "early merges repeated at the end": _with(data, merges=merges + early),
        "late merges repeated at the start": _with(data, merges=late + merges),
        "repeats, pairs form": _with(data, merges=[m.split(" ") for m in early + merges + early]),
    }
    for name, case in list(cases.items()):
        for ignore in (True, False, ...):
            cases[f"{name}, ignore_merges {ignore}"] = _with(case, ignore_merges=ignore)
    refused = set()
    for name, case in cases.items():
        hf_ids, ours = _ids_or_refusal(tmp_path, case, texts)
        assert ours == hf_ids, name
        if ours is None:
            refused.add(name.split(",")[0])
    assert refused == {"merges missing", "merges null", "a merge of three", "a merge of a token not in the vocab"}


def test_ignore_merges_false_is_plain_bpe(small_hf, tmp_path):
    data, _ = small_hf
    vocab = data["model"]["vocab"]
    zq = [vocab["z"], vocab["q"]]
    for ignore, want in ((True, [vocab["zq"]]), (False, zq), (..., zq)):  # HF's default is false
        path = tmp_path / "tokenizer.json"
        path.write_text(json.dumps(_with(data, ignore_merges=ignore)), encoding="utf-8")
        tok = Tokenizer.from_hf(path)
        assert tok.encode("zq") == want, ignore
        assert tok.decode(want) == "zq"
    with pytest.raises(TokenizerFileError, match="ignore_merges must be true or false"):
        path.write_text(json.dumps(_with(data, ignore_merges="yes")), encoding="utf-8")
        Tokenizer.from_hf(path)


def test_repeated_merges_rank_at_their_last_line(tmp_path):
    # "abc" from (b c), (a b), (ab c): merging its bytes joins (b c) first, unless (a b)
    # ranks before it; listed twice, a pair ranks where HF puts it: at its last line.
    from ferrolm.bpe.hf import hf_tokenizer_json

    vocab = {i: bytes([i]) for i in range(256)} | {256: b"bc", 257: b"ab", 258: b"abc"}
    data = hf_tokenizer_json(vocab, [(b"b", b"c"), (b"a", b"b"), (b"ab", b"c")], [], "gpt2")
    for merges, want in (
        (["a b", "b c", "ab c"], [258]),
        (["a b", "b c", "a b", "ab c"], [97, 256]),  # (a b) ranks third: after (b c)
        (["b c", "a b", "ab c", "b c"], [258]),  # (b c) ranks fourth: after (a b)
    ):
        path = tmp_path / "tokenizer.json"
        path.write_text(json.dumps(_with(data, merges=merges, ignore_merges=False)), encoding="utf-8")
        assert Tokenizer.from_hf(path).encode("abc") == want, merges


def test_from_files_refuses_a_repeated_merge(tmp_path):
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"ab", 257: b"abc"}
    (tmp_path / "vocab.json").write_bytes(tf.vocab_bytes(vocab, []))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\nab c\na b\n", encoding="utf-8")
    from ferrolm.bpe import reference

    for load in (Tokenizer.from_files, reference.Tokenizer.from_files):
        with pytest.raises(TokenizerFileError, match=r"merges.txt:4: the merge 'a b' repeats line 2"):
            load(tmp_path / "vocab.json", tmp_path / "merges.txt")
    with pytest.raises(ValueError, match=r"merges\[2\].*repeats merges\[0\]"):
        Tokenizer(vocab, [(b"a", b"b"), (b"ab", b"c"), (b"a", b"b")])


# --------------------------------------------------------------------------- what is read at all


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    """A small tokenizer trained here, saved as a folder."""
    tok = Tokenizer.train(iter([_source_text()]), 300, [EOT, "<|pad|>"], progress=False)
    return tok, tok.save(tmp_path_factory.mktemp("small") / "tok")


def test_tokenizer_files_are_read_only_when_regular_and_not_huge(small_folder, tmp_path):
    tok, d = small_folder
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(fileformat.MAX_FILE_BYTES + 1)  # sparse: nothing written
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    for path, message in ((fifo, "not a regular file"), (zero, "not a regular file"), (huge, "over the 256 MiB")):
        with pytest.raises(TokenizerFileError, match=message):
            Tokenizer.from_hf(path)
        with pytest.raises(TokenizerFileError, match=message):
            Tokenizer.from_files(path, d / "merges.txt")
        with pytest.raises(TokenizerFileError, match=message):
            Tokenizer.from_files(d / "vocab.json", path)
        for name in (*tf.CHECKED_FILES, tf.RECORD_FILE):
            target = tmp_path / f"{path.stem}-{name}"
            target.mkdir()
            for p in d.iterdir():
                if p.name == name:
                    (target / name).symlink_to(path)
                else:
                    (target / p.name).write_bytes(p.read_bytes())
            with pytest.raises(TokenizerFileError, match=message):
                Tokenizer.load(target)


def test_hf_config_files_are_checked_and_folders_without_their_sums_still_load(small_folder, tmp_path):
    tok, d = small_folder
    rec = json.loads((d / tf.RECORD_FILE).read_text())
    assert set(rec["sha256"]) == {"vocab.json", "merges.txt", "tokenizer.json"} | {
        tf.HF_CONFIG_FILE,
        tf.HF_SPECIALS_FILE,
    }
    for name in (tf.HF_CONFIG_FILE, tf.HF_SPECIALS_FILE):
        target = tmp_path / name
        target.mkdir()
        for p in d.iterdir():
            (target / p.name).write_bytes(p.read_bytes())
        config = json.loads((d / name).read_text())
        (target / name).write_text(json.dumps({**config, "eos_token": "<|pad|>"}))
        changed = "eos_token differs" if name == tf.HF_CONFIG_FILE else "its sha256 differs"
        with pytest.raises(TokenizerFileError, match=f"{name}: {changed}"):
            Tokenizer.load(target)
        # a folder saved before the record kept their sums loads with them edited
        sums = {k: v for k, v in rec["sha256"].items() if k not in (tf.HF_CONFIG_FILE, tf.HF_SPECIALS_FILE)}
        (target / tf.RECORD_FILE).write_text(json.dumps({**rec, "sha256": sums}))
        assert Tokenizer.load(target).fingerprint == tok.fingerprint


def test_tokenizer_config_takes_a_chat_template_but_not_a_changed_vocab_or_special_token(small_folder, tmp_path):
    tok, d = small_folder
    target = tmp_path / "edited"
    target.mkdir()
    for p in d.iterdir():
        (target / p.name).write_bytes(p.read_bytes())
    config = json.loads((d / tf.HF_CONFIG_FILE).read_text())
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    # the Hugging Face way: a chat template (and other config-only fields) added to the config
    (target / tf.HF_CONFIG_FILE).write_text(json.dumps({**config, "chat_template": template, "model_max_length": 7}))
    assert Tokenizer.load(target).fingerprint == tok.fingerprint
    assert reference.Tokenizer.load(target).encode("a b") == tok.encode("a b")
    # the special tokens' ids as transformers reads them stay protected
    decoder = {str(int(k) + 1): v for k, v in config["added_tokens_decoder"].items()}
    (target / tf.HF_CONFIG_FILE).write_text(json.dumps({**config, "added_tokens_decoder": decoder}))
    with pytest.raises(TokenizerFileError, match="tokenizer_config.json: added_tokens_decoder differs"):
        Tokenizer.load(target)
    for bad in ("[1, 2]", "{not json"):
        (target / tf.HF_CONFIG_FILE).write_text(bad)
        with pytest.raises(TokenizerFileError, match="tokenizer_config.json: (must hold|not valid)"):
            Tokenizer.load(target)
    # and so do the vocabulary and the merges
    (target / tf.HF_CONFIG_FILE).write_text(json.dumps({**config, "chat_template": template}))
    for name in (tf.VOCAB_FILE, tf.MERGES_FILE):
        original = (target / name).read_text()
        (target / name).write_text(original.replace("\n", "\n ", 1) if name == tf.MERGES_FILE else original + " ")
        with pytest.raises(TokenizerFileError, match=f"{name}: its sha256 differs"):
            Tokenizer.load(target)
        (target / name).write_text(original)
    assert Tokenizer.load(target).fingerprint == tok.fingerprint
