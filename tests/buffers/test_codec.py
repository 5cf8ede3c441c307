"""Property tests for the rollout-batch codec: exact round trips, zero copy, and loud failures."""

from __future__ import annotations

import gc
import pickle
import struct
import warnings

import msgspec
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from buffers import codec
from buffers.codec import (
    ALLOWED_DTYPES,
    MAGIC,
    CodecError,
    CorruptPayload,
    ForeignPayload,
    RolloutBatch,
    TruncatedPayload,
    decode,
    encode,
    peek,
    to_torch,
)

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8).filter(
    lambda s: s != "offsets"
)
META_VALUES = st.one_of(
    st.text(max_size=12),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.booleans(),
)


@st.composite
def batches(draw: st.DrawFn, max_rows: int = 6, max_row_len: int = 5) -> RolloutBatch:
    lengths = draw(st.lists(st.integers(0, max_row_len), max_size=max_rows))
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    rows, tokens = len(lengths), int(offsets[-1])
    names = draw(st.lists(NAMES, max_size=5, unique=True))
    n_token = draw(st.integers(0, len(names)))
    token_fields = {}
    for name in names[:n_token]:  # one entry per token: 1-D, or typed-ragged with trailing dims
        shape = draw(st.sampled_from([(tokens,), (tokens, draw(st.integers(0, 3)), draw(st.integers(1, 2)))]))
        token_fields[name] = draw(hnp.arrays(draw(st.sampled_from(ALLOWED_DTYPES)), shape))
    row_fields = {}
    for name in names[n_token:]:
        shape = draw(st.sampled_from([(rows,), (rows, draw(st.integers(0, 3)))]))
        row_fields[name] = draw(hnp.arrays(draw(st.sampled_from(ALLOWED_DTYPES)), shape))
    meta = draw(st.dictionaries(st.text(max_size=8), META_VALUES, max_size=4))
    return RolloutBatch(offsets, token_fields, row_fields, meta)


