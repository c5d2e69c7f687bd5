"""vLLM worker extension: the entry point of interlace inside every worker rank.

vLLM mixes this class into its worker (``worker_extension_cls``); an extension may only add methods,
so :meth:`interlace_install` is called once through ``collective_rpc`` after start-up
(:func:`interlace.cluster.engine.start_engine` does it) and wires interlace into the model runner.
"""

from __future__ import annotations

import os

from interlace.core.janitor import remove_on_exit, shared_memory_files, socket_files


class InterlaceWorkerExtension:
    def interlace_install(self, all_modules: list[str]) -> None:
        """Wire interlace into this rank's runner; ``all_modules``: every stage's module names."""
        # lazy: vLLM loads this class in its engine process too; the hooks load in worker ranks only
        from interlace.workers.runner_hooks import install

        runner = self.model_runner
        _one_torch_thread_beside_accelerators(runner.device)
        _ensure_pp_receive_buffer(runner)
        if getattr(runner, "_interlace", None) is None:
            runner._interlace = install(runner, all_modules)

    def interlace_remove_files_on_exit(self) -> list[str]:
        """Have the files this rank's process made that outlive it when killed (the ``/dev/shm``
        segments it maps, its ZMQ sockets' files) removed when it ends; returns them. For ranks
        that vLLM's Ray executor started: each is a Ray actor of its own, not a descendant of the
        engine core whose files the engine's starter hands to its janitor (cluster/engine.py), and
        Ray kills it outright. On a CPU vLLM's communicator at TP or PP > 1 never unlinks its
        segments (``*-cpushm_*``), and the TP group's message queues (``psm_*``) go only with a
        clean exit; every spread replica left them."""
        from vllm import envs

        files = shared_memory_files([os.getpid()]) + socket_files([os.getpid()], envs.VLLM_RPC_BASE_PATH)
        remove_on_exit(*files)
        return files

    def interlace_module_names(self) -> list[str]:
        """Module names of this rank's model, for validating points on the driver."""
        return [name for name, _ in self.model_runner.model.named_modules()]

    def interlace_installed_hooks(self) -> list[tuple[str, str]]:
        """Hooks currently installed (tests check that finished traces leave none behind)."""
        return self.model_runner._interlace.hooks.installed

    def interlace_replays(self) -> int:
        """Chunks this rank has replayed ops on since start-up: rows vLLM recomputed after
        preempting a request (KV cache pressure)."""
        return self.model_runner._interlace.scheduler.replays

    def interlace_step_counts(self) -> dict:
        """This rank's ``graph_steps``: on a compiled engine, the steps since start-up that replayed
        vLLM's graphs, ran ops in graph taps, ran programs at the taps between graph pieces, or ran
        eager (those that intervened otherwise; None on an eager engine), and of the graph steps
        those that replayed FULL graphs with the taps idle (``graph_idle``); and ``taps``: on an
        engine with graph taps, the steps whose ops ran through them (``steps``), the steps whose
        programs ran at them (``programs``), and the forwards that ran each tap's ops (by module
        name; every graph replay does; None without taps); ``replays``: as :meth:`interlace_replays`;
        ``write_logs``: program invokes admitted with a write log (``kept``) and without one because
        vLLM could never preempt them (``skipped``; scheduler.py); ``saves``: programs' tensor saves
        held to their step's end and recorded together (``held``), and those recorded where made
        (``at_once``: too large to hold, or near a limit; program_services.py)."""
        inter = self.model_runner._interlace
        taps = None
        if inter.taps is not None:
            ran = inter.taps.ran.tolist()
            taps = {"steps": inter.tap_steps, "programs": inter.piece_steps,
                    "ran": {name: ran[i] for name, i in inter.taps.index.items()}}
        return {"graph_steps": getattr(inter, "graph_steps", None), "taps": taps, "replays": inter.scheduler.replays,
                "write_logs": dict(inter.write_logs), "saves": dict(inter.save_counts)}

    def interlace_set_attribute(self, module: str, name: str, value) -> bool:
        """Set an attribute of one of this rank's modules (tests use it to emulate model variants,
        e.g. a block that defers its all-reduce); False where the module runs on another stage."""
        runner = self.model_runner
        try:
            target = runner.model.get_submodule(module)
        except AttributeError:
            return False
        setattr(target, name, value)
        runner._interlace.tp.forget()  # values are classified once; the module changed
        return True


def _one_torch_thread_beside_accelerators(device) -> None:
    """On a GPU worker, torch's CPU ops get one thread (as later vLLM releases do for serving).

    interlace does small CPU tensor work on the engine and reporter threads (touching a report
    file's pages ahead, for one); with torch's default of one thread per core, each parallel region
    leaves OpenMP workers spinning beside the engine thread, whose serial Python bounds an eager
    step. vLLM 0.26's single-process executor keeps the default. Measured on an H200, in one
    process: the 4-layer save case's decode steps took 9.8 ms median (p90 16.7) with 16 threads
    and 8.5 ms (p90 9.3) with one; the other cases moved within noise. A CPU worker keeps its
    threads (they run the model), and an ``OMP_NUM_THREADS`` set by the user wins.
    """
    if device.type == "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(1)


def _ensure_pp_receive_buffer(runner) -> None:
    """Allocate the pipeline receive buffer that CPU eager mode never warms up.

    The V1 runner creates it in a dummy run that the CPU worker skips in eager mode, and later
    stages then fail with ``assert self.intermediate_tensors is not None``.
    """
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", True) is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )
