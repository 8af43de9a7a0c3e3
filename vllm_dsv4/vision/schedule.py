"""Image blocks are computed whole, in one step (docs/VISION.md §8): a token of a block attends its whole block,
so no step may start or end inside one.

vLLM schedules steps and prefix-cache hits without knowing this (its ``disable_chunked_mm_input`` keeps
a step from cutting an image only when the step starts before the image's placeholder). ``install`` puts
three guards on the scheduler of a DeepSeek-V4 Vision model, each moving a boundary back to the block's
START where it would fall inside: the tokens scheduled per step (chunked prefill), the prefix-cache hit,
and tokens a KV connector offers. A block larger than a step's token budget could never be scheduled:
``check_budget`` refuses such a configuration at start-up.
"""

from __future__ import annotations

import functools

from vllm_dsv4.config import ConfigError, Dsv4Config
from vllm_dsv4.vision.layout import alignment_pad


def image_blocks(request) -> list[tuple[int, int]]:
    """(START, END) token indices of each image block of a vLLM request, from its placeholder ranges
    (each covers the alignment pad, then the block)."""
    blocks = []
    for feature in request.mm_features or ():
        if feature.modality == "image":
            offset, length = feature.mm_position.offset, feature.mm_position.length
            blocks.append((offset + alignment_pad(offset), offset + length - 1))
    return blocks


def inside(blocks: list[tuple[int, int]], boundary: int) -> tuple[int, int] | None:
    """The block that a step boundary at token ``boundary`` (its first token to compute) cuts, if any."""
    return next(((first, last) for first, last in blocks if first < boundary <= last), None)


def tokens_keeping_blocks_whole(blocks: list[tuple[int, int]], computed: int, new: int) -> int:
    """Of ``new`` tokens from ``computed`` on, those to schedule so the step does not end inside a block."""
    cut = inside(blocks, computed + new)
    return new if cut is None or cut[0] < computed else cut[0] - computed


def check_budget(vllm_config) -> None:
    """A step must be able to hold the largest image block (``vision_max_n_token`` tokens)."""
    vision = Dsv4Config.from_hf_config(vllm_config.model_config.hf_config).vision
    budget = vllm_config.scheduler_config.max_num_batched_tokens
    if vision is not None and budget < vision.max_n_token:
        raise ConfigError(f"max_num_batched_tokens={budget} is below vision_max_n_token={vision.max_n_token}: an "
                          f"image block is computed in one step; raise max_num_batched_tokens")


def _schedule_guard(schedule_encoder_inputs):
    @functools.wraps(schedule_encoder_inputs)
    def guarded(request, num_computed_tokens, num_new_tokens, *args, **kwargs):
        num_new_tokens = tokens_keeping_blocks_whole(image_blocks(request), num_computed_tokens, num_new_tokens)
        return schedule_encoder_inputs(request, num_computed_tokens, num_new_tokens, *args, **kwargs)

    return guarded


def _hit_guard(kv_cache_manager):
    """``get_computed_blocks`` whose hit never ends inside a block: the lookup is redone capped at the
    block's START (whole cache blocks: the hit may end earlier)."""
    get_computed_blocks = kv_cache_manager.get_computed_blocks
    coordinator = kv_cache_manager.coordinator

    @functools.wraps(get_computed_blocks)
    def guarded(request):
        blocks = image_blocks(request)
        if not blocks:
            return get_computed_blocks(request)
        find = coordinator.find_longest_cache_hit

        def find_outside_blocks(block_hashes, max_length):
            while True:
                hit = find(block_hashes, max_length)
                cut = inside(blocks, hit[1])
                if cut is None:
                    return hit
                max_length = cut[0]

        coordinator.find_longest_cache_hit = find_outside_blocks
        try:
            return get_computed_blocks(request)
        finally:
            del coordinator.find_longest_cache_hit

    return guarded


def _connector_guard(get_num_new_matched_tokens):
    """A connector's offer that would resume inside a block is declined (the tokens are computed instead)."""
    @functools.wraps(get_num_new_matched_tokens)
    def guarded(request, num_computed_tokens, *args, **kwargs):
        external, load_async = get_num_new_matched_tokens(request, num_computed_tokens, *args, **kwargs)
        if external and inside(image_blocks(request), num_computed_tokens + external):
            return 0, False
        return external, load_async

    return guarded


def install(scheduler) -> None:
    """Put the guards on ``scheduler`` (its own methods; other models' schedulers are left alone)."""
    scheduler._try_schedule_encoder_inputs = _schedule_guard(scheduler._try_schedule_encoder_inputs)
    scheduler.kv_cache_manager.get_computed_blocks = _hit_guard(scheduler.kv_cache_manager)
    if scheduler.connector is not None:
        connector = scheduler.connector
        connector.get_num_new_matched_tokens = _connector_guard(connector.get_num_new_matched_tokens)
