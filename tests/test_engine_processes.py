"""Engine cores of in-process models fork from one server that imported vLLM once
(cluster/engine_processes.py), and run with the environment their caller had when it started them."""

from __future__ import annotations

import os

import psutil

import interlace


def _engine_core(model: interlace.Model) -> psutil.Process:
    (process,) = model.engine.llm_engine.engine_core.resources.engine_manager.processes
    return psutil.Process(process.pid)


def _set_at_start(m):
    """A program: what the rank's environment says of the variable the test set."""
    import os

    m.save("env", os.environ.get("INTERLACE_TEST_SET_AT_START"))


def test_a_second_engine_core_forks_from_the_server_with_the_callers_environment(llama, monkeypatch):
    first = _engine_core(llama)
    server = first.parent()
    assert server.pid != os.getpid() and "forkserver" in " ".join(server.cmdline())
    monkeypatch.setenv("INTERLACE_TEST_SET_AT_START", "yes")  # set after the server started
    second = interlace.Model("tiny-llama")
    try:
        assert _engine_core(second).parent().pid == server.pid  # the same server: vLLM imported once
        assert second.generate("Hi", program=_set_at_start).saves["env"] == "yes"
        assert second.generate("Hello", max_tokens=3).token_ids == llama.generate("Hello", max_tokens=3).token_ids
    finally:
        second.close()
    assert llama.generate("Hi", program=_set_at_start).saves["env"] is None  # started before it was set
