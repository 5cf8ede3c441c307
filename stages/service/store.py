"""`Store`: what the service keeps on disk beside its journal, so a restart over the same folder comes back.

* `models/{model_id}/step-{n}/`: a model's learner state (adapter and AdamW state, `PolicyTrainer.write_state`)
  after its optimizer step n, written when that `optim_step` finishes, and `models/{model_id}/commit.json` (the
  step, the seq of its `optim_step` and that call's result: `journal.Commit`) replaced atomically after it: a
  step is committed exactly when `commit.json` names it, and a kill before that leaves the previous commit
  whole. The older step folder is removed after the new commit; at most two exist at once.
* `samplers/{uuid}.safetensors`: each adapter saved for sampling, as the learner published it (its tensors and its
  descriptor, `stages.weights.adapter.pack_adapter`), so a sampler saved before a restart samples after it.

`model.json` names the base model folder the state belongs to; a service over another model refuses the folder.

Nothing here is pickled: msgspec JSON, torch distributed checkpoints and safetensors.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import msgspec
import safetensors.torch

from stages.service.journal import Commit, Outcome, StateError, write_atomically
from stages.weights.adapter import AdapterVersion, as_received, pack_adapter

COMMIT_FILE = "commit.json"
MODEL_FILE = "model.json"  # the base model whose state this is


def read_commits(folder: Path) -> dict[str, Commit]:
    """Every model's committed step in the state folder `folder` (a model that never committed one has none)."""
    found = {}
    for model in (folder / "models").iterdir():
        if (model / COMMIT_FILE).is_file():
            found[model.name] = msgspec.json.decode((model / COMMIT_FILE).read_bytes(), type=Commit)
    return found


class Store:
    def __init__(self, folder: Path, model_path: Path) -> None:
        """The store in `folder`, for the base model `model_path`; a `StateError` naming both when the folder
        holds another base model's state (a restart must use the folder of the same model)."""
        self.folder = folder
        (folder / "models").mkdir(parents=True, exist_ok=True)
        (folder / "samplers").mkdir(parents=True, exist_ok=True)
        owner, model = folder / MODEL_FILE, str(model_path.resolve())
        if owner.is_file() and json.loads(owner.read_text())["model"] != model:
            raise StateError(f"state folder {folder} holds the state of {json.loads(owner.read_text())['model']}, "
                             f"not of {model}: serve that model over it, or give this one another --state")
        if not owner.is_file():
            write_atomically(owner, json.dumps({"model": model}).encode())

    def _model(self, model_id: str) -> Path:
        return self.folder / "models" / model_id

    def step_folder(self, model_id: str, step: int) -> Path:
        return self._model(model_id) / f"step-{step}"

    def commit(self, model_id: str, step: int, seq: int, outcome: Outcome) -> None:
        """Commit step `step` (its state already written to `step_folder`), then drop the step committed before
        it, however many steps back (commits are periodic): at most two step folders exist at once."""
        file = self._model(model_id) / COMMIT_FILE
        before = msgspec.json.decode(file.read_bytes(), type=Commit).step if file.is_file() else None
        write_atomically(file, msgspec.json.encode(Commit(step, seq, outcome)))
        if before is not None and before != step:
            shutil.rmtree(self.step_folder(model_id, before), ignore_errors=True)

    def commits(self) -> dict[str, Commit]:
        return read_commits(self.folder)

    def save_sampler(self, adapter: AdapterVersion) -> str:
        """Write a sampler's adapter; its file, relative to the state folder (for the journal's record)."""
        name = f"samplers/{uuid.uuid4().hex}.safetensors"  # two models may save at once, each in its own thread
        tensors = {n: t.detach().cpu().contiguous() for n, t in pack_adapter(adapter.spec, adapter.tensors).items()}
        write_atomically(self.folder / name, safetensors.torch.save(tensors))  # on disk before it is journaled
        return name

    def load_sampler(self, name: str) -> AdapterVersion:
        received = as_received(safetensors.torch.load_file(str(self.folder / name)))
        assert isinstance(received, AdapterVersion), f"{name} holds no adapter"
        return received

