"""How episodes run: [rollout] (groups, engine-call timeout), [episode] (limits), [environment]
(multi-turn) and [gateway] (agents on the OpenAI API)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from baton.sections.base import Section, declared_defaults
from stages.environments import make_environment

if TYPE_CHECKING:
    from stages.rollout.episode import EpisodeLimits
    from stages.rollout.gateway_worker import GatewaySettings

ROLLOUT = declared_defaults("stages.rollout:Rollout")
EPISODE_LIMITS = declared_defaults("stages.rollout.episode:EpisodeLimits")
GATEWAY_SETTINGS = declared_defaults("stages.rollout.gateway_worker:GatewaySettings")


class RolloutSpec(Section):
    group_size: int = Field(ROLLOUT("group_size", 8), ge=2,
        description="completions per prompt: one GRPO group, whose rewards are compared with their mean")
    request_timeout_s: float | None = Field(
        ROLLOUT("request_timeout_s", None), gt=0,
        description="an engine call not answered within this is an error and its groups are generated "
        "again; unset: wait (required by the engine.hang fault)"
    )
    max_failed_in_a_row: int = Field(
        ROLLOUT("max_failed_in_a_row", 512), ge=0,
        description="episodes failed one after another on an engine, none kept in between, before the run fails "
        "naming their reason (a prompt beyond the engine's context, an agent that always raises); 0: never")
    max_engines: int | None = Field(None, ge=1, le=64, description="engines the run may grow to while it runs "
        "(`baton scale RUN_DIR --engines N`, docs/guides/elastic.md; on Ray without checkpoints); "
        "unset: a fixed engine.count")


class EpisodeSpec(Section):
    """Per-episode limits ([episode], stages.rollout.episode.EpisodeLimits); unset: no limit."""

    max_turns: int = Field(EPISODE_LIMITS("max_turns", 8), ge=1, description="model turns per episode "
                           "(an episode without an environment has one)")
    max_tokens: int | None = Field(EPISODE_LIMITS("max_tokens", None), ge=1, description="tokens per "
                                   "episode: prompt, model turns and environment replies")
    step_timeout_s: float | None = Field(EPISODE_LIMITS("step_timeout_s", None), gt=0, description="one "
                                         "environment call; past it the episode fails (counted)")
    timeout_s: float | None = Field(EPISODE_LIMITS("timeout_s", None), gt=0, description="the whole episode; "
                                    "past it the episode fails (counted)")

    def make(self) -> EpisodeLimits:
        from stages.rollout.episode import EpisodeLimits

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

    port: int = Field(GATEWAY_SETTINGS("port", 0), ge=0, le=65535, description="0: a free port")
    bind: str = Field(GATEWAY_SETTINGS("bind", "127.0.0.1"), description="the address to listen on; anything "
                      "but 127.0.0.1 lets other machines in (they still need the run's token)")
    agent: str | None = Field(None, description="'pkg.module:function' called per episode with (sample, "
                              "base_url, api_key), returning its reward; unset: agents open episodes themselves")
    agents: int | None = Field(None, ge=1, description="agent calls at once (default: engine.batch_groups * "
                               "rollout.group_size)")
    max_tokens: int = Field(GATEWAY_SETTINGS("max_tokens", 1024), ge=1, description="per request")
    max_episode_tokens: int = Field(GATEWAY_SETTINGS("max_episode_tokens", 16384), ge=1,
        description="all tokens of one episode; generation stops there")
    max_episode_s: float = Field(GATEWAY_SETTINGS("max_episode_s", 3600.0), gt=0,
        description="an episode open longer than this is dropped ('episode time limit')")
    reward_timeout_s: float = Field(GATEWAY_SETTINGS("reward_timeout_s", 600.0), gt=0, description="an "
                                    "episode whose reward has not come this long after its last request is dropped")

    def make(self) -> GatewaySettings:
        from stages.rollout.gateway_worker import GatewaySettings

        return GatewaySettings(**self.model_dump())

    @model_validator(mode="after")
    def _agent_resolves(self) -> GatewaySpec:
        if self.agent is not None:
            from stages.rollout.gateway_worker import as_agent

            try:
                as_agent(self.agent)
            except ValueError as exc:
                raise ValueError(f"gateway.agent: {exc}") from None
        return self
