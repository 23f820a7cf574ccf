"""The training loop: shards in, checkpoints and a metrics log out.

    from ferrolm.lm.train import load_config, train
    cfg = load_config("cpu-small", ["data.train=data/train", "data.val=data/val"])
    summary = train(cfg)                   # or: train(cfg, resume="runs/cpu-small")

One optimizer step:
    lr = warmup + cosine(step)             (or of the elapsed fraction of max_time_s)
    repeat accum times:                    gradient accumulation up to tokens_per_step
        x, y = train_shards.get_batch(...) uniform random windows, seeded per process
        loss = cross_entropy(model(x), y)  bf16 autocast when enabled
        (loss / accum).backward()          DDP all-reduces gradients on the last micro-batch
    norm = clip_grad_norm(...)             stop here, before the update, if loss/norm is NaN
    optimizer.step()

A run directory holds ``config.toml`` (the resolved config), ``metrics.jsonl`` (one JSON
record per log step), ``checkpoints/step_XXXXXXXX.pt`` (the last ``keep_last``) and
``best.pt`` (lowest validation loss). Checkpoints carry everything needed to continue
exactly: model, optimizer, step, config, RNG states, each process's sampler state, the
elapsed time and the tokenizer fingerprint. SIGINT/SIGTERM finish the current step, save,
and return. Under ``torchrun`` each process trains on its own sampler stream; rank 0 logs
and saves.
"""

from __future__ import annotations

import contextlib
import json
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

from ferrolm.lm.checkpoint import (
    CheckpointError,
    apply_checkpoint,
    get_rng_state,
    read_checkpoint,
    save_checkpoint,
    set_rng_state,
    unwrap_model,
)
from ferrolm.lm.config import (  # noqa: F401  (re-exported: the config is part of this module's API)
    CONFIG_NAME,
    ConfigError,
    DataSection,
    ModelSection,
    OptimizerSection,
    RunSection,
    ScheduleSection,
    TrainConfig,
    apply_overrides,
    load_config,
    preset_names,
    to_toml,
)
from ferrolm.lm.data import ShardError, TokenShards, sample_starts

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
    "plot_run",
    "read_metrics",
    "latest_checkpoint",
    "PEAK_FLOPS_BF16",
]

METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
BEST_FILE = "best.pt"
_CKPT_RE = re.compile(r"^step_(\d+)\.pt$")

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
    status: str  # "done", "time" (max_time_s reached), "interrupted", "nan"
    step: int
    run_dir: Path
    last_checkpoint: Optional[Path]
    best_val_loss: Optional[float]
    final_val_loss: Optional[float]
    message: str = ""
    records: list = field(default_factory=list)  # the JSONL records this call wrote (rank 0)


