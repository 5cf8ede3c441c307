"""A tiny HF-format causal LM and a character tokenizer, made locally with random weights.

Nothing is downloaded: `make_tiny_model` writes a transformers Qwen2 checkpoint (config,
safetensors weights) and a fast tokenizer into one folder, so the learner, the torch engine and
SGLang all load the very same files. The folder is created once and reused.

Any local Hugging Face causal-LM folder loads the same way (Qwen2/Qwen3/Llama/Mistral, through the
transformers Auto classes): `check_model_folder` says before a run what is wrong with a folder (not a
model, an architecture that cannot load, no chat template where chat prompts need one);
`load_tokenizer` gives a pad token, `stop_token_ids` the tokenizer's EOS plus generation_config.json's,
and `prompt_token_ids` tokenizes plain text (BOS only where the tokenizer adds one) or chat messages.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
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


class ModelFolderError(FileNotFoundError, ValueError):
    """The model folder is missing, incomplete, or holds something no engine can load (the message says
    what is wrong and what to do; the config layer prefixes the key that named the folder)."""


def tiny_tokenizer():
    """The tiny model's tokenizer (a character vocabulary, ChatML-like specials), made in memory."""
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
    heads: int = 8,
    kv_heads: int = 4,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Create (or reuse) a random-init Qwen2 checkpoint + tokenizer in `folder`; return its path.

    Reuse is keyed on the architecture arguments: a folder made with other arguments is an error
    unless `overwrite` is set, so two runs never silently train different models under one name.
    The model is written into a staging folder beside `folder` and renamed into place, so a process
    never loads a half-written model: of several processes making the same folder at once (two runs,
    parallel test workers), one rename wins and the others reuse its folder.
    8 query heads over 4 key/value heads (head size 8, Qwen's 2:1 grouping) rather than 4 over 2: the
    same parameters, but reverse-4's middle answer position fits supervised in 50 steps instead of 200,
    and GRPO (lr 1.5e-3, k = 2) learns reverse-3 and reverse-4 at every seed tried (README "Learning defaults").
    """
    spec = {"hidden_size": hidden_size, "layers": layers, "heads": heads, "kv_heads": kv_heads, "seed": seed}
    return _make_tiny_folder(Path(folder), spec, _write_tiny_model, overwrite)


def make_tiny_moe_model(
    folder: str | Path,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    experts: int = 8,
    top_k: int = 2,
    moe_intermediate: int = 64,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Create (or reuse) a random-init Qwen3-MoE checkpoint + the tiny tokenizer in `folder`; return its path.

    Every decoder layer is a mixture of `experts` experts of which each token uses `top_k` (gate
    weights renormalised over them: `norm_topk_prob`), head size 16; made, marked and reused exactly as
    `make_tiny_model` makes its folder (the marker records `family = "qwen3_moe"`, so a dense tiny
    folder is never reused as an MoE one). transformers writes the experts per expert
    (`mlp.experts.{e}.gate_proj.weight`), the format SGLang's loader reads; in memory they are fused.
    """
    spec = {"family": "qwen3_moe", "hidden_size": hidden_size, "layers": layers, "heads": heads,
            "kv_heads": kv_heads, "experts": experts, "top_k": top_k, "moe_intermediate": moe_intermediate,
            "seed": seed}
    return _make_tiny_folder(Path(folder), spec, _write_tiny_moe_model, overwrite)


def _make_tiny_folder(folder: Path, spec: dict, write, overwrite: bool) -> Path:
    """`write(staging, spec)` into a staging folder renamed to `folder` (see `make_tiny_model`), or reuse
    the folder a marker with the same `spec` says is complete."""
    if (folder / MARKER).exists() and not overwrite:
        return _reuse_tiny_model(folder, spec)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-making-", dir=folder.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users' servers
        write(staging, spec)
        if overwrite and folder.exists():
            shutil.rmtree(folder)
        try:
            os.rename(staging, folder)  # atomic; fails when `folder` exists and is not empty
        except OSError:
            if (folder / MARKER).exists():  # another process made it meanwhile
                return _reuse_tiny_model(folder, spec)
            shutil.copytree(staging, folder, dirs_exist_ok=True)  # a folder the user made, without a model
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _reuse_tiny_model(folder: Path, spec: dict) -> Path:
    found = json.loads((folder / MARKER).read_text())
    if found != spec:
        differing = ", ".join(f"{key} = {found.get(key)}" for key in spec if found.get(key) != spec[key])
        raise ModelFolderError(
            f"{folder} holds a tiny model made with {found}, not {spec}: delete the folder to make it again, "
            f"keep it by asking for its settings ([model] {differing}), or choose another folder "
            "(in Python: overwrite=True remakes it)"
        )
    return folder


def _write_tiny_tokenizer(folder: Path) -> dict:
    """Save the tiny tokenizer into `folder`; the config fields every tiny model shares (vocabulary,
    positions, tied head, special token ids)."""
    _quiet_transformers()
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(folder)
    vocab_size = 64  # >= len(tokenizer); a multiple of 8 keeps every backend's kernels happy
    assert len(tokenizer) <= vocab_size
    return {"vocab_size": vocab_size, "max_position_embeddings": 256, "tie_word_embeddings": True,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}


def _save_random_model(folder: Path, model_class, config, spec: dict) -> None:
    """`model_class(config)` initialised from `spec`'s seed, saved, then the marker that says the folder is complete."""
    with torch.random.fork_rng():
        torch.manual_seed(spec["seed"])
        model_class(config).save_pretrained(folder)
    (folder / MARKER).write_text(json.dumps(spec))


def _write_tiny_moe_model(folder: Path, spec: dict) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **_write_tiny_tokenizer(folder),
        hidden_size=spec["hidden_size"],
        intermediate_size=2 * spec["hidden_size"],  # dense MLP size (unused: every layer is sparse)
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        head_dim=spec["hidden_size"] // spec["heads"],
        num_experts=spec["experts"],
        num_experts_per_tok=spec["top_k"],
        moe_intermediate_size=spec["moe_intermediate"],
        norm_topk_prob=True,
    )
    _save_random_model(folder, Qwen3MoeForCausalLM, config, spec)


