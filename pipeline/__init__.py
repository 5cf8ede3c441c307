"""baton's runtime: refs, versions, channels, actors, the ledger and the Pipeline builder.

Nothing here knows about models, rewards or gradients; see `stages` for that.
"""

from pipeline.actor import Actor, ActorFailed, BaseActor
from pipeline.channel import Channel, ChannelClosed
from pipeline.dsl import Pipeline, RunContext
from pipeline.ledger import Ledger
from pipeline.refs import Ref, make_key, parse_key
from pipeline.versions import VersionClock
from pipeline.watchdog import PipelineHung, WatchdogSettings

__all__ = [
    "Actor", "ActorFailed", "BaseActor", "Channel", "ChannelClosed", "Ledger", "Pipeline", "PipelineHung", "Ref",
    "RunContext", "VersionClock", "WatchdogSettings", "make_key", "parse_key",
]
