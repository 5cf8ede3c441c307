"""SGLangEngine's own logic against a scripted HTTP stand-in (the real server:
tests/stages/engines/test_sglang.py)."""

from __future__ import annotations

import pytest
from aiohttp import web

from stages.engines.base import EngineError, SamplingParams
from stages.engines.sglang import MAX_ROUNDS, SGLangEngine

pytestmark = pytest.mark.anyio


async def serve(handler) -> tuple[web.AppRunner, str]:
    async def health(request):
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def answer(rid: str, finish: dict, tokens: list[int], spans=None) -> dict:
    meta = {"id": rid, "finish_reason": finish, "output_token_logprobs": [[-0.5, t, None] for t in tokens]}
    if spans is not None:
        meta["weight_versions"] = spans
    return {"output_ids": tokens, "meta_info": meta}


async def test_requests_aborted_again_and_again_fail_with_the_servers_reason(tmp_path) -> None:
    calls = []

    async def always_abort(request):
        body = await request.json()
        calls.append(len(body["rid"]))
        return web.json_response([answer(r, {"type": "abort", "message": "KV cache full"}, []) for r in body["rid"]])

    runner, url = await serve(always_abort)
    engine = SGLangEngine(tmp_path, url=url)
    await engine.start()
    try:
        with pytest.raises(EngineError, match="aborted 8 times in a row.*KV cache full"):
            await engine.generate([[1, 2]] * 3, SamplingParams(max_new_tokens=4))
        assert calls == [3] * MAX_ROUNDS and engine.stats["regenerated"] == 3 * MAX_ROUNDS
    finally:
        await engine.stop()
        await runner.cleanup()


async def test_only_aborted_requests_are_sent_again_and_spans_set_each_tokens_version(tmp_path) -> None:
    rounds = []

    async def abort_first_once(request):
        body = await request.json()
        rounds.append(body["input_ids"])
        out = []
        for i, rid in enumerate(body["rid"]):
            if len(rounds) == 1 and i == 0:
                out.append(answer(rid, {"type": "abort", "message": "interrupted"}, [5]))
            else:
                spans = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]
                out.append(answer(rid, {"type": "stop", "matched": 9}, [5, 6, 9], spans))
        return web.json_response(out)

    runner, url = await serve(abort_first_once)
    engine = SGLangEngine(tmp_path, url=url)
    await engine.start()
    try:
        out = await engine.generate([[1, 7], [1, 8]], SamplingParams(max_new_tokens=4, stop_token_ids=(9,)))
        assert rounds == [[[1, 7], [1, 8]], [[1, 7]]]  # the aborted one alone, from its prompt
        for c in out:
            assert c.tokens.tolist() == [5, 6, 9] and c.versions.tolist() == [3, 4, 4]
            assert c.finish_reason == "stop"
    finally:
        await engine.stop()
        await runner.cleanup()


class _LiveProcess:
    """The launched server's process, still running (what `SGLangServer.alive` reports)."""

    def alive(self) -> bool:
        return True


async def test_a_push_whose_connection_dropped_while_the_server_lives_is_refused_then_taken_when_sent_again(
        tmp_path, monkeypatch) -> None:
    """A dropped connection mid-push (a loaded machine) is no dead server: the version did not land, so it is
    refused (the transport sends it again) instead of taken for landed, which ignored every later copy of it."""
    from stages.engines.sglang import ServerGone

    async def nothing(request):
        return web.json_response([])

    runner, url = await serve(nothing)
    engine = SGLangEngine(tmp_path, url=url)
    await engine.start()
    applied, drops = [], [ServerGone("POST /update_weights_from_tensor failed: ServerDisconnectedError")]

    async def apply(version, tensors) -> None:
        if drops:
            raise drops.pop()
        applied.append(version)
        engine._version = version

    monkeypatch.setattr(engine, "_fit", lambda version, tensors: tensors)
    monkeypatch.setattr(engine, "_apply", apply)
    engine._server = _LiveProcess()
    try:
        with pytest.raises(EngineError, match="version 1 did not land"):
            await engine.receive_weights(1, {})
        assert engine.version == 0
        await engine.receive_weights(1, {})
        assert applied == [1] and engine.version == 1
    finally:
        engine._server = None
        await engine.stop()
        await runner.cleanup()


async def test_a_push_into_a_server_that_died_and_was_restarted_with_it_is_no_error(tmp_path, monkeypatch) -> None:
    """The server died mid-push and a request's recovery restarted it meanwhile, re-applying the latest version,
    this one: the push is not refused as a dropped connection (the server answers, and holds the version)."""
    from stages.engines.sglang import ServerGone

    async def nothing(request):
        return web.json_response([])

    runner, url = await serve(nothing)
    engine = SGLangEngine(tmp_path, url=url)
    await engine.start()
    applied, restarted = [], []

    async def apply(version, tensors) -> None:
        raise ServerGone("POST /update_weights_from_tensor failed: ServerDisconnectedError")

    async def recover() -> None:  # what the restart does: a new server, then the latest version applied
        restarted.append(engine._latest[0])
        engine._held = engine._latest

    monkeypatch.setattr(engine, "_fit", lambda version, tensors: tensors)
    monkeypatch.setattr(engine, "_apply", apply)
    monkeypatch.setattr(engine, "_recover", recover)
    engine._server = _LiveProcess()
    try:
        await engine.receive_weights(1, {})
        assert restarted == [1] and applied == []
    finally:
        engine._server = None
        await engine.stop()
        await runner.cleanup()
