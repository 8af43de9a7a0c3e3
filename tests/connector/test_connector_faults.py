"""DSV4Connector's scheduler and worker sides driven in one process, without vLLM's engine, with the store
attacked between and around the calls vLLM makes: entries evicted, replaced or damaged after a lookup,
forged entries that pass the digest, stray files, a store that hangs, other checkpoints.

A producer saves one prompt's entries from random cache pages (block id = block position + 1 in every
group); a consumer with the same block ids looks the prompt up, its worker loads, and every page the
load names must equal the producer's. A load may fail only as vLLM's per-request failure
(``failed_recving``), and with pinned loads (vLLM 0.26's way) not at all."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tests.conftest import load_make_checkpoint
from vllm_dsv4 import compat
from vllm_dsv4.config import Dsv4Config, LayerKind
from vllm_dsv4.connector import connector as connector_module
from vllm_dsv4.connector.connector import DSV4Connector, DSV4ConnectorMetadata
from vllm_dsv4.connector.fingerprint import fingerprint
from vllm_dsv4.connector.plan import PrefixKeys
from vllm_dsv4.connector.store import EntryError, EntryStore, read_entry
from vllm_dsv4.kv.layout import layer_components

CONFIG = load_make_checkpoint().make_config("flash", num_layers=3)
CFG = Dsv4Config.from_dict(CONFIG)
PAGE_BYTES, NUM_BLOCKS, CHUNK = 48, 200, 256
PROMPT = list(range(1000, 1000 + 700))  # history entries at 256 and 512, the window entry at 699


def kv_cache_groups():
    """Cache layers of one C4 and one C128 layer, grouped as vLLM groups them (block size, window)."""
    members = {}
    for layer, kind in ((0, LayerKind.C4), (1, LayerKind.C128)):
        for name, c in layer_components(CFG, kind, torch.float32, CHUNK).items():
            members.setdefault((c.block_tokens, c.window_tokens), []).append(f"model.layers.{layer}.attn.{name}_cache")
    return [SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=block, page_size_bytes=PAGE_BYTES),
                            layer_names=names) for (block, _), names in members.items()]


GROUPS = kv_cache_groups()


def vllm_config(role: str, extra: dict, model: str = "tiny-model"):
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=None, dtype=torch.float32,
                                     hf_config=SimpleNamespace(to_dict=lambda: dict(CONFIG), **CONFIG)),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        kv_transfer_config=SimpleNamespace(is_kv_producer=role in ("kv_producer", "kv_both"),
                                           is_kv_consumer=role in ("kv_consumer", "kv_both"),
                                           kv_connector_extra_config=extra))


def make(role: str, side: KVConnectorRole, extra: dict, seed: int | None = None) -> DSV4Connector:
    conn = DSV4Connector(vllm_config(role, extra), side, SimpleNamespace(kv_cache_groups=GROUPS))
    if side == KVConnectorRole.WORKER:
        g = torch.Generator().manual_seed(seed or 0)
        conn.register_kv_caches({name: torch.randint(0, 256, (NUM_BLOCKS, PAGE_BYTES), dtype=torch.uint8, generator=g)
                                 if seed is not None else torch.zeros(NUM_BLOCKS, PAGE_BYTES, dtype=torch.uint8)
                                 for group in GROUPS for name in group.layer_names})
    return conn


def block_ids(num_tokens: int) -> list[list[int]]:
    return [[p + 1 for p in range(-(-num_tokens // g.kv_cache_spec.block_size))] for g in GROUPS]


@pytest.fixture(autouse=True)
def rank_zero(monkeypatch):
    monkeypatch.setattr(connector_module, "get_tensor_model_parallel_rank", lambda: 0)


def produce(extra: dict) -> DSV4Connector:
    """A producer's worker that saved PROMPT's entries; its pages are the expected ones."""
    scheduler = make("kv_producer", KVConnectorRole.SCHEDULER, extra)
    worker = make("kv_producer", KVConnectorRole.WORKER, extra, seed=1)
    keys = PrefixKeys(scheduler.fingerprint, CHUNK)
    saves = scheduler._saves(keys, PROMPT, [256, 512], [len(PROMPT) - 1], block_ids(len(PROMPT)))
    assert len(saves) == 3
    worker.bind_connector_metadata(DSV4ConnectorMetadata(saves=saves))
    worker.wait_for_save()
    return worker


def request(request_id: str = "r") -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, all_token_ids=PROMPT, prompt_token_ids=PROMPT,
                           num_tokens=len(PROMPT), cache_salt=None, num_computed_tokens=0)


def look_up(scheduler: DSV4Connector, req=None) -> tuple[int, DSV4ConnectorMetadata]:
    """(tokens found, the step's metadata) for a request with nothing computed."""
    req = req or request()
    found, _ = scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: block_ids(len(PROMPT))), found)
    return found, scheduler.build_connector_meta(SimpleNamespace())


