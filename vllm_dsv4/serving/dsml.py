"""Incremental parser for the answer part of a DeepSeek-V4 completion: text, then DSML tool calls.

The format (docs/MODEL.md §10, the release's ``parse_message_from_completion_text``)::

    content\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="F">
    <｜DSML｜parameter name="k" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="n" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

One state machine serves streaming and whole outputs: ``feed`` takes any chunk, ``finish`` ends the
output. A call's arguments are built as JSON text while they stream (``{"k": "raw text", "n": JSON}``,
``json.dumps`` separators), so the concatenated argument deltas equal the final arguments at every
chunking. Guarantees, for any chunking and any cut-off point:

- no markup reaches ``content``: the ``\\n\\n`` before a block, a half-written tag cut off by
  ``max_tokens`` and anything after the closing block are dropped;
- a call appears only once its name is complete; its arguments are valid JSON when the output ends
  (an open string value is closed, an unfinished non-string value dropped); ``complete`` says whether
  ``</｜DSML｜invoke>`` was reached;
- a ``string="false"`` value that is not JSON (the model's mistake), or JSON nested deeper than
  ``MAX_JSON_DEPTH``, becomes a JSON string;
- given the request's tool names, a call to any other name is parsed but not returned (``undeclared``
  lists it): the model may only call what the request offers.

No vLLM imports; ``tool_parser.py`` adapts it to vLLM's parser interfaces.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import accumulate, repeat

DSML = "｜DSML｜"
MARK = "<" + DSML
BLOCK_OPEN = (f"<{DSML}tool_calls>", f"<{DSML}toolcalls>", f"<{DSML}tool>")  # spellings seen in the wild
BLOCK_CLOSE = tuple("</" + t[1:] for t in BLOCK_OPEN)
INVOKE_OPEN = f'<{DSML}invoke name="'
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"
MAX_NAME_CHARS = 256
MAX_JSON_DEPTH = 64  # deeper values stay text: Python's json recurses per level
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NESTING = {"[": 1, "{": 1, "]": -1, "}": -1}
_NAME_STOP = re.compile(r'["\n<]')
_PARAM_HEAD = re.compile(r'\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*')

# states
TEXT, THINK, BLOCK, NAME, INVOKE, PARAM_HEAD, VALUE, AFTER = (
    "text", "think", "block", "name", "invoke", "head", "value", "after")
THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class Call:
    """One tool call: ``arguments`` is the JSON text emitted so far (complete once ``finish`` ran)."""

    name: str
    arguments: str = "{"
    complete: bool = False
    num_params: int = 0


@dataclass
class Delta:
    """What one ``feed``/``finish`` produced: content text and, per call index, name / argument text."""

    content: str = ""
    reasoning: str = ""
    names: dict[int, str] = field(default_factory=dict)
    arguments: dict[int, str] = field(default_factory=dict)

    def add_args(self, index: int, text: str) -> None:
        self.arguments[index] = self.arguments.get(index, "") + text

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.names or self.arguments)


def _json_chars(text: str) -> str:
    """``text`` escaped for the inside of a JSON string (per character, so chunks can be split anywhere)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")  # Python's json would accept NaN and Infinity


def nesting_depth(text: str) -> int:
    """The deepest bracket nesting of JSON ``text`` (brackets inside strings left out)."""
    return max(accumulate(map(_NESTING.get, _JSON_STRING.sub("", text), repeat(0)), initial=0))


