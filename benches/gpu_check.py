"""Everything ferrolm's LM half should do on one GPU, checked in one command (at most ~9
minutes on an H100/H200), with the findings written to benches/results/gpu.md.

The GPU machine needs Python with torch (CUDA), transformers and numpy; no internet, no
Rust. Install ferrolm from the abi3 wheel that `.ci/run` builds, next to a checkout of
this repository (for benches/):

    pip install --no-deps --target /opt/ferrolm dist/ferrolm-*.whl
    PYTHONPATH=/opt/ferrolm python benches/gpu_check.py

What it does, in order (each stage's result goes into the report even when a later one fails):

1. Environment: torch, the GPU, and its measured dense bf16 matrix rate (8192^3 matmuls),
   which MFU is reported against (next to the data-sheet peak where the GPU is known).
2. Checks: logits on the GPU vs the CPU (fp32, TF32 off); greedy generation with the KV
   cache vs without it and vs the CPU; a resumed run vs an uninterrupted one on the GPU.
3. Speed: tokens/s, MFU and peak memory of the `tinystories` model shape in bf16, ferrolm
   eager and compiled side by side with HF `LlamaForCausalLM` (SDPA, eager and compiled)
   and the nanoGPT-style GPT of the same widths (eager and compiled): benches/bench_model.py.
4. Training: 2 minutes of the `tinystories` preset on text found on the machine (the Python
   standard library's source, as `ferrolm demo` uses), with its loss curve.
5. Learning race: the presets of --race-contenders (default cs336, tinystories and tinystories
   with cpu-small's hashed bigram embedding, its sparse update and its AdamW betas, each
   forced to the `tinystories` shape and batch) for --race-seconds of training clock each
   (default 60), on the same shards and validation windows, as benches/bench_learning.py
   races on a CPU; nanochat's own model and optimizer too with --nanochat CHECKOUT. On
   TinyStories text (--tinystories FOLDER_OR_FILE: a 10,000-id tokenizer and shards made
   from its first --tinystories-mb MB) the report gives each one's seconds and tokens to
   validation loss 1.45; otherwise the race runs on the stage-4 text.

    python benches/gpu_check.py --device cpu --tiny     # a dry run of every code path, in seconds
    python benches/gpu_check.py --stages race --race-seconds 300 --tinystories TS --nanochat NC

The dry run uses a tiny model, a few seconds of training, and torch.compile's "eager"
backend for the compiled rows (dynamo traces the same graphs; no code is generated); its
report goes to a temporary directory unless --out is given. --stages picks stages 2-5
(checks, speed, training, race; the data stage always runs). Exit status 1 when a stage
or check failed (the report says which), 2 when CUDA was asked for and is not there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_learning  # noqa: E402  (benches/ is not a package)
import bench_model  # noqa: E402

from ferrolm import __version__  # noqa: E402
from ferrolm.lm.model import TransformerLM  # noqa: E402

TINY = dict(vocab_size=512, context_length=32, d_model=32, num_layers=2, num_heads=4, d_ff=64)
STAGES = ("checks", "speed", "training", "race")
RACE_TARGET = 1.45  # the validation loss TinyStories runs are held to (CS336's target)


# ---------------------------------------------------------------------------------------
# 1. Environment
# ---------------------------------------------------------------------------------------


def matmul_tflops(device: torch.device, n: int, reps: int) -> float:
    """Measured dense bf16 (fp32 on the CPU) matmul rate, TFLOP/s."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def environment(device: torch.device, tiny: bool) -> dict:
    from ferrolm.lm.train import PEAK_FLOPS_BF16

    env = dict(ferrolm=__version__, torch=torch.__version__, python=platform.python_version(), device=str(device))
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["datasheet_tflops"] = next((f / 1e12 for k, f in PEAK_FLOPS_BF16 if k in env["gpu"]), None)
    else:
        env["gpu"] = f"none (CPU: {platform.processor() or platform.machine()})"
    env["measured_tflops"] = matmul_tflops(device, 256 if tiny else 8192, 3 if tiny else 20)
    return env


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------
# 2. Checks
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def full_fp32():
    """TF32 off: the checks compare fp32 results across devices and code paths."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def check_logits(device: torch.device, shape: dict) -> str:
    """The same weights and ids on the device and on the CPU give the same fp32 logits."""
    torch.manual_seed(0)
    model = TransformerLM(**shape).eval()
    ids = torch.randint(0, shape["vocab_size"], (2, shape["context_length"]))
    with full_fp32(), torch.no_grad():
        on_cpu = model(ids)
        on_device = model.to(device)(ids.to(device)).cpu()
    diff = (on_cpu - on_device).abs().max().item()
    assert diff < 1e-3, f"max |logits difference| {diff:.2e}"
    return f"max |difference| {diff:.2e} over {tuple(on_cpu.shape)} logits"


def check_generate(device: torch.device, shape: dict) -> str:
    """Greedy decoding: with the KV cache = without it, on the device = on the CPU."""
    from ferrolm.lm.generate import generate

    torch.manual_seed(1)
    model = TransformerLM(**shape).eval()
    prompt = [1, 2, 3, 4, 5]
    n = min(24, shape["context_length"] - len(prompt))

    def greedy(m, use_cache):
        return list(generate(m, prompt, n, top_k=1, use_cache=use_cache))

    with full_fp32():
        on_cpu = greedy(model, True)
        model.to(device)
        cached, uncached = greedy(model, True), greedy(model, False)
    assert cached == uncached, f"KV cache {cached} vs no cache {uncached}"
    same_as_cpu = sum(a == b for a, b in zip(cached, on_cpu))
    assert same_as_cpu >= n // 2, f"device {cached} vs CPU {on_cpu}"  # near-ties may flip late
    return f"{n} greedy tokens: cache = no cache; {same_as_cpu}/{n} equal to the CPU's"


def check_resume(device: torch.device, shards: dict, work: Path) -> str:
    """8 steps straight vs 4 steps, a checkpoint, and 4 resumed steps: the same weights."""
    from ferrolm.lm.checkpoint import read_checkpoint
    from ferrolm.lm.train import load_config, train

    def cfg(out: Path):
        sets = [f"model.{k}={v}" for k, v in TINY.items()] + [
            f"model.vocab_size={shards['vocab_size']}",
            f"data.train={json.dumps(shards['train'])}",
            f"data.val={json.dumps(shards['val'])}",
            f"run.out_dir={json.dumps(str(out))}",
            f"run.device={json.dumps(str(device))}",
            "schedule.max_steps=8",
            "schedule.warmup_steps=2",
            "schedule.batch_size=4",
            "schedule.tokens_per_step=0",
            "run.checkpoint_every=4",
            "run.keep_last=3",
            "run.eval_every=4",
            "run.eval_batches=1",
            "run.log_every=2",
            "run.progress=false",
            "run.compile=false",
        ]
        return load_config("tinystories", sets)

    train(cfg(work / "straight"))
    train(cfg(work / "resumed"), resume=work / "straight" / "checkpoints" / "step_00000004.pt")
    a = read_checkpoint(work / "straight" / "checkpoints" / "step_00000008.pt")["model"]
    b = read_checkpoint(work / "resumed" / "checkpoints" / "step_00000008.pt")["model"]
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert diff < 1e-4, f"max |weight difference| {diff:.2e}"
    return f"max |weight difference| after 8 steps {diff:.2e}"


def run_check(name: str, fn, *args) -> tuple[str, bool, str]:
    t0 = time.perf_counter()
    try:
        detail = fn(*args)
        ok = True
    except Exception as e:  # a failed check is a finding to report, not a reason to stop
        ok, detail = False, f"{type(e).__name__}: {e}"
        traceback.print_exc()
    detail += f" ({time.perf_counter() - t0:.1f} s)"
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return name, ok, detail


# ---------------------------------------------------------------------------------------
# Data for the training stages: local text, ferrolm's tokenizer, shards
# ---------------------------------------------------------------------------------------


def tokenize(train_path: Path, val_path: Path, work: Path, vocab: int) -> dict:
    """A tokenizer of `vocab` ids trained on the training text, and shards of both texts."""
    from ferrolm.app.demo import EOT
    from ferrolm.bpe import shards
    from ferrolm.bpe.tokenizer import Tokenizer

    tok = Tokenizer.train(str(train_path), vocab, [EOT], progress=False)
    tok.save(work / "tokenizer")
    train_side = shards.encode(tok, [train_path], work / "train", progress=False)
    val_side = shards.encode(tok, [val_path], work / "val", progress=False)
    return dict(
        train=str(work / "train"),
        val=str(work / "val"),
        tokenizer=str(work / "tokenizer"),
        vocab_size=tok.vocab_size,
        train_tokens=int(train_side["num_tokens"]),
        val_tokens=int(val_side["num_tokens"]),
    )


def prepare_shards(work: Path, tiny: bool) -> dict:
    from ferrolm.app.demo import prepare_data

    info = prepare_data(work / "text", max_bytes=int(0.4e6 if tiny else 40e6))
    sides = tokenize(info.train_path, info.val_path, work, 512 if tiny else 10_000)
    return dict(sides, text_mb=(info.train_bytes + info.val_bytes) / 1e6)


# ---------------------------------------------------------------------------------------
# 3. Speed and 4. training
# ---------------------------------------------------------------------------------------


def speed(device: torch.device, tiny: bool, peak_tflops: float) -> list[str]:
    argv = ["--device", device.type, "--shapes", "tiny" if tiny else "tinystories"]
    argv += ["--dtypes", "bf16" if device.type == "cuda" else "fp32", "--peak-tflops", str(peak_tflops)]
    if tiny:
        argv += ["--runs", "1", "--steps", "1", "--threads", "1", "--compile-backend", "eager"]
    else:
        argv += ["--runs", "3", "--steps", "8", "--batch", "64"]
    args = bench_model.parser().parse_args(argv)
    _, lines = bench_model.compare(args)
    return [f"    python benches/bench_model.py {' '.join(argv)}", ""] + lines


def training_run(device: torch.device, shards: dict, work: Path, tiny: bool, report_dir: Path) -> list[str]:
    from ferrolm.lm.train import load_config, train

    seconds = 5 if tiny else 120
    sets = [
        f"model.vocab_size={shards['vocab_size']}",
        f"data.train={json.dumps(shards['train'])}",
        f"data.val={json.dumps(shards['val'])}",
        f"data.tokenizer={json.dumps(shards['tokenizer'])}",
        f"run.out_dir={json.dumps(str(work / 'run'))}",
        f"run.device={json.dumps(str(device))}",
        f"schedule.max_time_s={seconds}",
        'schedule.schedule_by="time"',
        "schedule.warmup_steps=20",
        "run.eval_every=50",
        "run.eval_batches=8",
        "run.log_every=10",
        "run.checkpoint_every=0",
        "run.progress=false",
    ]
    if tiny:
        sets += [f"model.{k}={v}" for k, v in TINY.items() if k != "vocab_size"]
        sets += ["schedule.batch_size=4", "schedule.tokens_per_step=0", "schedule.warmup_steps=2"]
        sets += ["run.eval_every=5", "run.eval_batches=1", "run.log_every=2", "run.compile=false"]
    cfg = load_config("tinystories", sets)
    summary = train(cfg)
    try:  # matplotlib is optional on a bare GPU machine: the table below is the curve too
        from ferrolm.app.plot import plot_run

        png = plot_run(
            work / "run", x="time", out=report_dir / "gpu_loss.png", title="tinystories preset, 2 minutes", force=True
        )
        figure = f"![loss curve]({png.name})"
    except ImportError as e:
        figure = f"(no loss plot: {e})"
    recs = [r for r in summary.records if r.get("tokens_per_s") or r.get("val_loss") is not None]
    lines = [
        f"`ferrolm train --config tinystories` for {seconds} s of training clock (compile and evaluations included) on "
        f"{shards['text_mb']:.0f} MB of local text ({shards['train_tokens']:,} training tokens, vocabulary "
        f"{shards['vocab_size']:,}); status {summary.status}, {summary.step} steps, final val loss "
        f"{summary.final_val_loss if summary.final_val_loss is None else round(summary.final_val_loss, 4)}.",
        "",
        figure,
        "",
        "| step | time s | train loss | val loss | tokens/s | MFU |",
        "|---|---|---|---|---|---|",
    ]
    for r in recs:
        mfu = f"{100 * r['mfu']:.1f} %" if r.get("mfu") else ""
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else ""
        fmt = lambda v: "" if v is None else f"{v:.4f}"  # noqa: E731
        lines.append(
            f"| {r['step']} | {r['time_s']:.0f} | {fmt(r['train_loss'])} | {fmt(r['val_loss'])} | {tps} | {mfu} |"
        )
    return lines


# ---------------------------------------------------------------------------------------
# 5. The learning race at the tinystories shape
# ---------------------------------------------------------------------------------------


class PartlyFailed(Exception):
    """A stage whose report is worth keeping although a part of it failed."""

    def __init__(self, lines: list[str], why: str):
        super().__init__(why)
        self.lines = lines


def _story_end(data: bytes, at: int) -> int:
    """The offset just past the first end-of-story separator at or after `at` (len: none)."""
    from ferrolm.app.demo import EOT

    i = data.find(EOT.encode(), at)
    if i < 0:
        return len(data)
    i += len(EOT)
    return i + 1 if data[i : i + 1] == b"\n" else i


def _head(path: Path, max_bytes: int) -> bytes:
    """The file's first `max_bytes`, cut after the last whole story."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) <= max_bytes:
        return data
    from ferrolm.app.demo import EOT

    last = data.rfind(EOT.encode(), 0, max_bytes)
    return data[: _story_end(data, last)] if last > 0 else data[:max_bytes]


