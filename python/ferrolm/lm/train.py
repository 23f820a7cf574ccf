"""The training loop: shards in, checkpoints and a metrics log out.

    from ferrolm.lm.train import load_config, train
    cfg = load_config("cpu-small", ["data.train=data/train", "data.val=data/val"])
    summary = train(cfg)                   # or: train(cfg, resume="runs/cpu-small")

One optimizer step:
    lr = warmup + cosine or wsd(step)      (or of the elapsed fraction of max_time_s)
    repeat accum times:                    gradient accumulation up to tokens_per_step
        x, y = batches.next()              rows per data.batching (uniform random windows, or
                                           rows that start at documents, packed best-fit;
                                           conversations packed best-fit, the targets
                                           outside the assistant's replies ignored),
                                           seeded per process, one batch ahead on a
                                           background thread; fewer rows in the first
                                           steps with schedule.batch_ramp_steps
        loss = model_loss(model, x, y)     model(x, targets=y): the LM head fused with the
                                           cross-entropy (compiled as one graph with
                                           run.compile), bf16 autocast when enabled
        (loss / accum).backward()          DDP all-reduces gradients on the last micro-batch
                                           (FSDP2 with run.parallel = "fsdp" reduce-scatters);
                                           conversations weigh each micro-batch by its share
                                           of the step's assistant tokens instead of 1 / accum
    norm = clip_grad_norm(...)             stop here, before the update, if loss/norm is NaN
                                           or the gradient was 0 three checks running (dead)
    optimizer.step()                       torch's fused AdamW kernel, or Muon + AdamW groups
                                           (on a GPU the NaN check runs when due: `_flags_due`)

A run with ``run.init_from`` starts from those weights (a ferrolm run or checkpoint, a
Hugging Face folder) instead of a random init: a fresh optimizer and schedule from step 0,
the source's model shape, and its tokenizer written to the run folder's ``tokenizer/``
(unless data.tokenizer names it) so the run's checkpoints find it; ``--resume`` continues
from the run's own checkpoints and never reads the source again.

A run directory holds ``config.toml`` (the resolved config), ``metrics.jsonl`` (one JSON
record per log step), ``checkpoints/step_XXXXXXXX.pt`` (the last ``keep_last``) and
``best.pt`` (lowest validation loss). Checkpoints carry everything needed to continue
exactly: model, optimizer, step, config, RNG states, each process's loader state, the
elapsed time and the tokenizer fingerprint. SIGINT/SIGTERM finish the current step (on a
GPU: the next step that reads the flags), save, and return. Under ``torchrun`` each process trains on its own sampler stream; rank 0 logs
and saves.

The file reads top to bottom: `train` and its loop `_train`, then the setup it calls
(`setup_run`: device, resume, data, model, optimizer), then what one step does, then
evaluation, logging and saving. What changes from step to step is one `RunState`; what is
built once is one `Run`.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from ferrolm import __version__
from ferrolm._util import ForgivingStream, atomic_write_bytes, say_where_possible, stale_temporaries
from ferrolm.bpe.tokenizer import Tokenizer
from ferrolm.lm import functional, gemm
from ferrolm.lm.chat import add_chat_tokens
from ferrolm.lm.checkpoint import (
    BEST_FILE,
    CHECKPOINT_DIR,
    CheckpointError,
    InitialWeights,
    apply_checkpoint,
    get_rng_state,
    initial_weights,
    latest_checkpoint,
    read_checkpoint,
    save_checkpoint,
    set_rng_state,
    step_checkpoints,
    unwrap_model,
)
from ferrolm.lm.config import (  # noqa: F401  (re-exported: the config is part of this module's API)
    CONFIG_NAME,
    ConfigError,
    DataSection,
    ModelConfig,
    ModelSection,
    OptimizerSection,
    RunSection,
    ScheduleSection,
    TrainConfig,
    adopt_model,
    apply_overrides,
    load_config,
    preset_names,
    to_toml,
)
from ferrolm.lm.conversations import ConversationData, is_conversation_source, read_conversations
from ferrolm.lm.data import (
    BatchPrefetcher,
    ConversationRows,
    DocumentRows,
    RandomWindows,
    ShardError,
    TokenShards,
    masked_targets,
    packed_rows,
    sample_starts,
)
from ferrolm.lm.device import resolve_device, reuse_freed_memory, use_bf16, use_compile
from ferrolm.lm.evaluate import token_byte_lengths
from ferrolm.lm.memory import check_training_memory
from ferrolm.lm.metrics import MetricsLog, read_metrics
from ferrolm.lm.model import TransformerLM, flops_per_token
from ferrolm.lm.optim import (
    AdamW,
    Muon,
    clip_grad_norm,
    coalesce_grads,
    cosine_lr,
    muon_momentum_at,
    muon_param_groups,
    param_groups_for_decay,
    wsd_lr,
)
from ferrolm.lm.sharding import full_state_dicts, load_full_state_dicts, shard_model

__all__ = [
    "TrainConfig",
    "ModelSection",
    "DataSection",
    "OptimizerSection",
    "ScheduleSection",
    "RunSection",
    "ConfigError",
    "load_config",
    "train",
    "TrainSummary",
    "read_metrics",
    "latest_checkpoint",
    "PEAK_FLOPS_BF16",
    "build_model",
    "Dist",
    "sampler_seed",
    "validation_starts",
    "val_bytes_per_token",
]


# Dense bf16 peak FLOP/s by GPU name (substring match, first hit wins); MFU is logged only
# for these, and only with bf16 autocast on.
PEAK_FLOPS_BF16 = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
]


@dataclass
class TrainSummary:
    status: str  # "done", "time" (max_time_s reached), "interrupted", "nan", "dead" (no gradient left)
    step: int
    run_dir: Path
    last_checkpoint: Optional[Path]
    best_val_loss: Optional[float]
    final_val_loss: Optional[float]
    message: str = ""
    records: list = field(default_factory=list)  # the JSONL records this call wrote (rank 0)


@dataclass
class RunState:
    """What changes from step to step; a checkpoint carries all of it."""

    step: int = 0
    time_s: float = 0.0  # the training clock: the sum of step times, over resumes
    wall_s: float = 0.0  # wall time since the run began, over resumes
    best_val: Optional[float] = None
    final_val: Optional[float] = None  # the last validation loss of this call
    last_ckpt: Optional[Path] = None
    # The running train-loss sum since the last log record (a float64 tensor on the device),
    # its count, and where that record was: resumed logs match uninterrupted ones.
    loss_sum: Any = None
    loss_count: int = 0
    last_log_step: int = 0
    last_log_time: float = 0.0
    # Consecutive checked steps whose gradient was exactly zero, and the first of them.
    zero_grad_steps: int = 0
    zero_grad_since: int = 0


@dataclass
class Dist:
    """This process's place in a run: rank, local rank and world size (``Dist()``: a run of
    one process); ``setup_distributed`` joins torchrun's group and says which."""

    rank: int = 0
    local_rank: int = 0
    world: int = 1
    initialized_here: bool = False

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class Run:
    """What a training run is built from, once, before the first step."""

    cfg: TrainConfig
    dist: Dist
    device: torch.device
    bf16: bool
    run_dir: Path
    model: torch.nn.Module  # what the step runs: DDP-wrapped under torchrun
    eval_model: torch.nn.Module  # the same without DDP hooks
    loss: Callable  # loss(model, x, y, bf16): model and loss, compiled as one graph when run.compile
    raw_model: torch.nn.Module  # the plain module checkpoints save
    optimizer: torch.optim.Optimizer
    params: list
    train_data: TokenShards | ConversationData
    val_data: TokenShards | ConversationData
    val_starts: Optional[torch.Tensor]  # fixed validation windows, this process's slice (shards)
    sampler: torch.Generator  # this process's batch stream
    batches: BatchPrefetcher  # draws from the sampler, one batch ahead, off the step's thread
    accum: int  # micro-batches per optimizer step
    tokens_per_step: int
    flops_per_tok: Optional[float]
    peak: Optional[float]
    loggers: MetricsLog
    bar: Any  # tqdm bar on rank 0 when run.progress, else None
    # stderr and stdout that never raise: a reader gone (a closed pipe) must not cost a checkpoint
    err: ForgivingStream
    out: ForgivingStream
    val_bytes_per_token: Optional[float] = None  # for bits per byte; None without a tokenizer folder
    # conversations: this process's fixed validation rows (ids, loss mask), and the data's
    # counts (conversations kept, malformed, cropped) for the first record this call writes
    val_rows: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    data_report: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------


