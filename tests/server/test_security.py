"""Hostile input: the URL guard (decided without connecting; refused end to end on loopback only),
local files, bombs, oversized bodies, the API key, a corpus of bad requests and a fuzz test."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import http.server
import ipaddress
import json
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from encode_server.media.decoding import MediaError, MediaLimits
from encode_server.media.loader import MediaLoader, parse_item
from encode_server.media.url_guard import (
    BlockedAddressError,
    GuardedConnector,
    address_refusal,
    content_type_refusal,
    resolve_local_path,
)
from encode_server.ops.setting_values import exempt_networks, in_networks
from encode_server.ops.settings import Settings, load_settings
from tests.support.helpers import InProcessServer, ServerProcess, image_b64, png_bytes

# --- the address policy, decided without any connection ---------------------------------------


@pytest.mark.parametrize("address,label", [
    ("127.0.0.1", "loopback"), ("127.9.9.9", "loopback"), ("::1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("fc00::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"),
    ("240.0.0.1", "reserved"), ("100.64.0.1", "public"), ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:10.0.0.1", "private"), ("192.0.2.1", "private"),
])
def test_non_public_addresses_are_refused(address, label):
    reason = address_refusal(address, allow_private=False)
    assert reason is not None and label in reason


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "93.184.216.34"])
def test_public_addresses_are_allowed(address):
    assert address_refusal(address, allow_private=False) is None


def test_allow_private_opens_loopback_private_and_link_local_but_not_multicast():
    for address in ("127.0.0.1", "10.0.0.1", "169.254.1.1", "::1", "fe80::1"):
        assert address_refusal(address, allow_private=True) is None
    assert address_refusal("224.0.0.1", allow_private=True) is not None
    assert address_refusal("0.0.0.0", allow_private=True) is not None


class FakeResolver:
    """Answers every name with fixed addresses; no DNS traffic at all."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = addresses

    async def resolve(self, host, port=0, family=0):
        return [{"hostname": host, "host": a, "port": port, "family": 0, "proto": 0, "flags": 0}
                for a in self.addresses]

    async def close(self):
        pass


def resolve_with_guard(host: str, *answers: str, allow_private: bool = False):
    async def run():
        connector = GuardedConnector(allow_private=allow_private, resolver=FakeResolver(*answers))
        try:
            return await connector._resolve_host(host, 80)
        finally:
            await connector.close()

    return asyncio.run(run())


def test_a_name_resolving_to_a_private_address_is_refused_before_connecting():
    with pytest.raises(BlockedAddressError, match="10.0.0.7 is a private address"):
        resolve_with_guard("rebinding.example", "10.0.0.7")


def test_only_the_allowed_answers_of_a_mixed_resolution_are_used():
    results = resolve_with_guard("mixed.example", "127.0.0.1", "8.8.4.4")
    assert [r["host"] for r in results] == ["8.8.4.4"]


def test_ip_literals_are_judged_too():
    with pytest.raises(BlockedAddressError):
        resolve_with_guard("169.254.169.254")


def test_content_type_sanity():
    assert content_type_refusal("image/png", "image") is None
    assert content_type_refusal("application/octet-stream", "audio") is None
    assert content_type_refusal("audio/wav; codecs=1", "audio") is None
    assert content_type_refusal(None, "video") is None
    assert "text/html" in content_type_refusal("text/html; charset=utf-8", "image")
    assert content_type_refusal("application/json", "audio") is not None


def test_local_paths_only_inside_the_allowed_folder(tmp_path):
    media, outside = tmp_path / "media", tmp_path / "secret"
    media.mkdir()
    outside.mkdir()
    (media / "ok.png").write_bytes(b"x")
    (outside / "key.png").write_bytes(b"x")
    (media / "link.png").symlink_to(outside / "key.png")
    assert resolve_local_path(str(media / "ok.png"), str(media)) == (media / "ok.png").resolve()
    assert resolve_local_path(f"file://{media}/ok.png", str(media)) == (media / "ok.png").resolve()
    for bad in (f"{media}/../secret/key.png", str(media / "link.png"), "/etc/passwd", f"file://{outside}/key.png",
                "relative/ok.png", str(media / "missing.png")):
        with pytest.raises(PermissionError):
            resolve_local_path(bad, str(media))
    with pytest.raises(PermissionError, match="allowed-local-media-dir"):
        resolve_local_path(str(media / "ok.png"), None)


