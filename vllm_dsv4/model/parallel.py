"""Tensor, data and expert parallelism as a transform of the one model definition (gpt-fast's
``apply_tp`` idea), in vLLM's layout.

Tensor parallelism (TP) shards the attention's query heads (``wq_b`` rows, ``attn_sink``) and
output groups (``wo_a`` rows, ``wo_b`` columns) and the shared expert's intermediate dim.
Replicated: the single K=V latent head and everything that writes the KV caches (``wkv``,
compressor, indexer), norms, mHC, router, embedding and head. Each block's attention and MoE
outputs are partial sums, all-reduced over the TP group once per sub-layer.

Data parallelism (DP, vLLM's ``data_parallel_size``) runs one engine per DP rank with its own
requests, scheduler and KV cache; attention never leaves its DP rank. The routed experts are
split over all DP x TP ranks (vLLM's EP group: rank ``dp_rank * tp_size + tp_rank``), whole
experts per rank, and the tokens of all DP ranks meet in the MoE: vLLM's naive dispatch/combine,
all-gather over the DP group (each rank padded to the step's largest DP rank) and reduce-scatter
back. vLLM does this with and without ``enable_expert_parallel`` (FusedMoE flattens its TP across
DP, ``FusedMoEParallelConfig.make``); the flag only picks whole experts (EP) or slices of every
expert (no EP) per rank. Our routed experts are always whole per rank (already so under TP), so
both settings place them the same way.
"""

from __future__ import annotations

import torch

from vllm_dsv4.shard import Shard


def current_shard() -> Shard:
    from vllm.distributed import get_dp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    dp = get_dp_group()
    return Shard(get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(), dp.rank_in_group,
                 dp.world_size)


def all_reduce(partial: torch.Tensor, shard: Shard) -> torch.Tensor:
    if shard.size == 1:
        return partial
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(partial)


class DpGroup:
    """The three DP-group operations the MoE needs (vLLM's groups; tests substitute tensor ops)."""

    def num_tokens(self, x: torch.Tensor) -> list[int]:
        """Rows of each DP rank in this step, from vLLM's ``dp_metadata`` (set for every forward
        under DP, dummy runs included); without it, exchanged here."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        meta = get_forward_context().dp_metadata if is_forward_context_available() else None
        if meta is not None:
            return [int(n) for n in meta.num_tokens_across_dp_cpu.tolist()]
        return [int(n) for n in self.all_gather(torch.tensor([x.shape[0]], device=x.device)).tolist()]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Equal-shaped ``[n, ...]`` of every DP rank -> ``[dp_size * n, ...]`` in DP rank order."""
        from vllm.distributed import get_dp_group

        return get_dp_group().all_gather(tensor, dim=0)

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[dp_size * n, ...]`` summed over DP ranks; this rank's ``[n, ...]`` block."""
        from vllm.distributed import get_dp_group

        return get_dp_group().reduce_scatter(tensor, dim=0)


def across_dp(compute, shard: Shard, group: DpGroup, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """``compute(x, weights, ids)`` (this rank's experts, a partial sum over experts) run on the
    tokens of every DP rank; returns this rank's tokens' sum over the DP group's partials.

    Each rank pads its ``[T, ...]`` rows to the step's largest T (padding picks expert -1, which no
    rank owns, at weight 0), all-gathers them, computes, and reduce-scatters back. Every DP rank
    calls this in every step (vLLM runs a dummy batch on idle ranks), T = 0 included.
    """
    sizes = group.num_tokens(x)
    if sizes[shard.dp_rank] != x.shape[0]:
        raise RuntimeError(f"DP rank {shard.dp_rank} runs {x.shape[0]} tokens, but vLLM's dp_metadata says {sizes}")
    rows = max(sizes)
    if rows == 0:  # every rank empty (all ranks agree, so none enters a collective)
        return x.new_zeros(x.shape)
    pad = rows - x.shape[0]
    x_all = group.all_gather(torch.cat([x, x.new_zeros(pad, *x.shape[1:])]))
    w_all = group.all_gather(torch.cat([weights, weights.new_zeros(pad, *weights.shape[1:])]))
    ids_all = group.all_gather(torch.cat([ids, ids.new_full((pad, *ids.shape[1:]), -1)]))
    return group.reduce_scatter(compute(x_all, w_all, ids_all))[: x.shape[0]]
