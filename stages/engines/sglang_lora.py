"""LoRA adapters in an SGLang server: one adapter per version, named `policy-v{N}`, and the requests that
hold each (`ServerAdapters`, one per `SGLangEngine` launched with `lora=LoraServing(...)`).

A request starts under the engine's current adapter and keeps it to its end (SGLang binds an adapter to
a request): its tokens all come from that version, and it holds a reference to the adapter while it is
in flight. A new version:
1. aborts the requests the staleness policy restarts on it (they are generated again under it); nothing
   is paused, so no unload can ever wait on a paused request;
2. unloads every adapter that is neither current nor held by a request (never one a request holds:
   SGLang's unload waits for its requests, and a held adapter's unload would block), and removes what
   the server could reload it from (a `disk` adapter's folder; a tensor-loaded one has nothing to reload
   from, so a request naming it fails loudly instead of silently running an old version);
3. if the server is still full (`max_loaded` adapters), aborts the requests holding the oldest adapter and
   unloads it: SGLang's own LRU eviction is never reached, so it never unloads a held adapter either;
4. loads the version (`/load_lora_adapter_from_tensors` with a sha256 per tensor the server verifies, or
   `/load_lora_adapter` from a PEFT folder with `update = "disk"`), runs its probe (the descriptor's
   token sequence, teacher-forced under the new adapter: its logprobs must equal the learner's) and only
   then makes it current. A failed probe unloads it, reports `engine.adapter_mismatch` and refuses the
   version: an adapter that never reached the server is refused, not mistaken for staleness.

What stays resident is the staleness window: the current adapter and those live requests still use
(with `MaxStaleness(k)`, at most k + 1; k + 2 while a version loads, hence `max_loaded >= k + 2`). After
every load and unload the server's own list of adapters must equal this object's (else EngineError).
A restarted server holds nothing: the engine loads the current adapter (probe included) before it serves.
"""

from __future__ import annotations

import base64
import hashlib
import io
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

from pipeline.events import report_event
from stages.engines.base import EngineError
from stages.weights.adapter import AdapterError, AdapterSpec, Probe, adapter_pairs, peft_config, write_peft_folder

RELEASE_TIMEOUT_S = 60.0  # how long a full server waits for aborted requests to let go of the oldest adapter


@dataclass(frozen=True)
class LoraServing:
    """How a launched server serves adapters: its largest rank, the modules adapters may target, and how
    many adapters it holds at once (SGLang's `--max-loaded-loras`; at least the staleness bound k + 2)."""

    max_rank: int
    target_modules: tuple[str, ...]
    max_loaded: int = 4

    def __post_init__(self) -> None:
        if self.max_rank < 1 or self.max_loaded < 2 or not self.target_modules:
            raise ValueError(f"LoraServing needs max_rank >= 1, max_loaded >= 2 and target modules, got {self}")

    def launch_args(self, cpu: bool) -> tuple[str, ...]:
        """The server's LoRA flags (on CPU, SGLang's torch-native LoRA backend: it needs the pin_memory shim
        tools/sglang-cpu/install.sh installs)."""
        return ("--enable-lora", "--max-lora-rank", str(self.max_rank),
                "--lora-target-modules", *self.target_modules,
                "--max-loras-per-batch", str(self.max_loaded), "--max-loaded-loras", str(self.max_loaded),
                *(("--lora-backend", "torch_native") if cpu else ()))


def adapter_name(version: int) -> str:
    return f"policy-v{version}"


def fit_adapter(engine: str, serving: LoraServing | None, version: int, spec: AdapterSpec,
                tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], base: str) -> None:
    """EngineError unless the server can serve this adapter: launched with LoRA, the rank within its
    `max_rank`, the targets among its modules, made for its `base` (fingerprint), names and shapes fitting it."""
    if serving is None:
        raise EngineError(f"engine {engine} got the adapter of version {version} but its server was launched "
                          "without LoRA; give the engine lora=LoraServing(...) (learner.lora sets it)")
    problems = [] if spec.base == base else [f"it applies to base {spec.base}, this server serves {base}"]
    if spec.rank > serving.max_rank:
        problems.append(f"rank {spec.rank} is above the server's --max-lora-rank {serving.max_rank}")
    outside = [m for m in spec.target_modules if m not in serving.target_modules]
    if outside:
        problems.append(f"targets {outside} are not among the modules the server was launched to adapt "
                        f"{list(serving.target_modules)} (learner.lora.target_modules)")
    try:
        adapter_pairs(spec, tensors, shapes)
    except AdapterError as exc:
        problems.append(str(exc))
    if problems:
        raise EngineError(f"engine {engine}: the adapter of version {version} does not fit: {'; '.join(problems)}")


