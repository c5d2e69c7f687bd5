"""SIGTERM as a request to stop: what Kubernetes, Docker, systemd and ``ray job stop`` send.

Python's default dies at once (no ``finally``, no ``with`` exit, no ``atexit``), and ``ray.init``
replaces whatever handler there was with Ray's own: a native stack dump, then an exit that skips
the stop Ctrl-C gives (on the CPU machine, Ray 2.60: ``interlace serve`` exited with status 15 and
Serve was never shut down; a ``Cluster`` script aborted, status -6). :func:`stop_on_sigterm` installs a handler that raises :class:`Terminated` in the main thread
instead, where Ctrl-C raises ``KeyboardInterrupt``, so the same ``except``/``finally`` blocks run:
``interlace serve`` shuts Serve down, ``interlace sweep`` stops its actor pool and keeps what it
committed, a ``with interlace.Cluster(...)`` block closes the cluster. A second SIGTERM while that
runs ends the process at once, as the default does (what is left then goes as after a kill: Ray
ends the actors of a driver that is gone, the janitor removes their report folders).

``Terminated`` is a ``SystemExit``: ``except Exception`` does not catch it, and a script that lets
it through exits with status 143 (128 + SIGTERM) and no traceback. Raised while the main thread
waits in ``ray.get``, it reaches the caller as Ray's ``SystemExit(1)``: :func:`received` says
whether a SIGTERM came, whatever the exception became on its way.

``ray.init`` puts Ray's handler back (and its core worker a native one that prints the dump), so
every ``ray.init`` of ours runs inside :func:`kept_across_ray_init`; installing ours after it
replaces both.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

EXIT_CODE = 128 + signal.SIGTERM  # 143, the shell's status for a process ended by SIGTERM

_received = False


class Terminated(SystemExit):
    """The process got SIGTERM: stop as on Ctrl-C (raised by :func:`stop_on_sigterm`'s handler)."""

    def __init__(self) -> None:
        super().__init__(EXIT_CODE)

    def __str__(self) -> str:
        return "stopped by SIGTERM"


def _on_sigterm(signum, frame) -> None:
    global _received
    if _received:  # a second SIGTERM while stopping: end now, as the default handler does
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _received = True
    raise Terminated()


def received() -> bool:
    """Whether this process got a SIGTERM that :func:`stop_on_sigterm`'s handler turned into a stop."""
    return _received


def stop_on_sigterm() -> bool:
    """Install the handler (main thread only: Python runs signal handlers there); whether it is
    installed now."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def installed() -> bool:
    return signal.getsignal(signal.SIGTERM) is _on_sigterm


def _replaceable(handler) -> bool:
    """Nobody chose this handler: Python's default, Ray's own (``ray.init`` installs it), or ours."""
    return handler in (signal.SIG_DFL, None, _on_sigterm) or \
        (getattr(handler, "__module__", None) or "").split(".")[0] == "ray"


def take_over() -> bool:
    """Install the handler where the one in place is nobody's choice (the default, Ray's, ours);
    a handler the program installed itself stays. Whether ours is installed now."""
    if threading.current_thread() is threading.main_thread() and _replaceable(signal.getsignal(signal.SIGTERM)):
        stop_on_sigterm()
    return installed()


@contextlib.contextmanager
def kept_across_ray_init(take: bool = False):
    """Around ``ray.init``, which installs Ray's handler: ours is installed again after if it was
    in place before, or (``take``) if the one before was nobody's choice (:func:`take_over`)."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and (before is _on_sigterm or (take and _replaceable(before))):
            stop_on_sigterm()
