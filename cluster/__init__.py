"""The cluster: what stands between the user API and a vLLM rank.

- the one config schema (:mod:`~interlace.cluster.config`, and :mod:`~interlace.cluster.helm_values`
  beside it, which reads the Helm chart's values into the same configs);
- engines (:mod:`~interlace.cluster.engine`): start a vLLM engine with the worker extension;
- the trace path every target shares: :mod:`~interlace.cluster.shards` splits a trace across
  replicas, :mod:`~interlace.cluster.assembly` turns invokes into vLLM requests and reports into
  results with the one merge function for shared values (:mod:`interlace.core.merge`, which
  programs' ``m.share`` checks its merge against in the engine);
- Ray: engine replicas as actors (:mod:`~interlace.cluster.replica`) on placement groups
  (:mod:`~interlace.cluster.placement`) and the collector actor (:mod:`~interlace.cluster.collector`);
- :mod:`interlace.cluster.serve`: the Ray Serve application;
- :mod:`interlace.cluster.sweep`: sweeps over datasets of prompts.

Imports go down only: this package imports :mod:`interlace.workers` and :mod:`interlace.core`,
never the user API (``tests/test_layers.py`` holds the line).
"""
