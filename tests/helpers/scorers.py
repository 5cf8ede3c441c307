"""Tiny models for the scorer tests: a random-init reward model on the tiny tokenizer, and the sequences a
multi-turn episode leaves (prompt, model turns, environment replies) as codec rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from stages.data.model import tiny_tokenizer
from stages.environments.tokens import EpisodeTokens


def make_tiny_classifier(folder: Path, seed: int = 0, num_labels: int = 1) -> Path:
    """A random-init Qwen2ForSequenceClassification (the tiny model's shape) with the tiny tokenizer."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    if (folder / "config.json").exists():
        return folder
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(folder)
    config = Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True, num_labels=num_labels,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        Qwen2ForSequenceClassification(config).save_pretrained(folder)
    return folder


class Turn:
    """A model turn as an engine reports it (tokens, behaviour logprobs, versions)."""

    def __init__(self, tokens: list[int], version: int = 0) -> None:
        self.tokens = np.asarray(tokens, np.int32)
        self.logprobs = np.linspace(-0.5, -2.0, len(tokens)).astype(np.float32)
        self.versions = np.full(len(tokens), version, np.int32)


def multi_turn_row(prompt: list[int], turns: list[list[int]], replies: list[list[int]]) -> dict[str, np.ndarray]:
    """The codec row of an episode: `prompt`, then each model turn followed by its environment reply."""
    tokens = EpisodeTokens(prompt)
    for i, turn in enumerate(turns):
        tokens.add_model(Turn(turn))
        if i < len(replies):
            tokens.add_env(replies[i])
    return tokens.row()


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """The model's own forward over `ids` alone: the logprob of each token after the first."""
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).numpy()


def make_reverse_teacher(folder: Path, digits: int = 2, steps: int = 100, seed: int = 1) -> Path:
    """A teacher made to answer reverse-`digits` (`12>` -> `21`): the tiny model (seed `seed`) fitted
    supervised on every prompt of the task, saved with the tiny tokenizer (the student's)."""
    from stages.data.model import load_model, load_tokenizer, make_tiny_model, prompt_token_ids

    make_tiny_model(folder, seed=seed)
    tokenizer, model = load_tokenizer(folder), load_model(folder)
    prompts = [f"{n:0{digits}d}" for n in range(10**digits)]
    rows = [prompt_token_ids(tokenizer, f"{p}>") + list(tokenizer.encode(p[::-1], add_special_tokens=False))
            for p in prompts]
    ids = torch.tensor(rows)
    targets = ids[:, 1:].clone()
    targets[:, : -digits] = -100  # the answer's tokens alone
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        for _ in range(steps):
            logits = model(ids).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.save_pretrained(folder)
    return folder
