"""The per-step batch layout: which rows of vLLM's flat token batch belong to which request.

vLLM runs every scheduled request's tokens as one flat ``[num_tokens, hidden]`` batch. A
:class:`BatchLayout` is the small piece of data that says how to cut it, built once per step by a
thin adapter for each model runner (V1 on CPU builds, V2 on GPU builds). Everything above it is
runner-agnostic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BatchLayout:
    req_ids: list[str]  # [num_reqs] vLLM's internal request ids, in row order
    row_starts: np.ndarray  # [num_reqs + 1] request i owns rows row_starts[i]:row_starts[i+1]
    first_positions: np.ndarray  # [num_reqs] position of each request's first row in its sequence
    num_tokens: int  # real token rows; rows past this are padding (CUDA graphs)


def layout_from_v1_runner(runner) -> BatchLayout:
    """Read the layout from the V1 runner's persistent batch (valid once inputs are prepared)."""
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    starts = np.asarray(runner.query_start_loc.np[: num_reqs + 1], dtype=np.int64).copy()
    return BatchLayout(
        req_ids=list(batch.req_ids[:num_reqs]),
        row_starts=starts,
        first_positions=np.asarray(batch.num_computed_tokens_cpu[:num_reqs], dtype=np.int64).copy(),
        num_tokens=int(starts[-1]),
    )


def layout_from_v2_input_batch(input_batch) -> BatchLayout:
    """Build the layout from the V2 runner's per-step ``InputBatch`` (vLLM GPU builds)."""
    num_reqs = input_batch.num_reqs
    starts = np.asarray(input_batch.query_start_loc_np[: num_reqs + 1], dtype=np.int64).copy()
    return BatchLayout(
        req_ids=list(input_batch.req_ids[:num_reqs]),
        row_starts=starts,
        first_positions=np.asarray(input_batch.num_computed_tokens_np[:num_reqs], dtype=np.int64).copy(),
        num_tokens=int(input_batch.num_tokens),
    )
