"""Data-parallel attention + expert-parallel MoE (model/parallel.py), simulated in one process.

Each simulated (DP, TP) rank is a thread running the real code (``across_dp`` over its routed
experts, or the whole ``MoE.forward``) on its own DP rank's tokens; the DP group's collectives are
explicit tensor ops on the ranks' tensors (``torch.cat`` for the all-gather, a sum in rank order
for the reduce-scatter), and the block's TP all-reduce is the test's own sum. Every rank's weights
come through the loader with its ``Shard``, so the loader's expert placement is the MoE's. Each DP
rank's result must equal the single-rank MoE's rows for its tokens, run on all ranks' tokens at
once: bit for bit for the routed experts' exchange, to float32 rounding for the whole MoE.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.loader.test_load import empty_params, stream
from vllm_dsv4.config import ConfigError, Dsv4Config
from vllm_dsv4.loader.checkpoint import Checkpoint
from vllm_dsv4.loader.load import load_official_weights
from vllm_dsv4.loader.names import sharded_dim
from vllm_dsv4.model.moe import MoE
from vllm_dsv4.model.parallel import DpGroup, across_dp
from vllm_dsv4.shard import Shard

HASHED, SCORED = 0, 2  # layer 0 routes by token hash, layer 2 by score (num_hash_layers = 2)


class Rendezvous:
    """The DP group's wire: every rank puts its tensor, all get every rank's, in rank order."""

    def __init__(self, size: int):
        self.barrier, self.slots = threading.Barrier(size, timeout=60), [None] * size

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor
        self.barrier.wait()
        every = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before all have read it
        return every


class TensorOpsDpGroup(DpGroup):
    """``DpGroup`` with the collectives as tensor ops; ``sizes`` plays vLLM's dp_metadata (None:
    no forward context, so ``DpGroup.num_tokens`` exchanges the counts itself)."""

    def __init__(self, wire: Rendezvous, dp_rank: int, sizes: list[int] | None):
        self.wire, self.dp_rank, self.sizes, self.calls = wire, dp_rank, sizes, []

    def num_tokens(self, x):
        return list(self.sizes) if self.sizes is not None else super().num_tokens(x)

    def all_gather(self, tensor):
        self.calls.append("all_gather")
        return torch.cat(self.wire.exchange(self.dp_rank, tensor))

    def reduce_scatter(self, tensor):
        self.calls.append("reduce_scatter")
        every = self.wire.exchange(self.dp_rank, tensor)
        total = every[0].clone()
        for t in every[1:]:
            total += t
        return total.chunk(len(every))[self.dp_rank]


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt_unquantized):
    return Dsv4Config.from_pretrained(tiny_ckpt_unquantized), Checkpoint(tiny_ckpt_unquantized)


def shard_params(full: dict[str, torch.nn.Parameter], shard: Shard, cfg: Dsv4Config) -> dict[str, torch.nn.Parameter]:
    """Empty parameters shaped as ``shard``'s slice of the whole-model ``full`` ones."""
    local = {}
    for name, p in full.items():
        shape = list(p.shape)
        if name.endswith((".experts.w13", ".experts.w2")):
            shape[0] = shard.experts_per_rank(cfg.n_routed_experts)
        elif (dim := sharded_dim(name)) is not None:
            shape[dim] //= shard.size
        local[name] = torch.nn.Parameter(torch.full(shape, float("nan"), dtype=p.dtype), requires_grad=False)
    return local


def loaded_moe(cfg: Dsv4Config, ckpt: Checkpoint, layer: int, shard: Shard, dp_group: DpGroup | None = None) -> MoE:
    """Layer ``layer``'s MoE for ``shard``, every parameter filled by the loader."""
    moe = MoE(cfg, layer < cfg.num_hash_layers, shard, dp_group)
    params = shard_params(empty_params(cfg, ckpt), shard, cfg)
    params.update({f"layers.{layer}.ffn.{name}": p for name, p in moe.named_parameters()})
    assert load_official_weights(cfg, stream(ckpt), params, shard) == set(params)
    return moe


