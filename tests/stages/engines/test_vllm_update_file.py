"""The vLLM push's version file: what stages.engines.vllm_update writes, the server's reader
(tools/vllm-cpu/baton_vllm/version_file.py, importable without vllm) returns whole, or refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from stages.engines.vllm_delta import WHOLE_NEEDED, PushedBase, write_delta_file
from stages.engines.vllm_update import write_version_file

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools" / "vllm-cpu"))
from baton_vllm.version_delta import BaseNotHeld  # noqa: E402
from baton_vllm.version_file import VersionFileError, data_offset, read_kept, read_version  # noqa: E402


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


# -- a version as a delta against the one the server kept (stages.engines.vllm_delta, baton_vllm.version_delta)

def _moved(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Two elements of the float tensor moved, the bf16 one whole, the int64 one unchanged."""
    moved = {n: t.clone() for n, t in tensors.items()}
    moved["a.weight"].view(-1)[[2, 11]] += 1.0
    moved["b.bias"] += 0.5
    return moved


def test_a_delta_rebuilds_the_next_version_exactly_and_sends_only_what_moved(tmp_path):
    tensors = _tensors()
    _, held = read_kept(write_version_file(tmp_path / "v3.bin", 3, tensors, bucket_bytes=64), 3, None)
    moved = _moved(tensors)
    path, figures = write_delta_file(tmp_path / "v4.bin", 4, moved, PushedBase.of(3, tensors), bucket_bytes=64)
    back, kept = read_kept(path, 4, held)
    assert all(torch.equal(back[n], moved[n]) for n in moved) and kept.version == 4
    assert figures["changed"] == 2 + 7 and figures["elements"] == 15 + 7 + 4
    assert figures["bytes"] < sum(t.nbytes for t in tensors.values())
    assert all(torch.equal(t, tensors[n]) for n, t in read_version(tmp_path / "v3.bin", 3).items())  # base intact


def test_a_delta_against_a_version_the_server_does_not_keep_asks_for_the_whole_version(tmp_path):
    tensors = _tensors()
    _, held = read_kept(write_version_file(tmp_path / "v2.bin", 2, tensors), 2, None)
    path, _ = write_delta_file(tmp_path / "v4.bin", 4, _moved(tensors), PushedBase.of(3, tensors))
    for kept in (None, held):  # a restarted server keeps nothing; this one missed version 3
        with pytest.raises(BaseNotHeld, match=WHOLE_NEEDED):
            read_kept(path, 4, kept)
    other = {**tensors, "a.weight": torch.zeros(5, 3)}  # another layout is not a delta at all
    assert write_delta_file(tmp_path / "v5.bin", 5, other, PushedBase.of(3, tensors)) is None


def test_a_damaged_delta_is_refused_by_the_checksum_of_its_result_and_the_base_stays(tmp_path):
    tensors = _tensors()
    _, held = read_kept(write_version_file(tmp_path / "v3.bin", 3, tensors), 3, None)
    before = held.data.copy()
    path, _ = write_delta_file(tmp_path / "v4.bin", 4, _moved(tensors), PushedBase.of(3, tensors))
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # a byte of the last patch's values
    path.write_bytes(bytes(raw))
    with pytest.raises(VersionFileError, match="checksum"):
        read_kept(path, 4, held)
    assert (held.data == before).all()
