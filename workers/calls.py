"""Running a program interleaved with the forward pass.

A :class:`ProgramCall` is one run of a user program for one generation step over one group of
invokes. It runs in a greenlet on the engine's own thread: each module access switches back to
the engine, which switches into the program again when the forward pass reaches that module. Only
one side runs at a time, so the program sees a consistent model and the engine never races it, and
a switch costs under a microsecond (a handoff between two threads cost 0.1-0.2 ms inside vLLM's
process on an H200 host, five of them per step for a program saving 4 layers: see
docs/benchmarks.md). Running on the engine's thread, a program also runs on its CUDA device and
stream and in its inference mode, with nothing to set up.

The engine side never lets a user exception or a hang through: errors are captured as records
with the user's traceback, and a program that overruns its time budget is interrupted by the
:class:`~interlace.workers.watchdog.Watchdog` (an exception raised inside the program) and its invokes fail.

A program can refuse to stop: it may catch the interruption (``except BaseException``) and go on,
or sit inside one long call into C (``time.sleep``), where no exception lands. Its thread is the
engine's, so nothing else can run while it does. :data:`watchdog.GRACE_S` after its deadline the watchdog
ends the worker process, after writing the reason into the invokes' reports: the engine dies at
once (not when vLLM's own time-outs fire, minutes later), the driver's error names the program
that ignored its time limit, and the next trace starts a new engine.

Whatever ends the process while a program's code runs (that last resort, ``os._exit``, a crash),
the rank's flight recorder (flight.py) names the program: :meth:`ProgramCall._switch_in` marks it
running for each switch into the program, and idle when control comes back.

Under tensor parallelism every rank runs the same program on the same values, and some of its
accesses enter a collective (a value split across ranks is gathered whole). A rank that stopped
a program on its own clock would skip a collective the other ranks enter, and the group would
hang. So with ``local_limits=False`` (TP > 1) a program that comes back to the engine is judged
by the time the ranks agree on: at the step's end (tp_agreement.agree_on_time, carried by the
step's last agreement round on the host) a program past its limit is stopped, and a budget spent
in an earlier step stops it at its start, identically on every rank. A program that never comes
back (a busy loop) is interrupted by each rank's watchdog on that rank's clock, as on one rank:
it unwinds in its own code, before it could enter a gather, and the next agreement round, which
every rank reaches before anything is gathered for a call, times the call out on every rank
(tp_agreement.agree_on_paths). Only the last resort ends the process (every rank's program is
past its deadline by then; the group dies together instead of hanging).

The same holds for the program's own path: the ranks run the same bytes on the same values, but
a program can still consult something rank-local (the clock, the process id, a file, a device
error on one GPU). The interleaver compares each call's next move across the group before it
enters any collective for it (tp_agreement.agree_on_paths), and a call that went different
ways is stopped on every rank (:meth:`ProgramCall.stop`). Under pipeline parallelism a later stage replays an
earlier stage's accesses; each replayed access is checked against the one logged there.
"""

from __future__ import annotations

import inspect
import time
import traceback
from typing import Any, Callable

import greenlet
import torch

from interlace.workers import program_settings
from interlace.workers.greenlets import deep_frames, deep_switch, idle_workers
from interlace.workers.printed import Printed
from interlace.workers.points import Point
from interlace.workers.watchdog import Watchdog


class ProgramError(BaseException):
    """Raised inside a program to stop it (timeout, engine-side refusal). A BaseException, so a
    program's ``except Exception`` does not swallow it."""




# Raises ProgramError in a program past its deadline, and ends the process a program that swallows it
WATCHDOG = Watchdog(ProgramError)


class RanksDiverged(ProgramError):
    """A program took different paths on the ranks that must run it alike."""


class Suspended(ProgramError):
    """Raised inside a program whose next access belongs to a later pipeline stage."""


class _Finished:
    """Sentinel: the program returned (or failed) for this step. Its module and kind match no
    point's, so a scan for the calls waiting at a point needs no separate ``done`` test."""

    module = kind = None


FINISHED = _Finished()


