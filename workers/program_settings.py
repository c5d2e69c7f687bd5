"""Settings a program may change for itself, kept apart from the engine it runs inside.

A program runs on the engine's own thread (calls.py), and torch keeps some settings per thread:
grad mode, the default dtype, the CPU thread count, and the stack of torch function and dispatch
modes, which is where ``with torch.device("meta"):`` and ``torch.set_default_device`` live. A
program that set one and then read the model handed the engine its setting: the rest of the
forward pass, every invoke's, ran under it. ``with torch.device("meta"):`` around a read ended
the engine's worker (a CPU kernel called on meta tensors), losing every trace in the batch.
``sys.stdout`` and ``sys.stderr`` are the process's: a program's ``contextlib.redirect_stdout``
around a read sent what the programs run meanwhile printed (printed.py) into its buffer.

torch's default random generators are the process's: ``torch.manual_seed`` in a program reseeded
the generator vLLM samples every request with, so the other invokes' sampling repeated the
program's noise at every step it seeded, and the draws of programs run between its reads moved
its seeded stream.

So each program's settings are its own, as a thread's would be. Where a program hands control
back to the engine (it waits at a point, or ends), what it changed is set aside and the engine's
settings, read as the engine switched in, are put back; when the engine resumes the program, the
program's are put back in turn, so that its ``with`` blocks unwind what they entered. Nothing is
done where nothing changed: a check is nine reads (0.2 us on the 2-core CPU).

The generators become a program's own once it seeds them or sets their state (the functions
:func:`keep_generators_apart` wraps: ``torch.manual_seed``, ``torch.cuda.manual_seed``,
``torch.set_rng_state``...; transformers' ``set_seed`` calls them too): the engine's states are
read then, and are put back at every hand-over while the program's wait for it. Reading two
generators' states at every hand-over would cost a program per invoke 1-2 us a switch; a seed
costs nothing until a program makes one. A program that draws without seeding draws from the
engine's stream, as the engine's sampling does: random either way.

Not kept apart: inference mode (a program that leaves it off across a read makes the engine's
tensors ordinary ones, slower but the same values), and the generators' own methods called on
``torch.default_generator`` (``torch.default_generator.manual_seed(0)``), which cannot be wrapped.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable, NamedTuple

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
    generators: Any  # the engine's generator states while a program that seeded runs (None: the engine's own)


def settings() -> tuple:
    """The engine's settings now, as a :class:`Settings` tuple."""
    return (_grad(), _dtype(), _threads(), _function_modes(), _dispatch_modes(), _device.CURRENT_DEVICE,
            sys.stdout, sys.stderr, _GENERATORS.engine)


class SetAside(NamedTuple):
    """A program's own settings while the engine runs: put back by :func:`put_back`."""

    settings: Settings
    function_modes: list  # bottom first
    dispatch_modes: list
    device_context: object  # torch's record of the mode torch.set_default_device entered
    generators: Any  # the program's generator states, if it seeded (keep_generators_apart)


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
    generators = None
    if own.generators is not None:  # the program seeded: its states aside, the engine's back
        generators = _GENERATORS.states()
        _GENERATORS.put(own.generators)
        _GENERATORS.engine = None
    return SetAside(own, functions[::-1], dispatches[::-1], context, generators)


def put_back(aside: SetAside, engine: tuple) -> None:
    """Give a program resumed under ``engine``'s settings its own again."""
    for mode in aside.function_modes:
        torch._C._push_on_torch_function_stack(mode)
    for mode in aside.dispatch_modes:
        _python_dispatch._push_mode(mode)
    torch._GLOBAL_DEVICE_CONTEXT.device_context = aside.device_context
    _device.CURRENT_DEVICE = aside.settings.device
    _put(aside.settings, Settings._make(engine))
    if aside.generators is not None:  # the engine's states as they are now (it sampled since), then the program's
        _GENERATORS.engine = _GENERATORS.states()
        _GENERATORS.put(aside.generators)


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
# one; interlace's own (bench/step_probe.py's cProfile) is installed outside programs. cProfile
# installs its profiler from C, past sys.setprofile: its Profile.enable is guarded alike. (Other
# C profilers, line_profiler or yappi, are not.)

