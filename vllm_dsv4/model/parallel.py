"""Tensor parallelism as a transform of the one model definition (gpt-fast's ``apply_tp`` idea).

Sharded across TP ranks: query heads (``wq_b`` rows, ``attn_sink``), output groups (``wo_a`` rows,
``wo_b`` columns), the shared expert's intermediate dim, and routed experts (whole experts per
rank). Replicated: the single K=V latent head and everything that writes the KV caches (``wkv``,
compressor, indexer), norms, mHC, router, embedding and head. Each block's attention and MoE
outputs are partial sums, all-reduced once per sub-layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_dsv4.config import ConfigError


@dataclass(frozen=True)
class Shard:
    """This process's slice: ``rank`` of ``size`` tensor-parallel ranks."""

    rank: int = 0
    size: int = 1

    def part(self, total: int, what: str) -> int:
        if total % self.size:
            raise ConfigError(f"{what}={total} is not divisible by tensor_parallel_size={self.size}")
        return total // self.size

    def check_blocks(self, total: int, block: int, what: str) -> None:
        """A weight held in FP8 is cut between its ``block``-wide scale blocks, or not at all."""
        n = self.part(total, what)
        if self.size > 1 and n % block:
            fix = (f"use a tensor_parallel_size that divides {total // block}" if total % block == 0
                   else f"{total} is not whole blocks, so only tensor_parallel_size=1 keeps it")
            raise ConfigError(f"{what}: {total} split over tensor_parallel_size={self.size} leaves {n} per rank, "
                              f"which cuts its {block}x{block} FP8 scale blocks; {fix}")

    def slice(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        n = self.part(tensor.shape[dim], f"dim {dim} of a {tuple(tensor.shape)} tensor")
        return tensor.narrow(dim, self.rank * n, n)

    def local_expert(self, expert: int, num_experts: int) -> int | None:
        """Index of ``expert`` among this rank's experts, None if another rank owns it."""
        per_rank = self.part(num_experts, "n_routed_experts")
        return expert - self.rank * per_rank if expert // per_rank == self.rank else None


def current_shard() -> Shard:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return Shard(get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())


def all_reduce(partial: torch.Tensor, shard: Shard) -> torch.Tensor:
    if shard.size == 1:
        return partial
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(partial)
