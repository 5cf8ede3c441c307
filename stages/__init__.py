"""What runs inside the actors, in two halves that never import each other (docs/architecture.md):

  rollout/   the producer: workers, episodes, groups, evaluation, gateway mode
  learner/   the consumer: the actor's loop, the batch collector, the step, losses, state, reports
and what both use: engines/, environments/, weights/ (one module per transport), gateway/ (the
OpenAI layer), data/ (tasks, datasets, rewards, model loading) and runfiles (run-folder file names).

The DSL's names are exported here (`from stages import Rollout, GRPOLearner, TorchEngine`), loaded on
first use. Modules moved in 0.2 keep their old import path for one release (`MOVED`): importing the old path
warns and gives the module at its new place, so a user's `"stages.rewards:exact_match"` still resolves.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "stages.tasks": "stages.data.tasks",
    "stages.datasets": "stages.data.datasets",
    "stages.rewards": "stages.data.rewards",
    "stages.model": "stages.data.model",
    "stages.episode": "stages.rollout.episode",
    "stages.evaluation": "stages.rollout.evaluation",
    "stages.group_output": "stages.rollout.outbox",
    "stages.gateway.run_host": "stages.rollout.gateway_worker",
    "stages.learner_state": "stages.learner.state",
    "stages.losses": "stages.learner.losses",
    "stages.bias": "stages.learner.bias",
    "stages.timeline": "stages.learner.timeline",
}


_EXPORTS = {
    "DatasetTask": "stages.data.datasets",
    "GRPOLearner": "stages.learner",
    "RewardFunction": "stages.data.rewards",
    "Rollout": "stages.rollout",
    "TorchEngine": "stages.engines.torch",
    "check_model_folder": "stages.data.model",
    "load_model": "stages.data.model",
    "load_tokenizer": "stages.data.model",
    "make_tiny_model": "stages.data.model",
    "tasks": "stages.data.tasks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'stages' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    return module if name == "tasks" else getattr(module, name)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path of `MOVED` and loads it as the module at its new place."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system gives the module the old path's spec: keep its own
        return module

    def exec_module(self, module) -> None:
        """The module ran already, at its new place."""
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
