"""Reference computations for engine tests: a model's own teacher-forced logprobs, a model in eval mode,
and weights that make every next token equally likely."""

from __future__ import annotations

import numpy as np
import torch

from stages.data.model import load_model

GREEDY = 1e-5  # the engine floors temperature here: effectively argmax


def teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], tokens: np.ndarray,
                            temperature: float = 1.0) -> torch.Tensor:
    """Logprob of each completion token under `model`, recomputed on prompt + completion."""
    ids = torch.tensor([prompt + [int(t) for t in tokens]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return logp[pos, torch.as_tensor(tokens, dtype=torch.long)]


def eval_model(folder) -> torch.nn.Module:
    model = load_model(folder)
    model.eval()
    return model


def uniform_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A version whose final norm is zero: logits are all 0, so every token has logprob -log(V)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd["model.norm.weight"].zero_()
    return sd


