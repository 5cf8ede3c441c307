"""Token-in token-out: an episode's record keeps the engine's ids exactly (also where decoding and
re-encoding them would give other ids), and its loss mask, logprobs and versions stay aligned with
the ids over several turns, through the codec."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from buffers.codec import RolloutBatch, decode, encode
from stages.environments.render import ChatRenderer
from stages.environments.tokens import EpisodeTokens
from tools.make_math_example import make_tokenizer


@dataclass
class Completion:  # the fields of stages.engines.base.Completion that the record reads
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray


def completion(ids: list[int], version: int | list[int], first_logprob: float = -0.5) -> Completion:
    versions = np.full(len(ids), version, np.int32) if isinstance(version, int) else np.array(version, np.int32)
    return Completion(np.array(ids, np.int32), first_logprob - np.arange(len(ids), dtype=np.float32), versions)


@pytest.fixture(scope="session")
def bpe():
    return make_tokenizer()


@pytest.fixture(scope="session")
def chat(bpe):
    return ChatRenderer(bpe, (bpe.convert_tokens_to_ids("<|im_end|>"),))


def non_canonical_ids(bpe, text: str) -> list[int]:
    """`text` as one id per byte-level character: ids an engine may sample, not the tokenizer's own."""
    pieces = bpe.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)  # [(byte-level text, span), ...]
    return [bpe.convert_tokens_to_ids(char) for piece, _ in pieces for char in piece]


def test_the_record_keeps_the_engines_ids_where_reencoding_would_change_them(bpe, chat):
    sampled = non_canonical_ids(bpe, " apples") + [chat.stop_ids[0]]
    text = bpe.decode(sampled, skip_special_tokens=True)
    reencoded = list(bpe.encode(text, add_special_tokens=False)) + [chat.stop_ids[0]]
    assert text == " apples" and reencoded != sampled and len(reencoded) < len(sampled)

    prompt = chat.prompt_ids([{"role": "user", "content": "How many apples?"}])
    episode = EpisodeTokens(prompt)
    episode.add_model(completion(sampled, 3))
    reply = chat.reply_ids([{"role": "user", "content": "Count again."}], after_stop=True)
    episode.add_env(reply)
    assert episode.ids() == prompt + sampled + reply
    row = episode.row()
    assert row["tokens"].tolist() == prompt + sampled + reply
    assert row["tokens"][row["loss_mask"] == 1].tolist() == sampled


def test_mask_logprobs_and_versions_stay_aligned_over_three_turns(bpe, chat):
    prompt = chat.prompt_ids([{"role": "user", "content": "Ann has 3 apples."}])
    turns = [completion(bpe.encode("4", add_special_tokens=False) + [chat.stop_ids[0]], 5, -0.1),
             completion(bpe.encode("Ann has 7", add_special_tokens=False), [5, 6, 6, 7], -0.2),  # cut by length
             completion(bpe.encode("7", add_special_tokens=False) + [chat.stop_ids[0]], 8, -0.3)]
    replies = [chat.reply_ids([{"role": "user", "content": "No."}], after_stop=True),
               chat.reply_ids([{"role": "user", "content": "Finish."}], after_stop=False)]
    episode = EpisodeTokens(prompt)
    expected_ids, expected_mask, expected_lp, expected_ver = list(prompt), [0] * len(prompt), [0.0] * len(prompt), \
        [-1] * len(prompt)
    for i, turn in enumerate(turns):
        episode.add_model(turn)
        expected_ids += turn.tokens.tolist()
        expected_mask += [1] * len(turn.tokens)
        expected_lp += turn.logprobs.tolist()
        expected_ver += turn.versions.tolist()
        if i < len(replies):
            assert episode.ids() == expected_ids  # what the engine continues from
            episode.add_env(replies[i])
            expected_ids += replies[i]
            expected_mask += [0] * len(replies[i])
            expected_lp += [0.0] * len(replies[i])
            expected_ver += [-1] * len(replies[i])
    assert replies[1][0] == chat.stop_ids[0]  # the turn cut by length is closed by the reply
    row = episode.row()
    assert {k: v.dtype for k, v in row.items()} == {"tokens": np.int32, "logprobs": np.float32,
                                                    "loss_mask": np.uint8, "token_versions": np.int32}
    assert row["tokens"].tolist() == expected_ids and len(episode) == len(expected_ids)
    assert row["loss_mask"].tolist() == expected_mask
    np.testing.assert_array_equal(row["logprobs"], np.array(expected_lp, np.float32))
    assert row["token_versions"].tolist() == expected_ver
    assert episode.turns == 3 and episode.model_tokens == sum(len(t.tokens) for t in turns)
    assert episode.prompt_len == len(prompt)
    assert episode.version_span() == (5, 8)

    batch = decode(encode(RolloutBatch.from_rows([row, EpisodeTokens(prompt).row()])))
    for name, column in row.items():
        np.testing.assert_array_equal(batch.row(0)[name], column)
    assert batch.row(1)["loss_mask"].sum() == 0


def test_version_span_covers_model_tokens_only():
    episode = EpisodeTokens([1, 2, 3])
    assert episode.version_span() is None and episode.turns == 0
    episode.add_env([4, 5])
    assert episode.version_span() is None
    episode.add_model(completion([6], 2))
    episode.add_model(completion([], 0))  # an empty turn counts as a turn, adds no version
    assert episode.version_span() == (2, 2) and episode.turns == 2 and episode.model_tokens == 1


def test_a_model_turn_needs_one_logprob_and_one_version_per_token():
    episode = EpisodeTokens([1])
    with pytest.raises(ValueError, match="one logprob and one version per token"):
        episode.add_model(Completion(np.array([1, 2], np.int32), np.zeros(1, np.float32), np.zeros(2, np.int32)))
    with pytest.raises(ValueError, match="must be >= 0"):
        episode.add_model(completion([7], -1))
    assert episode.ids() == [1] and episode.turns == 0
