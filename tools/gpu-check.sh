#!/usr/bin/env bash
# The device check, run whenever a session is lent a GPU (tools/gpu_check.py says what it measures):
# baton's TorchEngine and GRPO learner step on CUDA in bf16 on a random-init Qwen2-0.5B-shaped model,
# sparse weight deltas at that size, mooncake registering CUDA memory when it is there, and a Qwen3-MoE
# learner step with routing replay off and on (`--rows moe` runs that row alone).
#
# The device image has torch, transformers and safetensors but not msgspec, structlog, tenacity, peft
# or accelerate: they travel as wheels in .whl/ (ignored by git). Once, here, in the repo's root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl msgspec==0.23.0 structlog==26.1.0 tenacity==9.2.1 peft accelerate
# Mooncake's CUDA wheel (98 MB) is over what a call carries (64 MiB): .whl/mooncake-cuda-slim.tar.gz holds
# its TransferEngine alone (mooncake/engine.so, the libraries it links, an empty __init__.py) and
# syslib/ with libibverbs.so.1, libmlx5.so.1 and libnuma.so.1 from this machine's Debian packages and
# libcudart.so.12 from the nvidia-cuda-runtime-cu12 wheel (the wheel is built for CUDA 12; the device's
# torch is cu130), 15 MB. Then call the device tool with carry [".whl"] and the command `bash tools/gpu-check.sh`.
# Without a GPU, `bash tools/gpu-check.sh --shape tiny --device cpu` runs the same code on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import msgspec, structlog, tenacity, peft" 2> /dev/null && compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -c "import mooncake.engine" 2> /dev/null && [ -f .whl/mooncake-cuda-slim.tar.gz ]; then
    mkdir -p /tmp/mooncake && tar xzf .whl/mooncake-cuda-slim.tar.gz -C /tmp/mooncake
    cudart="$(python3 -c 'import nvidia.cuda_runtime, os; print(os.path.join(nvidia.cuda_runtime.__path__[0], "lib"))' 2> /dev/null || true)"
    export PYTHONPATH=/tmp/mooncake${PYTHONPATH:+:$PYTHONPATH}
    export LD_LIBRARY_PATH=/tmp/mooncake/syslib${cudart:+:$cudart}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
export PYTHONUNBUFFERED=1
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
out="${OUT:-runs/gpu-check}"
mkdir -p "$out"
python3 tools/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/gpu-check.log"
