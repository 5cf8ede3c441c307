"""The OpenAI-compatible gateway: outside agents run episodes by pointing their `base_url` at it.

Modules: `server` (HTTP routes, auth, errors), `host` (what the gateway asks of the run; `EngineHost`),
`episodes` (open episodes, limits, finishing once), `turns` (one model turn: token-in token-out
prompt, generation, record), `transcript` (does a request extend what was recorded?), `schema`
(OpenAI request structs), `responses` (OpenAI response bodies), `errors` (OpenAI-shaped errors).
"""

from pipeline.net import make_token_file
from stages.gateway.episodes import Limits
from stages.gateway.host import EngineHost, Host, OpenedEpisode, OverBudget
from stages.gateway.server import Gateway

__all__ = ["EngineHost", "Gateway", "Host", "Limits", "OpenedEpisode", "OverBudget", "make_token_file"]
