"""An engine core running in the driver's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, how
people debug vLLM) still delivers reports: nothing else steps it after ``generate()``, and
workers learn which requests finished only in a step. A trace's results go with the user's last
reference to them, and closing the model lets go of the rank's data files. Run in a child process so the engine's
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

        import interlace
        from interlace import ops

        if __name__ == "__main__":
            model = interlace.Model("tiny-llama")
            out = model.generate("The capital of France is", ops=[ops.save("layers.1.resid", tokens="last")],
                                 max_tokens=3, ignore_eos=True)
            print("SHAPE", tuple(out.saves["layers.1.resid"].shape), type(model.engine.llm_engine.engine_core).__name__)
            root = str(model._sink_root)
            saved = weakref.ref(out.saves["layers.1.resid"])
            del out  # the result's rows map the data file too
            gc.collect()
            print("KEPT AFTER DEL", saved() is not None)
            mapped = lambda: [line.split()[-2] for line in open("/proc/self/maps") if root in line]
            print("MAPPED BEFORE", len(mapped()))
            model.close()
            print("MAPPED AFTER", mapped())
    """)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "SHAPE (3, 128) InprocClient" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
    # The model's first trace started the engine; its results go with the user's last reference
    # (a traceback vLLM keeps from its start held them for good)
    assert "KEPT AFTER DEL False" in done.stdout, done.stdout[-2000:]
    # The rank ran in this process: closing the model lets go of its data file (it used to stay
    # mapped, and pinned on a GPU, until the process ended)
    assert "MAPPED BEFORE 1" in done.stdout and "MAPPED AFTER []" in done.stdout, done.stdout[-2000:]
