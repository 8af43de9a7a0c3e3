"""What every cache group's builder shares within a step (kv/metadata.py): the token -> request
map, the step's plans and its other fields."""

import copy
from types import SimpleNamespace

import torch

from vllm_dsv4.config import LayerKind
from vllm_dsv4.kv.metadata import CacheMetadataBuilder, TokenRequests


def brute_force(query_lens: list[int], num_tokens: int) -> list[int]:
    owners = [r for r, n in enumerate(query_lens) for _ in range(n)]
    return owners + [-1] * (num_tokens - len(owners))


def layout(query_lens: list[int]) -> list[int]:
    return [0, *torch.tensor(query_lens, dtype=torch.int64).cumsum(0).tolist()]


def test_each_token_maps_to_its_request_and_padding_to_minus_one():
    g = torch.Generator().manual_seed(0)
    tokens = TokenRequests(64, "cpu")
    for _ in range(50):
        query_lens = torch.randint(0, 6, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        num_tokens = sum(query_lens) + int(torch.randint(0, 4, (1,), generator=g))  # padded steps too
        assert tokens.of(layout(query_lens), num_tokens).tolist() == brute_force(query_lens, num_tokens)


def test_an_unchanged_layout_is_not_rewritten_and_a_changed_one_is():
    tokens = TokenRequests(16, "cpu")
    decode = layout([1, 1, 1])
    tokens.of(decode, 4)
    tokens.buffer[:4] = 7  # a write would restore the map
    assert tokens.of(decode, 4).tolist() == [7] * 4
    assert tokens.of(layout([2, 1]), 4).tolist() == [0, 0, 1, -1]
    assert tokens.of(decode, 4).tolist() == [0, 1, 2, -1]
    assert tokens.of(decode, 3).tolist() == [0, 1, 2]


def test_builders_of_one_device_share_one_buffer():
    a, b = TokenRequests.shared(32, "cpu"), TokenRequests.shared(32, torch.device("cpu"))
    assert a is b and TokenRequests.shared(64, "cpu") is not a


def _builder():
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=64), speculative_config=None)
    return CacheMetadataBuilder(None, [], config, "cpu")


def _step(query_lens: list[int]):
    """A step's CommonAttentionMetadata as vLLM's runner makes it (one per step, a new slice of its
    query_start_loc buffer); each group's builder gets a shallow copy with the group's block table."""
    starts = torch.tensor(layout(query_lens), dtype=torch.int32)
    return SimpleNamespace(num_reqs=len(query_lens), num_actual_tokens=sum(query_lens), query_start_loc_cpu=starts[:],
                           max_query_len=max(query_lens), seq_lens_cpu_upper_bound=None, max_seq_len=100,
                           block_table_tensor=torch.zeros(len(query_lens), 4, dtype=torch.int32))


def test_cache_groups_of_one_step_share_its_plans_and_a_new_step_or_a_draft_gets_its_own():
    """One plan per step and layer kind, whatever the number of cache groups: the groups' builders
    (vLLM splits the layers' caches into many groups) hand out one plan per step; the next step,
    and a draft step (vLLM's proposer reuses its metadata object across draft steps), start empty."""
    groups = [_builder() for _ in range(3)]
    step = _step([1, 1, 1])
    first = [b.build(0, copy.copy(step)) for b in groups]
    first[0].plan.closed_windows.once(LayerKind.C4, lambda: "made by group 0")
    assert all(md.plan is first[0].plan for md in first)
    assert first[2].plan.closed_windows.once(LayerKind.C4, lambda: "made again") == "made by group 0"
    draft = groups[1].build(0, copy.copy(step), fast_build=True)
    assert draft.plan is not first[0].plan and not draft.plan.closed_windows
    step = _step([1, 1, 1])
    nxt = [b.build(0, copy.copy(step)) for b in groups]
    assert nxt[0].plan is not first[0].plan and not nxt[0].plan.closed_windows
    assert all(md.plan is nxt[0].plan for md in nxt)


def test_cache_groups_of_one_step_share_its_fields_and_a_new_step_has_its_own():
    """The step's token map, query starts and bounds are worked out by its first group and handed to
    the others as they are; the next step's (another layout) are its own, as are a draft step's."""
    groups = [_builder() for _ in range(3)]
    step = _step([1, 2, 1])
    first = [b.build(0, copy.copy(step)) for b in groups]
    assert all(md.query_starts is first[0].query_starts for md in first)
    assert first[0].query_starts == [0, 1, 3, 4] and first[0].token_to_req.tolist() == [0, 1, 1, 2]
    assert not first[0].decode_only
    step = _step([1, 1])
    nxt = [b.build(0, copy.copy(step)) for b in groups]
    assert nxt[0].query_starts is not first[0].query_starts and nxt[2].query_starts == [0, 1, 2]
    assert nxt[2].token_to_req.tolist() == [0, 1] and nxt[2].decode_only
    draft = groups[1].build(0, copy.copy(_step([1, 1, 1])), fast_build=True)
    assert draft.query_starts == [0, 1, 2, 3] and draft.token_to_req.tolist() == [0, 1, 2]
