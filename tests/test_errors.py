"""Bad input fails that trace alone, with a clear message; the engine keeps serving."""

from __future__ import annotations

import signal
import sys
import time

import numpy as np
import pytest
import torch

from conftest import no_new_socket_files, socket_files
import interlace
from interlace import ops
from interlace.core.trace import Invoke

PROMPT = "The capital of France is"


def _still_serves(model, oracles):
    ids = oracles["tiny-llama"].ids(PROMPT)
    out = model.generate(ids, ops=[ops.save("layers.0.resid")], max_tokens=3, ignore_eos=True)
    assert out.saves["layers.0.resid"].shape[0] == len(ids) + 2
    assert model.engine.collective_rpc("interlace_installed_hooks") == [[]]


def test_exception_in_program_carries_the_user_traceback(llama, oracles):
    def helper_that_fails(x):
        return x / undefined_name  # noqa: F821

    def program(m):
        helper_that_fails(m.layers[1].resid)

    with pytest.raises(interlace.InterventionError) as err:
        llama.generate(PROMPT, program=program)
    text = str(err.value)
    assert "NameError" in text and "helper_that_fails" in text and "undefined_name" in text
    assert err.value.record["where"].startswith("step 0")
    _still_serves(llama, oracles)


def test_failure_of_one_invoke_leaves_the_others_in_its_trace_intact(llama, oracles):
    ids = oracles["tiny-llama"].ids(PROMPT)

    def boom(m):
        if m.step == 1:
            raise ValueError("bad luck")

    with pytest.raises(interlace.InterventionError, match="bad luck") as err:
        with llama.trace(max_tokens=3, ignore_eos=True) as tr:
            tr.invoke(ids, ops=[ops.save("layers.1.resid")])
            tr.invoke(ids, program=boom)
    assert err.value.invoke == 1
    partial = err.value.partial
    assert partial[0].saves["layers.1.resid"].shape[0] == len(ids) + 2


def test_an_invoke_failing_mid_generation_leaves_the_others_exact(llama, oracles):
    # Decode steps reuse the previous step's schedule while the batch only advances; a failure
    # midway must end that reuse, so the failed invoke's program runs no more and the others' rows stay right.
    ids = oracles["tiny-llama"].ids(PROMPT)

    def keep(m):
        m.save("x", m.last(m.layers[1].resid))

    def boom(m):
        m.save("x", m.last(m.layers[1].resid))
        if m.step == 3:
            raise ValueError("bad luck at step 3")

    with pytest.raises(interlace.InterventionError, match="bad luck at step 3") as err:
        with llama.trace(max_tokens=8, ignore_eos=True) as tr:
            tr.invoke(ids, program=keep)
            tr.invoke(ids, program=boom)
            tr.invoke(ids, ops=[ops.save("layers.1.resid", tokens="last")])
    assert err.value.invoke == 1 and err.value.record["where"].startswith("step 3")
    alone = llama.generate(ids, program=keep, max_tokens=8, ignore_eos=True)
    atol = 1e-4 if not torch.cuda.is_available() else 1e-2
    partial = err.value.partial
    assert partial[0].saves["x"].shape[0] == 8  # steps 0..7
    assert partial[1].saves["x"].shape[0] == 4  # steps 0..3: its program ran no more after failing
    torch.testing.assert_close(partial[0].saves["x"], alone.saves["x"], atol=atol, rtol=atol)
    torch.testing.assert_close(partial[2].saves["layers.1.resid"], alone.saves["x"], atol=atol, rtol=atol)
    _still_serves(llama, oracles)


def test_infinite_loop_is_cut_off(llama, oracles):
    def spin(m):
        m.layers[0].resid
        while True:
            pass

    started = time.monotonic()
    with pytest.raises(interlace.InterventionError, match="time limit of 2s"):
        with llama.trace(timeout_s=2) as tr:
            tr.invoke(PROMPT, program=spin)
    assert time.monotonic() - started < 20
    _still_serves(llama, oracles)


def test_a_program_that_swallows_the_interruption_is_still_stopped(llama, oracles):
    def stubborn(m):
        m.layers[0].resid
        try:
            while True:
                pass
        except Exception:  # catches the interruption, then tries to go on
            pass
        m.layers[1].resid

    with pytest.raises(interlace.InterventionError, match="time limit of 1s"):
        with llama.trace(timeout_s=1) as tr:
            tr.invoke(PROMPT, program=stubborn)
    _still_serves(llama, oracles)


def test_the_time_limit_is_for_the_whole_trace_not_each_step(llama, oracles):
    def slow(m):  # 0.3 s at every step: within 1 s at any one step, past it by the fourth
        m.layers[0].resid
        time.sleep(0.3)

    with pytest.raises(interlace.InterventionError, match="time limit of 1s"):  # the trace's, not what was left
        with llama.trace(timeout_s=1, max_tokens=8) as tr:
            tr.invoke(PROMPT, program=slow)
    _still_serves(llama, oracles)


def test_write_of_wrong_shape_or_dtype_is_refused(llama, oracles):
    def wrong_shape(m):
        m.layers[1].resid = torch.zeros(3)

    def wrong_dtype(m):
        m.layers[1].resid = torch.zeros_like(m.layers[1].resid, dtype=torch.int64)

    with pytest.raises(interlace.InterventionError, match=r"shape \(3,\) does not match"):
        llama.generate(PROMPT, program=wrong_shape)
    with pytest.raises(interlace.InterventionError, match="dtype torch.int64 cannot replace"):
        llama.generate(PROMPT, program=wrong_dtype)
    _still_serves(llama, oracles)