_REFUSED = ("sys.setprofile and sys.settrace (profilers, cProfile, tracers, pdb and breakpoint()) cannot run inside "
            "the engine, which runs many users' programs on one thread; time parts of a program with "
            "time.perf_counter() and print the figures (what a program prints comes back as result.printed)")


def _before(owner: Any, name: str, check: Callable[..., None]) -> None:
    """Wrap ``owner.name`` so that ``check`` sees its arguments first (once per process: a
    wrapped function is left as it is)."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, "__interlace_guard__", False):
        return

    @functools.wraps(original)
    def checked(*args, **kwargs):
        check(*args)
        return original(*args, **kwargs)

    checked.__interlace_guard__ = True
    setattr(owner, name, checked)


def _refuser(watchdog: Any, message: str) -> Callable[[], None]:
    def refuse() -> None:
        if watchdog.running() is not None:  # a program's code runs (calls.WATCHDOG knows whose)
            raise RuntimeError(message)

    return refuse


def refuse_profilers(watchdog: Any) -> None:
    """Make ``sys.setprofile``, ``sys.settrace`` and ``cProfile.Profile.enable`` raise when a
    program's code calls them (``watchdog``: calls.WATCHDOG)."""
    import cProfile

    refuse = _refuser(watchdog, _REFUSED)
    for name in ("setprofile", "settrace"):
        _before(sys, name, lambda function: function is None or refuse())  # (taking one off is allowed)
    _before(cProfile.Profile, "enable", lambda *_: refuse())


# --- torch's random generators -------------------------------------------------------------------


class _States:
    """Generators' states, read at one moment (compared by identity in a settings tuple)."""

    __slots__ = ("each",)

    def __init__(self, each: list[tuple[torch.Generator, torch.Tensor]]):
        self.each = each


class _Generators:
    """torch's default generators this process draws from (the CPU's, and its GPU's once CUDA is
    up), and the engine's states while a program that seeded them runs."""

    def __init__(self):
        self.engine: _States | None = None

    @staticmethod
    def states() -> _States:
        each = [torch.default_generator]
        if torch.cuda.is_initialized():  # a worker draws on its own device only
            each.append(torch.cuda.default_generators[torch.cuda.current_device()])
        return _States([(generator, generator.get_state()) for generator in each])

    @staticmethod
    def put(states: _States) -> None:
        for generator, state in states.each:
            generator.set_state(state)


_GENERATORS = _Generators()

# Where torch seeds or sets its default generators' states (one function may go by several names;
# torch.manual_seed calls torch.cuda.manual_seed_all: the engine's states are read once)
_SEEDING = {"torch": ("manual_seed", "seed", "set_rng_state"),
            "torch.random": ("manual_seed", "seed", "set_rng_state"),
            "torch.cuda": ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all"),
            "torch.cuda.random": ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state",
                                  "set_rng_state_all")}


def keep_generators_apart(watchdog: Any) -> None:
    """Make torch's seeding functions, called from a program's code (``watchdog``: calls.WATCHDOG,
    which knows whose code runs), first read the engine's generator states: the program's
    hand-overs put them back (:func:`set_aside`)."""

    def engine_states_first(*_args) -> None:
        if _GENERATORS.engine is None and watchdog.running() is not None:
            _GENERATORS.engine = _GENERATORS.states()

    for module, functions in _SEEDING.items():
        for name in functions:
            _before(importlib.import_module(module), name, engine_states_first)


# The process's resource limits are everyone's: a program that lowered the open-file limit left the
# engine unable to write any later trace's report (each trace failed after the driver's grace, and
# so did every trace after it), and one on memory or CPU time would end the engine for all.
_LIMITS_REFUSED = ("resource.setrlimit and resource.prlimit cannot run inside the engine: its resource limits "
                   "are those of every user's traces")


def refuse_resource_limits(watchdog: Any) -> None:
    """Make ``resource.setrlimit`` and ``resource.prlimit`` (setting a limit) raise when a
    program's code calls them."""
    import resource

    refuse = _refuser(watchdog, _LIMITS_REFUSED)
    _before(resource, "setrlimit", lambda *_: refuse())
    _before(resource, "prlimit", lambda *args: len(args) < 3 or refuse())  # (reading one is allowed)


def install(watchdog: Any) -> None:
    """What a program may not set, and the generators it may seed for itself: once per process."""
    refuse_profilers(watchdog)
    refuse_resource_limits(watchdog)
    keep_generators_apart(watchdog)
