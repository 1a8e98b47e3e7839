"""Runs every shell command that README.md and docs/*.md show, in the order shown, from a fresh clone.

    python scripts/check_docs.py --list                   # every command, and the ones skipped with why
    python scripts/check_docs.py --list --json            # the same as a JSON list (what tests/test_docs.py reads)
    python scripts/check_docs.py                          # run them all (README.md, then docs/*.md by name)
    python scripts/check_docs.py --file docs/pipeline.md  # one file's (repeatable)
    python scripts/check_docs.py --worktree               # a copy of the working tree, uncommitted edits included

A command is a line (with its ``\\`` continuations and open quotes) of a ```` ```sh ````, ```` ```bash ```` or
```` ```console ```` block, or a ``$ `` line of an untagged block; what follows a ``$ `` line up to the next is
its output. A shown output whose line starts with ``error:`` is an expected refusal: the command must exit 2
with that line on stderr (``...`` in it matches anything). Untagged blocks are output, file trees and
synopses, not commands. A block that cannot run here is marked in the doc, just before it::

    <!-- docs-check: skip (needs a GPU) -->

and listed with that reason. The clone is ``git clone`` of this repository into a temporary directory
(``--worktree``: the tracked and untracked-not-ignored files instead), with ``.venv`` a link to this
checkout's (``pyproject.toml`` dated before its stamp, so ``make`` does not reinstall) first on ``PATH``
and the clone on ``PYTHONPATH``. Exit status: 0 when every command ran as shown, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMAND_LANGUAGES = ("sh", "bash", "console", "shell")
SKIP = re.compile(r"<!--\s*docs-check:\s*skip\s*\((?P<reason>.+?)\)\s*-->")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<language>[\w-]*)\s*$")


@dataclasses.dataclass(frozen=True)
class Command:
    """One shown command: where (``file:line``), its text, the output lines shown under it, and why it is
    skipped (None: it runs)."""

    file: str
    line: int
    text: str
    output: tuple[str, ...] = ()
    skip: str | None = None

    @property
    def expected_error(self) -> str | None:
        """The ``error:`` line shown under the command, if any."""
        return next((line.strip() for line in self.output if line.strip().startswith("error:")), None)

    @property
    def error_pattern(self) -> str | None:
        """The regular expression the command's stderr must contain: its expected error, ``...`` matching
        anything (None: it must exit 0)."""
        error = self.expected_error
        return None if error is None else ".*?".join(re.escape(part.strip()) for part in error.split("..."))

    def listed(self) -> dict:
        """What ``--list --json`` prints of the command."""
        return {"file": self.file, "line": self.line, "text": self.text, "skip": self.skip,
                "expected_error": self.expected_error, "error_pattern": self.error_pattern}


def _complete(text: str) -> bool:
    """Whether ``text`` is a whole shell command (no trailing ``\\``, no open quote)."""
    if text.rstrip().endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:  # No closing quotation
        return False
    return True


def _commands_of(lines: list[str], first: int, dollar_only: bool) -> list[tuple[int, str, list[str]]]:
    """(line number, command, shown output) of a block's ``lines`` (the first is line ``first``)."""
    found: list[tuple[int, str, list[str]]] = []
    pending: list[str] = []
    for number, line in enumerate(lines, first):
        if pending:
            pending.append(line)
            if _complete("\n".join(pending)):
                found[-1] = (found[-1][0], "\n".join(pending), [])
                pending = []
            continue
        stripped = line.strip()
        if dollar_only or stripped.startswith("$ "):
            if not stripped.startswith("$ "):
                if found:
                    found[-1][2].append(line)
                continue
            stripped = stripped[2:]
        if not stripped or stripped.startswith("#"):
            continue
        found.append((number, stripped, []))
        if not _complete(stripped):
            pending = [stripped]
    return found


