"""Writes the docstrings of the installed Python standard library as a JSONL corpus (no download).

    python scripts/stdlib_docstrings.py --out data/stdlib_docstrings.jsonl

One document per module: its module, class and function docstrings in source order, separated by
blank lines (``{"text": ..., "module": ...}`` per line). Modules are read in sorted path order from
``sysconfig.get_paths()["stdlib"]``, skipping test suites, ``site-packages`` and files that do not
parse, so the same Python gives the same file. English prose with code in it: a real corpus every
machine that has Python holds.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys
import sysconfig

SKIPPED_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def module_docstrings(path: pathlib.Path) -> str:
    """The docstrings of one module, in source order, joined by blank lines ('' when none)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    nodes = [tree] + [node for node in ast.walk(tree)
                      if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    nodes.sort(key=lambda node: getattr(node, "lineno", 0))
    texts = [ast.get_docstring(node) for node in nodes]
    return "\n\n".join(text for text in texts if text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSONL file to write")
    args = parser.parse_args(argv)
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    documents = chars = 0
    partial = out.with_name(out.name + ".tmp")
    with partial.open("w", encoding="utf-8") as stream:
        for path in sorted(root.rglob("*.py")):
            if SKIPPED_PARTS & set(path.relative_to(root).parts):
                continue
            text = module_docstrings(path)
            if text:
                module = ".".join(path.relative_to(root).with_suffix("").parts)
                stream.write(json.dumps({"text": text, "module": module}, ensure_ascii=False) + "\n")
                documents += 1
                chars += len(text)
    partial.replace(out)
    print(f"wrote {documents} documents ({chars / 1e6:.1f} M characters) from {root} to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
