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
its seeded stream. So are its numerics settings: float32 matmul precision (TF32 on cuBLAS, bf16
on oneDNN), deterministic algorithms, reduced-precision reductions, cuDNN's flags. One set by a
program changed every user's arithmetic for the engine's life (a float32 model is float32 on GPUs
only while matmuls stay IEEE: docs/guide.md), or made kernels without a deterministic version
raise in everyone's forward pass. And so is Python's garbage collector: ``gc.disable()`` in a
program left a long-running engine never collecting cycles. The current CUDA device and stream are
the engine thread's: a program that read the model inside ``with torch.cuda.stream(side):`` had
the rest of everyone's forward pass launched on its stream.

So each program's settings are its own, as a thread's would be. Where a program hands control
back to the engine (it waits at a point, or ends), what it changed is set aside and the engine's
settings, read as the engine switched in, are put back; when the engine resumes the program, the
program's are put back in turn, so that its ``with`` blocks unwind what they entered. Nothing is
done where nothing changed: a check is nine reads (0.2 us on the 2-core CPU).

These process-wide settings become a program's own once it changes one (the functions
:func:`keep_process_state_apart` wraps: ``torch.manual_seed``, ``torch.cuda.manual_seed``,
``torch.set_rng_state``..., transformers' ``set_seed`` calls them too; and every setter of the
numerics settings, ``torch.set_float32_matmul_precision``, ``torch.backends.cuda.matmul.allow_tf32
= ...``, ``torch.use_deterministic_algorithms``...; ``gc.disable``, ``gc.enable``,
``gc.set_threshold``; torch.cuda's and torch.accelerator's device and stream setters and
``torch.cuda.Stream``'s ``with``): the engine's are read then, and are put back
at every hand-over while the program's wait for it. Reading them at every hand-over would cost a
program per invoke several us a switch; a change costs nothing until a program makes one. A
program that draws without seeding draws from the engine's stream, as the engine's sampling does:
random either way.

Not kept apart: inference mode (a program that leaves it off across a read makes the engine's
tensors ordinary ones, slower but the same values), the generators' own methods called on
``torch.default_generator`` (``torch.default_generator.manual_seed(0)``), which cannot be wrapped,
and ``torch.set_flush_denormal`` (torch cannot read it back).
"""

from __future__ import annotations

import functools
import gc
import importlib
import sys
from typing import Any, Callable, NamedTuple

import torch
from torch.utils import _device
from torch.utils import _python_dispatch

from interlace.workers.watchdog import raise_in

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
    process: Any  # the engine's process-wide state while a program that changed it runs (None: the engine's own)


def settings() -> tuple:
    """The engine's settings now, as a :class:`Settings` tuple."""
    return (_grad(), _dtype(), _threads(), _function_modes(), _dispatch_modes(), _device.CURRENT_DEVICE,
            sys.stdout, sys.stderr, _PROCESS.engine)


class SetAside(NamedTuple):
    """A program's own settings while the engine runs: put back by :func:`put_back`."""

    settings: Settings
    function_modes: list  # bottom first
    dispatch_modes: list
    device_context: object  # torch's record of the mode torch.set_default_device entered
    process: Any  # the program's process-wide state, if it changed it (keep_process_state_apart)


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
    process = None
    if own.process is not None:  # the program changed the process's state: its own aside, the engine's back
        process = _PROCESS.read()
        _PROCESS.put(own.process)
        _PROCESS.engine = None
    return SetAside(own, functions[::-1], dispatches[::-1], context, process)


def put_back(aside: SetAside, engine: tuple) -> None:
    """Give a program resumed under ``engine``'s settings its own again."""
    for mode in aside.function_modes:
        torch._C._push_on_torch_function_stack(mode)
    for mode in aside.dispatch_modes:
        _python_dispatch._push_mode(mode)
    torch._GLOBAL_DEVICE_CONTEXT.device_context = aside.device_context
    _device.CURRENT_DEVICE = aside.settings.device
    _put(aside.settings, Settings._make(engine))
    if aside.process is not None:  # the engine's state as it is now (it sampled since), then the program's
        _PROCESS.engine = _PROCESS.read()
        _PROCESS.put(aside.process)


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


