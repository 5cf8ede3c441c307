"""`ClassifierReward`: a sequence-classification model (a reward model) scores each sample on an SGLang server.

The sample is rendered the way the reward model was trained to read it: the prompt (its chat messages,
or its text as one user message) and the completion as the assistant's reply, through the model's own
chat template; the ids go to SGLang's `/classify` (a server started with `--is-embedding`), one request
per group. The score is output `label` of the model's head at the last token.

Parity with transformers (`AutoModelForSequenceClassification` on the same folder), which
tests/stages/scorers/test_classifier_sglang.py checks; two differences had to be removed:
- SGLang 0.5's `Qwen2ForSequenceClassification` gives its score head a bias that the Hugging Face model
  does not have (`nn.Linear(..., bias=True)` against transformers' `bias=False`); the checkpoint holds no
  `score.bias`, so SGLang kept the bias's random init: every score came out shifted by one constant per
  server start (-0.038 in the first measurement, a new one after each restart). The server therefore
  loads a serving folder (`serving_folder`): the model's files, linked, plus `score.bias` = 0 where the
  checkpoint has none, which makes SGLang's head the transformers head;
- transformers pools at the last token that is not the config's `pad_token_id`, SGLang at the last token;
  trailing pad ids are left out of the request (the positions before them are computed alike: causal).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from stages.data.model import load_tokenizer
from stages.data.rewards import Sample, Scores
from stages.scorers.base import ScorerError, record
from stages.scorers.server import ScoringServer, Served, ServerSettings

INDEX = "model.safetensors.index.json"
BIAS_FILE = "baton-score-bias.safetensors"


def checkpoint_tensors(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the folder's safetensors files: name -> (dtype, shape), read from the headers."""
    from safetensors import safe_open

    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                found[name] = (piece.get_dtype(), tuple(piece.get_shape()))
    return found


def serving_folder(model: Path, into: Path) -> Path:
    """The folder the SGLang server loads (see the module docstring): `model` itself when its checkpoint has
    a `score.bias`, else `into`, holding links to every file of `model`, a `score.bias` of zeros in the
    score head's dtype, and (when `model` has one) its weight index naming that file too."""
    from safetensors.torch import save_file

    tensors = checkpoint_tensors(model)
    if "score.bias" in tensors or "score.weight" not in tensors:
        return model
    dtype, shape = tensors["score.weight"]
    into.mkdir(parents=True, exist_ok=True)
    for file in model.iterdir():
        if file.name != INDEX and not (into / file.name).exists():
            (into / file.name).symlink_to(file.resolve())
    torch_dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(dtype, torch.float32)
    save_file({"score.bias": torch.zeros(shape[0], dtype=torch_dtype)}, str(into / BIAS_FILE))
    if (model / INDEX).is_file():
        index = json.loads((model / INDEX).read_text())
        index["weight_map"]["score.bias"] = BIAS_FILE
        (into / INDEX).write_text(json.dumps(index))
    return into


@dataclass
class ClassifierReward(Served):
    """`ClassifierReward(ServerSettings("rm-folder"))` launches the folder on SGLang; with a `url` it attaches to
    a server already serving it (the folder still gives the tokenizer and chat template). `label`: which output
    is the score."""

    settings: ServerSettings
    label: int = 0
    name: str = "classifier"
    stats: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.settings.model is None:
            raise ValueError("classifier: give the reward model's folder (it renders the samples, with a url too)")
        self.model = Path(self.settings.model)
        self.tokenizer = load_tokenizer(self.model, pad=False)
        if not self.tokenizer.chat_template:
            raise ValueError(f"classifier model {str(self.model)!r}: its tokenizer has no chat template to render "
                             "the prompt and completion with; add a chat_template to its tokenizer_config.json")
        config = json.loads((self.model / "config.json").read_text())
        self.pad_id = config.get("pad_token_id")
        labels = int(config.get("num_labels", len(config.get("id2label") or {0: 0})))
        if not 0 <= self.label < labels:
            raise ValueError(f"classifier label {self.label} is not an output of {str(self.model)!r} "
                             f"({labels} labels); choose one in 0..{labels - 1}")
        self.server = ScoringServer(self.name, self.settings, self.stats, extra_args=("--is-embedding",))

    async def start(self, log_dir: Path | None = None) -> None:
        if self.settings.url is None and self.server.server is None:
            folder = serving_folder(self.model, Path(tempfile.mkdtemp(prefix="baton-classifier-")))
            self.server.settings = replace(self.settings, model=folder)
        await super().start(log_dir)

    def render(self, sample: Sample) -> list[int]:
        """The ids the reward model reads for `sample` (see the module docstring)."""
        messages = list(sample.messages) if sample.messages else [{"role": "user", "content": sample.prompt}]
        messages.append({"role": "assistant", "content": sample.completion})
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        while ids and self.pad_id is not None and ids[-1] == self.pad_id:
            ids.pop()
        return ids

    async def score(self, samples: Sequence[Sample]) -> Scores:
        """One group's scores; never raises (a failed request fails the group's samples, with its reason)."""
        t0 = time.perf_counter()
        try:
            values = await self._classify([self.render(s) for s in samples])
            failure = None
        except ScorerError as exc:
            values, failure = [0.0] * len(samples), f"classifier {exc.reason}"
        record(self.stats, time.perf_counter() - t0, failure)
        return Scores(values, [failure] * len(samples))

    async def _classify(self, sequences: list[list[int]]) -> list[float]:
        if not all(sequences):
            raise ScorerError("empty input", "a sample rendered to no tokens")
        answer = await self.server.post("/classify", {"input_ids": sequences})
        items = answer if isinstance(answer, list) else [answer]
        try:
            values = [float(item["embedding"][self.label]) for item in items]
        except (KeyError, TypeError, IndexError, ValueError):
            raise ScorerError("bad answer", str(answer)[:200]) from None
        if len(values) != len(sequences):
            raise ScorerError("bad answer", f"{len(values)} scores for {len(sequences)} samples")
        if not all(math.isfinite(v) for v in values):
            raise ScorerError("not finite", str(values))
        return values
