"""Smoke test of an installed ferrolm wheel, run by .ci/run in a virtualenv without cargo.

Trains a small tokenizer, encodes and decodes, reads Parquet of every codec into a shard,
builds the model and runs a forward pass.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import ferrolm

assert shutil.which("cargo") is None, "the smoke test must run without a Rust toolchain on PATH"
print("ferrolm", ferrolm.__version__, "from", Path(ferrolm.__file__).parent)

text = "\n<|endoftext|>\n".join(
    f"Story {i}: the cat sat on the mat and looked at the {i % 7} birds." for i in range(300)
)
tok = ferrolm.Tokenizer.train(iter([text]), vocab_size=300, special_tokens=["<|endoftext|>"], progress=False)
ids = tok.encode("the cat sat<|endoftext|>")
assert tok.decode(ids) == "the cat sat<|endoftext|>", ids
# numpy arrays are made by the extension (rust-numpy): check them in the built wheel too.
arr = tok.encode_to_numpy("the cat sat<|endoftext|>")
assert arr.dtype.itemsize == 2 and arr.tolist() == ids, (arr, ids)
flat, offsets = tok.encode_batch_to_numpy(["the cat", "", "sat<|endoftext|>"])
assert offsets.tolist()[-1] == len(flat) and flat.tolist() == tok.encode("the cat") + tok.encode("sat<|endoftext|>")
with tempfile.TemporaryDirectory() as d:
    tok.save(d)
    again = ferrolm.Tokenizer.load(d)
    assert again.encode("the cat sat") == tok.encode("the cat sat")

# The Parquet reader and its codecs, as linked into the wheel (pyarrow only writes the files).
try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:
    print("pyarrow not installed: Parquet not checked")
else:
    from ferrolm.bpe import shards

    docs = ["the cat sat", "on the mat", "and looked at the birds"]
    want = sum((tok.encode(d) + [tok.eos_id] for d in docs), [])
    with tempfile.TemporaryDirectory() as d:
        for codec in ("snappy", "gzip", "brotli", "zstd", "lz4"):
            path = Path(d) / f"{codec}.parquet"
            pq.write_table(pa.table({"text": docs}), path, compression=codec)
            shards.encode(tok, path, Path(d) / codec, progress=False)
            got = (Path(d) / f"{codec}.bin").read_bytes()
            assert [int.from_bytes(got[i : i + 2], "little") for i in range(0, len(got), 2)] == want, codec

import torch  # noqa: E402

from ferrolm.lm.model import TransformerLM  # noqa: E402

model = TransformerLM(
    vocab_size=tok.vocab_size, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64, rope_theta=10000.0
)
logits = model(torch.tensor([ids[:8]]))
assert logits.shape == (1, min(8, len(ids)), tok.vocab_size)
# Export copies this file into a Hugging Face folder: it must be in the wheel, beside the modules.
from ferrolm.lm.hf_remote import modeling_source  # noqa: E402

assert b"class FerroLMForCausalLM" in modeling_source(), "hf_modeling/modeling_ferrolm.py is missing from the wheel"

out = subprocess.run(["ferrolm", "--version"], capture_output=True, text=True, check=True)
assert ferrolm.__version__ in out.stdout, out.stdout
print("wheel smoke test: ok")
