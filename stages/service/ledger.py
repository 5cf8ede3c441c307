"""The service's ledger, `state/ledger.jsonl`: each datum trained and each sample drawn, by version, one
msgspec-JSON record a line, appended as each call finishes (flushed, not fsync'd: it is an account, not what a
restart comes back from; that is the journal).

* `TrainedRecord`: a `forward_backward` (not a `forward`) of a model, its call `seq`, its loss, how many datums
  and loss tokens, and the version its gradient goes into (`into_version`: the model's step after the next
  `optim_step`). A restart runs the calls after the last commit again, and they are recorded again: the same
  `(model, seq)` twice is one call (`trained_once` keeps the last).
* `SampledRecord`: a sample request, the checkpoint it drew from (`path`; `version`: the model's step when that
  checkpoint was saved, None for the base model), the prompt's length and each sample's generated tokens.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

LEDGER_FILE = "ledger.jsonl"


class TrainedRecord(msgspec.Struct, tag="trained"):
    model: str
    seq: int
    loss_fn: str
    datums: int
    loss_tokens: int  # positions with a nonzero weight or advantage
    into_version: int
    at: float


class SampledRecord(msgspec.Struct, tag="sampled"):
    request_id: str
    path: str
    version: int | None
    prompt_tokens: int
    generated: list[int]  # each sample's generated tokens
    at: float


LedgerRecord = TrainedRecord | SampledRecord
_decoder = msgspec.json.Decoder(LedgerRecord)


class Ledger:
    """Appends to `folder/ledger.jsonl` (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LEDGER_FILE
        torn = path.is_file() and path.stat().st_size > 0 and path.read_bytes()[-1:] != b"\n"
        self._file = open(path, "ab")  # noqa: SIM115  held open for the service's life
        if torn:  # a kill cut the last line short: it stays one bad line, not the start of the next record
            self._file.write(b"\n")
        self._encoder = msgspec.json.Encoder()

    def trained(self, model: str, seq: int, loss_fn: str, datums: int, loss_tokens: int, into_version: int) -> None:
        self._append(TrainedRecord(model, seq, loss_fn, datums, loss_tokens, into_version, time.time()))

    def sampled(self, request_id: str, path: str, version: int | None, prompt_tokens: int,
                generated: list[int]) -> None:
        self._append(SampledRecord(request_id, path, version, prompt_tokens, generated, time.time()))

    def _append(self, record: LedgerRecord) -> None:
        self._file.write(self._encoder.encode(record) + b"\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_ledger(folder: Path) -> list[LedgerRecord]:
    """Every record of `folder/ledger.jsonl` (a line a kill cut short is skipped)."""
    path = folder / LEDGER_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_bytes().splitlines():
        try:
            records.append(_decoder.decode(line))
        except msgspec.DecodeError:
            continue
    return records


def trained_once(records: list[LedgerRecord]) -> dict[tuple[str, int], TrainedRecord]:
    """The trained calls by (model, seq), each once (a call run again after a restart is the same call)."""
    return {(r.model, r.seq): r for r in records if isinstance(r, TrainedRecord)}
