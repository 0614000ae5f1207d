from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchrlhf.utils.logging import (
    ConsoleLogger,
    JsonlLogger,
    MultiLogger,
    TensorBoardLogger,
    WandbLogger,
    build_logger,
    read_metrics,
)
from torchrlhf.utils.timer import timer

REPO = Path(__file__).resolve().parents[2]


def test_jsonl_logger_round_trip(tmp_path):
    with JsonlLogger(tmp_path) as logger:
        logger.log({"critic/score/mean": torch.tensor(0.5), "actor/ppo_kl": 0.01, "note": "x"}, step=1)
        logger.log({"critic/score/mean": 0.75}, step=2)
        logger.log_samples([{"prompt": "2+2=", "response": "4", "score": 1.0}], step=2)
    # A resumed run appends and re-logs step 2: the last value wins.
    with JsonlLogger(tmp_path) as logger:
        logger.log({"critic/score/mean": 0.8}, step=2)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows == [{"step": 1, "critic/score/mean": 0.5, "actor/ppo_kl": 0.01, "note": "x"},
                    {"step": 2, "critic/score/mean": 0.8}]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples == [{"step": 2, "prompt": "2+2=", "response": "4", "score": 1.0}]


def test_jsonl_rewind_keeps_each_step_once(tmp_path):
    """A job killed after its step-2 checkpoint logged steps 3-4 (the last line cut short); the restarted
    job resumes from step 2: rewinding drops steps 3-4, and the re-run steps are appended once."""
    with JsonlLogger(tmp_path) as logger:
        for step in range(5):
            logger.log({"x": float(step)}, step=step)
            logger.log_samples([{"response": f"r{step}"}], step=step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "x": ')  # killed mid-write
    with JsonlLogger(tmp_path) as logger:
        logger.rewind(2, {"x": 99.0})  # step 2 is there: the checkpoint's row is not added
        logger.log({"x": 3.5}, step=3)
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == \
        [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.5)]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4
    samples = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples == [0, 1, 2]


def test_jsonl_rewind_restores_a_checkpointed_step_never_logged(tmp_path):
    """Killed between writing the checkpoint of step 2 and logging step 2: the checkpoint's row is logged."""
    with JsonlLogger(tmp_path) as logger:
        logger.log({"x": 1.0}, step=1)
    with JsonlLogger(tmp_path) as logger:
        logger.rewind(2, {"x": 2.0})
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 2.0)]


def test_console_logger_line_and_samples():
    out = io.StringIO()
    logger = ConsoleLogger(total_steps=None, file=out)
    logger.log({"critic/score/mean": 0.5, "actor/pg_loss": torch.tensor(-0.25), "val/gsm8k/acc": 0.1,
                "other/x": 3.0}, step=4)
    logger.log_samples([{"prompt": "a\nb", "response": "c"}], step=4)
    logger.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 4: score=0.5  pg_loss=-0.25  val/gsm8k/acc=0.1"
    assert lines[1] == "step 4 sample 0: prompt: a\\nb | response: c"


def test_message_reaches_the_console_only(tmp_path):
    out = io.StringIO()
    logger = MultiLogger([ConsoleLogger(total_steps=None, file=out), JsonlLogger(tmp_path)])
    logger.message("validation before -> after training: x")
    logger.close()
    assert out.getvalue() == "validation before -> after training: x\n"
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_console_logger_with_progress_bar():
    out = io.StringIO()
    logger = ConsoleLogger(total_steps=3, file=out)
    logger.log({"critic/score/mean": 1.0}, step=1)
    logger.close()
    assert "step 1: score=1" in out.getvalue()


def test_multi_logger_and_build(tmp_path):
    logger = build_logger(["jsonl", "console"], log_dir=tmp_path, total_steps=None)
    assert isinstance(logger, MultiLogger)
    logger.log({"a": 1}, step=0)
    logger.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "a": 1}]
    with pytest.raises(ValueError, match=r"unknown logger\(s\) \['tensorbord'\]"):
        build_logger(["tensorbord"], log_dir=tmp_path)


def test_optional_backends_error_or_work(tmp_path):
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            TensorBoardLogger(tmp_path / "tb")
    else:
        with TensorBoardLogger(tmp_path / "tb") as tb:
            tb.log({"a": 1.0}, step=1)
        assert any((tmp_path / "tb").iterdir())
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ImportError, match="pip install wandb"):
            WandbLogger("p", mode="offline", log_dir=tmp_path)
    else:
        with WandbLogger("p", "run", mode="offline", log_dir=tmp_path) as wb:
            wb.log({"a": 1.0}, step=1)


def test_timer():
    timings: dict[str, float] = {}
    with timer("gen", timings):
        sum(range(1000))
    with timer("reward", timings, accumulate=True):
        pass
    with timer("reward", timings, accumulate=True):
        pass
    with pytest.raises(RuntimeError):
        with timer("fail", timings):
            raise RuntimeError
    assert set(timings) == {"timing_s/gen", "timing_s/reward", "timing_s/fail"}
    assert all(v >= 0 for v in timings.values())


def test_plot_metrics_tool(tmp_path):
    with JsonlLogger(tmp_path) as logger:
        for step in range(1, 5):
            logger.log({"critic/score/mean": 0.1 * step, "actor/kl_loss": 0.01, "response_length/mean": 20 + step,
                        "val/arithmetic/acc": 0.2, "actor/entropy": 1.0}, step=step)
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import plot_metrics
    finally:
        sys.path.pop(0)
    series = plot_metrics.collect_series(read_metrics(tmp_path / "metrics.jsonl"))
    assert series["training reward"]["critic/score/mean"] == ([1, 2, 3, 4], pytest.approx([0.1, 0.2, 0.3, 0.4]))
    assert series["kl to the reference"]["actor/kl_loss"][0] == [1, 2, 3, 4]
    assert list(series["validation accuracy"]) == ["val/arithmetic/acc"]
    assert "response_length/mean" in series["response length"] and "actor/entropy" in series["entropy"]
    if importlib.util.find_spec("matplotlib") is None:
        return
    out = tmp_path / "curves.png"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "plot_metrics.py"), str(tmp_path / "metrics.jsonl"),
                           str(tmp_path / "metrics.jsonl"), "--labels", "a", "b", "--out", str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"})
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
