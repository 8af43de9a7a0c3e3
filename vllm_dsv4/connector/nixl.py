"""``DSV4NixlConnector``: vLLM's NIXL connector (pull mode, UCX) for DeepSeek-V4's per-component caches.

    --kv-transfer-config '{"kv_connector": "DSV4NixlConnector", "kv_role": "kv_producer"}'   # prefill
    --kv-transfer-config '{"kv_connector": "DSV4NixlConnector", "kv_role": "kv_consumer"}'   # decode

Everything is vLLM's ``NixlPullConnector``: its scheduler (which blocks of which KV-cache group a
request hands over, the sliding-window and compressor-state groups clipped to their windows), handshake,
transfers, lease and heartbeats, options (``kv_connector_extra_config``) and proxy protocol
(``kv_transfer_params`` with ``do_remote_decode`` / ``do_remote_prefill``). What differs is how the
worker describes our cache memory to NIXL, and, on CPU, two settings of the worker's process.

Regions (vLLM 0.32). vLLM packs every KV-cache group into one block pool whose rows overlay the
groups (block-outermost layout): the first layer of every group starts at byte 0 of a row, so a
window page, a C4 page and a compressor-state page share one address with different lengths. vLLM's
pull worker keys its NIXL regions by address and keeps the page length registered there last; the
other groups' pages at that address are then read at that length (a 64-token window page cut to a
4-token state page) and the decode engine computes on garbage. Its push worker, for
pipeline-parallel prefill, registers one region per layer and routes each group's block ids to its
own layers' regions; this worker takes that path at any pipeline size, so each layer's pages move at
their own length and nothing else moves. vLLM 0.26 registers a packed pool as one region and moves
whole rows (``compat.nixl_regions_by_layer``).

CPU. NIXL's agent runs a progress thread that polls without pause (a core per engine, idle or not);
on CPU, where the model computes on every core, the agent runs without it and progresses when vLLM
checks its transfers (every engine step while a transfer is pending).
"""

from __future__ import annotations

import uuid

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlBaseConnector,
    NixlPullConnector,
    NixlPullConnectorScheduler,
    NixlPullConnectorWorker,
)
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config
from vllm.platforms import current_platform

from vllm_dsv4 import compat

DEFAULT_UCX_THREADS = 4  # vLLM's default for kv_connector_extra_config "num_threads"


class DSV4NixlWorker(NixlPullConnectorWorker):
    """vLLM's pull worker with one NIXL region per cache layer (vLLM's layer-name routing)."""

    _supports_pp_hma = True  # regions advertise their layers, so both ends match them by name

    def __init__(self, vllm_config, engine_id: str, kv_cache_config):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        if current_platform.is_cpu():
            threads = self.kv_transfer_config.get_from_extra_config("num_threads", DEFAULT_UCX_THREADS)
            config = nixl_agent_config(enable_prog_thread=False, backends=self.nixl_backends, num_threads=threads,
                                       capture_telemetry=True)
            self.nixl_wrapper = NixlWrapper(str(uuid.uuid4()), config)  # no memory registered with the first yet

    def _requires_layer_name_routing(self) -> bool:
        return compat.nixl_regions_by_layer() and self._tracks_region_layers()


class DSV4NixlConnector(NixlPullConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)  # NixlPullConnector's would build
        if role == KVConnectorRole.SCHEDULER:                               # a worker (a NIXL agent) we replace
            self.connector_scheduler = NixlPullConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
        else:
            self.connector_worker = DSV4NixlWorker(vllm_config, self.engine_id, kv_cache_config)
