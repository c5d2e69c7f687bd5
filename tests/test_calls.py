"""Program calls as greenlets: the watchdog's interruptions land in programs, never in the engine.

Programs run on the engine's own thread, and a program past its time limit is stopped by an
exception raised in that thread from another one. These tests race programs that finish just
around their deadline against a watchdog that looks every millisecond, while the "engine" (this
test) keeps running Python between calls: an interruption landing there would raise here.
"""

from __future__ import annotations

import gc
import sys
import time

import pytest
import torch

from interlace.workers import calls, greenlets
from interlace.workers.calls import ProgramCall
from interlace.workers.points import Point


class _View:
    def where(self) -> str:
        return "step 0"


@pytest.fixture
def fast_watchdog(monkeypatch):
    """A watchdog that looks every 0.2 ms, and threads that hand the GIL over every 50 us (the
    defaults, 50 ms and 5 ms, make the races below rare rather than absent)."""
    monkeypatch.setattr(calls.WATCHDOG, "period", 0.0002)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.00005)
    yield calls.WATCHDOG
    sys.setswitchinterval(interval)


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_interruptions_never_land_in_the_engine(fast_watchdog):
    timed_out = finished = 0
    for i in range(2000):
        run_for = 0.002 * (i % 5) / 4  # 0 to 2 ms: before, at and after the 1 ms budget

        def program(m, run_for=run_for):
            _spin(run_for)

        call = ProgramCall(program, _View(), budget_s=0.001, limit_s=0.001)
        call.start()  # an interruption landing on this side would raise here...
        _spin(0.0005)  # ...or here, in the engine's own Python
        assert call.done
        timed_out += call.error is not None
        finished += call.error is None
    assert timed_out and finished  # both outcomes raced
    _spin(0.01)  # and nothing is raised here afterwards: no call is left running


def test_a_program_waiting_at_a_point_is_resumed_with_its_value_and_stopped_past_its_budget(fast_watchdog):
    seen = []

    def program(m):
        seen.append(call.wait_at(Point("model.layers.0", "resid")))
        _spin(1.0)  # far past the budget: interrupted

    call = ProgramCall(program, _View(), budget_s=0.05, limit_s=0.05)
    call.start()
    assert call.waiting_for == Point("model.layers.0", "resid") and not call.done
    call.resume("value")
    assert seen == ["value"] and call.done
    assert "time limit of 0.05s" in call.error["message"] and call.used_s < 0.5


def test_a_program_that_swallows_every_interruption_inside_a_point_is_stopped_at_its_next_access(fast_watchdog):
    def program(m):
        for _ in range(100):
            try:
                _spin(0.01)
            except calls.ProgramError:
                pass
        call.wait_at(Point("model.layers.1", "resid"))  # refused: past the limit

    call = ProgramCall(program, _View(), budget_s=0.005, limit_s=0.005)
    call.start()
    assert call.done and "time limit" in call.error["message"]


def _stage_program(points: list[Point]):
    """A program that reads ``points`` in order, as ProgramView does (an access per point)."""
    def program(view):
        call = view.call
        return [call.access(lambda p=p: call.wait_at(p), p) for p in points]
    return program


class _StageView(_View):
    call: ProgramCall


def _call_on_stage(points, replay=None, replay_points=None) -> ProgramCall:
    view = _StageView()
    call = ProgramCall(_stage_program(points), view, budget_s=10, limit_s=10, replay=replay,
                       replay_points=replay_points, keep_log=True, local_limits=False)
    view.call = call
    return call


def test_a_stage_carries_every_earlier_stages_accesses_on_to_the_next():
    """Under pipeline parallelism each stage replays the accesses made before it and logs its
    own for the next: the log it carries on holds all of them, so a third stage replays the
    first stage's values in their places (not the second stage's)."""
    first, second, third = Point("model.layers.0", "resid"), Point("model.layers.1", "resid"), Point("model.layers.2", "resid")
    call = _call_on_stage([first, second, third], replay=["from stage 0"], replay_points=[first])
    call.start()
    assert call.waiting_for == second
    call.resume("from stage 1")
    assert call.waiting_for == third
    assert call.log == ["from stage 0", "from stage 1"] and call.log_points == [first, second]
    later = _call_on_stage([first, second, third], replay=call.log, replay_points=call.log_points)
    later.start()
    assert later.waiting_for == third and later.error is None


