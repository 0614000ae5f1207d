"""Metric loggers: console, jsonl, TensorBoard, wandb, all behind one small interface.

Every logger has ``log(metrics, step)``, ``log_samples(rows, step)`` (sample generations,
a list of dicts such as ``{"prompt", "response", "score"}``) and ``close()``. Call them on the
controller (rank 0) only. `build_logger` makes a `MultiLogger` from config names.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

Rows = Sequence[Mapping[str, Any]]


def _scalar(value: Any) -> Any:
    """Python numbers from tensors / numpy scalars; other values unchanged."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        v = _scalar(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, bool):
            out[k] = float(v)
    return out


class MetricLogger:
    """The interface; subclasses override what they support."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        raise NotImplementedError

    def log_samples(self, rows: Rows, step: int) -> None:
        pass

    def message(self, text: str) -> None:
        """A line for the person watching (e.g. the end-of-run summary); metric files ignore it."""

    def rewind(self, step: int, row: Mapping[str, Any] | None = None) -> None:
        """A run resumed from the checkpoint of ``step``: forget what was logged for later steps (the job that
        wrote them died after that checkpoint; the resumed run logs them again). ``row``, the metrics the
        checkpoint saved for ``step``, is logged if ``step`` itself is missing (a death between the save and
        the log)."""

    def close(self) -> None:
        pass

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# Shown on the console line, in this order, when present, under a short label (the other loggers keep
# every metric under its full name).
CONSOLE_KEYS = {
    "critic/score/mean": "score", "critic/rewards/mean": "reward", "actor/pg_loss": "pg_loss",
    "actor/ppo_kl": "ppo_kl", "actor/kl_loss": "kl_loss", "actor/entropy": "entropy", "actor/grad_norm": "grad_norm",
    "critic/vf_loss": "vf_loss", "response_length/mean": "resp_len", "reward/errors": "reward_errors",
    "reward/timeouts": "reward_timeouts", "timing_s/step": "step_s", "perf/throughput": "tok/s",
}


class ConsoleLogger(MetricLogger):
    """One compact line per step (key metrics and all ``val/`` metrics) under a progress bar.

    The bar uses tqdm (installed with transformers) when ``total_steps`` is known; the lines
    are printed through it so they do not break the bar.
    """

    def __init__(self, total_steps: int | None = None, *, keys: Mapping[str, str] = CONSOLE_KEYS,
                 progress: bool = True, file: Any = None) -> None:
        self.keys = dict(keys)
        self.file = file or sys.stdout
        self._bar = None
        if progress and total_steps:
            try:  # imported here: tqdm is optional (a run without it logs lines only)
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total_steps, desc="training", unit="step", file=sys.stderr, dynamic_ncols=True)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        values = _scalars(metrics)
        shown = [k for k in self.keys if k in values] + sorted(k for k in values if k.startswith("val/"))
        line = f"step {step}: " + "  ".join(f"{self.keys.get(k, k)}={_fmt(values[k])}" for k in shown)
        self._write(line)
        if self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def log_samples(self, rows: Rows, step: int) -> None:
        for i, row in enumerate(rows):
            text = " | ".join(f"{k}: {_short(v)}" for k, v in row.items())
            self._write(f"step {step} sample {i}: {text}")

    def message(self, text: str) -> None:
        self._write(text)

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.file)
        else:
            print(line, file=self.file, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _fmt(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else str(v)


def _short(v: Any, limit: int = 200) -> str:
    s = str(_scalar(v)).replace("\n", "\\n")
    return s if len(s) <= limit else s[: limit - 3] + "..."


class JsonlLogger(MetricLogger):
    """``metrics.jsonl`` (one ``{"step": ..., <metric>: ...}`` line per call) and ``samples.jsonl`` in ``log_dir``.

    Files are appended to, so a resumed run continues them after `rewind` dropped the steps past its
    checkpoint; each step then has one line (`read_metrics` keeps the last line of a step all the same).
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.metrics_path = os.path.join(log_dir, "metrics.jsonl")
        self.samples_path = os.path.join(log_dir, "samples.jsonl")
        self._metrics = open(self.metrics_path, "a")
        self._samples = None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        row = {"step": step, **{k: _scalar(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(row, default=str) + "\n")
        self._metrics.flush()

    def log_samples(self, rows: Rows, step: int) -> None:
        if self._samples is None:
            self._samples = open(self.samples_path, "a")
        for row in rows:
            self._samples.write(json.dumps({"step": step, **{k: _scalar(v) for k, v in row.items()}}, default=str) + "\n")
        self._samples.flush()

    def rewind(self, step: int, row: Mapping[str, Any] | None = None) -> None:
        """Keep the lines of steps up to ``step`` in both files, so a resumed run's file has each step once."""
        logged = _truncate_after(self.metrics_path, step)
        if step > 0 and step not in logged and row:
            self.log(row, step)
        if os.path.exists(self.samples_path):
            _truncate_after(self.samples_path, step)

    def close(self) -> None:
        self._metrics.close()
        if self._samples is not None:
            self._samples.close()


def _truncate_after(path: str, step: int) -> set[int]:
    """Drop the lines of ``path`` whose step is above ``step`` (and a line cut short by a kill); returns the
    steps kept. Rewritten in place: an open append-mode handle keeps appending at the new end."""
    kept, steps = [], set()
    with open(path, "r+") as f:
        for line in f:
            try:
                row_step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                continue
            if row_step <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
                steps.add(row_step)
        f.seek(0)
        f.writelines(kept)
        f.truncate()
    return steps


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` sorted by step, one per step (the last logged wins, as after a resume)."""
    by_step: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_step[row["step"]] = {**by_step.get(row["step"], {}), **row}
    return [by_step[s] for s in sorted(by_step)]


class TensorBoardLogger(MetricLogger):
    """Scalars and sample tables via ``torch.utils.tensorboard`` (needs ``pip install tensorboard``)."""

    def __init__(self, log_dir: str | os.PathLike) -> None:
        # Imported here: tensorboard is optional, needed by this logger only.
        try:
            import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
        except ImportError:
            raise ImportError("the TensorBoard logger needs tensorboard: pip install tensorboard") from None
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=os.fspath(log_dir))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for k, v in _scalars(metrics).items():
            self._writer.add_scalar(k, v, global_step=step)
        self._writer.flush()

    def log_samples(self, rows: Rows, step: int) -> None:
        if not rows:
            return
        cols = list(rows[0])
        table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        table += ["| " + " | ".join(_short(r.get(c), 500).replace("|", "\\|") for c in cols) + " |" for r in rows]
        self._writer.add_text("samples", "\n".join(table), global_step=step)

    def close(self) -> None:
        self._writer.close()


class WandbLogger(MetricLogger):
    """Weights & Biases (needs ``pip install wandb``). ``mode="offline"`` (or ``WANDB_MODE=offline``)
    writes the run locally with no network; upload it later with ``wandb sync``."""

    def __init__(self, project: str, name: str | None = None, *, config: Mapping[str, Any] | None = None,
                 mode: str | None = None, log_dir: str | os.PathLike | None = None) -> None:
        try:  # imported here: wandb is optional (and slow to import), needed by this logger only
            import wandb
        except ImportError:
            raise ImportError("the wandb logger needs wandb: pip install wandb (or torchrlhf[wandb])") from None
        self._wandb = wandb
        self._run = wandb.init(project=project, name=name, config=dict(config or {}),
                               mode=mode or os.environ.get("WANDB_MODE"), dir=os.fspath(log_dir) if log_dir else None)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self._run.log(_scalars(metrics), step=step)

    def log_samples(self, rows: Rows, step: int) -> None:
        if rows:
            cols = list(rows[0])
            table = self._wandb.Table(columns=cols, data=[[_scalar(r.get(c)) for c in cols] for r in rows])
            self._run.log({"val/generations": table}, step=step)

    def close(self) -> None:
        self._run.finish()


class MultiLogger(MetricLogger):
    """Fans every call out to several loggers."""

    def __init__(self, loggers: Sequence[MetricLogger]) -> None:
        self.loggers = list(loggers)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def log_samples(self, rows: Rows, step: int) -> None:
        for logger in self.loggers:
            logger.log_samples(rows, step)

    def message(self, text: str) -> None:
        for logger in self.loggers:
            logger.message(text)

    def rewind(self, step: int, row: Mapping[str, Any] | None = None) -> None:
        for logger in self.loggers:
            logger.rewind(step, row)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


LOGGERS = ("console", "jsonl", "tensorboard", "wandb")


def build_logger(names: Sequence[str], *, log_dir: str | os.PathLike, total_steps: int | None = None,
                 project: str = "torchrlhf", experiment: str | None = None,
                 config: Mapping[str, Any] | None = None) -> MultiLogger:
    """A `MultiLogger` from names in `LOGGERS`; file-based loggers write under ``log_dir``."""
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ValueError(f"unknown logger(s) {unknown}; choose from {list(LOGGERS)}")
    loggers: list[MetricLogger] = []
    for name in names:
        if name == "console":
            loggers.append(ConsoleLogger(total_steps))
        elif name == "jsonl":
            loggers.append(JsonlLogger(log_dir))
        elif name == "tensorboard":
            loggers.append(TensorBoardLogger(os.path.join(log_dir, "tensorboard")))
        else:
            loggers.append(WandbLogger(project, experiment, config=config, log_dir=log_dir))
    return MultiLogger(loggers)
