"""Loss curves of training runs, from their metrics.jsonl logs, as a PNG.

from ferrolm.app.plot import plot_run
plot_run(["runs/a", "runs/b"], x="tokens", out="cmp.png")

The PNG names ferrolm as its Software: a later plot replaces only such a file (or any with
force=True), and never a run's own files.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import matplotlib
from matplotlib.figure import Figure  # no pyplot: no backend switch, no window, no global figure list

from ferrolm import __version__
from ferrolm._util import atomic_open, check_out
from ferrolm.lm.metrics import METRICS_FILE, read_metrics

__all__ = ["plot_run", "is_ferrolm_plot"]

_X_KEYS = {"step": ("step", "step"), "time": ("time_s", "training time (s)"), "tokens": ("tokens", "tokens")}


def plot_run(
    run_dirs,
    x: str = "step",
    out: str | os.PathLike | None = None,
    labels: Optional[list[str]] = None,
    title: Optional[str] = None,
    force: bool = False,
) -> Path:
    """Plot train and validation loss of one or more runs against step, time or tokens; return the PNG path.

    `run_dirs` is a run directory (or metrics.jsonl) or a list of them, overlaid in one figure.
    The PNG goes to `out`, by default ``<first run>/loss_<x>.png``, whole or not at all. An
    existing `out` is replaced only when it is a plot of ferrolm's, or with `force`; never
    when it is one of `run_dirs` (or their metrics.jsonl).
    """
    if x not in _X_KEYS:
        raise ValueError(f"x must be one of {', '.join(_X_KEYS)}, got {x!r}")
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    run_dirs = [Path(r) for r in run_dirs]
    if not run_dirs:
        raise ValueError("plot_run needs at least one run directory")
    key, xlabel = _X_KEYS[x]
    fig = Figure(figsize=(8, 5), dpi=120)
    ax = fig.subplots()
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    losses = []
    for i, run in enumerate(run_dirs):
        records = read_metrics(run)
        label = labels[i] if labels and i < len(labels) else (run.parent.name if run.name == METRICS_FILE else run.name)
        _draw_run(ax, records, key, label, colors[i % len(colors)])
        losses += [r[k] for r in records for k in ("train_loss", "val_loss") if r.get(k) is not None]
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    _zoom(ax, losses)
    first = run_dirs[0] if run_dirs[0].is_dir() else run_dirs[0].parent
    out_path = Path(out) if out is not None else first / f"loss_{x}.png"
    inputs = run_dirs + [r / METRICS_FILE for r in run_dirs]
    check_out(out_path, inputs, force=force, judge=_judge_png, example=f"loss_{x}.png")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    with atomic_open(out_path) as f:
        fig.savefig(f, format="png", metadata={"Software": f"{SOFTWARE} {__version__}"})
    return out_path


SOFTWARE = "ferrolm"  # the PNG's Software text begins with it


def is_ferrolm_plot(path: os.PathLike | str) -> bool:
    """Whether ``path`` is a PNG whose Software text (before its image data) names ferrolm."""
    try:
        with open(path, "rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                return False
            while True:
                head = f.read(8)
                if len(head) < 8 or head[4:] == b"IDAT":
                    return False
                size = int.from_bytes(head[:4], "big")
                body = f.read(size + 4)[:size]  # the chunk and its CRC
                if head[4:] == b"tEXt" and body.startswith(b"Software\0" + SOFTWARE.encode()):
                    return True
    except OSError:
        return False


def _judge_png(path: Path) -> Optional[str]:
    return None if is_ferrolm_plot(path) else "exists and is not a plot ferrolm wrote; choose a new file name"


def _draw_run(ax, records: list[dict], key: str, label: str, color: str) -> None:
    """One run: its train loss faint, its validation loss with markers and a line at its best."""
    tr = [(r[key], r["train_loss"]) for r in records if r.get("train_loss") is not None and r.get(key) is not None]
    va = [(r[key], r["val_loss"]) for r in records if r.get("val_loss") is not None and r.get(key) is not None]
    if tr:
        ax.plot(*zip(*tr), color=color, alpha=0.35, linewidth=1, label=f"{label} train")
    if va:
        ax.plot(*zip(*va), color=color, marker="o", markersize=3, linewidth=1.8, label=f"{label} val")
        ax.axhline(min(v for _, v in va), color=color, linestyle=":", linewidth=0.8)


def _zoom(ax, losses: list[float]) -> None:
    """Zoom past the first steps' huge losses so the interesting part is readable."""
    finite = sorted(v for v in losses if math.isfinite(v))
    if finite:
        hi = finite[int(len(finite) * 0.98)] if len(finite) > 10 else finite[-1]
        ax.set_ylim(max(0.0, finite[0] - 0.1), hi + 0.1)
