"""ferrolm.ray and `ferrolm encode --ray` on a local Ray cluster of two CPUs that this module
starts once: parts equal the one-machine encode byte for byte, reruns skip complete parts,
and a worker killed in the middle of a part leaves the output unchanged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from texts import SEPARATOR, stdlib_text

from ferrolm.bpe import shards
from ferrolm.bpe.tokenizer import Tokenizer
from ferrolm.lm.data import TokenShards

ray = pytest.importorskip("ray")
import ferrolm.ray as fray  # noqa: E402

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def cluster():
    """A local cluster of 2 CPUs (two workers) with a small object store; its address."""
    if ray.is_initialized():
        ray.shutdown()
    ctx = ray.init(num_cpus=2, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False)
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="module")
def gpt2_tok(gpt2_vocab_merges):
    vocab, merges = gpt2_vocab_merges
    return Tokenizer(vocab, merges, [EOT])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "in.txt"
    path.write_text(stdlib_text(1_500_000), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory, gpt2_tok, corpus):
    """The ids of the one-machine encode of the corpus."""
    prefix = tmp_path_factory.mktemp("one") / "whole"
    shards.encode(gpt2_tok, [corpus], prefix, progress=False)
    return np.fromfile(f"{prefix}.bin", dtype="<u2")


def parts_in_manifest_order(prefix: Path) -> np.ndarray:
    manifest = json.loads(shards.manifest_path(prefix).read_text())
    return np.concatenate([np.fromfile(prefix.parent / f"{p}.bin", dtype="<u2") for p in manifest["parts"]])


def test_parts_hold_the_one_machine_ids_and_a_rerun_skips_them(cluster, tmp_path, gpt2_tok, corpus, one_machine):
    prefix = tmp_path / "out" / "corpus"
    m = fray.encode(gpt2_tok, [corpus], prefix, parts=3, progress=False)
    assert m["parts"] == [f"corpus.part-{i}-of-3" for i in range(3)]
    assert m["num_tokens"] == len(one_machine) and m["skipped_parts"] == 0
    assert np.array_equal(parts_in_manifest_order(prefix), one_machine)
    on_disk = json.loads(shards.manifest_path(prefix).read_text())
    for rec in on_disk["part_records"]:
        data = (prefix.parent / f"{rec['name']}.bin").read_bytes()
        assert rec["num_tokens"] == len(data) // 2
        assert rec["sha256"] == __import__("hashlib").sha256(data).hexdigest()
    # The readers take the prefix (or the manifest) as for any split.
    assert np.array_equal(TokenShards(prefix)[:], one_machine)
    assert np.array_equal(TokenShards(shards.manifest_path(prefix))[:], one_machine)
    assert shards.validate_shards(prefix, tokenizer=gpt2_tok) == []
    # A rerun finds every part complete and rewrites none of them.
    mtimes = [os.stat(prefix.parent / f"{p}.bin").st_mtime_ns for p in m["parts"]]
    again = fray.encode(gpt2_tok, [corpus], prefix, parts=3, progress=False)
    assert again["skipped_parts"] == 3
    assert mtimes == [os.stat(prefix.parent / f"{p}.bin").st_mtime_ns for p in m["parts"]]
    # Only the part that is gone is encoded again.
    os.unlink(prefix.parent / "corpus.part-1-of-3.json")
    again = fray.encode(gpt2_tok, [corpus], prefix, parts=3, progress=False)
    assert again["skipped_parts"] == 2
    assert np.array_equal(parts_in_manifest_order(prefix), one_machine)
    # Parts of another split under the prefix are refused, not mixed.
    with pytest.raises(ValueError, match="3-way split"):
        fray.encode(gpt2_tok, [corpus], prefix, parts=4, progress=False)


def test_dataset_blocks_encode_as_encode_texts(cluster, tmp_path, gpt2_tok):
    docs = stdlib_text(300_000).split(SEPARATOR)
    shards.encode_texts(gpt2_tok, docs, tmp_path / "whole", progress=False)
    ds = ray.data.from_items([{"body": d} for d in docs], override_num_blocks=3)
    m = fray.encode(gpt2_tok, ds, tmp_path / "ds", column="body", progress=False)
    assert len(m["parts"]) == 3 and m["num_documents"] == len(docs)
    assert np.array_equal(parts_in_manifest_order(tmp_path / "ds"), np.fromfile(tmp_path / "whole.bin", dtype="<u2"))
    assert fray.encode(gpt2_tok, ds, tmp_path / "ds", column="body", progress=False)["skipped_parts"] == 3
    with pytest.raises(ValueError, match="no column 'text'"):
        fray.encode(gpt2_tok, ds, tmp_path / "nocol", progress=False)


def _pid_writing(partial: Path) -> int | None:
    """The process that has ``partial`` open (the worker encoding that part)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == str(partial):
                    return int(pid)
            except OSError:
                continue
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker through /proc")
def test_a_worker_killed_mid_part_is_retried_and_the_output_is_unchanged(cluster, tmp_path, gpt2_tok, corpus):
    big = tmp_path / "big.txt"
    big.write_text(corpus.read_text(encoding="utf-8") * 4, encoding="utf-8")
    whole = tmp_path / "whole"
    shards.encode(gpt2_tok, [big], whole, progress=False)
    prefix = tmp_path / "killed"
    partial = tmp_path / "killed.part-0-of-2.bin.partial"
    result: dict = {}

    def run():
        try:
            # Small chunks, each committed: the part takes a few seconds, so it can be caught mid-way.
            result["manifest"] = fray.encode(gpt2_tok, [big], prefix, parts=2, chunk_size=1 << 15, progress=False)
        except BaseException as e:  # reported by the assertion below
            result["error"] = e

    driver = threading.Thread(target=run)
    driver.start()
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and driver.is_alive() and time.monotonic() < deadline:
        pid = _pid_writing(partial)
        if pid is not None and partial.exists() and partial.stat().st_size > 0:
            os.kill(pid, signal.SIGKILL)
            killed = pid
        time.sleep(0.01)
    driver.join(300)
    assert killed is not None, "the part finished before its worker could be killed"
    assert "error" not in result, result.get("error")
    assert np.array_equal(parts_in_manifest_order(prefix), np.fromfile(f"{whole}.bin", dtype="<u2"))
    assert shards.validate_shards(prefix) == []