def test_parameters_are_read_only(llama, oracles):
    # Every request shares the weights: an in-place edit of one would change every later request.
    ids = oracles["tiny-llama"].ids("Weights are shared by")
    before = llama.generate(ids, max_tokens=4, ignore_eos=True).token_ids
    edits = {
        "in place": lambda m: m.layers[0].input_layernorm.weight.mul_(0),
        "through a view": lambda m: m.layers[0].input_layernorm.weight[:8].zero_(),
        "detached": lambda m: m.embed_tokens.weight.detach()[5].fill_(1.0),
        "assigned rows": lambda m: m.embed_tokens.weight.__setitem__(slice(0, 4), 0.0),
    }
    for how, program in edits.items():
        with pytest.raises(interlace.InterventionError, match="parameters are read-only"):
            llama.generate(ids, program=program, max_tokens=2)
    copy = llama.generate(ids, program=lambda m: m.save("w", m.layers[0].input_layernorm.weight.clone().mul_(2)))
    assert torch.equal(copy.saves["w"], 2 * oracles["tiny-llama"].layers[0].input_layernorm.weight)
    assert llama.generate(ids, max_tokens=4, ignore_eos=True).token_ids == before
    _still_serves(llama, oracles)


def test_huge_saves_are_refused(llama, oracles):
    """Rows past ``max_save_bytes`` are refused where they are saved, and so are saved values that
    are not tensors and shared values, by their size in memory: a 16 MB numpy array, bytes or
    list saved (or shared) at every step went past a 1 MiB limit, only tensors being counted."""
    with pytest.raises(interlace.InterventionError, match="exceed the limit"):
        with llama.trace(max_tokens=4, max_save_bytes=4096) as tr:
            tr.invoke(PROMPT, program=lambda m: m.save("all", m.layers[0].resid.repeat(100, 1)))
    huge = {
        "numpy": lambda m: m.save("x", np.zeros(1 << 20, np.float32)),
        "bytes": lambda m: m.save("x", b"x" * (4 << 20)),
        "list": lambda m: m.save("x", [m.layers[0].resid.repeat(10, 1)] * 100),
        "shared list": lambda m: m.share("x", list(range(1 << 19))),
        "shared tensor": lambda m: m.share("x", torch.zeros(1, 1 << 20)),
    }
    for kind, program in huge.items():
        with pytest.raises(interlace.InterventionError, match=r"invoke 0 failed at step 0(, at layers.0.resid)?: MemoryError: saves .* exceed the limit of 1 MiB") as err:
            with llama.trace(max_tokens=2, max_save_bytes=1 << 20) as tr:
                tr.invoke(PROMPT, program=program)
                tr.invoke(PROMPT, program=lambda m: m.save("small", np.zeros(8)))
        assert len(err.value.partial[1].saves["small"]) == 2, kind
    _still_serves(llama, oracles)


def test_an_engine_core_that_cannot_start_says_why():
    """vLLM raises only "Engine core initialization failed. See root cause above." in the caller;
    the cause (here a KV cache too small for one block) was in the engine core's log only. The
    failed start leaves none of its processes' socket files (it left 7 in the temp folder)."""
    from interlace.cluster.config import ModelConfig

    before = socket_files()
    cfg = ModelConfig.load("tiny-llama").model_copy(update={"kv_cache_bytes": 1024})
    # vLLM words it by device: "No available memory for the cache blocks" on the CPU, "... KV cache is
    # needed, which is larger than the available KV cache memory" on a GPU (G45).
    with pytest.raises(ValueError, match="the engine could not start: .*(cache blocks|KV cache memory)"):
        interlace.Model(cfg).engine
    no_new_socket_files(before)


def _holds_itself(m):
    kept = [m.layers[1].resid.sum()]
    kept.append(kept)
    mine = {"step": 0}
    mine["me"] = mine
    m.save("list", kept)
    m.share("dict", mine)


def test_saved_and_shared_values_that_hold_themselves_arrive_as_they_were(llama):
    """Sizing a saved value walked it without noting what it had seen: a list that holds itself
    kept the program in that walk until the trace's time limit stopped it (60 s, with every other
    invoke of the engine waiting), named as a program that ran too long."""
    started = time.monotonic()
    with llama.trace(max_tokens=2) as tr:
        tr.invoke(PROMPT, program=_holds_itself)
    assert time.monotonic() - started < 30
    saved, shared = tr.result[0].saves["list"], tr.result.shared["dict"]
    assert len(saved) == 2 and all(step[1] is step for step in saved)
    assert shared[0]["me"] is shared[0]


def test_a_save_that_cannot_be_written_fails_its_invoke_only(llama, oracles):
    """Reports are written on a background thread; a save that cannot be serialised (a lock)
    fails its invoke with a message, the other invoke's saves arrive, the engine serves on."""
    import threading

    with pytest.raises(interlace.InterventionError, match="invoke 0 failed at reporting results.*pickle") as err:
        with llama.trace(max_tokens=2) as tr:
            tr.invoke(PROMPT, program=lambda m: m.save("lock", threading.Lock()))
            tr.invoke(PROMPT, program=lambda m: m.save("resid", m.layers[0].resid))
    assert err.value.partial[1].saves["resid"].shape[0] == len(oracles["tiny-llama"].ids(PROMPT)) + 1
    _still_serves(llama, oracles)


