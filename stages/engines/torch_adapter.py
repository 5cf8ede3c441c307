"""`AdapterMerger`: how the torch engine turns an adapter version into whole weights (see
`stages.engines.torch`): merged into its own base once per version, probed before it is staged."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from stages.engines.base import EngineError
from stages.weights.adapter import AdapterError, AdapterVersion, Probe, adapter_pairs, base_fingerprint, merged_weights


class AdapterMerger:
    """The engine's base weights (the model folder's, as loaded) and the merge of each adapter into them.
    `stats` is the engine's: it counts `adapters_merged`, `adapters_refused` and the seconds merging took."""

    def __init__(self, engine: str, model_path: Path, stats: dict[str, float]) -> None:
        self.engine, self.model_path, self.stats = engine, model_path, stats
        stats.update({"adapters_merged": 0, "adapters_refused": 0, "merge_s": 0.0})
        self.model: torch.nn.Module | None = None
        self.lock = threading.Lock()
        self.base: dict[str, torch.Tensor] = {}
        self.fingerprint: str | None = None

    def keep_base(self, model: torch.nn.Module | None, weights_lock: threading.Lock) -> None:
        """Keep `model`'s weights as they are now (at start: the model folder's) as the base; None forgets it."""
        self.model, self.lock = model, weights_lock
        # a tied head under its own name too: an adapter may target it (it is then untied, stages.engines.torch)
        self.base = {} if model is None else {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}

    def merge(self, version: int, adapter: AdapterVersion) -> dict[str, torch.Tensor]:
        """The whole version an adapter makes of the base: the merged target weights and the base's own
        tensors for the rest. EngineError when it does not fit the base or fails its probe."""
        t0 = time.perf_counter()
        try:
            spec = adapter.spec
            if self.fingerprint is None:
                self.fingerprint = base_fingerprint(self.model_path)
            if spec.base != self.fingerprint:
                raise AdapterError(f"it applies to base {spec.base}, this engine serves {self.fingerprint}")
            pairs = adapter_pairs(spec, adapter.tensors, {n: tuple(t.shape) for n, t in self.base.items()})
            weights = {**self.base, **merged_weights(self.base, spec, pairs)}
            if spec.probe is not None:
                self.check_probe(spec.probe, weights)
        except AdapterError as exc:
            self.stats["adapters_refused"] += 1
            raise EngineError(f"engine {self.engine} refused the adapter of version {version}: {exc}") from None
        self.stats["adapters_merged"] += 1
        self.stats["merge_s"] = round(self.stats["merge_s"] + time.perf_counter() - t0, 4)
        return weights

    def check_probe(self, probe: Probe, weights: dict[str, torch.Tensor]) -> None:
        """The probe's logprobs under `weights` (not yet the live ones) equal the learner's within its tolerance."""
        assert self.model is not None
        ids = torch.tensor([list(probe.tokens)], device=self.model.device)
        with self.lock, torch.no_grad():  # functional_call swaps the parameters: no decode step meanwhile
            # tie_weights=False: `weights` names a tied head too, merged apart from the embedding when adapted
            out = torch.func.functional_call(self.model, weights, (), {"input_ids": ids}, tie_weights=False)
        logp = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None]).squeeze(1).cpu()
        diff = probe.difference(logp.tolist())
        if not diff <= probe.tolerance:
            raise AdapterError(f"its probe's logprobs differ from the learner's by {diff:.3g} (tolerance "
                               f"{probe.tolerance:g}): the engine does not hold the learner's adapter")
