"""Bundled YAML configs (``models/*.yaml``), read through :mod:`interlace.cluster.config`."""
