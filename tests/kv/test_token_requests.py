"""The step metadata's token -> request map (attention/backend.py), shared by every cache group's builder."""

import torch

from vllm_dsv4.attention.backend import TokenRequests


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
