"""Training metrics: FLOPs and MFU accounting, and the run's metrics logger.

FLOPs per trained token are the model family's (``FamilyCosts.flops_per_token``);
the built-in families follow the PaLM-paper convention (also used by MaxText
and torchtitan, ``models.common.palm_train_flops_per_token``)::

    flops_per_token = 6 * N + 12 * L * T * (H * Dh)

* ``6 * N``: forward (2N) plus backward (4N) of the weight matmuls. ``N`` counts
  matmul weights only: it excludes the input-embedding table (a gather, no FLOPs)
  and includes the output head.
* ``12 * L * T * (H * Dh)``: the attention score (QK^T) and value (AV) matmuls
  over ``L`` layers at sequence length ``T`` with ``H`` heads of size ``Dh``,
  forward plus backward, *not* halved for the causal mask.

Model FLOPs utilisation is achieved TFLOP/s per device over the device's dense
bf16 peak: ``mfu = tflops_per_device / peak_bf16_tflops(device_kind)``.

:class:`MetricsLogger` writes, on the primary process only,
``<run_dir>/metrics.jsonl`` (one JSON object per ``log`` call; non-finite floats
are written as the strings ``"nan"``, ``"inf"``, ``"-inf"`` so every line is
valid JSON), the same scalars to its trackers (TensorBoard under
``<run_dir>/tensorboard``, Weights & Biases, MLflow: ``meshtrain.trackers``), and at close
``summary.json`` and ``loss.png``. A metric whose value is a list (one number per
component, e.g. an MoE layer's share of tokens per expert) is also logged as its
``<key>_max`` and ``<key>_min``, goes to the trackers as ``<key>/<i>``, and is
plotted at close as ``<key>.png`` (one line per component).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from meshtrain.trackers import TENSORBOARD_DIR, Status, TensorBoardTracker, Tracker, close_trackers, scalars
from meshtrain.errors import cut

# Dense (non-sparse) bf16 peak TFLOP/s per device, most specific pattern first (NVIDIA's datasheets:
# H100 SXM 989, H200 the same compute, B200 2.25 PFLOP/s; ``meshtrain.gpu_compile.Target`` reads them).
# Patterns are matched case-insensitively against JAX's ``device.device_kind``.
_PEAK_BF16_TFLOPS: tuple[tuple[re.Pattern[str], float], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), tflops)
    for pattern, tflops in (
        (r"\bH100\b.*\bPCIe\b", 756.0),
        (r"\bH100\b.*\bNVL\b", 835.0),
        (r"\bH100\b", 989.0),  # SXM, e.g. "NVIDIA H100 80GB HBM3"
        (r"\bH200\b", 989.0),
        (r"\bA100\b", 312.0),
        (r"\bB200\b", 2250.0),
    )
)

_SI_PREFIXES = ("", "k", "M", "G", "T", "P", "E")


def peak_bf16_tflops(device_kind: str) -> float | None:
    """Dense bf16 peak TFLOP/s of a device from its ``device_kind``; ``None`` if unknown (CPU)."""
    return next((tflops for pattern, tflops in _PEAK_BF16_TFLOPS if pattern.search(device_kind)), None)


def mfu(tflops_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction of ``peak`` TFLOP/s; ``None`` when the peak is unknown."""
    return None if peak is None else tflops_per_device / peak


def _scale(x: float) -> tuple[float, str]:
    """``x`` divided by powers of 1000 until below 1000, with its SI prefix."""
    for prefix in _SI_PREFIXES[:-1]:
        if abs(x) < 1000:
            return x, prefix
        x /= 1000
    return x, _SI_PREFIXES[-1]


def format_bytes(n: int) -> str:
    """A byte count in decimal (SI, powers of 1000) units: ``"512 B"``, ``"29.9 MB"``."""
    value, prefix = _scale(float(n))
    return f"{n} B" if not prefix else f"{value:.1f} {prefix}B"