# Failures that NNsight's idioms meet here, and what to write instead (appended to the message)
_HINTS = (
    (AttributeError, "object has no attribute 'save'",
     "values in a program are plain tensors: save one with m.save(name, value) (NNsight's value.save())"),
    (RuntimeError, "does not require grad",
     "the model runs without gradients (vLLM's inference kernels have no backward; docs/guide.md, Limits today); "
     "for gradients of your own code on a value the program read (a probe's), compute them inside "
     "`with torch.inference_mode(False), torch.enable_grad():` on a .clone() of the value"),
    # A program travels by value, the modules it uses by name (but its own: trace.programs_by_value);
    # a replica's actor or another node may not have them on its path (a sys.path.insert in the script).
    (ModuleNotFoundError, "No module named",
     "the program uses a module that the engine's process cannot import: install it where the engines run, give "
     "Ray's runtime_env={'py_modules': [module]} to ray.init, or send it with the program by calling "
     "cloudpickle.register_pickle_by_value(module) before the trace"),
)


def error_record(exc: BaseException, where: str) -> dict:
    """A picklable description of a failure, with the user's own traceback."""
    message = str(exc)
    for kind, says, hint in _HINTS:
        if isinstance(exc, kind) and says in message:
            message = f"{message}; {hint}"
    return {
        "type": type(exc).__name__,
        "message": message,
        "where": where,
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }


