"""baton's tests, in folders that mirror the packages; shared helpers in tests/helpers, one contract
test per plug-in kind in tests/contracts, whole runs in tests/e2e."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
