"""What runs inside the actors: the rollout producer, engines, tasks, the learner, weight transports."""

from stages import tasks
from stages.engines.torch import TorchEngine
from stages.learner import GRPOLearner
from stages.model import load_model, load_tokenizer, make_tiny_model
from stages.rollout import Rollout

__all__ = ["GRPOLearner", "Rollout", "TorchEngine", "load_model", "load_tokenizer", "make_tiny_model", "tasks"]
