"""The producer stage: samples -> episodes (engine <-> environment) -> reward -> group -> store -> Ref.

`Rollout` (stage.py) is what the DSL and the config build; it makes one worker per engine
(worker.py: the generation loop; gateway_worker.py: episodes from agents outside). A worker's parts:
its prompt stream (prompts.py), its episodes (episode.py), group scoring and storing (groups.py), the
outbox that records and sends groups in batches (outbox.py), and evaluation (evaluation.py). Nothing
here imports `stages.learner`: the two halves meet only through refs, the ledger and the run folder
(`stages.runfiles`).
"""

from stages.rollout.stage import Rollout
from stages.rollout.worker import GroupsNotStored, ProducerWorker, RolloutWorker, Room

__all__ = ["GroupsNotStored", "ProducerWorker", "Rollout", "RolloutWorker", "Room"]