def commands(path: pathlib.Path) -> list[Command]:
    """The commands ``path`` (a Markdown file) shows, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    out: list[Command] = []
    index, skip = 0, None
    while index < len(lines):
        marker = SKIP.search(lines[index])
        fence = FENCE.match(lines[index])
        if marker:
            skip = marker["reason"]
        elif fence:
            end = next((i for i in range(index + 1, len(lines)) if lines[i].strip() == "```"), len(lines))
            body = lines[index + 1:end]
            language = fence["language"]
            if language in COMMAND_LANGUAGES or (not language and any(row.strip().startswith("$ ") for row in body)):
                dollar = language == "console" or not language
                for number, text, output in _commands_of(body, index + 2, dollar):
                    out.append(Command(name, number, text, tuple(output), skip))
            skip, index = None, end
        elif lines[index].strip():
            skip = None  # a marker applies to the block right after it
        index += 1
    return out


def documents(files: list[str]) -> list[pathlib.Path]:
    if files:
        return [(ROOT / name).resolve() for name in files]
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def fresh_clone(into: pathlib.Path, worktree: bool) -> pathlib.Path:
    """A clone of this repository at ``into/meshtrain`` sharing this checkout's virtual environments."""
    clone = into / "meshtrain"
    if worktree:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                check=True, capture_output=True).stdout.decode().split("\0")
        for name in filter(None, listed):
            source = ROOT / name
            if source.is_file():
                (clone / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, clone / name)
    else:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    for venv in (".venv", ".venv-newest", ".venv-gpu"):
        if (ROOT / venv).is_dir():
            (clone / venv).symlink_to(ROOT / venv)
    stamp = ROOT / ".venv" / ".installed"
    if stamp.is_file():  # make's $(STAMP) is newer than pyproject.toml: no reinstall into the shared venv
        older = stamp.stat().st_mtime - 60
        os.utime(clone / "pyproject.toml", (older, older))
    return clone


def run(command: Command, clone: pathlib.Path, timeout: float) -> tuple[bool, str]:
    """Runs ``command`` in ``clone``: (as shown, a one-line note)."""
    env = {**os.environ, "PATH": f"{clone / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(clone), "MPLBACKEND": "Agg"}
    env.pop("VIRTUAL_ENV", None)
    start = time.monotonic()
    try:
        done = subprocess.run(["bash", "-c", command.text], cwd=clone, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    took = f"{time.monotonic() - start:.1f} s"
    error = command.expected_error
    if error is not None:
        ok = done.returncode == 2 and re.search(command.error_pattern, done.stderr) is not None
        return ok, f"exit {done.returncode}, {took}" + ("" if ok else f"; wanted exit 2 and {error[:100]!r}; "
                                                         f"stderr: {_last(done.stderr)}")
    if done.returncode != 0:
        return False, f"exit {done.returncode}, {took}: {_last(done.stderr or done.stdout)}"
    return True, took


def _last(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="list the commands (and the skipped ones) and exit")
    parser.add_argument("--json", action="store_true", help="with --list: print the commands as a JSON list")
    parser.add_argument("--file", action="append", default=[], help="only this Markdown file's (repeatable)")
    parser.add_argument("--worktree", action="store_true", help="copy the working tree instead of cloning HEAD")
    parser.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per command (default 900)")
    args = parser.parse_args(argv)
    if args.json and not args.list:
        parser.error("--json: goes with --list")
    shown = [command for path in documents(args.file) for command in commands(path)]
    if args.json:
        print(json.dumps([command.listed() for command in shown], indent=1))
        return 0
    if args.list:
        for command in shown:
            state = f"skip ({command.skip})" if command.skip else ("error" if command.expected_error else "run")
            print(f"{command.file}:{command.line}\t{state}\t{' '.join(command.text.split())}")
        return 0
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="check_docs-"))
    failed = ran = 0
    try:
        clone = fresh_clone(workdir, args.worktree)
        print(f"clone: {clone}", flush=True)
        for command in shown:
            where = f"{command.file}:{command.line}"
            if command.skip:
                print(f"SKIP {where} ({command.skip}): {' '.join(command.text.split())[:120]}", flush=True)
                continue
            ok, note = run(command, clone, args.timeout)
            ran, failed = ran + 1, failed + (not ok)
            print(f"{'ok  ' if ok else 'FAIL'} {where} ({note}): {' '.join(command.text.split())[:120]}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    skipped = sum(1 for command in shown if command.skip)
    print(f"{ran - failed} of {ran} commands ran as shown, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