class ProgramCall:
    """One program run over one step; the engine drives it with :meth:`start` and :meth:`resume`."""

    def __init__(self, program: Callable, view, budget_s: float, limit_s: float, replay: list | None = None,
                 keep_log: bool = False, local_limits: bool = True, replay_points: list | None = None,
                 flight=None):
        self.program = program
        # The rank's flight recorder entry for this program (flight.py): marked while the
        # program's code runs, so a process it ends can be pinned on it. None: not recorded.
        self.flight = flight
        # False under TP > 1: time-outs are decided at points every rank agrees on (module docstring)
        self.local_limits = local_limits
        self.view = view
        self.budget_s = budget_s  # program running time left to the trace
        self.limit_s = limit_s  # the trace's whole time limit (for the message)
        # Pipeline parallelism (see pipeline.py): the values earlier stages' accesses returned, and
        # whether to log this stage's for the next one.
        self.replay = replay or []
        self.replay_points = replay_points or []  # which access made each value there
        self.replaying = replay is not None  # even with no values: the code before the first access ran there
        # What a later stage replays: every access so far, this stage's and the earlier ones'
        self.log: list | None = list(self.replay) if keep_log else None
        self.log_points: list = list(self.replay_points)
        self.accesses = 0
        self.used_s = 0.0  # time the program ran in this call (engine time not counted)
        self.agreed_s = 0.0  # under TP: the most any rank of the group counted (see tp_agreement.agree_on_time)
        self.waiting_for: Point | _Finished | None = None  # what the program needs next
        # ``waiting_for is FINISHED``, kept as a field (set by _finish): read about ten times a
        # program per step, where a property call cost more than the test
        self.done = False
        self.error: dict | None = None
        self.timed_out = False  # past its budget (set by the watchdog, or by the engine between switches)
        self.stopped = False  # stopped by the engine with its own record (see stop)
        self.writes = 0  # writes to the model so far (the interleaver's count, compared across TP ranks)
        # Registered with the watchdog: set and cleared by it under its lock, read without (only
        # this call's own thread registers it), so a switch pays one locked leave, not two.
        self.watched = False
        self.deadline = 0.0  # when the watchdog interrupts it (set as it enters)
        # Started at its first point rather than at the step's start (start_at; prologue.py):
        # ``unstarted`` while it waits there without having run, ``_handed`` the (point, value) its
        # first wait takes without a switch. ``first_point``: where it first waited this step,
        # ``last_first`` and ``last_inputs`` the same and its prologue's index values a step ago.
        self.prologue = None  # prologue.Prologue, where the program may start at its first point (one rank, one stage)
        self.unstarted = False
        self._handed: tuple | None = None
        self.first_point: Point | None = None
        self.last_first: Point | None = None
        self.last_inputs: tuple | None = None
        self._greenlet: greenlet.greenlet | None = None  # the worker running the program, from start to its end
        self._engine: greenlet.greenlet | None = None  # who switched in last: where accesses switch back to
        self._dropped = False  # its worker was collected while the program waited (greenlet raised GreenletExit there)
        # the settings a program may change for itself (torch's, sys.stdout), as the engine had
        # them when it last switched in: the program puts them back whenever it hands control back
        self._engine_settings: tuple | None = None  # a program_settings.Settings
        self.printed: Printed | None = None  # what the program wrote to stdout or stderr this step (printed.py)
        self.threads: list = []  # threads the program started this step (program_settings.stop_threads)

    def again(self, budget_s: float) -> None:
        """The same program over the same invokes one step on, within an epoch (the interleaver
        reuses the call, its context and its view then): every per-step field as a new call has
        it, without building one. With a program per invoke a step built 256 calls, contexts and
        views, 9 us each on the 2-core CPU, and their garbage set off the collector every few
        hundred."""
        self.budget_s = budget_s
        if self.log is not None:  # no replay where a call is reused (see Interleaver.begin_step)
            self.log, self.log_points = [], []
        self.accesses = 0
        self.used_s = self.agreed_s = 0.0
        self.waiting_for = self.error = None
        self.done = False
        self.timed_out = self.stopped = self.watched = False
        self.writes = 0
        self._greenlet = self._engine = None
        self._dropped = False
        self.printed = None
        self.last_first, self.first_point = self.first_point, None
        self.unstarted, self._handed = False, None
        self.view._bind(self)

    # --- engine side ---------------------------------------------------------------------------

    def start(self) -> None:
        self._switch_in(_START)

    def start_at(self, point: Point | None, value: Any) -> None:
        """Start a program whose first access is ``point`` (its prologue only walks the module
        tree: prologue.py) where the forward pass is at that point: its first wait takes ``value``
        without switching back, one round trip instead of two (``point`` None: ``value`` is
        raised there, see wait_at)."""
        self.unstarted = False
        self._handed = (point, value)
        try:
            self._switch_in(_START)
        finally:
            self._handed = None

    def resume(self, value: Any) -> None:
        """Hand ``value`` to the program waiting at its point; return when it waits again."""
        self._switch_in(value)

    def cancel(self, reason: str) -> None:
        """Stop a program that is waiting at a point that will not come, or that never started
        (its step's start failed before it: runner_hooks._guard failed its invokes)."""
        if self.waiting_for is None and not self.unstarted:
            self.error = self.error or error_record(ProgramError(reason), where=self.view.where())
            self._finish()
            return
        self._switch_in(ProgramError(reason))

    def suspend(self) -> None:
        """Stop a program whose next access runs on a later pipeline stage (not an error)."""
        self._switch_in(Suspended())

    def _start_to_stop(self, stop: BaseException) -> None:
        """A program waiting unstarted is stopped as a started one is: it runs to its first wait,
        where ``stop`` is raised."""
        self.start_at(None, stop)

    def _finish(self) -> None:
        """The program returned, failed or was stopped: it waits for nothing more this step."""
        self.waiting_for = FINISHED
        self.done = True
        if self.threads:
            left = program_settings.stop_threads(self.threads)
            self.threads = []
            if left is not None:
                self.error = self.error or error_record(RuntimeError(left), where=self.view.where())

    @property
    def running(self) -> bool:
        """Whether the program's frames are the ones its thread runs now (greenlet keeps a frame
        only for a greenlet switched out; this flips inside the switch itself)."""
        return bool(self._greenlet) and self._greenlet.gr_frame is None

    def _switch_in(self, value: Any) -> None:
        """Run the program until it waits at its next point or finishes, within its budget (a
        :class:`ProgramError` handed in is raised at the program's point)."""
        if self.done:
            return
        if self.unstarted and value is not _START:
            return self._start_to_stop(value)
        if self.used_s >= self.budget_s if self.local_limits else self.budget_s <= 0:
            self._time_out()
            return
        switch = None
        if value is _START:  # an idle worker of this thread runs it (see _worker)
            idle = idle_workers()
            if idle:
                self._greenlet = idle.pop()
            else:
                self._greenlet = greenlet.greenlet(_worker)
                switch = deep_switch  # its first switch sets where its stack starts
            value = self
        self._engine = greenlet.getcurrent()
        self._engine_settings = program_settings.settings()
        started = time.monotonic()
        WATCHDOG.enter(self, started + self.budget_s - self.used_s)
        flight = self.flight
        if flight is not None:
            flight.recorder.enter(flight)
        try:
            if switch is None:
                self._greenlet.switch(value)
            else:
                switch(self._greenlet, value, deep_frames())
        except ProgramError:  # an interruption that landed as the program was leaving (see Watchdog)
            pass
        finally:
            if flight is not None:
                flight.recorder.leave()
            if self.watched:  # the program switched back without leaving (it finished, or raised)
                WATCHDOG.leave(self)
            self.used_s += time.monotonic() - started
        # Interrupted by the watchdog (on any layout), or finished past the limit by this rank's
        # clock (one rank alone only: under TP the ranks agree on that at the step's end).
        if self.timed_out or (self.local_limits and self.used_s >= self.budget_s):
            self._time_out()

    def release(self) -> None:
        """The step is over: drop the links from the program's ``m`` back to this call and to the
        value it read last, and from the call to its worker, so that what the step held goes by
        reference counting when the step's epoch does (the interleaver keeps an epoch's calls
        to reuse them: ProgramCall.again). Left linked, every program call of every step was
        garbage only the collector could free: with a program per invoke (256 invokes x 32 steps,
        tiny model, 2-core CPU, bench/step_probe.py) the collections took 12 ms a step (full ones
        of 110-125 ms), and 3 ms once released. A program that keeps ``m`` past its step finds it
        unbound (view.STEP_OVER) until the view serves its invoke's next step."""
        self.view._bind(None)
        self._greenlet = None

    def time_out(self) -> None:
        """Stop the program now, as past its time limit (the TP group agreed it is)."""
        if not (self.done and self.timed_out):
            self._time_out()

    def stop(self, record: dict) -> None:
        """End the program now, failing its invokes with ``record`` unless it failed already (the
        TP group agreed it must end, e.g. its ranks went different ways)."""
        self.stopped = True
        self._unwind("stopped")
        self.error = self.error or record
        self._finish()

    def _unwind(self, why: str) -> None:
        """Raise :class:`ProgramError` at the point the program waits at, so its frames unwind."""
        if self._greenlet is not None:  # started and not finished: waiting at a point
            self._engine = greenlet.getcurrent()  # where it switches back to: here, not the hub that ran it last
            self._engine_settings = program_settings.settings()
            WATCHDOG.enter(self, time.monotonic())  # a program that swallows the stop is interrupted
            if self.flight is not None:
                self.flight.enter()  # its except and finally blocks run now
            try:
                self._greenlet.throw(ProgramError(why))
            except ProgramError:
                pass
            finally:
                if self.flight is not None:
                    self.flight.leave()
                WATCHDOG.leave(self)

    def _time_out(self) -> None:
        """Stop a program past its budget: its frames unwind now, its invokes fail."""
        self.timed_out = True
        self._unwind("time limit")
        self.error = self.error or error_record(
            TimeoutError(f"the program ran past the trace's time limit of {self.limit_s:g}s and was stopped"),
            where=str(self.waiting_for) if isinstance(self.waiting_for, Point) else self.view.where(),
        )
        self._finish()

    # --- program side --------------------------------------------------------------------------

    def access(self, live: Callable[[], Any], what: Any = None) -> Any:
        """One access of the program (``what``: a point, parameter or recv): replayed from the
        carry while earlier pipeline stages already made it, else ``live()``; logged when a later
        stage needs it."""
        index, self.accesses = self.accesses, self.accesses + 1
        if index < len(self.replay):
            made = self.replay_points[index] if index < len(self.replay_points) else what
            if made != what:  # the value replayed is another access's: using it would be silently wrong
                diverged = RanksDiverged(
                    f"the program took another path on this pipeline stage than on the stages before it: "
                    f"its access #{index + 1} was {made} there and {what} here. Every stage runs the program "
                    "and must make the same accesses; something stage-local (the clock, the process id or "
                    "rank, a file, randomness seeded apart) decided otherwise"
                )
                self.error = self.error or error_record(diverged, where=self.view.where())  # even if caught
                raise diverged
            return self.replay[index]
        self.replaying = False
        value = live()
        if self.log is not None:
            self.log.append(_snapshot(value))
            self.log_points.append(what)
        return value

    def wait_at(self, point: Point) -> Any:
        """Called from the program: switch back to the engine until it reaches ``point``."""
        if greenlet.getcurrent() is not self._greenlet:  # before any of the call's state changes
            raise RuntimeError(f"{point} was read from outside the program's own run (another thread, or after the "
                               "step): a program reads and writes m only in its own code, as the engine calls it")
        if self.timed_out:  # still watched: a program that swallows this is interrupted again
            raise ProgramError("time limit")
        if self.first_point is None:
            self.first_point = point
            handed = self._handed
            if handed is not None:  # started at its first point (start_at), or to be stopped there
                self._handed = None
                if handed[0] is None:
                    raise handed[1]
                if point is handed[0] or point == handed[0]:
                    return handed[1]
        WATCHDOG.leave(self)
        self.waiting_for = point
        aside = program_settings.set_aside(self._engine_settings)  # the engine runs with its own settings
        try:
            value = self._engine.switch()
        except greenlet.GreenletExit:  # its worker is being collected: dropped while it waited (see _worker)
            self._dropped = True
            raise
        finally:
            if aside is not None:  # the program's own again, for its code (and its with blocks' exits)
                program_settings.put_back(aside, self._engine_settings)
        if isinstance(value, ProgramError):
            raise value
        return value

    def print(self, text: str) -> None:
        """What the program wrote to ``sys.stdout`` or ``sys.stderr`` (printed.ProgramStream)."""
        if self.printed is None:
            self.printed = Printed()
        self.printed.add(0, text)

    def _run(self) -> None:
        try:
            returned = self.program(self.view)
            if returned is not None:  # (the driver refuses such programs; a raw request may not have been checked)
                _refuse_lazy(returned)
        except Suspended:
            pass
        except BaseException as exc:  # noqa: BLE001 - every user failure becomes a record
            if self._dropped and type(exc) is greenlet.GreenletExit:  # its worker is being collected (see _worker)
                raise  # (a GreenletExit the program raised itself is a failure like any other)
            if not (self.timed_out or self.stopped):
                self.error = error_record(exc, where=self.view.where())
        finally:
            WATCHDOG.leave(self)
            program_settings.set_aside(self._engine_settings)  # what the program set ends with it
            self._finish()


