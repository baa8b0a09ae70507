"""`--register-with`: the server announces itself to SGLang's encoder registry (`POST
/register_encoder_url`), retrying until the registry is up, and withdraws on drain (`DELETE
/unregister_encoder_url`). A stand-in registry on loopback records what it is sent."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from encode_server.ops.setting_values import advertised_url, registry_urls
from encode_server.ops.settings import Settings
from tests.support.helpers import ServerProcess, free_port


class Registry:
    """SGLang's EncoderBootstrapServer routes, recording (method, path, body)."""

    def __init__(self, port: int) -> None:
        calls = self.calls = []

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
                calls.append((self.command, self.path, body))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"OK")

            do_POST = do_DELETE = _record

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, method: str, timeout: float = 20.0) -> tuple:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for call in self.calls:
                if call[0] == method:
                    return call
            time.sleep(0.05)
        raise AssertionError(f"no {method} within {timeout} s: {self.calls}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_registers_once_the_registry_is_up_and_withdraws_on_drain():
    port = free_port()
    registry = None
    try:
        with ServerProcess("--register-with", f"http://127.0.0.1:{port}") as server:
            registry = Registry(port)  # SGLang comes up after the encoder: the server keeps trying
            assert registry.wait_for("POST") == ("POST", "/register_encoder_url", {"url": server.url})
            assert not [call for call in registry.calls if call[0] == "DELETE"]
        assert registry.wait_for("DELETE", timeout=5) == ("DELETE", "/unregister_encoder_url", {"url": server.url})
    finally:
        if registry is not None:
            registry.close()


def test_advertised_url_and_registry_list():
    assert advertised_url("127.0.0.1", 30000, None) == "http://127.0.0.1:30000"
    assert advertised_url("::1", 30000, None) == "http://[::1]:30000"
    assert advertised_url("0.0.0.0", 30000, "http://encoder-3:30000/") == "http://encoder-3:30000"
    with pytest.raises(ValueError, match="--advertise-url"):
        advertised_url("0.0.0.0", 30000, None)
    assert registry_urls(" http://a:1/, https://b:2 ,") == ["http://a:1", "https://b:2"]
    with pytest.raises(ValueError, match="http"):
        registry_urls("a:1")


def test_settings_refuse_a_registry_they_cannot_advertise_to():
    with pytest.raises(ValueError, match="--advertise-url"):
        Settings(host="0.0.0.0", register_with="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="not an http"):
        Settings(register_with="tcp://127.0.0.1:1")
    assert Settings(host="0.0.0.0", register_with="http://127.0.0.1:1", advertise_url="http://10.0.0.7:30000")