def tinystories_text(src: Path, work: Path, max_bytes: int) -> tuple[Path, Path, str]:
    """TinyStories' training and validation text, each cut at a story boundary.

    `src` is a folder holding its ``*train*.txt`` and ``*valid*.txt`` files, or a training
    file (its ``valid`` sibling is used when there, else its last 2 % is held out)."""

    def pick(folder: Path, word: str):
        # The GPT-4 stories (V2) first: the set the 1.45 target was set on.
        found = sorted(folder.glob(f"*{word}*.txt"), key=lambda p: ("V2" not in p.name, p.name))
        return found[0] if found else None

    if src.is_dir():
        train, val = pick(src, "train"), pick(src, "valid")
        if train is None:
            raise FileNotFoundError(f"--tinystories {src}: no *train*.txt in it")
    elif src.is_file():
        train, sibling = src, src.with_name(src.name.replace("train", "valid"))
        val = sibling if sibling != src and sibling.is_file() else None
    else:
        raise FileNotFoundError(f"--tinystories {src}: no such file or folder")
    work.mkdir(parents=True, exist_ok=True)
    text = _head(train, max_bytes)
    if val is None:
        cut = _story_end(text, len(text) * 98 // 100)
        text, held = text[:cut], text[cut:]
        if not held:
            raise ValueError(f"--tinystories {src}: too few stories to hold some out for validation")
        source = f"{train.name} (its last 2 % held out for validation)"
    else:
        held = _head(val, max(max_bytes // 10, 1 << 20))
        source = f"{train.name}, validation {val.name}"
    (work / "train.txt").write_bytes(text)
    (work / "valid.txt").write_bytes(held)
    return work / "train.txt", work / "valid.txt", source


def race_data(shards: dict, work: Path, tinystories, tinystories_mb: float, tiny: bool) -> tuple[dict, str]:
    """bench_learning's data (tok, train, val) and a sentence saying what it is."""
    if tinystories is None:
        data = dict(tok=shards["tokenizer"], train=shards["train"], val=shards["val"])
        return data, (
            f"the data stage's local text ({shards['text_mb']:.1f} MB, {shards['train_tokens']:,} training tokens, "
            f"vocabulary {shards['vocab_size']:,})"
        )
    train_txt, val_txt, source = tinystories_text(Path(tinystories), work / "text", int(tinystories_mb * 1e6))
    sides = tokenize(train_txt, val_txt, work, 512 if tiny else 10_000)
    data = dict(tok=sides["tokenizer"], train=sides["train"], val=sides["val"])
    return data, (
        f"TinyStories: {train_txt.stat().st_size / 1e6:.1f} MB of {source}, a tokenizer of "
        f"{sides['vocab_size']:,} ids trained on it, {sides['train_tokens']:,} training tokens"
    )


def race_shape(device: torch.device, tiny: bool) -> dict:
    """What every contender is forced to: the tinystories preset's widths and batch, the device."""
    from ferrolm.lm.train import load_config

    ts = load_config("tinystories")
    m, s = ts.model, ts.schedule
    shape = {f"model.{k}": getattr(m, k) for k in ("d_model", "num_layers", "num_heads", "d_ff", "context_length")}
    shape.update({"schedule.batch_size": s.batch_size, "schedule.tokens_per_step": s.tokens_per_step})
    if tiny:
        shape.update({f"model.{k}": v for k, v in TINY.items() if k != "vocab_size"})
        shape.update({"schedule.batch_size": 4, "schedule.tokens_per_step": 0})
    gpu = "true" if device.type == "cuda" and not tiny else "false"
    return {
        **shape,
        "run.device": str(device),
        "run.autocast_bf16": "true" if device.type == "cuda" else "false",
        "run.compile": gpu,
        "run.eval_batches": 1 if tiny else 10,
        "run.seed": 1337,
        "run.progress": "false",
        "run.checkpoint_every": 0,
        "run.keep_best": "false",
        "run.log_every": 2 if tiny else 50,
    }


def _why(err: Exception, log: Path) -> str:
    """The failure and the last line its log holds (the report is all a GPU machine sends)."""
    try:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-1:]
    except OSError:
        tail = []
    return f"{err}" + (f": `{tail[0].strip()[:200]}`" if tail else "")


def learning_race(device: torch.device, shards: dict, work: Path, args, report_dir: Path) -> list[str]:
    t0 = time.perf_counter()
    data, what = race_data(shards, work / "race-data", args.tinystories, args.tinystories_mb, args.tiny)
    prep_s = time.perf_counter() - t0
    seconds = args.race_seconds if args.race_seconds is not None else (3 if args.tiny else 60)
    settings = bench_learning.race_settings("time", 0, seconds / 60)
    shape = race_shape(device, args.tiny)
    threads = 1 if device.type == "cpu" else 0  # 0: torch's default
    eval_every = 5 if args.tiny else 100
    runs, failed, notes = {}, {}, []
    for spec in [c for c in args.race_contenders.split(",") if c]:
        label = bench_learning.parse_contender(spec)[0]
        out = work / "race" / label
        print(f"   {label} ...", flush=True)
        try:
            spec = bench_learning.timed_spec(spec, settings["schedule.max_steps"])
            bench_learning.train_ferrolm(spec, data, out, settings, threads, eval_every, shape)
            runs[label] = out
        except Exception as e:  # one contender's failure is a finding; the others still race
            failed[label] = _why(e, out.parent / f"{out.name}.log")
    if args.nanochat is None:
        notes.append("nanochat: skipped (give a nanochat checkout with --nanochat DIR to race it).")
    elif not runs:
        notes.append("nanochat: skipped (it takes its data, shape and windows from a ferrolm contender's run).")
    else:
        out = work / "race" / "nanochat"
        print("   nanochat ...", flush=True)
        base = next(iter(runs.values())) / "config.toml"
        try:
            # The dry run checks the path, not the speed: nanochat's optimizer steps (compiled by
            # nanochat itself) run eagerly instead of spending minutes in CPU code generation.
            env = dict(os.environ, TORCHDYNAMO_DISABLE="1") if args.tiny else None
            compile = shape["run.compile"] == "true"
            bench_learning.train_nanochat(args.nanochat, base, out, settings, threads, compile=compile, env=env)
            runs["nanochat"] = out
        except Exception as e:
            failed["nanochat"] = _why(e, out.parent / f"{out.name}.log")

    on_ts = args.tinystories is not None
    lines = [
        f"Each contender trains at the tinystories preset's shape (d_model {shape['model.d_model']}, "
        f"{shape['model.num_layers']} layers, {shape['model.num_heads']} heads, d_ff {shape['model.d_ff']}, "
        f"context {shape['model.context_length']}, batch {shape['schedule.batch_size']}) for **{seconds:g} s of "
        "training clock** (the sum of step times, compilation included, evaluations not), in its own process, one "
        f"after the other, {'bf16 autocast' if shape['run.autocast_bf16'] == 'true' else 'float32'}"
        f"{', torch.compile' if shape['run.compile'] == 'true' else ''}; on {what} (made in {prep_s:.0f} s); "
        f"validation loss every {eval_every} steps on the same {int(shape['run.eval_batches']) * int(shape['schedule.batch_size']):,} "
        "windows. ferrolm contenders: `ferrolm train --config PRESET` with only the shape, batch, data, device and "
        "evaluation forced, the schedule by time (its warmup at the preset's share). nanochat: its own `GPT` and "
        "`MuonAdamW` with its schedules (benches/nanochat_peer.py).",
        "",
        f"| contender | steps | tokens | seconds | final val loss | seconds to {RACE_TARGET} | tokens to {RACE_TARGET} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    finals = {}
    for name, run_dir in runs.items():
        ev = bench_learning.evals(run_dir)
        if not ev:
            failed[name] = "no validation loss recorded"
            continue
        last, best = ev[-1], min(r["val_loss"] for r in ev)
        finals[name] = last
        first = bench_learning.reached(ev, RACE_TARGET)
        if not on_ts:
            to_time = to_tokens = "needs --tinystories"
        elif first:
            to_time, to_tokens = f"{first['time_s']:.0f}", f"{first['tokens']:,}"
        else:
            to_time, to_tokens = f"not reached (best {best:.3f})", "-"
        lines.append(
            f"| {name} | {last['step']:,} | {last['tokens']:,} | {last['time_s']:.0f} | {last['val_loss']:.3f} "
            f"| {to_time} | {to_tokens} |"
        )
    lines += [f"| {name} | **FAILED** | {why} | | | | |" for name, why in failed.items()]
    lines.append("")
    if not on_ts:
        lines += [
            f"Time and tokens to validation loss {RACE_TARGET} are measured on TinyStories only "
            "(--tinystories DIR_OR_FILE); losses on this text are not comparable with it.",
            "",
        ]
    for ref in ("cs336", "nanochat"):
        if ref in finals and len(finals) > 1:
            lines += [f"At equal time, against {ref}:", "", *bench_learning.lower_than(finals, ref), ""]
    lines += notes
    if finals:
        try:  # matplotlib is optional on a bare GPU machine: the table holds the result
            bench_learning.plot({"time": {n: [runs[n]] for n in finals}}, report_dir / "gpu_race.png")
            lines += ["", "![validation loss against training seconds](gpu_race.png)"]
        except ImportError as e:
            lines += ["", f"(no plot: {e})"]
    print("\n".join(lines), flush=True)  # the console too: it may be all that comes back from a machine
    if failed:
        raise PartlyFailed(lines, f"{', '.join(failed)} failed")
    return lines


# ---------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------


def stage(title: str, fn, *args) -> tuple[list[str], bool]:
    print(f"== {title}", flush=True)
    t0 = time.perf_counter()
    try:
        lines, ok = fn(*args), True
    except PartlyFailed as e:
        lines, ok = [*e.lines, "", f"**FAILED**: {e}"], False
        print(f"   FAILED: {e}", flush=True)
    except Exception as e:
        traceback.print_exc()
        lines, ok = [f"**FAILED**: {type(e).__name__}: {e}"], False
    took = time.perf_counter() - t0
    print(f"   ({took:.0f} s)", flush=True)
    return [f"## {title}", "", *lines, "", f"({took:.0f} s)", ""], ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a dry run")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and seconds-long stages (a dry run)")
    ap.add_argument("--out", help="the report (default benches/results/gpu.md; with --tiny a temporary file)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"the stages to run after the data ({','.join(STAGES)})")
    ap.add_argument(
        "--race-contenders",
        default=(
            "cs336,tinystories,tinystories-bigram=tinystories+model.bigram_buckets=524288+optimizer.sparse_bigram=true"
            "+optimizer.beta1=0.4+optimizer.beta2=0.99"
        ),
        help="ferrolm presets of the learning race, comma-separated; LABEL=PRESET+KEY=VALUE+... adds settings",
    )
    ap.add_argument("--race-seconds", type=float, help="training seconds of each contender (default 60; 3 with --tiny)")
    ap.add_argument(
        "--nanochat", type=Path, help="a checkout of nanochat's repository, to race its model and optimizer"
    )
    ap.add_argument(
        "--tinystories",
        help="TinyStories text (a folder with its train and valid .txt files, or a training file) to race on",
    )
    ap.add_argument("--tinystories-mb", type=float, default=500, help="megabytes of TinyStories training text read")
    args = ap.parse_args()
    stages = set(args.stages.split(","))
    if stages - set(STAGES):
        ap.error(f"--stages: unknown {', '.join(sorted(stages - set(STAGES)))}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here (for a dry run: --device cpu --tiny)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="ferrolm-gpu-check-"))
    out = Path(args.out) if args.out else (work / "gpu.md" if args.tiny else HERE / "results" / "gpu.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    t_start = time.perf_counter()
    shape = dict(TINY) if args.tiny else {k: v for k, v in bench_model.SHAPES["tinystories"].items() if k != "batch"}

    env = environment(device, args.tiny)
    print(json.dumps(env), flush=True)
    peak = env.get("datasheet_tflops") or env["measured_tflops"]
    report = [
        "# ferrolm on one GPU: checks, speed, a short training run and a learning race",
        "",
        f"Written by `python benches/gpu_check.py{' --device ' + args.device if args.device != 'cuda' else ''}"
        f"{' --tiny' if args.tiny else ''}` on {time.strftime('%Y-%m-%d %H:%M')}: ferrolm {env['ferrolm']}, "
        f"torch {env['torch']}, Python {env['python']}, {env['gpu']}.",
        "",
        f"Measured dense matmul rate: **{env['measured_tflops']:.0f} TFLOP/s**"
        + (f" (data sheet: {env['datasheet_tflops']:.0f})" if env.get("datasheet_tflops") else "")
        + f"; the MFU columns below divide by {peak:.0f} TFLOP/s"
        + (" (the data sheet's figure, as the training log does)." if env.get("datasheet_tflops") else "."),
        "",
    ]
    shards: dict = {}

    def data() -> list[str]:
        shards.update(prepare_shards(work / "data", args.tiny))
        return [f"{shards['text_mb']:.1f} MB of text, {shards['train_tokens']:,} training tokens."]

    lines, all_ok = stage("Data: local text, tokenizer, shards", data)
    report += lines

    if "checks" in stages:
        print("== Checks", flush=True)
        checks = [run_check("logits, device vs CPU", check_logits, device, shape)]
        checks.append(run_check("generate with the KV cache", check_generate, device, shape))
        if shards:
            checks.append(run_check("resume on the device", check_resume, device, shards, work / "resume"))
        report += ["## Checks", "", "| check | result | detail |", "|---|---|---|"]
        report += [f"| {name} | {'ok' if ok else '**FAILED**'} | {detail} |" for name, ok, detail in checks]
        report.append("")
        all_ok &= all(ok for _, ok, _ in checks)

    if "speed" in stages:
        lines, ok = stage("Speed: the tinystories shape, side by side", speed, device, args.tiny, peak)
        report += lines
        all_ok &= ok
    if shards and "training" in stages:
        lines, ok = stage("Training: the tinystories preset", training_run, device, shards, work, args.tiny, out.parent)
        report += lines
        all_ok &= ok
    if (shards or args.tinystories) and "race" in stages:
        title = "Learning race: the tinystories shape, equal wall-clock"
        lines, ok = stage(title, learning_race, device, shards, work, args, out.parent)
        report += lines
        all_ok &= ok
    report.append(
        f"Total: {time.perf_counter() - t_start:.0f} s; {'every stage passed' if all_ok else 'SOME STAGES FAILED'}."
    )
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(report) + "\n")
    tmp.replace(out)
    print(f"wrote {out}", flush=True)
    for bulky in ("data", "race-data"):  # the shards; the runs' logs stay for a look
        shutil.rmtree(work / bulky, ignore_errors=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
