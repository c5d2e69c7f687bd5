"""The sweep's safetensors writer: files safetensors itself reads back, equal to the joined parts."""

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from interlace.cluster.sweep.tensor_file import write_safetensors


def test_parts_are_written_joined_and_read_back_by_safetensors(tmp_path):
    region = torch.randn(6, 3, 5).to(torch.bfloat16)  # parts that view one region, as reports' saves do
    parts = {
        "resid": [region[0], region[1:3].reshape(6, 5), region[3:6, 0]],  # the last one not contiguous
        "ids": [torch.arange(4), torch.arange(7, 9)],
        "flag": [torch.tensor([True]), torch.tensor([False, True])],
        "scalar": [torch.tensor(2.5)],  # a shared value: one 0-dimensional part
        "none_yet": [torch.empty(0, 5)],
    }
    path = tmp_path / "shard.safetensors"
    with open(path, "wb", buffering=0) as out:
        write_safetensors(out, parts, {"interlace.shared": "{}"})
    got = load_file(path)
    assert set(got) == set(parts)
    for name, values in parts.items():
        want = values[0] if len(values) == 1 else torch.cat([v.reshape(-1, *values[0].shape[1:]) for v in values])
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"interlace.shared": "{}"}
