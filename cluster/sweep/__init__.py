"""Sweeps: one intervention over a dataset of prompts, written as resumable, exactly-once shards.

- :mod:`~interlace.cluster.sweep.runner`: ``run_sweep``, behind ``interlace sweep`` and ``ray job submit``;
- :mod:`~interlace.cluster.sweep.shard_writer`: the actor that runs a shard and writes its files;
- :mod:`~interlace.cluster.sweep.store`: where the files go (a folder or an object store) and how
  they are read back;
- :mod:`~interlace.cluster.sweep.tensor_file`: the safetensors file written as its rows arrive.
"""
