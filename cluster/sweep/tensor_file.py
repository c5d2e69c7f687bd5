"""A safetensors file written from each tensor's parts, without joining them first.

A sweep shard stores each save name's rows of every prompt as one tensor. The rows arrive as
views of the workers' mapped report files, one per prompt; ``safetensors.torch.save_file`` wants
each tensor whole, so using it meant joining the parts (``torch.cat``: a copy into memory nobody
had touched, which the kernel must first find and map) after copying them out of the reports.
The format is small and fixed (an 8-byte little-endian header length, a JSON header of dtypes,
shapes and byte ranges, then the bytes), so this module writes the header and then each part's
bytes straight from where they lie: one copy, from the reports into the file, done by ``write``
with the GIL released (the shard runner's other threads keep the engine fed meanwhile).
Files written here are ordinary safetensors files (``safetensors.safe_open``, ``load_file``).

    with open(path, "wb", buffering=0) as out:
        write_safetensors(out, {"resid": [rows_of_prompt_0, rows_of_prompt_1]}, {"note": "x"})
"""

from __future__ import annotations

import json
import struct
from typing import Any, Sequence

import torch

# torch dtype -> safetensors' dtype name (the names safetensors.torch reads back)
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
_CHUNK = 1 << 30  # bytes per write call (Linux writes at most 2 GiB - 4 KiB at once)


def storable(dtype: torch.dtype) -> bool:
    """Whether a safetensors file holds tensors of ``dtype`` (not complex128, complex32, float4 or
    float8_e8m0fnu)."""
    return dtype in _DTYPES


def joined_shape(parts: Sequence[torch.Tensor]) -> list[int]:
    """The shape of ``torch.cat(parts)`` (rows added up, the rest from the first part); one part
    keeps its own shape, a 0-dimensional one included."""
    if len(parts) == 1:
        return list(parts[0].shape)
    return [sum(p.shape[0] for p in parts), *parts[0].shape[1:]]


def write_safetensors(out: Any, tensors: dict[str, Sequence[torch.Tensor]], metadata: dict[str, str]) -> None:
    """Write a safetensors file to the binary stream ``out`` (anything with ``write``): tensor
    ``name`` is its parts joined along dim 0. Parts of one name share dtype and trailing shape."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, parts in tensors.items():
        first = parts[0]
        if first.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r}: safetensors cannot store {first.dtype}")
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        header[name] = {"dtype": _DTYPES[first.dtype], "shape": joined_shape(parts), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    _write_all(out, struct.pack("<Q", len(text)) + text)
    for parts in tensors.values():
        for part in parts:
            _write_all(out, _bytes_of(part))


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without a copy when it is contiguous on the CPU."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _write_all(out: Any, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while len(view):
        written = out.write(view[:_CHUNK])
        view = view[written if written is not None else min(len(view), _CHUNK):]
