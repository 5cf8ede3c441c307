"""What an exported model folder is checked against: the checkpoint's weights, and the torch engine's greedy
completions when that engine holds them."""

from __future__ import annotations

from pathlib import Path

import anyio
import torch

from stages.data.model import load_model, load_tokenizer, prompt_token_ids, stop_token_ids
from stages.engines.base import SamplingParams
from stages.engines.torch import TorchEngine
from stages.learner.state import read_model_weights
from tests.helpers.engines import GREEDY

PROMPTS = ("12>", "345>", "907>", "5>")
NEW_TOKENS = 12


def checkpoint_weights(checkpoint: Path, model_path: Path) -> dict[str, torch.Tensor]:
    """The float32 weights a checkpoint folder holds (its learner state, loaded into the run's model)."""
    model = load_model(model_path)
    read_model_weights(checkpoint / "consumer", model)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def exported_weights(out: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def engine_greedy(model_path: Path, weights: dict[str, torch.Tensor], version: int) -> list[list[int]]:
    """The TorchEngine's greedy completions of PROMPTS (tokenized as the rollout does) once it holds `weights`."""
    tokenizer = load_tokenizer(model_path)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=GREEDY, stop_token_ids=stop_token_ids(tokenizer))

    async def main() -> list[list[int]]:
        engine = TorchEngine(model_path, name="reference", seed=0)
        await engine.start()
        try:
            await engine.receive_weights(version, {name: t.clone() for name, t in weights.items()})
            assert engine.version == version
            prompts = [prompt_token_ids(tokenizer, text) for text in PROMPTS]
            return [c.tokens.tolist() for c in await engine.generate(prompts, params)]
        finally:
            await engine.stop()

    return anyio.run(main)


def transformers_greedy(out: Path) -> tuple[list[list[int]], list[list[int]]]:
    """transformers' own greedy completions of PROMPTS from the folder alone (its tokenizer, its generation
    config), one prompt at a time; and the prompts' token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    prompts, completions = [], []
    for text in PROMPTS:
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS,
                                       pad_token_id=tokenizer.pad_token_id)
        prompts.append(ids[0].tolist())
        completions.append(generated[0, ids.shape[1]:].tolist())
    return prompts, completions


def rollout_prompts(model_path: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(model_path)
    return [prompt_token_ids(tokenizer, text) for text in PROMPTS]
