"""baton's runtime: refs, versions, channels, actors, the ledger and the Pipeline builder.

Nothing here knows about models, rewards or gradients; see `stages` for that.
"""

from pipeline.actor import Actor, ActorFailed, BaseActor
from pipeline.channel import Channel, ChannelClosed
from pipeline.dsl import Pipeline, RunContext
from pipeline.ledger import Ledger
from pipeline.refs import Ref, make_key, parse_key
from pipeline.versions import VersionClock

__all__ = [
    "Actor", "ActorFailed", "BaseActor", "Channel", "ChannelClosed", "Ledger", "Pipeline", "Ref",
    "RunContext", "VersionClock", "make_key", "parse_key",
]
