"""Tests for meshtrain.metrics: FLOPs/MFU accounting, formatting, and MetricsLogger outputs."""

import json

import pytest

from meshtrain.metrics import (
    MetricsLogger,
    format_bytes,
    format_duration,
    mfu,
    peak_bf16_tflops,
)
from models.common import palm_train_flops_per_token

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_train_flops_per_token_hand_computed():
    # 6 * 1_000_000 + 12 * 4 * 128 * 256 = 6_000_000 + 1_572_864
    flops = palm_train_flops_per_token(matmul_params=1_000_000, num_layers=4, seq_len=128, attention_dim=256)
    assert flops == 7_572_864.0


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA B200", 2250.0),
        ("cpu", None),
        ("TPU v5", None),
        ("", None),
    ],
)
def test_peak_bf16_tflops(kind, expected):
    assert peak_bf16_tflops(kind) == expected


def test_mfu():
    assert mfu(494.5, None) is None
    assert mfu(494.5, 989.0) == pytest.approx(0.5)
    assert mfu(494.5, peak_bf16_tflops("NVIDIA H100 80GB HBM3")) == pytest.approx(0.5)


def test_format_bytes_decimal():
    assert format_bytes(512) == "512 B"
    assert format_bytes(29_900_000) == "29.9 MB"
    assert format_bytes(141_000_000_000) == "141.0 GB"


def test_format_duration():
    assert format_duration(0) == "0s"
    assert format_duration(42.4) == "42s"
    assert format_duration(62) == "1m02s"
    assert format_duration(3 * 3600 + 4 * 60 + 5) == "3h04m"
    assert format_duration(2 * 86400 + 5 * 3600) == "2d05h"


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_logger_writes_jsonl_tensorboard_summary_and_png(tmp_path):
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, total_steps=30, is_primary=True, live=False)
    logger.log(10, {"loss": 3.5, "grad_norm": 1.25, "tokens_per_sec": 1000.0, "mfu": None})
    logger.log(20, {"loss": 2.5, "tokens_per_sec": 3000.0})
    logger.log(30, {"loss": float("nan"), "tokens_per_sec": 5000.0})
    lines = _read_jsonl(run_dir / "metrics.jsonl")
    assert lines == [
        {"loss": 3.5, "grad_norm": 1.25, "tokens_per_sec": 1000.0, "mfu": None, "step": 10},
        {"loss": 2.5, "tokens_per_sec": 3000.0, "step": 20},
        {"loss": "nan", "tokens_per_sec": 5000.0, "step": 30},
    ]
    logger.close({"entropy_floor": 1.9, "compile_s": 12.5})

    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["first_loss"] == 3.5
    assert summary["last_loss"] == "nan"
    assert summary["best_loss"] == 2.5
    assert summary["mean_tokens_per_sec"] == 4000.0  # first logged step excluded
    assert summary["steps"] == 30
    assert summary["total_steps"] == 30
    assert summary["entropy_floor"] == 1.9
    assert summary["compile_s"] == 12.5
    assert (run_dir / "loss.png").read_bytes()[:8] == PNG_MAGIC


def test_second_logger_appends(tmp_path):
    with MetricsLogger(tmp_path, total_steps=4, is_primary=True, tensorboard=False, live=False) as logger:
        logger.log(1, {"loss": 4.0})
        logger.log(2, {"loss": 3.0})
    with MetricsLogger(tmp_path, total_steps=4, is_primary=True, tensorboard=False, live=False) as logger:
        logger.log(3, {"loss": 2.0})
    assert [line["step"] for line in _read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert not (tmp_path / "tensorboard").exists()


def test_non_primary_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, total_steps=10, is_primary=False, live=False)
    logger.log(1, {"loss": 1.0})
    logger.close({"entropy_floor": 0.5})
    assert not run_dir.exists()
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr() == ("", "")


def test_plain_progress_lines(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, total_steps=300, is_primary=True, tensorboard=False, live=False)
    logger.log(10, {"loss": 3.21044, "grad_norm": 0.8123, "tokens_per_sec": 12345.0, "mfu": None})
    logger.log(20, {"loss": 3.1, "tokens_per_sec": 12000.0, "mfu": 0.4})
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step  10/300")
    assert "loss 3.2104" in lines[0]
    assert "grad_norm 0.812" in lines[0]
    assert "tok/s 12.3k" in lines[0]
    assert "mfu -" in lines[0]
    assert "eta -" in lines[0]  # no step time known yet
    assert lines[1].startswith("step  20/300")
    assert "loss 3.1000" in lines[1]
    assert "mfu 40.0%" in lines[1]
    assert "eta " in lines[1] and "eta -" not in lines[1]
    logger.close()
    err = capsys.readouterr().err
    assert "run summary" in err and "best_loss" in err


def test_live_progress_runs(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, total_steps=2, is_primary=True, tensorboard=False, live=True)
    logger.log(1, {"loss": 2.0, "tokens_per_sec": 100.0})
    logger.log(2, {"loss": 1.0, "tokens_per_sec": 100.0})
    logger.close()
    assert "run summary" in capsys.readouterr().err
    assert len(_read_jsonl(tmp_path / "metrics.jsonl")) == 2


def test_loss_png_after_a_resume_shows_the_whole_run(tmp_path, monkeypatch):
    """Issue 52, item 3: the steps earlier segments logged up to the resumed step (a step a crashed
    segment logged after it, and a line cut by the crash, are not), then this segment's."""
    from meshtrain import metrics

    plotted = {}
    monkeypatch.setattr(metrics, "_plot_loss", lambda path, steps, losses, **kw: plotted.update(
        steps=list(steps), losses=list(losses), eval_steps=list(kw["eval_steps"])))
    earlier = [{"step": s, "loss": 10.0 - s} for s in range(1, 5)] + [{"step": 4, "eval_loss": 7.5},
                                                                     {"step": 5, "loss": 99.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier) + '{"step": 6, "lo')
    with metrics.MetricsLogger(tmp_path, 6, is_primary=True, tensorboard=False, live=False,
                               resumed_from=4) as logger:
        for step in (5, 6):
            logger.log(step, {"loss": 1.0 / step})
    assert plotted["steps"] == [1, 2, 3, 4, 5, 6] and plotted["eval_steps"] == [4]
    assert plotted["losses"] == [9.0, 8.0, 7.0, 6.0, 0.2, 1.0 / 6]
    last = (tmp_path / "metrics.jsonl").read_text().splitlines()[-2:]  # the cut line stays apart from the new ones
    assert [json.loads(line)["step"] for line in last] == [5, 6]
