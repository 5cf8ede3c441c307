"""The vLLM push's version file: what stages.engines.vllm_update writes, the server's reader
(tools/vllm-cpu/baton_vllm/version_file.py, importable without vllm) returns whole, or refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from stages.engines.vllm_update import write_version_file

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools" / "vllm-cpu"))
from baton_vllm.version_file import VersionFileError, data_offset, read_version  # noqa: E402


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g).bfloat16(),
            "c.count": torch.arange(4, dtype=torch.int64)}


def test_a_written_version_reads_back_exactly(tmp_path):
    tensors = _tensors()
    path = write_version_file(tmp_path / "v.bin", 3, tensors, bucket_bytes=64)  # several buckets
    back = read_version(path, 3)
    assert list(back) == list(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)


@pytest.mark.parametrize("damage", ["flip", "truncate", "version"])
def test_a_damaged_partial_or_mislabelled_version_is_refused(tmp_path, damage):
    path = write_version_file(tmp_path / "v.bin", 3, _tensors(), bucket_bytes=64)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-40] ^= 0x10  # a byte of the last tensor's data
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(bytes(raw[: len(raw) - 8]))
    with pytest.raises(VersionFileError, match={"flip": "checksum", "truncate": "partial",
                                                 "version": "not 4"}[damage]):
        read_version(path, 4 if damage == "version" else 3)


def test_a_file_that_is_no_version_is_refused(tmp_path):
    path = tmp_path / "junk.bin"
    path.write_bytes(b"\0" * (data_offset(0) + 8))
    with pytest.raises(VersionFileError, match="magic"):
        read_version(path, 0)
