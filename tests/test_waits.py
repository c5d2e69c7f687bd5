"""What a program may do after a wait (a recv, a later point, a parameter another pipeline stage
holds), against transformers (float32, same weights).

A write to a value the program holds lands in this step's forward pass while the hook that
produced it runs, however many times the program waited since; once that hook has returned, the
write fails the invoke with a message saying why, never silently lost. tests/test_parallel.py
runs every test here again at TP=2, PP=2 and TP=2 x PP=2.
"""

from __future__ import annotations

import pytest
import torch

import interlace

PROMPT = "The capital of France is"
STEPS = 4


def _prompts(oracle) -> tuple[list[int], list[int]]:
    clean = oracle.ids(PROMPT)
    corrupt = clean[:-2] + [(clean[-2] + 7) % 500, clean[-1]]  # one token swapped, same length
    return clean, corrupt


def _patched_greedy(oracle, clean: list[int], corrupt: list[int], layer: int) -> list[int]:
    """transformers' greedy tokens for ``corrupt`` with its residual stream after ``layer``
    replaced, at the last prompt position and every generated one, by the clean run's at the
    same position (what the receivers below do at every step)."""
    clean_seq = clean + oracle.greedy(clean, STEPS)
    clean_resid = oracle.run(clean_seq)["resid"][layer]
    first = len(corrupt) - 1

    def patch(out):
        hidden = (out[0] if isinstance(out, tuple) else out).clone()
        hidden[0, first:] = clean_resid[first : hidden.shape[1]]
        return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

    return oracle.greedy(corrupt, STEPS, hooks={oracle.layers[layer]: patch})


def send_clean(m):
    m.send("clean", m.layers[2].resid)  # sent at the receivers' own hook


def edit_after_wait(m):
    h = m.layers[2].resid
    clean = m.recv("clean")  # with the receiver added first, resumed by the sender's send
    h[-1] = clean[-1]


def assign_after_wait(m):
    h = m.layers[2].resid
    clean = m.recv("clean")
    edited = h.clone()
    edited[-1] = clean[-1]
    m.layers[2].resid = edited


def one_liner(m):
    m.layers[2].resid[-1] = m.recv("clean")[-1]


@pytest.mark.parametrize("receiver", [edit_after_wait, assign_after_wait, one_liner], ids=lambda f: f.__name__)
@pytest.mark.parametrize("receiver_first", [True, False], ids=["receiver_first", "sender_first"])
def test_patch_after_recv_lands_in_either_order(any_model, oracle, receiver, receiver_first):
    clean, corrupt = _prompts(oracle)
    expected = _patched_greedy(oracle, clean, corrupt, 2)
    assert expected != oracle.greedy(corrupt, STEPS)  # the patch changes the tokens
    with any_model.trace(max_tokens=STEPS, ignore_eos=True) as tr:
        if receiver_first:
            tr.invoke(corrupt, program=receiver)
            tr.invoke(clean, program=send_clean)
        else:
            tr.invoke(clean, program=send_clean)
            tr.invoke(corrupt, program=receiver)
    patched = tr.result[0 if receiver_first else 1]
    assert patched.token_ids == expected


def test_batched_patch_after_recv_lands(any_model, oracle):
    clean, corrupt = _prompts(oracle)
    other = oracle.ids("One two three four five")[: len(clean)]
    other = other + [11] * (len(clean) - len(other))  # same length as the clean prompt

    @interlace.batched
    def patch_all(m):
        h = m.layers[2].resid
        clean_rows = m.recv("clean")
        for rows in m.rows:  # each invoke's last row takes the clean run's last row
            h[rows.stop - 1] = clean_rows[-1]

    with any_model.trace(max_tokens=STEPS, ignore_eos=True) as tr:
        tr.invoke(corrupt, program=patch_all)  # the batched receivers come first
        tr.invoke(other, program=patch_all)
        tr.invoke(clean, program=send_clean)
    assert tr.result[0].token_ids == _patched_greedy(oracle, clean, corrupt, 2)
    assert tr.result[1].token_ids == _patched_greedy(oracle, clean, other, 2)


