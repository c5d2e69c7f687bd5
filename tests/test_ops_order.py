"""Declarative ops: each invoke's ops apply in the order it gave, whatever other invokes share;
ops on modules that return tuples; selections that select nothing.

The order tests compare a batch against each invoke run alone (its solo run), on the same engine.
"""

from __future__ import annotations

import pytest
import torch

import interlace
from interlace import ops
from test_interventions import ATOL, PROMPT

POINT = "layers.1.resid"
MAX_TOKENS = 4


def _order_trace(n: int = 64):
    """``n`` invokes: op lists mixing two shared op objects (a scale, a save of the last token)
    with each invoke's own steering vector, in different orders (conflicting ones included, and
    the shared scale twice in one list), plus invokes with only the shared ops and plain ones."""
    gen = torch.Generator().manual_seed(17)
    scale = ops.scale(POINT, 0.5)
    keep = ops.save(POINT, name="kept", tokens="last")
    lengths = (3, 5, 8, 13)
    invokes = []
    for i in range(n):
        prompt = [int(t) for t in torch.randint(10, 500, (lengths[i % len(lengths)],), generator=gen)]
        own = ops.add(POINT, 4 * torch.randn(128, generator=gen))
        orders = ([own, scale, keep], [scale, own, keep], [keep, own, scale], [own, keep, scale],
                  [scale, keep], [keep, scale], None, [scale, own, scale, keep])
        op_list = orders[i % len(orders)]
        invokes.append((prompt, op_list))
    return invokes


def _run_batch(model, invokes):
    with model.trace(max_tokens=MAX_TOKENS, ignore_eos=True) as tr:
        for prompt, op_list in invokes:
            tr.invoke(prompt, ops=op_list or ())
    return tr.result


def test_each_invoke_keeps_its_op_order_among_shared_ops(llama):
    """64 invokes sharing a scale and a save with their own steering vectors, in different orders:
    16 of them, spread over the batch and taking every order and prompt length twice, each equal
    its solo run (a solo run is a trace of its own: all 64 cost a CPU TP=2 x PP=2 engine a minute)."""
    invokes = _order_trace()
    batch = _run_batch(llama, invokes)
    for index in sorted(9 * k % len(invokes) for k in range(16)):  # k % 8 orders, k % 4 lengths, all rows
        prompt, op_list = invokes[index]
        solo = llama.generate(prompt, ops=op_list or (), max_tokens=MAX_TOKENS, ignore_eos=True)
        got = batch[index]
        assert got.token_ids == solo.token_ids, f"invoke {index} ({op_list and [o['op'] for o in op_list]})"
        assert got.saves.keys() == solo.saves.keys()
        if "kept" in solo.saves:
            assert got.saves["kept"].shape == (MAX_TOKENS, 128)
            if torch.cuda.is_available():  # GPU matmul kernels depend on the batch's size
                torch.testing.assert_close(got.saves["kept"], solo.saves["kept"], atol=ATOL, rtol=ATOL)
            else:  # on CPU a row's values do not depend on the batch: bit for bit
                assert torch.equal(got.saves["kept"], solo.saves["kept"]), f"invoke {index}"


def test_conflicting_orders_split_one_op_and_keep_the_batching():
    """Plans are shared while the invokes' orders agree and split where they conflict."""
    from interlace.workers.ops import OpOrder
    from interlace.workers.points import Point

    class Invoke:  # the fields OpOrder reads from the interleaver's InvokeState
        def __init__(self, slot):
            self.slot, self.trace = slot, "t"

    def op(kind, key):
        return {"op": kind, "point": POINT, "key": key, "_point": Point("model.layers.1", "resid")}

    x, y, z = op("scale", "x"), op("save", "y"), op("add", "z")
    order, invokes = OpOrder(), [Invoke(slot) for slot in range(258)]
    for slot in range(256):  # a sweep: one plan per op
        order.add(invokes[slot], [x, z, y] if slot % 2 else [x, y], prepare=dict)
    assert [plan.op["key"] for plan in order.plans()] == ["x", "z", "y"]
    assert [len(plan.members) for plan in order.plans()] == [256, 128, 256]
    order.add(invokes[256], [y, x], prepare=dict)  # the other way round: x splits
    order.add(invokes[257], [x, x, z], prepare=dict)  # twice: applied twice, z after both
    assert [plan.op["key"] for plan in order.plans()] == ["x", "z", "y", "x", "z"]
    assert [len(plan.members) for plan in order.plans()] == [257, 128, 257, 2, 1]
    order.drop({id(inv) for inv in invokes[1:256:2] + invokes[256:]})
    assert [plan.op["key"] for plan in order.plans()] == ["x", "y"]


