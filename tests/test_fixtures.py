"""The suite's own data: the fixture files are the bytes SOURCES.md records, and the
corpora the tests make (tests/texts.py) are what the tests rely on."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
from texts import CORPORA, EOT, FIXTURES, SEPARATOR, corpus_text, fixture_file, stdlib_text

ROW = re.compile(r"^\| `([^`]+)` \| (\d+) \| `([0-9a-f]{16})` \|", re.M)


def recorded() -> dict[str, tuple[int, str]]:
    text = (FIXTURES / "SOURCES.md").read_text(encoding="utf-8")
    return {name: (int(size), digest) for name, size, digest in ROW.findall(text)}


def test_every_fixture_is_recorded_with_its_size_and_hash():
    rows = recorded()
    on_disk = sorted(p.name for p in FIXTURES.iterdir() if p.name != "SOURCES.md")
    assert sorted(rows) == on_disk
    for name, (size, digest) in rows.items():
        data = fixture_file(name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()[:16]) == (size, digest), name
        assert b"\r" not in data, f"{name}: line ends were converted"


def test_a_missing_fixture_says_where_it_belongs():
    with pytest.raises(FileNotFoundError, match="part of the repository"):
        fixture_file("no_such_file.txt")


@pytest.mark.parametrize("name", CORPORA)
def test_corpora_are_documents_of_the_asked_size_and_repeatable(name):
    text = corpus_text(name, 50_000)
    assert 45_000 < len(text) <= 50_000 and text.endswith("\n")
    assert text == corpus_text(name, 50_000)
    docs = text.split(SEPARATOR)
    assert len(docs) > 1 and all(doc.strip() for doc in docs)
    assert all(EOT not in doc for doc in docs)


def test_documents_are_cycled_to_the_size_asked():
    from texts import _cut

    assert _cut(("one\ntwo", "three"), 40) == "one\ntwo" + SEPARATOR + "three\n"
    assert _cut(("one\ntwo", "three"), 60) == SEPARATOR.join(["one\ntwo", "three", "one\ntwo"]) + "\n"
    assert _cut(("one\ntwo", "three"), 5) == "one\n"
    assert _cut(("one\ntwo", "three"), 2) == "on"


def test_multilingual_corpus_covers_the_scripts_the_tokenizer_treats_apart():
    text = corpus_text("multilingual", 200_000)
    scripts = {unicodedata.name(c).split()[0] for c in text if ord(c) > 0x7F and c.isalpha()}
    for script in ("CJK", "HIRAGANA", "KATAKANA", "HANGUL", "CYRILLIC", "GREEK", "ARABIC", "DEVANAGARI", "LATIN"):
        assert script in scripts, script
    for piece in ("\r\n", "\u3000", "\u00a0", "👨‍👩‍👧‍👦", "🇩🇪", "３", "٣"):
        assert piece in text, repr(piece)


def test_stdlib_corpus_is_this_pythons_source():
    text = stdlib_text(300_000)
    assert "def " in text and "import " in text and '"""' in text


def test_a_skip_for_a_missing_package_says_how_to_install_it(tmp_path):
    # The suite's own conftest as a plugin, on a test module and a test that each lack a package.
    (tmp_path / "test_module_level.py").write_text('import pytest\npytest.importorskip("no_such_package_a")\n')
    (tmp_path / "test_in_a_test.py").write_text(
        'import pytest\n\ndef test_it():\n    pytest.importorskip("no_such_package_b")\n'
    )
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "conftest", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    hint = 'pip install ".[test]" installs every package the tests use'
    lines = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(lines) == 2 and all(hint in line for line in lines), r.stdout + r.stderr
    assert any("no_such_package_a" in line for line in lines) and any("no_such_package_b" in line for line in lines)
