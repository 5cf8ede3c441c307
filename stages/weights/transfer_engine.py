"""A Mooncake TransferEngine for this process, and the address its peers reach it at (every
`mooncake_p2p` party: the learner's ranks and the engines' receivers)."""

from __future__ import annotations

import os
from typing import Any

from stages.weights.base import WeightPushError


def transfer_engine(protocol: str, device: str) -> Any:
    from buffers.mooncake_master import require_mooncake

    require_mooncake()  # names the package or system library to install
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(advertised_host(), "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise WeightPushError(
            f"TransferEngine.initialize({advertised_host()}, P2PHANDSHAKE, {protocol!r}, {device!r}) returned {rc}"
        )
    return engine


def advertised_host() -> str:
    """The address peers use to reach this process's TransferEngine: 127.0.0.1 unless `BATON_HOST`
    names this node's address (multi-node runs)."""
    return os.environ.get("BATON_HOST", "127.0.0.1")
