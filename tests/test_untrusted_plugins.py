"""Files a user may download run no code: a run's checkpoint or an export that names a ``model.plugin``
is refused by every tool that loads it unless ``--trust-plugin`` is given; a plugin that fails to
import is one line naming its file.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

from meshtrain import convert, export, generate, logits
from meshtrain.checkpoint import CHECKPOINT_DIR
from meshtrain.train import main
from meshtrain.weights.export_format import EXPORT_META, PARAMS_DIR
from utils import TINY


PAYLOAD = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")
"""


def _payload(directory: pathlib.Path, name: str) -> tuple[pathlib.Path, pathlib.Path]:
    """A plugin file (module ``name``) that leaves a marker file when imported: (the file, the marker)."""
    marker = directory / f"{name}.ran"
    plugin = directory / f"{name}.py"
    plugin.write_text(PAYLOAD.format(marker=str(marker)))
    return plugin, marker


@pytest.fixture(scope="module")
def run_with_a_plugin(one_step_run, tmp_path_factory):
    """A copy of ``one_step_run`` whose checkpoint's recorded config names a payload plugin: (run,
    marker, plugin, tokens)."""
    root = tmp_path_factory.mktemp("untrusted")
    run_dir = root / "run"
    shutil.copytree(one_step_run, run_dir)
    plugin, marker = _payload(root, "downloaded_payload")
    meta_path = run_dir / CHECKPOINT_DIR / "1" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["config"]["model"]["plugin"] = str(plugin)
    meta_path.write_text(json.dumps(meta))
    tokens = root / "tokens.npy"
    np.save(tokens, np.arange(8, dtype=np.int32)[None])
    return run_dir, marker, plugin, tokens


def _refused(code: int, capsys, plugin: pathlib.Path, field: str) -> None:
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {field}: ") and str(plugin) in err and "--trust-plugin" in err, err


def test_every_tool_refuses_a_runs_plugin_without_trust_plugin(run_with_a_plugin, tmp_path, capsys):
    run_dir, marker, plugin, tokens = run_with_a_plugin
    _refused(logits.main(["--model", str(run_dir), "--tokens", str(tokens), "--out", str(tmp_path / "l.npy")]),
             capsys, plugin, "--model")
    _refused(export.main(["--run", str(run_dir), "--out", str(tmp_path / "export")]), capsys, plugin, "--run")
    _refused(convert.main(["to-hf", "--from", str(run_dir), "--out", str(tmp_path / "hf")]), capsys, plugin, "--from")
    _refused(generate.main(["--run", str(run_dir), "--prompt", "a", "--max-new-tokens", "1"]), capsys, plugin,
             "--run")
    assert not marker.exists()  # no code ran
    assert not (tmp_path / "export").exists() and not (tmp_path / "hf").exists() and not (tmp_path / "l.npy").exists()


def test_trust_plugin_imports_it(run_with_a_plugin, tmp_path, capsys):
    run_dir, marker, _, tokens = run_with_a_plugin
    out = tmp_path / "logits.npy"
    assert logits.main(["--model", str(run_dir), "--tokens", str(tokens), "--out", str(out), "--trust-plugin"]) == 0
    assert marker.read_text() == "ran" and np.load(out).shape[:2] == (1, 8)


def test_an_export_that_ships_its_own_plugin_is_refused_before_any_read(tmp_path, capsys, monkeypatch):
    """An export whose meshtrain.json names a plugin file beside it (a relative path)."""
    export_dir = tmp_path / "export"
    (export_dir / PARAMS_DIR).mkdir(parents=True)
    plugin, marker = _payload(export_dir, "shipped_payload")
    (export_dir / EXPORT_META).write_text(json.dumps({"model": {"family": "llama", "plugin": plugin.name}}))
    monkeypatch.chdir(export_dir)  # where the relative path would resolve
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.zeros((1, 4), np.int32))
    code = logits.main(["--model", str(export_dir), "--tokens", str(tokens), "--out", str(tmp_path / "l.npy")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and str(export_dir / EXPORT_META) in err and plugin.name in err, err
    assert "--trust-plugin" in err and not marker.exists()


@pytest.mark.parametrize("source, shown", [
    ("def broken(:\n", "SyntaxError at line 1"),
    ("raise RuntimeError('the plugin refuses to load')\n", "RuntimeError: the plugin refuses to load"),
], ids=["syntax-error", "raises"])
def test_a_plugin_that_fails_to_import_is_one_line_naming_its_file(tmp_path, capsys, source, shown):
    plugin = tmp_path / f"failing_plugin_{len(source)}.py"
    plugin.write_text(source)
    assert main(["--config", TINY, f"model.plugin={plugin}", f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: model.plugin: cannot import {plugin}: {shown}"), err