def load(meta: DSV4ConnectorMetadata, extra: dict) -> tuple[DSV4Connector, set[str]]:
    """A consumer worker that ran ``meta``'s loads; the requests whose load failed."""
    worker = make("kv_consumer", KVConnectorRole.WORKER, extra)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    return worker, worker.get_transfer_results(set()).failed_recving


def assert_loaded(worker: DSV4Connector, producer: DSV4Connector, meta: DSV4ConnectorMetadata) -> None:
    """Every block the loads wrote holds the producer's page, in every layer of its group."""
    for g, group in enumerate(GROUPS):
        dst = sorted({d for loads in meta.loads.values() for ld in loads for _, d in ld.copies[g]})
        assert dst, group.layer_names
        for name in group.layer_names:
            assert torch.equal(worker._pages[name][dst], producer._pages[name][dst]), name


@pytest.fixture
def store(tmp_path):
    return {"path": str(tmp_path / "store"), "max_bytes": 1 << 26}


def damage(producer: DSV4Connector, how: str) -> None:
    """Every entry of the store evicted, damaged in place, or truncated."""
    for path in producer.store.root.rglob("*.kv"):
        if how == "evicted":
            path.unlink()
        elif how == "damaged":
            data = bytearray(path.read_bytes())
            data[-7] ^= 0x10
            path.write_bytes(data)
        else:
            path.write_bytes(path.read_bytes()[:-3])


def test_a_clean_load(store):
    producer = produce(store)
    found, meta = look_up(make("kv_consumer", KVConnectorRole.SCHEDULER, store))
    worker, failed = load(meta, store)
    assert found == len(PROMPT) - 1 and failed == set()
    assert_loaded(worker, producer, meta)


@pytest.mark.parametrize("how", ["evicted", "damaged", "truncated"])
def test_without_pins_a_store_event_after_the_lookup_fails_the_load_late(store, how):
    produce(store)
    _, meta = look_up(make("kv_consumer", KVConnectorRole.SCHEDULER, dict(store, pin_loads=False)))
    damage_of = make("kv_producer", KVConnectorRole.WORKER, store)
    damage(damage_of, how)
    assert load(meta, store)[1] == {"r"}  # vLLM 0.32 recomputes it; vLLM 0.26 could not


@pytest.mark.parametrize("how", ["evicted", "damaged", "truncated"])
def test_pinned_loads_survive_any_store_event_after_the_lookup(store, how):
    producer = produce(store)
    scheduler = make("kv_consumer", KVConnectorRole.SCHEDULER, dict(store, pin_loads=True))
    found, meta = look_up(scheduler)
    damage(producer, how)
    worker, failed = load(meta, store)
    assert found == len(PROMPT) - 1 and failed == set()
    assert_loaded(worker, producer, meta)
    pins = list(scheduler.pins.root.rglob("*.kv"))
    assert len(pins) == 3
    scheduler.update_connector_output(SimpleNamespace(finished_recving={"r"}))  # the workers loaded it
    assert not any(pin.exists() for pin in pins)


