"""One live process per ``run.dir`` (or prepared corpus ``--out``): a lock file naming the process and
host that holds the directory.

``run.dir/.meshtrain.lock`` is created atomically (``O_CREAT | O_EXCL``) by process 0 before the run
writes anything, and removed when the run ends. A second run on the same directory refuses with one
line. A lock left by a run that was killed (its process no longer exists on this host, or has this
process's own PID: a restarted container) is taken over with a warning; a lock held from another
host cannot be checked and is reported, naming the file to remove once that run is known to be gone.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import sys
import time

from meshtrain import jsonio
from meshtrain.errors import ConfigError, writable_directory

LOCK_FILE = ".meshtrain.lock"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host. This process's own PID counts as not running: the
    lock being acquired is not yet this process's, so it was left by an earlier one that had the same
    PID (a restarted container's runs are all PID 1)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process; a PID no process can have
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """Holds ``run_dir`` for this process while inside ``with`` (``acquire``/``release``); errors name
    ``field`` and call the holder a ``holder`` (``run.dir`` and a run for training, ``--out`` and a
    prepare for a corpus being prepared)."""

    def __init__(self, run_dir: str | pathlib.Path, field: str = "run.dir", holder: str = "run"):
        self.field, self.holder = field, holder
        self.path = pathlib.Path(run_dir) / LOCK_FILE
        self.owner = {"pid": os.getpid(), "host": socket.gethostname(),
                      "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.owner, f)
        return True

    def acquire(self) -> None:
        """Takes the directory, or raises ``ConfigError("run.dir", ...)`` naming who holds it."""
        writable_directory(self.path.parent, self.field)
        for _ in range(3):  # a racing run may take over or release the lock between two looks
            if self._create():
                self.held = True
                return
            try:
                holder = jsonio.loads(self.path.read_text())
                pid, host = int(holder["pid"]), str(holder["host"])
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError):
                holder, pid, host = {}, -1, "?"
            if host == self.owner["host"] and pid > 0 and not _alive(pid):
                stale = self.path.with_name(f"{LOCK_FILE}.stale-{pid}")
                try:
                    os.rename(self.path, stale)  # only one taker wins the rename
                except FileNotFoundError:
                    continue
                stale.unlink(missing_ok=True)
                print(f"warning: {self.path} was left by process {pid}, which is no longer running; "
                      "taking over the run directory", file=sys.stderr, flush=True)
                continue
            where = f"process {pid} on host {host}" if pid > 0 else "an unreadable lock"
            since = f" since {holder['started']}" if "started" in holder else ""
            remedy = (f"wait for it to finish or choose another {self.field}" if host == self.owner["host"]
                      else f"if that {self.holder} is gone, remove {self.path}")
            raise ConfigError(self.field, f"{self.path.parent} is in use by a live {self.holder} ({where}{since}); "
                              f"{remedy}")
        raise ConfigError(self.field, f"could not take {self.path}: other {self.holder}s keep taking it")

    def release(self) -> None:
        if not self.held:
            return
        try:
            if jsonio.loads(self.path.read_text()).get("pid") == self.owner["pid"]:
                self.path.unlink()
        except (OSError, ValueError):
            pass
        self.held = False
