"""SGLangServer's port handling, on a real subprocess that binds and serves like SGLang's HTTP front (a
stand-in for `sglang.launch_server`, so it runs without an SGLang environment): a restart whose port another
process took meanwhile moves to a fresh port instead of waiting out its launch timeout on a port it cannot
bind, a foreign server answering on the port is not taken for this one, and a port the caller named is
never moved."""

from __future__ import annotations

import http.server
import socket
import sys
import threading
from pathlib import Path

import pytest

from stages.engines.sglang_server import PortTaken, SGLangServer

pytestmark = pytest.mark.anyio

# binds --port, answers every GET with 200; when the port is taken it logs the error and waits, unbound, as
# SGLang does (uvicorn logs "address already in use" and the server does not exit)
STAND_IN = """
import http.server, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as exc:
    print(f"ERROR: error while attempting to bind on address: {exc}", flush=True)
    time.sleep(3600)
print(f"serving on {port}", flush=True)
server.serve_forever()
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class AlwaysOk(http.server.BaseHTTPRequestHandler):
    """A foreign server's handler: 200 to every GET, /health included."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


class StandIn(SGLangServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", STAND_IN, "--port", str(self.port)]


def stand_in(tmp_path: Path, port: int | None = None) -> StandIn:
    return StandIn("unused-model", port=port, log_path=tmp_path / "server.log", launch_timeout_s=30)


def listener(port: int) -> socket.socket:
    """A foreign process's listening socket on `port` (it accepts, never answers)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the crashed server's connections may linger
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


async def test_a_restart_whose_port_was_taken_moves_to_a_fresh_one(tmp_path) -> None:
    server = stand_in(tmp_path)
    await server.start()
    crashed_on = server.port
    server.kill()
    with listener(crashed_on):  # another process got the port between the crash and the restart
        await server.start()
        try:
            assert server.alive() and server.port != crashed_on
            assert f"serving on {server.port}" in (tmp_path / "server.log").read_text()
        finally:
            server.stop()


async def test_a_foreign_server_answering_on_the_port_is_not_taken_for_this_one(tmp_path) -> None:
    server = stand_in(tmp_path)
    await server.start()
    crashed_on = server.port
    server.kill()
    foreign = http.server.HTTPServer(("127.0.0.1", crashed_on), AlwaysOk)
    thread = threading.Thread(target=foreign.serve_forever, daemon=True)
    thread.start()
    try:
        await server.start()  # /health answers 200 at once, from the foreign process
        try:
            assert server.port != crashed_on, "a foreign server's 200 passed for this server's health"
        finally:
            server.stop()
    finally:
        foreign.shutdown()
        foreign.server_close()


async def test_a_port_the_caller_named_is_never_moved(tmp_path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with listener(port):
        server = stand_in(tmp_path, port=port)
        with pytest.raises(PortTaken, match=f"port {port} is taken"):
            await server.start()
        assert server.port == port and not server.alive()
