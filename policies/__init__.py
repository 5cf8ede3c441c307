"""Decisions from versions and counts: pure functions, no I/O."""

from policies.staleness import MaxStaleness, OnStale, Verdict, staleness, sync

__all__ = ["MaxStaleness", "OnStale", "Verdict", "staleness", "sync"]