def test_a_save_or_share_name_that_is_not_a_string_fails_its_invoke_only(llama, oracles):
    """Results, the endpoint's answers and a sweep's files are keyed by these names: an int name
    passed a local trace, then failed the endpoint's answer (its schema wants strings) or, in a
    sweep, every prompt of the shard (``name.startswith``). Now the program's own line fails, in
    its invoke alone; a string of another type (numpy's) comes back as a plain one."""

    with pytest.raises(interlace.InterventionError, match=r"save\(\) name must be a non-empty string, got 3 \(int\)") as err:
        with llama.trace(max_tokens=2) as tr:
            tr.invoke(PROMPT, program=lambda m: m.save(3, m.layers[0].resid))
            tr.invoke(PROMPT, program=lambda m: m.save("resid", m.layers[0].resid))
    assert err.value.partial[1].saves["resid"].shape[0] == len(oracles["tiny-llama"].ids(PROMPT)) + 1
    for bad in ("", ("a", 1)):
        with pytest.raises(interlace.InterventionError, match=r"share\(\) name must be a non-empty string"):
            llama.generate(PROMPT, program=lambda m, bad=bad: m.share(bad, 1.0))
    for bad in (3, ""):  # "" was taken for None: saved under the point's name
        with pytest.raises(TypeError, match="save name must be a non-empty string, or None for the point.s own, got"):
            ops.save("layers.1.resid", name=bad)
    [name] = llama.generate(PROMPT, program=lambda m: m.save(np.str_("h"), m.layers[0].resid)).saves
    assert name == "h" and type(name) is str
    _still_serves(llama, oracles)


def test_a_sparse_nested_quantized_or_meta_tensor_save_fails_at_its_line(llama, oracles):
    """Such tensors passed ``m.save`` and broke the report's row gathering later, for the whole
    batch: a sparse one ended the trace's reports on the rank (every invoke lost, the driver
    waited 30 s and started a new engine), a meta one made every invoke of its trace come back
    with no saves and no error. Now the program's line fails, in its invoke alone."""
    bad = {
        "sparse": (lambda h: h.to_sparse(), r"save\('x'\) takes dense tensors, got a sparse_coo tensor; save value.to_dense\(\)"),
        "nested": (lambda h: torch.nested.nested_tensor([h[:1], h[:2]]), r"got a nested tensor; save value.to_padded_tensor\(0\)"),
        "quantized": (lambda h: torch.quantize_per_tensor(h.float(), 0.1, 0, torch.qint8), r"takes unquantized tensors, got torch.qint8"),
        "meta": (lambda h: torch.empty(2, device="meta"), r"a tensor on the meta device has no values to save"),
    }
    for kind, (make, message) in bad.items():
        with pytest.raises(interlace.InterventionError, match=message) as err:
            with llama.trace(max_tokens=2) as tr:
                tr.invoke(PROMPT, program=lambda m, make=make: m.save("x", make(m.layers[0].resid)))
                tr.invoke(PROMPT, program=lambda m: m.save("resid", m.layers[0].resid))
        assert err.value.partial[1].saves["resid"].shape[0] == len(oracles["tiny-llama"].ids(PROMPT)) + 1, kind
    with pytest.raises(interlace.InterventionError, match=r"share\('s'\) takes dense tensors"):
        llama.generate(PROMPT, program=lambda m: m.share("s", m.layers[0].resid.to_sparse()), max_tokens=2)
    _still_serves(llama, oracles)


def test_a_program_save_under_an_op_saves_name_fails_at_its_line(llama, oracles):
    """An invoke's op saving layers.1.resid and its program saving layer 2 under the same name
    came back as one tensor of both's rows (18 rows for a 9-token trace), indistinguishable; two
    ops are refused that on the driver. Now the program's line fails, in its invoke alone."""
    program = lambda m: m.save("h", m.layers[2].resid)  # noqa: E731
    with pytest.raises(interlace.InterventionError, match=r"save\('h'\): an op of this invoke saves layers.1.resid under that name") as err:
        with llama.trace(max_tokens=2) as tr:
            tr.invoke(PROMPT, program=program, ops=[ops.save("layers.1.resid", name="h")])
            tr.invoke(PROMPT, program=program, ops=[ops.save("layers.1.resid", name="h1")])
    rows = len(oracles["tiny-llama"].ids(PROMPT)) + 1
    assert err.value.partial[1].saves["h"].shape[0] == rows and err.value.partial[1].saves["h1"].shape[0] == rows
    _still_serves(llama, oracles)


def test_batched_refuses_what_it_cannot_mark():
    """``interlace.batched(3)`` or of a bound method raised AttributeError ("'method' object has
    no attribute '__interlace_batched__'"), naming interlace's attribute, not the fix."""

    class Steerer:
        def steer(self, m):
            m.layers[1].resid += 1

    with pytest.raises(TypeError, match="interlace.batched marks a program, a function of m; got 3"):
        interlace.batched(3)
    # (len, not print: Ray Data's progress bars replace builtins.print with a Python function)
    for unmarkable in (Steerer().steer, len):
        with pytest.raises(TypeError, match=r"cannot mark .* mark a function that calls it: interlace.batched\(lambda m"):
            interlace.batched(unmarkable)


def test_saving_the_model_view_or_a_module_fails_at_its_line(llama, oracles):
    """``m.save("m", m)`` failed the invoke only at its report, with pickle's "Can't pickle local
    object 'install.<locals>.begin_step'"; now at the program's line, saying what to save."""
    for program in (lambda m: m.save("m", m), lambda m: m.share("layer", m.layers[1])):
        with pytest.raises(interlace.InterventionError, match=r"takes a value .* not <module|takes a value .* not <interlace") as err:
            llama.generate(PROMPT, program=program, max_tokens=2)
        assert "pickle" not in str(err.value)
    _still_serves(llama, oracles)


