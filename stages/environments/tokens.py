"""`EpisodeTokens`: the token-in token-out record of one episode.

An episode's ids are only ever appended: the prompt's ids, each model turn exactly as the engine
emitted it (`add_model`: its ids, behaviour logprobs and per-token weight versions), each
environment reply tokenized alone (`add_env`, see `stages.environments.render`). Nothing is decoded
and re-encoded, so the ids trained are the ids the engine sampled.

Invariants, for every position: `loss_mask` is 1 exactly on model tokens; prompt and environment
tokens have logprob 0 and version -1; the columns of `row()` have one length. The record's
staleness is that of its oldest model token (`version_span`).

An MoE engine's model turns carry each token's routed experts ([tokens, moe layers, top_k],
`Completion.routed_experts`); `row()` then adds them as the column `routed_experts` (zeros where
`loss_mask` is 0: prompt and environment tokens carry none), and only then: a dense episode's row has
exactly the four columns. Within an episode every non-empty model turn carries experts, or none does.
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
    # and, when it has them, `routed_experts` [tokens, moe layers, top_k] (None or absent: a dense model)


class EpisodeTokens:
    """One episode's ids with their logprobs, loss mask and versions, built by appending."""

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.prompt_len = len(prompt_ids)
        self._ids: list[int] = [int(t) for t in prompt_ids]
        self._logprobs: list[np.ndarray] = [np.zeros(self.prompt_len, np.float32)]
        self._mask: list[np.ndarray] = [np.zeros(self.prompt_len, np.uint8)]
        self._versions: list[np.ndarray] = [np.full(self.prompt_len, NO_VERSION, np.int32)]
        # each part's routed experts: an array for a model turn that has them, else its token count (zeros)
        self._experts: list[np.ndarray | int] = [self.prompt_len]
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
        self._append(tokens.tolist(), logprobs, np.ones(len(tokens), np.uint8), versions,
                     self._checked_experts(completion, len(tokens)))
        self.model_tokens += len(tokens)
        self.turns += 1

    def add_env(self, ids: Sequence[int]) -> None:
        """Append an environment reply's ids (loss_mask 0, logprob 0, version -1)."""
        n = len(ids)
        self._append([int(t) for t in ids], np.zeros(n, np.float32), np.zeros(n, np.uint8),
                     np.full(n, NO_VERSION, np.int32), n)

    def _checked_experts(self, completion: Generated, n: int) -> np.ndarray | int:
        """A model turn's routed experts (or its token count when it has none), checked against its tokens
        and the episode's other turns."""
        experts = getattr(completion, "routed_experts", None)
        had = [e for e in self._experts if isinstance(e, np.ndarray) and len(e)]
        if experts is None:
            if n and had:
                raise ValueError("a model turn without routed experts in an episode whose other turns have them")
            return n
        experts = np.asarray(experts)
        if experts.ndim != 3 or len(experts) != n:
            raise ValueError(f"a model turn needs [tokens, moe layers, top_k] routed experts: {n} tokens, "
                             f"experts of shape {experts.shape}")
        if had and (had[0].shape[1:] != experts.shape[1:] or had[0].dtype != experts.dtype):
            raise ValueError(f"routed experts of shape {experts.shape[1:]} {experts.dtype} after "
                             f"{had[0].shape[1:]} {had[0].dtype} in one episode")
        if n and not had and self.model_tokens:
            raise ValueError("a model turn with routed experts in an episode whose other turns have none")
        return experts

    def _append(self, ids: list[int], logprobs: np.ndarray, mask: np.ndarray, versions: np.ndarray,
                experts: np.ndarray | int) -> None:
        self._ids += ids
        self._logprobs.append(logprobs)
        self._mask.append(mask)
        self._versions.append(versions)
        self._experts.append(experts)

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

    ROW_BYTES_PER_TOKEN: ClassVar[int] = 13  # what `row` stores per token: 4 + 4 + 1 + 4 (a dense model's)

    def row(self) -> dict[str, np.ndarray]:
        """The codec row (`buffers.codec.RolloutBatch.from_rows`): tokens int32, logprobs float32,
        loss_mask uint8, token_versions int32, one entry per id; and `routed_experts` [ids, moe layers,
        top_k] when a model turn carried experts (see the module docstring)."""
        row = {
            "tokens": np.asarray(self._ids, dtype=np.int32),
            "logprobs": np.concatenate(self._logprobs),
            "loss_mask": np.concatenate(self._mask),
            "token_versions": np.concatenate(self._versions),
        }
        recorded = next((e for e in self._experts if isinstance(e, np.ndarray)), None)
        if recorded is not None:
            from stages.data.routing import ROUTED_EXPERTS_FIELD  # here: a dense producer never imports torch

            row[ROUTED_EXPERTS_FIELD] = np.concatenate(
                [e if isinstance(e, np.ndarray) else np.zeros((e, *recorded.shape[1:]), recorded.dtype)
                 for e in self._experts])
        return row
