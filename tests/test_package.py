"""The package installs, imports, and its two halves agree on basic facts."""

from __future__ import annotations

import subprocess
import sys

import ferrolm
from ferrolm import _core, patterns


def test_version_matches_core():
    assert ferrolm.__version__ == _core.version()
    assert ferrolm.__version__.count(".") == 2


def test_cli_help_runs():
    out = subprocess.run([sys.executable, "-m", "ferrolm", "--help"], capture_output=True, text=True, check=True)
    assert "ferrolm" in out.stdout


def test_core_pretokenizer_matches_python_regex_on_gpt2_sample():
    import regex

    text = "Hello world! It's 2024...\n\n  spaces   and\ttabs\u00a0nbsp 123abc"
    assert _core.pretokenize(text, "gpt2") == regex.findall(patterns.GPT2, text)