def test_a_base64_jpeg_that_starts_with_a_slash_is_not_a_path():
    jpeg = base64.b64encode(png_bytes(8, 8, fmt="JPEG")).decode()
    assert jpeg.startswith("/9j/")
    assert parse_item(jpeg, 0, "image").kind == "base64"
    assert parse_item("/data/cat.jpg", 0, "image").kind == "file"


# --- fetching over loopback: redirects are checked again ---------------------------------------

class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict = {}

    def do_GET(self):  # noqa: N802
        status, headers, body = self.routes.get(self.path, (404, {}, b""))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve(host: str, routes: dict) -> http.server.ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"routes": routes})
    httpd = http.server.ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_a_redirect_to_a_refused_address_is_refused():
    """127.0.0.2 stands for a public host (allowed here); it redirects to 127.0.0.3, which is not."""
    target = serve("127.0.0.3", {"/cat.png": (200, {"Content-Type": "image/png"}, png_bytes(28, 28))})
    front = serve("127.0.0.2", {
        "/direct.png": (200, {"Content-Type": "image/png"}, png_bytes(28, 28)),
        "/hop.png": (302, {"Location": f"http://127.0.0.3:{target.server_address[1]}/cat.png"}, b""),
    })
    limits = dataclasses.replace(MediaLimits.from_settings(Settings(), adapter=None),
                                 extra_allowed_networks=(ipaddress.ip_network("127.0.0.2/32"),))

    async def fetch(path: str):
        loader = MediaLoader(ThreadPoolExecutor(1), limits)
        try:
            source = parse_item(f"http://127.0.0.2:{front.server_address[1]}{path}", 0, "image")
            return await loader.load("image", [source], lambda modality, item: None)
        finally:
            await loader.close()

    try:
        assert asyncio.run(fetch("/direct.png"))[0].decoded.size == (28, 28)
        with pytest.raises(MediaError, match="127.0.0.3 is a loopback address"):
            asyncio.run(fetch("/hop.png"))
    finally:
        front.shutdown()
        target.shutdown()


# --- the server end to end: hostile corpus, fuzzing, keys ---------------------------------------

