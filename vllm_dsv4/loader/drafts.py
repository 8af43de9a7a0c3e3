"""Which draft a checkpoint holds (its ``mtp.*`` tensors), told from its config.json and its index, and the
speculative method that drafts with it.

One row per draft; the first row that recognises a checkpoint names it. ``num_nextn_predict_layers`` does not
decide anything: the DSpark releases (V4-Flash-0731, V4-Pro-0813) leave it at 1 and ship three stages
(docs/MODEL.md §7). It is read only where the index cannot be (a model that is not a local directory), to
tell an MTP module from none.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dsv4.config import ConfigError, DSparkConfig, Dsv4Config
from vllm_dsv4.loader.checkpoint import (
    DSPARK_ONLY, INDEX_FILE, MTP_ONLY, SINGLE_FILE, Checkpoint, CheckpointError, dspark_problems, holds_draft_tensors,
)


def _has_dspark(raw: Mapping[str, Any], names: frozenset[str] | None) -> bool:
    return any(k in raw for k in DSparkConfig.KEYS) or bool(holds_draft_tensors(names, DSPARK_ONLY))


def _has_mtp_module(raw: Mapping[str, Any], names: frozenset[str] | None) -> bool:
    if names is None:
        return int(raw.get("num_nextn_predict_layers", 0)) > 0
    return bool(holds_draft_tensors(names, MTP_ONLY))


@dataclass(frozen=True)
class Draft:
    """``method``: the ``speculative_config`` method that drafts with it (None: no draft);
    ``recognise(config, index names or None)``; ``holds``: what the checkpoint carries, for messages."""

    method: str | None
    recognise: Callable[[Mapping[str, Any], frozenset[str] | None], bool]
    holds: str


DRAFTS = (
    Draft("dspark", _has_dspark, "a DSpark drafter (dspark_* keys in config.json; mtp.0.main_proj, mtp.*.markov_head)"),
    Draft("mtp", _has_mtp_module, "an MTP module (mtp.0.e_proj, h_proj, enorm, hnorm)"),
    Draft(None, lambda raw, names: True, "no draft model (no mtp.* tensors)"),
)
_DRAFT_OF_METHOD = {draft.method: draft for draft in DRAFTS if draft.method}


def draft_of(raw: Mapping[str, Any], names: Iterable[str] | None) -> Draft:
    """The draft of a checkpoint with config.json ``raw`` and tensor ``names`` (None where the index cannot
    be read); CheckpointError where config.json and the index disagree about it."""
    frozen = None if names is None else frozenset(names)
    if frozen is not None:
        problems = dspark_problems(Dsv4Config.from_dict(raw).dspark, frozen)
        if problems:
            raise CheckpointError("; ".join(problems))
    return next(draft for draft in DRAFTS if draft.recognise(raw, frozen))


def tensor_names(path: str | Path) -> list[str] | None:
    """The tensor names of a local checkpoint (its index, or the one file's header); None for a model
    that is not a local directory (a hub id, fetched later by vLLM)."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        try:
            return list(json.loads((path / INDEX_FILE).read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{INDEX_FILE}: no valid 'weight_map' ({e})") from e
    if (path / SINGLE_FILE).is_file():
        return Checkpoint(path).names()
    return None


def check_draft_method(method: str, raw: Mapping[str, Any], names: Iterable[str] | None) -> Draft:
    """Raise ConfigError unless the checkpoint's draft serves ``speculative_config`` method ``method`` (one of
    the methods that draft with the checkpoint's own modules: mtp, dspark)."""
    draft = draft_of(raw, names)
    if draft.method != method:
        use = f"use method {draft.method!r}" if draft.method else "it cannot draft"
        raise ConfigError(f"speculative decoding with method {method!r} needs {_DRAFT_OF_METHOD[method].holds}; "
                          f"this checkpoint holds {draft.holds}: {use}")
    return draft