def _write_tiny_model(folder: Path, spec: dict) -> None:
    """The tokenizer, config and weights of `spec`, then the marker that says the folder is complete."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **_write_tiny_tokenizer(folder),
        hidden_size=spec["hidden_size"],
        intermediate_size=4 * spec["hidden_size"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
    )
    _save_random_model(folder, Qwen2ForCausalLM, config, spec)


WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_LOADING = threading.Lock()  # see load_model


def _check_folder(folder: str | Path) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(
            f"model folder {str(folder)!r} does not exist (a model folder holds config.json, model.safetensors "
            "and tokenizer.json); create the demo model with "
            "stages.data.model.make_tiny_model(folder) or point model.path at a local Hugging Face checkpoint folder"
        )
    missing = [] if (folder / "config.json").exists() else ["config.json"]
    if not any((folder / f).exists() for f in WEIGHT_FILES):
        missing.append(" or ".join(WEIGHT_FILES[:2]))
    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        missing.append(" or ".join(TOKENIZER_FILES))
    if missing:
        raise ModelFolderError(
            f"model folder {str(folder)!r} lacks {', '.join(missing)}: it is not a Hugging Face model folder; "
            "create it with stages.data.model.make_tiny_model(folder) or point model.path at an HF checkpoint"
        )
    return folder


def _check_architecture(folder: Path) -> None:
    """The folder's config names a causal-LM architecture transformers can build."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelFolderError(f"model folder {str(folder)!r}: its config.json cannot be read ({exc})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelFolderError(
            f"model folder {str(folder)!r} holds a {config.model_type!r} model, which is not a causal LM "
            "transformers can load (use a decoder-only checkpoint such as Qwen2, Qwen3, Llama or Mistral)"
        )


