"""Remove a folder once the process that made it is gone, however that process ended.

A replica's report folder lives in memory-backed ``/dev/shm``. When its driver disconnects, Ray
kills the replica actor outright (no ``atexit``, no ``finally``), so the actor cannot clean up
after itself. :func:`remove_on_exit` starts a small stdlib-only process that holds the read end
of a pipe whose write end only the calling process holds: the kernel closes it when the caller
dies, for any reason, and the janitor then removes the folder. The janitor detaches itself (a
second fork), so a worker's exit that kills its own children does not take it along.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_JANITOR = """
import os, shutil, sys
if os.fork():  # detach: the process it watches kills its own children when it exits
    os._exit(0)
sys.stdin.buffer.read()  # returns at EOF: the watched process has ended
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""

_HELD: list = []  # the pipes' write ends: open for as long as this process lives


def remove_on_exit(folder: Path) -> None:
    """Remove ``folder`` when this process ends (a normal exit, a kill, a crash)."""
    janitor = subprocess.Popen([sys.executable, "-S", "-c", _JANITOR, str(folder)], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    janitor.wait()  # the first fork returns at once; its child holds the pipe
    _HELD.append(janitor.stdin)