def test_program_steps_that_never_run_are_refused_before_the_trace_is_sent(llama):
    """A program's ``steps=[-1]`` (or past max_tokens, or ``[]``) ran the trace with the program never
    called; ``steps`` given with no program were ignored."""
    for steps in ([-1], [0, 3]):
        with pytest.raises(ValueError, match=r"program steps \[(-1|3)\] never run in a trace with max_tokens=3"):
            llama.generate(PROMPT, program=lambda m: None, steps=steps, max_tokens=3)
    assert llama.generate(PROMPT, program=lambda m: m.save("s", m.step), steps=[2], max_tokens=3).saves["s"] == 2
    with pytest.raises(ValueError, match=r"program steps=\[\]: the program would never run"):  # it ran with no call
        llama.generate(PROMPT, program=lambda m: None, steps=[], max_tokens=3)
    with pytest.raises(ValueError, match=r"steps=\[0\] selects the steps a program runs at, and this invoke has no "
                                         r"program; an op takes steps of its own"):  # the ops ran at every step
        llama.generate(PROMPT, ops=[ops.save("layers.1.resid")], steps=[0], max_tokens=3)
    with pytest.raises(ValueError, match=r"op save at layers.1.resid: steps=\[\] never runs"):  # failed after the run
        llama.generate(PROMPT, ops=[ops.save("layers.1.resid", steps=[])], max_tokens=3)
    for steps in ([1.5], ["1"]):  # int() made 1.5 an op's step 1, and a program's 1.5 never ran
        with pytest.raises(TypeError, match="steps must be integers"):
            llama.generate(PROMPT, program=lambda m: None, steps=steps, max_tokens=3)
        with pytest.raises(TypeError, match="steps must be integers"):
            ops.save("layers.1.resid", steps=steps)


def test_a_share_with_an_unknown_merge_fails_at_its_line_before_the_trace_runs_on(llama, oracles):
    """The merge is checked at ``m.share``, in the step that made it: before, it failed only once
    every invoke had reported, after the whole generation. A known merge with a dim still merges."""
    with pytest.raises(interlace.InterventionError, match=r"failed at step 0.*unknown merge 'bogus'; choose one of"):
        llama.generate(PROMPT, max_tokens=4, program=lambda m: m.share("x", m.layers[0].resid, merge="bogus"))
    with pytest.raises(interlace.InterventionError, match=r"unknown merge 'sum:1'"):
        llama.generate(PROMPT, program=lambda m: m.share("x", 1.0, merge="sum:1"))
    with llama.trace(max_tokens=1) as tr:
        for _ in range(2):
            tr.invoke(PROMPT, program=lambda m: m.share("last", m.last(m.layers[0].resid), merge="concat:1"))
    assert tr.result.shared["last"].shape == (1, 2 * oracles["tiny-llama"].model.config.hidden_size)
    _still_serves(llama, oracles)


def test_an_op_value_of_the_wrong_shape_fails_its_invoke_naming_the_sizes_that_fit(llama, oracles):
    """torch's own message named neither the op nor what would fit."""
    hidden = oracles["tiny-llama"].model.config.hidden_size
    for op in (ops.add("layers.1.resid", torch.ones(7)), ops.replace("layers.1.resid", torch.ones(2, 3))):
        with pytest.raises(interlace.InterventionError, match=rf"op {op['op']} at layers.1.resid: ValueError: {op['op']}: a "
                                                              rf"value of shape \(.*\) does not broadcast .* give {hidden} values"):
            llama.generate(PROMPT, max_tokens=2, ops=[op])
    _still_serves(llama, oracles)


def test_op_values_positions_and_save_names_that_would_silently_mislead_are_refused(llama, oracles):
    """Each of these ran: tokens=[1.5] saved position 1, a complex vector lost its imaginary part,
    and two points saved under one name came back as one tensor of both points' rows."""
    with pytest.raises(TypeError, match="tokens must be 'all', 'last' or a list of integer positions"):
        ops.save("layers.1.resid", tokens=[1.5])
    with pytest.raises(TypeError, match="add: the value must be real, got torch.complex64"):
        ops.add("layers.1.resid", torch.ones(128, dtype=torch.complex64))
    with pytest.raises(TypeError, match="replace: the value must be a tensor or numbers, got str"):
        ops.replace("layers.1.resid", "abc")
    # a meta vector failed in the op's digest with torch's error; a sparse one failed on the engine
    with pytest.raises(ValueError, match="add: a tensor on the meta device has no values to add"):
        ops.add("layers.1.resid", torch.ones(128, device="meta"))
    with pytest.raises(TypeError, match=r"replace: the value must be a dense tensor, got a sparse_coo one; pass value.to_dense\(\)"):
        ops.replace("layers.1.resid", torch.ones(128).to_sparse())
    with pytest.raises(ValueError, match="two saves name 'x': layers.1.resid and layers.2.resid"):
        llama.generate(PROMPT, ops=[ops.save("layers.1.resid", name="x"), ops.save("layers.2.resid", name="x")])
    prompt_then_last = [ops.save("layers.1.resid", name="x", steps=[0]),
                        ops.save("layers.1.resid", name="x", tokens="last", steps=[1, 2])]
    n = len(oracles["tiny-llama"].ids(PROMPT))
    assert llama.generate(PROMPT, ops=prompt_then_last, max_tokens=3).saves["x"].shape[0] == n + 2

    assert ops.save("layers.1.resid", tokens=np.array([2, 1]), steps=np.arange(2))["tokens"] == [1, 2]
    _still_serves(llama, oracles)


