"""Slot lists -> global cache indices: the reference against a loop (any machine), the Triton kernel
against the reference (exact: integer results), over padding rows, empty slots, lists shorter and
longer than the alignment and a strided slot tensor."""

from __future__ import annotations

import pytest
import torch

from csrc_triton.cache_index_ref import global_slots as global_slots_ref
from tests.csrc_triton.kernel_cases import DEVICE, SKIP_REASON, cache_index_args

ALIGN = 128


@pytest.mark.parametrize("T, K", [(7, 9), (5, 128), (6, 300)])
def test_reference_matches_a_loop(T, K):
    block_table, E, req, entries = cache_index_args(T, K)
    index, length = global_slots_ref(block_table, E, req, entries, ALIGN)
    width = max(ALIGN, -(-K // ALIGN) * ALIGN)
    assert index.shape == (T, width) and index.dtype == length.dtype == torch.int32
    for t in range(T):
        want = [-1] * width
        for k in range(K):
            e = int(entries[t, k])
            if e >= 0 and req[t] >= 0:
                want[k] = int(block_table[req[t], e // E]) * E + e % E
        assert index[t].tolist() == want
        valid = [k + 1 for k in range(K) if want[k] >= 0]
        assert int(length[t]) == (max(valid) if valid else 0)


@pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
@pytest.mark.parametrize("T, K", [(0, 9), (1, 1), (7, 9), (5, 128), (6, 300), (64, 640)])
def test_global_slots_kernel_matches_ref(T, K):
    from csrc_triton.cache_index import global_slots

    block_table, E, req, entries = cache_index_args(T, K, device=DEVICE)
    for got, want in zip(global_slots(block_table, E, req, entries, ALIGN),
                         global_slots_ref(block_table, E, req, entries, ALIGN)):
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want.cpu())


@pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
def test_global_slots_kernel_reads_strided_slots():
    """The model passes slices of wider slot tensors (query chunks, the window's columns)."""
    from csrc_triton.cache_index import global_slots

    block_table, E, req, entries = cache_index_args(6, 2 * 150, device=DEVICE)
    strided = entries[:, ::2]
    for got, want in zip(global_slots(block_table, E, req, strided, ALIGN),
                         global_slots_ref(block_table, E, req, strided.contiguous(), ALIGN)):
        assert torch.equal(got.cpu(), want.cpu())
