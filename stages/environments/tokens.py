"""`EpisodeTokens`: the token-in token-out record of one episode.

An episode's ids are only ever appended: the prompt's ids, each model turn exactly as the engine
emitted it (`add_model`: its ids, behaviour logprobs and per-token weight versions), each
environment reply tokenized alone (`add_env`, see `stages.environments.render`). Nothing is decoded
and re-encoded, so the ids trained are the ids the engine sampled.

Invariants, for every position: `loss_mask` is 1 exactly on model tokens; prompt and environment
tokens have logprob 0 and version -1; the four columns of `row()` have one length. The record's
staleness is that of its oldest model token (`version_span`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

import numpy as np

NO_VERSION = -1  # the version of a token no model generated (prompt, environment reply)


class Generated(Protocol):
    """What `add_model` takes: the engine's completion (`stages.engines.base.Completion`)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray


class EpisodeTokens:
    """One episode's ids with their logprobs, loss mask and versions, built by appending."""

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.prompt_len = len(prompt_ids)
        self._ids: list[int] = [int(t) for t in prompt_ids]
        self._logprobs: list[np.ndarray] = [np.zeros(self.prompt_len, np.float32)]
        self._mask: list[np.ndarray] = [np.zeros(self.prompt_len, np.uint8)]
        self._versions: list[np.ndarray] = [np.full(self.prompt_len, NO_VERSION, np.int32)]
        self.model_tokens = 0  # how many ids the model generated (loss_mask 1)
        self.turns = 0  # how many model turns were added

    def add_model(self, completion: Generated) -> None:
        """Append one model turn as the engine emitted it (loss_mask 1); an empty turn still counts."""
        tokens = np.asarray(completion.tokens, dtype=np.int32)
        logprobs = np.asarray(completion.logprobs, dtype=np.float32)
        versions = np.asarray(completion.versions, dtype=np.int32)
        if not tokens.ndim == logprobs.ndim == versions.ndim == 1 or not len(tokens) == len(logprobs) == len(versions):
            raise ValueError(f"a model turn needs one logprob and one version per token: {len(tokens)} tokens, "
                             f"{len(logprobs)} logprobs, {len(versions)} versions")
        if len(versions) and int(versions.min()) < 0:
            raise ValueError(f"a model token's weight version must be >= 0, got {int(versions.min())}")
        self._append(tokens.tolist(), logprobs, np.ones(len(tokens), np.uint8), versions)
        self.model_tokens += len(tokens)
        self.turns += 1

    def add_env(self, ids: Sequence[int]) -> None:
        """Append an environment reply's ids (loss_mask 0, logprob 0, version -1)."""
        n = len(ids)
        self._append([int(t) for t in ids], np.zeros(n, np.float32), np.zeros(n, np.uint8),
                     np.full(n, NO_VERSION, np.int32))

    def _append(self, ids: list[int], logprobs: np.ndarray, mask: np.ndarray, versions: np.ndarray) -> None:
        self._ids += ids
        self._logprobs.append(logprobs)
        self._mask.append(mask)
        self._versions.append(versions)

    def ids(self) -> list[int]:
        """Every id so far: what the engine continues from on the next model turn."""
        return list(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def version_span(self) -> tuple[int, int] | None:
        """(oldest, newest) weight version of the model's tokens; None before any model token."""
        if not self.model_tokens:
            return None
        versions = np.concatenate(self._versions)[np.concatenate(self._mask).astype(bool)]
        return int(versions.min()), int(versions.max())

    ROW_BYTES_PER_TOKEN: ClassVar[int] = 13  # what `row` stores per token: 4 + 4 + 1 + 4

    def row(self) -> dict[str, np.ndarray]:
        """The codec row (`buffers.codec.RolloutBatch.from_rows`): tokens int32, logprobs float32,
        loss_mask uint8, token_versions int32, one entry per id."""
        return {
            "tokens": np.asarray(self._ids, dtype=np.int32),
            "logprobs": np.concatenate(self._logprobs),
            "loss_mask": np.concatenate(self._mask),
            "token_versions": np.concatenate(self._versions),
        }