# ---------------------------------------------------------------------------------------
# Devices, distributed setup, precision
# ---------------------------------------------------------------------------------------


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """ "auto" -> cuda (this process's GPU) > mps > cpu; anything else is checked and returned."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"run.device: unknown device {name!r} (use auto, cpu, cuda, cuda:N or mps)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"run.device is {name!r} but CUDA is not available here")
        if dev.index is None:
            dev = torch.device("cuda", local_rank % torch.cuda.device_count())
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"run.device is {name!r} but MPS is not available here")
    return dev


@dataclass
class _Dist:
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


def _setup_distributed(device_name: str) -> _Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return _Dist()
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    initialized_here = False
    if not dist.is_initialized():
        use_cuda = torch.cuda.is_available() and device_name in ("auto",) or device_name.startswith("cuda")
        backend = "nccl" if use_cuda else "gloo"
        if use_cuda:
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dist.init_process_group(backend=backend)
        initialized_here = True
    return _Dist(
        rank=dist.get_rank(), local_rank=local_rank, world=dist.get_world_size(), initialized_here=initialized_here
    )


def _autocast(device: torch.device, enabled: bool):
    if enabled and device.type in ("cuda", "cpu"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


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
# Model, optimizer
# ---------------------------------------------------------------------------------------


def build_model(cfg: ModelSection) -> torch.nn.Module:
    from ferrolm.lm.model import TransformerLM

    return TransformerLM(
        cfg.vocab_size,
        cfg.context_length,
        cfg.d_model,
        cfg.num_layers,
        cfg.num_heads,
        cfg.d_ff,
        cfg.rope_theta,
        tie_embeddings=cfg.tie_embeddings,
    )


def build_optimizer(model: torch.nn.Module, cfg: OptimizerSection) -> torch.optim.Optimizer:
    from ferrolm.lm.optim import AdamW, param_groups_for_decay

    groups = param_groups_for_decay(model, cfg.weight_decay)
    return AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)


def training_flops_per_token(model: torch.nn.Module) -> Optional[float]:
    """Forward + backward FLOPs per token (3 x the forward) when the model exposes its config."""
    cfg = getattr(unwrap_model(model), "config", None)
    if cfg is None:
        return None
    try:
        from ferrolm.lm.model import flops_per_token
    except ImportError:  # pragma: no cover
        return None
    return 3.0 * flops_per_token(cfg)


def lr_at(cfg: TrainConfig, step: int, elapsed_s: float) -> float:
    """The learning rate of optimizer step `step` (0-based)."""
    from ferrolm.lm.optim import cosine_lr

    s, o = cfg.schedule, cfg.optimizer
    it: float = step
    if s.schedule_by == "time":
        it = min(elapsed_s / s.max_time_s, 1.0) * s.max_steps
    return cosine_lr(it, o.lr, o.min_lr, s.warmup_steps, s.cosine_steps or s.max_steps)


def _loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from ferrolm.lm.functional import cross_entropy

    return cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _clip(params, max_norm: float) -> torch.Tensor:
    from ferrolm.lm.optim import clip_grad_norm

    if max_norm > 0:
        return clip_grad_norm(params, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))


# ---------------------------------------------------------------------------------------
# Run directory: checkpoints and metrics
# ---------------------------------------------------------------------------------------


def _step_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    d = run_dir / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _CKPT_RE.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> Optional[Path]:
    """The newest step checkpoint of a run directory, or None."""
    ckpts = _step_checkpoints(Path(run_dir))
    return ckpts[-1][1] if ckpts else None


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The JSONL records of a run (a directory or a metrics.jsonl path); bad lines are skipped."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics log at {path}")
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # e.g. a line cut short by a kill
            if isinstance(rec, dict) and "step" in rec:
                records.append(rec)
    return records


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records past `last_step` (written after the checkpoint we resume from)."""
    if not path.is_file():
        return
    from ferrolm.bpe.files import atomic_write_bytes

    kept = [json.dumps(r) for r in read_metrics(path) if r["step"] <= last_step]
    atomic_write_bytes(path, ("\n".join(kept) + "\n" if kept else "").encode("utf-8"))


class _Loggers:
    """metrics.jsonl (always) plus wandb / TensorBoard when asked for and installed."""

    def __init__(self, run_dir: Path, cfg: TrainConfig, enabled: bool, resume_step: Optional[int]):
        self.enabled = enabled
        self.file = None
        self.wandb = None
        self.tb = None
        if not enabled:
            return
        path = run_dir / METRICS_FILE
        if resume_step is not None:
            _truncate_metrics(path, resume_step)
        self.file = open(path, "a", encoding="utf-8")
        if cfg.run.wandb:
            try:
                import wandb  # type: ignore

                self.wandb = wandb.init(project=cfg.run.wandb, config=cfg.to_dict(), dir=str(run_dir), resume="allow")
            except ImportError:
                warnings.warn(
                    "run.wandb is set but wandb is not installed; logging to metrics.jsonl only", stacklevel=2
                )
        if cfg.run.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tb"))
            except ImportError:
                warnings.warn(
                    "run.tensorboard is set but tensorboard is not installed; logging to metrics.jsonl only",
                    stacklevel=2,
                )

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        scalars = {
            k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
        }
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tb is not None:
            self.tb.close()


