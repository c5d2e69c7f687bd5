"""interlace: intervention programs inside vLLM, from a laptop CPU to a GPU cluster.

    >>> import interlace
    >>> model = interlace.Model()                     # the embedded tiny Llama on a local engine
    >>> def program(m):                               # called once per generation step
    ...     m.save("resid", m.layers[1].resid)
    >>> model.generate("Hello", program=program).saves["resid"]

See ``interlace.Model`` for traces with several invokes, ``interlace.ops`` for declarative
interventions, and docs/ for steering, logit lens and activation patching examples.
"""

from typing import TYPE_CHECKING

from interlace.core import ops
from interlace.core.trace import InterventionError, InvokeResult, ProgramEndedEngine, TraceResult, WorkerDied, batched

if TYPE_CHECKING:
    from interlace.cluster_client import Cluster, connect
    from interlace.model import Model, Trace
    from interlace.sweep import open_sweep

# The entry points load on first use (PEP 562), so that code importing a lower layer (a vLLM rank
# importing interlace.workers, a Ray actor importing interlace.cluster) never loads the user API.
_LAZY = {"Model": "interlace.model", "Trace": "interlace.model", "Cluster": "interlace.cluster_client",
         "connect": "interlace.cluster_client", "open_sweep": "interlace.sweep"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'interlace' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = ["Model", "Cluster", "connect", "Trace", "TraceResult", "InvokeResult", "InterventionError", "WorkerDied", "ProgramEndedEngine", "batched", "ops", "open_sweep"]
