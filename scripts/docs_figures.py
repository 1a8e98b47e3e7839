"""Regenerates the exact figures the docs state and rewrites them in place (``make docs-figures``).

    python scripts/docs_figures.py            # run what the figures come from, rewrite the docs
    python scripts/docs_figures.py --check    # the same, but only report the figures that moved (exit 1 if any)
    python scripts/docs_figures.py --list     # which figures, from what
    python scripts/docs_figures.py --list --json  # the same as JSON (what tests/test_docs.py reads)

Two kinds of figure:

* a run's losses and counts (``FIGURES``): the shipped config trained as its ``make`` target trains it, into
  a temporary ``run.dir``, its ``summary.json`` formatted into the sentence that states it;
* a command's shown output: a block marked ``<!-- docs-figures: output -->`` whose first line is
  ``$ COMMAND`` (with its continuations) gets COMMAND's stdout, run from the repository root, below it.

Figures that neither regenerates (benchmark timings, dated measurements) are dated in the docs;
tests hold the planner's and the parameter counts' figures (``tests/test_plan.py``, ``tests/test_docs.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable

from check_docs import _complete  # the same reading of a shown command (scripts/ is sys.path[0] of a script)

ROOT = pathlib.Path(__file__).resolve().parents[1]

OUTPUT_MARKER = "<!-- docs-figures: output -->"


@dataclasses.dataclass(frozen=True)
class Figure:
    """A sentence of ``doc`` (``pattern``'s one match) restated from the summary of ``config`` trained on 8
    simulated devices as its make target trains it."""

    doc: str
    config: str
    pattern: str
    text: Callable[[dict], str]


def _loss(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}f}"


FIGURES = [
    Figure("README.md", "configs/tiny.yaml",
           r"\| loss at step 1 → step 500 \| [\d.]+ → [\d.]+ \(best logged [\d.]+\) \|",
           lambda s: f"| loss at step 1 → step 500 | {_loss(s['first_loss'])} → {_loss(s['last_loss'])} "
                     f"(best logged {_loss(s['best_loss'])}) |"),
    Figure("README.md", "configs/tiny.yaml", r"a\n?[\d,]+-parameter Llama",
           lambda s: f"a\n{s['parameters']:,}-parameter Llama"),
    Figure("docs/moe.md", "configs/moe_tiny.yaml", r"loss [\d.]+ -> [\d.]+ \(best [\d.]+; entropy floor [\d.]+\)",
           lambda s: f"loss {_loss(s['first_loss'])} -> {_loss(s['last_loss'])} (best {_loss(s['best_loss'])}; "
                     f"entropy floor {_loss(s['entropy_floor'])})"),
    Figure("docs/benchmarks.md", "configs/moe_tiny.yaml", r"\(the current figure, [\d.]+:",
           lambda s: f"(the current figure, {_loss(s['last_loss'])}:"),
    Figure("docs/families.md", "configs/deepseek_tiny.yaml", r"loss [\d.]+ to [\d.]+ in 400 steps \(best [\d.]+;",
           lambda s: f"loss {_loss(s['first_loss'], 2)} to {_loss(s['last_loss'], 2)} in 400 steps "
                     f"(best {_loss(s['best_loss'], 2)};"),
]


def summary_of(config: str, cache: dict[str, dict]) -> dict:
    """``summary.json`` of ``config`` trained to its end on 8 simulated devices (once per config)."""
    if config not in cache:
        with tempfile.TemporaryDirectory(prefix="docs_figures-") as run_dir:
            subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", config, "--host-devices", "8",
                            f"run.dir={run_dir}"], cwd=ROOT, check=True, capture_output=True)
            cache[config] = json.loads((pathlib.Path(run_dir) / "summary.json").read_text())
    return cache[config]


def output_blocks(text: str) -> list[tuple[int, int, str]]:
    """(first output line, end line, command) of each block of ``text`` marked ``OUTPUT_MARKER``."""
    lines, found = text.split("\n"), []
    for index, line in enumerate(lines):
        if line.strip() != OUTPUT_MARKER:
            continue
        start = index + 2  # the fence, then "$ COMMAND"
        command, end = [lines[start].strip().removeprefix("$ ")], start + 1
        while not _complete("\n".join(command)):
            command.append(lines[end])
            end += 1
        close = next(i for i in range(end, len(lines)) if lines[i].strip() == "```")
        found.append((end, close, "\n".join(command)))
    return found


def regenerate(doc: pathlib.Path, cache: dict[str, dict]) -> tuple[str, list[str]]:
    """``doc``'s text with its figures regenerated, and a line for each figure that moved."""
    text, moved = doc.read_text(encoding="utf-8"), []
    name = str(doc.relative_to(ROOT))
    for start, end, command in reversed(output_blocks(text)):
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, check=True)
        lines = text.split("\n")
        new = [""] + done.stdout.rstrip("\n").split("\n") if lines[start:start + 1] == [""] else \
            done.stdout.rstrip("\n").split("\n")
        if lines[start:end] != new:
            moved.append(f"{name}: the output of `{' '.join(command.split())[:80]}`")
        text = "\n".join(lines[:start] + new + lines[end:])
    for figure in (figure for figure in FIGURES if figure.doc == name):
        found = re.findall(figure.pattern, text)
        if len(found) != 1:
            raise SystemExit(f"{name}: {figure.pattern!r} matches {len(found)} times, not once; update FIGURES")
        new = figure.text(summary_of(figure.config, cache))
        if found[0].replace("\n", " ") != new.replace("\n", " "):
            moved.append(f"{name}: {' '.join(found[0].split())} -> {' '.join(new.split())}")
            text = re.sub(figure.pattern, new.replace("\\", "\\\\"), text)
    return text, moved


def listing(docs: list[pathlib.Path]) -> dict[str, list[dict]]:
    """``--list --json``: the run figures of ``docs`` and their command-output blocks, each block's output
    as the doc shows it now."""
    names = [str(doc.relative_to(ROOT)) for doc in docs]
    outputs = []
    for doc, name in zip(docs, names, strict=True):
        lines = doc.read_text(encoding="utf-8").split("\n")
        outputs += [{"doc": name, "line": start + 1, "command": command, "output": lines[start:end]}
                    for start, end, command in output_blocks("\n".join(lines))]
    figures = [{"doc": figure.doc, "config": figure.config, "pattern": figure.pattern}
               for figure in FIGURES if figure.doc in names]
    return {"figures": figures, "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="report the figures that moved; rewrite nothing")
    parser.add_argument("--list", action="store_true", help="list the figures and what regenerates them")
    parser.add_argument("--json", action="store_true",
                        help="with --list: print {figures: [{doc, config, pattern}], outputs: [{doc, line, "
                             "command, output}]} (line: the first output line's)")
    parser.add_argument("--file", action="append", default=[], help="only this Markdown file's (repeatable)")
    args = parser.parse_args(argv)
    if args.json and not args.list:
        parser.error("--json: goes with --list")
    docs = [ROOT / name for name in args.file] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    if args.list:
        listed = listing(docs)
        if args.json:
            print(json.dumps(listed, indent=1))
            return 0
        for block in listed["outputs"]:
            print(f"{block['doc']}\toutput of\t{' '.join(block['command'].split())}")
        for figure in listed["figures"]:
            print(f"{figure['doc']}\t{figure['config']} summary\t{figure['pattern']}")
        return 0
    cache: dict[str, dict] = {}
    moved_all = []
    for doc in docs:
        text, moved = regenerate(doc, cache)
        moved_all += moved
        if moved and not args.check:
            doc.write_text(text, encoding="utf-8")
    for line in moved_all:
        print(("moved: " if args.check else "rewritten: ") + line)
    print(f"{len(moved_all)} figures {'moved' if args.check else 'rewritten'}")
    return 1 if args.check and moved_all else 0


if __name__ == "__main__":
    sys.exit(main())
