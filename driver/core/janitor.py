"""Remove files and folders once the process that made them is gone, however that process ended.

A replica's report folder lives in memory-backed ``/dev/shm``, and so do the shared-memory
segments of every vLLM engine (its processes' message queues; on a CPU at TP or PP > 1 its
communicator's, which vLLM never unlinks). When a replica's driver disconnects, Ray kills the
replica actor outright (no ``atexit``, no ``finally``) and the actor's children with it, among
them the multiprocessing resource tracker that would have unlinked the segments; a script killed
by SIGKILL runs no ``finally`` either. Each left its files in ``/dev/shm`` at every such end.

:func:`remove_on_exit` hands paths to a small stdlib-only process, one per calling process, that
holds the read end of a pipe whose write end only the caller holds: the kernel closes it when the
caller dies, for any reason, and the janitor then removes every path it was given. The janitor
detaches itself (a second fork), so a worker's exit that kills its own children does not take it
along. Paths that are gone by then (a model closed on purpose removes its own) are skipped.

:func:`shared_memory_files` names an engine's segments (the files in ``/dev/shm`` its processes
map) and :func:`socket_files` its ZMQ endpoints' files. The replica (or script) that starts an
engine hands those of its engine core and that process's descendants to its own janitor; a rank
that vLLM's Ray executor started is no descendant of either, so it hands its own to a janitor of
its own (``workers/extension.py``).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterable

# The first paths come as arguments (they name the janitor in a process listing), later ones as
# lines on its stdin; at EOF (the caller has ended) it removes them all.
_JANITOR = """
import os, shutil, sys
if os.fork():  # detach: the process it watches kills its own children when it exits
    os._exit(0)
paths = sys.argv[1:]
for line in sys.stdin.buffer:  # ends at EOF: the watched process has ended
    paths.append(os.fsdecode(line.rstrip(b"\\n")))
for path in paths:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass
"""


def shared_memory_files(pids: Iterable[int]) -> list[str]:
    """The files directly in ``/dev/shm`` that the processes ``pids`` have mapped (those gone or
    not readable are skipped). Report files live in folders of their own, and a deleted file's
    name (Ray's object store maps one) may be another's by now: neither is named."""
    found: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                path = fields[5].rstrip("\n") if len(fields) == 6 else ""
                if os.path.dirname(path) == "/dev/shm" and not path.endswith(" (deleted)"):
                    found.add(path)
    return sorted(found)


def socket_files(pids: Iterable[int], folder: str | Path) -> list[str]:
    """The Unix socket files directly in ``folder`` that the processes ``pids`` have bound (or
    accepted connections on): the ZMQ ``ipc://`` endpoints of vLLM's processes, made in its RPC
    folder (``VLLM_RPC_BASE_PATH``, the temp folder). libzmq leaves the file when its process is
    killed, and a vLLM engine's shutdown kills its processes: 7 files for every engine start."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    return sorted({path for inode, path in _bound_sockets() if inode in inodes
                   and os.path.dirname(path) == os.fspath(folder)})


def _bound_sockets() -> list[tuple[str, str]]:
    """(inode, path) of each Unix socket bound to a path now, in this network namespace."""
    bound: list[tuple[str, str]] = []
    with contextlib.suppress(OSError), open("/proc/net/unix", encoding="utf-8", errors="replace") as table:
        next(table)  # (the header)
        for line in table:
            fields = line.split(maxsplit=7)  # ... Inode Path; a connecting socket has no path
            if len(fields) == 8:
                bound.append((fields[6], fields[7].rstrip("\n")))
    return bound


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def unbound_socket_files(folder: str | Path, since: float, settled_s: float = 0.5) -> list[str]:
    """vLLM's ZMQ socket files in ``folder`` (named by a uuid4) made at ``since`` (a
    ``time.time()``) or later that no socket is bound to any more: an engine that failed to start
    leaves these (7 on a CPU), and its processes are gone before anything can read which files
    they bound (:func:`socket_files`). Such a file can take no connection, so removing it harms
    no one, whoever made it. Only files made ``settled_s`` ago or earlier are named: a socket's
    file exists a moment before the socket is listed as bound to it. (A socket bound by a process
    in another network namespace that shares this folder is not seen: none of vLLM's.)"""
    made: list[str] = []
    settled = time.time() - settled_s
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                # file times are a clock tick coarse (up to 10 ms): one made just after ``since`` may read earlier
                if (_UUID.fullmatch(entry.name) and stat.S_ISSOCK(info.st_mode)
                        and since - 0.05 <= info.st_ctime <= settled):
                    made.append(entry.path)
    if not made:
        return []
    bound = {path for _inode, path in _bound_sockets()}
    return sorted(path for path in made if path not in bound)


_lock = threading.Lock()
_janitor: tuple[int, object] | None = None  # (the pid it serves, the write end of its pipe)


def remove_on_exit(*paths: str | Path) -> None:
    """Remove each of ``paths`` (a folder with what it holds, or a file) when this process ends
    (a normal exit, a kill, a crash)."""
    global _janitor
    if not paths:
        return
    with _lock:
        if _janitor is not None and _janitor[0] == os.getpid():  # (a forked child starts its own)
            try:
                _janitor[1].write(b"".join(os.fsencode(str(path)) + b"\n" for path in paths))
                _janitor[1].flush()
                return
            except OSError:  # its janitor was killed: a new one takes these paths
                pass
        janitor = subprocess.Popen([sys.executable, "-S", "-c", _JANITOR, *map(str, paths)], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        janitor.wait()  # the first fork returns at once; its child holds the pipe
        _janitor = (os.getpid(), janitor.stdin)  # open for as long as this process lives