def test_cli_encode_ray_joins_the_cluster_ray_address_names(cluster, tmp_path, gpt2_tok, corpus, one_machine):
    tok_dir = tmp_path / "tok"
    gpt2_tok.save(tok_dir)
    env = {**os.environ, "RAY_ADDRESS": cluster}
    args = ["encode", "--tokenizer", tok_dir, "--input", corpus, "--out", tmp_path / "c", "--no-progress"]
    run = subprocess.run(
        [sys.executable, "-m", "ferrolm", *map(str, args), "--ray", "--parts", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "wrote 2 parts (0 already complete)" in run.stdout
    assert np.array_equal(TokenShards(tmp_path / "c")[:], one_machine)
    # A rerun with nothing to do says so, and reports no rate of zero work.
    again = subprocess.run(
        [sys.executable, "-m", "ferrolm", *map(str, args), "--ray", "--parts", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert "all 2 parts already complete" in again.stdout and "tokens/s" not in again.stdout, again.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "ferrolm", *map(str, args), "--ray", "--part", "0/2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and "--part and --ray do not go together" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_without_ray_the_error_names_the_extra(monkeypatch, gpt2_tok, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r'pip install "ferrolm\[ray\]"'):
        fray.encode(gpt2_tok, [tmp_path / "x.txt"], tmp_path / "x")


def test_train_tokenizer_ray_gives_the_merges_of_one_run(cluster, tmp_path, corpus):
    from ferrolm.bpe import trainer

    vocab, merges, specials, _ = fray.train_tokenizer([corpus], 800, parts=3, work_dir=tmp_path / "c", progress=False)
    assert (vocab, merges) == trainer.train_bpe([corpus], 800, [EOT])
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [f"part-{i}-of-3.counts" for i in range(3)]
    # Through the CLI, joining the cluster that RAY_ADDRESS names.
    env = {**os.environ, "RAY_ADDRESS": cluster}
    run = subprocess.run(
        [sys.executable, "-m", "ferrolm", "train-tokenizer", "--ray", "--parts", "3", "--input", str(corpus)]
        + ["--vocab-size", "800", "--out", str(tmp_path / "tok"), "--no-progress"],
        capture_output=True,
        text=True,
        env={**env, "PYTHONWARNINGS": "ignore"},
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert Tokenizer.load(tmp_path / "tok").merges == merges


def test_train_tokenizer_on_a_dataset_gives_the_merges_of_its_documents(cluster, tmp_path):
    from ferrolm.bpe import trainer

    docs = stdlib_text(200_000).split(SEPARATOR)
    ds = ray.data.from_items([{"text": d} for d in docs], override_num_blocks=3)
    vocab, merges, _, _ = fray.train_tokenizer(ds, 700, work_dir=tmp_path / "c", progress=False)
    assert (vocab, merges) == trainer.train_bpe(iter(docs), 700, [EOT])
    assert len(list((tmp_path / "c").iterdir())) == 3


def _edit_keeping_size_and_mtime(path: Path, at: int, n: int = 1) -> None:
    """Overwrite ``n`` bytes from ``at`` with a word the text lacks, then restore the
    modification time."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    assert at + n <= len(data)
    data[at : at + n] = (b"zqx " * n)[:n]
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _two_small_files(tmp_path: Path) -> list[Path]:
    docs = stdlib_text(12_000).split(SEPARATOR)
    half = len(docs) // 2
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for f, part in zip(files, (docs[:half], docs[half:])):
        f.write_text(SEPARATOR.join(part) + SEPARATOR, encoding="utf-8")
    return files


def test_a_rerun_after_a_same_size_edit_encodes_the_parts_that_read_it(cluster, tmp_path, gpt2_tok):
    files = _two_small_files(tmp_path)
    prefix = tmp_path / "out" / "c"
    fray.encode(gpt2_tok, files, prefix, parts=2, progress=False)
    sidecars = [shards.read_sidecar(shards.output_paths(prefix, (i, 2))[1]) for i in range(2)]
    touched = [i for i, sc in enumerate(sidecars) if any(r["path"] == str(files[1]) for r in sc["inputs"])]
    _edit_keeping_size_and_mtime(files[1], files[1].stat().st_size // 2)
    again = fray.encode(gpt2_tok, files, prefix, parts=2, progress=False)
    assert again["skipped_parts"] == 2 - len(touched)
    shards.encode(gpt2_tok, files, tmp_path / "whole", progress=False)
    assert np.array_equal(parts_in_manifest_order(prefix), np.fromfile(tmp_path / "whole.bin", dtype="<u2"))


def test_train_tokenizer_ray_rerun_after_a_same_size_edit_counts_again(cluster, tmp_path):
    from ferrolm.bpe import trainer

    files = _two_small_files(tmp_path)
    work = tmp_path / "c"
    fray.train_tokenizer(files, 400, parts=2, work_dir=work, progress=False)
    _edit_keeping_size_and_mtime(files[1], 1_000, 2_000)
    vocab, merges, _, _ = fray.train_tokenizer(files, 400, parts=2, work_dir=work, progress=False)
    assert (vocab, merges) == trainer.train_bpe(files, 400, [EOT])
