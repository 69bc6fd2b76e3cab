"""The Fleet gate: what faces the network in front of a SuperLink.

Flower 1.42's SuperLink serves its Control API (run submission: it starts a ServerApp, i.e. code,
on its host), its runtime API and its Fleet API (what SuperNodes call) on one HTTP port, and
SuperNode authentication guards the Fleet API only. So hfl binds every SuperLink to loopback and
puts this gate on the address the SuperNodes reach: it forwards the Fleet API's own paths (read
from Flower's Fleet router, exactly as written, POST, no query) to the SuperLink and answers
everything else 403 without forwarding it. Run submission is then open only on the SuperLink's
host (or through a tunnel to its loopback port). TLS, when asked for, ends at the gate with the
SuperLink's own certificate and goes on to the SuperLink, which keeps its TLS, verified with the CA.

    python -m hfl.deploy.gate --host 0.0.0.0 --port 9092 --upstream 127.0.0.1:9093 [--tls DIR]
"""

from __future__ import annotations

import argparse
import logging
import ssl
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx
import uvicorn

log = logging.getLogger("hfl.gate")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# Headers that belong to one connection (RFC 9110 7.6.1), not to the request or reply forwarded.
HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
              b"transfer-encoding", b"upgrade", b"host", b"content-length"}
MAX_BODY = 1 << 30  # what one Fleet message may carry through the gate (a model; Flower chunks larger objects)


def fleet_paths() -> frozenset[str]:
    """Every path of Flower's Fleet API, from its own router: what a SuperNode calls, nothing else."""
    from flwr.superlink.routers.fleet.router import router

    paths = frozenset(route.path for route in router.routes if route.path.startswith("/v1/fleet/"))
    if not paths:
        raise RuntimeError("Flower's Fleet router lists no /v1/fleet/ path: this Flower is not the one hfl's gate "
                           "was written for")
    return paths


async def _answer(send: Send, status: int, text: str) -> None:
    """A one-line plain-text answer of the gate's own (a refusal, a dead SuperLink)."""
    body = (text + "\n").encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class FleetGate:
    """An ASGI app forwarding the Fleet API's paths to ``upstream`` and refusing the rest."""

    def __init__(self, upstream: str, verify: ssl.SSLContext | bool = False,
                 allowed: frozenset[str] | None = None) -> None:
        self.scheme = "https" if verify is not False else "http"
        self.upstream = upstream
        self.allowed = fleet_paths() if allowed is None else allowed
        self.verify = verify
        self.client: httpx.AsyncClient | None = None
        self.refused = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":  # websockets: Flower's Fleet API has none
            return
        # The raw path as sent (no percent-decoding, no dot-segment removal) must be one of the
        # Fleet paths exactly: what is forwarded is then that listed path, whatever the upstream parses.
        path = scope.get("raw_path") or scope["path"].encode()
        path = path.decode("latin-1")
        if scope["method"] != "POST" or scope.get("query_string") or path not in self.allowed:
            self.refused += 1
            client = scope.get("client") or ("?", 0)
            log.warning("refused %s %s from %s:%s (only the Fleet API is served here)", scope["method"], path[:200],
                        *client)
            await _answer(send, 403, "hfl gate: only Flower's Fleet API is served on this port; run "
                                     "submission is on the SuperLink's own host")
            return
        body = await self._body(receive)
        if body is None:
            await _answer(send, 413, "hfl gate: request too large")
            return
        forwarded = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP]
        assert self.client is not None
        try:
            reply = await self.client.post(f"{self.scheme}://{self.upstream}{path}", content=body, headers=forwarded)
        except httpx.TransportError as exc:  # the SuperLink is down or restarting: the SuperNode retries on 502/503
            await _answer(send, 502, f"hfl gate: the SuperLink at {self.upstream} does not answer ({exc})")
            return
        content = reply.content
        out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.multi_items()
               if k.lower().encode() not in HOP_BY_HOP and k.lower() != "content-encoding"]
        out.append((b"content-length", str(len(content)).encode()))
        await send({"type": "http.response.start", "status": reply.status_code, "headers": out})
        await send({"type": "http.response.body", "body": content})

    async def _body(self, receive: Receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY:
                return None
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # Long reads: a SuperLink answers at once, but one Fleet object can be large on a slow link.
                self.client = httpx.AsyncClient(verify=self.verify, timeout=httpx.Timeout(300.0, connect=10.0))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.client is not None:
                    await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


def serve(host: str, port: int, upstream: str, tls_dir: str | None = None) -> None:
    """Run the gate until stopped (SIGTERM/SIGINT: uvicorn's own handling)."""
    ssl_options: dict[str, Any] = {}
    verify: ssl.SSLContext | bool = False
    if tls_dir:
        from hfl.deploy.roles import ServerTls

        tls = ServerTls.from_dir(tls_dir)
        ssl_options = {"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)}
        verify = ssl.create_default_context(cafile=str(tls.ca))
    app = FleetGate(upstream, verify)
    log.info("Fleet gate on %s:%d -> %s (%d Fleet paths; everything else refused)", host, port, upstream,
             len(app.allowed))
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, **ssl_options)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hfl.deploy.gate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="0.0.0.0", help="the address SuperNodes reach")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="the SuperLink, HOST:PORT (loopback)")
    p.add_argument("--tls", help="directory with ca.crt, server.pem, server.key (the SuperLink's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.setLevel(logging.INFO)
    serve(args.host, args.port, args.upstream, args.tls)


if __name__ == "__main__":
    main()