# --- the process's state: torch's random generators and numerics settings -------------------------


class _State:
    """The process's state at one moment (compared by identity in a settings tuple): each default
    generator's state, and each numerics setting's value."""

    __slots__ = ("generators", "numerics")

    def __init__(self, generators: list[tuple[torch.Generator, torch.Tensor]], numerics: list[Any]):
        self.generators = generators
        self.numerics = numerics


class _ProcessState:
    """torch's default generators this process draws from (the CPU's, and its GPU's once CUDA is
    up) and its numerics settings (:func:`_numerics`), and the engine's state while a program that
    changed it runs."""

    def __init__(self):
        self.engine: _State | None = None
        self.numerics: list[tuple[Callable[[], Any], Callable[[Any], Any]]] = []  # (read, write): install()

    def read(self) -> _State:
        generators = [torch.default_generator]
        if torch.cuda.is_initialized():  # a worker draws on its own device only
            generators.append(torch.cuda.default_generators[torch.cuda.current_device()])
        return _State([(g, g.get_state()) for g in generators], [_read(read) for read, _write in self.numerics])

    def put(self, state: _State) -> None:
        for generator, generator_state in state.generators:
            generator.set_state(generator_state)
        for (read, write), value in zip(self.numerics, state.numerics):
            if value is not _UNREAD and _read(read) != value:
                write(value)


def _read(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except RuntimeError:
        return _UNREAD


_PROCESS = _ProcessState()

# Where torch seeds or sets its default generators' states (one function may go by several names;
# torch.manual_seed calls torch.cuda.manual_seed_all: the engine's states are read once)
_SEEDING = {"torch": ("manual_seed", "seed", "set_rng_state"),
            "torch.random": ("manual_seed", "seed", "set_rng_state"),
            "torch.cuda": ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all"),
            "torch.cuda.random": ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state",
                                  "set_rng_state_all")}

# torch's numerics settings, each read by torch._C._get_<name> and set by torch._C._set_<name> (a
# getter of two values takes them as two arguments back). torch's own setters (torch.backends'
# properties, torch.set_float32_matmul_precision, torch.use_deterministic_algorithms) call these.
_FLAGS = ("cublas_allow_fp16_reduced_precision_reduction", "cublas_allow_bf16_reduced_precision_reduction",
          "cublas_allow_fp16_accumulation", "cpu_allow_fp16_reduced_precision_reduction",
          "math_sdp_allow_fp16_bf16_reduction", "cudnn_enabled", "cudnn_benchmark", "cudnn_deterministic",
          "mkldnn_enabled", "mkldnn_deterministic", "deterministic_fill_uninitialized_memory")
# Older ways to set float32 precision: torch keeps their effect in the per-backend precisions read
# above (reading them back raises once a program mixed them with the newer API)
_PRECISION_SETTERS = ("_set_fp32_precision_setter", "_set_float32_matmul_precision", "_set_cublas_allow_tf32",
                      "_set_cudnn_allow_tf32", "_set_onednn_allow_tf32")
_UNREAD = object()  # a setting torch would not read back: left as it is
# Where torch sets the current CUDA device and stream (torch.cuda.set_device, ``with
# torch.cuda.device(i):``, torch.cuda.set_stream, ``with torch.cuda.stream(s):``, torch.accelerator's
# the same). They are the engine thread's, which programs run on: a program that read the model with
# a side stream set ran the rest of everyone's forward pass on it, unordered with the engine's
# stream (the next graph piece's replay too), and one left on another device had the engine
# allocate there.
_CUDA_SETTERS = ("_cuda_setStream", "_cuda_setDevice", "_cuda_exchangeDevice", "_cuda_maybeExchangeDevice",
                 "_accelerator_setStream", "_accelerator_setDeviceIndex", "_accelerator_exchangeDevice",
                 "_accelerator_maybeExchangeDevice")