def test_a_request_looked_up_again_keeps_its_pinned_copies(store):
    """vLLM looks a request it could not schedule up again in the next step: no second copy."""
    produce(store)
    scheduler = make("kv_consumer", KVConnectorRole.SCHEDULER, dict(store, pin_loads=True))
    req = request()
    assert scheduler.get_num_new_matched_tokens(req, 0) == (len(PROMPT) - 1, True)
    first = {p: p.stat().st_ino for p in scheduler.pins.root.rglob("*.kv")}
    assert scheduler.get_num_new_matched_tokens(req, 0) == (len(PROMPT) - 1, True)
    assert {p: p.stat().st_ino for p in scheduler.pins.root.rglob("*.kv")} == first and len(first) == 3


def test_a_pinned_lookup_drops_a_damaged_entry_and_resumes_before_it(store):
    producer = produce(store)
    history = PrefixKeys(producer.fingerprint, CHUNK).history_key(PROMPT, 512)
    data = bytearray(producer.store.path(history).read_bytes())
    data[-1] ^= 1
    producer.store.path(history).write_bytes(data)
    scheduler = make("kv_consumer", KVConnectorRole.SCHEDULER, dict(store, pin_loads=True))
    found, meta = look_up(scheduler)
    assert found == 0 and meta.loads == {}  # no window entry before 512 (window_every 8192): a miss
    assert not producer.store.path(history).exists()
    scheduler.request_finished_all_groups(request(), block_ids(len(PROMPT)))
    assert not list(scheduler.pins.root.rglob("*"))


def test_on_vllm_026_loads_are_pinned_and_no_store_event_ends_the_engine(store, monkeypatch):
    monkeypatch.setattr(compat, "reports_failed_loads", lambda: False)
    producer = produce(store)
    for pin_loads, fails in ((None, False), (False, True)):
        scheduler = make("kv_consumer", KVConnectorRole.SCHEDULER, dict(store) | (
            {} if pin_loads is None else {"pin_loads": pin_loads}))
        _, meta = look_up(scheduler)
        evicted = {p: p.read_bytes() for p in producer.store.root.rglob("*.kv")}
        damage(producer, "evicted")
        worker = make("kv_consumer", KVConnectorRole.WORKER, store)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        if fails:
            with pytest.raises(EntryError, match="no way to recompute"):  # what ended 0.26 engines
                worker.get_finished(set())
        else:
            assert worker.get_finished(set()) == (None, {"r"})
            assert_loaded(worker, producer, meta)
        for path, data in evicted.items():
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(data)


def forged_headers(header: dict) -> dict[str, dict]:
    groups = header["groups"]
    bad = {
        "groups not a list": dict(header, groups={"0": groups[0]}),
        "a group too few": dict(header, groups=groups[:-1]),
        "blocks a string": dict(header, groups=[dict(groups[0], blocks=str(groups[0]["blocks"]))] + groups[1:]),
        "blocks a bool": dict(header, groups=[dict(groups[0], blocks=True)] + groups[1:]),
        "blocks too few": dict(header, groups=[dict(groups[0], blocks=groups[0]["blocks"] - 1)] + groups[1:]),
        "blocks negative": dict(header, groups=[dict(groups[0], blocks=-1)] + groups[1:]),
        "page bytes other": dict(header, groups=[dict(groups[0], page_bytes=[PAGE_BYTES * 2] * len(
            groups[0]["page_bytes"]))] + groups[1:]),
        "layers other": dict(header, groups=[dict(groups[0], layers=groups[0]["layers"][::-1])] + groups[1:]),
        "group a list": dict(header, groups=[[1, 2]] + groups[1:]),
        "an extra field": dict(header, groups=[dict(groups[0], offset=3)] + groups[1:]),
        "end other": dict(header, end=header["end"] - 1),
        "end a string": dict(header, end=str(header["end"])),
        "fingerprint other": dict(header, fingerprint="00" * 16),
        "format other": dict(header, format=1),
    }
    return bad


