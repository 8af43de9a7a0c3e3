"""scripts/pd_proxy.py when a peer server fails: unreachable, closing the connection before it answers,
or dropping a stream midway, as a crashed or restarted vLLM server does. The peers here are plain TCP
servers that speak just enough HTTP/1.1 to do that on cue; the proxy is the real app, called in process
while its own client reaches the peers over sockets. Every failure must reach the client as an error
naming the server, and the proxy must go on serving."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.conftest import REPO_ROOT, load_module_by_path
from tests.serving.conftest import free_port

pd_proxy = load_module_by_path(REPO_ROOT / "scripts" / "pd_proxy.py")

COMPLETION = {"choices": [{"text": "x"}]}
REFUSAL = {"error": {"message": "this request is refused", "code": 400}}
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"n": 0}\n\n', b'data: {"n": 1}\n\n', b"data: [DONE]\n\n"]


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict]:
    """(path, JSON body) of the next request on the connection."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    sizes = [int(line.split(":")[1]) for line in head.split("\r\n") if line.lower().startswith("content-length")]
    body = await reader.readexactly(sizes[0] if sizes else 0)
    return head.split(" ")[1], json.loads(body) if body else {}


def json_answer(status: bytes, answer: dict) -> bytes:
    data = json.dumps(answer).encode()
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (status, len(data), data)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Peer:
    """A server on 127.0.0.1 answering each request by the next entry of ``acts`` (the last repeats):
    "ok" (200: JSON, or the whole event stream when asked to stream), "refuse" (400 with a JSON error,
    as vLLM answers a request it rejects, streamed or not), "close" (hang up before answering), "drop"
    (start the event stream, send one event and half of the next, hang up)."""

    def __init__(self, *acts: str):
        self.acts, self.served = list(acts), 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                path, body = await read_request(reader)
                act = self.acts[min(self.served, len(self.acts) - 1)] if path != "/health" else "ok"
                self.served += path != "/health"
                if act == "close":
                    return
                if act == "refuse":
                    writer.write(json_answer(b"400 Bad Request", REFUSAL))
                elif not body.get("stream"):
                    writer.write(json_answer(b"200 OK", COMPLETION if path != "/health" else {}))
                elif act == "drop":
                    writer.write(STREAM_HEAD + chunk(EVENTS[0] + EVENTS[1][:9]))
                else:
                    writer.write(STREAM_HEAD + b"".join(chunk(e) for e in EVENTS) + chunk(b""))
                await writer.drain()
                if act == "drop":
                    return
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


async def proxy_calls(prefill: Peer | None, decode: Peer, calls: list[tuple[str, str, dict | None]]) -> list:
    """Run the peers (``None``: a port nobody listens on) and make ``calls`` (method, path, JSON body)
    through one proxy, in order; their (status, body text)."""
    prefill_url = await prefill.start() if prefill else f"http://127.0.0.1:{free_port()}"
    decode_url = await decode.start()
    app = pd_proxy.make_app(prefill_url, decode_url, timeout=30)
    answers = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        for method, path, body in calls:
            answer = await client.request(method, path, json=body)
            answers.append((answer.status_code, answer.text))
    return answers


def run(prefill: Peer | None, decode: Peer, calls: list) -> list:
    return asyncio.run(asyncio.wait_for(proxy_calls(prefill, decode, calls), 60))


def sse_data(text: str) -> list:
    """Each event's data: parsed JSON, or the literal "[DONE]"; an event that is not whole fails here."""
    events = text.split("\n\n")
    assert events[-1] == "", text  # the stream ends with a whole event
    assert all(e.startswith("data: ") for e in events[:-1]), text
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events[:-1]]


def names(error: dict, role: str) -> bool:
    return error["error"]["code"] == 502 and f"the {role} server at http://127.0.0.1:" in error["error"]["message"]


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
