"""SGLangEngine: an SGLang HTTP server as the producer's inference engine.

The engine either launches its server (`SGLangServer`, possibly from another venv) or attaches to a running one by
`url`; it speaks HTTP only and never imports sglang.

* **generate**: one batched `/generate` call with `input_ids`, sampling params, stop tokens and `return_logprob`; each
  request gets an id (`rid`) so it can be aborted alone. Every token's version comes from the response's
  `weight_versions` spans (SGLang records which weights produced which tokens), so a request that ran across an update
  reports each segment honestly.
* **receive_weights(version, tensors)**: applies a whole version, tagged `str(version)`, through one of SGLang's paths
  (`update = "tensor" | "distributed" | "disk"`), always inside `/begin_weight_update` ... `/end_weight_update`. With
  requests in flight it first pauses generation (`pause_mode = "in_place"` keeps their KV cache, `"retract"`
  recomputes it), asks the staleness policy what each request should do (`interrupt`: continue on the new weights, or
  restart from its prompt), applies, and continues. A version is applied whole or the call raises `EngineError`;
  `version` only moves once the server confirmed the update and its logprobs on a probe equal the version's
  (`sglang_probe`; the folder's own weights are checked at start too); fused expert tensors go out under the
  per-expert names SGLang's loader takes (`sglang_moe`). An MoE model's server returns routed experts: each completion
  carries them, aligned as the torch engine's (`sglang_moe`).
* **adapters** (`lora=LoraServing(...)`, a LoRA run): the server is launched with LoRA, each `AdapterVersion` is
  loaded as `policy-v{N}` and every request runs under the adapter of the version it started under, holding it until
  it ends; what stays loaded and when an adapter may go: `stages.engines.sglang_lora`. No pause, no weight update: the
  base never changes. Adapters may also be served by name beside the versions (`add_adapter`; `generate(...,
  adapter=name)`; the `adapters` hold them).
* **health**: transient HTTP failures are retried (tenacity). If the server this engine launched dies, it is
  restarted, the latest weights are re-applied, and the requests that were in flight are generated again from their
  prompts; `stats["restarts"]` and `stats["regenerated"]` count it. A server that cannot be brought back raises
  `EngineError`.
* **preempt()**: the requests in flight are aborted and end with the tokens they have (`server_engine`).
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import numpy as np
import torch
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from pipeline.events import report_event
from stages.data.routing import folder_moe_layout
from stages.engines.base import Completion, EngineError, EngineRun, SamplingParams, preempted_before_start
from stages.engines.server_engine import IDLE_CONNECTION_S, ServerEngine
from stages.engines.sglang_lora import LoraServing, ServerAdapters, fit_adapter
from stages.engines.sglang_moe import per_expert_tensors, served_routes
from stages.engines.sglang_probe import (
    PushMismatch,
    WeightProbe,
    checkpoint_shapes,
    dtype_tolerance,
    folder_version,
    untied_head,
)
from stages.engines.sglang_server import ServerFailed, SGLangServer, gpu_available
from stages.engines.sglang_update import UPDATE_PATHS, ServerUpdate, version_of_tag
from stages.weights.adapter import AdapterVersion, base_fingerprint

MAX_ROUNDS = 8  # generate() gives up on requests aborted (or lost to a dead server) this many times in a row
PAUSE_MODES = ("in_place", "retract")


class ServerGone(EngineError):
    """The server stopped answering (connection refused or reset)."""


@dataclass
class SGLangEngine(ServerEngine):
    """`SGLangEngine(model_path)` launches a CPU/GPU server; `SGLangEngine(model_path, url=...)` attaches."""

    model_path: str | Path
    name: str = "sglang-0"
    url: str | None = None
    python: str | None = None
    port: int | None = None
    dtype: str = "float32"
    device: str = "auto"
    gpu_id: int | None = None  # the GPU a launched server uses (--base-gpu-id)
    threads: int = 1
    max_total_tokens: int = 16384
    extra_args: tuple[str, ...] = ()
    update: str = "tensor"
    pause_mode: str = "in_place"
    max_restarts: int = 3
    start_timeout_s: float = 300.0  # how long a launched server may take to answer its health check
    lora: LoraServing | None = None  # serve LoRA adapters (a LoRA run's versions): stages.engines.sglang_lora
    request_timeout_s: float = 600.0
    # each full-weight version is checked by the server's logprobs on a probe (sglang_probe): the bound in float32
    # (lower precisions get at least sglang_probe.LOW_PRECISION_TOLERANCE); None: not checked
    probe_tolerance: float | None = 1e-5
    log_dir: str | Path | None = None  # the server's log and engine events go here (`attach`: the run folder)
    policy: Any = None  # the run's staleness policy (its `interrupt`), from `attach`
    stats: dict = field(default_factory=lambda: {"restarts": 0, "regenerated": 0, "interrupted": 0, "updates": 0})

    def __post_init__(self) -> None:
        if self.update not in UPDATE_PATHS:
            raise ValueError(f"engine.update must be one of {UPDATE_PATHS}, got {self.update!r}")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"engine.pause_mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        self._version = 0
        cpu = self.device == "cpu" or (self.device == "auto" and not gpu_available())
        self.gpus = 0 if cpu or self.url is not None else 1  # the server it launches uses one; an attached one none
        self._latest: tuple[int, dict[str, torch.Tensor] | AdapterVersion] | None = None
        self._held: tuple[int, dict[str, torch.Tensor] | AdapterVersion] | None = None  # the server's, applied last
        self._server: SGLangServer | None = None
        self._base_url: str | None = None  # the server's address: `url`, or the launched server's
        self._http: aiohttp.ClientSession | None = None
        self._inflight: dict[str, int] = {}  # rid -> oldest version it may have tokens from
        self._update_lock: anyio.Lock | None = None
        self._restart_lock: anyio.Lock | None = None
        self._updater = ServerUpdate(self.name, Path(self.model_path), self._call)
        self._adapters = ServerAdapters(self.name, self.lora, self._call, self.stats)
        self._expected: dict[str, tuple[int, ...]] | None = None
        self._layout = folder_moe_layout(self.model_path)  # an MoE model's: its completions carry routed experts
        self.returns_routed_experts = self._layout is not None
        self._probe: WeightProbe | None = None
        self._probing = self.probe_tolerance is not None  # every full-weight version, dense or MoE (sglang_probe)
        self._untied_head = self._layout is not None and untied_head(Path(self.model_path))  # (an MoE has config)
        self._base: str | None = None  # the model folder's fingerprint (stages.weights.adapter), once an adapter came
        self._rids = itertools.count()
        self._last_abort = ""
        self._stopping = False  # `stop` began: requests in flight fail with EngineError, nothing restarts

    # -- lifecycle -----------------------------------------------------------------------------
    def attach(self, run: EngineRun) -> None:
        """The run's staleness policy answers for requests in flight; the server logs to the run folder."""
        self.policy = run.policy
        if run.log_dir is not None:
            self.log_dir = run.log_dir

    @property
    def base_url(self) -> str | None:
        """Where the server answers (once started)."""
        return self._base_url

    async def start(self) -> None:
        if self._http is not None:
            return
        self._stopping = False
        self._update_lock, self._restart_lock = anyio.Lock(), anyio.Lock()
        self._base_url = self.url
        self._adapters.log_dir = Path(self.log_dir) if self.log_dir else None
        if self.url is None:
            log_dir = Path(self.log_dir) if self.log_dir else Path(tempfile.gettempdir())
            lora = self.lora.launch_args(cpu=self.gpus == 0) if self.lora is not None else ()
            lora += ("--enable-return-routed-experts",) if self._layout is not None else ()
            self._server = SGLangServer(
                self.model_path, python=self.python, port=self.port, dtype=self.dtype, device=self.device,
                threads=self.threads, max_total_tokens=self.max_total_tokens,
                extra_args=(*self.extra_args, *lora,
                            *(() if self.gpu_id is None else ("--base-gpu-id", str(self.gpu_id)))),
                log_path=log_dir / f"sglang-{self.name}-{os.getpid()}.log", launch_timeout_s=self.start_timeout_s,
            )
            try:
                await self._server.start()
            except ServerFailed as exc:
                shim = "pin_memory" in str(exc) and self.lora is not None
                hint = "; rerun tools/sglang-cpu/install.sh: it installs the CPU LoRA shim" if shim else ""
                raise EngineError(f"engine {self.name}: {exc}{hint}") from None
            self._base_url = self._server.url
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
                                           connector=aiohttp.TCPConnector(keepalive_timeout=IDLE_CONNECTION_S))
        try:
            await self._call("GET", "/health")
            if self._latest is not None:  # weights that arrived before start
                await self._apply(*self._latest)
                self._held = self._latest
            elif (self._probing or self._untied_head) and (
                    tensors := await anyio.to_thread.run_sync(folder_version, Path(self.model_path))) is not None:
                # version 0 is checked like any other. Pushed first: a tied MoE head (SGLang's MoE models keep
                # lm_head apart and load none from such a folder), and to a server attached by url, which may
                # hold any version of an earlier run (the cause of a start probe 0.23 off: docs/guides/sglang.md)
                if self._untied_head or self.url is not None:
                    fitted = self._fit(0, tensors)
                    await self._update(0, fitted)
                    self._latest = self._held = (0, fitted)  # what a restarted server or a refused version gets
                elif self._probing:
                    await self._check_landed(0, tensors)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.stop()
            raise

    async def stop(self) -> None:
        """Fail the requests in flight (EngineError) and stop the server this engine launched."""
        self._stopping = True
        await self._updater.close(server_up=self._http is not None)
        await self._adapters.close()
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._server is not None:
            await anyio.to_thread.run_sync(self._server.stop)
            self._server = None

    # -- generation ----------------------------------------------------------------------------
    async def generate(self, prompts: list[list[int]], params: SamplingParams, adapter: str | None = None
                       ) -> list[Completion]:  # under the current version, or the adapter `add_adapter` named so
        if self._http is None:
            raise RuntimeError(f"engine {self.name} is not started")
        self._refuse_if_preempted()
        results: list[Completion | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        for _ in range(MAX_ROUNDS):
            if self._preempted:  # requests it could not give back go on elsewhere from their prompts
                results = [c or preempted_before_start() for c in results]
                todo = []
            if not todo:
                return results  # type: ignore[return-value]
            done = await self._generate_some([prompts[i] for i in todo], params, adapter)
            again = []
            for i, completion in zip(todo, done, strict=True):
                if completion is None:  # interrupted by the policy, or its server died: from the prompt again
                    again.append(i)
                else:
                    results[i] = completion
            if again:
                self.stats["regenerated"] += len(again)
            todo = again
        if not todo:
            return results  # type: ignore[return-value]
        raise EngineError(
            f"engine {self.name}: {len(todo)} requests were aborted {MAX_ROUNDS} times in a row "
            f"(last reason: {self._last_abort!r}); not trying again"
        )

    async def _generate_some(self, prompts: list[list[int]], params: SamplingParams,
                             named: str | None = None) -> list[Completion | None]:
        rids = [f"{self.name}-{uuid.uuid4().hex[:8]}-{next(self._rids)}" for _ in prompts]
        adapter = self._adapters.acquire(rids, named)  # the whole call runs under one adapter, held by each request
        submitted = adapter[1] if adapter is not None else self._version
        body = {
            "input_ids": prompts,
            "rid": rids,
            "sampling_params": {
                "max_new_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "stop_token_ids": list(params.stop_token_ids),
                # with no stop tokens asked for, run the full length (SGLang would stop at the model's EOS)
                "ignore_eos": not params.stop_token_ids,
            },
            "return_logprob": True,
            # prefix-cache entries are only shared between requests made under one version: a
            # prompt's KV computed by older weights must never serve a newer version's request
            "extra_key": f"v{submitted}",
            **({"lora_path": adapter[0]} if adapter is not None else {}),
            **({"return_routed_experts": True} if self._layout is not None else {}),
        }
        for rid in rids:
            self._inflight[rid] = submitted
        try:
            answer = await self._preemptible(self._call("POST", "/generate", body), lambda: self._abort(rids))
        except ServerGone:
            if self._stopping:
                raise EngineError(f"engine {self.name} stopped") from None
            if not self._preempted:  # (a preempted engine's server is not brought back)
                await self._recover()
            return [None] * len(prompts)
        finally:
            for rid in rids:
                self._inflight.pop(rid, None)
            if adapter is not None:
                self._adapters.release(rids, adapter[0])
        if not isinstance(answer, list) or len(answer) != len(prompts):
            raise EngineError(f"engine {self.name}: /generate gave {type(answer).__name__}, not {len(prompts)} results")
        return [self._completion(item, submitted, params, spans=adapter is None) for item in answer]

    def _completion(self, item: dict, submitted: int, params: SamplingParams, spans: bool = True) -> Completion | None:
        """One request's completion (None: aborted). Its tokens' versions: the server's `weight_versions`
        spans (`spans`), or all `submitted` (a request under an adapter: the adapter's version throughout)."""
        meta = item["meta_info"]
        finish = (meta.get("finish_reason") or {}).get("type", "length")
        if finish == "abort" and not self._preempted:  # (preempted: its tokens so far, server_engine)
            self._last_abort = (meta.get("finish_reason") or {}).get("message", "")
            return None
        pairs = meta["output_token_logprobs"]
        tokens = np.array([t for _, t, *_ in pairs], dtype=np.int32)
        logprobs = np.array([lp for lp, *_ in pairs], dtype=np.float32)
        if len(tokens) != len(item.get("output_ids", tokens)):
            raise EngineError(f"engine {self.name}: {len(tokens)} logprobs for {len(item['output_ids'])} tokens")
        versions = np.full(len(tokens), submitted, dtype=np.int32)
        whole = [{"version": meta.get("weight_version"), "start": 0, "end": len(tokens)}]
        for span in (meta.get("weight_versions") or whole) if spans else ():
            versions[span["start"] : span["end"]] = version_of_tag(span["version"], submitted)
        stopped = finish == "stop" and len(tokens) > 0 and int(tokens[-1]) in params.stop_token_ids
        served = {"rid": meta.get("id"), "prompt_tokens": int(meta.get("prompt_tokens") or 0),
                  "cached_tokens": int(meta.get("cached_tokens") or 0)}  # the server's prefix cache served these
        try:  # an MoE model's routed experts of each generated token (sglang_moe)
            routes = None if self._layout is None else served_routes(meta, self._layout, len(tokens))
        except ValueError as exc:
            raise EngineError(f"engine {self.name}: routed experts: {exc}") from None
        finish = "preempted" if finish == "abort" else "stop" if stopped else "length"
        return Completion(tokens, logprobs, versions, finish, served, routes)

    async def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            await self._call("POST", "/abort_request", {"rid": rid})

    # -- weights -------------------------------------------------------------------------------
    @property
    def adapters(self) -> ServerAdapters:  # what the server holds (`loaded`, `remove`, `scored`: sglang_lora)
        return self._adapters

    async def add_adapter(self, name: str, version: int, adapter: AdapterVersion) -> None:
        """Serve `adapter` under `name` beside the versions, checked to fit and by its probe (`ServerAdapters.add`)."""
        self._fit(version, adapter)
        await self._adapters.add(name, version, adapter.spec, adapter.tensors, disk=self.update == "disk")

    async def receive_weights(self, version: int, tensors: dict[str, torch.Tensor] | AdapterVersion) -> None:
        """Apply `version` whole (see the module docstring); older or equal versions are ignored."""
        if self._latest is not None and version <= self._latest[0]:
            return
        tensors = self._fit(version, tensors)
        self._latest = (version, tensors)
        if self._http is None:
            return  # applied at start
        assert self._update_lock is not None
        async with self._update_lock:
            if self._latest[0] != version:
                return  # a newer version arrived while this one waited
            try:
                await self._apply(version, tensors)
            except ServerGone:
                if self._server is None:
                    raise  # attached by url: nothing here can bring it back
                await self._recover()  # a dead server is restarted (here, or by a request) with the latest version
                if self._held is None or self._held[0] < version:  # it answers without it: a dropped connection
                    if self._latest[0] == version:  # (taken for landed, the version sent again was ignored)
                        self._latest = self._held
                    raise EngineError(f"engine {self.name}: version {version} did not land (the connection "
                                      "dropped); it is to be sent again") from None
            except EngineError:
                if self._latest[0] == version:  # refused: a restarted server gets what this one held, not it
                    self._latest = self._held
                raise
            else:
                self._held = (version, tensors)

    def _fit(self, version: int, tensors: dict[str, torch.Tensor] | AdapterVersion) -> dict | AdapterVersion:
        """The tensors to send, checked against the checkpoint's names and shapes before the server
        sees them: a version that does not fit whole is refused here, with the server untouched (an
        adapter: against the checkpoint and what the server was launched to serve)."""
        if self._expected is None:
            self._expected = checkpoint_shapes(Path(self.model_path))
        if isinstance(tensors, AdapterVersion):
            if self._base is None:
                self._base = base_fingerprint(self.model_path)
            fit_adapter(self.name, self.lora, version, tensors.spec, tensors.tensors, self._expected, self._base)
            return tensors
        tensors = per_expert_tensors(tensors)  # fused experts: SGLang's loader skips them (sglang_moe)
        expected, problems = self._expected, []
        for name, shape in expected.items():
            if name not in tensors:
                problems.append(f"{name} missing")
            elif tuple(tensors[name].shape) != shape:
                problems.append(f"{name} has shape {tuple(tensors[name].shape)}, the model {shape}")
        extra = [n for n in tensors if n not in expected and n != "lm_head.weight"]  # tied head: not stored
        problems += [f"{n} is not in the model" for n in extra]
        if problems:
            raise EngineError(f"engine {self.name}: weights of version {version} do not fit: {'; '.join(problems[:5])}")
        head = self._untied_head and "lm_head.weight" in tensors  # a tied head SGLang's model keeps apart (MoE)
        return {n: t for n, t in tensors.items() if n in expected or (head and n == "lm_head.weight")}

    async def _apply(self, version: int, tensors: dict[str, torch.Tensor] | AdapterVersion) -> None:
        if isinstance(tensors, AdapterVersion):  # no pause: requests keep their own adapters (sglang_lora)
            policy = self.policy
            restart = [rid for rid, oldest in self._inflight.items()
                       if policy is not None and policy.interrupt(oldest, version) == "restart"]
            await self._adapters.install(version, tensors.spec, tensors.tensors, disk=self.update == "disk",
                                         restart=restart)
            self._version = version
            self.stats["updates"] += 1
            return
        inflight = dict(self._inflight)
        if not inflight:
            await self._update(version, tensors)
            return
        await self._call("POST", "/pause_generation", {"mode": self.pause_mode})
        try:
            for rid, oldest in inflight.items():
                if self.policy is not None and self.policy.interrupt(oldest, version) == "restart":
                    await self._call("POST", "/abort_request", {"rid": rid})
                    self.stats["interrupted"] += 1
            held = self._version
            await self._update(version, tensors, flush_cache=False, probe=False)
        finally:
            await self._call("POST", "/continue_generation", {})
        if self._probing:  # a paused server answers no probe: checked once requests go on
            try:
                await self._check_landed(version, tensors)
            except PushMismatch:
                self._version = held
                raise

    async def _update(self, version: int, tensors: dict[str, torch.Tensor], flush_cache: bool = True,
                      probe: bool = True) -> None:
        await self._updater.apply(version, tensors, self.update)
        if probe and self._probing:
            await self._check_landed(version, tensors)
        self._version = version
        self.stats["updates"] += 1
        await self._adapters.base_replaced()
        if flush_cache:  # KV computed by older weights must not serve new requests' prefixes
            await self._call("POST", "/flush_cache", {}, check=False)

    async def _check_landed(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """The server's probe logprobs equal the version's (sglang_probe); else the server gets back what it
        held before (the last version applied, or its model folder) and the version is refused."""
        if self._probe is None:
            self._probe = WeightProbe(self.model_path, self.dtype)
        tolerance = dtype_tolerance(self.probe_tolerance, self.dtype)
        expected = await anyio.to_thread.run_sync(self._probe.expected, tensors, tolerance)
        answer = await self._call("POST", "/generate", self._probe.request(version))
        self.stats["probes"] = self.stats.get("probes", 0) + 1
        try:
            gap = self.stats["probe_gap"] = self._probe.check(version, expected, answer)
            self.stats["probe_gap_max"] = max(gap, self.stats.get("probe_gap_max", 0.0))  # over the engine's life
        except PushMismatch as exc:
            self.stats["pushes_refused"] = self.stats.get("pushes_refused", 0) + 1
            report_event(self.log_dir, "engine.push_mismatch", engine=self.name, version=version, error=str(exc))
            if self._held is not None and not isinstance(self._held[1], AdapterVersion):
                await self._updater.apply(self._held[0], self._held[1], self.update)
            else:  # the folder it started from
                await self._call("POST", "/begin_weight_update", {})
                await self._call("POST", "/update_weights_from_disk", {"model_path": str(self.model_path),
                                 "flush_cache": True, "weight_version": str(self._version)})
                await self._call("POST", "/end_weight_update", {})
            raise PushMismatch(f"engine {self.name}: {exc}") from None

    # -- HTTP and recovery ---------------------------------------------------------------------
    async def _call(self, method: str, path: str, body: dict | None = None, check: bool = True) -> Any:
        """One request, retried for 30 s while the server refuses connections; raises ServerGone
        when it stays unreachable and EngineError on an error answer (when `check`)."""
        if self._http is None or self._http.closed:
            raise EngineError(f"engine {self.name} is {'stopped' if self._stopping else 'not started'}")
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(aiohttp.ClientConnectorError),
                stop=stop_after_delay(0 if self._server is not None and not self._server.alive() else 30),
                wait=wait_exponential(multiplier=0.1, max=2), reraise=True,
            ):
                with attempt:
                    async with self._http.request(method, self._base_url + path, json=body) as response:
                        text = await response.text()
                        status = response.status
        except (aiohttp.ClientConnectionError, aiohttp.ServerDisconnectedError) as exc:
            raise ServerGone(f"engine {self.name}: {method} {path} failed: {type(exc).__name__}: {exc}") from None
        payload: Any = json.loads(text) if text[:1] in ("[", "{") else text
        failed = status != 200 or (isinstance(payload, dict) and payload.get("success") is False)
        if check and failed:
            raise EngineError(f"engine {self.name}: {method} {path} answered {status}: {text[:500]}")
        return payload

    async def _answers(self) -> bool:
        """The server this engine launched still runs and answers its health check."""
        if self._server is None or not self._server.alive():
            return False
        try:
            await self._call("GET", "/health")
        except ServerGone:
            return False
        return True

    async def _recover(self) -> None:
        """The server stopped answering. Restart it if this engine launched it, then re-apply the
        latest weights; raise EngineError if it cannot be restarted (or is not ours to restart)."""
        assert self._restart_lock is not None
        async with self._restart_lock:
            if self._server is None:
                raise EngineError(f"engine {self.name}: server {self._base_url} is gone (not baton's to restart)")
            if await self._answers():
                return  # another caller already restarted it
            if self._server.alive():
                await anyio.to_thread.run_sync(self._server.stop)
            if self.stats["restarts"] >= self.max_restarts:
                raise EngineError(f"engine {self.name}: server died again after {self.max_restarts} restarts")
            self.stats["restarts"] += 1
            report_event(self.log_dir, "engine.restarted", engine=self.name, restart=self.stats["restarts"])
            self._updater.server_restarted()
            self._adapters.server_restarted()
            t0 = time.perf_counter()
            try:
                await self._server.start()
            except ServerFailed as exc:
                raise EngineError(f"engine {self.name}: restart failed: {exc}") from None
            self._base_url = self._server.url  # a new port when another process took the old one meanwhile
            if self._latest is not None:
                await self._apply(*self._latest)
                self._held = self._latest
            self.stats["restart_s"] = round(time.perf_counter() - t0, 2)

