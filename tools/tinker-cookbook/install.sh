#!/usr/bin/env bash
# The tinker-cookbook's venv (default: .venv-cookbook), for examples/tinker/cookbook_*.py.
#
#   tools/tinker-cookbook/install.sh [VENV]
#
# tinker-cookbook 0.6.1 needs tml-renderers>=0.4.1, which a registry with only tml-renderers 0.2.1 lacks; 0.5.8
# is the newest that installs, and it pins transformers<=5.5.4 (and with it an older huggingface_hub and
# tokenizers), older than the project's. So it gets a venv of its own that sees the project's packages
# (--system-site-packages: tinker, datasets, torch) but keeps its transformers to itself; the project's Python
# still runs `baton serve` (the examples' --baton-python). The pins are pyproject.toml's `tinker-cookbook` extra.
# Idempotent: a venv that already imports tinker_cookbook 0.5.8 is left as it is.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${1:-$ROOT/.venv-cookbook}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
COOKBOOK_VERSION=0.5.8

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import sys, tinker_cookbook; sys.exit(tinker_cookbook.__version__ != '$COOKBOOK_VERSION')" 2>/dev/null; then
  echo "tinker-cookbook $COOKBOOK_VERSION already installed in $VENV"
else
  "$PY" -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "tinker-cookbook==$COOKBOOK_VERSION" "tinker>=0.38,<0.39"
fi