def format_duration(seconds: float) -> str:
    """A duration rounded to whole seconds: ``"42s"``, ``"1m02s"``, ``"3h04m"``, ``"2d05h"``."""
    s = max(0, round(seconds))
    minutes, s = divmod(s, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{s:02d}s"
    return f"{s}s"


def _format_count(x: float) -> str:
    """A rate with an SI suffix: ``"512"``, ``"12.3k"``."""
    value, prefix = _scale(x)
    return f"{value:.0f}" if not prefix else f"{value:.1f}{prefix}"


def _json_value(value: object) -> object:
    """``value`` as plain JSON data: non-finite floats as ``"nan"``/``"inf"``/``"-inf"``, unknown types as str."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else str(float(value))
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return str(value)


# Metrics shown on the progress line, in order: (key, label, formatter).
_DISPLAYED: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("loss", "loss", "{:.4f}".format),
    ("grad_norm", "grad_norm", "{:.3f}".format),
    ("lr", "lr", "{:.2e}".format),
    ("tokens_per_sec", "tok/s", _format_count),
    ("tflops_per_device", "tflops/dev", "{:.3g}".format),
    ("mfu", "mfu", "{:.1%}".format),
    ("eval_loss", "eval_loss", "{:.4f}".format),
    ("eval_bits_per_byte", "eval_bpb", "{:.4f}".format),
)


@dataclasses.dataclass(frozen=True)
class _Losses:
    """Train and held-out losses by step, as ``metrics.jsonl`` logged them."""

    steps: list[int]
    losses: list[float]
    eval_steps: list[int]
    eval_losses: list[float]


def _ends_a_line(path: Path) -> bool:
    with path.open("rb") as stream:
        stream.seek(-1, 2)
        return stream.read(1) == b"\n"


def _logged_losses(path: Path, until: int) -> _Losses:
    """The losses ``path`` (a run's metrics.jsonl) logged at steps up to ``until`` (the latest line of
    each step: a step redone after a crash logged twice); a line cut by a crash is skipped."""
    train, held_out = {}, {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or step > until:
            continue
        for key, kept in (("loss", train), ("eval_loss", held_out)):
            if isinstance(record.get(key), (int, float)):
                kept[step] = float(record[key])
    return _Losses(sorted(train), [train[s] for s in sorted(train)], sorted(held_out),
                   [held_out[s] for s in sorted(held_out)])


def _plot_loss(
    path: Path, steps: Sequence[int], losses: Sequence[float], *, entropy_floor: float | None, title: str,
    eval_steps: Sequence[int] = (), eval_losses: Sequence[float] = (),
) -> None:
    """Write a loss-vs-step PNG (train, and held-out when evaluated), with a dashed line at
    ``entropy_floor`` when given."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, losses, label="train loss")
    if eval_steps:
        ax.plot(eval_steps, eval_losses, marker="o", label="eval loss")
    if entropy_floor is not None:
        ax.axhline(entropy_floor, linestyle="--", color="gray", label="entropy floor")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")


def _plot_components(path: Path, key: str, steps: Sequence[int], values: Sequence[Sequence[float]], title: str) -> None:
    """Write a PNG of a list-valued metric over steps, one line per component."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    series = np.asarray(values, dtype=float)
    for component in range(series.shape[1]):
        ax.plot(steps, series[:, component], label=str(component))
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if series.shape[1] <= 16:
        ax.legend(ncol=min(8, series.shape[1]), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")


def _with_extremes(metrics: Mapping[str, object]) -> dict[str, object]:
    """``metrics`` with ``<key>_max`` and ``<key>_min`` after each list-valued one."""
    out: dict[str, object] = {}
    for key, value in metrics.items():
        out[key] = value
        if isinstance(value, (list, tuple)) and value:
            out[f"{key}_max"], out[f"{key}_min"] = max(value), min(value)
    return out


class MetricsLogger:
    """Logs per-step metrics to JSONL, the trackers and stderr; summarises the run at close.

    Only the primary process (``is_primary``) writes anything; on other processes
    every method is a no-op and ``run_dir`` is not touched. An existing
    ``metrics.jsonl`` is appended to, so a resumed run continues it.

    Keys shown on the progress line when present: ``loss``, ``grad_norm``, ``lr``,
    ``tokens_per_sec``, ``tflops_per_device``, ``mfu`` (a fraction). All keys go to
    the JSONL file; the numbers among them go to the trackers (``meshtrain.trackers.scalars``).

    Args:
      run_dir: the run's output directory, created if missing.
      total_steps: the step the run ends at, for progress and ETA.
      is_primary: whether this is process 0.
      tensorboard: whether to write TensorBoard event files under ``run_dir/tensorboard``.
      trackers: more trackers (``meshtrain.trackers.open_trackers``), closed with the logger.
      live: a ``rich`` progress bar (True) or one plain stderr line per ``log``
        (False); ``None`` chooses live iff stderr is a TTY.
    """

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        is_primary: bool,
        tensorboard: bool = True,
        live: bool | None = None,
        trackers: Sequence[Tracker] = (),
        resumed_from: int | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.is_primary = is_primary
        self._closed = False
        self._steps: list[int] = []
        self._losses: list[float] = []
        self._tokens_per_sec: list[float] = []
        self._eval_steps: list[int] = []
        self._eval_losses: list[float] = []
        self._components: dict[str, tuple[list[int], list[list[float]]]] = {}  # list-valued metrics
        self._first_log: tuple[int, float] | None = None  # (step, monotonic time)
        if not is_primary:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # loss.png shows the whole run: what earlier segments logged up to the step this one resumes from.
        self._earlier = _logged_losses(self.run_dir / "metrics.jsonl", resumed_from) if resumed_from else None
        self._jsonl = (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        if self._jsonl.tell() > 0 and not _ends_a_line(self.run_dir / "metrics.jsonl"):
            self._jsonl.write("\n")  # a line a killed segment left unfinished stays apart from the next
        self._trackers = [*([TensorBoardTracker(self.run_dir / TENSORBOARD_DIR)] if tensorboard else []), *trackers]
        self._progress: Progress | None = None
        if live if live is not None else sys.stderr.isatty():
            self._progress = Progress(
                TextColumn("step"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  tok/s {task.fields[tok_s]}  eta {task.fields[eta]}"),
                console=Console(file=sys.stderr),
            )
            self._task = self._progress.add_task("train", total=total_steps, loss="-", tok_s="-", eta="-")
            self._progress.start()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def log(self, step: int, metrics: Mapping[str, float | int | None]) -> None:
        """Record ``metrics`` for ``step``: one JSONL line (flushed), the trackers' scalars, progress."""
        if not self.is_primary:
            return
        now = time.monotonic()
        metrics = _with_extremes(metrics)
        self._jsonl.write(json.dumps(_json_value({**metrics, "step": step})) + "\n")
        self._jsonl.flush()
        for key, value in metrics.items():
            if isinstance(value, (list, tuple)):
                steps, values = self._components.setdefault(key, ([], []))
                steps.append(step)
                values.append([float(v) for v in value])
        if self._trackers:
            numbers = scalars(metrics)
            self._to_trackers(step, lambda tracker: tracker.log(step, numbers))

        if metrics.get("loss") is not None:
            self._steps.append(step)
            self._losses.append(float(metrics["loss"]))
        if metrics.get("tokens_per_sec") is not None:
            self._tokens_per_sec.append(float(metrics["tokens_per_sec"]))
        if metrics.get("eval_loss") is not None:
            self._eval_steps.append(step)
            self._eval_losses.append(float(metrics["eval_loss"]))
        if self._first_log is None:
            self._first_log = (step, now)
        first_step, first_time = self._first_log
        eta = (
            format_duration((now - first_time) / (step - first_step) * max(0, self.total_steps - step))
            if step > first_step
            else "-"
        )

        shown = {
            key: (label, "-" if metrics[key] is None else fmt(float(metrics[key])))
            for key, label, fmt in _DISPLAYED
            if key in metrics and ("loss" in metrics or metrics[key] is not None)
        }
        if self._progress is not None and "loss" not in metrics:  # an evaluation: a line above the bar
            parts = [f"step {step}"] + [f"{label} {text}" for label, text in shown.values()]
            self._progress.console.print("  ".join(parts))
        elif self._progress is not None:
            self._progress.update(
                self._task,
                completed=step,
                loss=shown.get("loss", ("", "-"))[1],
                tok_s=shown.get("tokens_per_sec", ("", "-"))[1],
                eta=eta,
            )
        else:
            width = len(str(self.total_steps))
            fields = [f"step {step:>{width}}/{self.total_steps}"]
            fields += [f"{label} {text}" for label, text in shown.values()]
            if "loss" in metrics:
                fields.append(f"eta {eta}")
            print("  ".join(fields), file=sys.stderr, flush=True)

    def _to_trackers(self, step: int, record: Callable[[Tracker], None]) -> None:
        """``record(tracker)`` for each tracker; one that fails (its store gone, a server out of
        reach) is dropped with one warning line: the run goes on, and metrics.jsonl keeps every step."""
        for tracker in list(self._trackers):
            try:
                record(tracker)
            except Exception as err:  # noqa: BLE001 - the libraries' own errors (OSError, MlflowException, ...)
                self._trackers.remove(tracker)
                first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
                print(f"warning: run.loggers: {tracker.name} failed at step {step} ({cut(first)}) and logs "
                      f"nothing more in this run; {self.run_dir / 'metrics.jsonl'} keeps every step",
                      file=sys.stderr, flush=True)

    def log_samples(self, step: int, samples: list[dict[str, str]]) -> None:
        """Record text samples (``{"prompt", "text"}`` each) for ``step``: one JSONL line
        ``{"step", "samples"}``, the trackers' text, and each sample on the console (cut to 200
        characters)."""
        if not self.is_primary:
            return
        self._jsonl.write(json.dumps({"step": step, "samples": samples}) + "\n")
        self._jsonl.flush()
        self._to_trackers(step, lambda tracker: tracker.log_samples(step, samples))
        for sample in samples:
            line = f"step {step} sample: {sample['prompt']!r} -> {sample['text']!r}"
            line = line if len(line) <= 200 else line[:197] + "..."
            if self._progress is not None:
                self._progress.console.print(line, markup=False)
            else:
                print(line, file=sys.stderr, flush=True)

    def summary_stats(self) -> dict[str, object]:
        """Loss and throughput statistics over the steps logged by this logger."""
        finite = [x for x in self._losses if math.isfinite(x)]
        throughput = self._tokens_per_sec[1:]  # the first logged step includes compilation
        return {
            "steps": self._steps[-1] if self._steps else None,
            "total_steps": self.total_steps,
            "first_loss": self._losses[0] if self._losses else None,
            "last_loss": self._losses[-1] if self._losses else None,
            "best_loss": min(finite) if finite else None,
            "mean_tokens_per_sec": sum(throughput) / len(throughput) if throughput else None,
            **({"last_eval_loss": self._eval_losses[-1]} if self._eval_losses else {}),
        }

    def close(self, summary: Mapping[str, object] | None = None, *, print_summary: bool = True) -> None:
        """Finish the run: stop the display, close files and trackers, print and write the summary, plot the loss.

        ``summary`` holds extra entries (compile time, ``entropy_floor``, per-device
        memory, ...) merged after the computed statistics. ``print_summary=False`` (a run ended by
        an error) writes summary.json without printing a summary that would look like a normal end.
        Idempotent.
        """
        if not self.is_primary or self._closed:
            return
        self._closed = True
        extra = dict(summary or {})
        if self._progress is not None:
            self._progress.stop()
        self._jsonl.close()
        status = (Status.FAILED if extra.get("stopped_by_error") else Status.PREEMPTED if extra.get("preempted")
                  else Status.FINISHED)
        try:
            close_trackers(self._trackers, status)  # before the summary, which W&B's closing lines would follow
        except Exception as err:  # noqa: BLE001 - a tracker's store gone at the end: the run's own files stand
            first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
            print(f"warning: run.loggers: a tracker failed to close its run ({cut(first)}); "
                  f"{self.run_dir / 'metrics.jsonl'} keeps every step", file=sys.stderr, flush=True)
        finally:
            self._write_summary(extra, print_summary)

    def _write_summary(self, extra: dict[str, object], print_summary: bool) -> None:
        """summary.json, the printed summary, loss.png and the plots of list-valued metrics."""
        result = _json_value({**self.summary_stats(), **extra})
        (self.run_dir / "summary.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        lines = [f"run summary ({self.run_dir})"]
        lines += [
            f"  {key:<20} {format(value, '.6g') if isinstance(value, float) else value}"
            for key, value in result.items()
        ]
        if print_summary:
            print("\n".join(lines), file=sys.stderr, flush=True)

        floor = extra.get("entropy_floor")
        earlier = self._earlier or _Losses([], [], [], [])
        _plot_loss(
            self.run_dir / "loss.png",
            earlier.steps + self._steps,
            earlier.losses + self._losses,
            entropy_floor=None if floor is None else float(floor),
            title=f"{self.run_dir.name} ({self.run_dir})",
            eval_steps=earlier.eval_steps + self._eval_steps,
            eval_losses=earlier.eval_losses + self._eval_losses,
        )
        for key, (steps, values) in self._components.items():
            if len({len(v) for v in values}) == 1:
                _plot_components(self.run_dir / f"{key}.png", key, steps, values, f"{key} ({self.run_dir.name})")