class ServerAdapters:
    """See the module docstring. `call(method, route, body, check=True)` is the engine's HTTP call;
    `stats` its counters (`interrupted`, `adapters_loaded`, `adapters_unloaded`, `adapters_refused`,
    `adapter_probes` and the largest probe gap seen, `adapter_probe_gap_max`)."""

    def __init__(self, engine: str, serving: LoraServing | None, call: Callable[..., Awaitable[Any]],
                 stats: dict[str, float]) -> None:
        self.engine, self.serving, self.call, self.stats = engine, serving, call, stats
        stats.update({"adapters_loaded": 0, "adapters_unloaded": 0, "adapters_refused": 0})
        self.current: tuple[str, int] | None = None  # the adapter new requests start under, and its version
        self.loaded: dict[str, int] = {}  # adapter name -> version, as the server holds them
        self.holders: dict[str, set[str]] = {}  # adapter name -> rids of the requests in flight under it
        self.folders: Path | None = None  # update = "disk": where each adapter's PEFT folder is written
        self.log_dir: Path | None = None  # engine events (the run folder)
        self.tolerance: float | None = None  # the bound a probe is held to (None: the descriptor's own)

    # -- requests ----------------------------------------------------------------------------------
    def acquire(self, rids: list[str], name: str | None = None) -> tuple[str, int] | None:
        """The adapter and version new requests start under (None: the base, before any adapter; `name`: that
        adapter, loaded by `add`), held by each of `rids` until `release`."""
        chosen = self.current
        if name is not None:
            if name not in self.loaded:
                raise EngineError(f"engine {self.engine}: no adapter {name!r} is loaded ({sorted(self.loaded)} are)")
            chosen = (name, self.loaded[name])
        if chosen is not None:
            self.holders.setdefault(chosen[0], set()).update(rids)
        return chosen

    def release(self, rids: list[str], name: str) -> None:
        self.holders.get(name, set()).difference_update(rids)

    def held(self, name: str) -> int:
        return len(self.holders.get(name, ()))

    # -- versions ----------------------------------------------------------------------------------
    async def install(self, version: int, spec: AdapterSpec, tensors: dict[str, torch.Tensor], disk: bool,
                      restart: list[str]) -> None:
        """Make `version`'s adapter current (steps 1-4 of the module docstring); `restart`: the requests the
        staleness policy restarts on it. EngineError, the engine left on its version, when it fails."""
        for rid in restart:
            await self._abort(rid)
            self.stats["interrupted"] += 1
        await self.collect()
        await self._make_room()
        name = adapter_name(version)
        if name in self.loaded:  # a refused earlier attempt left it (or a retry): load it afresh
            await self._unload(name)
        await self._load(name, version, spec, tensors, disk)
        if spec.probe is not None:
            await self._check_probe(name, version, spec.probe)
        self.current = (name, version)
        await self.collect()

    async def add(self, name: str, version: int, spec: AdapterSpec, tensors: dict[str, torch.Tensor],
                  disk: bool) -> None:
        """Load an adapter under `name` beside the versions, never current: a request runs under it when it names
        it (`acquire(rids, name)`); its probe is checked as a version's is. `version` tags its requests and their
        prefix cache (`extra_key`), so it must be unique among the adapters and the base's versions. It stays
        until `remove`: the caller keeps room (`max_loaded`), else the oldest loaded is evicted (`_make_room`)."""
        if name in self.loaded:
            await self.remove(name)
        await self._make_room()
        await self._load(name, version, spec, tensors, disk)
        if spec.probe is not None:
            await self._check_probe(name, version, spec.probe)

    async def remove(self, name: str) -> None:
        """Unload the adapter `name` once no request holds it (its requests end first; none is aborted)."""
        while self.held(name):
            await anyio.sleep(0.01)
        if name in self.loaded:
            await self._unload(name)

    async def scored(self, tokens: list[int], name: str | None, version: int) -> list[float]:
        """The server's teacher-forced logprob of each token of `tokens` after the first, under adapter `name` (None:
        the base); `version` keys the prefix cache as a request under it does."""
        answer = await self.call("POST", "/generate", {
            "input_ids": list(tokens), "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 0, "extra_key": f"v{version}",
            **({"lora_path": name} if name is not None else {})})
        return [lp for lp, *_ in answer["meta_info"]["input_token_logprobs"][1:]]

    async def collect(self) -> None:
        """Unload every adapter neither current nor held by a request in flight."""
        current = self.current[0] if self.current is not None else None
        for name in [n for n in self.loaded if n != current and not self.held(n)]:
            await self._unload(name)

    async def base_replaced(self) -> None:
        """Full weights replaced the base: new requests run on them alone, and idle adapters go."""
        self.current = None
        await self.collect()

    def server_restarted(self) -> None:
        """A new server holds no adapter; the requests of the old one are gone."""
        self.loaded.clear()
        self.holders.clear()
        self.current = None

    async def close(self) -> None:
        if self.folders is not None:
            await anyio.to_thread.run_sync(shutil.rmtree, self.folders, True)
            self.folders = None

    async def _make_room(self) -> None:
        """Until one more adapter fits: abort the requests holding the oldest one, wait until they let go,
        and unload it."""
        assert self.serving is not None
        while len(self.loaded) + 1 > self.serving.max_loaded:
            current = self.current[0] if self.current is not None else None
            oldest = min((n for n in self.loaded if n != current), key=self.loaded.__getitem__)
            for rid in list(self.holders.get(oldest, ())):
                await self._abort(rid)
                self.stats["interrupted"] += 1
            with anyio.move_on_after(RELEASE_TIMEOUT_S):
                while self.held(oldest):
                    await anyio.sleep(0.01)
            if self.held(oldest):
                raise EngineError(f"engine {self.engine}: {self.held(oldest)} aborted requests still hold {oldest} "
                                  f"after {RELEASE_TIMEOUT_S:.0f} s; the server has no room for another adapter")
            await self._unload(oldest)

    async def _load(self, name: str, version: int, spec: AdapterSpec, tensors: dict[str, torch.Tensor],
                    disk: bool) -> None:
        if disk:
            if self.folders is None:
                root = self.log_dir if self.log_dir is not None else Path(tempfile.gettempdir())
                root.mkdir(parents=True, exist_ok=True)
                self.folders = Path(tempfile.mkdtemp(prefix=f"adapters-{self.engine}-", dir=root))
            folder = await anyio.to_thread.run_sync(write_peft_folder, self.folders / name, spec, tensors)
            body = {"lora_name": name, "lora_path": str(folder)}
            answer = await self.call("POST", "/load_lora_adapter", body)
        else:
            payload, checksums = await anyio.to_thread.run_sync(_serialize_adapter, tensors)
            answer = await self.call("POST", "/load_lora_adapter_from_tensors", {
                "lora_name": name, "config_dict": peft_config(spec), "serialized_named_tensors": [payload],
                "expected_checksums": checksums})
        self.loaded[name] = version
        self.stats["adapters_loaded"] += 1
        self._agree(answer)

    async def _unload(self, name: str) -> None:
        answer = await self.call("POST", "/unload_lora_adapter", {"lora_name": name})
        self.loaded.pop(name, None)
        self.holders.pop(name, None)
        self.stats["adapters_unloaded"] += 1
        if self.folders is not None:  # nothing left to reload it from
            await anyio.to_thread.run_sync(shutil.rmtree, self.folders / name, True)
        self._agree(answer)

    def _agree(self, answer: Any) -> None:
        """The server's list of adapters (every load and unload answers with it) is this object's."""
        served = set((answer or {}).get("loaded_adapters") or {}) if isinstance(answer, dict) else None
        if served is not None and served != set(self.loaded):
            raise EngineError(f"engine {self.engine}: the server holds adapters {sorted(served)}, the engine "
                              f"expected {sorted(self.loaded)}")

    async def _abort(self, rid: str) -> None:
        await self.call("POST", "/abort_request", {"rid": rid})

    async def _served_probe(self, name: str, probe: Probe) -> list[float]:
        """The server's teacher-forced logprob of each probe token after the first, under adapter `name`."""
        answer = await self.call("POST", "/generate", {
            "input_ids": list(probe.tokens), "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 0, "lora_path": name, "extra_key": f"probe-{name}"})
        return [lp for lp, *_ in answer["meta_info"]["input_token_logprobs"][1:]]

    async def _check_probe(self, name: str, version: int, probe: Probe) -> None:
        """The probe's logprobs under `name` within `self.tolerance` (None: the descriptor's own) of the learner's;
        else the adapter is unloaded and the version refused (EngineError)."""
        diff = probe.difference(await self._served_probe(name, probe))
        tolerance = probe.tolerance if self.tolerance is None else self.tolerance
        self.stats["adapter_probes"] = self.stats.get("adapter_probes", 0) + 1
        self.stats["adapter_probe_gap_max"] = max(diff, self.stats.get("adapter_probe_gap_max", 0.0))
        if diff <= tolerance:
            return
        self.stats["adapters_refused"] += 1
        report_event(self.log_dir, "engine.adapter_mismatch", engine=self.engine, version=version,
                     difference=round(diff, 6))
        await self._unload(name)
        raise EngineError(f"engine {self.engine}: adapter {name} fails its probe: its logprobs differ from the "
                          f"learner's by {diff:.3g} (tolerance {tolerance:g}); the version is refused")


def _serialize_adapter(tensors: dict[str, torch.Tensor]) -> tuple[str, dict[str, str]]:
    """SGLang's `load_lora_adapter_from_tensors` payload (its same-host protocol: shared-memory handles,
    see `stages.engines.sglang_update._serialize_shared`) and a sha256 per tensor the server checks."""
    from multiprocessing.reduction import ForkingPickler

    torch.multiprocessing.set_sharing_strategy("file_system")
    named = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
    checksums = {n: hashlib.sha256(t.view(-1).view(torch.uint8).numpy()).hexdigest() for n, t in named.items()}
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode(), checksums
