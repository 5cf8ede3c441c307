"""Open episodes: their token record (segments), their deadlines, and finishing each exactly once.

An episode is opened through the host (`open`), served request by request (one at a time: the
episode's lock serializes them, so its record is appended in order), and finished exactly once,
by whichever comes first:
- its reward (`POST .../reward`): finished with the reward;
- `POST .../close` without a reward: dropped, reason "closed without reward";
- no request and no reward for `reward_timeout_s` since its last request: dropped, "reward timeout";
- older than `max_episode_s`: dropped, "episode time limit";
- the gateway stopping: dropped, "gateway stopped".
A finished episode answers 409 to further requests; an id the gateway never opened answers 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from stages.data.tasks import Prompt
from stages.environments.tokens import EpisodeTokens
from stages.gateway.errors import ApiError
from stages.gateway.host import Host, OpenedEpisode, OverBudget
from stages.gateway.transcript import ChatTranscript, TextTranscript


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request and one episode may ask."""

    max_body_bytes: int = 1 << 20  # a larger request body is a 413
    max_tokens: int = 1024  # a request asking more is a 400; the default when it asks nothing
    max_n: int = 16  # choices per request (outside episodes)
    max_episode_tokens: int = 16384  # all tokens of an episode's segments; generation stops there
    max_episode_s: float = 3600.0
    reward_timeout_s: float = 600.0  # counted from the episode's last request
    shutdown_s: float = 5.0  # how long `Gateway.stop` lets requests in flight finish


@dataclass
class Segment:
    """One contiguous token record of an episode and the transcript it was built from."""

    tokens: EpisodeTokens
    transcript: ChatTranscript | TextTranscript
    after_stop: bool = True  # the last model turn ended with a stop token


@dataclass
class Episode:
    """An open episode: the host's id, sample and group, its segments (the last one is extended),
    and the clock its limits are measured on (`time.monotonic`)."""

    id: str
    sample: Prompt
    group: int
    opened_at: float
    active_at: float
    segments: list[Segment] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    busy: int = 0  # requests in flight
    ended: str | None = None  # "rewarded" or why it was dropped

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def token_count(self) -> int:
        return sum(len(s.tokens) for s in self.segments)


class EpisodeBook:
    """The gateway's open episodes (id -> Episode) and the ids it finished recently (for a 409)."""

    def __init__(self, host: Host, limits: Limits, stats: Counter) -> None:
        self.host, self.limits, self.stats = host, limits, stats
        self.open: dict[str, Episode] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()
        self._finishing: set[asyncio.Task] = set()

    async def start(self, wait: bool) -> Episode:
        try:
            opened: OpenedEpisode = await self.host.open(wait)
        except OverBudget as exc:
            retry = max(1, round(exc.retry_after_s))
            raise ApiError(429, str(exc), "over_budget", headers={"Retry-After": str(retry)}) from None
        now = time.monotonic()
        episode = Episode(opened.id, opened.sample, opened.group, now, now)
        self.open[episode.id] = episode
        self.stats["episodes_opened"] += 1
        return episode

    def get(self, episode_id: str) -> Episode:
        episode = self.open.get(episode_id)
        if episode is not None:
            return episode
        if episode_id in self.ended:
            raise ApiError(409, f"episode {episode_id} has ended ({self.ended[episode_id]})", "episode_ended")
        raise ApiError(404, f"no episode {episode_id!r}", "episode_not_found")

    async def finish(self, episode: Episode, reward: float | None, reason: str | None) -> bool:
        """Finish `episode` once (after any request in flight); False when it had already ended."""
        async with episode.lock:
            if episode.ended is not None:
                return False
            episode.ended = "rewarded" if reason is None else reason
            self.open.pop(episode.id, None)
            self.ended[episode.id] = episode.ended
            while len(self.ended) > 100_000:
                self.ended.popitem(last=False)
            self.stats["episodes_rewarded" if reason is None else f"dropped: {reason}"] += 1
            await self.host.finish(episode.id, [s.tokens for s in episode.segments], reward, reason)
            return True

    def expired(self, episode: Episode, now: float) -> str | None:
        if now - episode.opened_at > self.limits.max_episode_s:
            return "episode time limit"
        if episode.busy == 0 and now - episode.active_at > self.limits.reward_timeout_s:
            return "reward timeout"
        return None

    async def watch(self) -> None:
        """Drop expired episodes, forever (the gateway cancels it at stop)."""
        tick = max(0.01, min(self.limits.reward_timeout_s, self.limits.max_episode_s) / 8)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for episode in list(self.open.values()):
                reason = self.expired(episode, now)
                if reason is not None:
                    task = asyncio.create_task(self.finish(episode, None, reason))
                    self._finishing.add(task)
                    task.add_done_callback(self._finishing.discard)

    async def close_all(self, reason: str) -> None:
        for task in list(self._finishing):
            with contextlib.suppress(Exception):
                await task
        for episode in list(self.open.values()):
            await self.finish(episode, None, reason)