def _fails(model, programs: list, match: str, max_tokens: int = 2) -> interlace.InterventionError:
    with pytest.raises(interlace.InterventionError, match=match) as info:
        with model.trace(max_tokens=max_tokens) as tr:
            for program in programs:
                tr.invoke(PROMPT, program=program)
    return info.value


def test_edit_after_reading_a_later_point_fails(llama, oracles):
    def late_edit(m):
        h = m.layers[1].resid
        m.save("later", m.layers[2].resid)
        h[-1] = 0  # layer 1 has run: this cannot reach the model

    err = _fails(llama, [late_edit], r"edited in place its copy of layers\.1\.resid after reading layers\.2\.resid")
    assert "Make every write to layers.1.resid before reading layers.2.resid" in str(err)
    ids = oracles["tiny-llama"].ids(PROMPT)
    assert llama.generate(ids, max_tokens=4, ignore_eos=True).token_ids == oracles["tiny-llama"].greedy(ids, 4)


def test_an_output_edited_after_reading_a_later_point_fails(llama):
    """A module's output is a copy while the invoke keeps a write log (the default), so an
    in-place edit after its module ran is seen and refused, as for resid."""
    def late_edit(m):
        out = m.layers[1].mlp.output
        m.save("later", m.layers[2].resid)
        out.mul_(2.0)

    _fails(llama, [late_edit], r"edited in place its copy of layers\.1\.mlp\.output after reading layers\.2\.resid")


def test_edit_after_reading_an_earlier_stage_point_fails(any_model):
    """Layer 0 and layer 3 run on different stages under PP=2: the late edit happens on the stage
    that replays layer 0's value, and fails there just as on one device."""

    def late_edit(m):
        h = m.layers[0].resid
        m.layers[3].resid  # noqa: B018 - the read is the point
        h.mul_(0)

    _fails(any_model, [late_edit], r"edited in place its copy of layers\.0\.resid after reading layers\.3\.resid")


def send_late(m):
    m.send("clean", m.layers[3].resid)  # after the receivers' layer 1 has run


def edit_across_hooks(m):
    h = m.layers[1].resid
    clean = m.recv("clean")
    h[-1] = clean[-1]


def assign_across_hooks(m):
    h = m.layers[1].resid
    clean = m.recv("clean")
    m.layers[1].resid = torch.cat([h[:-1], clean[-1:]])


@pytest.mark.parametrize("receiver,how", [(edit_across_hooks, "edited in place its copy of"),
                                          (assign_across_hooks, "assigned")], ids=["edit", "assign"])
@pytest.mark.parametrize("receiver_first", [True, False], ids=["receiver_first", "sender_first"])
def test_write_after_a_wait_that_spans_hooks_fails(llama, oracles, receiver, how, receiver_first):
    programs = [receiver, send_late] if receiver_first else [send_late, receiver]
    err = _fails(llama, programs, rf"{how} layers\.1\.resid after waiting at recv\('clean'\)")
    assert "m.recv('clean')[-1]" in str(err) and "at or before layers.1.resid" in str(err)
    ids = oracles["tiny-llama"].ids(PROMPT)
    assert llama.generate(ids, max_tokens=4, ignore_eos=True).token_ids == oracles["tiny-llama"].greedy(ids, 4)


