"""baton's runtime: refs, versions, channels, actors, the ledger, the two runtimes and the Pipeline.

Nothing here knows about models, rewards or gradients; see `stages` for that. `pipeline.contracts`
declares every method a stage may implement and every call it may make on the run.
"""

from pipeline.actor import Actor, ActorFailed, BaseActor
from pipeline.channel import Channel, ChannelClosed
from pipeline.contracts import Buffer, Consumer, Producer, Services, Stage
from pipeline.dsl import Pipeline, RunContext
from pipeline.ledger import Ledger
from pipeline.refs import Ref, make_key, parse_key
from pipeline.versions import VersionClock
from pipeline.watchdog import PipelineHung, WatchdogSettings

__all__ = [
    "Actor", "ActorFailed", "BaseActor", "Buffer", "Channel", "ChannelClosed", "Consumer", "Ledger", "Pipeline",
    "PipelineHung", "Producer", "Ref", "RunContext", "Services", "Stage", "VersionClock", "WatchdogSettings",
    "make_key", "parse_key",
]
