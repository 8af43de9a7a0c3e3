"""What makes two engines' entries interchangeable, as 16 bytes mixed into every entry key.

An entry's bytes are the caches a model computed: they depend on the weights, the config (vLLM's,
overrides included), the dtypes, every cache layer's page, and how this plugin lays entries out
(``FORMAT``). The weights are named by a digest of the checkpoint's index and of each shard's name,
size and safetensors header (shapes, dtypes, offsets), cheap even for a 1.6T checkpoint; a checkpoint
whose files cannot be read (a hub id not in the local cache) is named by its id and revision instead.
``model_key`` replaces the weights' part for engines that trust each other's checkpoints. A store's
secret is mixed in too, so tenants with different secrets never share (or find) each other's keys.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from vllm_dsv4 import get_logger

FORMAT = 2  # the plugin's entry layout; bump when what an entry holds, or how, changes
INDEX_FILES = ("model.safetensors.index.json", "config.json")
MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit

logger = get_logger(__name__)


def fingerprint(vllm_config, kv_cache_config, model_key: str | None, secret: bytes | None) -> bytes:
    """16 bytes naming the model, its config and dtypes, the cache layout, the entry format and the secret."""
    model_config = vllm_config.model_config
    description = {
        "format": FORMAT,
        "weights": model_key or weights_digest(model_config.model, getattr(model_config, "revision", None)),
        "config": model_config.hf_config.to_dict(),
        "dtype": str(model_config.dtype),
        "cache_dtype": vllm_config.cache_config.cache_dtype,
        "groups": [[g.kv_cache_spec.block_size, g.kv_cache_spec.page_size_bytes, list(g.layer_names)]
                   for g in kv_cache_config.kv_cache_groups],
        "secret": hashlib.sha256(secret).hexdigest() if secret else None,
    }
    text = json.dumps(description, sort_keys=True, default=str).encode()
    return hashlib.blake2b(text, digest_size=16).digest()


def weights_digest(model: str, revision: str | None = None) -> str:
    """A digest of the checkpoint at ``model`` (a directory, or a hub id found in the local cache)."""
    directory = _local_directory(model, revision)
    if directory is None:
        logger.warning("DSV4Connector: %s is not a local checkpoint; entries are keyed by its name and revision "
                       "%s (set model_key on engines that share them)", model, revision)
        return f"{model}@{revision}"
    h = hashlib.sha256()
    for name in INDEX_FILES:
        if (directory / name).is_file():
            h.update(name.encode() + b"\0" + (directory / name).read_bytes())
    for shard in sorted(directory.glob("*.safetensors")):
        h.update(shard.name.encode() + b"\0" + struct.pack("<Q", shard.stat().st_size) + _safetensors_header(shard))
    return h.hexdigest()


def _local_directory(model: str, revision: str | None) -> Path | None:
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache, not a hub id, no hub library: no local files
        return None


def _safetensors_header(path: Path) -> bytes:
    """The shard's header (u64 length + JSON), or what of it there is."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        return prefix + f.read(min(length, MAX_SAFETENSORS_HEADER))
