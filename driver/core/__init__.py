"""What the user API, the cluster and the workers share, and which imports none of them.

- :mod:`interlace.core.settings`: every ``INTERLACE_*`` environment setting, read in one place;
- :mod:`interlace.core.trace`: the trace data model (invokes, results, errors) and its checks;
- :mod:`interlace.core.wire`: the typed messages that cross process boundaries;
- :mod:`interlace.core.ops`: declarative ops as data (public as ``interlace.ops``);
- :mod:`interlace.core.merge`: the one merge of trace-shared values (the driver's and the collector's),
  and the list of merges ``m.share`` is checked against in the engine;
- :mod:`interlace.core.tiny_models`: the embedded tiny models, built locally;
- :mod:`interlace.core.janitor`: files and folders removed when the process that made them ends
  (report folders, engines' shared memory), however it ends.
"""
