"""An engine core running in the driver's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, how
people debug vLLM) still delivers reports: nothing else steps it after ``generate()``, and
workers learn which requests finished only in a step. Reports of a trace's invokes that finish a
step apart are written as one batch. A trace's results go with the user's last reference to them,
and closing the model lets go of the rank's data files. Programs run under a tracer (coverage.py,
a debugger) in the engine's thread. Run in a child process so the engine's
process-wide state stays out of the test session."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_saves_arrive_from_an_in_process_engine():
    script = textwrap.dedent("""
        import gc
        import weakref

        import torch

        import interlace
        from interlace import ops

        if __name__ == "__main__":
            # Two sequences at a time, chunked prefill: of "Hi" and a long prompt, "Hi" finishes a
            # step earlier, and a third prompt takes its place while the long one runs.
            model = interlace.Model("tiny-llama", enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=2)
            out = model.generate("The capital of France is", ops=[ops.save("layers.1.resid", tokens="last")],
                                 max_tokens=3, ignore_eos=True)
            print("SHAPE", tuple(out.saves["layers.1.resid"].shape), type(model.engine.llm_engine.engine_core).__name__)

            # a program ran here: closing the model lets go of its flight record too (below)
            def reads(m):
                m.save("h", m.layers[0].output)

            model.generate("Hi", program=reads, max_tokens=2, ignore_eos=True)

            # Reports of a trace's invokes that finish in different steps are held and written as
            # one batch; with no time to wait, one batch per step. The invoke admitted meanwhile
            # must not get a held invoke's rows: each prompt's saves equal those of a trace of its own.
            from interlace.workers import reports, sink
            batches = []
            write_batch = sink.DirSink.batch
            sink.DirSink.batch = lambda self, trace, stage: batches.append(trace) or write_batch(self, trace, stage)
            prompts, names = ("Hi", "A long prompt, " * 8, "Hello there"), ("layers.1.resid", "layers.0.mlp.output")
            saves = [ops.save("layers.1.resid", tokens="all"), ops.save("layers.0.mlp.output", tokens="last")]
            alone = [model.generate(prompt, ops=saves, max_tokens=2, ignore_eos=True) for prompt in prompts]
            batches.clear()
            results = {}
            for hold in (60.0, 0.0):
                reports.REPORT_HOLD_S = hold
                with model.trace(max_tokens=2, ignore_eos=True) as tr:
                    for prompt in prompts:
                        tr.invoke(prompt, ops=saves)
                results[hold] = tr.result
                print("BATCHES", hold, len(set(batches)), len(batches))
                batches.clear()
            same = all(r.saves[name].shape == a.saves[name].shape and torch.allclose(r.saves[name], a.saves[name], atol=1e-5)
                       for hold in results for r, a in zip(results[hold], alone) for name in names)
            print("SAME ROWS", same, [tuple(r.saves["layers.1.resid"].shape) for r in results[0.0]])
            del results, tr, alone
            root = str(model._sink_root)
            saved = weakref.ref(out.saves["layers.1.resid"])
            del out  # the result's rows map the data file too
            gc.collect()
            print("KEPT AFTER DEL", saved() is not None)
            mapped = lambda: [line.split()[-2] for line in open("/proc/self/maps") if root in line]
            print("MAPPED BEFORE", len(mapped()) > 0)
            model.close()
            print("MAPPED AFTER", mapped())
    """)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "SHAPE (3, 128) InprocClient" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
    # one trace each: held, its invokes' reports made one batch; not held, one per step an invoke finished in
    assert "BATCHES 60.0 1 1" in done.stdout and "BATCHES 0.0 1 3" in done.stdout, done.stdout[-2000:]
    assert "SAME ROWS True" in done.stdout, done.stdout[-2000:]
    # The model's first trace started the engine; its results go with the user's last reference
    # (a traceback vLLM keeps from its start held them for good)
    assert "KEPT AFTER DEL False" in done.stdout, done.stdout[-2000:]
    # The rank ran in this process: closing the model lets go of its data file (it used to stay
    # mapped, and pinned on a GPU, until the process ended) and of the flight record its programs
    # were run under (workers/flight.py)
    assert "MAPPED BEFORE True" in done.stdout and "MAPPED AFTER []" in done.stdout, done.stdout[-2000:]


def test_programs_run_under_a_tracer_in_the_engines_thread():
    """coverage.py, pdb and IDE debuggers trace every thread (sys.settrace), which counts each
    Python frame called from C twice against the recursion limit: the deep frames a program's
    worker greenlet starts below (workers/greenlets.py, deep_switch) ran out of room, and the first
    program of a traced engine failed with a RecursionError in interlace's code."""
    script = textwrap.dedent("""
        import sys
        import threading

        import torch

        import interlace

        def tracer(frame, event, arg):
            return None

        def reads(m):
            m.save("h", m.layers[0].resid)

        if __name__ == "__main__":
            sys.settrace(tracer)
            threading.settrace(tracer)
            model = interlace.Model("tiny-llama")
            traced = model.generate("Hello", program=reads, max_tokens=2, ignore_eos=True)
            sys.settrace(None)
            threading.settrace(None)
            plain = model.generate("Hello", program=reads, max_tokens=2, ignore_eos=True)
            print("SAME", tuple(traced.saves["h"].shape), torch.equal(traced.saves["h"], plain.saves["h"]))
            model.close()
    """)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "SAME (5, 128) True" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
    assert "internal error" not in done.stderr, done.stderr[-4000:]