def assert_same_array(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype.newbyteorder("<")
    assert got.shape == want.shape
    assert got.tobytes() == want.astype(got.dtype).tobytes()


def assert_same_batch(got: RolloutBatch, want: RolloutBatch) -> None:
    assert_same_array(got.offsets, want.offsets)
    for mine, theirs in ((got.token_fields, want.token_fields), (got.row_fields, want.row_fields)):
        assert list(mine) == list(theirs)
        for name in theirs:
            assert_same_array(mine[name], theirs[name])
    assert got.meta == want.meta
    assert [type(v) for v in got.meta.values()] == [type(v) for v in want.meta.values()]


def body_start(payload: memoryview) -> int:
    return len(payload) - peek(payload).body_nbytes


@given(batches())
def test_round_trip_is_exact(batch: RolloutBatch) -> None:
    payload = encode(batch)
    for buf in (payload, bytes(payload), bytearray(payload)):
        assert_same_batch(decode(buf), batch)
    header = peek(payload)
    assert (header.rows, header.tokens, header.meta) == (batch.rows, batch.tokens, batch.meta)
    assert header.checksum == xxhash.xxh3_64_intdigest(payload[body_start(payload) :])


@given(batches())
def test_parts_are_the_payload_byte_for_byte(batch: RolloutBatch) -> None:
    """encode_parts gives encode's bytes, with the batch's contiguous arrays as parts (not copies)."""
    gathered, header = codec.encode_parts(batch)
    assert bytes(gathered.join()) == bytes(encode(batch))
    assert header == peek(encode(batch))
    assert gathered.nbytes == len(encode(batch))
    for arr in (*batch.token_fields.values(), *batch.row_fields.values()):
        if arr.size and arr.flags.c_contiguous and arr.dtype.byteorder in "<=|":
            assert any(np.shares_memory(part, arr) for part in gathered.parts), "an array was copied"


@given(batches())
def test_decode_is_zero_copy_and_read_only(batch: RolloutBatch) -> None:
    buf = bytearray(encode(batch))
    whole = np.frombuffer(buf, dtype=np.uint8)
    decoded = decode(buf)
    arrays = [decoded.offsets, *decoded.token_fields.values(), *decoded.row_fields.values()]
    for arr in arrays:
        assert not arr.flags.writeable
        if arr.size:
            assert np.shares_memory(arr, whole)
    for i in range(decoded.rows):
        for name, view in decoded.row(i).items():
            if view.size:
                assert np.shares_memory(view, whole), name


@given(batches())
def test_encode_is_deterministic_and_aligned(batch: RolloutBatch) -> None:
    payload = encode(batch)
    assert bytes(payload) == bytes(encode(batch))
    start = body_start(payload)
    assert start % 64 == 0
    assert all(d.offset % 64 == 0 for d in peek(payload).fields)


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(batches(max_rows=4, max_row_len=3))
def test_every_truncation_raises(batch: RolloutBatch) -> None:
    payload = bytes(encode(batch))
    for n in range(len(payload)):
        with pytest.raises(TruncatedPayload):
            decode(payload[:n])
    for n in range(len(payload)):
        with pytest.raises(TruncatedPayload):
            peek(payload[:n])


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(batches(max_rows=4, max_row_len=3), st.integers(1, 255))
def test_every_body_byte_flip_raises_corrupt(batch: RolloutBatch, mask: int) -> None:
    payload = bytearray(encode(batch))
    for i in range(body_start(payload), len(payload)):
        payload[i] ^= mask
        with pytest.raises(CorruptPayload):
            decode(payload)
        payload[i] ^= mask


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(batches(max_rows=4, max_row_len=3), st.integers(1, 255))
def test_every_header_byte_flip_raises(batch: RolloutBatch, mask: int) -> None:
    payload = bytearray(encode(batch))
    for i in range(body_start(payload)):
        payload[i] ^= mask
        for verify in (True, False):
            with pytest.raises(CodecError):
                decode(payload, verify=verify)
        payload[i] ^= mask
    assert_same_batch(decode(payload), batch)


@given(st.binary(max_size=256))
def test_random_bytes_are_rejected(data: bytes) -> None:
    with pytest.raises(CodecError):
        decode(data)


@pytest.mark.parametrize(
    "data",
    [
        pickle.dumps({"tokens": [1, 2, 3]}),
        pickle.dumps(np.arange(10)),
        b"",
        b"BTN",
        b"\x00" * 64,
        b"PK\x03\x04",
    ],
)
def test_foreign_bytes_are_rejected(data: bytes) -> None:
    with pytest.raises(CodecError) as err:
        decode(data)
    assert isinstance(err.value, ForeignPayload if len(data) >= 4 else TruncatedPayload)


def test_unknown_format_version_is_foreign() -> None:
    header = msgspec.msgpack.encode({"format_version": 99, "anything": "new"})
    payload = struct.pack("<4sIQ", MAGIC, len(header), xxhash.xxh3_64_intdigest(header)) + header
    with pytest.raises(ForeignPayload, match="format_version 1, found 99"):
        decode(payload)


def test_trailing_bytes_are_corrupt() -> None:
    payload = bytes(encode(RolloutBatch(np.array([0, 2]), {"t": np.arange(2, dtype=np.int32)})))
    with pytest.raises(CorruptPayload, match="trailing"):
        decode(payload + b"\x00")


@pytest.mark.parametrize(
    "bad", [np.array([object()], dtype=object), np.array(["a"]), np.zeros(1, np.complex64)]
)
def test_disallowed_dtypes_are_rejected(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="'weird'.*not allowed"):
        RolloutBatch(np.array([0, 1]), {"weird": bad})
    with pytest.raises(ValueError, match="'weird'.*not allowed"):
        RolloutBatch(np.array([0, 1]), {}, {"weird": bad})


def test_disallowed_dtype_is_rejected_at_encode() -> None:
    batch = RolloutBatch(np.array([0, 1]), {"t": np.zeros(1, np.int32)})
    object.__setattr__(batch, "token_fields", {"t": np.array([object()], dtype=object)})
    with pytest.raises(CodecError, match="'t'.*object"):
        encode(batch)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"token_fields": {"tokens": np.zeros(4, np.int32)}}, "token field 'tokens'.*shape"),
        ({"token_fields": {"tokens": np.zeros((2, 1), np.int32)}}, "token field 'tokens'.*shape"),
        ({"token_fields": {"experts": np.zeros((4, 2, 2), np.uint8)}}, r"token field 'experts'.*\(3, \.\.\.\)"),
        ({"token_fields": {"experts": np.array(1, np.uint8)}}, "token field 'experts'.*shape"),
        ({"row_fields": {"rewards": np.zeros(3, np.float32)}}, "row field 'rewards'.*shape"),
        ({"row_fields": {"rewards": np.float32(1.0)}}, "row field 'rewards'"),
        ({"row_fields": {"rewards": [1.0, 2.0]}}, "row field 'rewards'.*numpy array"),
        ({"offsets": np.array([1, 3, 3])}, "offsets.*start at 0"),
        ({"offsets": np.array([0, 3, 2])}, "offsets.*non-decreasing"),
        ({"offsets": np.array([0.0, 3.0])}, "offsets"),
        ({"token_fields": {"offsets": np.zeros(3, np.int64)}}, "'offsets' is reserved"),
        ({"meta": {"x": np.int64(1)}}, "meta 'x'"),
        ({"meta": {"x": 2**64}}, "meta 'x'"),
        (
            {"token_fields": {"a": np.zeros(3, np.int32)}, "row_fields": {"a": np.zeros(2, np.int32)}},
            "'a'",
        ),
    ],
)
def test_bad_batches_name_the_field(kwargs: dict, match: str) -> None:
    args = {"offsets": np.array([0, 3, 3]), "token_fields": {}, "row_fields": {}, "meta": {}} | kwargs
    with pytest.raises(ValueError, match=match):
        RolloutBatch(**args)


