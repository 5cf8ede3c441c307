"""Checks every ObjectStore must pass, shared by the tests of each backend."""

from __future__ import annotations

import numpy as np
import pytest

from buffers.codec import RolloutBatch, decode, encode, encode_parts, peek
from buffers.store import ObjectStore, StoreError, StoreFull
from pipeline.refs import make_key, older_than_pattern

SURVIVORS = ["other/v00000003/g3/0", "run/v00000101/g101/0", "run/v00000101/g101/1"]  # 2 bytes each


async def check_remove_matching_by_version(store: ObjectStore) -> None:
    """Removing by version range counts exactly what it removed, touches no other run, and is
    idempotent; afterwards the store holds exactly SURVIVORS."""
    for version in (0, 1, 9, 10, 11, 99, 100, 101):
        for sample in ("0", "1"):
            await store.put(make_key("run", version, f"g{version}", sample), b"ab")
    await store.put(make_key("other", 3, "g3", "0"), b"ab")
    assert await store.remove_matching(older_than_pattern("run", 10)) == 6
    assert await store.remove_matching(older_than_pattern("run", 10)) == 0
    assert await store.remove_matching(older_than_pattern("run", 0)) == 0
    assert await store.remove_matching(older_than_pattern("run", 101)) == 8


async def check_encoded_batch_round_trip(store: ObjectStore) -> int:
    """An encoded rollout batch comes back from the store decoded unchanged, and the same batch put as parts
    (`Gathered`) comes back as the same bytes; returns its encoded size."""
    batch = RolloutBatch.from_rows(
        [{"tokens": np.arange(5, dtype=np.int32)}, {"tokens": np.arange(2, dtype=np.int32)}],
        row_fields={"rewards": np.array([1.0, -1.0], np.float32)},
        meta={"group": "g00000001"},
    )
    payload = encode(batch)
    await store.put("run/v00000001/g00000001/0", payload)
    decoded = decode(await store.get("run/v00000001/g00000001/0", size_hint=len(payload)))
    assert decoded.token_fields["tokens"].tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert decoded.row_fields["rewards"].tolist() == [1.0, -1.0]
    assert decoded.meta == {"group": "g00000001"}
    parts, header = encode_parts(batch)  # as the producer puts it: the batch's arrays as parts
    await store.put("run/v00000001/g00000001/1", parts)
    got = await store.get("run/v00000001/g00000001/1", size_hint=parts.nbytes)
    assert bytes(got) == bytes(payload) and header.checksum == peek(got).checksum, "a gathered put stores the join"
    return len(payload)


async def check_capacity_refuses_and_changes_nothing(store: ObjectStore, held) -> None:
    """`store` is bounded to 100 bytes: a put that does not fit raises StoreFull naming the key, its
    size and the fill, and changes nothing; then it holds 100 bytes, under "a" and "b". `held()`
    awaits (the bytes, the keys) the store holds."""
    await store.put("a", b"x" * 70)
    with pytest.raises(StoreFull, match=r"'b' \(40 bytes\).*70 of 100") as err:
        await store.put("b", b"x" * 40)
    assert isinstance(err.value, StoreError)
    with pytest.raises(StoreFull):
        await store.put("a", b"x" * 101)
    assert (await held(), bytes(await store.get("a"))) == ((70, ["a"]), b"x" * 70)
    await store.put("b", b"x" * 30)
    assert (await held())[0] == 100
