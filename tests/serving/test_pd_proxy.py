"""scripts/pd_proxy.py against peers that fail or misbehave (unreachable, hanging up, dropping a stream,
never answering), clients that misbehave (bad JSON, no key, leaving early) and requests vLLM answers
differently on the one-token prefill leg (``min_tokens``). The peers are plain TCP servers that speak
just enough HTTP/1.1 to do that on cue; the proxy is the real app, called in process (or served by
uvicorn on a port where a client must really disconnect) while its own clients reach the peers over
sockets. Every failure must reach the client as an error naming the server, and the proxy must go on
serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import httpx
import pytest
import uvicorn

from tests.conftest import REPO_ROOT, load_module_by_path
from tests.serving.conftest import free_port

pd_proxy = load_module_by_path(REPO_ROOT / "scripts" / "pd_proxy.py")

COMPLETION = {"choices": [{"text": "x"}]}
REFUSAL = {"error": {"message": "this request is refused", "code": 400}}
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"n": 0}\n\n', b'data: {"n": 1}\n\n', b"data: [DONE]\n\n"]


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict, dict]:
    """(path, lower-cased headers, JSON body) of the next request on the connection."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    lines = head.split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return lines[0].split(" ")[1], headers, json.loads(body) if body else {}


def json_answer(status: bytes, answer: dict) -> bytes:
    data = json.dumps(answer).encode()
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (status, len(data), data)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Peer:
    """A server on 127.0.0.1 answering each completion request by the next entry of ``acts`` (the last
    repeats): "ok" (200: JSON, or the whole event stream when asked to stream; a 400 as vLLM's for
    ``min_tokens`` above ``max_tokens``), "refuse" (400 with a JSON error, streamed or not), "close"
    (hang up before answering), "drop" (start the event stream, send one event and half of the next,
    hang up), "hang" (never answer), "hold" (a stream: one event, then wait for ``release``).
    ``health``: "ok" or "hang". Records each completion request (path, headers, body) and, in
    ``closed``, how many of those connections the proxy closed while the peer still held them."""

    def __init__(self, *acts: str, health: str = "ok"):
        self.acts, self.health, self.served = list(acts), health, 0
        self.requests: list[tuple[str, dict, dict]] = []
        self.closed = 0
        self.release = asyncio.Event()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                path, headers, body = await read_request(reader)
                if path == "/health":
                    if self.health == "hang":
                        await reader.read()
                        return
                    writer.write(json_answer(b"200 OK", {}))
                    await writer.drain()
                    continue
                act = self.acts[min(self.served, len(self.acts) - 1)]
                self.served += 1
                self.requests.append((path, headers, body))
                if await self.act(act, body, reader, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def act(self, act: str, body: dict, reader, writer) -> bool:
        """Answer one request; True when the connection is over."""
        if act == "close":
            return True
        if act == "hang" or act == "hold" and body.get("stream"):
            if act == "hold":
                writer.write(STREAM_HEAD + chunk(EVENTS[0]))
                await writer.drain()
            waiting = asyncio.ensure_future(self.release.wait())
            closing = asyncio.ensure_future(reader.read())
            done, _ = await asyncio.wait({waiting, closing}, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel(), closing.cancel()
            if closing in done:
                self.closed += 1
                return True
            writer.write(chunk(b"".join(EVENTS[1:])) + chunk(b""))
        elif act == "refuse" or body.get("min_tokens", 0) > body.get("max_tokens", 16):
            writer.write(json_answer(b"400 Bad Request", REFUSAL))
        elif not body.get("stream"):
            writer.write(json_answer(b"200 OK", COMPLETION))
        elif act == "drop":
            writer.write(STREAM_HEAD + chunk(EVENTS[0] + EVENTS[1][:9]))
            await writer.drain()
            return True
        else:
            writer.write(STREAM_HEAD + b"".join(chunk(e) for e in EVENTS) + chunk(b""))
        await writer.drain()
        return False


def unreachable() -> str:
    return f"http://127.0.0.1:{free_port()}"


async def proxy_calls(prefill: Peer | None, decode: Peer, calls: list, **options) -> list:
    """Run the peers (``None``: a port nobody listens on) and make ``calls`` (method, path, JSON body or
    raw bytes[, headers]) through one proxy, in order; their (status, body text)."""
    prefill_url = await prefill.start() if prefill else unreachable()
    app = pd_proxy.make_app(prefill_url, await decode.start(), **options)
    answers = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        for method, path, body, *headers in calls:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            answer = await client.request(method, path, headers=headers[0] if headers else None, **kw)
            answers.append((answer.status_code, answer.text))
    return answers


def run(prefill: Peer | None, decode: Peer, calls: list, **options) -> list:
    return asyncio.run(asyncio.wait_for(proxy_calls(prefill, decode, calls, **options), 60))


def sse_data(text: str) -> list:
    """Each event's data: parsed JSON, or the literal "[DONE]"; an event that is not whole fails here."""
    events = text.split("\n\n")
    assert events[-1] == "", text  # the stream ends with a whole event
    assert all(e.startswith("data: ") for e in events[:-1]), text
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events[:-1]]


def names(error: dict, role: str, code: int = 502) -> bool:
    return error["error"]["code"] == code and f"the {role} server at http://127.0.0.1:" in error["error"]["message"]


COMPLETE = ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4})
STREAM = ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True})