def run_ranks(dp: int, tp: int, sizes: list[int], rank_fn, metadata: bool = True):
    """Runs ``rank_fn(shard, dp_group, rows)`` for every (DP, TP) rank in its own thread, ``rows``
    being the slice of all tokens that DP rank serves. Returns per DP rank the TP sum of its ranks'
    outputs (the block's TP all-reduce, in rank order) and every rank's DP group."""
    starts = [sum(sizes[:r]) for r in range(dp)]
    wires = [Rendezvous(dp) for _ in range(tp)]  # one DP group per TP rank (vLLM's layout)
    outs, groups, errors = {}, {}, []

    def rank(dp_rank: int, tp_rank: int) -> None:
        try:
            groups[dp_rank, tp_rank] = group = TensorOpsDpGroup(wires[tp_rank], dp_rank, sizes if metadata else None)
            rows = slice(starts[dp_rank], starts[dp_rank] + sizes[dp_rank])
            with torch.no_grad():
                outs[dp_rank, tp_rank] = rank_fn(Shard(tp_rank, tp, dp_rank, dp), group, rows)
        except BaseException as e:  # noqa: BLE001 -- re-raised below, after every thread ended
            errors.append(e)
            for wire in wires:
                wire.barrier.abort()

    threads = [threading.Thread(target=rank, args=(d, t)) for d in range(dp) for t in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    combined = []
    for d in range(dp):
        total = outs[d, 0].clone()
        for t in range(1, tp):
            total += outs[d, t]
        combined.append(total)
    return combined, groups


def tokens(cfg: Dsv4Config, n: int, seed: int):
    """x [n, D], input ids [n], routing weights [n, k] and expert ids [n, k]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg.hidden_size, generator=g)
    input_ids = torch.randint(0, cfg.vocab_size, (n,), generator=g)
    weights = torch.rand(n, cfg.num_experts_per_tok, generator=g)
    ids = torch.randint(0, cfg.n_routed_experts, (n, cfg.num_experts_per_tok), generator=g)
    return x, input_ids, weights, ids


def test_placement_follows_vllm_ep_ranks():
    """EP rank = dp_rank * tp_size + tp_rank; expert e on EP rank e // (E / ep_size)."""
    shard = Shard(rank=1, size=2, dp_rank=1, dp_size=2)
    assert (shard.ep_rank, shard.ep_size, shard.experts_per_rank(8), shard.first_expert(8)) == (3, 4, 2, 6)
    assert [shard.local_expert(e, 8) for e in range(8)] == [None] * 6 + [0, 1]
    owners = [[r for r in range(4) if Shard(r % 2, 2, r // 2, 2).local_expert(e, 8) is not None] for e in range(8)]
    assert owners == [[e // 2] for e in range(8)]
    assert Shard(0, 1, 1, 2).part(4, "num_attention_heads") == 4  # DP alone leaves attention whole
    with pytest.raises(ConfigError, match=r"n_routed_experts=8 .* data_parallel_size x tensor_parallel_size = 3 x 1"):
        Shard(0, 1, 0, 3).experts_per_rank(8)


def test_loader_gives_a_dp_rank_its_experts_and_whole_attention(ckpt):
    """DP rank 1 of 2 (TP 1): experts 4..7, everything else whole."""
    cfg, checkpoint = ckpt
    full = empty_params(cfg, checkpoint)
    load_official_weights(cfg, stream(checkpoint), full)
    shard = Shard(0, 1, 1, 2)
    local = shard_params(full, shard, cfg)
    assert load_official_weights(cfg, stream(checkpoint), local, shard) == set(local)
    assert torch.equal(local["layers.2.ffn.experts.w13"], full["layers.2.ffn.experts.w13"][4:])
    assert torch.equal(local["layers.2.ffn.experts.w2"], full["layers.2.ffn.experts.w2"][4:])
    for name in ("layers.1.attn.wq_b.weight", "layers.1.attn.wo_b.weight", "layers.2.ffn.shared_experts.w13.weight"):
        assert torch.equal(local[name], full[name]), name


RANKS = [(2, 1, [7, 3]), (2, 1, [0, 5]), (4, 1, [5, 1, 0, 9]), (2, 2, [6, 11]), (1, 2, [8])]
RANK_IDS = ["dp2", "dp2-idle-rank", "dp4", "dp2xtp2", "tp2"]


@pytest.mark.parametrize("dp, tp, sizes", RANKS, ids=RANK_IDS)
def test_dispatch_and_combine_are_exact(ckpt, dp, tp, sizes):
    """The routed experts of all ranks, fed every DP rank's tokens through ``across_dp``, give
    each DP rank exactly the single-rank experts' rows: every expert sees the same rows in the
    same order (padding picks no expert), and with k = 2 picks a token's sum over ranks adds the
    same two contributions. An idle rank (0 tokens) still joins every collective."""
    cfg, checkpoint = ckpt
    assert cfg.num_experts_per_tok == 2
    x, _, weights, ids = tokens(cfg, sum(sizes), seed=0)
    reference = loaded_moe(cfg, checkpoint, SCORED, Shard()).experts(x, weights, ids)

    def rank(shard, group, rows):
        experts = loaded_moe(cfg, checkpoint, SCORED, shard, group).experts
        if dp == 1:
            return experts(x[rows], weights[rows], ids[rows])
        return across_dp(experts, shard, group, x[rows], weights[rows], ids[rows])

    combined, groups = run_ranks(dp, tp, sizes, rank)
    start = 0
    for d, n in enumerate(sizes):
        assert combined[d].shape == (n, cfg.hidden_size)
        assert torch.equal(combined[d], reference[start : start + n]), f"DP rank {d}"
        start += n
    for group in groups.values():
        assert group.calls == ([] if dp == 1 else ["all_gather"] * 3 + ["reduce_scatter"])


@pytest.mark.parametrize("layer", [HASHED, SCORED], ids=["hash", "score"])
@pytest.mark.parametrize("dp, tp, sizes", RANKS, ids=RANK_IDS)
def test_moe_over_dp_ranks_equals_the_single_rank_moe(ckpt, layer, dp, tp, sizes, cpu_ops):
    """The whole ``MoE.forward`` on every rank (routing on the rank's own tokens, the exchange, the
    shared expert on the rank's tokens, the TP sum) against one MoE on all tokens. Not bit-exact:
    CPU BLAS may round a row of the router / shared expert differently inside a batch of another
    size, and the TP-split shared expert reassociates its sum (seen: 1e-6)."""
    cfg, checkpoint = ckpt
    x, input_ids, _, _ = tokens(cfg, sum(sizes), seed=1)
    reference = loaded_moe(cfg, checkpoint, layer, Shard())(x, input_ids)

    def rank(shard, group, rows):
        return loaded_moe(cfg, checkpoint, layer, shard, group)(x[rows], input_ids[rows])

    combined, groups = run_ranks(dp, tp, sizes, rank)
    torch.testing.assert_close(torch.cat(combined), reference, rtol=1e-5, atol=1e-5)
    for group in groups.values():
        assert group.calls == ([] if dp == 1 else ["all_gather"] * 3 + ["reduce_scatter"])


def test_without_dp_metadata_the_ranks_exchange_their_counts(ckpt):
    """No forward context (no vLLM dp_metadata): ``DpGroup.num_tokens`` all-gathers the counts."""
    cfg, checkpoint = ckpt
    sizes = [4, 9]
    x, _, weights, ids = tokens(cfg, sum(sizes), seed=2)
    reference = loaded_moe(cfg, checkpoint, SCORED, Shard()).experts(x, weights, ids)
    combined, groups = run_ranks(2, 1, sizes, lambda shard, group, rows: across_dp(
        loaded_moe(cfg, checkpoint, SCORED, shard, group).experts, shard, group, x[rows], weights[rows], ids[rows]),
        metadata=False)
    assert torch.equal(torch.cat(combined), reference)
    for group in groups.values():
        assert group.calls == ["all_gather"] * 4 + ["reduce_scatter"]


def test_dp_metadata_disagreeing_with_the_batch_is_an_error(ckpt):
    cfg, _ = ckpt
    group = TensorOpsDpGroup(Rendezvous(1), 0, [5, 3])
    x = torch.zeros(4, cfg.hidden_size)
    with pytest.raises(RuntimeError, match=r"DP rank 0 runs 4 tokens, but vLLM's dp_metadata says \[5, 3\]"):
        across_dp(None, Shard(0, 1, 0, 2), group, x, torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.long))
    assert group.calls == []
