"""Prefill/decode demo proxy for two vLLM servers that share a DSV4Connector store.

    # a prefill and a decode engine on one store (a filesystem both hosts mount; /dev/shm on one host)
    vllm serve deepseek-ai/DeepSeek-V4-Flash --port 8100 --kv-transfer-config \
      '{"kv_connector":"DSV4Connector","kv_role":"kv_producer","kv_connector_extra_config":{"path":"/dev/shm/kv"}}'
    vllm serve deepseek-ai/DeepSeek-V4-Flash --port 8200 --kv-transfer-config \
      '{"kv_connector":"DSV4Connector","kv_role":"kv_consumer","kv_connector_extra_config":{"path":"/dev/shm/kv"}}'
    python scripts/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each completion request is sent first to the prefill server with one output token (its engine stores
the prompt's cache entries before it answers), then unchanged to the decode server, whose answer,
streamed or not, is the client's: the decode engine loads all but the prompt's last token from the
store and computes only that one. A prefill server that fails answers the client with its error. A
server that cannot be reached or drops the connection gets the client a 502 naming it; one that drops a
stream midway ends it with an error event after the last whole event (never half an event).
"""

from __future__ import annotations

import argparse
import json

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

ROUTES = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict) -> dict:
    """The request as the prefill server gets it: one token, not streamed."""
    body = dict(body, max_tokens=1, stream=False)
    body.pop("stream_options", None)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return body


def peer_error(role: str, base: str, exc: httpx.TransportError) -> dict:
    """An OpenAI-style error body naming the server that failed and how."""
    return {"error": {"message": f"the {role} server at {base} failed: {type(exc).__name__}: {exc}",
                      "type": "BadGateway", "code": 502}}


def make_app(prefill: str, decode: str, timeout: float = 600.0) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=timeout)

    async def forward(route: str, request: Request) -> Response:
        body = await request.json()
        try:
            first = await client.post(prefill + route, json=prefill_body(body))
        except httpx.TransportError as exc:
            return JSONResponse(peer_error("prefill", prefill, exc), 502)
        if first.status_code != 200:
            return Response(first.content, first.status_code, media_type="application/json")
        try:
            if not body.get("stream"):
                answer = await client.post(decode + route, json=body)
                return Response(answer.content, answer.status_code, media_type="application/json")
            upstream = await client.send(client.build_request("POST", decode + route, json=body), stream=True)
            if upstream.status_code != 200:  # an error answer, not a stream
                content = await upstream.aread()
                await upstream.aclose()
                return Response(content, upstream.status_code, media_type=upstream.headers.get("content-type"))
        except httpx.TransportError as exc:
            return JSONResponse(peer_error("decode", decode, exc), 502)

        async def relay():
            """The decode server's events, each whole; an error event if it drops the stream."""
            pending = b""
            try:
                async for chunk in upstream.aiter_bytes():
                    *events, pending = (pending + chunk).split(b"\n\n")
                    if events:
                        yield b"".join(event + b"\n\n" for event in events)
                if pending:  # the stream ended cleanly: whatever followed the last blank line is the server's
                    yield pending
            except httpx.TransportError as exc:
                yield b"data: " + json.dumps(peer_error("decode", decode, exc)).encode() + b"\n\n"
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    def handler(route: str):
        async def handle(request: Request) -> Response:
            return await forward(route, request)

        return handle

    for route in ROUTES:
        app.post(route)(handler(route))

    async def status(base: str) -> int | str:
        try:
            return (await client.get(base + "/health")).status_code
        except httpx.TransportError as exc:
            return f"unreachable ({type(exc).__name__})"

    @app.get("/health")
    async def health() -> Response:
        answers = {"prefill": await status(prefill), "decode": await status(decode)}
        return JSONResponse(answers, 200 if all(a == 200 for a in answers.values()) else 503)

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            answer = await client.get(decode + "/v1/models")
        except httpx.TransportError as exc:
            return JSONResponse(peer_error("decode", decode, exc), 502)
        return Response(answer.content, answer.status_code, media_type="application/json")

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", required=True, help="base URL of the kv_producer server")
    ap.add_argument("--decode", required=True, help="base URL of the kv_consumer server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    uvicorn.run(make_app(args.prefill.rstrip("/"), args.decode.rstrip("/")), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
