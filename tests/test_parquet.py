"""The core's Parquet reader against pyarrow: the same documents, in the same order, for
every codec, page layout and string type pyarrow writes; bad files are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrolm._core import ParquetDocs
from ferrolm.bpe import shards
from ferrolm.bpe.inputs import parquet_batches
from ferrolm.bpe.tokenizer import Tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

EOT = "<|endoftext|>"
CODECS = ["none", "snappy", "gzip", "brotli", "zstd", "lz4"]


def read_all(path, column="text", batch_bytes=1 << 20) -> list[str]:
    docs = ParquetDocs(str(path), column, batch_bytes)
    out = []
    while (batch := docs.next_batch()) is not None:
        data, offsets = batch
        assert offsets[0] == 0 and offsets[-1] == len(data)
        raw = data.tobytes()
        out.extend(raw[a:b].decode("utf-8") for a, b in zip(offsets[:-1], offsets[1:]))
    return out


def expected(table, column="text") -> list[str]:
    return [d for d in table.column(column).to_pylist() if d is not None]


texts = st.lists(st.one_of(st.none(), st.text(max_size=300)), max_size=120)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    docs=texts,
    codec=st.sampled_from(CODECS),
    row_group=st.integers(1, 50),
    page_bytes=st.sampled_from([64, 1024, 1 << 20]),
    dictionary=st.booleans(),
    page_version=st.sampled_from(["1.0", "2.0"]),
    large=st.booleans(),
    batch_bytes=st.sampled_from([1, 100, 1 << 20]),
)
def test_the_core_reads_what_pyarrow_wrote(
    tmp_path, docs, codec, row_group, page_bytes, dictionary, page_version, large, batch_bytes
):
    kind = pa.large_string() if large else pa.string()
    table = pa.table({"id": list(range(len(docs))), "text": pa.array(docs, type=kind)})
    path = tmp_path / "d.parquet"
    pq.write_table(
        table,
        path,
        row_group_size=row_group,
        compression=codec,
        data_page_size=page_bytes,
        use_dictionary=dictionary,
        data_page_version=page_version,
    )
    assert read_all(path, batch_bytes=batch_bytes) == expected(table)
    assert ParquetDocs(str(path)).num_rows == len(docs)


def test_required_columns_dictionary_fallback_and_many_row_groups(tmp_path):
    # Repeated documents (dictionary pages) then distinct ones (pyarrow falls back to plain
    # pages when the dictionary grows): both kinds of page in one column chunk.
    docs = ["same story"] * 3000 + [f"story number {i} " * (i % 7) for i in range(20000)]
    schema = pa.schema([pa.field("text", pa.string(), nullable=False)])
    table = pa.table({"text": docs}, schema=schema)
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=7000, dictionary_pagesize_limit=4096)
    assert read_all(path) == docs
    assert sum(len(d) for d, _ in parquet_batches(str(path), "text")) == sum(len(d.encode()) for d in docs)


def test_batches_are_about_the_size_asked_and_whole_documents(tmp_path):
    docs = [("x" * (i % 300)) for i in range(5000)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": docs}), path, row_group_size=1234)  # batches span row groups
    reader = ParquetDocs(str(path), "text", 64 * 1024)
    sizes = []
    while (b := reader.next_batch()) is not None:
        sizes.append(len(b[0]))
    assert sum(sizes) == sum(len(d) for d in docs)
    assert all(s < 2 * 64 * 1024 for s in sizes) and all(s >= 64 * 1024 for s in sizes[:-1])
    assert reader.next_batch() is None


def test_columns_that_are_not_text_are_refused_by_name(tmp_path):
    path = tmp_path / "d.parquet"
    table = pa.table(
        {
            "id": [1, 2],
            "tags": pa.array([["a"], ["b", "c"]]),
            "meta": pa.array([{"url": "u"}, {"url": "v"}]),
            "blob": pa.array([b"\x00\x01", b"ok"], type=pa.binary()),
            "text": ["a", "b"],
        }
    )
    pq.write_table(table, path)
    with pytest.raises(ValueError, match="column 'id' .* of type INT64, not a string column"):
        ParquetDocs(str(path), "id")
    for nested in ("tags", "meta"):
        with pytest.raises(ValueError, match=f"column '{nested}' .* nested"):
            ParquetDocs(str(path), nested)
    with pytest.raises(ValueError, match="no column 'story' .*id, tags, meta, blob, text"):
        ParquetDocs(str(path), "story")
    # Byte arrays without a string annotation are read as text; the encoder checks UTF-8.
    assert [d.tobytes() for d, _ in parquet_batches(str(path), "blob")] == [b"\x00\x01ok"]
    with pytest.raises(FileNotFoundError):
        ParquetDocs(str(tmp_path / "missing.parquet"))


@pytest.mark.parametrize("cut", ["header", "footer", "middle"])
def test_damaged_files_are_errors_not_crashes(tmp_path, cut):
    docs = [f"document {i} " * 50 for i in range(2000)]
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": docs}), good, row_group_size=500, compression="snappy")
    raw = bytearray(good.read_bytes())
    if cut == "header":
        raw = raw[: len(raw) // 2]  # the footer is gone
    elif cut == "footer":
        raw[-12:-8] = b"\xff\xff\xff\x7f"  # an impossible footer length
    else:
        mid = len(raw) // 3
        raw[mid : mid + 4096] = bytes(4096)  # pages zeroed
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        read_all(bad)
    # The process is alive and the next file reads.
    assert read_all(good) == docs


def test_encode_reads_every_codec_to_the_same_shard(tmp_path):
    docs = [f"Once upon a time {i}, there was \u00fcnicode {'and more ' * (i % 9)}" for i in range(400)]
    tok = Tokenizer.train(iter(docs), 300, [EOT], progress=False)
    ref = sum((tok.encode(d) + [tok.eos_id] for d in docs), [])
    for codec in CODECS:
        path = tmp_path / f"{codec}.parquet"
        pq.write_table(pa.table({"text": docs}), path, compression=codec, row_group_size=97)
        shards.encode(tok, path, tmp_path / codec, threads=2, chunk_size=2048, progress=False)
        got = (tmp_path / f"{codec}.bin").read_bytes()
        assert got == np.array(ref, dtype="<u2").tobytes(), codec


def test_invalid_utf8_in_a_byte_array_column_names_the_document(tmp_path):
    tok = Tokenizer.train(iter(["some text", "more text"]), 270, [EOT], progress=False)
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": pa.array([b"fine", b"bad \xff here"], type=pa.binary())}), path)
    with pytest.raises(ValueError, match="document 1 is not valid UTF-8"):
        shards.encode(tok, path, tmp_path / "o", progress=False)
    side = shards.encode(tok, path, tmp_path / "r", errors="replace", progress=False)
    assert side["num_documents"] == 2