def test_from_rows_and_row_views() -> None:
    rows = [
        {"tokens": np.array([1, 2, 3], np.int32), "mask": np.array([0, 1, 1], np.uint8)},
        {"tokens": np.array([], np.int32), "mask": np.array([], np.uint8)},
        {"tokens": np.array([7], np.int32), "mask": np.array([1], np.uint8)},
    ]
    batch = RolloutBatch.from_rows(rows, row_fields={"rewards": np.array([0.5, 0.0, 1.0], np.float32)})
    assert batch.rows == 3 and batch.tokens == 4
    assert batch.offsets.tolist() == [0, 3, 3, 4]
    assert batch.nbytes == 4 * 8 + 4 * 4 + 4 * 1 + 3 * 4
    decoded = decode(encode(batch))
    for i, row in enumerate(rows):
        got = decoded.row(i)
        assert got["tokens"].tolist() == row["tokens"].tolist()
        assert got["mask"].tolist() == row["mask"].tolist()
        assert got["rewards"].item() == batch.row_fields["rewards"][i]
    assert decoded.row(-1)["tokens"].tolist() == [7]
    with pytest.raises(IndexError):
        decoded.row(3)
    with pytest.raises(ValueError, match="row 1"):
        RolloutBatch.from_rows([{"t": np.zeros(2)}, {"t": np.zeros(2), "u": np.zeros(2)}])


@pytest.mark.parametrize("n", [6, 300_000])
def test_non_native_and_strided_inputs_encode_little_endian(n: int) -> None:
    big_endian = np.arange(n, dtype=">i4")
    strided = np.arange(2 * n, dtype=np.float64)[::2]
    contiguous = np.arange(n, dtype=np.int32)
    batch = RolloutBatch(np.array([0, n]), {"a": big_endian, "b": strided, "c": contiguous})
    payload = encode(batch)
    assert peek(payload).checksum == xxhash.xxh3_64_intdigest(payload[body_start(payload) :])
    assert bytes(codec.encode_parts(batch)[0].join()) == bytes(payload)
    decoded = decode(payload)
    assert decoded.token_fields["a"].dtype == np.dtype("<i4")
    assert np.array_equal(decoded.token_fields["a"], contiguous)
    assert np.array_equal(decoded.token_fields["b"], strided)
    assert np.array_equal(decoded.token_fields["c"], contiguous)


def test_short_checksum_still_lays_out_correctly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checksum with a shorter msgpack encoding than the placeholder may move the body start."""

    class ConstantHasher:
        def update(self, data: bytes) -> None:
            pass

        def intdigest(self) -> int:
            return 7

    monkeypatch.setattr(codec, "_checksum", lambda data: 7)
    monkeypatch.setattr(codec, "_new_hasher", ConstantHasher)
    moved = 0
    for pad in range(70):
        batch = RolloutBatch(np.array([0, 50]), {"t": np.arange(50, dtype=np.int32)}, meta={"p": "x" * pad})
        payload = encode(batch)
        header = peek(payload)
        assert header.checksum == 7
        assert_same_batch(decode(payload), batch)
        assert body_start(payload) % 64 == 0
        placeholder = msgspec.msgpack.encode(msgspec.structs.replace(header, checksum=2**64 - 1))
        moved += body_start(payload) != codec._align(16 + len(placeholder))
    assert moved > 0


def test_pool_recycles_only_dead_buffers() -> None:
    n = 1 << 19
    first = RolloutBatch(np.array([0, n]), {"t": np.arange(n, dtype=np.int32)})
    second = RolloutBatch(np.array([0, n]), {"t": np.arange(n, dtype=np.int32)[::-1].copy()})
    payload = encode(first)
    decoded = decode(payload)
    del payload
    gc.collect()
    other = encode(second)
    assert not np.shares_memory(np.frombuffer(other, np.uint8), decoded.token_fields["t"])
    assert decoded.token_fields["t"].tolist() == first.token_fields["t"].tolist()
    address = np.frombuffer(other, np.uint8).ctypes.data
    expected = bytes(other)
    del decoded
    gc.collect()
    del other
    gc.collect()
    reused = encode(second)
    assert np.frombuffer(reused, np.uint8).ctypes.data == address
    assert bytes(reused) == expected
    with pytest.raises(TypeError):
        reused[0] = 1  # type: ignore[index]


@pytest.mark.parametrize("dtype", ALLOWED_DTYPES)
def test_to_torch_shares_memory_without_warning(dtype: np.dtype) -> None:
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    batch = RolloutBatch(np.array([0, 3]), {"x": np.array([0, 1, 1]).astype(dtype)})
    arr = decode(bytes(encode(batch))).token_fields["x"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor = to_torch(arr)
        writable = to_torch(np.array([1, 2], np.int32))
    assert tensor.data_ptr() == arr.ctypes.data
    assert tensor.tolist() == arr.tolist()
    assert writable.tolist() == [1, 2]


def _reheadered(payload: memoryview, header: codec.Header) -> bytes:
    """`payload`'s body under another header (preamble, checksum and padding made consistent)."""
    body = bytes(payload[body_start(payload) :])
    header_bytes = msgspec.msgpack.encode(header)
    start = codec._align(16 + len(header_bytes))
    preamble = struct.pack("<4sIQ", MAGIC, len(header_bytes), xxhash.xxh3_64_intdigest(header_bytes))
    return preamble + header_bytes + bytes(start - 16 - len(header_bytes)) + body


