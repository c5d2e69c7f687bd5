"""Engines, the merge function and the config schema (Ray actors, Serve and the collector later)."""
