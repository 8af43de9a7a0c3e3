"""The prefill -> decode hand-off of vLLM's disaggregation protocol (vLLM's own proxy pattern), as
``scripts/pd_proxy.py`` speaks it.

The prefill leg asks the prefill engine to keep the prompt's KV for a remote decode
(``do_remote_decode``); its answer carries ``kv_transfer_params`` (NIXL: the engine, host, port and
block ids to read from), which the decode leg hands to the decode engine (``do_remote_prefill``).
Connectors that move KV through a store (``DSV4Connector``) return none: the decode request then goes
out as the client sent it.
"""

from __future__ import annotations

import json

# What vLLM's NIXL connector reads on the prefill engine: keep the blocks for a remote decode.
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_request(body: dict) -> dict:
    """The prefill leg's body (already cut to one token) with the hand-off request."""
    return dict(body, kv_transfer_params=dict(REMOTE_DECODE))


def decode_request(body: dict, prefill_answer: bytes | str) -> dict:
    """The client's body for the decode leg, with the prefill engine's ``kv_transfer_params`` if it sent any."""
    try:
        params = json.loads(prefill_answer).get("kv_transfer_params")
    except (ValueError, AttributeError):  # not a JSON object: nothing to hand over
        params = None
    return dict(body, kv_transfer_params=params) if params else body
