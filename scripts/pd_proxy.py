"""Prefill/decode demo proxy for two vLLM servers: NIXL (DSV4NixlConnector) or a shared DSV4Connector store.

    # a prefill and a decode engine on one store (a filesystem both hosts mount; /dev/shm on one host)
    vllm serve deepseek-ai/DeepSeek-V4-Flash --port 8100 --kv-transfer-config \
      '{"kv_connector":"DSV4Connector","kv_role":"kv_producer","kv_connector_extra_config":{"path":"/dev/shm/kv"}}'
    vllm serve deepseek-ai/DeepSeek-V4-Flash --port 8200 --kv-transfer-config \
      '{"kv_connector":"DSV4Connector","kv_role":"kv_consumer","kv_connector_extra_config":{"path":"/dev/shm/kv"}}'
    python scripts/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

    # or NIXL: the decode engine reads the prefill engine's cache pages (kv_transfer_params, kv_handoff.py)
    vllm serve ... --port 8100 --kv-transfer-config '{"kv_connector":"DSV4NixlConnector","kv_role":"kv_producer"}'
    vllm serve ... --port 8200 --kv-transfer-config '{"kv_connector":"DSV4NixlConnector","kv_role":"kv_consumer"}'

Each completion request is sent first to the prefill server with one output token (its engine stores
the prompt's cache entries before it answers, or keeps its blocks for NIXL), then to the decode server
(with the ``kv_transfer_params`` the prefill server answered with, if any), whose answer, streamed or
not, is the client's: the decode engine loads the prompt's cache from the store or over NIXL and
computes only its last token. The client's ``Authorization`` header goes to both servers;
``--api-key`` makes the proxy itself require ``Authorization: Bearer <key>`` (401 otherwise).

Failures: a body that is not a JSON object gets a 400 and reaches no server; a prefill server's error
answer is the client's; a server that cannot be reached or drops the connection gets the client a 502
naming it, one that does not connect or answer in time (``--connect-timeout``, ``--read-timeout``: the
longest silence between bytes) a 504; a stream dropped midway ends with an error event after the
last whole event (never half an event). A client that disconnects closes its request's connection to
the server working on it, which makes vLLM abort the request. ``/health`` asks both servers at once and
answers within ``--health-timeout`` (503 naming a server that is down or silent). ``--max-connections``
bounds the open connections to the two servers together (streams included; 0: no bound); a request waits for one
at most the read timeout (then a 503).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
from collections.abc import Awaitable
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

sys.path.insert(0, str(Path(__file__).parent))
import kv_handoff  # noqa: E402  (scripts/ is no package)

ROUTES = ("/v1/completions", "/v1/chat/completions")
PREFILL_ONLY_DROPPED = ("stream_options", "min_tokens")  # min_tokens > 1 is refused with max_tokens = 1


def prefill_body(body: dict) -> dict:
    """The request as the prefill server gets it: one token, not streamed."""
    body = dict(body, max_tokens=1, stream=False)
    for key in PREFILL_ONLY_DROPPED:
        body.pop(key, None)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return body


def error(message: str, kind: str, code: int) -> JSONResponse:
    """An OpenAI-style error answer."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, code)


def peer_error(role: str, base: str, exc: httpx.TransportError) -> JSONResponse:
    """The answer for a server that failed: 504 if it was too slow, 503 if the pool had no connection
    for it, 502 otherwise; the message names the server and how it failed."""
    if isinstance(exc, httpx.PoolTimeout):
        return error(f"the proxy has no free connection to the {role} server at {base} (--max-connections)",
                     "ServiceUnavailable", 503)
    code, kind = (504, "GatewayTimeout") if isinstance(exc, httpx.TimeoutException) else (502, "BadGateway")
    return error(f"the {role} server at {base} failed: {type(exc).__name__}: {exc}", kind, code)


async def read_object(request: Request) -> dict | None:
    """The request's JSON body if it is an object; None otherwise."""
    try:
        body = json.loads(await request.body())
    except ValueError:  # not JSON, or not UTF-8
        return None
    return body if isinstance(body, dict) else None


async def until_disconnected(request: Request) -> None:
    """Returns when the client has gone (its body is read by then, so receive() only waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable, gone: asyncio.Future):
    """``work``'s result, or ``gone`` if the client disconnects first; ``work`` is then cancelled,
    closing its connection to the server, which makes vLLM abort the request."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()
    return gone


