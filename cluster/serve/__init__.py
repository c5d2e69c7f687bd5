"""The Ray Serve application: one model deployment shared by many users over HTTP.

- :mod:`~interlace.cluster.serve.app`: ``build_app`` (``serve run interlace.cluster.serve.app:build_app``),
  ``start`` and ``interlace serve``;
- :mod:`~interlace.cluster.serve.ingress`: the FastAPI ingress deployment (routes, streaming);
- :mod:`~interlace.cluster.serve.http_api`: the request and answer schema, validated strictly;
- :mod:`~interlace.cluster.serve.auth`: API tokens and roles;
- :mod:`~interlace.cluster.serve.state`: the one actor holding per-token state and the metrics;
- :mod:`~interlace.cluster.serve.metrics`: every ``interlace_*`` Prometheus metric.
"""