def train(
    cfg: TrainConfig,
    *,
    resume: str | os.PathLike | None = None,
    on_step: Callable[[int, Optional[dict]], None] | None = None,
) -> TrainSummary:
    """Train per `cfg`; with `resume` (a run directory or checkpoint) continue that run exactly.

    `on_step(step, record)` is called after every optimizer step (record is the JSONL record
    on log steps, else None), on every process. Returns a TrainSummary.
    """
    cfg.validate()
    dist_ = setup_distributed(cfg.run.device)
    try:
        return _train(cfg, dist_, resume, on_step)
    finally:
        if dist_.initialized_here:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, dist_: Dist, resume, on_step) -> TrainSummary:
    run, state = setup_run(cfg, dist_, resume)
    sched = cfg.schedule
    records: list[dict] = []
    status, message = "done", ""
    wall_start, wall_base = time.perf_counter(), state.wall_s
    with _StopFlag() as stop:
        try:
            if state.step == 0 and cfg.run.eval_at_start:
                records.append(log_start(run, state))
            time_sync = state.time_s  # the training clock every process agrees on (the slowest one's)
            while state.step < sched.max_steps:
                t0 = time.perf_counter()
                lr = lr_at(cfg, state.step, time_sync)
                set_hyperparameters(run.optimizer, cfg.optimizer, state.step, lr)
                step_loss = forward_backward(run)
                grad_norm = _clip(run.params, cfg.optimizer.grad_clip)
                bad, stop_req, time_sync, zero = agree(run, state, step_loss, grad_norm, stop, t0)
                if zero is not None:
                    count_zero_gradient(state, zero)
                if bad or state.zero_grad_steps >= DEAD_STEPS:
                    run.optimizer.zero_grad(set_to_none=True)
                    status = "nan" if bad else "dead"
                    message = nan_message(run, state, step_loss) if bad else dead_message(run, state, step_loss)
                    say(run, message)
                    break
                run.optimizer.step()
                run.optimizer.zero_grad(set_to_none=True)
                state.step += 1
                state.time_s += time.perf_counter() - t0
                state.wall_s = wall_base + (time.perf_counter() - wall_start)
                state.loss_sum += step_loss
                state.loss_count += 1

                out_of_time = sched.max_time_s > 0 and time_sync >= sched.max_time_s
                last = state.step >= sched.max_steps or out_of_time or bool(stop_req)
                rec = log_step(run, state, lr, grad_norm, last=last, stopping=bool(stop_req))
                if rec is not None:
                    records.append(rec)
                advance_bar(run, time_sync)
                if last or (cfg.run.checkpoint_every and state.step % cfg.run.checkpoint_every == 0):
                    save(run, state, final=last)
                if on_step is not None:
                    on_step(state.step, rec)
                if stop_req or out_of_time:
                    status, message = stop_reason(run, state, bool(stop_req), stop.signum)
                    say(run, message)
                    break
        finally:
            run.batches.close()
            if run.bar is not None:
                run.bar.close()
            run.loggers.close()
    return TrainSummary(
        status=status,
        step=state.step,
        run_dir=run.run_dir,
        last_checkpoint=state.last_ckpt,
        best_val_loss=state.best_val,
        final_val_loss=state.final_val,
        message=message,
        records=records,
    )


# ---------------------------------------------------------------------------------------
# Setup: device, resume, data, model, optimizer
# ---------------------------------------------------------------------------------------