def _refuse_lazy(returned: Any) -> None:
    """Fail a program that returned a generator or coroutine: none of its code ran."""
    if inspect.isgenerator(returned) or inspect.iscoroutine(returned) or inspect.isasyncgen(returned):
        if hasattr(returned, "close"):  # no "coroutine was never awaited" warning
            returned.close()
        raise TypeError(f"the program returned a {type(returned).__name__} without running its code (a generator "
                        "or async function); programs are plain functions of m")


_START = object()  # handed to _switch_in by ProgramCall.start
def _worker(job: "ProgramCall | _Starts") -> None:
    """A greenlet's life: run one call's program, or a run of programs started at their first
    points (:func:`start_at_points`), to its end, go back to the engine (whoever switched in
    last), and wait, idle, for the next. A new greenlet per call cost 7 us to create and run to
    its end, against 0.5 us for two switches into a waiting one (2-core CPU): with a program per
    invoke, every invoke's call every step made one."""
    while True:
        try:
            if type(job) is _Starts:
                call = job.run(greenlet.getcurrent())
            else:
                call = job
                try:
                    call._run()
                except ProgramError:  # an interruption that landed on the program's way out (see Watchdog)
                    WATCHDOG.leave(call)
                    call._finish()
        except greenlet.GreenletExit:  # dropped while its program waited: this greenlet ends
            return
        engine, call._greenlet = call._engine, None
        idle_workers().append(greenlet.getcurrent())  # not kept in this frame: no cycle through it
        job = call = None  # nor what it ran (a run of starts holds their values) while it is idle
        job = engine.switch()