def test_wrong_module_names(llama, oracles):
    with pytest.raises(interlace.InterventionError, match=r"no module 'mlpp' under 'layers.1'.*'mlp'"):
        llama.generate(PROMPT, program=lambda m: m.layers[1].mlpp.output)
    # declarative ops are checked on the driver, before anything reaches the engine
    with pytest.raises(AttributeError, match="no module 'mlpp'"):
        llama.generate(PROMPT, ops=[ops.save("layers.1.mlpp.output")])
    with pytest.raises(ValueError, match="must end in one of"):
        llama.generate(PROMPT, ops=[ops.save("layers.1.mlp")])
    with pytest.raises(interlace.InterventionError, match=r"IndexError: module list 'model.layers' has 4 modules; index 4"):
        llama.generate(PROMPT, program=lambda m: m.layers[4].resid)
    with pytest.raises(interlace.InterventionError, match=r"module 'model.layers.1' is not a module list; its children are"):
        llama.generate(PROMPT, program=lambda m: [layer for layer in m.layers[1]])
    _still_serves(llama, oracles)


def test_nnsights_save_gradients_and_breakpoints_fail_saying_what_to_do_instead(llama):
    with pytest.raises(interlace.InterventionError, match=r"no attribute 'save'; .* m.save\(name, value\)"):
        llama.generate(PROMPT, program=lambda m: m.layers[1].resid.save())
    with pytest.raises(interlace.InterventionError, match=r"does not require grad.*; the model runs without gradients"
                                                          r".*inside `with torch.inference_mode\(False\), torch.enable_grad"):
        llama.generate(PROMPT, program=lambda m: m.logits.sum().backward())
    probe = torch.randn(128)

    def probe_gradient(m):  # docs/guide.md's way to gradients of a program's own code, after a read and across one
        h = m.layers[1].resid
        with torch.inference_mode(False), torch.enable_grad():
            x = h.clone().requires_grad_()
            later = m.layers[2].resid
            (grad,) = torch.autograd.grad((x @ probe.clone()).sum() + later.sum(), x)
        m.save("grad", grad)
    grads = llama.generate(PROMPT, program=probe_gradient, max_tokens=2).saves["grad"]
    torch.testing.assert_close(grads, probe.expand_as(grads))

    def debugged(m):
        h = m.layers[1].resid
        breakpoint()
        m.save("h", h)

    def profiled(m):
        sys.setprofile(lambda *_: None)
        m.save("h", m.layers[1].resid)

    def c_profiled(m):  # cProfile installs its profiler from C
        import cProfile

        with cProfile.Profile():
            m.save("h", m.layers[1].resid)

    for program in (debugged, profiled, c_profiled):  # (one left installed slowed every later step, or hung the engine)
        with pytest.raises(interlace.InterventionError, match=r"sys.setprofile and sys.settrace \(profilers, cProfile, "
                                                              r"tracers, pdb and breakpoint\(\)\) cannot run.*print the figures"):
            llama.generate(PROMPT, program=program)
    assert llama.generate(PROMPT, program=lambda m: m.save("h", m.layers[1].resid)).saves["h"].shape[0] > 0


def test_malformed_requests_are_refused_on_the_driver(llama):
    want_plain = llama.generate(PROMPT, max_tokens=2).token_ids
    for bad in (123, [[5, 6, 7]], [5.0, 6.0], [True, False], torch.tensor([[5, 6, 7]]), np.array([5.5])):
        with pytest.raises(TypeError, match="prompt must be text or token ids"):
            llama.generate(bad)
    # Token ids as numpy's integers, a 1-D array or tensor (a tokenizer's row) are ids like a list's:
    # a list of numpy ints was refused as "got list", an array as "got ndarray"
    want = llama.generate([5, 6, 7], max_tokens=2).token_ids
    for ids in ((5, 6, 7), [np.int64(5), np.int64(6), np.int64(7)], np.array([5, 6, 7]), torch.tensor([5, 6, 7])):
        assert llama.generate(ids, max_tokens=2).token_ids == want
    with pytest.raises(TypeError, match="program must be a function"):
        llama.generate(PROMPT, program="not a function")

    # programs that would run without doing their work, or fail at their first step on the engine
    def generator(m):
        m.layers[1].resid += 1.0
        yield

    async def coroutine(m):
        m.layers[1].resid += 1.0

    def two_arguments(m, vector):
        m.layers[1].resid += vector

    for program, why in [(generator, "is a generator function"), (coroutine, "is an async function"),
                         (two_arguments, r"two_arguments\(m, vector\) cannot be called with one argument"),
                         (lambda: None, r"<lambda>\(\) cannot be called")]:
        with pytest.raises(TypeError, match=why):
            with llama.trace() as tr:
                tr.invoke(PROMPT, program=program)
    assert llama.generate(PROMPT, program=lambda m, scale=2.0: None).token_ids  # a default is fine
    # sent anyway (a request not built by tr.invoke): it fails on the engine, alone
    with pytest.raises(interlace.InterventionError, match="returned a generator without running its code") as err:
        with llama.trace(max_tokens=2) as tr:
            tr.invoke(PROMPT)
            tr.invokes.append(Invoke(PROMPT, program=generator))
    assert err.value.invoke == 1 and err.value.partial[0].token_ids
    with pytest.raises(ValueError, match="tokens must be"):
        ops.save("layers.1.resid", tokens="first")
    with pytest.raises(ValueError, match="no invokes"):
        llama.trace().run()
    with pytest.raises(ValueError, match="n=2: each invoke generates one sequence"):  # vLLM's parallel sampling
        llama.generate(PROMPT, n=2, temperature=1.0)
    with pytest.raises(TypeError, match="made with interlace.ops"):  # a hand-made op dict
        llama.generate(PROMPT, ops=[{"op": "zero", "point": "layers.1.resid"}])
    # One op not in a list was refused as "not made with interlace.ops, got 'op'" (a dict's keys),
    # and ops=None, as program=None takes, with "'NoneType' object is not iterable"
    with pytest.raises(TypeError, match=r"ops takes a list of ops, got one op \(save at layers.1.resid\): pass ops=\[...\]"):
        llama.generate(PROMPT, ops=ops.save("layers.1.resid"))
    assert llama.generate(PROMPT, ops=None, max_tokens=2).token_ids == want_plain