_FP32_PRECISIONS = [(backend, op) for backend in ("generic", "cuda", "cudnn", "mkldnn")
                    for op in ("all", "matmul", "conv", "rnn")]  # those this torch knows (install)


def _numerics() -> list[tuple[Callable[[], Any], Callable[[Any], Any]]]:
    """(read, write) of each numerics setting this torch has, and of the garbage collector's, the
    writes torch's and gc's own (unwrapped).
    float32 matmul precision is read per backend: the legacy reading
    (``torch.get_float32_matmul_precision``) raises once the two APIs were mixed, and follows these."""
    C = torch._C
    knobs = []
    for backend, op in _FP32_PRECISIONS:
        try:
            C._get_fp32_precision_getter(backend, op)
        except RuntimeError:  # a pair this torch does not know
            continue
        knobs.append((functools.partial(C._get_fp32_precision_getter, backend, op),
                      functools.partial(C._set_fp32_precision_setter, backend, op)))
    set_deterministic = C._set_deterministic_algorithms
    knobs.append((lambda: (C._get_deterministic_algorithms(), C._get_deterministic_algorithms_warn_only()),
                  lambda value: set_deterministic(value[0], warn_only=value[1])))
    enable, disable, set_threshold = gc.enable, gc.disable, gc.set_threshold
    knobs.append((gc.isenabled, lambda on: enable() if on else disable()))
    knobs.append((gc.get_threshold, lambda value: set_threshold(*value)))
    for name in _FLAGS:
        read, write = getattr(C, f"_get_{name}", None), getattr(C, f"_set_{name}", None)
        if read is None or write is None:
            continue
        knobs.append((read, lambda value, write=write: write(*value) if isinstance(value, tuple) else write(value)))
    if getattr(C, "_cuda_setStream", None) is not None and torch.cuda.is_available():
        # The current CUDA device and stream (the device first: a stream is set on its own device)
        get_device, set_device, set_stream = C._cuda_getDevice, C._cuda_setDevice, C._cuda_setStream
        knobs.append((get_device, set_device))
        knobs.append((lambda: C._cuda_getCurrentStream(get_device()),
                      lambda s: set_stream(stream_id=s[0], device_index=s[1], device_type=s[2])))
    return knobs


def keep_process_state_apart(watchdog: Any) -> None:
    """Make torch's seeding functions and numerics setters, called from a program's code
    (``watchdog``: calls.WATCHDOG, which knows whose code runs), first read the engine's state:
    the program's hand-overs put it back (:func:`set_aside`)."""
    from torch.backends import ContextProp

    if not _PROCESS.numerics:
        _PROCESS.numerics = _numerics()

    def engine_state_first(*_args) -> None:
        if _PROCESS.engine is None and watchdog.running() is not None:
            _PROCESS.engine = _PROCESS.read()

    for module, functions in _SEEDING.items():
        for name in functions:
            _before(importlib.import_module(module), name, engine_state_first)
    for name in (*_PRECISION_SETTERS, "_set_deterministic_algorithms", *(f"_set_{name}" for name in _FLAGS)):
        _before(torch._C, name, engine_state_first)
    _before(ContextProp, "__set__", engine_state_first)  # torch.backends.cudnn's kept torch._C's setters as they were
    for name in ("enable", "disable", "set_threshold"):
        _before(gc, name, engine_state_first)
    for name in _CUDA_SETTERS:
        _before(torch._C, name, engine_state_first)
    _before(torch.cuda.Stream, "__enter__", engine_state_first)  # ``with stream:`` sets it in C


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


# Signal handlers, masks and timers are the process's too: a program's ``signal.alarm(2)`` ended the
# engine two seconds later, long after the program returned, failing every trace then in flight
# and blaming none (2-core CPU, tiny-llama).
_SIGNALS_REFUSED = ("signal handlers, masks and timers (signal.signal, signal.alarm, signal.setitimer, "
                    "signal.pthread_sigmask...) cannot run inside the engine: its process and its signals are "
                    "every user's traces' (an alarm would end the engine later, under others' traces). A trace's "
                    "own time limit is its timeout_s")