# ---------------------------------------------------------------------------------------
# Signals: finish the step, save, stop
# ---------------------------------------------------------------------------------------


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
# The loop
# ---------------------------------------------------------------------------------------


def _open_data(cfg: TrainConfig, model_vocab: int) -> tuple[TokenShards, TokenShards]:
    cfg.require_data()
    tok = cfg.data.tokenizer or None
    train_data = TokenShards(cfg.data.train, tokenizer=tok)
    val_data = TokenShards(cfg.data.val, tokenizer=tok)
    if train_data.fingerprint != val_data.fingerprint:
        raise ShardError(
            f"train and val shards come from different tokenizers ({train_data.fingerprint[:16]}... vs {val_data.fingerprint[:16]}...)"
        )
    for name, d in (("train", train_data), ("val", val_data)):
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


def _sampler_seed(seed: int, rank: int) -> int:
    return (seed * 1_000_003 + 7919 * (rank + 1)) % (2**63)


def _gather_states(g: torch.Generator, dist_: _Dist, device: torch.device) -> list[torch.Tensor]:
    state = g.get_state()
    if not dist_.enabled:
        return [state]
    import torch.distributed as dist

    t = state.to(device)
    out = [torch.empty_like(t) for _ in range(dist_.world)]
    dist.all_gather(out, t)
    return [o.cpu() for o in out]


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
    dist_ = _setup_distributed(cfg.run.device)
    try:
        return _train(cfg, dist_, resume, on_step)
    finally:
        if dist_.initialized_here:
            import torch.distributed as dist

            dist.destroy_process_group()