def test_forged_entries_that_pass_the_digest_fail_only_their_request(store):
    """Anyone who can write an unkeyed store can make a valid digest: the layout must be checked."""
    producer = produce(store)
    key = PrefixKeys(producer.fingerprint, CHUNK).history_key(PROMPT, 256)
    header, payload = read_entry(producer.store.path(key), None)
    header.pop("payload_bytes")
    for name, forged in forged_headers(header).items():
        producer.store.write(key, forged, [payload])
        _, meta = look_up(make("kv_consumer", KVConnectorRole.SCHEDULER, store))
        assert load(meta, store)[1] == {"r"}, name
    producer.store.write(key, header, [payload[:-PAGE_BYTES]])  # a page short
    _, meta = look_up(make("kv_consumer", KVConnectorRole.SCHEDULER, store))
    assert load(meta, store)[1] == {"r"}


def test_stray_files_in_a_window_directory_are_skipped(store):
    producer = produce(store)
    keys = PrefixKeys(producer.fingerprint, CHUNK)
    directory = producer.store.root / keys.window_dir(PROMPT, 512)
    for name in ("junk.kv", "-x.kv", "x-y.kv", "99999999999999999999999-a.kv", "12.kv", "١٢-x.kv", ".hidden.kv"):
        (directory / name).write_bytes(b"not an entry")
    (directory / "subdir.kv").mkdir()
    assert look_up(make("kv_consumer", KVConnectorRole.SCHEDULER, store))[0] == len(PROMPT) - 1


def test_a_store_that_hangs_costs_misses_not_the_engine_loop(store, monkeypatch):
    produce(store)
    scheduler = make("kv_consumer", KVConnectorRole.SCHEDULER, dict(store, lookup_timeout_s=0.2))
    release, check = threading.Event(), scheduler.store.check
    monkeypatch.setattr(scheduler.store, "check", lambda key: release.wait() and check(key))
    start = time.monotonic()
    assert scheduler.get_num_new_matched_tokens(request("a"), 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(request("b"), 0) == (0, False)  # at once while it hangs
    assert time.monotonic() - start < 1.5
    release.set()
    time.sleep(0.1)
    assert scheduler.get_num_new_matched_tokens(request("c"), 0) == (len(PROMPT) - 1, True)


def checkpoint(directory, shard_bytes: bytes, index: str = '{"weight_map": {}}'):
    directory.mkdir()
    (directory / "model.safetensors.index.json").write_text(index)
    header = b'{"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}'
    (directory / "model-00001.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + shard_bytes)
    return str(directory)


def test_keys_follow_the_weights_not_the_path(tmp_path):
    kv = SimpleNamespace(kv_cache_groups=GROUPS)
    a = checkpoint(tmp_path / "a", b"\x00\x01\x02\x03")
    same_elsewhere = checkpoint(tmp_path / "b", b"\x00\x01\x02\x03")
    longer = checkpoint(tmp_path / "c", b"\x00\x01\x02\x03\x04")
    reindexed = checkpoint(tmp_path / "d", b"\x00\x01\x02\x03", '{"weight_map": {"w": "x"}}')

    def fp(model, secret=None, model_key=None):
        return fingerprint(vllm_config("kv_both", {}, model), kv, model_key, secret)

    assert fp(a) == fp(same_elsewhere)
    assert len({fp(a), fp(longer), fp(reindexed), fp(a, secret=b"s" * 16), fp(a, model_key="m")}) == 5
    assert fp(a, model_key="m") == fp(longer, model_key="m")


def test_a_store_shared_with_a_secret_refuses_entries_without_it(store):
    secret = dict(store, secret="0123456789abcdef")
    producer = produce(store)  # no secret: its keys are not even found
    assert look_up(make("kv_consumer", KVConnectorRole.SCHEDULER, secret))[0] == 0
    keyed = produce(secret)
    found, meta = look_up(make("kv_consumer", KVConnectorRole.SCHEDULER, secret))
    worker, failed = load(meta, secret)
    assert found == len(PROMPT) - 1 and failed == set()
    assert_loaded(worker, keyed, meta)
    assert isinstance(EntryStore(producer.store.root, 1 << 26).max_bytes, int)