def refuse_signals(watchdog: Any) -> None:
    """Make the ``signal`` module's functions that set a handler, a mask, a timer or send a
    signal raise when a program's code calls them (reading, ``signal.getsignal``, is allowed)."""
    import signal

    refuse = _refuser(watchdog, _SIGNALS_REFUSED)
    for name in ("signal", "alarm", "setitimer", "siginterrupt", "set_wakeup_fd", "pthread_sigmask", "pthread_kill",
                 "raise_signal"):
        _before(signal, name, lambda *_: refuse())


# The process itself is everyone's too (a probe on the 2-core CPU): a program's os.fork() left copies of
# the engine's worker running after the engine was closed (on a GPU, holding its memory), and
# os.nice or os.sched_setaffinity would slow every user's traces for the engine's life.
_PROCESS_REFUSED = ("{name} cannot run inside the engine: its process is every user's traces' (a forked copy of "
                    "the engine's worker outlives it; its priority, scheduling and cores are everyone's). Run "
                    "other programs with subprocess")
_PROCESS_CONTROLS = ("fork", "forkpty", "nice", "setpriority", "sched_setaffinity", "sched_setscheduler",
                     "sched_setparam", "setsid", "setpgrp", "setpgid")


def refuse_process_controls(watchdog: Any) -> None:
    """Make ``os.fork`` and the functions that change the process's priority, scheduling, cores
    or process group raise when a program's code calls them; and have ``threading.Thread.start``
    record the threads a program's own code starts, which :func:`stop_threads` stops at its end
    if they still run (a spinning one left running slowed every later trace 10x, 2-core CPU)."""
    import os
    import threading

    for name in _PROCESS_CONTROLS:
        refuse = _refuser(watchdog, _PROCESS_REFUSED.format(name=f"os.{name}"))
        _before(os, name, lambda *_args, refuse=refuse: refuse())

    def record_the_programs(thread: threading.Thread, *_args) -> None:
        # Only threads the program's own code starts: a library's helper threads, started lazily
        # from whatever uses it first, are long-lived by design and the library's (tqdm's monitor,
        # torch.compile's and any ThreadPoolExecutor's workers: a pool whose worker was stopped
        # never ran a task again). interlace's own are started alike (the watchdog's as a program
        # is entered, the reporter's at a first report, the unmapper's from a finalizer).
        call = watchdog.running()
        if call is not None and _shipped(sys._getframe(2).f_globals):
            call.threads.append(thread)

    _before(threading.Thread, "start", record_the_programs)


def _shipped(code_globals: dict) -> bool:
    """Whether code runs with these globals because a program shipped it (cloudpickle gives code
    sent by value globals of its own), not from a module this process imported."""
    module = sys.modules.get(code_globals.get("__name__", ""))
    return module is None or module.__dict__ is not code_globals


def stop_threads(threads: list) -> str | None:
    """At its program's end: stop the threads it started that still run (SystemExit raised in
    each at its next bytecode, which ends a thread quietly), and say why the program fails."""
    running = [thread for thread in threads if thread.is_alive()]
    for thread in running:
        raise_in(thread.ident, SystemExit)
    if not running:
        return None
    return (f"the program left {len(running)} thread(s) it started running ({', '.join(t.name for t in running)}) "
            "as it ended: interlace stopped them (a thread runs on in the engine's process, beyond the trace's "
            "time limit, beside every user's traces). Join the threads a program starts before it returns "
            "(`with ThreadPoolExecutor() as pool:` does)")


def install(watchdog: Any) -> None:
    """What a program may not set, and the process's state it may change for itself: once per process."""
    refuse_profilers(watchdog)
    refuse_resource_limits(watchdog)
    refuse_signals(watchdog)
    refuse_process_controls(watchdog)
    keep_process_state_apart(watchdog)
