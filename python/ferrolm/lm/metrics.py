"""Where a training run's records go: ``metrics.jsonl`` in the run directory (always), and
wandb / TensorBoard when the config asks for them and they are installed."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Optional

from ferrolm._util import atomic_write_bytes

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """metrics.jsonl (always) plus wandb / TensorBoard when asked for and installed."""

    def __init__(self, run_dir: Path, cfg, enabled: bool, resume_step: Optional[int]):
        self.enabled = enabled
        self.file = None
        self.wandb = None
        self.tb = None
        if not enabled:
            return
        path = run_dir / METRICS_FILE
        # Resumed: drop the records written after the checkpoint. Fresh: the directory holds
        # no checkpoint, so any records are those of a run killed before its first one.
        _truncate_metrics(path, resume_step if resume_step is not None else -1)
        self.file = open(path, "a", encoding="utf-8")
        if cfg.run.wandb:
            self.wandb = _open_wandb(cfg, run_dir)
        if cfg.run.tensorboard:
            self.tb = _open_tensorboard(run_dir)

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


def _open_wandb(cfg, run_dir: Path):
    try:
        import wandb  # optional: imported only when asked for
    except ImportError:
        warnings.warn(
            'run.wandb is set but wandb is not installed (pip install "ferrolm[wandb]"); logging to metrics.jsonl only',
            stacklevel=6,
        )
        return None
    return wandb.init(project=cfg.run.wandb, config=cfg.to_dict(), dir=str(run_dir), resume="allow")


def _open_tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter  # optional: needs the tensorboard package
    except ImportError:
        warnings.warn(
            'run.tensorboard is set but tensorboard is not installed (pip install "ferrolm[tensorboard]"); '
            "logging to metrics.jsonl only",
            stacklevel=6,
        )
        return None
    return SummaryWriter(str(run_dir / "tb"))


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
    kept = [json.dumps(r) for r in read_metrics(path) if r["step"] <= last_step]
    atomic_write_bytes(path, ("\n".join(kept) + "\n" if kept else "").encode("utf-8"))
