"""A tiny HF-format causal LM and a character tokenizer, made locally with random weights.

Nothing is downloaded: `make_tiny_model` writes a transformers Qwen2 checkpoint (config,
safetensors weights) and a fast tokenizer into one folder, so the learner, the torch engine and
SGLang all load the very same files. The folder is created once and reused; `load_model` and
`load_tokenizer` refuse a folder that is missing or incomplete with a message saying how to make it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ALPHABET = list("0123456789+-=>?:, ") + [chr(c) for c in range(ord("a"), ord("z") + 1)]
MARKER = "baton_tiny_model.json"


def _quiet_transformers() -> None:
    """Progress bars and advice from transformers would bury the run's own progress line."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


class ModelFolderError(FileNotFoundError):
    """The model folder is missing or incomplete."""


def _build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ALPHABET)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}{% endif %}"
    )
    return hf


def make_tiny_model(
    folder: str | Path,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Create (or reuse) a random-init Qwen2 checkpoint + tokenizer in `folder`; return its path.

    Reuse is keyed on the architecture arguments: a folder made with other arguments is an error
    unless `overwrite` is set, so two runs never silently train different models under one name.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _quiet_transformers()
    folder = Path(folder)
    spec = {"hidden_size": hidden_size, "layers": layers, "heads": heads, "kv_heads": kv_heads, "seed": seed}
    marker = folder / MARKER
    if marker.exists() and not overwrite:
        found = json.loads(marker.read_text())
        if found != spec:
            raise ModelFolderError(
                f"{folder} holds a tiny model made with {found}, not {spec}; "
                "pass overwrite=True or choose another folder"
            )
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    tokenizer.save_pretrained(folder)
    vocab_size = 64  # >= len(tokenizer); a multiple of 8 keeps every backend's kernels happy
    assert len(tokenizer) <= vocab_size
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        Qwen2ForCausalLM(config).save_pretrained(folder)
    marker.write_text(json.dumps(spec))
    return folder


def _check_folder(folder: str | Path) -> Path:
    folder = Path(folder)
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (folder / f).exists()]
    if missing:
        raise ModelFolderError(
            f"model folder {str(folder)!r} lacks {', '.join(missing)}; create it with "
            "stages.model.make_tiny_model(folder) or point model.path at an HF checkpoint"
        )
    return folder


def load_model(folder: str | Path) -> torch.nn.Module:
    """Load the causal LM in float32 on CPU, in train mode."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(_check_folder(folder), dtype=torch.float32)
    model.train()
    return model


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_check_folder(folder))
