"""CPU cost of one HTTP answer of the Serve endpoint, JSON (tensors as base64) against binary
(one .safetensors file), on the server (encoding) and on the client (decoding).

One invoke of 128 generated tokens whose last-token residual (2048 wide, bfloat16) was saved at
every step: the answer of ``bench/serve_bench.py``'s traces on the 1B shape (about 0.5 MB).

Usage: python bench/answer_bench.py [--rows 129] [--width 2048] [--n 200]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    import torch

    from interlace.cluster.serve.http_api import (
        TraceResponse, decode_result, encode_result, read_safetensors_body, safetensors_body, tensors_b64,
    )
    from interlace.core.trace import InvokeResult, TraceResult

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=129)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args()
    saved = torch.randn(args.rows, args.width).to(torch.bfloat16)
    result = TraceResult(invokes=[InvokeResult(prompt=[1] * 128, token_ids=list(range(128)), text="x" * 500,
                                               saves={"layers.8.resid": saved})], shared={})

    def server_json() -> bytes:
        response, tensors = encode_result("trace", result, False)
        response.tensors = tensors_b64(tensors)
        return response.model_dump_json().encode()

    def server_binary() -> bytes:
        return safetensors_body(*encode_result("trace", result, False))

    def client_json(body: bytes):
        return decode_result(TraceResponse.model_validate_json(body))

    def client_binary(body: bytes):
        return decode_result(*read_safetensors_body(body))

    for name, server, client in (("json", server_json, client_json), ("binary", server_binary, client_binary)):
        for _ in range(5):  # warm-up
            client(server())
        started = time.perf_counter()
        for _ in range(args.n):
            body = server()
        encoded = time.perf_counter()
        for _ in range(args.n):
            out = client(body)
        decoded = time.perf_counter()
        assert torch.equal(out.invokes[0].saves["layers.8.resid"], saved)
        print(f"{name:7} server {1e3 * (encoded - started) / args.n:6.2f} ms  client "
              f"{1e3 * (decoded - encoded) / args.n:6.2f} ms  {len(body) / 1e3:5.0f} kB", flush=True)


if __name__ == "__main__":
    main()