def test_an_unreachable_prefill_server_is_named_and_health_says_which():
    (status, text), (health_status, health) = run(None, Peer("ok"), [COMPLETE, ("GET", "/health", None)])
    assert status == 502 and names(json.loads(text), "prefill") and "ConnectError" in text
    assert health_status == 503
    assert json.loads(health) == {"prefill": "unreachable (ConnectError)", "decode": 200}


def test_a_decode_server_that_hangs_up_is_named_and_the_proxy_serves_the_next_request():
    answers = run(Peer("ok"), Peer("close", "close", "ok"), [COMPLETE, STREAM, COMPLETE, STREAM])
    for status, text in answers[:2]:
        assert status == 502 and names(json.loads(text), "decode"), text
    assert answers[2] == (200, json.dumps(COMPLETION))
    assert answers[3][0] == 200 and sse_data(answers[3][1]) == [{"n": 0}, {"n": 1}, "[DONE]"]


def test_a_stream_dropped_midway_ends_with_an_error_event_after_the_last_whole_one():
    (status, text), (next_status, next_text) = run(Peer("ok"), Peer("drop", "ok"), [STREAM, STREAM])
    assert status == 200  # the stream had started: the error comes as its last event
    first, error = sse_data(text)
    assert first == {"n": 0} and names(error, "decode") and "RemoteProtocolError" in error["error"]["message"]
    assert next_status == 200 and sse_data(next_text) == [{"n": 0}, {"n": 1}, "[DONE]"]


def test_a_decode_servers_error_answer_to_a_stream_reaches_the_client_as_it_is():
    (status, text), = run(Peer("ok"), Peer("refuse"), [STREAM])
    assert status == 400 and json.loads(text) == REFUSAL


@pytest.mark.parametrize("body", [b'{"prompt": "hi", ', b"[1, 2]", b'"text"', b"null", b'{"prompt": "\xff"}'])
def test_a_body_that_is_not_a_json_object_gets_a_400(body):
    prefill, decode = Peer("ok"), Peer("ok")
    (status, text), after = run(prefill, decode, [("POST", "/v1/completions", body), COMPLETE])
    assert status == 400 and "JSON object" in json.loads(text)["error"]["message"], text
    assert after == (200, json.dumps(COMPLETION))
    assert prefill.served == decode.served == 1  # the bad body reached neither server


def test_min_tokens_above_one_reaches_only_the_decode_server():
    """The prefill leg asks for one token; vLLM refuses ``min_tokens`` above ``max_tokens``."""
    prefill, decode = Peer("ok"), Peer("ok")
    body = {"prompt": "hi", "max_tokens": 8, "min_tokens": 4}
    answers = run(prefill, decode, [("POST", "/v1/completions", body),
                                    ("POST", "/v1/chat/completions", dict(body, stream=True))])
    assert answers[0] == (200, json.dumps(COMPLETION)) and answers[1][0] == 200, answers
    assert [b.get("min_tokens") for _, _, b in prefill.requests] == [None, None]
    assert [b["min_tokens"] for _, _, b in decode.requests] == [4, 4]


def test_the_clients_authorization_reaches_both_servers():
    prefill, decode = Peer("ok"), Peer("ok")
    auth = {"Authorization": "Bearer client-key"}
    run(prefill, decode, [(*COMPLETE, auth), ("GET", "/v1/models", None, auth)])
    assert [h.get("authorization") for _, h, _ in prefill.requests] == ["Bearer client-key"]
    assert [h.get("authorization") for _, h, _ in decode.requests] == ["Bearer client-key"] * 2


