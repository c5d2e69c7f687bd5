"""Which programs may start at their first point (workers/prologue.py): those whose first
statement only walks the module tree from ``m`` to a point, with constant, closure or global int
indices, read again at every step. Anything the user's code could do first disqualifies."""

from __future__ import annotations

from interlace.workers.prologue import prologue_of

LAYER = 3


def _closure(layer):
    def program(m):
        m.layers[layer].mlp.output *= 2

    return program


def test_a_walk_to_a_point_is_a_prologue_and_its_indices_are_read_at_every_step():
    def constant(m):
        m.layers[1].resid += 1.0

    def global_index(m):
        m.save("h", m.layers[LAYER].output)  # the method is looked up, and called after the read

    assert prologue_of(constant).values() == ()
    assert prologue_of(global_index).values() == (3,)
    program = _closure(5)
    assert prologue_of(program).values() == (5,)
    program.__closure__[0].cell_contents = 6  # as a program changing its own cell would
    assert prologue_of(program).values() == (6,)
    program.__closure__[0].cell_contents = "6"  # not an int: its point is not known without running it
    assert prologue_of(program).values() is None


def test_code_of_the_users_before_the_first_point_is_not_a_prologue():
    def calls_first(m):
        print("step")
        m.layers[1].resid += 1.0

    def branches(m):
        if m.step:
            m.layers[1].resid += 1.0

    def step_index(m):
        m.layers[m.step].resid += 1.0

    def stores_first(m):
        scale = 2.0
        m.layers[1].resid *= scale

    def other_object(m, cfg={"layer": 1}):
        m.layers[cfg["layer"]].resid += 1.0

    def no_point(m):
        m.save("x", 1)

    for program in (calls_first, branches, step_index, stores_first, other_object, no_point, print):
        assert prologue_of(program) is None, program
