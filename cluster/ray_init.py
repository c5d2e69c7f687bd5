"""Joining or starting Ray for a ``Cluster``, ``interlace sweep`` and ``interlace serve``.

An address is checked before ``ray.init`` joins it: given one where no Ray listens (a typo in
``--address``, a head node that is down), Ray retried its GCS for minutes, printing warnings,
before it failed, and the command looked hung.
"""

from __future__ import annotations

import socket
from typing import Any

from interlace.core import sigterm

_ANSWER_S = 5.0  # a live GCS accepts a connection at once; a remote head over a slow link, in seconds


def init_ray(address: str, take_sigterm: bool = False, **ray_init: Any) -> None:
    """``ray.init(address, include_dashboard=False, **ray_init)``, keeping interlace's SIGTERM
    handler (``sigterm.kept_across_ray_init``; ``take_sigterm``: also take one nobody chose).
    ``address``: ``"local"`` (start one), ``"auto"``, ``host:port`` or ``ray://host:port``."""
    import ray

    check_reachable(address)
    with sigterm.kept_across_ray_init(take=take_sigterm):
        ray.init(address=address, include_dashboard=False, **ray_init)


def check_reachable(address: str) -> None:
    """ConnectionError unless something accepts a connection at ``address``'s host and port
    ("local" and "auto" are Ray's to resolve, and fail fast there); ValueError for what is no Ray
    address at all (Ray's own "Invalid address format", or its client's "Module: http does not
    exist" for an endpoint's URL)."""
    if address.startswith(("http://", "https://")):
        raise ValueError(f"{address} is a web address, not a Ray cluster's: an interlace endpoint is reached with "
                         "interlace.connect(url, token=...); a Ray address is 'auto', 'host:port' or 'ray://host:port'")
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if address not in ("local", "auto") and "://" not in address and not (host and port.isdigit()):
        raise ValueError(f"{address!r} is not a Ray address: give 'auto' (the cluster this node is part of), "
                         "'host:port' (its head's GCS, which `ray status` prints there), 'ray://host:port' (Ray "
                         "client), or none to start a local Ray")
    if "://" in target or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_ANSWER_S).close()
    except OSError as exc:
        raise ConnectionError(f"no Ray cluster answers at {address} ({exc}); check the address (`ray status` on the "
                              "head node prints it) or start one there with `ray start --head`") from None