def _partial_suffix(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``tags``."""
    for n in range(min(len(buf), max(map(len, tags)) - 1), 0, -1):
        if any(t.startswith(buf[-n:]) for t in tags):
            return n
    return 0


def _starts(buf: str, tags: tuple[str, ...]) -> str | None | bool:
    """The tag ``buf`` starts with; ``None`` if ``buf`` could still become one (too short); else False."""
    for t in tags:
        if buf.startswith(t):
            return t
    return None if any(t.startswith(buf) for t in tags) else False


class DsmlParser:
    """Feed the answer text (after ``</think>``) in chunks; read ``calls`` and the deltas."""

    def __init__(self, parse_think: bool = True, declared: Iterable[str] | None = None) -> None:
        """``parse_think``: route ``<think>...</think>`` in the answer to reasoning (off when the server
        has no reasoning parser: the markup is then content, as vLLM does). ``declared``: the tool
        names the request offers (None: any name is returned)."""
        self.declared = None if declared is None else frozenset(declared)
        self.undeclared: list[str] = []  # names of calls parsed but not returned
        self.current: Call | None = None  # the call being read (in ``calls`` unless undeclared)
        self.text_tags = BLOCK_OPEN + (INVOKE_OPEN,) + ((THINK_START, THINK_END) if parse_think else ())
        self.state = TEXT
        self.buf = ""  # text not yet consumed
        self.held_ws = ""  # trailing whitespace of the content: the separator if a block follows
        self.calls: list[Call] = []
        self.key: str | None = None  # parameter being read: JSON-quoted key, string flag
        self.is_string: bool | None = None
        self.scanned = 0  # where in buf the value's close tag can start (earlier text was searched)

    # -- public ---------------------------------------------------------------------------------

    def feed(self, text: str) -> Delta:
        """Consume a chunk of the answer; what it completed (text may be held back for one more chunk)."""
        self.buf += text
        out = Delta()
        while self.buf and self._step(out):
            pass
        return out

    def finish(self) -> Delta:
        """End of output (EOS, stop string or max_tokens): flush or drop what is pending."""
        out = Delta()
        if self.state == TEXT:
            # A tag cut off mid-way is markup, and so is its separator. "<" alone is one token before
            # ｜DSML｜: after a line break it is taken for a block's start.
            partial = self.buf and MARK.startswith(self.buf) and self.held_ws.endswith("\n")
            if not (self.buf.startswith(MARK) or partial):
                out.content += self.held_ws + self.buf
            self.held_ws = ""
        elif self.state == THINK:
            out.reasoning += self.buf
        elif self.state in (INVOKE, PARAM_HEAD, VALUE):
            if self.state == VALUE and self.is_string and self.key is not None:
                self._emit(out, '"')  # buf holds at most a cut-off close tag
            self._close_call(out, complete=False)
        self.buf, self.state = "", AFTER
        return out

    # -- one step of the state machine: consume a prefix of buf, False if more text is needed -----

    def _step(self, out: Delta) -> bool:
        return getattr(self, f"_in_{self.state}")(out)

    def _in_text(self, out: Delta) -> bool:
        at = self.buf.find("<")
        if at < 0:
            self._text(out, self.buf)
            self.buf = ""
            return False
        self._text(out, self.buf[:at])
        self.buf = self.buf[at:]
        tag = _starts(self.buf, self.text_tags)
        if tag is None:
            return False
        if tag is False:  # a "<" that opens nothing we know: the model's text
            self._text(out, "<")
            self.buf = self.buf[1:]
            return True
        self.buf = self.buf[len(tag) :]
        if tag in (THINK_START, THINK_END):  # a bare </think> is dropped
            self.state = THINK if tag == THINK_START else TEXT
            return True
        self.held_ws = ""  # the separator belongs to the block
        self.state = NAME if tag == INVOKE_OPEN else BLOCK  # a bare invoke opens a block implicitly
        return True

    def _in_think(self, out: Delta) -> bool:
        """Reasoning the model wrapped in <think> inside the answer (vLLM's reasoning parser has ended)."""
        at = self.buf.find("<")
        while at >= 0 and _starts(self.buf[at:], (THINK_END,) + BLOCK_OPEN) is False:
            at = self.buf.find("<", at + 1)
        if at < 0 or _starts(self.buf[at:], (THINK_END,) + BLOCK_OPEN) is None:
            end = len(self.buf) if at < 0 else at
            out.reasoning += self.buf[:end]
            self.buf = self.buf[end:]
            return False
        out.reasoning += self.buf[:at]
        self.buf = self.buf[at:]
        self.state = TEXT  # </think> is consumed by TEXT (dropped), a block opener starts the block
        return True

    def _in_block(self, out: Delta) -> bool:
        tag = self._next_tag((INVOKE_OPEN,) + BLOCK_CLOSE)
        if not tag:
            return tag is False
        self.state = NAME if tag == INVOKE_OPEN else AFTER
        return True

    def _in_name(self, out: Delta) -> bool:
        # Decided by the first '"', newline or "<" (or the length limit), so any chunking agrees.
        stop = _NAME_STOP.search(self.buf, 0, MAX_NAME_CHARS + 1)
        if stop is None or stop.group() != '"':
            if stop is None and len(self.buf) <= MAX_NAME_CHARS:
                return False
            self.buf = self.buf[stop.start() if stop else MAX_NAME_CHARS :]  # not a name: drop the invoke
            self.state = BLOCK
            return True
        end = stop.start()
        gt = self.buf.find(">", end)
        if gt < 0:
            return False
        name, self.buf = self.buf[:end].strip(), self.buf[gt + 1 :]
        if not name:
            self.state = BLOCK
            return True
        self.current = Call(name)
        self.state = INVOKE
        if self.declared is not None and name not in self.declared:
            self.undeclared.append(name)
            return True
        self.calls.append(self.current)
        out.names[len(self.calls) - 1] = name
        out.add_args(len(self.calls) - 1, "{")
        return True

    def _in_invoke(self, out: Delta) -> bool:
        tag = self._next_tag((PARAM_OPEN, INVOKE_CLOSE, INVOKE_OPEN) + BLOCK_CLOSE)
        if not tag:
            return tag is False
        if tag == PARAM_OPEN:
            self.state = PARAM_HEAD
        else:  # a missing </invoke> before the next invoke or the block's end still ends the call
            self._close_call(out, complete=True)
            self.state = {INVOKE_CLOSE: BLOCK, INVOKE_OPEN: NAME}.get(tag, AFTER)
        return True

    def _in_head(self, out: Delta) -> bool:
        gt = self.buf.find(">")
        if gt < 0:
            return False
        head, self.buf = self.buf[:gt], self.buf[gt + 1 :]
        m = _PARAM_HEAD.fullmatch(head)
        self.key = json.dumps(m.group(1), ensure_ascii=False) if m else None  # None: skip the value
        self.is_string = None if not m or m.group(2) is None else m.group(2) == "true"
        if self.key is not None and self.is_string:
            self._emit(out, self._param_prefix() + '"')
        self.state = VALUE
        return True

    def _in_value(self, out: Delta) -> bool:
        end = self.buf.find(PARAM_CLOSE, self.scanned)
        if end < 0:
            if self.is_string and self.key is not None:  # stream the string, keep a possible close tag
                keep = _partial_suffix(self.buf, (PARAM_CLOSE,))
                self._emit(out, _json_chars(self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep :]
            self.scanned = max(0, len(self.buf) - len(PARAM_CLOSE) + 1)  # a long JSON value: search on
            return False
        self.scanned = 0
        value, self.buf = self.buf[:end], self.buf[end + len(PARAM_CLOSE) :]
        if self.key is not None:
            if self.is_string:
                self._emit(out, _json_chars(value) + '"')
            else:
                self._emit(out, self._param_prefix() + self._json_value(value))
        self.state = INVOKE
        return True

    def _in_after(self, out: Delta) -> bool:
        at = min((i for i in (self.buf.find(t) for t in BLOCK_OPEN) if i >= 0), default=-1)
        if at < 0:  # text after the block is not part of the message; keep a possible opener
            self.buf = self.buf[len(self.buf) - _partial_suffix(self.buf, BLOCK_OPEN) :]
            return False
        self.buf = self.buf[at:]
        tag = _starts(self.buf, BLOCK_OPEN)
        self.buf = self.buf[len(tag) :]
        self.state = BLOCK
        return True

    # -- helpers --------------------------------------------------------------------------------

    def _text(self, out: Delta, text: str) -> None:
        """Content, holding back trailing whitespace until something other than a block follows."""
        if not text:
            return
        body = text.rstrip()
        if body:
            out.content += self.held_ws + body
            self.held_ws = text[len(body) :]
        else:
            self.held_ws += text

    def _next_tag(self, tags: tuple[str, ...]) -> str | None | bool:
        """Skip whitespace and stray text up to the next tag; the tag consumed, None (wait) or False."""
        stripped = self.buf.lstrip()
        at = stripped.find("<")
        if at < 0:
            self.buf = ""
            return None
        self.buf = stripped[at:]
        tag = _starts(self.buf, tags)
        if tag is None:
            return None
        if tag is False:  # unexpected markup or text inside the block: skip one character
            self.buf = self.buf[1:]
            return False
        self.buf = self.buf[len(tag) :]
        return tag

    def _param_prefix(self) -> str:
        call = self.current
        call.num_params += 1
        return ("" if call.num_params == 1 else ", ") + f"{self.key}: "

    def _json_value(self, raw: str) -> str:
        try:
            if nesting_depth(raw) > MAX_JSON_DEPTH:
                raise ValueError("nested too deeply")
            return json.dumps(json.loads(raw, parse_constant=_not_json), ensure_ascii=False)
        except ValueError:  # not JSON (or string="true" missing): keep the text as a string
            return json.dumps(raw, ensure_ascii=False)

    def _emit(self, out: Delta, text: str) -> None:
        self.current.arguments += text
        if self.calls and self.current is self.calls[-1]:
            out.add_args(len(self.calls) - 1, text)

    def _close_call(self, out: Delta, complete: bool) -> None:
        self._emit(out, "}")
        self.current.complete = complete