class _Starts:
    """Programs started at their first points one after another in one worker greenlet
    (:func:`start_at_points`): the worker running them now, and where it is."""

    __slots__ = ("items", "next", "runner", "started")

    def __init__(self, items: list):
        self.items = items  # (call, point, value)
        self.next = 0  # the next program to start
        self.runner: greenlet.greenlet | None = None  # None once the program it ran waited again
        self.started = 0.0  # when the program running now started

    def run(self, worker: greenlet.greenlet) -> ProgramCall:
        """Run the programs from ``next`` on, each within its budget, watched and recorded as
        ProgramCall._switch_in does, until the last has ended or one waits again: that one keeps
        this worker, and the engine starts the rest in another. Returns the last program run."""
        items, clock = self.items, time.monotonic()
        while True:
            call, point, value = items[self.next]
            self.next += 1
            call._greenlet, call._handed, self.started = worker, (point, value), clock
            flight = call.flight
            try:  # (watched from here on, and running: an interruption may land at once)
                WATCHDOG.enter(call, clock + call.budget_s - call.used_s)
                if flight is not None:
                    flight.recorder.enter(flight)
                call._run()
            except ProgramError:  # an interruption that landed on the program's way in or out (see Watchdog)
                WATCHDOG.leave(call)
                call._finish()
            call._handed = None  # (unless it read its point: then wait_at let go of it)
            if self.runner is not worker:  # it waited, and whoever resumed it counts its time
                return call
            if flight is not None:
                flight.recorder.leave()
            call._greenlet = None
            clock = time.monotonic()
            call.used_s += clock - self.started
            if self.next == len(items):
                return call