def test_sampling_settings_the_engine_core_cannot_decode_are_refused_and_the_engine_serves_on(llama):
    """vLLM builds SamplingParams without checking most fields' types; seed="abc" and the like
    then failed to decode in the engine core's input thread, which died: that trace, and every
    later one on the engine, waited forever. Each is refused before anything is sent, naming the
    field. (Each call runs in a thread with a limit, so that a hang fails here.)"""
    import threading

    def within(seconds, fn):
        outcome = []
        thread = threading.Thread(target=lambda: outcome.append(_outcome(fn)), daemon=True)
        thread.start()
        thread.join(seconds)
        assert outcome, f"no answer in {seconds} s: the engine hangs"
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def keep(m):
        m.save("r", m.layers[1].resid)

    for settings, why in (({"seed": "abc"}, r"sampling setting seed: Expected `int \| null`, got `str`"),
                          ({"seed": 1.5}, "sampling setting seed"),
                          ({"ignore_eos": "yes"}, "sampling setting ignore_eos"),
                          ({"logit_bias": {"a": 1.0}}, "sampling setting logit_bias"),
                          ({"extra_args": {"mine": object()}}, "cannot be sent to the engine")):
        for program in (keep, None):
            with pytest.raises(TypeError, match=why):
                within(60, lambda: llama.generate(PROMPT, program=program, max_tokens=2, **settings))
    assert within(60, lambda: llama.generate(PROMPT, program=keep, max_tokens=2, seed=3)).saves["r"].shape[0] > 0


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - raised again on the test's thread
        return exc


def test_a_trace_has_no_result_before_it_runs_and_takes_no_invoke_after(llama):
    """Reading ``tr.result`` inside the with block gave None (a TypeError later, far from the
    cause), and an invoke added after the block silently never ran."""
    with llama.trace(max_tokens=2) as tr:
        tr.invoke(PROMPT)
        with pytest.raises(RuntimeError, match="no result yet: it runs when its with block ends"):
            tr.result
    with pytest.raises(RuntimeError, match="has run already .* an invoke added now would not run"):
        tr.invoke("Another prompt")
    assert len(tr.result) == 1 and tr.result[0].token_ids
    assert tr.run()[0].token_ids == tr.result[0].token_ids  # run again: the same invokes
    with pytest.raises(interlace.InterventionError):  # a failed run leaves no result to read
        with llama.trace(max_tokens=2) as failed:
            failed.invoke(PROMPT, program=lambda m: 1 / 0)
    with pytest.raises(RuntimeError, match="if the run raised, that error says why"):
        failed.result
    assert llama.generate(PROMPT, max_tokens=2).token_ids


def test_a_trace_interrupted_by_ctrl_c_leaves_nothing_for_the_next(llama, oracles):
    """Ctrl-C in a trace left its requests running in vLLM's LLM, whose next generate() returned
    their outputs with its own: after an interrupted 300-token trace, a 2-token one got 300 tokens."""
    check_ctrl_c_leaves_nothing(llama)
    _still_serves(llama, oracles)


def check_ctrl_c_leaves_nothing(model) -> None:
    """Interrupt a long trace as Ctrl-C does; the next trace gets its own tokens from the same
    engine (its requests were aborted, not the engine dropped). Also run on GPUs (vLLM 0.26's
    abort: tests/test_gpu_numerics.py)."""
    import _thread
    import threading

    want = model.generate(PROMPT, max_tokens=2).token_ids
    engine = model.engine

    def slow(m):
        time.sleep(0.02)  # 300 steps: 6 s, interrupted after 1

    # Ctrl-C in a plain script: Python's own SIGINT handler (earlier tests' Ray and Serve set others)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, _thread.interrupt_main)  # as Ctrl-C does: KeyboardInterrupt in the main thread
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            model.generate(PROMPT, program=slow, max_tokens=300, ignore_eos=True)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, handler)
    assert model.generate(PROMPT, max_tokens=2).token_ids == want
    assert model.engine is engine, "the interrupted trace's requests were not aborted: the engine was dropped"


