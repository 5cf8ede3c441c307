"""CPU-ONLY stand-in for `sgl_kernel`, for SGLang 0.5.23 on CPUs without AMX (tests, CI, laptops).

PyPI has no CPU build of sgl_kernel. On a CPU without AMX, SGLang's `torch_native` path calls
none of its kernels except `assign_req_to_token_pool_cpu`, which is written here in plain torch.
Any other name imports fine and raises NotImplementedError if it is ever called, so a code path
that needs a real kernel fails loudly instead of computing something wrong. Never install this
next to a real sgl_kernel; GPU machines use the real package.
"""

import torch

__version__ = "0.0.0+baton.cpu.shim"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Write each request's new KV-cache slots into its row of the request-to-token table."""
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(f"baton's CPU sgl_kernel shim has no {name}; this path needs a real sgl_kernel")

    return _missing


_ = torch  # imported so that a broken torch install fails here, at import, not mid-request