def start_at_points(items: list[tuple[ProgramCall, Point, Any]]) -> None:
    """:meth:`ProgramCall.start_at` for several programs, each ``(call, point, value)``, in one
    worker greenlet one after another: a program that runs from its first point to its end (a
    program per invoke's ``m.layers[L].resid += v``) costs no switch of its own. On the 2-core
    CPU a switch into a program and back, with its accounting, was about 5 us of a program per
    invoke's 18 (bench/step_probe.py, tiny shape, 256 invokes). A program that waits again keeps
    the worker it ran in, and the rest go on in another."""
    starts: list = []
    hub = greenlet.getcurrent()
    engine_settings = program_settings.settings()
    for item in items:
        call = item[0]
        call.unstarted = False
        if call.done:
            continue
        if call.used_s >= call.budget_s if call.local_limits else call.budget_s <= 0:
            call._time_out()
            continue
        call._engine, call._engine_settings = hub, engine_settings
        starts.append(item)
    if not starts:
        return
    batch = _Starts(starts)
    while batch.next < len(starts):
        idle = idle_workers()
        worker = batch.runner = idle.pop() if idle else greenlet.greenlet(_worker)
        try:
            if worker:  # one that ran before, idle in _worker
                worker.switch(batch)
            else:  # its first switch sets where its stack starts (see deep_switch)
                deep_switch(worker, batch, deep_frames())
        except ProgramError:  # an interruption that landed as the program was leaving (see Watchdog)
            pass
        call = starts[batch.next - 1][0]
        if not call.done and batch.runner is worker:  # it waits again, keeping this worker
            batch.runner = None
            if call.flight is not None:
                call.flight.recorder.leave()
            call.used_s += time.monotonic() - batch.started
    for call, _point, _value in starts:
        # interrupted by the watchdog, or past the limit by this rank's clock (see _switch_in)
        if call.timed_out or (call.local_limits and call.used_s >= call.budget_s):
            call._time_out()


def _snapshot(value: Any) -> Any:
    """A copy that later in-place kernels (and the program's own edits) cannot change."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_snapshot(v) for v in value)
    return value
