"""The docs' commands and figures stay true (issue 52, item 4). ``scripts/check_docs.py`` runs every command
README.md and docs/*.md show from a fresh clone (``make docs-check``: minutes, not part of the suite) and
``scripts/docs_figures.py`` regenerates the figures that come from runs (``make docs-figures``); these tests
hold, in a second, what can be read without running anything: how the checker reads a doc, that every
command it would run is runnable as written (no placeholder, each training run its own ``run.dir``), that
``convert`` commands parse, and figures a doc restates from code (the presets' table). The scripts run as
commands (``--list --json``), never imported: scripts and tests do not import each other (test_imports.py).
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import subprocess
import sys
import types

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _listed(script: str, *args: str):
    """What ``scripts/SCRIPT --list --json ARGS`` prints, its objects read as namespaces."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--list", "--json", *args], cwd=REPO,
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout, object_hook=lambda fields: types.SimpleNamespace(**fields))


ALL = _listed("check_docs.py")
FIGURES = _listed("docs_figures.py")
RUN = [command for command in ALL if command.skip is None]
# What a synopsis holds (outside comments): optional flags, a directory or file of the reader's, an ellipsis.
PLACEHOLDER = re.compile(r"\[--|\b[A-Z_]*DIR\b|<[a-z-]+>|\bmy\.yaml\b|\.\.\.$")


def test_the_checker_reads_blocks_markers_and_shown_errors(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("""intro

```sh
echo one \\
    two   # a comment
python -c "
print(3)"
```

<!-- docs-check: skip (needs a GPU) -->
```sh
nvidia-smi
```

```
$ false --flag
error: x: a ... b
$ true
some output
```

```
not a command
```
""")
    found = _listed("check_docs.py", "--file", str(doc))
    assert {c.file for c in found} == {str(doc)}
    assert [(c.line, c.text, c.skip, c.expected_error) for c in found] == [
        (4, "echo one \\\n    two   # a comment", None, None),
        (6, 'python -c "\nprint(3)"', None, None),
        (12, "nvidia-smi", "needs a GPU", None),
        (16, "false --flag", None, "error: x: a ... b"),
        (18, "true", None, None),
    ]
    # The stderr a shown refusal must contain, ``...`` matching anything (and nothing out of order).
    pattern = found[3].error_pattern
    assert re.search(pattern, "error: x: a 123 b and more") and not re.search(pattern, "error: x: b a")
    assert [c.error_pattern for c in found if c is not found[3]] == [None] * 4


def test_every_command_the_check_runs_has_no_placeholder():
    """A synopsis (``[--step N]``, ``HF_DIR``, ``my.yaml``) is marked ``docs-check: skip`` with why."""
    words = lambda command: " ".join(shlex.split(command.text, comments=True))
    bad = [f"{c.file}:{c.line}: {c.text}" for c in RUN if PLACEHOLDER.search(words(c))]
    assert bad == []


def _training_run_dirs() -> dict[str, list[str]]:
    """run.dir -> where the commands that train into it stand (training: meshtrain.train or launch_local,
    not --print-*, not an expected refusal)."""
    dirs: dict[str, list[str]] = {}
    for command in ALL:
        words = shlex.split(command.text, comments=True)
        trains = "meshtrain.train" in words or any(word.endswith("launch_local.sh") for word in words)
        if not trains or command.expected_error or any(word.startswith("--print-") for word in words):
            continue
        run_dir = next((word.split("=", 1)[1] for word in words if word.startswith("run.dir=")), None)
        dirs.setdefault(run_dir, []).append(f"{command.file}:{command.line}")
    return dirs


def test_every_documented_training_command_has_its_own_run_dir():
    """tiny.yaml's fixed runs/tiny made later commands exit 2 or silently resume; a run.dir is shared only
    by the commands of one file (a resume shown on purpose). Skipped commands (a GPU's) are held too."""
    dirs = _training_run_dirs()
    unnamed = [where for where in dirs.pop(None, []) if not any(where == f"{c.file}:{c.line}" and c.skip for c in ALL)]
    assert unnamed == []
    shared = {run_dir: places for run_dir, places in dirs.items()
              if len({place.split(":")[0] for place in places}) > 1}
    assert shared == {}


def test_documented_convert_commands_parse():
    """families.md showed ``convert from-hf DIR OUT``; the CLI takes --hf / --out."""
    from meshtrain.convert import _parse_args

    converts = [c for c in ALL if "meshtrain.convert" in c.text and "[" not in c.text and "(or" not in c.text]
    assert len(converts) >= 3
    for command in converts:
        words = shlex.split(command.text, comments=True)
        _parse_args(words[words.index("meshtrain.convert") + 1:])


def test_the_presets_table_lists_every_preset():
    """parallelism.md printed 7 of the 8 presets; its block is `make docs-figures` output now, and this holds
    the count and order without running it."""
    from meshtrain.parallel.rules import PRESETS

    (block,) = [block for block in FIGURES.outputs if block.doc == "docs/parallelism.md" and "PRESETS" in block.command]
    shown = [line.split(" ", 1)[0] for line in block.output if line.strip()]
    assert shown == [preset.value for preset in PRESETS]


@pytest.mark.parametrize("figure", FIGURES.figures, ids=lambda f: f"{f.doc}:{f.config}")
def test_each_figure_the_script_rewrites_is_stated_once(figure):
    assert len(re.findall(figure.pattern, (REPO / figure.doc).read_text())) == 1


def test_the_readme_states_the_size_it_has():
    readme = (REPO / "README.md").read_text()
    stated = int(re.search(r"\(`meshtrain/`\) is about ([\d,]+) lines", readme).group(1).replace(",", ""))
    actual = sum(len(p.read_text().splitlines()) for p in (REPO / "meshtrain").rglob("*.py"))
    assert abs(stated - actual) / actual < 0.1, (stated, actual)
    assert "source .venv/bin/activate" in readme  # the commands shown run in the environment make creates
