"""Writes a small instruction set from the installed Python standard library (no download).

    python scripts/stdlib_instructions.py --out data/stdlib_instructions.jsonl

For ``make sft``: the docstrings model of ``make stdlib`` is fine-tuned to answer "summarize this
function" with the function's one-line summary. Each public function or class of a public module
with a usable summary (the first paragraph of its docstring, one line, 16..160 characters, opening
with a letter) gives one example:

* a function: ``{"prompt": "Summarize the function json.dumps(obj, skipkeys, ...) in one line.",
  "response": "Serialize ``obj`` to a JSON formatted ``str``."}``
* a class with public methods that have a summary: a chat of two turns, the class and then its first
  such method (``{"messages": [system, user, assistant, user, assistant]}``), so both input forms of
  ``prepare-sft`` and multi-turn masks are exercised; its other such methods as pairs (``Summarize
  the method ...``), before the chat.

Modules are read in sorted path order (as ``stdlib_docstrings.py`` reads them), so the same Python
gives the same file.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re
import sys
import sysconfig

from stdlib_docstrings import SKIPPED_PARTS

SYSTEM = "You answer questions about the Python standard library in one line."
MIN_CHARS, MAX_CHARS = 16, 160
MAX_SIGNATURE_CHARS = 48


def summary(node: ast.AST) -> str | None:
    """The docstring's first paragraph as one line, when it reads as a summary."""
    docstring = ast.get_docstring(node)
    if not docstring:
        return None
    text = " ".join(docstring.split("\n\n")[0].split())
    if not MIN_CHARS <= len(text) <= MAX_CHARS or not text[0].isalpha() or "(" in text.split()[0]:
        return None  # too short or long, or a signature line such as "f(x) -> y"
    return text


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``(a, b, *args)``: the argument names, ``(...)`` when that is long."""
    arguments = node.args
    names = [a.arg for a in arguments.posonlyargs + arguments.args if a.arg not in ("self", "cls")]
    names += [f"*{arguments.vararg.arg}"] if arguments.vararg else []
    names += [a.arg for a in arguments.kwonlyargs]
    names += [f"**{arguments.kwarg.arg}"] if arguments.kwarg else []
    shown = ", ".join(names)
    return f"({shown})" if len(shown) <= MAX_SIGNATURE_CHARS else "(...)"


def is_public(name: str) -> bool:
    return not name.startswith("_")


def examples(path: pathlib.Path, module: str):
    """The examples of one module, in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_public(node.name):
            line = summary(node)
            if line:
                yield {"prompt": f"Summarize the function {module}.{node.name}{signature(node)} in one line.",
                       "response": line}
        elif isinstance(node, ast.ClassDef) and is_public(node.name):
            line = summary(node)
            if not line:
                continue
            methods = [(item, summary(item)) for item in node.body
                       if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_public(item.name)]
            method = next(((item, text) for item, text in methods if text), None)
            if method is None:
                yield {"prompt": f"Summarize the class {module}.{node.name} in one line.", "response": line}
                continue
            item, text = method
            for other, other_text in methods:  # the other methods, as pairs
                if other_text and other is not item:
                    yield {"prompt": f"Summarize the method {module}.{node.name}.{other.name}{signature(other)} in "
                                     "one line.", "response": other_text}
            yield {"messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Summarize the class {module}.{node.name} in one line."},
                {"role": "assistant", "content": line},
                {"role": "user", "content": f"And its method {item.name}{signature(item)}?"},
                {"role": "assistant", "content": text}]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSONL file to write")
    args = parser.parse_args(argv)
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    counts = {"prompt": 0, "messages": 0}
    partial = out.with_name(out.name + ".tmp")
    with partial.open("w", encoding="utf-8") as stream:
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if SKIPPED_PARTS & set(parts) or not all(map(is_public, parts[:-1])):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if not parts or not is_public(parts[-1]) or not all(re.fullmatch(r"\w+", part) for part in parts):
                continue
            for example in examples(path, ".".join(parts)):
                stream.write(json.dumps(example, ensure_ascii=False) + "\n")
                counts["messages" if "messages" in example else "prompt"] += 1
    partial.replace(out)
    print(f"wrote {sum(counts.values())} examples ({counts['prompt']} prompt/response pairs, {counts['messages']} "
          f"two-turn chats) from {root} to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
