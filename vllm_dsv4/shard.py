"""Where this process sits in tensor, data and expert parallelism, and how that splits the model's
dimensions and experts (model/parallel.py applies it to the model; the loader cuts weights by it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_dsv4.config import ConfigError


@dataclass(frozen=True)
class Shard:
    """This process's place: TP ``rank`` of ``size``, DP ``dp_rank`` of ``dp_size``.

    Routed experts are split over the ``ep_size = dp_size * size`` ranks of vLLM's EP group, this
    one being ``ep_rank``; everything else TP-sharded is split over the ``size`` TP ranks only.
    """

    rank: int = 0
    size: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def ep_rank(self) -> int:
        return self.dp_rank * self.size + self.rank

    @property
    def ep_size(self) -> int:
        return self.dp_size * self.size

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

    def experts_per_rank(self, num_experts: int) -> int:
        if num_experts % self.ep_size:
            raise ConfigError(f"n_routed_experts={num_experts} is not divisible by data_parallel_size x "
                              f"tensor_parallel_size = {self.dp_size} x {self.size} (routed experts are "
                              f"split, whole, over all of them)")
        return num_experts // self.ep_size

    def first_expert(self, num_experts: int) -> int:
        return self.ep_rank * self.experts_per_rank(num_experts)

    def local_expert(self, expert: int, num_experts: int) -> int | None:
        """Index of ``expert`` among this rank's experts, None if another rank owns it."""
        per_rank = self.experts_per_rank(num_experts)
        return expert - self.ep_rank * per_rank if expert // per_rank == self.ep_rank else None
