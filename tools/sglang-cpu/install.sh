#!/usr/bin/env bash
# Build a CPU-only SGLang 0.5.23 server environment in its own venv (default: .venv-sglang).
#
#   tools/sglang-cpu/install.sh [VENV]
#
# SGLang's published wheel pins a CUDA torch and CUDA-only kernels, so on CPU we install
# torch 2.13.0 (CPU), then sglang with --no-deps plus requirements.txt (its own list without the
# CUDA entries), torchvision without its CUDA op registrations, and the pure-torch sgl_kernel
# stand-in from sgl_kernel_cpu_shim/. The project itself never imports sglang: it speaks HTTP to
# the server, so this venv's pins never constrain the project's. About 4 minutes and 3.5 GB on a cold
# cache. Idempotent: an existing venv that already imports sglang 0.5.23 keeps its packages; the shims'
# .pth file below is (re)written on every run, so running it again brings an older venv up to date.
#
# The shims (tools/sglang-cpu/sgl_kernel_cpu_shim/, put on the venv's path by one .pth file):
#   sgl_kernel/        a pure-torch stand-in for the CUDA-only kernel package (its docstring says which op).
#   baton_cpu_lora.py  SGLang's LoRA code (`--enable-lora --lora-backend torch_native`, what a LoRA run's
#                      server is launched with: stages/engines/sglang_lora.py) hard-codes pinned host memory
#                      (`torch.tensor(..., pin_memory=True)`, `.pin_memory()` in sglang/srt/lora/layers.py and
#                      its torch backend); torch refuses pinned memory without an accelerator, so the server
#                      dies at start-up. The .pth imports this module at interpreter start; the first time a
#                      process imports `sglang.srt.lora` on a machine without CUDA, it makes those calls
#                      return ordinary memory. Nothing else changes, and nothing at all on a GPU.
#   baton_cpu_moe.py   imported by baton_cpu_lora, MoE servers on CPU: `--enable-return-routed-experts` allocates
#                      its capture buffer with cudaHostRegister (`_cuda_host_register` in
#                      sglang/srt/mem_cache/pool_host/common.py), which kills the scheduler without CUDA: it
#                      becomes a no-op; Qwen2-MoE's shared-expert gate (`fused_gate_sigmoid_mul[_add]`) is a
#                      Triton kernel with no CPU driver: it becomes the same arithmetic in torch. Nothing on a GPU.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${1:-$ROOT/.venv-sglang}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
SGLANG_VERSION=0.5.23

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import sglang, sys; sys.exit(sglang.__version__ != '$SGLANG_VERSION')" 2>/dev/null; then
  echo "sglang $SGLANG_VERSION already installed in $VENV; refreshing the shims"
else
  "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
  "${PIP[@]}" torch==2.13.0
  echo "torch==2.13.0" > "$VENV/torch-pin.txt"
  "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
  "${PIP[@]}" -c "$VENV/torch-pin.txt" -r "$HERE/requirements.txt"
  "${PIP[@]}" --no-deps torchvision==0.28.0
  # PyPI's torchvision is built against CUDA: skip its op registrations (sglang only needs transforms).
  "$VENV/bin/python" - "$VENV" <<'PY'
import glob, sys
path = glob.glob(sys.argv[1] + "/lib/python3*/site-packages/torchvision/__init__.py")[0]
text = open(path).read()
old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
new = ("try:\n    from torchvision import _autograd_registrations, _meta_registrations\nexcept Exception:\n    pass\n"
       "from torchvision import (\n")
if old in text:
    open(path, "w").write(text.replace(old, new))
PY
fi
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# one .pth: its path line puts the shims on sys.path, its import line arms the LoRA pin_memory patch
printf '%s\nimport baton_cpu_lora\n' "$HERE/sgl_kernel_cpu_shim" > "$SITE/baton_sgl_kernel_cpu_shim.pth"
"$VENV/bin/python" -c "import torchvision.transforms, sgl_kernel, baton_cpu_lora, sglang; print('sglang', sglang.__version__, 'ready in', '$VENV')"