def test_per_token_arrays_round_trip_zero_copy() -> None:
    """A typed-ragged token field, [tokens, layers, top_k] uint8 (an MoE token's routed experts), travels
    like a 1-D one: checksummed, decoded as read-only views of the payload, sliced per row."""
    rng = np.random.default_rng(0)
    rows = [{"tokens": np.arange(n, dtype=np.int32), "experts": rng.integers(0, 8, (n, 2, 2), dtype=np.uint8)}
            for n in (3, 0, 5)]
    batch = RolloutBatch.from_rows(rows, row_fields={"rewards": np.zeros(3, np.float32)})
    assert batch.token_fields["experts"].shape == (8, 2, 2)
    buf = bytearray(encode(batch))
    decoded = decode(buf)
    assert_same_batch(decoded, batch)
    experts = decoded.token_fields["experts"]
    assert not experts.flags.writeable and np.shares_memory(experts, np.frombuffer(buf, np.uint8))
    for i, row in enumerate(rows):
        assert np.array_equal(decoded.row(i)["experts"], row["experts"])
    assert [d.shape for d in peek(buf).fields if d.name == "experts"] == [(8, 2, 2)]
    with pytest.raises(ValueError, match="row 1.*one length"):
        RolloutBatch.from_rows([rows[0], {"tokens": np.zeros(2, np.int32), "experts": np.zeros((3, 2, 2), np.uint8)}])


def test_per_token_field_with_a_wrong_leading_dim_is_corrupt() -> None:
    batch = RolloutBatch(np.array([0, 4]), {"experts": np.zeros((4, 2, 2), np.uint8)})
    payload = encode(batch)
    header = peek(payload)
    forged = tuple(msgspec.structs.replace(d, shape=(8, 2, 1)) if d.name == "experts" else d for d in header.fields)
    with pytest.raises(CorruptPayload, match=r"field 'experts': expected shape \(4, \.\.\.\), found \(8, 2, 1\)"):
        decode(_reheadered(payload, msgspec.structs.replace(header, fields=forged)))
    scalar = tuple(msgspec.structs.replace(d, shape=(), nbytes=1) if d.name == "experts" else d for d in header.fields)
    with pytest.raises(CorruptPayload, match="field 'experts'"):
        decode(_reheadered(payload, msgspec.structs.replace(header, fields=scalar)))


def test_one_dimensional_payloads_are_unchanged() -> None:
    """Per-token arrays changed no byte of a batch without them (payloads written before still decode)."""
    rows = [{"tokens": np.array([5, 6, 7], np.int32), "logprobs": np.array([0, -0.5, -0.25], np.float32),
             "loss_mask": np.array([0, 1, 1], np.uint8)},
            {"tokens": np.array([8], np.int32), "logprobs": np.array([-1.0], np.float32),
             "loss_mask": np.array([1], np.uint8)}]
    batch = RolloutBatch.from_rows(rows, row_fields={"rewards": np.array([1.0, 0.0], np.float32)}, meta={"group": "g1"})
    payload = encode(batch)
    assert (len(payload), xxhash.xxh3_64_hexdigest(bytes(payload))) == (712, "83670102adfce002")
    assert_same_batch(decode(payload), batch)
