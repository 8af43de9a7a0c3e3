"""How the indexer batches decodes: groups of requests whose padded key gather stays within budget."""

import torch

from vllm_dsv4.model.indexer import groups_by_length


def test_groups_cover_every_request_once_longest_first_within_budget():
    lengths = torch.tensor([5, 900, 0, 30, 30, 1000, 7, 2])
    groups = groups_by_length(lengths, budget=1000)
    flat = torch.cat(groups).tolist()
    assert sorted(flat) == list(range(len(lengths)))
    assert [lengths[i].item() for i in flat] == sorted(lengths.tolist(), reverse=True)
    for g in groups:
        assert len(g) == 1 or len(g) * lengths[g].max().item() <= 1000
    assert [len(g) for g in groups] == [1, 1, 6]  # 1000 alone, 900 alone, the rest (30 x 6 <= 1000) together
