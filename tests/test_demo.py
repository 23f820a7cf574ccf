"""`ferrolm demo` end to end on a tiny budget, its data preparation, and `ferrolm download`."""

from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from texts import fixture_file

from ferrolm.app import cli
from ferrolm.app.demo import EOT, MARKER, SEPARATOR, prepare_data, stdlib_files, stdlib_root

# A model small enough that a few steps take well under a second on one core.
TINY = [
    "model.context_length=32",
    "model.d_model=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.d_ff=64",
    "schedule.batch_size=4",
    "schedule.max_steps=12",
    "schedule.warmup_steps=2",
    "run.eval_every=6",
    "run.eval_batches=1",
    "run.num_threads=1",
    "run.autocast_bf16=false",
]


def _set_args(pairs):
    return [a for kv in pairs for a in ("--set", kv)]


def _docs(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith(SEPARATOR)
    return text[: -len(SEPARATOR)].split(SEPARATOR)


# --------------------------------------------------------------------------- end to end


def test_demo_default_data_end_to_end(tmp_path, capsys):
    """The default data (this Python's standard library), a slice of it, every artefact made."""
    out = tmp_path / "demo"
    argv = [
        "demo",
        "--out",
        str(out),
        "--minutes",
        "0.2",
        "--vocab-size",
        "300",
        "--max-mb",
        "0.3",
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
        "--no-progress",
    ] + _set_args(TINY)
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out

    for rel in [
        "data/train.txt",
        "data/val.txt",
        "data/sources.tsv",
        "tokenizer/vocab.json",
        "tokenizer/merges.txt",
        "tokenizer/tokenizer.json",
        "shards/train.bin",
        "shards/train.json",
        "shards/val.bin",
        "shards/val.json",
        "run/config.toml",
        "run/metrics.jsonl",
        "loss.png",
        "samples.txt",
        "report.md",
        MARKER,
    ]:
        assert (out / rel).is_file(), f"{rel} missing"
        assert (out / rel).stat().st_size > 0, f"{rel} empty"
    assert list((out / "run").rglob("*.pt")), "no checkpoint"
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    marker = json.loads((out / MARKER).read_text())
    assert marker["status"] == "done" and marker["format"] == "ferrolm-demo"
    assert marker["steps"] >= 1 and marker["vocab_size"] <= 300
    assert marker["final_val_loss"] is not None

    # The shards hold the demo's text encoded by the demo's tokenizer.
    from ferrolm.bpe.tokenizer import Tokenizer
    from ferrolm.lm.data import TokenShards

    tok = Tokenizer.load(out / "tokenizer")
    train = TokenShards(out / "shards" / "train", tokenizer=tok)
    val_text = (out / "data" / "val.txt").read_text(encoding="utf-8")
    val = TokenShards(out / "shards" / "val", tokenizer=tok)
    assert list(val[: len(val)]) == tok.encode(val_text)
    assert len(train) > len(val) > 0
    assert json.loads((out / "shards" / "train.json").read_text())["eos_id"] == tok.eos_id

    # Samples start with their prompts; the report names the output directory and its files.
    samples = (out / "samples.txt").read_text(encoding="utf-8")
    for prompt in ("import os\n", "def ", "class "):
        assert f"(prompt {prompt!r}) ---\n{prompt}" in samples
    assert str(out.resolve()) in printed
    assert "what to expect: a model that knows nothing scores ln(" in printed
    assert "what to expect:" in (out / "report.md").read_text(encoding="utf-8")
    for rel in ("loss.png", "samples.txt", "tokenizer/vocab.json", "shards/train.bin"):
        assert rel in printed

    # A second run into the same directory replaces what the first one wrote, and only that.
    from ferrolm.app.demo import _prepare_out_dir

    (out / "run" / "stale.txt").write_text("from the first run")
    (out / "notes.txt").write_text("the user's own file")
    _prepare_out_dir(out)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "notes.txt"]
    assert json.loads((out / MARKER).read_text())["status"] == "running"


