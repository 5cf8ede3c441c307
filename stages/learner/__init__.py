"""The consumer stage: refs in -> accepted groups -> one optimizer step per version -> weights out.

`GRPOLearner` (stage.py) is what the DSL and the config build; it makes the learner actor (actor.py:
the loop). The actor's parts: the batch collector (collector.py: replay window, staleness verdicts,
prefetch), the trainer (step.py: model, optimizer, one version's step), the losses (losses.py), its
checkpoint state (state.py), a checkpoint's model out as a Hugging Face folder (export.py), bias
accounting (bias.py), and what the run shows of it (report.py, timeline.py). Nothing here imports
`stages.rollout`: the two halves meet only through refs, the ledger and the run folder (`stages.runfiles`).
"""

from stages.learner.actor import LearnerActor
from stages.learner.stage import GRPOLearner

__all__ = ["GRPOLearner", "LearnerActor"]