def png_claiming(width: int, height: int) -> bytes:
    """A valid-looking PNG whose header claims `width x height` pixels (no pixel data to speak of)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk
            + struct.pack(">I", zlib.crc32(chunk) & 0xFFFFFFFF) + b"\x00\x00\x00\x00IEND\xaeB`\x82")


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "ok.png").write_bytes(png_bytes(56, 56))
    (folder / "page.html").write_text("<html></html>")
    return folder


@pytest.fixture(scope="module")
def guarded_server(media_dir):
    with InProcessServer("--allowed-local-media-dir", str(media_dir), "--max-image-pixels", "1000000",
                         "--max-request-bytes", "2000000") as server:
        yield server


@pytest.fixture(scope="module")
def loopback_site():
    site = serve("127.0.0.1", {
        "/cat.png": (200, {"Content-Type": "image/png"}, png_bytes(56, 56)),
        "/page.html": (200, {"Content-Type": "text/html"}, b"<html>hi</html>"),
    })
    yield f"http://127.0.0.1:{site.server_address[1]}"
    site.shutdown()


def hostile_corpus(site: str, media_dir) -> list[tuple[str, object]]:
    """(name, body) pairs; every one must get a 4xx with a message."""
    good = image_b64(56, 56)
    base = {"req_id": "h", "modality": "image"}
    return [
        ("ssrf loopback", {**base, "mm_items": [f"{site}/cat.png"]}),
        ("ssrf localhost name", {**base, "mm_items": [site.replace("127.0.0.1", "localhost") + "/cat.png"]}),
        ("ssrf ipv6 loopback", {**base, "mm_items": ["http://[::1]:9/x.png"]}),
        ("ssrf mapped loopback", {**base, "mm_items": ["http://[::ffff:127.0.0.1]:9/x.png"]}),
        ("ssrf decimal ip", {**base, "mm_items": ["http://2130706433/x.png"]}),
        ("ssrf unspecified", {**base, "mm_items": ["http://0.0.0.0:9/x.png"]}),
        ("ssrf in url object", {**base, "mm_items": [{"url": f"{site}/cat.png"}]}),
        ("ssrf in a video frame", {**base, "modality": "video", "mm_items": [{"frames": [f"{site}/cat.png"]}]}),
        ("ftp scheme", {**base, "mm_items": ["ftp://127.0.0.1/x.png"]}),
        ("gopher scheme", {**base, "mm_items": ["gopher://127.0.0.1:70/_x"]}),
        ("file outside dir", {**base, "mm_items": ["file:///etc/passwd"]}),
        ("path traversal", {**base, "mm_items": [f"{media_dir}/../../etc/passwd"]}),
        ("plain absolute path outside", {**base, "mm_items": ["/etc/hostname"]}),
        ("local html file", {**base, "mm_items": [f"{media_dir}/page.html"]}),
        ("pixel bomb header", {**base, "mm_items": [base64.b64encode(png_claiming(60000, 60000)).decode()]}),
        ("over max pixels", {**base, "mm_items": [image_b64(1200, 1000)]}),
        ("truncated png", {**base, "mm_items": [base64.b64encode(png_bytes(64, 64)[:80]).decode()]}),
        ("zero-size png", {**base, "mm_items": [base64.b64encode(png_claiming(0, 0)).decode()]}),
        ("random bytes", {**base, "mm_items": [base64.b64encode(bytes(range(256)) * 4).decode()]}),
        ("empty base64", {**base, "mm_items": [""]}),
        ("bad base64", {**base, "mm_items": ["@@@@"]}),
        ("data uri without comma", {**base, "mm_items": ["data:image/png;base64"]}),
        ("data uri of text", {**base, "mm_items": ["data:text/plain,hello"]}),
        ("audio as image", {**base, "modality": "audio", "mm_items": [good]}),
        ("nested frames", {**base, "modality": "video", "mm_items": [{"frames": [{"frames": [good]}]}]}),
        ("frames for image", {**base, "mm_items": [{"frames": [good]}]}),
        ("two keys in item", {**base, "mm_items": [{"url": "http://x", "data": good}]}),
        ("req_id int", {**base, "req_id": 7, "mm_items": [good]}),
        ("req_id empty", {**base, "req_id": "", "mm_items": [good]}),
        ("modality list", {**base, "modality": ["image"], "mm_items": [good]}),
        ("mm_items string", {**base, "mm_items": good}),
        ("mm_items null", {**base, "mm_items": None}),
        ("num_parts zero", {**base, "num_parts": 0, "mm_items": [good]}),
        ("part_idx negative", {**base, "part_idx": -1, "mm_items": [good]}),
        ("part_idx string", {**base, "part_idx": "0", "mm_items": [good]}),
        ("embedding_port string", {**base, "prefill_host": "127.0.0.1", "embedding_port": "5555", "mm_items": [good]}),
        ("embedding_port out of range", {**base, "prefill_host": "127.0.0.1", "embedding_port": 70000,
                                         "mm_items": [good]}),
        ("prefill_host wildcard", {**base, "prefill_host": "0.0.0.0", "embedding_port": 5555, "mm_items": [good]}),
        ("return_embedding string", {**base, "return_embedding": "yes", "mm_items": [good]}),
        ("timeout negative", {**base, "timeout_s": -1, "mm_items": [good]}),
        ("timeout string", {**base, "timeout_s": "5", "mm_items": [good]}),
        ("body is a list", [base]),
        ("body is a number", 42),
        ("deeply nested", json.loads("[" * 200 + "]" * 200)),
    ]


def test_hostile_corpus_gets_4xx_with_messages_and_the_server_keeps_serving(guarded_server, loopback_site,
                                                                             media_dir):
    corpus = hostile_corpus(loopback_site, media_dir)
    assert len(corpus) >= 30
    with httpx.Client(timeout=30) as client:
        for name, body in corpus:
            response = client.post(guarded_server.url + "/encode", json=body)
            assert 400 <= response.status_code < 500, (name, response.status_code, response.text)
            error = response.json()
            assert error["status"] == "error" and len(error["message"]) > 5, (name, error)
        for raw in (b"{" * 50_000, b"\xff\xfe garbage", b'{"req_id": "x", "mm_items": [' + b"1," * 10 + b"]",
                    b'{"req_id": "n", "modality": "image", "mm_items": ["AAAA"], "timeout_s": NaN}',
                    b'{"req_id": "i", "modality": "image", "mm_items": ["AAAA"], "timeout_s": Infinity}'):
            response = client.post(guarded_server.url + "/encode", content=raw)
            assert response.status_code == 400, raw[:20]
        ok = client.post(guarded_server.url + "/encode", json={
            "req_id": "after", "modality": "image", "mm_items": [f"{media_dir}/ok.png", f"file://{media_dir}/ok.png"]})
        assert ok.status_code == 200, ok.text
        assert client.get(guarded_server.url + "/health").json() == {"status": "ok"}
        refused = client.post(guarded_server.url + "/encode", json={
            "req_id": "ssrf", "modality": "image", "mm_items": [f"{loopback_site}/cat.png"]}).json()
        assert "127.0.0.1 is a loopback address" in refused["message"] and "mm_items[0]" in refused["message"]


def test_oversized_bodies_are_413_with_or_without_content_length(guarded_server):
    big = json.dumps({"req_id": "big", "modality": "image", "mm_items": ["A" * 2_500_000]}).encode()
    assert httpx.post(guarded_server.url + "/encode", content=big).status_code == 413

    def chunks():
        for _ in range(50):
            yield b"A" * 100_000

    response = httpx.post(guarded_server.url + "/encode", content=chunks())
    assert response.status_code == 413 and "limit" in response.json()["message"]


def test_allowed_private_urls_fetch_and_content_type_is_checked(loopback_site):
    with InProcessServer("--allow-private-urls", "true") as server:
        ok = httpx.post(server.url + "/encode", json={"req_id": "u", "modality": "image",
                                                     "mm_items": [f"{loopback_site}/cat.png"]})
        assert ok.status_code == 200, ok.text
        html = httpx.post(server.url + "/encode", json={"req_id": "h", "modality": "image",
                                                       "mm_items": [f"{loopback_site}/page.html"]})
        assert html.status_code == 400 and "text/html" in html.json()["message"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
encode_bodies = st.fixed_dictionaries({}, optional={
    "req_id": json_values | st.text(min_size=1, max_size=20),
    "modality": json_values | st.sampled_from(["image", "IMAGE", "audio", "video", "text"]),
    "mm_items": json_values | st.lists(st.sampled_from(["", "AAAA", "data:,x", "/x", {"data": "AA"},
                                                        {"frames": []}, {"url": "http://0.0.0.0/"}]), max_size=3),
    # Destinations stay on loopback (or are malformed): a test never sends traffic anywhere else.
    "num_parts": json_values, "part_idx": json_values,
    "prefill_host": st.none() | st.integers() | st.booleans()
    | st.sampled_from(["127.0.0.1", "::1", "localhost", "0.0.0.0", "0", "127.1", ""]),
    "embedding_port": json_values, "return_embedding": json_values, "timeout_s": json_values,
})


def only_refused_urls(body) -> bool:
    """No generated string may name a URL the server would fetch: the one URL used is refused
    before any connection (a wildcard address)."""
    return json.dumps(body).replace("http://0.0.0.0/", "").find("://") < 0


def test_fuzzed_bodies_never_get_a_5xx(guarded_server):
    with httpx.Client(timeout=30) as client:
        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=(encode_bodies | json_values).filter(only_refused_urls))
        def check(body):
            response = client.post(guarded_server.url + "/encode", json=body)
            assert response.status_code < 500, (body, response.text)
            if response.status_code >= 400:
                assert response.json()["message"]

        check()
    assert httpx.get(guarded_server.url + "/health").status_code == 200


def test_api_key_guards_every_endpoint_but_health_and_metrics():
    """A Prometheus scraper reads /metrics without the key (unless --metrics-require-key: next test)."""
    with InProcessServer("--api-key", "s3cret") as server:
        assert httpx.get(server.url + "/health").status_code == 200
        metrics = httpx.get(server.url + "/metrics")
        assert metrics.status_code == 200 and "encoder_requests_total" in metrics.text
        body = {"req_id": "k", "modality": "image", "mm_items": [image_b64(56, 56)]}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cre"}, {"Authorization": "Basic s3cret"}):
            response = httpx.post(server.url + "/encode", json=body, headers=headers)
            assert response.status_code == 401 and response.json()["status"] == "error"
        for path in ("/server_info", "/v1/performance", "/openapi.json", "/docs"):
            assert httpx.get(server.url + path).status_code == 401, path
        assert httpx.post(server.url + "/scheduler_receive_url", json={}).status_code == 401
        assert httpx.post(server.url + "/v1/chat/completions", json={}).status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.post(server.url + "/encode", json=body, headers=auth).status_code == 200
        assert httpx.get(server.url + "/metrics", headers={"Authorization": "bearer s3cret"}).status_code == 200
        info = httpx.get(server.url + "/server_info", headers=auth).json()
        assert "s3cret" not in json.dumps(info)
        assert "s3cret" not in httpx.get(server.url + "/metrics").text


def test_api_key_exempt_cidrs_let_a_network_without_a_key_and_nobody_else():
    """SGLang's prefill ranks and vLLM's proxy send no Authorization header: their network is exempted. Real HTTP
    on loopback: from 127.0.0.1, exempted by 127.0.0.0/8, asked for the key when only 10.0.0.0/8 is exempt."""
    body = {"req_id": "x", "modality": "image", "mm_items": [image_b64(56, 56)]}
    registration = {"req_id": "x2", "receive_url": "127.0.0.1:1", "receive_count": 1}
    with InProcessServer("--api-key", "s3cret", "--api-key-exempt-cidrs", "10.0.0.0/8, 127.0.0.0/8") as server:
        assert httpx.post(server.url + "/encode", json=body).status_code == 200  # as SGLang's receiver sends it
        assert httpx.post(server.url + "/scheduler_receive_url", json=registration).status_code == 200
        assert httpx.get(server.url + "/server_info").status_code == 200


def test_outside_the_exempt_networks_the_key_is_asked_and_a_forwarded_header_does_not_help():
    """The real server (its own uvicorn settings): the address judged is the connection's, not X-Forwarded-For."""
    body = {"req_id": "y", "modality": "image", "mm_items": [image_b64(56, 56)]}
    with ServerProcess("--api-key", "s3cret", env={"ENCODER_API_KEY_EXEMPT_CIDRS": "10.0.0.0/8,fd00::/8"}) as server:
        assert httpx.post(server.url + "/encode", json=body).status_code == 401
        spoofed = {"X-Forwarded-For": "10.1.2.3", "Forwarded": "for=10.1.2.3"}
        assert httpx.post(server.url + "/encode", json=body, headers=spoofed).status_code == 401
        assert httpx.post(server.url + "/scheduler_receive_url", json={}, headers=spoofed).status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.post(server.url + "/encode", json=body, headers=auth).status_code == 200
        info = httpx.get(server.url + "/server_info", headers=auth).json()
        assert info["settings"]["api_key_exempt_cidrs"] == "10.0.0.0/8,fd00::/8"


