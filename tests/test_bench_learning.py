"""benches/bench_learning.py's report: how a loss difference is worded, seeds summed up, and
the development and held-out figures kept apart."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benches" / "bench_learning.py"


@pytest.fixture(scope="module")
def bench_learning():
    spec = importlib.util.spec_from_file_location("bench_learning", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "loss, ref, words",
    [
        (5.333, 5.444, "2.0 % lower"),
        (5.965, 5.444, "9.6 % higher"),  # a higher loss is never "-9.6 % lower"
        (4.703, 5.374, "12.5 % lower"),
        (5.4441, 5.444, "level"),
    ],
)
def test_a_loss_is_worded_by_its_sign(bench_learning, loss, ref, words):
    assert bench_learning.relative_loss(loss, ref) == words


def make_run(folder: Path, dev: float, heldout: float, step: int = 250) -> Path:
    folder.mkdir(parents=True)
    row = {"step": step, "tokens": step * 4096, "time_s": 60.0, "val_loss": dev}
    (folder / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    (folder / "heldout.json").write_text(json.dumps({"loss": heldout, "bits_per_byte": heldout / 2.7}))
    return folder


def test_a_contenders_seeds_give_the_mean_and_the_spread(bench_learning, tmp_path):
    runs = [make_run(tmp_path / "a", 5.0, 5.2), make_run(tmp_path / "b", 5.2, 5.3)]
    sm = bench_learning.summary(runs)
    assert (sm["seeds"], sm["step"], sm["tokens"]) == (2, 250, 1_024_000)
    assert sm["dev"] == pytest.approx(5.1) and sm["dev_spread"] == pytest.approx(0.2)
    assert sm["heldout"] == pytest.approx(5.25) and sm["heldout_spread"] == pytest.approx(0.1)
    assert bench_learning.with_spread(sm["heldout"], sm["heldout_spread"], 2) == "5.250 ±0.050"
    assert bench_learning.with_spread(5.0, 0.0, 1) == "5.000"


def test_a_run_without_its_held_out_score_is_not_finished(bench_learning, tmp_path):
    run = make_run(tmp_path / "a", 5.0, 5.2)
    assert bench_learning.finished(run)
    (run / "heldout.json").unlink()
    assert not bench_learning.finished(run)


def test_the_first_seed_keeps_the_label_and_the_others_are_named_by_seed(bench_learning):
    assert bench_learning.run_name("smear", 1337, [1337, 7]) == "smear"
    assert bench_learning.run_name("smear", 7, [1337, 7]) == "smear.seed7"


def test_the_report_lines_word_each_contender_on_each_text(bench_learning, tmp_path):
    sums = {
        name: bench_learning.summary([make_run(tmp_path / name, dev, held)])
        for name, dev, held in (("cs336", 5.965, 6.0), ("cpu-small", 5.333, 5.0), ("nanochat", 5.444, 5.1))
    }
    assert bench_learning.against(sums, "nanochat") == [
        "- cs336: held-out loss 17.6 % higher than nanochat's",
        "- cpu-small: held-out loss 2.0 % lower than nanochat's",
    ]
    assert bench_learning.against(sums, "nanochat", "dev")[1] == (
        "- cpu-small: development loss 2.0 % lower than nanochat's"
    )


def test_the_portable_preset_races_by_default(bench_learning):
    args = bench_learning.arg_parser().parse_args([])
    assert args.contenders.split(",") == ["cs336", "cpu-small", "portable"]
    assert bench_learning.timed_spec("portable", 1000) == "portable=portable+schedule.warmup_steps=20"


def test_the_summary_sets_the_main_contender_against_nanochat_on_both_texts(bench_learning, tmp_path):
    runs = {
        name: [make_run(tmp_path / name, dev, held)]
        for name, dev, held in (
            ("cs336", 5.9, 6.0),
            ("cpu-small", 5.0, 5.1),
            ("portable", 5.1, 5.202),
            ("nanochat", 5.2, 5.3),
        )
    }
    args = bench_learning.arg_parser().parse_args(["--steps", "250"])
    rows = bench_learning.latest_result({"steps": runs}, args)
    assert (
        "| cpu-small: held-out loss, equal steps (250) | nanochat (GPT + MuonAdamW) | **3.8 % lower** (5.100 vs 5.300) |"
        in rows
    )
    assert (
        "| cpu-small: development loss, equal steps (250) | nanochat (GPT + MuonAdamW) | **3.8 % lower** (5.000 vs 5.200) |"
        in rows
    )
    assert (
        "| portable (exports to GGUF and HF): held-out loss, equal steps (250) | cpu-small | **2.0 % higher** (5.202 vs 5.100) |"
        in rows
    )
    assert "| cpu-small: tokens to cs336's final development loss | cs336 recipe | **1.00x** the tokens |" in rows


def test_the_report_lists_every_contender_with_its_settings_and_both_losses(bench_learning, tmp_path):
    runs = {"cpu-small": [make_run(tmp_path / "c", 5.0, 5.1)], "smear": [make_run(tmp_path / "s", 4.9, 5.05)]}
    args = bench_learning.arg_parser().parse_args(["--contenders", "cpu-small,smear=cpu-small+model.smear=true"])
    text = bench_learning.report({"steps": runs}, args, ["python benches/bench_learning.py"])
    assert "| smear | cpu-small smear=true | 1 | 250 | 1,024,000 | 60 | 4.900 | 5.050 | 1.870 |" in text
    assert "- smear: held-out loss 1.0 % lower than cpu-small's" in text


def test_the_gpu_checks_race_lines_word_each_final_loss_against_the_reference(bench_learning):
    finals = {"cs336": {"val_loss": 5.965}, "cpu-small": {"val_loss": 5.333}, "nanochat": {"val_loss": 5.444}}
    assert bench_learning.lower_than(finals, "nanochat") == [
        "- cs336: validation loss 9.6 % higher than nanochat's",
        "- cpu-small: validation loss 2.0 % lower than nanochat's",
    ]


def test_the_step_cost_report_sets_each_contender_against_the_first(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_step_cost", SCRIPT.with_name("bench_step_cost.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = argparse.Namespace(threads=2, steps=40, rounds=3, skip=10, results=tmp_path)
    speeds = {"fp32": {"cpu-small": [1000.0, 900.0, 1100.0], "gate": [800.0, 950.0, 900.0]}}
    module.write_report(speeds, ["cpu-small", "gate=cpu-small+model.attn_gate=true"], ["cpu-small", "gate"], args)
    text = (tmp_path / "step_cost.md").read_text()
    assert "| gate: training step per token (fp32) | cpu-small | **1.11x** the time (900 vs 1,000 tokens/s) |" in text
    assert "| fp32 | gate | cpu-small attn_gate=true | 900 | 1.11x |" in text


def test_a_report_counts_the_seeds_each_contender_finished(bench_learning, tmp_path):
    make_run(tmp_path / "cpu-small", 5.0, 5.1)
    make_run(tmp_path / "cpu-small.seed7", 5.2, 5.3)
    make_run(tmp_path / "smear", 4.9, 5.0)
    runs = bench_learning.finished_runs(tmp_path, ["cpu-small", "smear=cpu-small+model.smear=true"], [1337, 7])
    assert [d.name for d in runs["cpu-small"]] == ["cpu-small", "cpu-small.seed7"]
    assert [d.name for d in runs["smear"]] == ["smear"]
    assert "nanochat" not in runs
    # a contender this race lacks is left out; a race with none of them is an error
    assert list(bench_learning.finished_runs(tmp_path, ["smear", "gate=cpu-small+model.attn_gate=true"], [1337])) == [
        "smear"
    ]
    with pytest.raises(bench_learning.ContenderFailed, match="no finished run of gate"):
        bench_learning.finished_runs(tmp_path, ["gate=cpu-small+model.attn_gate=true"], [1337])


def test_nanochats_held_out_score_covers_the_windows_ferrolm_eval_scores(tmp_path):
    """nanochat_peer.score_heldout on a stand-in model: every token of the first N scored once,
    in consecutive windows, a shorter last window alone; bits per byte from the tokenizer."""
    torch = pytest.importorskip("torch")

    from ferrolm import Tokenizer
    from ferrolm.bpe import shards

    spec = importlib.util.spec_from_file_location("nanochat_peer", SCRIPT.with_name("nanochat_peer.py"))
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    tok = Tokenizer({i: bytes([i]) for i in range(256)} | {256: b"<|endoftext|>"}, [], ["<|endoftext|>"])
    tok.save(tmp_path / "tok")
    shards.encode_texts(tok, ["abcdefghijklmnopqrstuv"], tmp_path / "held", progress=False)  # 22 ids + eos
    seen = []

    class Uniform(torch.nn.Module):
        config = type("C", (), {"vocab_size": 258})

        def forward(self, x, y, loss_reduction="mean"):
            seen.append(tuple(y.shape))
            return torch.tensor(float(y.numel()) * 2.0)  # 2 nats a token

    result = peer.score_heldout(Uniform(), str(tmp_path / "held"), 21, 8, 2, "cpu", str(tmp_path / "tok"))
    assert seen == [(2, 8), (1, 4)]  # windows 0-8, 8-16 together, then 16-20 alone
    assert result["tokens"] == 20 and result["loss"] == pytest.approx(2.0)
    assert result["bits_per_byte"] == pytest.approx(2.0 / math.log(2))  # one byte a token
