"""interlace: intervention programs inside vLLM, from a laptop CPU to a GPU cluster.

    >>> import interlace
    >>> model = interlace.Model()                     # the embedded tiny Llama on a local engine
    >>> def program(m):                               # called once per generation step
    ...     m.save("resid", m.layers[1].resid)
    >>> model.generate("Hello", program=program).saves["resid"]

See ``interlace.Model`` for traces with several invokes, ``interlace.ops`` for declarative
interventions, and docs/ for steering, logit lens and activation patching examples.
"""

from interlace import ops
from interlace.cluster_client import Cluster, connect
from interlace.model import Model, Trace
from interlace.sweep import open_sweep
from interlace.trace import InterventionError, InvokeResult, TraceResult, WorkerDied, batched

__all__ = ["Model", "Cluster", "connect", "Trace", "TraceResult", "InvokeResult", "InterventionError", "WorkerDied", "batched", "ops", "open_sweep"]