def test_demo_user_data(tmp_path):
    from ferrolm.app.demo import run_demo

    src = fixture_file("corpus.en")
    res = run_demo(
        tmp_path / "d",
        [src],
        minutes=0.2,
        vocab_size=400,
        device="cpu",
        overrides=TINY,
        prompts=["", "The "],
        max_new_tokens=5,
        progress=False,
        log=lambda m: None,
    )
    assert res.plot is not None and res.plot.is_file()
    assert res.checkpoint.is_file() and res.samples_path.is_file()
    assert len(res.samples) == 2 and res.samples[1].startswith("The ")
    assert res.data.source == "user files" and res.data.val_docs >= 1
    assert res.train_tokens > res.val_tokens > 33
    assert 1 <= res.steps <= 12


def test_demo_refuses_a_directory_that_is_not_a_demo(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    rc = cli.main(["demo", "--out", str(tmp_path), "--minutes", "0.1", "--no-progress"])
    assert rc == 2
    assert "not a ferrolm demo directory" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--minutes", "0"], "minutes"),
        (["--vocab-size", "100"], "vocab_size"),
        (["--data", "no/such/file.txt"], "no such file"),
        (["--set", "model.nonsense=1", "--max-mb", "0.05", "--vocab-size", "260"], "model.nonsense"),
    ],
)
def test_demo_bad_arguments(tmp_path, capsys, argv, match):
    assert cli.main(["demo", "--out", str(tmp_path / "o"), "--no-progress"] + argv) == 2
    assert match in capsys.readouterr().err


# --------------------------------------------------------------------------- data


def test_stdlib_files_exclude_tests_and_site_packages():
    files = stdlib_files()
    rels = [r for r, _ in files]
    assert rels == sorted(rels)
    assert any(r == "os.py" for r in rels)
    for r in rels:
        parts = r.split("/")
        assert not {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"} & set(
            parts
        ), r
        assert not parts[-1].startswith("test_"), r
        assert r.endswith((".py", ".txt", ".rst"))
    assert all(p.is_relative_to(stdlib_root()) for _, p in files[:50])


def _fake_stdlib(root: Path) -> None:
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "site-packages" / "thirdparty").mkdir(parents=True)
    for i in range(200):
        (root / "pkg" / f"mod{i:03d}.py").write_text(f"def f{i}():\n    return {i}\n" * 20)
    (root / "test" / "test_x.py").write_text("TEST SUITE\n")
    (root / "pkg" / "test_y.py").write_text("TEST MODULE\n")
    (root / "site-packages" / "thirdparty" / "x.py").write_text("THIRD PARTY\n")
    (root / "pkg" / "latin1.py").write_bytes(b"# caf\xe9\n")
    (root / "pkg" / "special.py").write_text(f"s = '{EOT}'\n")
    (root / "README.txt").write_text("Some docs text.\n")


