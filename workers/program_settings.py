"""Settings a program may change for itself, kept apart from the engine it runs inside.

A program runs on the engine's own thread (calls.py), and torch keeps some settings per thread:
grad mode, the default dtype, the CPU thread count, and the stack of torch function and dispatch
modes, which is where ``with torch.device("meta"):`` and ``torch.set_default_device`` live. A
program that set one and then read the model handed the engine its setting: the rest of the
forward pass, every invoke's, ran under it. ``with torch.device("meta"):`` around a read ended
the engine's worker (a CPU kernel called on meta tensors), losing every trace in the batch.
``sys.stdout`` and ``sys.stderr`` are the process's: a program's ``contextlib.redirect_stdout``
around a read sent what the programs run meanwhile printed (printed.py) into its buffer.

So each program's settings are its own, as a thread's would be. Where a program hands control
back to the engine (it waits at a point, or ends), what it changed is set aside and the engine's
settings, read as the engine switched in, are put back; when the engine resumes the program, the
program's are put back in turn, so that its ``with`` blocks unwind what they entered. Nothing is
done where nothing changed: a check is eight reads (0.2 us on the 2-core CPU).

Not kept apart: torch's random generators (a program that seeds the global one seeds the
engine's sampling too; a program of its own ``torch.Generator`` is the fix) and inference mode
(a program that leaves it off across a read makes the engine's tensors ordinary ones, slower but
the same values).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch
from torch.utils import _device
from torch.utils import _python_dispatch

_grad = torch.is_grad_enabled
_dtype = torch.get_default_dtype
_threads = torch.get_num_threads
_function_modes = torch._C._len_torch_function_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack


class Settings(NamedTuple):
    """What is compared at every hand-over (cheap reads only). :func:`settings` returns a plain
    tuple of these fields, about half the cost of building this class (0.2 us against 0.37)."""

    grad: bool
    dtype: torch.dtype
    threads: int
    function_modes: int  # how many torch function modes are entered (a default device is one)
    dispatch_modes: int
    device: torch.device | None  # the default device torch.utils._device records (None: none set)
    stdout: Any
    stderr: Any


def settings() -> tuple:
    """The engine's settings now, as a :class:`Settings` tuple."""
    return (_grad(), _dtype(), _threads(), _function_modes(), _dispatch_modes(), _device.CURRENT_DEVICE,
            sys.stdout, sys.stderr)


class SetAside(NamedTuple):
    """A program's own settings while the engine runs: put back by :func:`put_back`."""

    settings: Settings
    function_modes: list  # bottom first
    dispatch_modes: list
    device_context: object  # torch's record of the mode torch.set_default_device entered


def set_aside(engine: tuple) -> SetAside | None:
    """Put the engine's settings ``engine`` back; return what the program had set instead (None:
    nothing differs). Modes the program entered on top of the engine's are taken off the stack."""
    own = settings()
    if own == engine:
        return None
    own, engine = Settings._make(own), Settings._make(engine)
    functions = [torch._C._pop_torch_function_stack() for _ in range(own.function_modes - engine.function_modes)]
    dispatches = [_python_dispatch._pop_mode() for _ in range(own.dispatch_modes - engine.dispatch_modes)]
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    if engine.device is None:  # (an engine with a default device of its own keeps torch's record as it is)
        torch._GLOBAL_DEVICE_CONTEXT.device_context = None
    _device.CURRENT_DEVICE = engine.device
    _put(engine, own)
    return SetAside(own, functions[::-1], dispatches[::-1], context)


def put_back(aside: SetAside, engine: tuple) -> None:
    """Give a program resumed under ``engine``'s settings its own again."""
    for mode in aside.function_modes:
        torch._C._push_on_torch_function_stack(mode)
    for mode in aside.dispatch_modes:
        _python_dispatch._push_mode(mode)
    torch._GLOBAL_DEVICE_CONTEXT.device_context = aside.device_context
    _device.CURRENT_DEVICE = aside.settings.device
    _put(aside.settings, Settings._make(engine))


def _put(wanted: Settings, now: Settings) -> None:
    if wanted.grad != now.grad:
        torch.set_grad_enabled(wanted.grad)
    if wanted.dtype != now.dtype:
        torch.set_default_dtype(wanted.dtype)
    if wanted.threads != now.threads:
        torch.set_num_threads(wanted.threads)
    sys.stdout, sys.stderr = wanted.stdout, wanted.stderr


# --- what a program may not set ------------------------------------------------------------------
#
# A profile or trace function is the thread's, like the settings above, but one cannot be set
# aside and put back: one a program left installed slowed every later step of the engine, everyone's
# (0.145 s against 0.08 a trace, 2-core CPU), and one installed in a worker greenlet made in the
# thread's hub after a program there was stopped spun the thread inside the program's next call,
# then again once the watchdog had let go of it: a hung engine (CPython 3.11, greenlet 3.5; see
# python-greenlet/greenlet#256 for profilers and switches at odds). So programs may not install
# one; interlace's own (bench/step_probe.py's cProfile) is installed outside programs.

_REFUSED = ("sys.setprofile and sys.settrace (profilers, tracers, pdb and breakpoint()) cannot run inside "
            "the engine, which runs many users' programs on one thread; time parts of a program with "
            "time.perf_counter() and print the figures (what a program prints comes back as result.printed)")


def refuse_profilers(watchdog: Any) -> None:
    """Make ``sys.setprofile`` and ``sys.settrace`` raise when a program's code calls them
    (``watchdog``: calls.WATCHDOG, which knows whose code runs); once per process."""
    if getattr(sys.setprofile, "__interlace_guard__", False):
        return

    def guard(original):
        def guarded(function):
            if function is not None and watchdog.running() is not None:
                raise RuntimeError(_REFUSED)
            return original(function)

        guarded.__interlace_guard__ = True
        return guarded

    sys.setprofile, sys.settrace = guard(sys.setprofile), guard(sys.settrace)