def test_unpicklable_program_dependency_fails_cleanly(llama, oracles):
    import types

    module = types.ModuleType("not_on_the_worker")  # a module the worker cannot import
    exec("def f(m):\n    m.save('x', m.layers[0].resid)\n", module.__dict__)
    import sys

    sys.modules["not_on_the_worker"] = module
    try:
        # it named the module only: a helper module a script put on its own sys.path fails so in a replica's actor
        with pytest.raises(interlace.InterventionError,
                           match=r"loading the invoke's program.*No module named 'not_on_the_worker'.*register_pickle_by_value"):
            llama.generate(PROMPT, program=module.f)
    finally:
        del sys.modules["not_on_the_worker"]
    import threading

    class Probe:  # a program that is a method of an object holding a lock
        def __init__(self):
            self.lock = threading.Lock()

        def run(self, m):
            m.save("x", m.layers[0].resid)

    # pickle's own "cannot pickle '_thread.lock' object" named neither the invoke nor the program
    with pytest.raises(TypeError, match=r"invoke 1's program .*Probe.run cannot be sent to the workers: .*_thread.lock"):
        with llama.trace(max_tokens=2) as tr:
            tr.invoke(PROMPT)
            tr.invoke(PROMPT, program=Probe().run)
    # A save that cannot travel back fails its invoke naming the save (pickle named only the type)
    with pytest.raises(interlace.InterventionError, match=r"invoke 1 failed at reporting results of save 'held' "
                                                          r"\(lock\).*cannot pickle '_thread.lock' object") as err:
        with llama.trace(max_tokens=2) as tr:
            tr.invoke(PROMPT, program=lambda m: m.save("x", m.layers[0].resid))
            tr.invoke(PROMPT, program=lambda m: (m.save("x", m.layers[0].resid), m.save("held", threading.Lock())))
    assert err.value.partial[0].saves["x"].shape[0] > 0  # its neighbour's saves came back
    _still_serves(llama, oracles)


def test_report_grace_waits_while_a_report_is_being_written(llama, monkeypatch):
    """The driver gives workers a grace period for reports after generation; a report still
    being written (reports are written in order, off the engine thread) extends it, and nothing
    at all past it fails with a message instead of waiting forever."""
    import threading

    import interlace.model
    from interlace.workers.sink import DirSink

    monkeypatch.setattr(interlace.model, "_REPORT_GRACE_S", 0.5)
    root = llama._sink_root
    (root / "slow-trace").mkdir()
    partial = root / "slow-trace" / ".partial-123"
    partial.write_bytes(b"")

    def finish_later():
        time.sleep(1.5)
        DirSink(str(root)).write("slow-trace", 0, [{"trace": "slow-trace", "invoke": 0, "stage": 0,
                                                     "saves": {}, "shared": [], "error": None}])
        partial.unlink()

    threading.Thread(target=finish_later).start()
    assert llama._collect("slow-trace", [0])[0][0]["invoke"] == 0
    with pytest.raises(interlace.WorkerDied, match="no report from .* within 0s after they were due: the engine's "
                                                   "workers died .* the next trace starts a new engine"):
        llama._collect("silent-trace", [0])
    assert llama._engine is None  # replaced: an engine whose reports stop would fail every later trace


def _fails_and_a_new_engine_serves(llama, oracles, program, match: str) -> None:
    """``program`` leaves the engine unable to serve: its trace fails with WorkerDied, and the
    model's next trace runs on a new engine, exact."""
    old = llama.engine
    with pytest.raises(interlace.WorkerDied, match=match):
        llama.generate(PROMPT, program=program, max_tokens=2)
    _still_serves(llama, oracles)
    assert llama.engine is not old


def test_a_program_that_leaves_the_engine_unable_to_report_fails_and_the_next_trace_gets_a_new_engine(
        llama, oracles, monkeypatch):
    """Workers that still generate but can no longer write reports (here a program breaks the
    report writer of its own worker, as an exhausted open-file limit did) fail the trace with
    WorkerDied once the grace is over; the model replaces the engine, so the next trace is served.
    Before, every later trace failed the same way after 30 s."""
    import interlace.model

    monkeypatch.setattr(interlace.model, "_REPORT_GRACE_S", 2.0)

    def breaks_reporting(m):
        from interlace.workers import reports

        def no_files(*_args, **_kwargs):
            raise OSError(24, "Too many open files")

        reports.open_sink = no_files
        m.save("h", m.layers[0].resid)

    _fails_and_a_new_engine_serves(llama, oracles, breaks_reporting, "no report from .* the next trace starts a new engine")