def test_parameter_read_after_a_point(llama, oracles):
    """On one device (and under TP) a parameter read is no wait, so the edit lands; under PP the
    lm_head lives on the last stage, after layer 0's: the edit fails there with the reason."""
    oracle = oracles["tiny-llama"]
    ids = oracle.ids(PROMPT)

    def add_unembedding_row(m):
        h = m.layers[0].resid
        h[-1] += m.lm_head.weight[5]

    if llama.config.pipeline_parallel_size > 1:
        _fails(llama, [add_unembedding_row], r"lm_head\.weight, which a later pipeline stage holds")
        return
    row = oracle.model.lm_head.weight[5]

    def hf_add(out):
        hidden = (out[0] if isinstance(out, tuple) else out).clone()
        hidden[0, -1] += row
        return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

    out = llama.generate(ids, program=add_unembedding_row, max_tokens=4, ignore_eos=True)
    assert out.token_ids == oracle.greedy(ids, 4, hooks={oracle.layers[0]: hf_add})


def test_module_of_another_stage_only(llama, oracles):
    """embed_tokens runs on the first pipeline stage only: read before a later stage's point it is
    carried along (any layout); read after one, under PP it fails with the reason and the fix."""
    oracle = oracles["tiny-llama"]
    ids = oracle.ids(PROMPT)
    embed = oracle.model.model.embed_tokens.weight[[5, 7]]

    def in_order(m):
        m.save("rows", m.embed_tokens.weight[[5, 7]])
        m.save("down", m.layers[3].mlp.down_proj.output[0])

    torch.testing.assert_close(llama.generate(ids, program=in_order, max_tokens=1).saves["rows"], embed)

    def after_a_later_point(m):
        m.save("down", m.layers[3].mlp.down_proj.output[0])
        m.save("rows", m.embed_tokens.weight[[5, 7]])

    if llama.config.pipeline_parallel_size > 1:
        _fails(llama, [after_a_later_point], r"embed_tokens\.weight belongs to an earlier pipeline stage")
    else:
        torch.testing.assert_close(llama.generate(ids, program=after_a_later_point, max_tokens=1).saves["rows"], embed)


def test_steps_that_never_ran_fail(llama, oracles):
    """Steps at or past max_tokens are refused on the driver (test_errors); steps that generation
    did not reach, because it stopped early (here at a stop token), fail naming the steps that ran."""
    ids = oracles["tiny-llama"].ids(PROMPT)
    keep = lambda m: m.save("h", m.last(m.layers[1].resid))  # noqa: E731
    tokens = llama.generate(ids, max_tokens=8, ignore_eos=True).token_ids
    last = next(k for k in range(1, 8) if tokens[k] not in tokens[:k])  # generation stops at step `last`
    with pytest.raises(interlace.InterventionError,
                       match=rf"steps=\[1, 50\].*before steps \[50\] \(steps 0 to {last} ran"):
        llama.generate(ids, program=keep, steps=[1, 50], max_tokens=60, ignore_eos=True, stop_token_ids=[tokens[last]])
    assert llama.generate(ids, program=keep, steps=[2, 3], max_tokens=4, ignore_eos=True).saves["h"].shape[0] == 2


def test_a_save_never_made_names_the_saves_made(llama, oracles):
    ids = oracles["tiny-llama"].ids(PROMPT)

    def program(m):
        m.save("h", m.last(m.layers[1].resid))
        if m.step == 50:
            m.save("late", m.logits)

    out = llama.generate(ids, program=program, max_tokens=3)
    with pytest.raises(KeyError, match=r"no save named 'late'; this invoke saved \['h'\].*m\.step == 50"):
        out.saves["late"]


def test_recv_of_a_name_nobody_sent_lists_the_names_sent(llama, oracles):
    ids = oracles["tiny-llama"].ids(PROMPT)
    misspelt = lambda m: m.send("clena", m.layers[1].resid)  # noqa: E731
    with pytest.raises(interlace.InterventionError, match=r"no invoke of this trace sent 'clean'.*names sent in this step: \['clena'\]"):
        with llama.trace(max_tokens=1) as tr:
            tr.invoke(ids, program=misspelt)
            tr.invoke(ids, program=lambda m: m.layers[1].resid.add_(m.recv("clean")))