def test_prepare_data_stdlib_split_is_deterministic(tmp_path):
    root = tmp_path / "lib"
    _fake_stdlib(root)
    a = prepare_data(tmp_path / "a", stdlib=root)
    prepare_data(tmp_path / "b", stdlib=root)
    for name in ("train.txt", "val.txt", "sources.tsv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    train, val = _docs(a.train_path), _docs(a.val_path)
    assert len(train) + len(val) == 201  # 200 modules + README.txt
    assert set(train).isdisjoint(val) and len(val) >= 1
    text = a.train_path.read_text() + a.val_path.read_text()
    for excluded in ("TEST SUITE", "TEST MODULE", "THIRD PARTY", "caf"):
        assert excluded not in text
    assert text.count(EOT) == 201  # the file holding a literal <|endoftext|> is left out
    assert "Some docs text." in text
    assert a.files == 201 and not a.truncated
    # the validation text is at least a tenth of the text here (it is small): topped up
    assert a.val_bytes >= (a.train_bytes + a.val_bytes) // 10 - 1000


def test_prepare_data_caps_the_size(tmp_path):
    root = tmp_path / "lib"
    _fake_stdlib(root)
    info = prepare_data(tmp_path / "o", stdlib=root, max_bytes=20_000)
    assert info.truncated
    assert 20_000 <= info.train_bytes + info.val_bytes < 20_000 + 1000 + 201 * len(SEPARATOR)
    assert info.train_docs + info.val_docs < 201


def test_prepare_data_user_files(tmp_path):
    docs = [(f"Story number {i}. " + "Once upon a time there was a cat. " * (i % 7 + 1)).strip() for i in range(400)]
    plain = tmp_path / "a.txt"
    plain.write_text(f"\n{EOT}\n".join(docs[:300]) + f"\n{EOT}\n")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write(EOT.join(docs[300:]))
    info = prepare_data(tmp_path / "o", [plain, tmp_path / "b.txt.gz"])
    train, val = _docs(info.train_path), _docs(info.val_path)
    assert sorted(train + val) == sorted(docs)
    assert val and train and info.files == 2
    # the same split again
    again = prepare_data(tmp_path / "o2", [plain, tmp_path / "b.txt.gz"])
    assert _docs(again.val_path) == val


def test_prepare_data_single_document_is_cut_at_a_line(tmp_path):
    src = tmp_path / "one.txt"
    lines = [f"line {i} of a long text without separators" for i in range(1000)]
    src.write_text("\n".join(lines) + "\n")
    info = prepare_data(tmp_path / "o", [src])
    train, val = _docs(info.train_path), _docs(info.val_path)
    assert len(train) == len(val) == 1
    assert train[0] + "\n" + val[0] == "\n".join(lines)
    assert info.notes


def test_prepare_data_rejects_empty_input(tmp_path):
    src = tmp_path / "empty.txt"
    src.write_text(f"  \n{EOT}\n  ")
    with pytest.raises(ValueError, match="no text"):
        prepare_data(tmp_path / "o", [src])
    src.write_text("x")
    with pytest.raises(ValueError, match="too little text"):
        prepare_data(tmp_path / "o", [src])


# --------------------------------------------------------------------------- download CLI

PAYLOAD = b"Once upon a time.\n" * 5000


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path != "/tiny.txt":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(PAYLOAD)))
        self.end_headers()
        self.wfile.write(PAYLOAD)

    def log_message(self, *args):
        pass


def test_download_command_on_loopback(tmp_path, monkeypatch, capsys):
    from ferrolm.app import download

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        monkeypatch.setitem(download.DATASETS, "tiny", [download.RemoteFile(f"{url}/tiny.txt", "tiny.txt")])
        assert cli.main(["download", "tiny", "--out", str(tmp_path / "data"), "--no-progress"]) == 0
        assert (tmp_path / "data" / "tiny.txt").read_bytes() == PAYLOAD
        assert str(tmp_path / "data" / "tiny.txt") in capsys.readouterr().out
        monkeypatch.setitem(download.DATASETS, "missing", [download.RemoteFile(f"{url}/nope.txt", "nope.txt")])
        assert cli.main(["download", "missing", "--out", str(tmp_path / "data"), "--no-progress"]) == 2
        assert "nope.txt" in capsys.readouterr().err
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_demo_reports_a_diverged_training(tmp_path, capsys):
    argv = [
        "demo",
        "--out",
        str(tmp_path / "d"),
        "--minutes",
        "0.2",
        "--vocab-size",
        "280",
        "--max-mb",
        "0.05",
        "--device",
        "cpu",
        "--no-progress",
    ] + _set_args(TINY + ["optimizer.name=adamw", "optimizer.lr=1e30", "schedule.warmup_steps=0"])
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "ferrolm demo: error: training stopped (nan)" in err and "NaN" in err
    assert json.loads((tmp_path / "d" / MARKER).read_text())["status"] == "running"  # not marked done
