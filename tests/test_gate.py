"""The Fleet gate (hfl.deploy.gate) in front of every SuperLink: Flower's Fleet paths are forwarded
as sent, everything else (run submission, the runtime API, tricks on the path) is answered 403
without reaching the SuperLink."""

from __future__ import annotations

import asyncio
import inspect
import re

import httpx
import pytest

from hfl.deploy.gate import FleetGate, fleet_paths


def call(gate: FleetGate, method: str, raw_path: bytes, body: bytes = b"", query: bytes = b"",
         headers: list[tuple[bytes, bytes]] | None = None) -> tuple[int, dict[bytes, bytes], bytes]:
    """One HTTP request through the gate's ASGI interface, as uvicorn hands it over (the raw path
    is what the client sent; ``path`` is its percent-decoded form)."""
    from urllib.parse import unquote

    scope = {"type": "http", "method": method, "raw_path": raw_path, "path": unquote(raw_path.decode()),
             "query_string": query, "headers": headers or [], "client": ("10.0.0.9", 4242)}
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> None:
        gate.client = gate.client or httpx.AsyncClient()
        await gate(scope, receive, send)

    asyncio.run(run())
    start, body_message = sent
    return start["status"], dict(start["headers"]), body_message["body"]


@pytest.fixture
def upstream() -> tuple[FleetGate, list[httpx.Request]]:
    """A gate whose SuperLink is a recorder: every forwarded request lands in the list."""
    seen: list[httpx.Request] = []

    def superlink(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=b"reply:" + request.content, headers={"x-flwr": "1"})

    gate = FleetGate("127.0.0.1:9", verify=False)
    gate.client = httpx.AsyncClient(transport=httpx.MockTransport(superlink))
    return gate, seen


def test_fleet_paths_are_flowers_and_cover_what_a_supernode_calls() -> None:
    from flwr.supernode import fleet_http_client

    called = set(re.findall(r'path="(/v1/[^"]+)"', inspect.getsource(fleet_http_client)))
    allowed = fleet_paths()
    assert called and called <= allowed  # every call a SuperNode makes passes
    assert all(p.startswith("/v1/fleet/") for p in allowed)
    assert "/v1/control/start-run" not in allowed


def test_a_fleet_call_is_forwarded_as_sent(upstream) -> None:
    gate, seen = upstream
    status, headers, body = call(gate, "POST", b"/v1/fleet/pull-messages", b"\x01\x02",
                                 headers=[(b"content-type", b"application/protobuf"), (b"x-sig", b"abc"),
                                          (b"connection", b"keep-alive"), (b"host", b"evil")])
    assert status == 200 and body == b"reply:\x01\x02" and headers[b"x-flwr"] == b"1"
    (request,) = seen
    assert request.url.path == "/v1/fleet/pull-messages" and request.url.host == "127.0.0.1"
    assert request.headers["x-sig"] == "abc" and request.headers["content-type"] == "application/protobuf"
    assert request.headers["host"] == "127.0.0.1:9"  # hop-by-hop and Host are the gate's own


@pytest.mark.parametrize(("method", "path", "query"), [
    ("POST", b"/v1/control/start-run", b""),                    # run submission: code on the host
    ("POST", b"/v1/control/list-runs", b""),
    ("POST", b"/v1/runtime/acquire-task", b""),                 # the ServerApps' own API
    ("POST", b"/v1/fleet/../control/start-run", b""),           # dot segments
    ("POST", b"/v1/fleet/%2e%2e/control/start-run", b""),       # encoded dot segments
    ("POST", b"/v1/fleet/pull-messages/", b""),                 # not the path exactly
    ("POST", b"//v1/fleet/pull-messages", b""),
    ("POST", b"/v1/fleet/pull-messages", b"x=1"),               # a query Flower never sends
    ("GET", b"/v1/fleet/pull-messages", b""),
    ("GET", b"/docs", b""),
    ("GET", b"/health", b""),
])
def test_everything_else_is_refused_without_reaching_the_superlink(upstream, method, path, query) -> None:
    gate, seen = upstream
    status, _, body = call(gate, method, path, b"payload", query)
    assert status == 403 and b"only Flower's Fleet API" in body
    assert seen == [] and gate.refused == 1


def test_a_superlink_that_does_not_answer_is_a_502_the_supernode_retries() -> None:
    gate = FleetGate("127.0.0.1:1", verify=False)  # nothing listens on port 1
    status, _, body = call(gate, "POST", b"/v1/fleet/send-node-heartbeat")
    assert status == 502 and b"does not answer" in body
