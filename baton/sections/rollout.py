"""How episodes run: [rollout] (groups, engine-call timeout), [episode] (limits), [environment]
(multi-turn) and [gateway] (agents on the OpenAI API)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from baton.sections.base import Section, default_of
from stages.environments import make_environment
from stages.rollout import Rollout
from stages.rollout.episode import EpisodeLimits
from stages.rollout.gateway_worker import GatewaySettings, as_agent


class RolloutSpec(Section):
    group_size: int = Field(default_of(Rollout, "group_size"), ge=2,
        description="completions per prompt: one GRPO group, whose rewards are compared with their mean")
    request_timeout_s: float | None = Field(
        default_of(Rollout, "request_timeout_s"), gt=0,
        description="an engine call not answered within this is an error and its groups are generated "
        "again; unset: wait (required by the engine.hang fault)"
    )
    max_failed_in_a_row: int = Field(
        default_of(Rollout, "max_failed_in_a_row"), ge=0,
        description="episodes failed one after another on an engine, none kept in between, before the run fails "
        "naming their reason (a prompt beyond the engine's context, an agent that always raises); 0: never")
    max_engines: int | None = Field(None, ge=1, le=64, description="engines the run may grow to while it runs "
        "(`baton scale RUN_DIR --engines N`, docs/guides/elastic.md; on Ray without checkpoints); "
        "unset: a fixed engine.count")


class EpisodeSpec(Section):
    """Per-episode limits ([episode], stages.rollout.episode.EpisodeLimits); unset: no limit."""

    max_turns: int = Field(default_of(EpisodeLimits, "max_turns"), ge=1, description="model turns per episode "
                           "(an episode without an environment has one)")
    max_tokens: int | None = Field(default_of(EpisodeLimits, "max_tokens"), ge=1, description="tokens per "
                                   "episode: prompt, model turns and environment replies")
    step_timeout_s: float | None = Field(default_of(EpisodeLimits, "step_timeout_s"), gt=0, description="one "
                                         "environment call; past it the episode fails (counted)")
    timeout_s: float | None = Field(default_of(EpisodeLimits, "timeout_s"), gt=0, description="the whole episode; "
                                    "past it the episode fails (counted)")

    def make(self) -> EpisodeLimits:
        return EpisodeLimits(**self.model_dump())


class EnvironmentSpec(BaseModel):
    """[environment]: `kind` is a built-in environment's name or 'pkg.module:Class'; every other key is
    passed to it (stages.environments). Unset: single-turn episodes scored by the reward function."""

    model_config = ConfigDict(extra="allow")
    kind: str = Field(description="a built-in environment (stages.environments.ENVIRONMENTS) or 'pkg.module:Class'")

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _makes_one(self) -> EnvironmentSpec:
        try:
            make_environment(self.kind, **self.options())
        except (ValueError, TypeError) as exc:
            raise ValueError(f"environment: {exc}") from None
        return self


class GatewaySpec(Section):
    """[gateway] (stages.rollout.gateway_worker.GatewaySettings): the OpenAI API in front of the run's engines;
    episodes come from agents through it instead of the rollout's own loop."""

    port: int = Field(default_of(GatewaySettings, "port"), ge=0, le=65535, description="0: a free port")
    bind: str = Field(default_of(GatewaySettings, "bind"), description="the address to listen on; anything "
                      "but 127.0.0.1 lets other machines in (they still need the run's token)")
    agent: str | None = Field(None, description="'pkg.module:function' called per episode with (sample, "
                              "base_url, api_key), returning its reward; unset: agents open episodes themselves")
    agents: int | None = Field(None, ge=1, description="agent calls at once (default: engine.batch_groups * "
                               "rollout.group_size)")
    max_tokens: int = Field(default_of(GatewaySettings, "max_tokens"), ge=1, description="per request")
    max_episode_tokens: int = Field(default_of(GatewaySettings, "max_episode_tokens"), ge=1,
        description="all tokens of one episode; generation stops there")
    max_episode_s: float = Field(default_of(GatewaySettings, "max_episode_s"), gt=0,
        description="an episode open longer than this is dropped ('episode time limit')")
    reward_timeout_s: float = Field(default_of(GatewaySettings, "reward_timeout_s"), gt=0, description="an "
                                    "episode whose reward has not come this long after its last request is dropped")

    def make(self) -> GatewaySettings:
        return GatewaySettings(**self.model_dump())

    @model_validator(mode="after")
    def _agent_resolves(self) -> GatewaySpec:
        if self.agent is not None:
            try:
                as_agent(self.agent)
            except ValueError as exc:
                raise ValueError(f"gateway.agent: {exc}") from None
        return self