class Proxy:
    """The two servers, the HTTP clients that reach them and the handlers of the proxy's routes."""

    def __init__(self, prefill: str, decode: str, *, connect_timeout: float = 10.0, read_timeout: float = 600.0,
                 health_timeout: float = 3.0, max_connections: int = 1024, api_key: str | None = None):
        self.servers = {"prefill": prefill, "decode": decode}
        self.api_key, self.health_timeout = api_key, health_timeout
        limits = httpx.Limits(max_connections=max_connections or None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(read_timeout, connect=connect_timeout), limits=limits)
        # health checks never wait behind busy completion connections
        self.health_client = httpx.AsyncClient(timeout=health_timeout)

    def refused(self, request: Request) -> Response | None:
        """A 401 unless the proxy needs no key or the request carries it."""
        if self.api_key is None or request.headers.get("authorization") == f"Bearer {self.api_key}":
            return None
        return error("a valid API key is required (Authorization: Bearer <key>)", "Unauthorized", 401)

    async def complete(self, route: str, request: Request) -> Response:
        if refused := self.refused(request):
            return refused
        body = await read_object(request)
        if body is None:
            return error("the request body must be a JSON object", "BadRequestError", 400)
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            return await self.exchange(route, body, forwarded_headers(request), request, gone)
        finally:
            gone.cancel()

    async def exchange(self, route: str, body: dict, headers: dict, request: Request,
                       gone: asyncio.Future) -> Response:
        """Prefill, then decode; the decode server's answer (whole, or relayed as a stream)."""
        prefill, decode, client = self.servers["prefill"], self.servers["decode"], self.client
        try:
            first = await unless_disconnected(
                request, client.post(prefill + route, json=kv_handoff.prefill_request(prefill_body(body)),
                                      headers=headers), gone)
        except httpx.TransportError as exc:
            return peer_error("prefill", prefill, exc)
        if first is gone:
            return Response(status_code=499)  # nobody reads it
        if first.status_code != 200:
            return Response(first.content, first.status_code, media_type="application/json")
        body = kv_handoff.decode_request(body, first.content)
        try:
            upstream = await unless_disconnected(request, client.send(
                client.build_request("POST", decode + route, json=body, headers=headers), stream=True), gone)
            if upstream is gone:
                return Response(status_code=499)
            if body.get("stream") and upstream.status_code == 200:
                return StreamingResponse(self.relay(upstream), media_type="text/event-stream")
            try:  # a whole answer, or an error answer
                content = await unless_disconnected(request, upstream.aread(), gone)
            finally:
                await upstream.aclose()
        except httpx.TransportError as exc:
            return peer_error("decode", decode, exc)
        if content is gone:
            return Response(status_code=499)
        return Response(content, upstream.status_code, media_type=upstream.headers.get("content-type"))

    async def relay(self, upstream: httpx.Response):
        """The decode server's events, each whole; an error event if it drops the stream. A client that
        disconnects cancels this generator (Starlette), which closes the decode connection."""
        pending = b""
        try:
            async for chunk in upstream.aiter_bytes():
                *events, pending = (pending + chunk).split(b"\n\n")
                if events:
                    yield b"".join(event + b"\n\n" for event in events)
            if pending:  # the stream ended cleanly: whatever followed the last blank line is the server's
                yield pending
        except httpx.TransportError as exc:
            yield b"data: " + peer_error("decode", self.servers["decode"], exc).body + b"\n\n"
        finally:
            await upstream.aclose()

    async def status(self, base: str) -> int | str:
        try:
            return (await self.health_client.get(base + "/health")).status_code
        except httpx.TimeoutException as exc:
            return f"no answer within {self.health_timeout:g}s ({type(exc).__name__})"
        except httpx.TransportError as exc:
            return f"unreachable ({type(exc).__name__})"

    async def health(self) -> Response:
        answers = dict(zip(self.servers, await asyncio.gather(*map(self.status, self.servers.values()))))
        return JSONResponse(answers, 200 if all(a == 200 for a in answers.values()) else 503)

    async def models(self, request: Request) -> Response:
        if refused := self.refused(request):
            return refused
        decode = self.servers["decode"]
        try:
            answer = await self.client.get(decode + "/v1/models", headers=forwarded_headers(request))
        except httpx.TransportError as exc:
            return peer_error("decode", decode, exc)
        return Response(answer.content, answer.status_code, media_type="application/json")


def forwarded_headers(request: Request) -> dict:
    """The client's headers the servers get: its credentials."""
    return {k: v for k, v in request.headers.items() if k == "authorization"}


def make_app(prefill: str, decode: str, **options) -> FastAPI:
    """The proxy's app; ``options``: :class:`Proxy`'s keyword arguments."""
    proxy = Proxy(prefill, decode, **options)
    app = FastAPI()
    for route in ROUTES:
        app.post(route)(functools.partial(proxy.complete, route))
    app.get("/health")(proxy.health)
    app.get("/v1/models")(proxy.models)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", required=True, help="base URL of the kv_producer server")
    ap.add_argument("--decode", required=True, help="base URL of the kv_consumer server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", help="require 'Authorization: Bearer KEY' from clients")
    ap.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to connect to a server")
    ap.add_argument("--read-timeout", type=float, default=600.0,
                    help="longest silence from a server, seconds (a prefill of a long prompt is silent throughout)")
    ap.add_argument("--health-timeout", type=float, default=3.0, help="seconds /health waits for each server")
    ap.add_argument("--max-connections", type=int, default=1024,
                    help="open connections to the servers at most, streams included (0: no bound)")
    args = ap.parse_args()
    app = make_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), connect_timeout=args.connect_timeout,
                   read_timeout=args.read_timeout, health_timeout=args.health_timeout,
                   max_connections=args.max_connections, api_key=args.api_key)
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