def test_a_program_may_not_change_the_engines_resource_limits(llama, oracles):
    """The process's limits are every user's: a program that lowered the open-file limit left the
    engine unable to write any later report."""

    def lowers_limits(m):
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))
        m.save("h", m.layers[0].resid)

    def reads_them(m):
        import resource

        m.save("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])

    with pytest.raises(interlace.InterventionError, match="resource.setrlimit and resource.prlimit cannot run "
                                                          "inside the engine"):
        llama.generate(PROMPT, program=lowers_limits, max_tokens=2)
    assert llama.generate(PROMPT, program=reads_them).saves["soft"] > 16
    _still_serves(llama, oracles)


def test_a_program_may_not_set_the_engines_signals(llama, oracles):
    """Signal handlers, masks and timers are the process's: a program's ``signal.alarm(2)`` ended
    the engine two seconds after the program returned, failing the traces then in flight."""

    def alarms(m):
        import signal

        signal.alarm(2)
        m.save("h", m.layers[0].resid)

    def ignores_sigterm(m):
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def reads_a_handler(m):
        import signal

        m.save("handler", str(signal.getsignal(signal.SIGTERM)))

    for program in (alarms, ignores_sigterm):
        with pytest.raises(interlace.InterventionError, match=r"signal handlers, masks and timers .* cannot run "
                                                              r"inside the engine"):
            llama.generate(PROMPT, program=program, max_tokens=2)
    assert llama.generate(PROMPT, program=reads_a_handler).saves["handler"]
    time.sleep(2.5)  # past the alarm the first program asked for
    _still_serves(llama, oracles)


def test_a_program_may_not_fork_the_engine_or_change_its_priority_or_cores(llama, oracles):
    """The engine's process is every user's: a program's os.fork() left copies of the engine's
    worker running after the engine closed, and a lower priority or fewer cores slow everyone."""

    def forks(m):
        import os

        os.fork()

    def pins_one_core(m):
        import os

        os.sched_setaffinity(0, {0})

    def reads_its_cores(m):
        import os

        m.save("cores", len(os.sched_getaffinity(0)))

    cores = llama.generate(PROMPT, program=reads_its_cores).saves["cores"]
    for program, name in ((forks, "os.fork"), (pins_one_core, "os.sched_setaffinity")):
        with pytest.raises(interlace.InterventionError, match=rf"{name} cannot run inside the engine"):
            llama.generate(PROMPT, program=program, max_tokens=2)
    assert llama.generate(PROMPT, program=reads_its_cores).saves["cores"] == cores
    _still_serves(llama, oracles)


def test_a_thread_a_program_leaves_running_is_stopped_and_fails_it(llama, oracles):
    """A thread runs on in the engine's process after the program that started it: one left
    spinning slowed every later trace 10x (2-core CPU). Threads a program joins are its own
    business; one still running as the program ends is stopped, and the program fails saying so.
    A library's own threads (a thread pool's worker, tqdm's monitor) are the library's: stopping
    them failed the program (``torch.compile`` in a program, through tqdm's monitor) and left a
    pool that never ran a task again."""

    def pools(m):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:  # joined as the block ends
            m.save("sum", sum(pool.map(abs, [-1, 2])))

    def spins_on(m):
        import threading

        def spin():
            while True:
                pass

        threading.Thread(target=spin, name="left-spinning", daemon=True).start()
        m.save("h", m.layers[0].resid)

    def threads(m):
        import threading

        m.save("names", [t.name for t in threading.enumerate()])

    def leaves_a_pool(m):
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(1, thread_name_prefix="left-idle")  # its worker is the library's
        m.save("one", pool.submit(abs, -1).result())

    assert llama.generate(PROMPT, program=pools).saves["sum"] == 3
    assert llama.generate(PROMPT, program=leaves_a_pool).saves["one"] == 1
    with pytest.raises(interlace.InterventionError, match=r"left 1 thread\(s\) it started running \(left-spinning\) "
                                                          r"as it ended: interlace stopped them"):
        llama.generate(PROMPT, program=spins_on, max_tokens=2)
    time.sleep(0.5)
    assert "left-spinning" not in llama.generate(PROMPT, program=threads).saves["names"]
    _still_serves(llama, oracles)


def test_a_dead_worker_fails_its_trace_and_the_engine_starts_afresh(llama, oracles):
    """A worker that dies (here a program kills its own process, as a crashing C extension or the
    kernel's out-of-memory killer would) fails the trace it was running with a clear error, and
    the model starts a new engine for the next trace (the session's: later tests run on it)."""
    import os
    import signal

    def crash(m):
        m.layers[0].resid
        os.kill(os.getpid(), signal.SIGKILL)

    _fails_and_a_new_engine_serves(llama, oracles, crash, "died")


def test_m_used_from_another_thread_raises_there_and_the_program_goes_on(llama, oracles):
    """``m`` reads switch the program back to the engine, which only its own run can do: a read
    from a thread the program started raises a clear error in that thread, and changes nothing
    of the program's state (its own reads, time limit and results stay right)."""
    import threading

    def program(m):
        caught = []

        def read():
            try:
                m.layers[2].resid
            except RuntimeError as exc:
                caught.append(str(exc))

        thread = threading.Thread(target=read)
        thread.start()
        thread.join()
        assert caught and "read from outside the program's own run" in caught[0], caught
        m.save("r2", m.layers[2].resid)

    ids = oracles["tiny-llama"].ids(PROMPT)
    got = llama.generate(ids, program=program, max_tokens=3, ignore_eos=True)
    want = llama.generate(ids, program=lambda m: m.save("r2", m.layers[2].resid), max_tokens=3, ignore_eos=True)
    assert got.token_ids == want.token_ids and torch.equal(got.saves["r2"], want.saves["r2"])
    _still_serves(llama, oracles)


def test_an_m_kept_past_its_step_says_so_when_used(llama, oracles):
    """A program that keeps ``m`` and reads through it at a later step got "no module 'resid'
    under 'layers.1'" (the missing call's AttributeError, raised in the ``resid`` property, was
    taken for a missing attribute); now it is told that this m's step is over."""
    kept = []

    def program(m):
        kept.append(m)
        if m.step == 2:
            kept[0].layers[1].resid

    with pytest.raises(interlace.InterventionError, match=r"failed at step 2: RuntimeError: this m is from a step that is over"):
        llama.generate(PROMPT, program=program, max_tokens=3, ignore_eos=True)
    _still_serves(llama, oracles)


def test_a_program_that_prints_without_end_keeps_64_kib_and_says_how_much_more(llama):
    """workers/printed.py: an invoke keeps printed.LIMIT characters of its program's output; the
    rest is counted in a last line, and the invoke succeeds."""
    from interlace.workers.printed import LIMIT

    def loud(m):
        m.save("h", m.layers[1].resid)
        for _ in range(20_000):
            print("x" * 9)  # 10 characters a line, 200,000 a step

    out = llama.generate(PROMPT, program=loud, max_tokens=2)
    kept, _, note = out.printed.rpartition("\n[interlace: ")
    assert len(kept) == LIMIT and set(kept) <= {"x", "\n"}
    assert note.startswith(f"{2 * 200_000 - LIMIT} more characters printed")
    assert out.saves["h"].shape[0] > 0
