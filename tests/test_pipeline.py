"""ferrolm.bpe.pipeline and ferrolm.lm.config.resume_config: what the commands run, called from Python."""

from __future__ import annotations

import pytest
from texts import EOT, stdlib_text

from ferrolm.bpe import pipeline
from ferrolm.bpe.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "a.txt"
    path.write_text(stdlib_text(60_000).replace("\n\n", f"\n{EOT}\n", 20), encoding="utf-8")
    return path


def test_one_run_saves_the_tokenizer_train_makes(corpus, tmp_path):
    done = pipeline.train_tokenizer(tmp_path / "tok", 400, input=[corpus], threads=1, progress=False)
    same = Tokenizer.train(str(corpus), 400, [EOT], num_threads=1, progress=False)
    assert done.path == tmp_path / "tok" and Tokenizer.load(done.path).fingerprint == same.fingerprint
    assert done.sample_path == str(corpus) and done.special_tokens == [EOT]
    longest = done.longest_tokens(5)
    assert [len(b) for b in longest] == sorted((len(b) for b in longest), reverse=True)
    assert EOT.encode() not in longest and len(longest[0]) == max(
        len(b) for b in same.vocab.values() if b != EOT.encode()
    )
    nbytes, ids = pipeline.compression(done.tokenizer, str(corpus), 10_000)
    assert nbytes == 10_000 and 0 < ids < nbytes


def test_counts_of_two_parts_train_the_tokenizer_of_one_run(corpus, tmp_path):
    files = []
    for i in range(2):
        h = pipeline.count_pretokens([corpus], tmp_path / f"{i}.counts", part=f"{i}/2", threads=1, progress=False)
        assert h["part"] == [i, 2] and h["seconds"] >= 0
        files.append(tmp_path / f"{i}.counts")
    split = pipeline.train_tokenizer(tmp_path / "two", 400, counts=files, threads=1, progress=False)
    one = pipeline.train_tokenizer(tmp_path / "one", 400, input=corpus, threads=1, progress=False)
    assert split.special_tokens == [EOT]  # from the counts files' header
    assert split.sample_path is None and split.tokenizer.fingerprint == one.tokenizer.fingerprint


@pytest.mark.parametrize(
    "options,message",
    [
        ({"part": "0/2"}, "--part goes with --counts-out"),
        ({"parts": 2}, "--parts goes with --ray"),
        ({"counts": ["c"], "counts_out": "d"}, "--counts and --counts-out do not go together"),
        ({"counts": ["c"], "input": ["i"]}, "not both"),
    ],
)
def test_options_that_do_not_go_together_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        pipeline.is_split(**options)


def test_a_missing_option_is_named(corpus, tmp_path):
    with pytest.raises(ValueError, match="--vocab-size is required"):
        pipeline.train_tokenizer(tmp_path / "tok", None, input=[corpus])
    with pytest.raises(ValueError, match="--counts-out needs --input"):
        pipeline.count_pretokens(None, tmp_path / "c.counts")


def test_encode_corpus_then_shard_text_gives_the_text_back(corpus, tmp_path):
    tok = Tokenizer.train(str(corpus), 400, [EOT], num_threads=1, progress=False)
    text = f"first document{EOT}second one, é and 😀{EOT}"
    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8")
    sidecar, seconds = pipeline.encode_corpus(tok, [src], tmp_path / "shard", threads=1, progress=False)
    assert seconds >= 0 and sidecar["num_documents"] == 2
    n, pieces = pipeline.shard_text(tok, tmp_path / "shard")
    assert n == sidecar["num_tokens"] and "".join(pieces) == text
    n, pieces = pipeline.shard_text(tok, tmp_path / "shard.bin", offset=n)
    assert n == 0 and "".join(pieces) == ""
    with pytest.raises(ValueError, match="--offset"):
        pipeline.shard_text(tok, tmp_path / "shard", offset=n + 10_000)
    with pytest.raises(ValueError, match="--chunk-size"):
        pipeline.encode_corpus(tok, [src], tmp_path / "other", chunk_mb=pipeline.MAX_CHUNK_MB + 1)


def test_resume_config_reads_the_run_folder(tmp_path):
    from ferrolm.lm.config import CONFIG_NAME, load_config, resume_config, to_toml

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / CONFIG_NAME).write_text(to_toml(load_config(None, ["model.num_layers=3"])), encoding="utf-8")
    (run / "checkpoints" / "step_10.pt").write_bytes(b"")
    for given in (run, run / "checkpoints" / "step_10.pt"):
        cfg = resume_config(None, ["optimizer.lr=0.001"], given)
        assert cfg.model.num_layers == 3 and cfg.optimizer.lr == 0.001 and str(cfg.run.out_dir) == str(run)
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        resume_config(None, [], tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="pass --config too"):
        resume_config(None, [], tmp_path)
