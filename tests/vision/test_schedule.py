"""Image blocks kept whole by the scheduler (vision/schedule.py), with vLLM's request and cache objects
stood in for: step boundaries, prefix-cache hits and connector offers that would fall inside a block
move to before its START; the architecture rewrite of a Vision config (patches.py patch 9)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_dsv4.config import ConfigError
from vllm_dsv4.vision import schedule


def request(*placeholders: tuple[int, int]):
    """A request whose images' placeholders (pad + block) are at (offset, length)."""
    features = [SimpleNamespace(modality="image", mm_position=SimpleNamespace(offset=o, length=n))
                for o, n in placeholders]
    return SimpleNamespace(mm_features=features)


def test_blocks_start_after_their_alignment_pad():
    # offsets 0 -> 3 PADs (START at 3), 5 -> 2 PADs (START at 7), 7 -> none
    assert schedule.image_blocks(request((0, 117), (200, 50), (7, 10))) == [(3, 116), (203, 249), (7, 16)]
    assert schedule.image_blocks(SimpleNamespace(mm_features=None)) == []


@pytest.mark.parametrize("computed, new, want", [
    (0, 100, 100),  # ends before the block (START at 103)
    (0, 104, 103),  # would take START only: stops before it
    (0, 216, 103),  # would end on the block's last token but one
    (0, 217, 217),  # takes the whole block (END at 216)
    (103, 50, 0),  # starts at START, cannot finish the block: waits for a bigger budget
    (103, 114, 114),
    (217, 30, 30),  # after the block
    (150, 10, 10),  # already inside (a guard failed elsewhere): nothing better to do than go on
])
def test_steps_never_end_inside_a_block(computed, new, want):
    blocks = schedule.image_blocks(request((100, 117)))  # pad 3: block 103..216
    assert schedule.tokens_keeping_blocks_whole(blocks, computed, new) == want


def test_the_first_block_cut_wins():
    blocks = schedule.image_blocks(request((100, 117), (300, 60)))  # 103..216, 303..359
    assert schedule.tokens_keeping_blocks_whole(blocks, 0, 320) == 303
    assert schedule.tokens_keeping_blocks_whole(blocks, 217, 100) == 303 - 217


class Coordinator:
    """Hits of whole 256-token blocks up to a cached length, as vLLM's coordinator returns them."""

    def __init__(self, cached: int):
        self.cached, self.asked = cached, []

    def find_longest_cache_hit(self, block_hashes, max_length):
        self.asked.append(max_length)
        hit = min(self.cached, max_length) // 256 * 256
        return ("blocks", hit, 0)


class Manager:
    def __init__(self, cached: int):
        self.coordinator = Coordinator(cached)

    def get_computed_blocks(self, request):
        _, hit, _ = self.coordinator.find_longest_cache_hit(None, request.num_tokens - 1)
        return "blocks", hit, 0


@pytest.mark.parametrize("placeholder, cached, want", [
    ((100, 117), 1000, 768),  # the hit (768 of an 800-token prompt) is past the block
    ((240, 117), 1000, 768),  # block 243..356: 768 is past it
    ((240, 117), 300, 0),  # 256 would cut 243..356: capped at 243, whole blocks: 0
    ((500, 117), 600, 256),  # 512 would cut 503..616: capped at 503: 256
    ((253, 10), 600, 512),  # START exactly at 256; 512 is past the block
])
def test_prefix_hits_never_end_inside_a_block(placeholder, cached, want):
    manager = Manager(cached)
    guarded = schedule._hit_guard(manager)
    req = request(placeholder)
    req.num_tokens = 800
    assert guarded(req)[1] == want
    assert "find_longest_cache_hit" not in vars(manager.coordinator)  # the lookup is the class's again


def test_connector_offers_ending_inside_a_block_are_declined():
    offers = {0: (300, True), 1: (355, True), 256: (101, True), 400: (90, True)}
    guarded = schedule._connector_guard(lambda req, computed: offers[computed])
    req = request((240, 117))  # block 243..356
    assert guarded(req, 0) == (0, False)  # resuming at 300 would start inside: the tokens are computed
    assert guarded(req, 1) == (0, False)  # at 356 (END still to compute): inside
    assert guarded(req, 256) == (101, True)  # at 357, past END
    assert guarded(req, 400) == (90, True)


def test_budget_must_hold_the_largest_block():
    hf = SimpleNamespace(to_dict=lambda: raw)
    from tests.conftest import load_make_checkpoint

    raw = load_make_checkpoint().make_config("tiny-vision", quantized=False)
    config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf),
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=383))
    with pytest.raises(ConfigError, match="max_num_batched_tokens=383 is below vision_max_n_token=384"):
        schedule.check_budget(config)
    config.scheduler_config.max_num_batched_tokens = 384
    schedule.check_budget(config)


def test_vision_configs_name_the_multimodal_class(monkeypatch):
    from vllm.config import model as model_config

    from vllm_dsv4 import patches

    def config(model_type, layers, arch):
        return SimpleNamespace(model_type=model_type, vision_n_layers=layers, architectures=[arch])

    loaded = {}
    monkeypatch.setattr(model_config, "get_config", lambda name, **kw: loaded[name])
    patches.patch_vision_architecture()
    patches.patch_vision_architecture()  # once only
    loaded.update(vision=config("deepseek_v4", 2, "DeepseekV4ForCausalLM"),
                  text=config("deepseek_v4", 0, "DeepseekV4ForCausalLM"),
                  draft=config("deepseek_v4", 2, "DeepSeekV4MTPModel"),
                  other=config("llama", 2, "DeepseekV4ForCausalLM"))
    assert model_config.get_config("vision").architectures == ["DeepseekV4ForConditionalGeneration"]
    for name in ("text", "draft", "other"):
        assert model_config.get_config(name).architectures == loaded[name].architectures
    assert model_config.get_config.__wrapped__.__name__ == "<lambda>"