def test_exempt_networks_are_read_strictly_and_match_ipv4_mapped_addresses(capsys):
    networks = exempt_networks("10.244.0.0/16, fd00::/8,192.0.2.7")
    assert in_networks("10.244.3.4", networks) and in_networks("::ffff:10.244.3.4", networks)
    assert in_networks("fd00::1", networks) and in_networks("192.0.2.7", networks)
    assert not in_networks("10.245.0.1", networks) and not in_networks("127.0.0.1", networks)
    assert not in_networks("not-an-address", networks) and not in_networks("10.244.0.1", ())
    with pytest.raises(SystemExit) as refused:
        load_settings(["--api-key-exempt-cidrs", "10.0.0.0/33"], {})
    assert refused.value.code == 2
    assert "'10.0.0.0/33' is not a network; write CIDRs separated by commas" in capsys.readouterr().err


def test_metrics_require_key_puts_metrics_behind_the_key_too():
    with InProcessServer("--api-key", "s3cret", env={"ENCODER_METRICS_REQUIRE_KEY": "true"}) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 401
        assert httpx.get(server.url + "/server_info").status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.get(server.url + "/metrics", headers=auth).status_code == 200
        assert httpx.get(server.url + "/server_info", headers=auth).json()["settings"]["metrics_require_key"] is True
