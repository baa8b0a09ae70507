"""Receiver addresses (`/scheduler_receive_url`'s `receive_url`, `prefill_host` + `embedding_port`): the
forms accepted, SGLang's scheme-less `host:port` and `[v6]:port` among them, always normalised to
`tcp://...`, and the addresses refused whatever their form (wildcards, legacy IPv4 spellings)."""

from __future__ import annotations

import pytest

from encode_server.delivery.sockets import check_endpoint, endpoint_for

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("given,expected", [
    ("tcp://127.0.0.1:5000", "tcp://127.0.0.1:5000"),
    ("127.0.0.1:5000", "tcp://127.0.0.1:5000"),
    ("  127.0.0.1:5000 ", "tcp://127.0.0.1:5000"),
    ("localhost:65535", "tcp://localhost:65535"),
    ("prefill-0.svc.cluster.local:1", "tcp://prefill-0.svc.cluster.local:1"),
    ("[::1]:5000", "tcp://[::1]:5000"),
    ("tcp://[::1]:5000", "tcp://[::1]:5000"),
    ("[fe80::1:2]:7", "tcp://[fe80::1:2]:7"),
    ("[::ffff:127.0.0.1]:5000", "tcp://[::ffff:127.0.0.1]:5000"),
    ("127.0.0.1:05000", "tcp://127.0.0.1:5000"),
])
def test_accepted_forms_normalise_to_tcp(given, expected):
    assert check_endpoint(given) == expected


@pytest.mark.parametrize("given,needle", [
    ("0.0.0.0:5000", "wildcard"),
    ("tcp://0.0.0.0:5000", "wildcard"),
    ("[::]:5000", "wildcard"),
    ("[0:0::0]:5000", "wildcard"),
    ("[::ffff:0.0.0.0]:5000", "wildcard"),
    ("*:5000", "not a tcp://"),
    ("127.1:5000", "canonical"),
    ("2130706433:5000", "canonical"),
    ("0:5000", "canonical"),
    ("[127.0.0.1]:5000", "not an IPv6"),
    ("[zz::1]:5000", "not a tcp://"),
    ("::1:5000", "not a tcp://"),  # an IPv6 host needs its brackets
    ("http://127.0.0.1:5000", "not a tcp://"),
    ("ipc:///tmp/x", "not a tcp://"),
    ("127.0.0.1", "not a tcp://"),
    ("127.0.0.1:", "not a tcp://"),
    ("127.0.0.1:0", "port out of range"),
    ("127.0.0.1:70000", "port out of range"),
    ("127.0.0.1:123456", "not a tcp://"),
    ("", "not a tcp://"),
])
def test_refused_forms_say_why(given, needle):
    with pytest.raises(ValueError, match=None) as refused:
        check_endpoint(given)
    assert needle in str(refused.value)


def test_prefill_host_and_port_build_the_same_endpoints():
    assert endpoint_for("127.0.0.1", 5000) == "tcp://127.0.0.1:5000"
    assert endpoint_for("::1", 5000) == "tcp://[::1]:5000"
    assert endpoint_for("[::1]", 5000) == "tcp://[::1]:5000"
    with pytest.raises(ValueError, match="wildcard"):
        endpoint_for("::", 5000)