def setup_run(cfg: TrainConfig, dist_: Dist, resume) -> tuple[Run, RunState]:
    """Everything before the first step, in an order that keeps resumed runs bit-exact."""
    main = dist_.is_main
    ckpt, ckpt_path = find_checkpoint(resume, cfg, main)
    device, bf16 = setup_device(cfg, dist_.local_rank, resumed_matmul=ckpt.get("cpu_matmul") if ckpt else None)
    run_dir = choose_run_dir(cfg, resume, have_checkpoint=ckpt is not None, main=main)

    check_init(cfg)
    init = start_weights(cfg) if ckpt is None else None
    torch.manual_seed(cfg.run.seed)
    chat_tok = (init.tokenizer if init else chat_tokenizer(cfg)) if uses_conversations(cfg) else None
    train_data, val_data = _open_conversations(cfg, chat_tok, main) if chat_tok else _open_data(cfg)
    if init is not None:
        record_tokenizer(cfg, init.tokenizer, () if chat_tok else (train_data, val_data), run_dir, dist_)
    shards = dist_.world if _sharded(cfg, dist_) else 1
    check_training_memory(cfg.model, cfg.schedule.batch_size, device, shards)
    model = build_model(cfg.model)
    if init is not None:
        apply_checkpoint({"model": init.state_dict, "iteration": 0}, model, name=cfg.run.init_from)
        del init
    model = model.to(device)
    if dist_.enabled and cfg.optimizer.sparse_bigram and cfg.model.bigram_buckets:
        raise ValueError(
            "optimizer.sparse_bigram runs in one process (DDP and FSDP reduce dense gradients); "
            "under torchrun set optimizer.sparse_bigram=false"
        )
    if _sharded(cfg, dist_):
        shard_model(model, device)  # in place, before the optimizer sees the parameters
    optimizer = build_optimizer(model, cfg.optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    accum, tokens_per_step = micro_batches(cfg, dist_)
    sampler = torch.Generator()
    sampler.manual_seed(sampler_seed(cfg.run.seed, dist_.rank))
    state, loader_state = RunState(), None
    if ckpt is not None:
        state, loader_state = resume_state(ckpt, ckpt_path, cfg, dist_, model, optimizer, train_data)
        del ckpt  # free the loaded tensors
        if loader_state is None:
            sampler.manual_seed(sampler_seed(cfg.run.seed + state.step, dist_.rank))
    rows = make_rows(cfg, train_data, sampler)
    if loader_state is not None:
        rows.set_state(loader_state)
    state.loss_sum = torch.tensor(float(state.loss_sum or 0.0), dtype=torch.float64, device=device)

    flops_per_tok = training_flops_per_token(model)
    peak = peak_flops(device, bf16)
    step_model, eval_model, loss = wrap_model(model, cfg, dist_, device)
    plan = (lambda index: batch_rows(cfg.schedule, index // accum)) if cfg.schedule.batch_ramp_steps else None
    batches = BatchPrefetcher(
        train_data,
        cfg.schedule.batch_size,
        cfg.model.context_length,
        device,
        rows=rows,
        plan=plan,
        first=state.step * accum,
    )
    val_starts = None if chat_tok else validation_starts(cfg, val_data, dist_)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(run_dir)
        if chat_tok is not None and not cfg.run.init_from:  # a run from weights recorded its tokenizer above
            keep_chat_tokenizer(cfg, chat_tok, run_dir)
        atomic_write_bytes(run_dir / CONFIG_NAME, to_toml(cfg).encode("utf-8"))
    loggers = MetricsLog(run_dir, cfg, main, state.step if resume is not None else None)
    state.last_ckpt = latest_checkpoint(run_dir) if resume is not None else None
    err, out = ForgivingStream(sys.stderr), ForgivingStream(sys.stdout)
    bar = progress_bar(cfg, state, err) if main and cfg.run.progress else None
    run = Run(
        cfg=cfg,
        dist=dist_,
        device=device,
        bf16=bf16,
        run_dir=run_dir,
        model=step_model,
        eval_model=eval_model,
        loss=loss,
        raw_model=unwrap_model(step_model),
        optimizer=optimizer,
        params=params,
        train_data=train_data,
        val_data=val_data,
        val_starts=val_starts,
        sampler=sampler,
        batches=batches,
        accum=accum,
        tokens_per_step=tokens_per_step,
        flops_per_tok=flops_per_tok,
        peak=peak,
        loggers=loggers,
        bar=bar,
        err=err,
        out=out,
        val_bytes_per_token=None if chat_tok else val_bytes_per_token(cfg, val_data, val_starts, device, dist_),
    )
    if chat_tok is not None:
        run.val_rows = validation_rows(cfg, val_data, dist_)
        run.data_report = {**train_data.report("train"), **val_data.report("val")}
    return run, state


def val_bytes_per_token(cfg: TrainConfig, val_data: TokenShards, starts, device, dist_: Dist) -> Optional[float]:
    """UTF-8 bytes per predicted token of the validation windows (all processes), when
    data.tokenizer names a folder: bits per byte = val loss / ln 2 / this."""
    if not cfg.data.tokenizer or not Path(cfg.data.tokenizer).is_dir():
        return None
    lengths = token_byte_lengths(Tokenizer.load(cfg.data.tokenizer), cfg.model.vocab_size)
    _, y = val_data.windows_at(starts, cfg.model.context_length, "cpu")
    total = torch.tensor([float(lengths[y].sum()), float(y.numel())], dtype=torch.float64, device=device)
    if dist_.enabled:
        dist.all_reduce(total)
    return float(total[0] / total[1]) if total[0] > 0 else None


def setup_distributed(device_name: str) -> Dist:
    """Join the process group torchrun describes in the environment (a no-op alone)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    initialized_here = False
    if not dist.is_initialized():
        use_cuda = torch.cuda.is_available() and device_name in ("auto",) or device_name.startswith("cuda")
        backend = "nccl" if use_cuda else "gloo"
        if use_cuda:
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dist.init_process_group(backend=backend)
        initialized_here = True
    return Dist(
        rank=dist.get_rank(), local_rank=local_rank, world=dist.get_world_size(), initialized_here=initialized_here
    )


def setup_device(cfg: TrainConfig, local_rank: int, resumed_matmul: Optional[str] = None) -> tuple[torch.device, bool]:
    """This process's device, with threads and TF32 set; and whether bf16 autocast is on.
    A resumed run keeps the float32 CPU kernel its checkpoint records when run.cpu_matmul is
    "auto" (``gemm.choose``), so that it continues the straight run exactly."""
    if cfg.run.num_threads > 0:
        torch.set_num_threads(cfg.run.num_threads)
    try:
        device = resolve_device(cfg.run.device, local_rank)
    except ValueError as e:
        raise ConfigError(f"run.device: {e}") from None
    if device.type == "cpu":
        reuse_freed_memory()  # no page faults in the step (see ferrolm.lm.device)
        try:
            # torch's BLAS or oneDNN, by a measurement or the checkpoint's record (ferrolm.lm.gemm)
            gemm.choose(cfg.run.cpu_matmul, recorded=resumed_matmul)
        except ValueError as e:
            raise ConfigError(f"run.cpu_matmul: {e}") from None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if cfg.run.tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
    return device, use_bf16(cfg.run.autocast_bf16, device)


def find_checkpoint(resume, cfg: TrainConfig, main: bool) -> tuple[Optional[dict], Optional[Path]]:
    """The checkpoint to resume from (a file, or a run directory's newest readable one) and its path."""
    if resume is None:
        return None, None
    path = Path(resume)
    ckpt = read_checkpoint(path) if not path.is_dir() else None
    if path.is_dir():
        candidates = [p for _, p in reversed(step_checkpoints(path))]
        if not candidates:
            raise FileNotFoundError(f"--resume {path}: no checkpoints in {path / CHECKPOINT_DIR}")
        for i, path in enumerate(candidates):
            try:
                ckpt = read_checkpoint(path)
                break
            except CheckpointError as e:
                if i == len(candidates) - 1:
                    raise
                if main:
                    warnings.warn(f"{e}; trying the previous checkpoint", stacklevel=5)
    if cfg.run.init_from:
        resumed_from_weights(cfg, ckpt, path)
    saved_model = (ckpt.get("config") or {}).get("model")
    now = cfg.to_dict()["model"]
    if saved_model:  # fields a checkpoint predates are its defaults (switches off)
        saved_model = ModelConfig.from_dict(saved_model).to_dict()
    if saved_model and saved_model != now:
        diff = {k: (saved_model.get(k), v) for k, v in now.items() if saved_model.get(k) != v}
        raise CheckpointError(f"{path} was saved with a different model config (checkpoint vs now: {diff})")
    saved_optimizer = ((ckpt.get("config") or {}).get("optimizer") or {}).get("name", "adamw")
    if saved_optimizer != cfg.optimizer.name:
        raise CheckpointError(
            f"{path} was trained with optimizer.name = {saved_optimizer!r}, not {cfg.optimizer.name!r}: "
            f"resume with --set optimizer.name={saved_optimizer}"
        )
    return ckpt, path


def choose_run_dir(cfg: TrainConfig, resume, *, have_checkpoint: bool, main: bool) -> Path:
    """run.out_dir, or the directory being resumed; a fresh run never lands on an old one."""
    run_dir = Path(cfg.run.out_dir)
    if resume is not None and Path(resume).is_dir() and Path(resume).resolve() != run_dir.resolve():
        run_dir = Path(resume)
        cfg.run.out_dir = str(resume)
    if not have_checkpoint and main and step_checkpoints(run_dir):
        raise FileExistsError(
            f"run.out_dir {run_dir} already holds a run; continue it with --resume {run_dir} or choose another run.out_dir"
        )
    return run_dir


INIT_TOKENIZER_DIR = "tokenizer"  # where a run started from weights keeps their tokenizer


def start_weights(cfg: TrainConfig) -> Optional[InitialWeights]:
    """The weights ``run.init_from`` names (None when unset), with ``cfg.model`` made their
    model (``adopt_model``: a contradicting [model] value is an error naming both)."""
    source = cfg.run.init_from
    if not source:
        return None
    try:
        init = initial_weights(source, chat_tokens=uses_conversations(cfg))  # conversations need the chat tokens
    except FileNotFoundError as e:
        raise FileNotFoundError(f"run.init_from {source}: {e}") from None
    except CheckpointError as e:
        raise CheckpointError(f"run.init_from {source}: {e}") from None
    adopt_model(cfg, init.config, source)
    cfg.validate()
    return init


def resumed_from_weights(cfg: TrainConfig, ckpt: dict, path: Path) -> None:
    """A run started from weights, resumed with the config it started from: its model is the
    one its checkpoint saved (not the source's, which is never read again) and, unless the
    config gives one, its tokenizer the one the run recorded."""
    saved = ckpt.get("config") or {}
    if isinstance(saved.get("model"), dict):
        adopt_model(cfg, ModelConfig.from_dict(saved["model"]), os.fspath(path))
    if not cfg.data.tokenizer and isinstance(saved.get("data"), dict):
        cfg.data.tokenizer = str(saved["data"].get("tokenizer") or "")


def record_tokenizer(cfg: TrainConfig, tok: Tokenizer, shards, run_dir: Path, dist_: Dist) -> None:
    """Check the shards against the tokenizer of the starting weights (ShardError naming
    them), then make data.tokenizer a folder holding it: the one the config gave when it is
    that tokenizer, else the run folder's tokenizer/, written by the main process."""
    for d in shards:
        d.check_tokenizer(tok)
    given = cfg.data.tokenizer
    if given and Path(given).is_dir():
        if Tokenizer.load(given).fingerprint != tok.fingerprint:
            raise ConfigError(
                f"data.tokenizer {given} is another tokenizer than that of run.init_from {cfg.run.init_from}: "
                "the run trains the weights with their own tokenizer (leave data.tokenizer unset or give that one)"
            )
        return
    where = run_dir / INIT_TOKENIZER_DIR
    if dist_.is_main:
        tok.save(where, model_max_length=cfg.model.context_length)
    _barrier(dist_)
    cfg.data.tokenizer = os.fspath(where)


def _open_data(cfg: TrainConfig) -> tuple[TokenShards, TokenShards]:
    """The train and val shards, checked against each other and the model; an unset
    model.vocab_size becomes the shards' (or the data.tokenizer's, for raw token files)."""
    cfg.require_data()
    tok = cfg.data.tokenizer or None
    dtype = cfg.data.dtype or None
    train_data = TokenShards(cfg.data.train, tokenizer=tok, dtype=dtype)
    val_data = TokenShards(cfg.data.val, tokenizer=tok, dtype=dtype)
    if not cfg.model.vocab_size:
        cfg.model.vocab_size = _data_vocab_size(train_data, val_data, tok)
    model_vocab = cfg.model.vocab_size
    if cfg.model.doc_mask:
        _eos_id(train_data, "model.doc_mask")
    if train_data.fingerprint != val_data.fingerprint:
        raise ShardError(
            f"train and val shards come from different tokenizers ({train_data.fingerprint[:16]}... vs {val_data.fingerprint[:16]}...)"
        )
    for name, d in (("train", train_data), ("val", val_data)):
        if d.vocab_size is None:
            d.vocab_size = model_vocab  # a raw token file: its ids are checked against the model's
        if d.vocab_size > model_vocab:
            raise ConfigError(
                f"data.{name} was encoded with a {d.vocab_size}-token vocabulary but model.vocab_size is {model_vocab}; "
                f"set --set model.vocab_size={d.vocab_size}"
            )
        if len(d) < cfg.model.context_length + 1:
            raise ShardError(
                f"data.{name} has {len(d)} tokens, fewer than one window of context_length + 1 = {cfg.model.context_length + 1}"
            )
    return train_data, val_data


def uses_conversations(cfg: TrainConfig) -> bool:
    """Whether the run trains on conversations (data.format, or by data.train's file names)."""
    if cfg.data.format == "auto":
        return bool(cfg.data.train) and is_conversation_source(cfg.data.train)
    return cfg.data.format == "conversations"


def check_init(cfg: TrainConfig) -> None:
    """A fine-tuning config (run.needs_init, as the sft preset sets) refuses to start without
    the weights it fine-tunes: it has no model shape of its own."""
    if cfg.run.needs_init and not cfg.run.init_from:
        raise ConfigError(
            "this config fine-tunes an existing model (run.needs_init, as in the sft preset) and has no model "
            "shape of its own: pass --init-from RUN (a run folder, checkpoint or Hugging Face model folder)"
        )


def chat_tokenizer(cfg: TrainConfig) -> Tokenizer:
    """data.tokenizer's tokenizer with the chat tokens (appended after its vocabulary when it
    lacks them): what conversations are rendered with."""
    name = cfg.data.tokenizer
    if not name or not Path(name).is_dir():
        raise ConfigError(
            f"conversation data (data.train = {cfg.data.train!r}) is rendered with a tokenizer: set "
            "data.tokenizer=DIR (a tokenizer folder), or --init-from a model, whose tokenizer is used"
        )
    try:
        return add_chat_tokens(Tokenizer.load(name))
    except ValueError as e:
        raise ConfigError(f"data.tokenizer {name}: {e}") from None


def keep_chat_tokenizer(cfg: TrainConfig, tokenizer: Tokenizer, run_dir: Path) -> None:
    """When the chat tokens were added, the extended tokenizer is the run's: saved in the
    run folder, and data.tokenizer names it (the checkpoints and a resume use it)."""
    name = cfg.data.tokenizer
    if name and Path(name).is_dir() and Tokenizer.load(name).fingerprint == tokenizer.fingerprint:
        return
    where = run_dir / INIT_TOKENIZER_DIR
    tokenizer.save(where, model_max_length=cfg.model.context_length)
    cfg.data.tokenizer = os.fspath(where)


def _open_conversations(
    cfg: TrainConfig, tokenizer: Tokenizer, main: bool
) -> tuple[ConversationData, ConversationData]:
    """The train and val conversations rendered with ``tokenizer``; an unset model.vocab_size
    becomes the tokenizer's. Their counts and any malformed rows are reported on stderr."""
    cfg.require_data()
    if not cfg.model.vocab_size:
        cfg.model.vocab_size = tokenizer.vocab_size
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size {cfg.model.vocab_size} is smaller than the {tokenizer.vocab_size} tokens of the "
            "tokenizer with the chat tokens"
        )
    row_len = cfg.model.context_length + 1
    out = []
    for name in ("train", "val"):
        data = read_conversations(
            getattr(cfg.data, name),
            tokenizer,
            row_len=row_len,
            max_bad_share=cfg.data.max_bad_share,
            name=f"data.{name}",
        )
        if main:
            print(data.summary(f"data.{name}"), file=sys.stderr)
        out.append(data)
    return out[0], out[1]


def _data_vocab_size(train: TokenShards, val: TokenShards, tokenizer) -> int:
    sizes = [d.vocab_size for d in (train, val) if d.vocab_size is not None]
    if sizes:
        return max(sizes)
    if tokenizer and not re.fullmatch(r"[0-9a-f]{64}", tokenizer):
        from ferrolm.bpe.tokenizer import Tokenizer

        return Tokenizer.load(tokenizer).vocab_size
    raise ConfigError(
        "model.vocab_size is not set and the shards have no sidecar to take it from; "
        "set --set model.vocab_size=N (50304 for GPT-2 token files) or data.tokenizer=DIR"
    )


def build_model(cfg: ModelConfig) -> torch.nn.Module:
    return TransformerLM.from_config(cfg)


def build_optimizer(model: torch.nn.Module, cfg: OptimizerSection) -> torch.optim.Optimizer:
    """AdamW with decay groups, or (optimizer.name = "muon") Muon with its AdamW groups;
    optimizer.sparse_bigram makes the bigram table's gradient sparse (both defer its unread rows' steps)."""
    if cfg.sparse_bigram and getattr(model, "bigram_embeddings", None) is not None:
        model.bigram_embeddings.sparse_grad = True
    if cfg.name != "muon":
        groups = param_groups_for_decay(model, cfg.weight_decay)
        return AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    width = 1.0
    if cfg.width_lr_scale:  # the AdamW lrs are set for width 768 (as the anchors'): scale by its ratio
        width = (768 / model.config.d_model) ** 0.5
    groups = muon_param_groups(
        model,
        lr=cfg.lr,
        embedding_lr=cfg.embedding_lr * width,
        head_lr=cfg.head_lr * width,
        scalar_lr=cfg.scalar_lr * width,
        weight_decay=cfg.muon_weight_decay,
        head_weight_decay=cfg.weight_decay,
        bigram_lr=cfg.bigram_lr * width if cfg.bigram_lr else None,
    )
    return Muon(
        groups,
        lr=cfg.lr,
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_ns_steps,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        orthogonalizer=cfg.muon_orthogonalizer,
        normuon=cfg.normuon,
        normuon_beta2=cfg.normuon_beta2,
        cautious_weight_decay=cfg.cautious_weight_decay,
    )


def set_hyperparameters(optimizer: torch.optim.Optimizer, cfg: OptimizerSection, step: int, lr: float) -> None:
    """Step `step`'s learning rates (`lr` times each group's `lr_scale`, 1 unless set) and
    Muon's momentum (its warm-up)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
        if group.get("kind") == "muon":
            group["momentum"] = muon_momentum_at(
                step, cfg.muon_momentum, cfg.muon_momentum_start, cfg.muon_momentum_warmup_steps
            )


def micro_batches(cfg: TrainConfig, dist_: Dist) -> tuple[int, int]:
    """(micro-batches per optimizer step, tokens per optimizer step over all processes)."""
    micro_tokens = cfg.schedule.batch_size * cfg.model.context_length * dist_.world
    accum = 1
    if cfg.schedule.tokens_per_step:
        accum = max(1, round(cfg.schedule.tokens_per_step / micro_tokens))
        if accum * micro_tokens != cfg.schedule.tokens_per_step and dist_.is_main:
            warnings.warn(
                f"schedule.tokens_per_step {cfg.schedule.tokens_per_step} is not a multiple of batch_size x context x processes "
                f"= {micro_tokens}; using {accum} micro-batches = {accum * micro_tokens} tokens per step",
                stacklevel=5,
            )
    return accum, accum * micro_tokens


def sampler_seed(seed: int, rank: int) -> int:
    """The seed of process ``rank``'s batch stream in a run seeded ``seed``: one stream per rank."""
    return (seed * 1_000_003 + 7919 * (rank + 1)) % (2**63)


def make_rows(
    cfg: TrainConfig, train_data, sampler: torch.Generator
) -> RandomWindows | DocumentRows | ConversationRows:
    """This process's row source per data.batching (conversations: packed), drawing from ``sampler``."""
    B, T = cfg.schedule.batch_size, cfg.model.context_length
    if isinstance(train_data, ConversationData):
        return ConversationRows(train_data, B, T, sampler, cfg.data.doc_buffer)
    if cfg.data.batching == "random":
        return RandomWindows(train_data, B, T, sampler)
    return DocumentRows(
        train_data, _eos_id(train_data, "data.batching = 'documents'"), B, T, sampler, cfg.data.doc_buffer
    )


def _eos_id(data: TokenShards, what: str) -> int:
    if data.eos_id is None:
        raise ConfigError(f"{what} needs shards that record their end-of-text id (a sidecar's eos_id); these have none")
    return data.eos_id


def resume_state(ckpt: dict, ckpt_path: Path, cfg: TrainConfig, dist_: Dist, model, optimizer, train_data):
    """Load `ckpt` into the model, optimizer and RNGs; return the run state it saved and this
    process's saved loader state (None when the batches cannot be replayed: reseeded)."""
    if ckpt.get("tokenizer_fingerprint") not in (None, train_data.fingerprint):
        raise CheckpointError(
            f"{ckpt_path} was trained on shards of another tokenizer than data.train {train_data.paths[0]}"
        )
    if _sharded(cfg, dist_):
        load_full_state_dicts(model, optimizer, ckpt["model"], ckpt["optimizer"])
        step = int(ckpt["iteration"])
    else:
        step = apply_checkpoint(ckpt, model, optimizer, name=str(ckpt_path))
    time_s = float(ckpt.get("time_s", 0.0))
    log_state = ckpt.get("log_state") or {}
    if "rng" in ckpt:
        set_rng_state(ckpt["rng"])
    states = ckpt.get("sampler_states") or []
    saved_batching, batching = ckpt.get("batching", "random"), batching_of(cfg)
    head = {"documents": 4, "conversations": 5}.get(batching)
    loader_state = None
    if saved_batching != batching:
        why = f"checkpoint was trained with data.batching = {saved_batching!r}, now {batching!r}"
    elif head and states and len(states[0]) != head + 3 * cfg.data.doc_buffer:
        why = "checkpoint was trained with another data.doc_buffer"
    elif len(states) != dist_.world:
        why = f"checkpoint has sampler states for {len(states)} process(es), now {dist_.world}"
    else:
        why, loader_state = "", states[dist_.rank]
    if why and dist_.is_main:
        warnings.warn(f"{why}: batches are reseeded, not replayed", stacklevel=5)
    if dist_.is_main:
        print(f"resuming from {ckpt_path} at step {step}", file=sys.stderr)
    return RunState(
        step=step,
        time_s=time_s,
        wall_s=float(ckpt.get("wall_s", 0.0)),
        best_val=ckpt.get("best_val_loss"),
        loss_sum=float(log_state.get("loss_sum", 0.0)),
        loss_count=int(log_state.get("count", 0)),
        last_log_step=int(log_state.get("last_step", step)),
        last_log_time=float(log_state.get("last_time", time_s)),
    ), loader_state


def batching_of(cfg: TrainConfig) -> str:
    """How rows are drawn, as a checkpoint records it: data.batching, or "conversations"."""
    return "conversations" if uses_conversations(cfg) else cfg.data.batching


def wrap_model(model, cfg: TrainConfig, dist_: Dist, device: torch.device):
    """(the model the step runs: DDP-wrapped under torchrun unless already sharded, the model
    evaluation runs, the step's loss function: model forward and cross-entropy, compiled as
    one graph per run.compile)."""
    loss = model_loss
    if use_compile(cfg.run.compile, device):
        loss = torch.compile(model_loss)
        if cfg.schedule.batch_ramp_steps:
            loss = _compiled_at_full_batch(loss, cfg.schedule.batch_size)
    if not dist_.enabled or _sharded(cfg, dist_):
        return model, model, loss
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return ddp, ddp.module, loss  # evaluation needs no DDP hooks


def _compiled_at_full_batch(compiled: Callable, rows: int) -> Callable:
    """The step's loss with a batch ramp under run.compile: the compiled graph for micro-batches
    of the full ``rows``, eager ``model_loss`` for the ramp's smaller ones. Each ramp size would
    be a new shape to compile (the fused head's chunk loop keeps shapes static), and past
    torch.compile's limit of graphs per function (8) the function stays eager, the full batch
    after the ramp included. The ramp is the run's first steps; the rest compiles once."""

    def loss(model, x, y, bf16, document_ids=None):
        return (compiled if x.shape[0] == rows else model_loss)(model, x, y, bf16, document_ids)

    return loss


def _sharded(cfg: TrainConfig, dist_: Dist) -> bool:
    """FSDP2 (run.parallel = "fsdp") under torchrun; one process never shards."""
    return dist_.enabled and cfg.run.parallel == "fsdp"


def validation_starts(cfg: TrainConfig, val_data: TokenShards, dist_: Dist) -> torch.Tensor:
    """Fixed validation windows, drawn once from their own seed; each process takes a slice."""
    val_gen = torch.Generator()
    val_gen.manual_seed(cfg.run.seed + 999_983)
    starts = sample_starts(
        len(val_data), cfg.run.eval_batches * cfg.schedule.batch_size, cfg.model.context_length, val_gen
    )
    return starts[dist_.rank :: dist_.world]


def validation_rows(cfg: TrainConfig, val_data: ConversationData, dist_: Dist) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed validation rows of conversations (up to eval_batches x batch_size, every
    conversation once, in order); each process takes a slice."""
    ids, mask = packed_rows(val_data, cfg.model.context_length, cfg.run.eval_batches * cfg.schedule.batch_size)
    return torch.from_numpy(ids[dist_.rank :: dist_.world]), torch.from_numpy(mask[dist_.rank :: dist_.world])


def training_flops_per_token(model: torch.nn.Module) -> Optional[float]:
    """Forward + backward FLOPs per token (3 x the forward) when the model exposes its config."""
    cfg = getattr(unwrap_model(model), "config", None)
    return None if cfg is None else 3.0 * flops_per_token(cfg)


def peak_flops(device: torch.device, bf16: bool) -> Optional[float]:
    """Dense bf16 peak FLOP/s of `device` when known (see PEAK_FLOPS_BF16), else None."""
    if device.type != "cuda" or not bf16:
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_FLOPS_BF16:
        if key in name:
            return flops
    return None


# ---------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------


def lr_at(cfg: TrainConfig, step: int, elapsed_s: float) -> float:
    """The learning rate of optimizer step `step` (0-based)."""
    s, o = cfg.schedule, cfg.optimizer
    it: float = step
    if s.schedule_by == "time":
        it = min(elapsed_s / s.max_time_s, 1.0) * s.max_steps
    if s.lr_schedule == "wsd":
        return wsd_lr(it, o.lr, o.min_lr, s.warmup_steps, s.cosine_steps or s.max_steps, s.decay_frac)
    return cosine_lr(it, o.lr, o.min_lr, s.warmup_steps, s.cosine_steps or s.max_steps)


def batch_rows(s: ScheduleSection, step: int) -> int:
    """Rows per micro-batch at optimizer step ``step`` (0-based): batch_size, or during the
    batch ramp batch_size (start + (1 - start) step / batch_ramp_steps) to the nearest row
    (halves up), at least 1."""
    if step >= s.batch_ramp_steps:
        return s.batch_size
    share = s.batch_ramp_start + (1.0 - s.batch_ramp_start) * step / s.batch_ramp_steps
    return max(1, math.floor(s.batch_size * share + 0.5))


def tokens_trained(run: Run, steps: int) -> int:
    """Tokens of the first ``steps`` optimizer steps over all processes, the batch ramp's
    smaller steps counted at their size."""
    s = run.cfg.schedule
    ramp = min(steps, s.batch_ramp_steps)
    per_row = run.tokens_per_step // s.batch_size  # micro-batches x context x processes
    return per_row * sum(batch_rows(s, i) for i in range(ramp)) + (steps - ramp) * run.tokens_per_step


def _autocast(device: torch.device, enabled: bool):
    if enabled and device.type in ("cuda", "cpu"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def model_loss(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool, document_ids: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The training loss of one micro-batch: what run.compile compiles, as one graph.

    The model computes the LM head and the loss together (``targets=``), so the
    (tokens, vocab) logits are never held; the softmax is reduced in float32 under bf16.
    ``document_ids`` (model.doc_mask): attention stays inside each document.
    """
    with _autocast(x.device, bf16):
        if document_ids is None:
            return model(x, targets=y)
        return model(x, targets=y, document_ids=document_ids)


def documents_of(run: Run, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The document ids of each row's positions when model.doc_mask is on, else None."""
    if not run.cfg.model.doc_mask:
        return None
    return functional.document_ids(x, run.train_data.eos_id)


def forward_backward(run: Run) -> torch.Tensor:
    """Accumulate the gradients of `run.accum` micro-batches; return the step's loss (float64).

    Token windows weigh each micro-batch 1 / accum. Conversations weigh each by its share
    of the step's assistant tokens over all processes, so that the step's gradient is that
    of the mean over all of them, not a mean of per-micro-batch means."""
    if not isinstance(run.train_data, ConversationData):
        loss_sum = torch.zeros((), dtype=torch.float32, device=run.device)
        for micro in range(run.accum):
            x, y = run.batches.next()
            loss = _micro_step(run, micro, x, y, None)
            loss_sum += loss.detach().float()
        return loss_sum.double() / run.accum
    batches = [run.batches.next_counted() for _ in range(run.accum)]
    total = _global_count(run, sum(n for *_, n in batches))
    step_loss = torch.zeros((), dtype=torch.float64, device=run.device)
    for micro, (x, y, n) in enumerate(batches):
        share = n * run.dist.world / total if total else 0.0  # DDP averages the processes' gradients
        step_loss += _micro_step(run, micro, x, y, share).detach().double() * share
    return step_loss


def _micro_step(run: Run, micro: int, x: torch.Tensor, y: torch.Tensor, weight: Optional[float]) -> torch.Tensor:
    """One micro-batch's forward and backward of ``weight`` x its loss (None: loss / accum); the loss."""
    last = micro == run.accum - 1
    accumulate = run.dist.enabled and not last and run.cfg.run.parallel == "ddp"
    with run.model.no_sync() if accumulate else contextlib.nullcontext():  # DDP: all-reduce once per step
        loss = run.loss(run.model, x, y, run.bf16, documents_of(run, x))
        (loss / run.accum if weight is None else loss * weight).backward()
    return loss


def _global_count(run: Run, count: int) -> int:
    """``count`` summed over the processes (a collective)."""
    if not run.dist.enabled:
        return count
    t = torch.tensor([float(count)], dtype=torch.float64, device=run.device)
    dist.all_reduce(t)
    return int(t.item())


def _clip(params, max_norm: float) -> torch.Tensor:
    if max_norm > 0:
        return clip_grad_norm(params, max_norm)
    grads = coalesce_grads(params)
    if not grads:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))


def agree(
    run: Run, state: RunState, loss_sum, grad_norm, stop: _StopFlag, t0: float
) -> tuple[float, float, float, Optional[bool]]:
    """The max over processes of: NaN seen, stop requested, the clock; and whether every
    process's gradient norm is exactly zero; one host sync.

    On a GPU the step is queued, not run, when this is reached: reading a flag waits for the
    GPU to finish and leaves it idle while the next step is queued. So there the flags are
    read only when due (see `_flags_due`); otherwise nothing is NaN yet as far as the loop
    knows, the stop flag is this process's own, the clock is the host's and the gradient
    unknown (None).
    """
    device = run.device
    if not _flags_due(run, state):
        stop_here = float(stop.signum is not None and not run.dist.enabled)
        return 0.0, stop_here, state.time_s + time.perf_counter() - t0, None
    norm = grad_norm.to(device).float()
    flags = torch.stack(
        [
            (~torch.isfinite(loss_sum) | ~torch.isfinite(norm)).double(),
            torch.tensor(float(stop.signum is not None), device=device, dtype=torch.float64),
            torch.tensor(state.time_s + time.perf_counter() - t0, device=device, dtype=torch.float64),
            (norm != 0).double(),
        ]
    )
    if run.dist.enabled:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad, stop_req, time_sync, moving = flags.tolist()
    return bad, stop_req, time_sync, not moving


def _flags_due(run: Run, state: RunState) -> bool:
    """Every step on the CPU (reading is free there) and when the clock steers the run (all
    processes must agree on it each step); else on log, eval and checkpoint steps and the
    last. A NaN is then caught at the next of those, before any checkpoint is written."""
    if run.device.type == "cpu" or run.cfg.schedule.max_time_s > 0:
        return True
    r, step = run.cfg.run, state.step + 1
    every = [n for n in (r.log_every, r.eval_every, r.checkpoint_every) if n]
    return step >= run.cfg.schedule.max_steps or any(step % n == 0 for n in every)


def nan_message(run: Run, state: RunState, loss_sum) -> str:
    where = f"the last good checkpoint is {state.last_ckpt}" if state.last_ckpt else "no checkpoint was saved yet"
    return (
        f"loss or gradient became NaN/inf at step {state.step + 1} (loss {float(loss_sum):.4g}); stopped "
        f"without updating the weights; {where}. Try a lower optimizer.lr, a warmup, or grad clipping."
    )


# A gradient of exactly zero on this many checked steps in a row stops a run as dead. A model
# that learns never has one: any token it predicts imperfectly moves the LM head. A zero
# gradient comes from a model whose activations have saturated or collapsed (a far too
# high learning rate): the optimizer has nothing left to follow, so more steps only burn time.
DEAD_STEPS = 3


def count_zero_gradient(state: RunState, zero: bool) -> None:
    if zero and not state.zero_grad_steps:
        state.zero_grad_since = state.step + 1
    state.zero_grad_steps = state.zero_grad_steps + 1 if zero else 0


def dead_message(run: Run, state: RunState, loss_sum) -> str:
    loss = float(loss_sum)
    vocab = run.cfg.model.vocab_size
    uniform = math.log(vocab) if vocab else None
    what = (
        f"loss {loss:.4g} = ln({vocab}), a uniform guess over the vocabulary"
        if uniform is not None and abs(loss - uniform) < 1e-3
        else f"loss {loss:.4g}"
    )
    since = state.zero_grad_since
    where = (
        f"the last checkpoint is {state.last_ckpt} (one saved after step {since - 1} holds the stalled model)"
        if state.last_ckpt
        else "no checkpoint was saved yet"
    )
    return (
        f"the gradient has been exactly 0 since step {since} ({what}): the model has stopped learning; "
        f"stopped at step {state.step + 1} without updating the weights; {where}. Try a lower learning rate "
        f"(optimizer.lr = {run.cfg.optimizer.lr:g}), a warmup, or grad clipping."
    )


def stop_reason(run: Run, state: RunState, stop_req: bool, signum: Optional[int]) -> tuple[str, str]:
    """(status, message) of a run stopped early: by a signal (here or in another process) or by the clock."""
    if stop_req:
        name = signal.Signals(signum).name if signum else "a stop request"
        where = f"checkpoint {state.last_ckpt}; continue with --resume {run.run_dir}"
        return "interrupted", f"stopped by {name} after step {state.step}; {where}"
    return "time", f"reached schedule.max_time_s = {run.cfg.schedule.max_time_s:g} s after step {state.step}"


class _StopFlag:
    """Set by SIGINT/SIGTERM; a second SIGINT interrupts at once."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


# ---------------------------------------------------------------------------------------
# Evaluation and logging
# ---------------------------------------------------------------------------------------


def evaluate(run: Run) -> float:
    """Mean loss over the fixed validation windows (all processes together); over the
    assistant tokens of the validation rows for conversations."""
    B, T = run.cfg.schedule.batch_size, run.cfg.model.context_length
    run.optimizer.settle()  # rows whose AdamW steps a sparse gradient deferred
    run.model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=run.device)
    with torch.no_grad():
        for x, y, n in _validation_batches(run, B, T):
            loss = model_loss(run.eval_model, x, y, run.bf16, documents_of(run, x))
            total[0] += loss.double() * n
            total[1] += n
    if run.dist.enabled:
        dist.all_reduce(total)
    run.model.train()
    return float(total[0] / total[1])


def _validation_batches(run: Run, B: int, T: int):
    """(inputs, targets, weight) of each validation batch: its rows for windows, its counted
    targets for conversations."""
    if run.val_rows is None:
        for i in range(0, len(run.val_starts), B):
            x, y = run.val_data.windows_at(run.val_starts[i : i + B], T, run.device)
            yield x, y, x.shape[0]
        return
    ids, mask = run.val_rows
    for i in range(0, len(ids), B):
        x, y = masked_targets(ids[i : i + B], mask[i : i + B])
        yield x.to(run.device), y.to(run.device), int(mask[i : i + B, 1:].sum())


def log_start(run: Run, state: RunState) -> dict:
    """The step-0 record: validation loss before training."""
    val_loss = evaluate(run)
    rec = make_record(run, state, lr_at(run.cfg, 0, 0.0), None, val_loss)
    run.loggers.log(rec)
    if state.best_val is None:
        state.best_val = val_loss
    return rec


def log_step(run: Run, state: RunState, lr: float, grad_norm, *, last: bool, stopping: bool) -> Optional[dict]:
    """On log and eval steps: evaluate if due, write the record, keep best.pt; the record or None."""
    r, step = run.cfg.run, state.step
    do_eval = bool(r.eval_every and step % r.eval_every == 0) or (last and not stopping)
    if not do_eval and step % r.log_every:
        return None
    val_loss = evaluate(run) if do_eval else None
    rec = make_record(run, state, lr, float(grad_norm), val_loss)  # the one read of the norm
    run.loggers.log(rec)
    if val_loss is not None:
        state.final_val = val_loss
        say(run, f"step {step}: val loss {val_loss:.4f} (ppl {rec['val_ppl']:.2f}), {rec['time_s']:.0f} s")
        if state.best_val is None or val_loss < state.best_val:
            state.best_val = val_loss
            if r.keep_best and step > 0:
                save_best(run, state)
    show_progress(run, rec, lr)
    return rec


def make_record(run: Run, state: RunState, lr: float, grad_norm: Optional[float], val_loss: Optional[float]) -> dict:
    """The JSONL record of this step; restarts the running train-loss average."""
    train_loss = None
    if state.loss_count:
        t = state.loss_sum / state.loss_count
        if run.dist.enabled:
            dist.all_reduce(t)
            t = t / run.dist.world
        train_loss = float(t)
    steps_done = state.step - state.last_log_step
    dt = state.time_s - state.last_log_time
    tokens = tokens_trained(run, state.step)
    tps = (tokens - tokens_trained(run, state.last_log_step)) / dt if dt > 0 and steps_done else None
    mfu = run.flops_per_tok * tps / (run.peak * run.dist.world) if (run.peak and run.flops_per_tok and tps) else None
    rec = {
        "step": state.step,
        "tokens": tokens,
        "time_s": round(state.time_s, 3),
        "wall_s": round(state.wall_s, 3),
        "lr": lr,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "val_ppl": math.exp(min(val_loss, 700.0)) if val_loss is not None else None,
        "val_bpb": val_loss / math.log(2) / run.val_bytes_per_token
        if val_loss is not None and run.val_bytes_per_token
        else None,
        "grad_norm": grad_norm,
        "tokens_per_s": tps,
        "mfu": mfu,
    }
    rec.update(run.data_report)  # the data's counts, in the first record of the call
    run.data_report = {}
    state.last_log_step, state.last_log_time = state.step, state.time_s
    state.loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    state.loss_count = 0
    return rec


def say(run: Run, msg: str) -> None:
    """A line on stderr from rank 0 (above the progress bar when there is one); on stdout
    when stderr's reader is gone, and nowhere when both are."""
    if not run.dist.is_main:
        return
    if run.bar is not None and not run.err.lost:
        run.bar.write(msg, file=run.err)
        if not run.err.lost:
            return
    say_where_possible(msg, run.err, run.out)


def _bar_by_time(cfg: TrainConfig) -> bool:
    # A time-budgeted run usually ends at max_time_s long before max_steps: its bar counts
    # seconds of the training clock, so that its ETA is the real one.
    return cfg.schedule.schedule_by == "time" and cfg.schedule.max_time_s > 0


def progress_bar(cfg: TrainConfig, state: RunState, file):
    common = dict(desc="train", dynamic_ncols=True, file=file, mininterval=1.0)
    if not _bar_by_time(cfg):
        return tqdm(total=cfg.schedule.max_steps, initial=state.step, unit="step", **common)
    total = float(cfg.schedule.max_time_s)
    return tqdm(
        total=total,
        initial=min(state.time_s, total),
        unit="s",
        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s of training [{elapsed}<{remaining}{postfix}]",
        **common,
    )


def show_progress(run: Run, rec: dict, lr: float) -> None:
    if run.bar is None:
        return
    post = {"step": rec["step"]} if _bar_by_time(run.cfg) else {}
    post["loss"] = f"{rec['train_loss']:.3f}" if rec["train_loss"] is not None else "-"
    post["lr"] = f"{lr:.2e}"
    if rec["tokens_per_s"]:
        post["tok/s"] = f"{rec['tokens_per_s']:,.0f}"
    run.bar.set_postfix(post, refresh=False)


def advance_bar(run: Run, time_sync: float) -> None:
    if run.bar is not None:
        bar = run.bar
        bar.update(max(0.0, min(time_sync, bar.total) - bar.n) if _bar_by_time(run.cfg) else 1)


# ---------------------------------------------------------------------------------------
# Run directory: checkpoints
# ---------------------------------------------------------------------------------------


def checkpoint_payload(run: Run, state: RunState) -> dict:
    """What a checkpoint carries beside the weights (a collective: every process calls it)."""
    acc = state.loss_sum.clone()
    if run.dist.enabled:  # every process resumes from the mean of the running sums
        dist.all_reduce(acc)
        acc /= run.dist.world
    log_state = {"loss_sum": float(acc), "count": state.loss_count}
    log_state.update(last_step=state.last_log_step, last_time=state.last_log_time)
    return dict(
        config=run.cfg.to_dict(),
        rng=get_rng_state(),
        sampler_states=_gather_states(run.batches.loader_state(), run.dist, run.device),
        batching=batching_of(run.cfg),
        world_size=run.dist.world,
        tokenizer_fingerprint=run.train_data.fingerprint,
        **tokenizer_location(run.cfg, run.run_dir),
        time_s=state.time_s,
        wall_s=state.wall_s,
        tokens=tokens_trained(run, state.step),
        best_val_loss=state.best_val,
        log_state=log_state,
        ferrolm_version=__version__,
        # the float32 kernel a CPU run chose, which a resumed run keeps (setup_device)
        **({"cpu_matmul": gemm.chosen()} if run.device.type == "cpu" else {}),
    )


def tokenizer_location(cfg: TrainConfig, run_dir: Path) -> dict:
    """Where data.tokenizer is, absolute and relative to the run folder, so that the model
    finds its tokenizer from any working folder, and after the project moves as a whole."""
    name = cfg.data.tokenizer
    if not name or not Path(name).is_dir():
        return {}
    where = Path(name).resolve()
    return {
        "tokenizer_dir": str(where),
        "tokenizer_dir_from_run": os.path.relpath(where, Path(run_dir).resolve()),
    }


class _Saved:
    """A state dict in the shape save_checkpoint reads (``.state_dict()``)."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state


def saved_state(run: Run):
    """(model, optimizer) for save_checkpoint; a sharded run gathers full tensors (a collective)."""
    if not _sharded(run.cfg, run.dist):
        return run.raw_model, run.optimizer
    model_sd, optim_sd = full_state_dicts(run.raw_model, run.optimizer)
    return _Saved(model_sd), _Saved(optim_sd)


def _gather_states(state: torch.Tensor, dist_: Dist, device: torch.device) -> list[torch.Tensor]:
    if not dist_.enabled:
        return [state]
    t = state.to(device)
    out = [torch.empty_like(t) for _ in range(dist_.world)]
    dist.all_gather(out, t)
    return [o.cpu() for o in out]


def save(run: Run, state: RunState, *, final: bool) -> None:
    """A step checkpoint (rank 0 writes, older ones past keep_last go); a failed final save raises."""
    run.optimizer.settle()  # deferred row updates: the weights saved are whole
    payload = checkpoint_payload(run, state)
    model, optimizer = saved_state(run)
    if run.dist.is_main:
        path = run.run_dir / CHECKPOINT_DIR / f"step_{state.step:08d}.pt"
        try:
            save_checkpoint(model, optimizer, state.step, path, **payload)
        except OSError as e:
            prev = (
                f"; the previous checkpoint {state.last_ckpt} is intact"
                if state.last_ckpt
                else "; no checkpoint of this run was saved before"
            )
            msg = f"could not save checkpoint {path}: {e}{prev}"
            if final:
                raise OSError(msg) from e
            say(run, msg + " (training continues)")
        else:
            state.last_ckpt = path
            if run.cfg.run.keep_last:
                for _, old in step_checkpoints(run.run_dir)[: -run.cfg.run.keep_last]:
                    old.unlink(missing_ok=True)
    _barrier(run.dist)


def save_best(run: Run, state: RunState) -> None:
    payload = checkpoint_payload(run, state)
    model, optimizer = saved_state(run)
    if run.dist.is_main:
        path = run.run_dir / BEST_FILE
        had_best = path.exists()
        try:
            save_checkpoint(model, optimizer, state.step, path, **payload)
        except OSError as e:
            prev = "the previous best is intact" if had_best else "there is no best checkpoint yet"
            say(run, f"could not save {path}: {e} ({prev}; training continues)")
    _barrier(run.dist)


def _barrier(dist_: Dist) -> None:
    if dist_.enabled:
        dist.barrier()


def remove_stale_temporaries(run_dir: Path) -> None:
    """Delete what saves killed mid-write left (checkpoint, best.pt and config temporaries)."""
    for path in stale_temporaries(run_dir) + stale_temporaries(run_dir / CHECKPOINT_DIR):
        path.unlink(missing_ok=True)