def test_the_proxys_own_api_key_is_required():
    prefill, decode = Peer("ok"), Peer("ok")
    answers = run(prefill, decode, [COMPLETE, (*COMPLETE, {"Authorization": "Bearer wrong"}),
                                    (*COMPLETE, {"Authorization": "Bearer secret"}), ("GET", "/health", None),
                                    ("GET", "/v1/models", None)], api_key="secret")
    assert [status for status, _ in answers] == [401, 401, 200, 200, 401]
    assert prefill.served == decode.served == 1


def test_health_answers_within_seconds_when_a_server_hangs():
    start = time.monotonic()
    (status, text), = run(Peer("ok"), Peer("ok", health="hang"), [("GET", "/health", None)], health_timeout=1)
    assert time.monotonic() - start < 5
    assert status == 503 and json.loads(text) == {"prefill": 200, "decode": "no answer within 1s (ReadTimeout)"}


def test_a_server_that_never_answers_is_named_after_the_read_timeout():
    start = time.monotonic()
    (status, text), = run(Peer("ok"), Peer("hang"), [COMPLETE], read_timeout=1)
    assert time.monotonic() - start < 10
    assert status == 504 and names(json.loads(text), "decode", 504) and "ReadTimeout" in text


def test_a_server_that_cannot_be_connected_to_is_named_after_the_connect_timeout():
    """A listening socket whose accept queue is full: the kernel drops further SYNs, so connecting hangs."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(0)
    fillers = [socket.socket() for _ in range(4)]
    for f in fillers:
        f.setblocking(False)
        f.connect_ex(sock.getsockname())
    try:
        async def calls():
            app = pd_proxy.make_app(f"http://127.0.0.1:{sock.getsockname()[1]}", await Peer("ok").start(),
                                    connect_timeout=1, read_timeout=60)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
                return await client.post("/v1/completions", json=COMPLETE[2])

        start = time.monotonic()
        answer = asyncio.run(asyncio.wait_for(calls(), 30))
        assert time.monotonic() - start < 10
        assert answer.status_code == 504 and names(answer.json(), "prefill", 504) and "ConnectTimeout" in answer.text
    finally:
        for s in fillers + [sock]:
            s.close()


def test_more_concurrent_streams_than_the_old_cap_of_100():
    """150 streams held open at once by the decode server, released only when all have arrived."""
    n = 150

    async def calls():
        prefill, decode = Peer("ok"), Peer("hold")
        app = pd_proxy.make_app(await prefill.start(), await decode.start(), max_connections=200)

        async def release_when_all_arrived():
            while decode.served < n:
                await asyncio.sleep(0.05)
            decode.release.set()

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy",
                                     timeout=60) as client:
            watcher = asyncio.ensure_future(release_when_all_arrived())
            answers = await asyncio.gather(*(client.post(STREAM[1], json=STREAM[2]) for _ in range(n)))
            watcher.cancel()
        return answers

    answers = asyncio.run(asyncio.wait_for(calls(), 60))
    assert all(a.status_code == 200 and sse_data(a.text) == [{"n": 0}, {"n": 1}, "[DONE]"] for a in answers)


@contextlib.asynccontextmanager
async def served(app, port: int):
    """``app`` served by uvicorn on 127.0.0.1:``port`` while in the context."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    try:
        yield
    finally:
        server.should_exit = True
        await task


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_decode_request(stream):
    """The decode server holds the request open; the client leaves; the proxy must close that connection
    (vLLM aborts a request whose connection closes) and go on serving."""

    async def scenario():
        prefill, decode = Peer("ok"), Peer("hold" if stream else "hang", "ok")
        port = free_port()
        async with served(pd_proxy.make_app(await prefill.start(), await decode.start()), port):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                if stream:
                    async with client.stream("POST", "/v1/completions", json=STREAM[2]) as answer:
                        async for first in answer.aiter_bytes():
                            assert first == EVENTS[0]
                            break
                else:
                    waiting = asyncio.ensure_future(client.post("/v1/completions", json=COMPLETE[2]))
                    while decode.served == 0:
                        await asyncio.sleep(0.05)
                    waiting.cancel()  # the client gives up: its connection closes
            deadline = time.monotonic() + 5
            while decode.closed == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert decode.closed == 1
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                assert (await client.post("/v1/completions", json=COMPLETE[2])).status_code == 200

    asyncio.run(asyncio.wait_for(scenario(), 60))
