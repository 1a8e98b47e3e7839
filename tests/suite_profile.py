"""Where the suite's time goes (``make test-profile``): a pytest plugin that adds up, per test file,
the wall time of its tests and the JAX time inside them (tracing to jaxprs, lowering to MLIR, XLA
compiling, compiles served by the persistent cache) from ``jax.monitoring``'s duration events, and
prints the files that cost most. Each pytest-xdist worker writes its totals to
``$SUITE_PROFILE_DIR`` (default ``.suite-profile/``); the controller merges them at the end and
writes ``summary.json`` there.

Only in-process work is seen: a test's subprocesses count in its wall time, not in its compiles.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import time

import pytest

# jax.monitoring's duration events -> the column each adds to.
EVENTS = {"jaxpr_trace_duration": "trace_s", "jaxpr_to_mlir_module_duration": "lower_s",
          "backend_compile_duration": "compile_s", "cache_retrieval_time_sec": "cache_load_s"}
COLUMNS = ("wall_s", "tests", "compile_s", "compiles", "trace_s", "lower_s", "cache_load_s")
SHOWN = 30


def _out_dir(config: pytest.Config) -> pathlib.Path:
    return pathlib.Path(os.environ.get("SUITE_PROFILE_DIR", config.rootpath / ".suite-profile"))


class SuiteProfile:
    def __init__(self):
        self.current: str | None = None
        self.files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def event(self, event: str, duration: float, **_) -> None:
        column = EVENTS.get(event.rsplit("/", 1)[-1])
        if column is not None and self.current is not None:
            self.files[self.current][column] += duration
            if column == "compile_s":
                self.files[self.current]["compiles"] += 1

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.current = item.nodeid.split("::")[0]
        start = time.perf_counter()
        yield
        self.files[self.current]["wall_s"] += time.perf_counter() - start
        self.files[self.current]["tests"] += 1
        self.current = None

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        out = _out_dir(session.config)
        out.mkdir(exist_ok=True)
        worker = getattr(session.config, "workerinput", None)  # pytest-xdist's, in a worker only
        if worker is not None:  # a worker: its own totals; the controller merges them
            (out / f"{worker['workerid']}.json").write_text(json.dumps(self.files))
            return
        merged: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for part in [*out.glob("gw*.json"), None]:
            files = self.files if part is None else json.loads(part.read_text())
            for name, totals in files.items():
                merged[name].update(totals)
        (out / "summary.json").write_text(json.dumps(merged, indent=1, sort_keys=True))
        self.rows = sorted(merged.items(), key=lambda item: -item[1]["wall_s"])

    def pytest_terminal_summary(self, terminalreporter) -> None:
        rows = getattr(self, "rows", [])
        total = collections.Counter()
        for _, totals in rows:
            total.update(totals)
        write = terminalreporter.write_line
        write(f"suite profile ({_out_dir(terminalreporter.config) / 'summary.json'}): seconds summed over workers")
        write(f"{'file':<36}" + "".join(f"{column:>13}" for column in COLUMNS))
        for name, totals in [*rows[:SHOWN], ("all files", total)]:
            cells = (f"{totals[column]:>13.0f}" if column.endswith("_s") else f"{totals[column]:>13d}"
                     for column in COLUMNS)
            write(f"{name.removeprefix('tests/'):<36}" + "".join(cells))


def pytest_configure(config: pytest.Config) -> None:
    import jax

    if not hasattr(config, "workerinput"):  # the controller (or a run without workers): a fresh directory
        for stale in _out_dir(config).glob("*.json"):
            stale.unlink()
    profile = SuiteProfile()
    jax.monitoring.register_event_duration_secs_listener(profile.event)
    config.pluginmanager.register(profile, "suite-profile")
