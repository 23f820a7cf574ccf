"""The package installs, imports, and its two halves agree on basic facts."""

from __future__ import annotations

import subprocess
import sys

import ferrolm
from ferrolm import _core
from ferrolm.bpe import patterns


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


def test_tokenizer_side_imports_with_torch_blocked():
    # A finder that refuses torch: every module of the tokenizer side must import, and it
    # must train, encode and save.
    code = """
import sys, importlib.abc, tempfile
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Block())
import importlib, pkgutil
import ferrolm, ferrolm.bpe
side = [m.name for m in pkgutil.iter_modules(ferrolm.bpe.__path__, "ferrolm.bpe.")]
assert len(side) > 8 and "ferrolm.bpe.hf" in side and "ferrolm.bpe.fileformat" in side, side
for name in side:  # every module of the tokenizer side
    importlib.import_module(name)
import ferrolm.reference, ferrolm.shards, ferrolm.tokenizer
tok = ferrolm.Tokenizer.train(iter(["a bb ccc " * 50]), vocab_size=270, progress=False)
assert tok.decode(tok.encode("a bb ccc")) == "a bb ccc"
with tempfile.TemporaryDirectory() as d:
    tok.save(d)
    ferrolm.Tokenizer.load(d)
assert "torch" not in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_short_module_paths_are_the_subpackage_modules():
    import importlib

    for short, home in ferrolm.PUBLIC_MODULES.items():
        assert importlib.import_module(f"ferrolm.{short}") is importlib.import_module(home), short
    from ferrolm.lm.model import TransformerLM as Home
    from ferrolm.model import TransformerLM

    assert TransformerLM is Home
    assert ferrolm.optim is importlib.import_module("ferrolm.lm.optim")


def test_hf_names_the_docs_give_under_ferrolm_model_are_the_hf_modules():
    import ferrolm.model
    from ferrolm.lm import hf

    for name in ("hf_architecture", "to_hf_state_dict", "to_hf_llama_state_dict"):
        assert getattr(ferrolm.model, name) is getattr(hf, name), name


def test_module_paths_from_before_the_split_still_import():
    import importlib

    import ferrolm.bpe_trainer
    import ferrolm.patterns
    import ferrolm.tokenizer_files
    import ferrolm.train_config

    assert ferrolm.patterns is importlib.import_module("ferrolm.bpe.patterns")
    assert ferrolm.tokenizer_files is importlib.import_module("ferrolm.bpe.files")
    assert ferrolm.bpe_trainer is importlib.import_module("ferrolm.bpe.trainer")
    assert ferrolm.train_config is importlib.import_module("ferrolm.lm.config")
    from ferrolm.tokenizer_files import read_merges  # noqa: F401
    from ferrolm.train_config import load_config  # noqa: F401