def _train(cfg: TrainConfig, dist_: _Dist, resume, on_step) -> TrainSummary:
    main = dist_.is_main
    if cfg.run.num_threads > 0:
        torch.set_num_threads(cfg.run.num_threads)
    device = resolve_device(cfg.run.device, dist_.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if cfg.run.tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
    bf16 = cfg.run.autocast_bf16 and device.type in ("cuda", "cpu")
    if bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        bf16 = False

    # -- resume: find the checkpoint, take the run's config from it ------------------------
    ckpt = None
    ckpt_path: Optional[Path] = None
    if resume is not None:
        resume = Path(resume)
        if resume.is_dir():
            candidates = [p for _, p in reversed(_step_checkpoints(resume))]
            if not candidates:
                raise FileNotFoundError(f"--resume {resume}: no checkpoints in {resume / CHECKPOINT_DIR}")
            for i, ckpt_path in enumerate(candidates):
                try:
                    ckpt = read_checkpoint(ckpt_path)
                    break
                except CheckpointError as e:
                    if i == len(candidates) - 1:
                        raise
                    if main:
                        warnings.warn(f"{e}; trying the previous checkpoint", stacklevel=2)
        else:
            ckpt_path = resume
            ckpt = read_checkpoint(ckpt_path)
        saved_model = (ckpt.get("config") or {}).get("model")
        if saved_model and saved_model != cfg.to_dict()["model"]:
            diff = {k: (saved_model.get(k), v) for k, v in cfg.to_dict()["model"].items() if saved_model.get(k) != v}
            raise CheckpointError(f"{ckpt_path} was saved with a different model config (checkpoint vs now: {diff})")
    run_dir = Path(cfg.run.out_dir)
    if resume is not None and resume.is_dir() and resume.resolve() != run_dir.resolve():
        run_dir = resume
        cfg.run.out_dir = str(resume)
    if ckpt is None and main and _step_checkpoints(run_dir):
        raise FileExistsError(
            f"run.out_dir {run_dir} already holds a run; continue it with --resume {run_dir} or choose another run.out_dir"
        )

    # -- data, model, optimizer -------------------------------------------------------------
    torch.manual_seed(cfg.run.seed)
    train_data, val_data = _open_data(cfg, cfg.model.vocab_size)
    model = build_model(cfg.model).to(device)
    optimizer = build_optimizer(model, cfg.optimizer)
    params = [p for p in model.parameters() if p.requires_grad]

    B, T = cfg.schedule.batch_size, cfg.model.context_length
    micro_tokens = B * T * dist_.world
    accum = 1
    if cfg.schedule.tokens_per_step:
        accum = max(1, round(cfg.schedule.tokens_per_step / micro_tokens))
        if accum * micro_tokens != cfg.schedule.tokens_per_step and main:
            warnings.warn(
                f"schedule.tokens_per_step {cfg.schedule.tokens_per_step} is not a multiple of batch_size x context x processes "
                f"= {micro_tokens}; using {accum} micro-batches = {accum * micro_tokens} tokens per step",
                stacklevel=2,
            )
    tokens_per_step = accum * micro_tokens

    sampler = torch.Generator()
    sampler.manual_seed(_sampler_seed(cfg.run.seed, dist_.rank))
    start_step, time_s, wall_s = 0, 0.0, 0.0
    best_val: Optional[float] = None
    log_state: dict = {}
    if ckpt is not None:
        if ckpt.get("tokenizer_fingerprint") not in (None, train_data.fingerprint):
            raise CheckpointError(
                f"{ckpt_path} was trained on shards of another tokenizer than data.train {train_data.paths[0]}"
            )
        start_step = apply_checkpoint(ckpt, model, optimizer, name=str(ckpt_path))
        time_s = float(ckpt.get("time_s", 0.0))
        wall_s = float(ckpt.get("wall_s", 0.0))
        best_val = ckpt.get("best_val_loss")
        log_state = ckpt.get("log_state") or {}
        if "rng" in ckpt:
            set_rng_state(ckpt["rng"])
        states = ckpt.get("sampler_states") or []
        if len(states) == dist_.world:
            sampler.set_state(states[dist_.rank])
        else:
            sampler.manual_seed(_sampler_seed(cfg.run.seed + start_step, dist_.rank))
            if main:
                warnings.warn(
                    f"checkpoint has sampler states for {len(states)} process(es), now {dist_.world}: batches are reseeded, not replayed",
                    stacklevel=2,
                )
        if main:
            print(f"resuming from {ckpt_path} at step {start_step}", file=sys.stderr)
    ckpt = None  # free the loaded tensors

    flops_per_tok = training_flops_per_token(model)
    peak = peak_flops(device, bf16)
    if cfg.run.compile:
        model = torch.compile(model)
    if dist_.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    raw_model = unwrap_model(model)  # what checkpoints save
    eval_model = model.module if dist_.enabled else model  # no DDP hooks, but compiled when compile is on

    # Fixed validation windows, drawn once from their own seed; each process takes a slice.
    val_gen = torch.Generator()
    val_gen.manual_seed(cfg.run.seed + 999_983)
    val_starts = sample_starts(len(val_data), cfg.run.eval_batches * B, T, val_gen)[dist_.rank :: dist_.world]

    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        from ferrolm.bpe.files import atomic_write_bytes

        atomic_write_bytes(run_dir / CONFIG_NAME, to_toml(cfg).encode("utf-8"))
    loggers = _Loggers(run_dir, cfg, main, start_step if resume is not None else None)

    def evaluate() -> float:
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device)
        with torch.no_grad():
            for i in range(0, len(val_starts), B):
                x, y = val_data.windows_at(val_starts[i : i + B], T, device)
                with _autocast(device, bf16):
                    logits = eval_model(x)
                loss = _loss_fn(logits, y)
                total[0] += loss.double() * x.shape[0]
                total[1] += x.shape[0]
        if dist_.enabled:
            import torch.distributed as dist

            dist.all_reduce(total)
        model.train()
        return float(total[0] / total[1])

    def checkpoint_payload(step: int) -> dict:
        acc = train_loss_acc.clone()
        if dist_.enabled:  # every process resumes from the mean of the running sums
            import torch.distributed as dist

            dist.all_reduce(acc)
            acc /= dist_.world
        return dict(
            config=cfg.to_dict(),
            rng=get_rng_state(),
            sampler_states=_gather_states(sampler, dist_, device),
            world_size=dist_.world,
            tokenizer_fingerprint=train_data.fingerprint,
            time_s=time_s,
            wall_s=wall_s,
            tokens=step * tokens_per_step,
            best_val_loss=best_val,
            # the running train-loss average since the last log record, so resumed logs match
            log_state={"loss_sum": float(acc), "count": loss_count, "last_step": last_log[0], "last_time": last_log[1]},
            ferrolm_version=_version(),
        )

    last_ckpt: list[Optional[Path]] = [latest_checkpoint(run_dir) if resume is not None else None]

    def save(step: int, *, final: bool) -> None:
        payload = checkpoint_payload(step)  # a collective: every process takes part
        if main:
            path = run_dir / CHECKPOINT_DIR / f"step_{step:08d}.pt"
            try:
                save_checkpoint(raw_model, optimizer, step, path, **payload)
            except OSError as e:
                prev = f"; the previous checkpoint {last_ckpt[0]} is intact" if last_ckpt[0] else ""
                msg = f"could not save checkpoint {path}: {e}{prev}"
                if final:
                    raise OSError(msg) from e
                _say(msg + " (training continues)")
            else:
                last_ckpt[0] = path
                if cfg.run.keep_last:
                    for _, old in _step_checkpoints(run_dir)[: -cfg.run.keep_last]:
                        old.unlink(missing_ok=True)
        _barrier(dist_)

    def save_best(step: int) -> None:
        payload = checkpoint_payload(step)
        if main:
            try:
                save_checkpoint(raw_model, optimizer, step, run_dir / BEST_FILE, **payload)
            except OSError as e:
                _say(f"could not save {run_dir / BEST_FILE}: {e} (the previous best is intact; training continues)")
        _barrier(dist_)

    def _say(msg: str) -> None:
        if main:
            if bar is not None:
                bar.write(msg, file=sys.stderr)
            else:
                print(msg, file=sys.stderr)

    bar = None
    # A time-budgeted run usually ends at max_time_s long before max_steps: its bar counts
    # seconds of the training clock, so that its ETA is the real one.
    bar_by_time = cfg.schedule.schedule_by == "time" and cfg.schedule.max_time_s > 0
    if main and cfg.run.progress:
        from tqdm.auto import tqdm

        if bar_by_time:
            total = float(cfg.schedule.max_time_s)
            bar = tqdm(
                total=total,
                initial=min(time_s, total),
                desc="train",
                unit="s",
                dynamic_ncols=True,
                file=sys.stderr,
                mininterval=1.0,
                bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s of training [{elapsed}<{remaining}{postfix}]",
            )
        else:
            bar = tqdm(
                total=cfg.schedule.max_steps,
                initial=start_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                mininterval=1.0,
            )

    records: list[dict] = []
    status, message = "done", ""
    step = start_step
    final_val: Optional[float] = None
    last_log = (int(log_state.get("last_step", step)), float(log_state.get("last_time", time_s)))
    train_loss_acc = torch.tensor(float(log_state.get("loss_sum", 0.0)), dtype=torch.float64, device=device)
    loss_count = int(log_state.get("count", 0))
    max_time = cfg.schedule.max_time_s

    def log_record(step: int, lr: float, grad_norm: float, val_loss: Optional[float]) -> dict:
        nonlocal last_log, train_loss_acc, loss_count
        train_loss = None
        if loss_count:
            t = train_loss_acc / loss_count
            if dist_.enabled:
                import torch.distributed as dist

                dist.all_reduce(t)
                t = t / dist_.world
            train_loss = float(t)
        steps_done = step - last_log[0]
        dt = time_s - last_log[1]
        tps = steps_done * tokens_per_step / dt if dt > 0 and steps_done else None
        rec = {
            "step": step,
            "tokens": step * tokens_per_step,
            "time_s": round(time_s, 3),
            "wall_s": round(wall_s, 3),
            "lr": lr,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "val_ppl": math.exp(min(val_loss, 700.0)) if val_loss is not None else None,
            "grad_norm": grad_norm,
            "tokens_per_s": tps,
            "mfu": (flops_per_tok * tps / (peak * dist_.world)) if (peak and flops_per_tok and tps) else None,
        }
        last_log = (step, time_s)
        train_loss_acc = torch.zeros((), dtype=torch.float64, device=device)
        loss_count = 0
        return rec

    wall_start = time.perf_counter()
    wall_base = wall_s
    with _StopFlag() as stop:
        try:
            if step == 0 and cfg.run.eval_at_start:
                v = evaluate()
                rec = log_record(0, lr_at(cfg, 0, 0.0), float("nan"), v)
                rec["grad_norm"] = None
                loggers.log(rec)
                records.append(rec)
                best_val = v if best_val is None else best_val
            time_sync = time_s  # the training clock every process agrees on (the slowest one's)
            while step < cfg.schedule.max_steps:
                t0 = time.perf_counter()
                lr = lr_at(cfg, step, time_sync)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_sum = torch.zeros((), dtype=torch.float32, device=device)
                for micro in range(accum):
                    x, y = train_data.get_batch(B, T, device, generator=sampler)
                    sync = not dist_.enabled or micro == accum - 1
                    with contextlib.nullcontext() if sync else model.no_sync():
                        with _autocast(device, bf16):
                            logits = model(x)
                        loss = _loss_fn(logits, y)
                        (loss / accum).backward()
                    loss_sum += loss.detach().float()
                grad_norm = _clip(params, cfg.optimizer.grad_clip)
                # One host sync per step: NaN check, stop requests and the shared clock.
                flags = torch.stack(
                    [
                        (~torch.isfinite(loss_sum) | ~torch.isfinite(grad_norm.to(device).float())).double(),
                        torch.tensor(float(stop.signum is not None), device=device, dtype=torch.float64),
                        torch.tensor(time_s + time.perf_counter() - t0, device=device, dtype=torch.float64),
                    ]
                )
                if dist_.enabled:
                    import torch.distributed as dist

                    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                bad, stop_req, time_sync = flags.tolist()
                if bad:
                    optimizer.zero_grad(set_to_none=True)
                    status = "nan"
                    where = (
                        f"the last good checkpoint is {last_ckpt[0]}" if last_ckpt[0] else "no checkpoint was saved yet"
                    )
                    message = (
                        f"loss or gradient became NaN/inf at step {step + 1} (loss {float(loss_sum) / accum:.4g}); stopped "
                        f"without updating the weights; {where}. Try a lower optimizer.lr, a warmup, or grad clipping."
                    )
                    _say(message)
                    break
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                dt = time.perf_counter() - t0
                time_s += dt
                wall_s = wall_base + (time.perf_counter() - wall_start)
                train_loss_acc += loss_sum.double() / accum
                loss_count += 1
                grad_norm_f = float(grad_norm)

                out_of_time = max_time > 0 and time_sync >= max_time
                last = step >= cfg.schedule.max_steps or out_of_time or bool(stop_req)
                do_eval = (cfg.run.eval_every and step % cfg.run.eval_every == 0) or (last and not stop_req)
                rec = None
                if do_eval or step % cfg.run.log_every == 0 or (last and not stop_req):
                    val_loss = evaluate() if do_eval else None
                    rec = log_record(step, lr, grad_norm_f, val_loss)
                    loggers.log(rec)
                    records.append(rec)
                    if val_loss is not None:
                        final_val = val_loss
                        _say(f"step {step}: val loss {val_loss:.4f} (ppl {rec['val_ppl']:.2f}), {rec['time_s']:.0f} s")
                        if best_val is None or val_loss < best_val:
                            best_val = val_loss
                            if cfg.run.keep_best and step > 0:
                                save_best(step)
                    if bar is not None:
                        post = {"step": step} if bar_by_time else {}
                        post.update(
                            {
                                "loss": f"{rec['train_loss']:.3f}" if rec["train_loss"] is not None else "-",
                                "lr": f"{lr:.2e}",
                            }
                        )
                        if rec["tokens_per_s"]:
                            post["tok/s"] = f"{rec['tokens_per_s']:,.0f}"
                        bar.set_postfix(post, refresh=False)
                if bar is not None:
                    bar.update(max(0.0, min(time_sync, bar.total) - bar.n) if bar_by_time else 1)
                if last or (cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0):
                    save(step, final=last)
                if on_step is not None:
                    on_step(step, rec)
                if stop_req:
                    status = "interrupted"
                    name = signal.Signals(stop.signum).name if stop.signum else "a stop request"
                    message = f"stopped by {name} after step {step}; checkpoint {last_ckpt[0]}; continue with --resume {run_dir}"
                    _say(message)
                    break
                if out_of_time:
                    status = "time"
                    message = f"reached schedule.max_time_s = {max_time:g} s after step {step}"
                    _say(message)
                    break
        finally:
            if bar is not None:
                bar.close()
            loggers.close()
    return TrainSummary(
        status=status,
        step=step,
        run_dir=run_dir,
        last_checkpoint=last_ckpt[0],
        best_val_loss=best_val,
        final_val_loss=final_val,
        message=message,
        records=records,
    )