def check_model_folder(folder: str | Path, needs_chat_template: bool = False) -> None:
    """Raise `ModelFolderError` (a ValueError) unless `folder` is a local causal-LM checkpoint the learner
    and the torch engine can load, with a tokenizer, and a chat template when `needs_chat_template`.
    Reads only configs and the tokenizer (no weights), so a config check can call it before a run."""
    folder = _check_folder(folder)
    _check_architecture(folder)
    try:
        tokenizer = load_tokenizer(folder)
    except (ValueError, OSError, TypeError) as exc:
        raise ModelFolderError(f"model folder {str(folder)!r}: its tokenizer cannot be loaded ({exc})") from None
    if needs_chat_template and not tokenizer.chat_template:
        raise ModelFolderError(
            f"the tokenizer in {str(folder)!r} has no chat template, and the task gives chat messages; "
            "use a chat (instruct) checkpoint, add a chat_template to its tokenizer_config.json, or give "
            "plain prompts (a prompt field instead of a messages field)"
        )


def load_model(folder: str | Path, dtype: str = "float32") -> torch.nn.Module:
    """Load the causal LM on CPU, in train mode, in `dtype` ("float32" or "bfloat16"). One load at a time per
    process: transformers builds the model under a process-wide meta-device context, so a load in another
    thread at the same time (an engine and a teacher starting together) would get meta tensors."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"model dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    _quiet_transformers()
    folder = _check_folder(folder)
    try:
        with _LOADING:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype])
    except (ValueError, KeyError) as exc:
        _check_architecture(folder)  # names the architecture when that is what failed
        raise ModelFolderError(f"model folder {str(folder)!r} cannot be loaded as a causal LM: {exc}") from None
    model.train()
    return model


def linear_module_names(folder: str | Path) -> list[str]:
    """The distinct last parts of the names of the linear modules of the causal LM in `folder` (a Qwen2's,
    as the tiny model is, when the folder holds no model yet), built from its config alone on the meta
    device: no weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

    _quiet_transformers()
    has_config = (Path(folder) / "config.json").is_file()
    config = AutoConfig.from_pretrained(folder) if has_config else Qwen2Config(num_hidden_layers=1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def load_tokenizer(folder: str | Path, pad: bool = True):
    """The folder's tokenizer, with a pad token (its EOS when it names none, unless not `pad`). The tiny
    demo model's tokenizer adds BOS to plain prompts (as the rollout always did for it); others add what
    their config says (Llama/Mistral: BOS; Qwen: nothing)."""
    from transformers import AutoTokenizer

    folder = _check_folder(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if (folder / MARKER).exists():
        tokenizer.add_bos_token = True
    if pad and tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def decode_many(tokenizer, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """`tokenizer.decode` of each sequence, equal to it, straight through the Rust tokenizer where the
    tokenizer is a fast one without clean-up (a fifth of transformers' own `decode` time; its
    `decode_batch` is slower still for short sequences)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return [tokenizer.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]
    return [backend.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Token ids that end a completion: the tokenizer's EOS and every `eos_token_id` (an int or a list)
    of the model folder's generation_config.json, in that order, without repeats."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    generation = Path(getattr(tokenizer, "name_or_path", "") or ".") / "generation_config.json"
    if generation.is_file():
        found = json.loads(generation.read_text()).get("eos_token_id")
        ids += found if isinstance(found, list) else [found] if found is not None else []
    return tuple(dict.fromkeys(int(i) for i in ids))


def prompt_token_ids(tokenizer, text: str | None = None, messages: list[dict] | None = None) -> list[int]:
    """A prompt's token ids: chat `messages` rendered by the tokenizer's chat template (with the
    generation prompt; the template adds any BOS itself), else plain `text` with the special tokens
    the tokenizer itself adds (BOS only when it has one and its config says to add it)."""
    if messages is not None:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text or "", add_special_tokens=True))