def test_equal_ops_built_apart_are_one_key_one_plan_and_one_pickle(llama):
    """The endpoint builds each invoke's ops from its JSON, and scripts often build them per invoke:
    equal ops built apart got other keys (a digest of their pickle, in which torch names a tensor's
    storage by its memory address), so they were applied invoke by invoke and pickled once each."""
    from interlace.core.trace import Invoke, encode_payloads
    from interlace.workers.ops import OpOrder
    from interlace.workers.points import Point

    steer = torch.linspace(-0.5, 0.5, 128)
    built = [[ops.add(POINT, steer.clone()), ops.save("layers.2.resid", tokens="last")] for _ in range(8)]
    assert len({tuple(op["key"] for op in op_list) for op_list in built}) == 1
    assert ops.add(POINT, steer * 2)["key"] != built[0][0]["key"]  # content, not the op's kind and point alone
    assert ops.add(POINT, steer.double())["key"] != built[0][0]["key"]
    payloads = encode_payloads([Invoke(PROMPT, None, op_list, None) for op_list in built], "t", "", 60.0, 1 << 20)
    assert len({id(payload.ops) for payload in payloads}) == 1  # one pickle for every invoke

    class Invoke_:  # the fields OpOrder reads from the interleaver's InvokeState
        def __init__(self, slot):
            self.slot, self.trace = slot, "t"

    order = OpOrder()
    for slot, op_list in enumerate(built):
        order.add(Invoke_(slot), [{**op, "_point": Point("model.layers.1", "resid")} for op in op_list], prepare=dict)
    assert [len(plan.members) for plan in order.plans()] == [8, 8]  # one batched application per op

    with llama.trace(max_tokens=2) as apart, llama.trace(max_tokens=2) as shared:
        for op_list in built:
            apart.invoke(PROMPT, ops=op_list)
            shared.invoke(PROMPT, ops=built[0])
    for got, want in zip(apart.result, shared.result):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(got.saves["layers.2.resid"], want.saves["layers.2.resid"], atol=ATOL, rtol=ATOL)


def test_ops_on_linear_layers_act_on_their_output_tensor(any_model, oracle):
    """vLLM's linear layers return (out, bias): ops on their output act on ``out``, laid out as
    the unsplit model's merged projections (Qwen2's with their biases)."""
    ids = oracle.ids(PROMPT)
    out = any_model.generate(ids, ops=[ops.save("layers.1.self_attn.qkv_proj.output", name="qkv"),
                                   ops.save("layers.1.mlp.gate_up_proj.output", name="gate_up"),
                                   ops.save("layers.1.input_layernorm.output", name="normed")])
    hf_attn, hf_mlp, seen, handles = oracle.layers[1].self_attn, oracle.layers[1].mlp, {}, []
    for name, mod in [("q", hf_attn.q_proj), ("k", hf_attn.k_proj), ("v", hf_attn.v_proj),
                      ("gate", hf_mlp.gate_proj), ("up", hf_mlp.up_proj), ("normed", oracle.layers[1].input_layernorm)]:
        handles.append(mod.register_forward_hook(lambda _m, _a, o, name=name: seen.__setitem__(name, o[0])))
    try:
        oracle.run(ids)
    finally:
        for h in handles:
            h.remove()
    close = lambda a, b: torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)  # noqa: E731
    close(out.saves["qkv"], torch.cat([seen["q"], seen["k"], seen["v"]], dim=-1))
    close(out.saves["gate_up"], torch.cat([seen["gate"], seen["up"]], dim=-1))
    close(out.saves["normed"], seen["normed"])

    # Logits, not greedy tokens: zeroing Qwen2's layer-1 MLP leaves its top two logits 0.0015
    # apart, which TF32 on a GPU (an H100) orders the other way round.
    zeroed = any_model.generate(ids, ops=[ops.zero("layers.1.mlp.down_proj.output"), ops.save("logits")])
    hook = {oracle.layers[1].mlp.down_proj: lambda o: torch.zeros_like(o)}
    expected = oracle.run(ids, hook)["logits"][-1]
    close(zeroed.saves["logits"][-1], expected)
    assert not torch.allclose(expected, oracle.run(ids)["logits"][-1], atol=ATOL)  # the op changed something