def _barrier(dist_: _Dist) -> None:
    if dist_.enabled:
        import torch.distributed as dist

        dist.barrier()


def _version() -> str:
    try:
        import ferrolm

        return ferrolm.__version__
    except Exception:  # pragma: no cover
        return "unknown"


# ---------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------

_X_KEYS = {"step": ("step", "step"), "time": ("time_s", "training time (s)"), "tokens": ("tokens", "tokens")}


def plot_run(
    run_dirs,
    x: str = "step",
    out: str | os.PathLike | None = None,
    labels: Optional[list[str]] = None,
    title: Optional[str] = None,
) -> Path:
    """Plot train and validation loss of one or more runs against step, time or tokens; return the PNG path.

    `run_dirs` is a run directory (or metrics.jsonl) or a list of them, overlaid in one figure.
    The PNG goes to `out`, by default ``<first run>/loss_<x>.png``.
    """
    if x not in _X_KEYS:
        raise ValueError(f"x must be one of {', '.join(_X_KEYS)}, got {x!r}")
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    run_dirs = [Path(r) for r in run_dirs]
    if not run_dirs:
        raise ValueError("plot_run needs at least one run directory")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, xlabel = _X_KEYS[x]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(run_dirs):
        records = read_metrics(run)
        label = labels[i] if labels and i < len(labels) else (run.parent.name if run.name == METRICS_FILE else run.name)
        color = colors[i % len(colors)]
        tr = [(r[key], r["train_loss"]) for r in records if r.get("train_loss") is not None and r.get(key) is not None]
        va = [(r[key], r["val_loss"]) for r in records if r.get("val_loss") is not None and r.get(key) is not None]
        if tr:
            ax.plot(*zip(*tr), color=color, alpha=0.35, linewidth=1, label=f"{label} train")
        if va:
            ax.plot(*zip(*va), color=color, marker="o", markersize=3, linewidth=1.8, label=f"{label} val")
            best = min(v for _, v in va)
            ax.axhline(best, color=color, linestyle=":", linewidth=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    all_losses = [
        r[k] for run in run_dirs for r in read_metrics(run) for k in ("train_loss", "val_loss") if r.get(k) is not None
    ]
    if all_losses:
        finite = sorted(v for v in all_losses if math.isfinite(v))
        if finite:
            # Zoom past the first steps' huge losses so the interesting part is readable.
            hi = finite[int(len(finite) * 0.98)] if len(finite) > 10 else finite[-1]
            ax.set_ylim(max(0.0, finite[0] - 0.1), hi + 0.1)
    out_path = (
        Path(out)
        if out is not None
        else (run_dirs[0] if run_dirs[0].is_dir() else run_dirs[0].parent) / f"loss_{x}.png"
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path
