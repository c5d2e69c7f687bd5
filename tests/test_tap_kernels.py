"""The tap kernel (workers/tap_kernels.py) against the taps' torch path (workers/taps.py), on this
CPU through Triton's interpreter (``TRITON_INTERPRET=1``, in a process of its own: the variable
must be set before Triton loads). On a GPU the kernel runs compiled: the GPU tests of test_taps
and test_graphs check it against transformers there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import torch
    from interlace.workers import tap_kernels, taps as taps_module

    torch.manual_seed(0)
    HIDDEN, ROWS = 96, 7  # a hidden size that is no power of two: the kernel's last block is masked
    VECTORS = torch.randn(3, HIDDEN)

    def taps_of(dtype, kernel):
        taps = taps_module.Taps(["model.layers.1", "model.layers.2"], {("model.layers.1", "resid"),
                                ("model.layers.2", "resid")}, HIDDEN, max_tokens=16, max_vectors=4,
                                dtype=dtype, device=torch.device("cpu"), graph_rows=8)
        taps.kernel = tap_kernels if kernel else None
        taps.vectors[1:] = VECTORS.to(dtype)
        control = taps.control[:ROWS, 1]
        control[:, 0] = torch.tensor([1, 0, 1, 1, 0, 1, 1], dtype=torch.float32)   # edited
        control[:, 1] = torch.tensor([0.5, 1, 1, 2, 1, 1, -3], dtype=torch.float32)  # mul
        control[:, 2] = torch.tensor([1, 0, 2, 0, 0, 3, 1], dtype=torch.float32)   # vector row
        control[:, 3] = torch.tensor([0, 0, 1, 0, 0, 1, 0], dtype=torch.float32)   # sets (replace, zero)
        control[:, 4] = torch.tensor([1, 1, 0, 0, 1, 1, 0], dtype=torch.float32)   # saved after the edit
        return taps

    checked = 0
    for dtype in (torch.bfloat16, torch.float32):
        hidden, residual = torch.randn(ROWS, HIDDEN).to(dtype), torch.randn(ROWS, HIDDEN).to(dtype)
        for asked in (0, 1, 2):  # idle, saves, edits
            for output in (False, True):
                got = []
                for kernel in (True, False):
                    taps = taps_of(dtype, kernel)
                    taps._asked = [0, asked]
                    taps.asked[1] = asked
                    h, r = hidden.clone(), residual.clone()
                    if output:
                        taps.run_output(h, 1)
                    else:
                        taps.run(h, r, 1)
                    got.append((h, r, taps.saved[1, :ROWS].clone(), taps.ran.clone()))
                for a, b in zip(*got):
                    if dtype == torch.float32 or a.dtype == torch.int64:
                        assert torch.equal(a, b), (dtype, asked, output, (a - b).abs().max())
                    else:  # the interpreter truncates float32 to bfloat16 (a GPU rounds to nearest, as torch)
                        torch.testing.assert_close(a, b, rtol=2**-6, atol=2**-6)
                checked += 1
        # wider than the fixed save rows: saves into rows of their own (Taps.wide)
        wide_h, wide_r = torch.randn(12, HIDDEN).to(dtype), torch.randn(12, HIDDEN).to(dtype)
        taps = taps_of(dtype, True)
        taps._asked = [0, 1]
        taps.asked[1] = 1
        taps.run(wide_h, wide_r, 1)
        torch.testing.assert_close(taps.wide[1], wide_h + wide_r, rtol=2**-6, atol=2**-6)
        assert not taps.saved.any()
    print("checked", checked)
''')


def test_the_tap_kernel_does_what_the_torch_path_does_bit_for_bit():
    """Idle, saves only, and edits (add with a scale, replace, zero, saves before and after), at a
    residual stream and at a module output, in bfloat16 and float32: the kernel's values, saved
    rows and run counts equal the torch path's: exactly in float32; in bfloat16 within the last
    bit, as the interpreter truncates where a GPU rounds to nearest as torch does."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checked 12" in done.stdout