def test_a_stage_whose_program_takes_another_path_fails_instead_of_reading_another_access():
    """A replayed value belongs to the access that made it: a program that asks for another one
    on this stage (it consulted something stage-local) fails, even if it catches the error."""
    first, other = Point("model.layers.0", "resid"), Point("model.layers.1", "resid")

    def swallowing(view):
        try:
            view.call.access(lambda: view.call.wait_at(other), other)
        except BaseException:  # noqa: BLE001 - a program that catches everything
            pass

    view = _StageView()
    call = ProgramCall(swallowing, view, budget_s=10, limit_s=10, replay=["made at layers.0"], replay_points=[first],
                       keep_log=True, local_limits=False)
    view.call = call
    call.start()
    assert call.done and call.error["type"] == "RanksDiverged"
    assert "access #1 was layers.0.resid there and layers.1.resid here" in call.error["message"]


def test_a_stopped_program_fails_with_the_groups_record_even_if_it_swallows_the_stop():
    def program(view):
        while True:
            try:
                view.call.wait_at(Point("model.layers.1", "resid"))
            except BaseException:  # noqa: BLE001
                pass

    view = _StageView()
    call = ProgramCall(program, view, budget_s=10, limit_s=10, local_limits=False)
    view.call = call
    call.start()
    call.stop({"type": "RanksDiverged", "message": "went apart"})
    assert call.done and call.error["message"] == "went apart"
    call.resume(None)  # nothing runs any more
    assert call.done


def test_a_program_started_from_the_hub_and_stopped_from_the_engine_unwinds_back_to_the_engine():
    """Programs are switched into from the thread's hub (greenlets.run_shallow), but under TP the
    step's end stops calls past their agreed time from the engine itself (tp_agreement.agree_on_time):
    the stopped program unwinds back to whoever stopped it, not into the hub, which serves on."""
    unwound = []

    def program(view):
        try:
            view.call.wait_at(Point("model.layers.1", "resid"))
        finally:
            unwound.append(True)

    view = _StageView()
    call = ProgramCall(program, view, budget_s=10, limit_s=10, local_limits=False)
    view.call = call
    greenlets.run_shallow(call.start)
    assert call.waiting_for == Point("model.layers.1", "resid")
    call.time_out()  # from here, outside the hub
    assert unwound == [True] and call.done and "time limit" in call.error["message"]
    assert greenlets.run_shallow(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):  # raised in the hub, raised again here
        greenlets.run_shallow(lambda: 1 / 0)


def test_tensors_a_program_reaches_through_the_functions_it_calls_move_to_the_models_device():
    """``interlace.batched(lambda m: steer(m))`` holds its vector in ``steer``'s closure, not its
    own: the worker follows the functions a program captured (a CPU vector met a GPU stream there
    before), once each, recursion included. "meta" stands in for a GPU here."""
    from interlace.workers.interleaver import _on_device

    vector, scale = torch.ones(3), torch.full((3,), 2.0)

    def steer(m):
        return vector * scale if m else steer(1)

    program = lambda m: steer(m)  # noqa: E731 - the form a user writes
    assert _on_device(program, torch.device("meta")) is program
    assert steer(1).device.type == "meta"  # both of steer's cells, reached through the lambda's


def test_a_program_started_at_its_first_point_takes_the_value_there_and_one_never_reached_stops_there():
    """calls.ProgramCall.start_at: the program's first wait, at the point it was started for,
    returns the value handed over without a switch back; a first wait elsewhere waits as usual.
    A call left unstarted whose point never came is stopped at its first wait, as a started one
    would be, and fails with the reason given."""
    here, later = Point("model.layers.1", "resid"), Point("model.layers.2", "resid")
    seen = []

    def program(m):
        seen.append(call.wait_at(here))
        seen.append(call.wait_at(later))

    call = ProgramCall(program, _View(), budget_s=5.0, limit_s=5.0)
    call.start_at(here, "first")
    assert seen == ["first"] and call.waiting_for == later and call.first_point == here
    call.resume("second")
    assert seen == ["first", "second"] and call.done and call.error is None

    other = ProgramCall(program, _View(), budget_s=5.0, limit_s=5.0)
    call, seen[:] = other, []
    other.start_at(later, "not for here")  # its first wait is elsewhere: it waits there
    assert seen == [] and other.waiting_for == here
    other.resume("first")
    assert seen == ["first"] and other.waiting_for == later

    never = ProgramCall(program, _View(), budget_s=5.0, limit_s=5.0)
    call, seen[:] = never, []
    never.unstarted, never.waiting_for = True, here
    never.cancel("layers.1 was not reached")
    assert seen == [] and never.done and never.first_point == here
    assert never.error["type"] == "ProgramError" and "not reached" in never.error["message"]