def test_a_decoder_layers_output_is_refused_for_ops(llama):
    """A decoder layer returns (hidden, residual); an op on one of them would be the classic silent
    error, so the driver points to the residual stream instead."""
    with pytest.raises(ValueError, match=r"layers\.1\.resid"):
        llama.generate([5, 6, 7], ops=[ops.add("layers.1.output", torch.ones(128))])


def test_selections_that_select_nothing_are_errors(llama):
    """Steps past max_tokens are refused on the driver; positions past the generation fail that
    invoke (naming the op, what it selected and what ran) while the others finish."""
    with pytest.raises(ValueError, match=r"steps \[4, 9\].*max_tokens=4"):
        llama.generate([5, 6, 7], ops=[ops.save(POINT, steps=[4, 9])], max_tokens=4)
    with pytest.raises(interlace.InterventionError) as info:
        with llama.trace(max_tokens=3, ignore_eos=True) as tr:
            tr.invoke([5, 6, 7], ops=[ops.save(POINT, name="early", tokens=[1])])
            tr.invoke([5, 6, 7], ops=[ops.save(POINT, name="early", tokens=[1]),
                                      ops.add(POINT, torch.ones(128), tokens=[40])])
    assert info.value.invoke == 1
    message = info.value.record["message"]
    assert "add at layers.1.resid" in message and "[40]" in message and "positions 0-4" in message
    assert info.value.partial[0].saves["early"].shape == (1, 128)
    # the last step and the last position that run are accepted
    out = llama.generate([5, 6, 7], ops=[ops.save(POINT, name="s", steps=[2]), ops.save(POINT, name="p", tokens=[4])],
                         max_tokens=3, ignore_eos=True)
    assert out.saves["s"].shape == out.saves["p"].shape == (1, 128)


def test_kinds_at_one_module_keep_the_given_order(llama):
    """``norm.output`` (the first of the final norm's (normed, residual)) and ``final`` are one
    tensor: an invoke's ops on them apply in its order, not by kind."""
    vector = torch.randn(128)
    with llama.trace(max_tokens=1) as tr:  # one step: the tokens the add changes are never run
        tr.invoke([5, 6, 7], ops=[ops.add("norm.output", vector), ops.save("final", name="f")])
        tr.invoke([5, 6, 7], ops=[ops.save("final", name="f"), ops.add("norm.output", vector)])
        tr.invoke([5, 6, 7], ops=[ops.save("final", name="f")])
    after, before, plain = (tr.result[i].saves["f"] for i in range(3))
    assert torch.equal(before, plain)
    torch.testing.assert_close(after, plain + vector, atol=1e-5, rtol=1e-5)


def test_save_limit_is_reported_in_a_unit_that_shows_it(llama):
    with pytest.raises(interlace.InterventionError, match=r"exceed the limit of 64 KiB"):
        llama.generate(list(range(10, 210)), ops=[ops.save("layers.0.resid")], max_save_bytes=64 << 10)
