"""A program's prologue: what it does from its start to its first point, when that is nothing but
walking the module tree (``m.layers[L].resid``).

Every step a program is switched into at the step's start, runs to its first point and switches
back; the forward pass then reaches that point and switches into it again. With a program per
invoke that first round trip is about a third of what a program costs a step (256 of them). A
program whose first statement is a chain of attribute lookups and constant indices from ``m`` to
a point (``m.layers[L].resid += v``) runs no code of the user's before that point: only
interlace's view, which has no effect. The same chain, with the same index values, names the same
point at every step, so such a program can be started at that point instead, handed its value
at once (calls.ProgramCall.start_at): one round trip a step instead of two.

This reads the chain from the program's bytecode (no code of the user's runs to find it): its
indices are constants, closure cells or globals, read again at every step (a program that moves
its first point, by a global it changes, is started as before). Anything else before the first
point (a call, a branch, a store, a property of a non-view object) makes the program's prologue
unknown, and it starts at the step's start as always.
"""

from __future__ import annotations

import dis
import sys
import weakref
from typing import Any

_POINT_KINDS = ("resid", "output", "input")
_IGNORED = ("RESUME", "NOP", "CACHE", "COPY_FREE_VARS", "MAKE_CELL")
_MISSING = object()
_PRE_312 = sys.version_info < (3, 12)


class Prologue:
    """The dynamic inputs of a program's chain from ``m`` to its first point."""

    __slots__ = ("_program", "_inputs", "__weakref__")

    def __init__(self, program: Any, inputs: list[tuple[str, Any]]):
        self._program = weakref.ref(program)
        self._inputs = inputs  # ("cell", index into __closure__) or ("global", name)

    def values(self) -> tuple[int, ...] | None:
        """The chain's index values now, or None if one is not an int (its point is then not known
        without running it)."""
        program = self._program()
        if program is None:
            return None
        values = []
        for where, key in self._inputs:
            if where == "cell":
                try:
                    value = program.__closure__[key].cell_contents
                except ValueError:  # an empty cell
                    return None
            else:
                value = program.__globals__.get(key, _MISSING)
            if type(value) is not int:  # an exact int: comparing it runs none of the user's code
                return None
            values.append(value)
        return tuple(values)


_KNOWN: "weakref.WeakKeyDictionary[Any, Prologue | None]" = weakref.WeakKeyDictionary()


def prologue_of(program: Any) -> Prologue | None:
    """The program's prologue if it is a chain from ``m`` to a point, else None (cached per
    function)."""
    try:
        return _KNOWN[program]
    except (KeyError, TypeError):
        pass
    found = _read(program)
    try:
        _KNOWN[program] = found
    except TypeError:  # not weak-referenceable: read again next time (not a plain function anyway)
        pass
    return found


def _read(program: Any) -> Prologue | None:
    code = getattr(program, "__code__", None)
    if code is None or code.co_argcount < 1 or not hasattr(program, "__globals__"):
        return None
    stack: list[tuple[str, Any]] = []  # what the bytecode pushed: ("m",), ("const", v), ("cell", i), ("global", name)
    inputs: list[tuple[str, Any]] = []
    for ins in dis.get_instructions(code):
        op = ins.opname
        if op in _IGNORED:
            continue
        if op == "LOAD_FAST" and ins.arg == 0:
            stack.append(("m", None))
        elif op == "LOAD_CONST":
            stack.append(("const", ins.argval))
        elif op == "LOAD_DEREF" and ins.argval in code.co_freevars:
            stack.append(("cell", code.co_freevars.index(ins.argval)))
        elif op == "LOAD_GLOBAL" and not ins.arg & 1:  # the low bit: a NULL for a call pushed too
            stack.append(("global", ins.argval))
        elif op == "LOAD_ATTR" and stack and stack[-1][0] == "m" and (_PRE_312 or not ins.arg & 1):
            if ins.argval in _POINT_KINDS:
                return Prologue(program, inputs)  # the first point: nothing but the view ran before it
            # a child module (the view's own lookup; it runs none of the user's code)
        elif op in ("LOAD_METHOD", "LOAD_ATTR") and stack and stack[-1][0] == "m":
            # ``m.save`` looked up for a call made after the read (a call before it is refused below)
            stack[-1:] = [("method", None), ("method", None)]
        elif op == "BINARY_SUBSCR" and len(stack) >= 2 and stack[-2][0] == "m" and stack[-1][0] in ("const", "cell", "global"):
            index = stack.pop()
            if index[0] == "const":
                if type(index[1]) is not int:
                    return None
            else:
                inputs.append(index)
        elif op == "COPY" and ins.arg == 1 and stack:
            stack.append(stack[-1])
        else:
            return None
    return None


def share_prologue(copy: Any, original: Any) -> None:
    """Give ``copy``, another invoke's copy of ``original`` (program_copies.py: the same code,
    equal captures), the original's prologue, read from the bytecode once per program."""
    known = prologue_of(original)
    try:
        _KNOWN[copy] = None if known is None else Prologue(copy, known._inputs)
    except TypeError:  # not weak-referenceable
        pass