def test_programs_started_together_run_in_one_worker_until_one_waits_again_which_keeps_it():
    """calls.start_at_points: programs handed their first points' values run one after another in
    one worker greenlet; one that waits again keeps that worker (resumed later, it ends there and
    the worker goes idle), the rest run on in another; each counts only its own time."""
    import greenlet

    here, later = Point("model.layers.1", "resid"), Point("model.layers.2", "resid")
    ran: list = []

    def quick(m):
        ran.append((m.name, m.call.wait_at(here), greenlet.getcurrent()))

    def waits(m):
        ran.append((m.name, m.call.wait_at(here), greenlet.getcurrent()))
        _spin(0.02)
        ran.append((m.name, m.call.wait_at(later), greenlet.getcurrent()))

    made = []
    for name, program in [("a", quick), ("b", waits), ("c", quick), ("d", quick)]:
        view = _StageView()
        view.name = name
        call = view.call = ProgramCall(program, view, budget_s=5.0, limit_s=5.0)
        call.unstarted, call.waiting_for = True, here
        made.append(call)
    calls.start_at_points([(call, here, f"value {k}") for k, call in enumerate(made)])
    a, b, c, d = made
    assert [(name, value) for name, value, _g in ran] == [("a", "value 0"), ("b", "value 1"), ("c", "value 2"),
                                                         ("d", "value 3")]
    workers = [g for _n, _v, g in ran]
    assert workers[0] is workers[1] and workers[2] is workers[3] and workers[1] is not workers[2]
    assert a.done and c.done and d.done and not b.done and b.waiting_for == later
    assert 0.02 <= b.used_s < 0.5 and a.used_s < 0.02 and c.used_s < 0.02
    b.resume("value 4")
    assert ran[-1][:2] == ("b", "value 4") and ran[-1][2] is workers[1] and b.done and b.error is None
    assert b.used_s >= 0.02 and all(call.error is None for call in made)


def test_a_program_started_with_others_that_runs_past_its_budget_fails_alone(fast_watchdog):
    """The watchdog interrupts the program running past its own deadline, never the ones before
    or after it in the same worker, nor the engine; a program that raises fails with its own
    record; one already past its budget is not run."""
    here = Point("model.layers.1", "resid")
    finished = []

    def quick(m):
        m.call.wait_at(here)
        finished.append(m.name)

    def loops(m):
        m.call.wait_at(here)
        _spin(1.0)
        finished.append(m.name)

    def raises(m):
        m.call.wait_at(here)
        raise KeyError("its own")

    for _round in range(20):
        made = []
        for name, program, budget in [("a", quick, 5.0), ("slow", loops, 0.01), ("b", quick, 5.0),
                                      ("bad", raises, 5.0), ("spent", quick, 0.0), ("c", quick, 5.0)]:
            view = _StageView()
            view.name = name
            call = view.call = ProgramCall(program, view, budget_s=budget, limit_s=budget)
            call.unstarted, call.waiting_for = True, here
            made.append(call)
        finished.clear()
        calls.start_at_points([(call, here, None) for call in made])
        _spin(0.001)  # an interruption landing on this side would raise here
        assert finished == ["a", "b", "c"]
        errors = {call.view.name: call.error for call in made if call.error is not None}
        assert sorted(errors) == ["bad", "slow", "spent"] and all(call.done for call in made)
        assert "time limit" in errors["slow"]["message"] and "time limit" in errors["spent"]["message"]
        assert errors["bad"]["type"] == "KeyError"


def test_a_programs_torch_settings_are_set_aside_while_the_engine_runs_and_put_back_for_it():
    """program_settings.py: what a program sets of torch's per-thread state (modes entered, default
    dtype and device, grad mode, thread count) and sys.stdout holds in its own code across its
    waits, is not there while the engine (this test) runs, and ends with it; a program stopped
    inside its ``with`` blocks unwinds them cleanly."""
    import contextlib
    import io

    from torch.utils._python_dispatch import TorchDispatchMode

    from interlace.workers import program_settings

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    engine = program_settings.Settings._make(program_settings.settings())
    counting, seen, buffer = Counting(), [], io.StringIO()

    def program(m):
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(1)
        torch.set_grad_enabled(not engine.grad)
        with torch.device("meta"), counting, contextlib.redirect_stdout(buffer):
            m.call.wait_at(Point("model.layers.0", "resid"))
            seen.append((torch.zeros(1).device.type, torch.get_default_dtype(), torch.get_num_threads(),
                         torch.is_grad_enabled()))
            print("the program's own")
            m.call.wait_at(Point("model.layers.1", "resid"))
        torch.set_default_device("meta")  # left set: it ends with the program
        sys.stderr = io.StringIO()  # so is this

    for stop in (False, True):
        view = _StageView()
        call = view.call = ProgramCall(program, view, budget_s=5.0, limit_s=5.0)
        call.start()
        assert program_settings.settings() == engine and torch.zeros(1).device.type == "cpu"
        torch.ones(2) + 1  # the engine's own ops: not the program's mode's
        print("the engine's own")  # not into the program's buffer
        call.resume("first")
        assert seen[-1] == ("meta", torch.float64, 1, not engine.grad) and program_settings.settings() == engine
        call.cancel("stopped") if stop else call.resume("second")
        assert call.done and (call.error is not None) == stop
        assert program_settings.settings() == engine and torch.zeros(1).device.type == "cpu"
    assert counting.ops == 2  # the program's torch.zeros, in each run: none of the engine's
    assert buffer.getvalue() == "the program's own\n" * 2


