"""Dependencies as used: what a plain install brings, and each optional feature names the
extra that installs it, in its error and in docs/usage.md."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest

from ferrolm import Tokenizer

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}


def test_export_needs_nothing_beyond_a_plain_install():
    assert "safetensors" in names(PROJECT["dependencies"])


def test_test_extra_runs_the_hugging_face_parity_tests():
    assert {"transformers", "tokenizers", "tiktoken"} <= names(PROJECT["optional-dependencies"]["test"])


def test_docs_name_every_extra():
    usage = (REPO / "docs" / "usage.md").read_text(encoding="utf-8")
    install = (REPO / "docs" / "install.md").read_text(encoding="utf-8")
    for extra in PROJECT["optional-dependencies"]:
        assert f"`{extra}`" in usage, extra
        assert extra in install, extra


def hide(monkeypatch, module: str) -> None:
    """Make `import module` fail as it does when the package is not installed."""
    for name in list(sys.modules):
        if name == module or name.startswith(module + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)


def test_to_tiktoken_names_its_extra(monkeypatch):
    tok = Tokenizer.train(iter(["abc abc abd"] * 5), 260, progress=False)
    hide(monkeypatch, "tiktoken")
    with pytest.raises(ImportError, match=re.escape('pip install "ferrolm[tiktoken]"')):
        tok.to_tiktoken()


def test_demo_zst_data_names_its_extra(monkeypatch, tmp_path):
    from ferrolm.app.demo import prepare_data

    (tmp_path / "t.txt.zst").write_bytes(b"not read")
    hide(monkeypatch, "zstandard")
    with pytest.raises(ValueError, match=re.escape('pip install "ferrolm[zstd]"')):
        prepare_data(tmp_path / "out", [tmp_path / "t.txt.zst"])


@pytest.mark.parametrize("extra", ["wandb", "tensorboard"])
def test_logging_extras_are_named_in_the_warning(monkeypatch, tmp_path, extra):
    from ferrolm.lm import metrics

    hide(monkeypatch, "wandb" if extra == "wandb" else "torch.utils.tensorboard")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opened = metrics._open_wandb(None, tmp_path) if extra == "wandb" else metrics._open_tensorboard(tmp_path)
    assert opened is None
    messages = [str(w.message) for w in caught]
    assert any(f'pip install "ferrolm[{extra}]"' in m for m in messages), messages
