"""ferrolm: from raw text to a trained language model.

The package has three parts:

- ``ferrolm.bpe``: the tokenizer side (Tokenizer, trainer, pure-Python reference,
  tokenizer files, shards). It never imports torch.
- ``ferrolm.lm``: the language-model side (model, functional, optim, data, train,
  checkpoint, generate). It imports torch.
- ``ferrolm.app``: the command line and the demo built on the two.

The names users type stay here: ``ferrolm.Tokenizer``, ``ferrolm.train_bpe``, and the
short module paths ``ferrolm.model``, ``ferrolm.optim``, ``ferrolm.reference`` ... which
are the same module objects as their homes in the subpackages.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from ferrolm._core import version as _core_version

__version__ = _core_version()

__all__ = ["__version__", "Tokenizer", "train_bpe"]

# Short public module path -> the module's home. `import ferrolm.model` gives
# `ferrolm.lm.model` itself (one module object, so patching either name patches both).
PUBLIC_MODULES = {
    "tokenizer": "ferrolm.bpe.tokenizer",
    "reference": "ferrolm.bpe.reference",
    "shards": "ferrolm.bpe.shards",
    "model": "ferrolm.lm.model",
    "functional": "ferrolm.lm.functional",
    "optim": "ferrolm.lm.optim",
    "data": "ferrolm.lm.data",
    "checkpoint": "ferrolm.lm.checkpoint",
    "generate": "ferrolm.lm.generate",
    "train": "ferrolm.lm.train",
    # The module names from before the package was split in three, kept importable.
    "patterns": "ferrolm.bpe.patterns",
    "tokenizer_files": "ferrolm.bpe.files",
    "bpe_trainer": "ferrolm.bpe.trainer",
    "train_config": "ferrolm.lm.config",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass  # the target ran when it was imported


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.partition(".")
        if prefix != __name__ or name not in PUBLIC_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(PUBLIC_MODULES[name]))


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())


def __getattr__(name: str):
    # Lazy so `import ferrolm` stays fast and never pulls in torch.
    if name == "Tokenizer":
        from ferrolm.bpe.tokenizer import Tokenizer

        return Tokenizer
    if name == "train_bpe":
        from ferrolm.bpe.trainer import train_bpe

        return train_bpe
    if name in PUBLIC_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'ferrolm' has no attribute {name!r}")