def _numerics() -> tuple:
    """What the test below changes: torch's numerics settings, as torch's public API reads them."""
    return (torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cuda.matmul.fp32_precision,
            torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            gc.isenabled(), gc.get_threshold())


def test_a_programs_numerics_and_gc_settings_are_its_own_and_the_engine_keeps_its_own():
    """program_settings.keep_process_state_apart: torch's numerics settings and the garbage
    collector's are the process's (a program's TF32 or bf16 matmuls, deterministic algorithms or
    ``gc.disable()`` were every user's until the engine ended); a program that sets them keeps them across its waits, the engine runs with its own in
    between, and a program stopped at a wait leaves the engine's."""
    from interlace.workers import program_settings

    program_settings.keep_process_state_apart(calls.WATCHDOG)
    engine = _numerics()
    changed = ("bf16", "ieee" if engine[1] == "tf32" else "tf32", True, True, not engine[4], not engine[5], False,
               (12345, 10, 10))
    seen = []

    def program(m):
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        torch.backends.cuda.matmul.allow_tf32 = engine[1] != "tf32"  # (the older API: a precision of the newer)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = not engine[4]  # (a property that kept torch._C's setter as it was)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = not engine[5]
        gc.disable()  # (the process's too)
        gc.set_threshold(12345, 10, 10)
        m.call.wait_at(Point("model.layers.0", "resid"))
        seen.append(_numerics())
        m.call.wait_at(Point("model.layers.1", "resid"))
        seen.append(_numerics())

    for stop in (False, True):
        seen.clear()
        view = _StageView()
        call = view.call = ProgramCall(program, view, budget_s=5.0, limit_s=5.0)
        call.start()
        assert _numerics() == engine and program_settings._PROCESS.engine is None
        call.resume("first")
        assert _numerics() == engine
        call.cancel("stopped") if stop else call.resume("second")
        assert call.done and call.error is None or stop
        assert seen == [changed] * (2 - stop)
        assert _numerics() == engine and program_settings._PROCESS.engine is None


def test_a_program_that_seeds_torchs_generator_draws_its_own_stream_and_the_engine_keeps_its_own():
    """program_settings.keep_process_state_apart: a program's ``torch.manual_seed`` seeds a stream of
    its own across its waits; the engine's draws in between (vLLM's sampling) go on from where
    its own stream was, as if no program had seeded; and a program stopped at a wait ends its own."""
    from interlace.workers import program_settings

    program_settings.keep_process_state_apart(calls.WATCHDOG)
    drawn = []

    def program(m):
        torch.manual_seed(0)
        drawn.append(torch.randn(3))
        m.call.wait_at(Point("model.layers.0", "resid"))
        drawn.append(torch.randn(3))
        torch.set_rng_state(torch.get_rng_state())  # setting a state is seeding too: still its own
        m.call.wait_at(Point("model.layers.1", "resid"))
        drawn.append(torch.randn(3))

    ours, engines = torch.Generator().manual_seed(0), torch.Generator().manual_seed(123)
    for stop in (False, True):
        drawn.clear()
        torch.manual_seed(123)  # the engine's own seed (here, outside a program: nothing set aside)
        assert program_settings._PROCESS.engine is None
        view = _StageView()
        call = view.call = ProgramCall(program, view, budget_s=5.0, limit_s=5.0)
        call.start()
        engine_draws = [torch.randn(2)]
        call.resume("first")
        engine_draws.append(torch.randn(2))
        call.cancel("stopped") if stop else call.resume("second")
        engine_draws.append(torch.randn(2))
        ours.manual_seed(0)
        assert all(torch.equal(got, torch.randn(3, generator=ours)) for got in drawn) and len(drawn) == 3 - stop
        engines.manual_seed(123)
        assert all(torch.equal(got, torch.randn(2, generator=engines)) for got in engine_draws)
        assert program_settings._PROCESS.engine is None and torch.initial_seed() == 123
    torch.manual_seed(0)
