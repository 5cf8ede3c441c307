"""Push time per weight transport into a vLLM server against into an SGLang server, on the same tiny model
(head dim 32, so vLLM's CPU attention takes it) and the same versions, in one run.

For each engine kind (its server started in turn, one at a time) and each transport that reaches an engine in
the receiving process (`inproc`, `disk`, `delta`, `mooncake_p2p`), the engine is subscribed behind the mailboxes
an engine process registers (as a producer's is) and `--versions` versions are published; each figure is the
median seconds from `publish` to its return (every version applied and, for both engines, checked by the
server's probe logprobs). A version moves about 1/`--every` of each tensor's elements (a sparse RL step), so
`delta` has something to save; with vLLM it also goes into the server as a delta (`VLLMEngine(push="delta")`).

`ratios.<transport>` is vLLM's median push seconds over SGLang's (below 1: vLLM takes it faster). Needs
`.venv-vllm` and `.venv-sglang`. Prints a table to stderr and, as the last stdout line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(1)

from stages.data.model import load_model, make_tiny_model  # noqa: E402
from stages.weights import engine_mailboxes, make_transport  # noqa: E402

TRANSPORTS = {"inproc": {}, "disk": {"root": None}, "delta": {}, "mooncake_p2p": {"bucket_bytes": 1 << 20}}


class Mailboxes:
    """An engine process's mailboxes for one engine, reached through `transport.remote_receiver`."""

    def __init__(self, engine, kind: str) -> None:
        self.boxes = engine_mailboxes([engine], kind)

    async def ask(self, box: str, header: bytes) -> bytes | None:
        return await self.boxes[box](header, None)

    async def deliver(self, box: str, header: bytes, blob) -> None:
        await self.boxes[box](header, blob)


def version_of(base: dict[str, torch.Tensor], seed: int, every: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in base.items():
        t = t.detach().clone()
        t.view(-1)[::every] += 0.01 * torch.randn(t.view(-1)[::every].shape, generator=g)
        out[n] = t
    return out


def make_engine(kind: str, folder: Path, logs: Path):
    if kind == "vllm":
        from stages.engines.vllm import VLLMEngine

        return VLLMEngine(folder, name="bench-vllm", log_dir=logs)
    from stages.engines.sglang import SGLangEngine

    return SGLangEngine(folder, name="bench-sglang", log_dir=logs)


async def push_seconds(kind: str, folder: Path, tmp: Path, args) -> dict[str, float]:
    """Median publish seconds per transport into one `kind` engine (its server started once)."""
    base = dict(load_model(folder).named_parameters())  # a tied head is no parameter of its own: it stays tied
    engine = make_engine(kind, folder, tmp / f"logs-{kind}")
    await engine.start()
    figures, version = {}, 0
    try:
        for name, options in TRANSPORTS.items():
            if kind == "vllm":
                engine.push = "delta" if name == "delta" else "full"
            options = {**options, **({"root": tmp / f"weights-{kind}"} if "root" in options else {})}
            transport = make_transport(name, **options)
            transport.subscribe(transport.remote_receiver(Mailboxes(engine, name), engine.name))
            times = []
            try:
                for i in range(args.versions + 1):  # the first (a whole version everywhere) is not timed
                    version += 1
                    state = version_of(base, version, args.every)
                    t0 = time.perf_counter()
                    await transport.publish(version, state)
                    if i:
                        times.append(time.perf_counter() - t0)
            finally:
                await transport.close()
            figures[name] = statistics.median(times)
            print(f"{kind:7s} {name:13s} {figures[name] * 1000:8.1f} ms per version", file=sys.stderr)
    finally:
        await engine.stop()
    return figures


async def main(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="baton-vllm-pushes-") as tmp:
        tmp = Path(tmp)
        folder = make_tiny_model(tmp / "hd32", heads=2, kv_heads=1)
        measured = {kind: await push_seconds(kind, folder, tmp, args) for kind in ("sglang", "vllm")}
    ratios = {name: round(measured["vllm"][name] / measured["sglang"][name], 3) for name in TRANSPORTS}
    return {"seconds": {k: {n: round(s, 4) for n, s in v.items()} for k, v in measured.items()},
            "versions": args.versions, "every": args.every, "ratios": ratios}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=5, help="timed versions per transport")
    parser.add_argument("--every", type=int, default=16, help="a version moves every n-th element")
    print(json.dumps(anyio.run(main, parser.parse_args())))
