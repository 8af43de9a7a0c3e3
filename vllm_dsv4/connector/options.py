"""``kv_connector_extra_config`` of ``DSV4Connector``: the one list of its options, parsed and checked.

    path              the entry store's directory (required)
    max_bytes         the store's budget across every engine using it (default: half the free space of
                      its filesystem when the engine starts, logged); least recently used entries go past it
    window_every      tokens between a prompt's window entries (default 8192, a multiple of 256)
    model_key         names the model in entry keys instead of a digest of its weights (index, shard
                      sizes and headers) and config; for engines that trust each other's checkpoints
    secret            entries carry an HMAC-SHA256 under this key: entries written without it (planted,
                      or another tenant's) are refused, and keys differ between secrets
    secret_file       the same, read from a file (keeps the secret out of the command line)
    group             share the store with this group (name or id): group-writable, entries group-readable;
                      without it the store must belong to this user and be writable by nobody else
    pin_loads         copy and verify each entry a request will load when it is looked up, so that its
                      load cannot fail later (default: on where vLLM cannot recompute a failed load, 0.26)
    lookup_timeout_s  the longest a lookup waits for the store (default 2): a store that hangs costs a
                      miss, never the engine loop
"""

from __future__ import annotations

import grp
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from vllm_dsv4.config import ConfigError

DEFAULT_WINDOW_EVERY = 8192  # tokens between the window entries of a prompt (module plan.py)
DEFAULT_LOOKUP_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Options:
    """``kv_connector_extra_config``, parsed (the module docstring says what each means)."""

    path: str
    max_bytes: int | None = None
    window_every: int = DEFAULT_WINDOW_EVERY
    model_key: str | None = None
    secret: bytes | None = None
    group: int | None = None
    pin_loads: bool | None = None
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> "Options":
        known = {f.name for f in fields(cls)} | {"secret_file"}
        unknown = sorted(set(extra) - known)
        if "path" not in extra or unknown:
            raise ConfigError(f"DSV4Connector: kv_connector_extra_config takes {sorted(known)} ('path' required: "
                              f"a tmpfs such as /dev/shm/... for CPU memory, or a disk or shared directory)"
                              + (f"; unknown: {unknown}" if unknown else ""))
        try:
            max_bytes = int(float(extra["max_bytes"])) if extra.get("max_bytes") is not None else None
            window_every = int(extra.get("window_every", DEFAULT_WINDOW_EVERY))
            lookup_timeout_s = float(extra.get("lookup_timeout_s", DEFAULT_LOOKUP_TIMEOUT_S))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"DSV4Connector: max_bytes, window_every and lookup_timeout_s are numbers ({e})") from e
        if (max_bytes is not None and max_bytes <= 0) or window_every <= 0 or lookup_timeout_s <= 0:
            raise ConfigError(f"DSV4Connector: max_bytes={max_bytes}, window_every={window_every} and "
                              f"lookup_timeout_s={lookup_timeout_s} must be > 0")
        pin_loads = extra.get("pin_loads")
        if pin_loads not in (None, True, False):
            raise ConfigError(f"DSV4Connector: pin_loads is true or false, not {pin_loads!r}")
        return cls(str(extra["path"]), max_bytes, window_every, extra.get("model_key"), _secret(extra),
                   _group(extra.get("group")), pin_loads, lookup_timeout_s)


def _secret(extra: dict[str, Any]) -> bytes | None:
    if "secret" in extra and "secret_file" in extra:
        raise ConfigError("DSV4Connector: give secret or secret_file, not both")
    if extra.get("secret_file") is not None:
        try:
            secret = Path(extra["secret_file"]).read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"DSV4Connector: cannot read secret_file {extra['secret_file']!r} ({e})") from e
    else:
        secret = str(extra["secret"]).encode() if extra.get("secret") is not None else None
    if secret is not None and len(secret) < 16:
        raise ConfigError("DSV4Connector: the secret must be at least 16 bytes")
    return secret


def _group(group: Any) -> int | None:
    """The group id of a group name or id; None for None."""
    if group is None:
        return None
    try:
        return int(group) if str(group).isdigit() else grp.getgrnam(str(group)).gr_gid
    except KeyError as e:
        raise ConfigError(f"DSV4Connector: no group {group!r}") from e
