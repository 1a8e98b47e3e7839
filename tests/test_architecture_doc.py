"""docs/architecture.md's module table names every module under meshtrain/ and models/: by its path, or
by its file name in the row of its folder (``meshtrain/data/sft.py`` in the row that starts with
``meshtrain/data/...``). A package's ``__init__.py`` is its folder's row."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module_rows() -> list[tuple[set[str], set[str]]]:
    """(the folders the first cell names, every backticked name in the row) of each row of the doc's
    ``## Modules`` table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Modules", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first = re.findall(r"`([^`]+)`", line.split("|")[1])
            folders = {name.rstrip("/") if name.endswith("/") else name.rsplit("/", 1)[0]
                       for name in first if "/" in name}
            rows.append((folders, set(re.findall(r"`([^`]+)`", line))))
    return rows


def _named(path: str, rows: list[tuple[set[str], set[str]]]) -> bool:
    """Whether a row names ``path``, or its folder's row names its file (a package's ``__init__.py``:
    the folder's row)."""
    folder, name = path.rsplit("/", 1)
    return any(path in names or (folder in folders and (name in names or name == "__init__.py"))
               for folders, names in rows)


def test_every_module_is_in_the_architecture_table():
    rows = _module_rows()
    modules = sorted(str(p.relative_to(ROOT)) for package in ("meshtrain", "models")
                     for p in (ROOT / package).rglob("*.py"))
    assert len(modules) > 100
    assert [m for m in modules if not _named(m, rows)] == []


def test_a_module_left_out_of_the_table_is_found():
    rows = [(folders, names - {"meshtrain/sampling.py"}) for folders, names in _module_rows()]
    assert not _named("meshtrain/sampling.py", rows)
    assert _named("meshtrain/data/sft.py", rows)
