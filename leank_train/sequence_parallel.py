"""Sequence parallelism for long contexts: the Ulysses attention exchange, and the strategy that carries it.

Why: at 32k-128k tokens the teacher prefill and the context K/V of one sample outgrow one device.
With a sequence-parallel group of ``W`` ranks, the prompt of one sample is cut into ``W`` contiguous
shards (padded at the end: attention is causal, so tokens after the answer change nothing before
them). Every layer computes q/k/v for its own shard (RoPE at global positions), then

- teacher (prefill, no grad): all-to-all from sequence-sharded ``[B, H, T/W, D]`` to head-sharded
  ``[B, H/W, T, D]``, causal attention over the whole sequence for ``H/W`` heads, all-to-all back.
  The head-sharded context K/V are kept: each rank stores ``1/W`` of the context cache;
- student (the answer tokens, with grad): the few answer tokens are replicated on every rank;
  each rank runs LeanK attention for its KV heads against its head shard of the context K/V, and the
  heads are all-gathered. ``copy_to_group`` (identity forward, all-reduce backward) at the entry
  and ``gather_heads`` (all-gather forward, own slice backward) at the exit make every rank's
  gradients full and identical, so DDP's gradient average over an SP group changes nothing, and
  the average over data-parallel groups is the usual batch mean.

Everything else is Lightning's: :class:`SequenceParallelStrategy` is its ``DDPStrategy`` plus a
``(data_parallel, sequence_parallel)`` device mesh; the sampler injected by Lightning splits the
data over the data-parallel dimension only, so all ranks of an SP group see the same sample.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy


def group_size(group: Any) -> int:
    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    return dist.get_rank(group)


def check_divisible(heads: int, world: int, what: str) -> None:
    """Head sharding needs whole heads per rank (GQA groups stay together when KV heads divide)."""
    if heads % world:
        raise ValueError(f"sequence parallelism over {world} ranks needs {what} divisible by {world}, got {heads}")


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[B, H, T/W, D]`` (my sequence shard, all heads) -> ``[B, H/W, T, D]`` (my heads, whole sequence)."""
    world = group_size(group)
    b, h, t, d = x.shape
    check_divisible(h, world, "the heads")
    send = x.reshape(b, world, h // world, t, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i] = rank i's sequence shard of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * t, d)


def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[B, H/W, T, D]`` (my heads, whole sequence) -> ``[B, H, T/W, D]`` (my sequence shard, all heads)."""
    world = group_size(group)
    b, h, t, d = x.shape
    if t % world:
        raise ValueError(f"sequence length {t} is not a multiple of the group size {world}")
    send = x.reshape(b, h, world, t // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i] = my sequence shard of rank i's heads
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * h, t // world, d)


def all_gather_cat(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """All-gather equal-shaped shards and concatenate them along ``dim`` in rank order (no autograd)."""
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _CopyToGroup(torch.autograd.Function):
    """Forward: identity on a tensor every rank holds alike. Backward: sum the ranks' partial gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherHeads(torch.autograd.Function):
    """Forward: all-gather head shards along ``dim``. Backward: each rank keeps its own slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.size = group, dim, x.shape[dim]
        return all_gather_cat(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start = group_rank(ctx.group) * ctx.size
        return grad.narrow(ctx.dim, start, ctx.size).contiguous(), None, None


def copy_to_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Mark a replicated tensor as entering the head-sharded region (gradients summed over the group)."""
    return _CopyToGroup.apply(x, group)


def gather_heads(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """All-gather head shards (differentiable: the backward returns each rank's own slice)."""
    return _GatherHeads.apply(x, group, dim)


def head_slice(heads: int, group: Any) -> slice:
    """The contiguous block of ``heads`` this rank owns (query heads of a GQA group stay together)."""
    world = group_size(group)
    check_divisible(heads, world, "the heads")
    per = heads // world
    rank = group_rank(group)
    return slice(rank * per, (rank + 1) * per)


def sequence_shard(length: int, group: Any) -> tuple[int, int, int]:
    """``(start, end, padded_length)`` of this rank's contiguous shard of a sequence padded to a multiple of W."""
    world = group_size(group)
    per = -(-length // world)
    rank = group_rank(group)
    return rank * per, (rank + 1) * per, per * world


class SequenceParallelStrategy(DDPStrategy):
    """Lightning's DDP over a ``(data_parallel, sequence_parallel)`` device mesh.

    ``sequence_parallel_size`` consecutive ranks share one sample (its sequence split across them);
    the world size must be a multiple of it. Everything else (launchers, torchrun, SLURM, multi-node,
    gradient averaging) is ``DDPStrategy``'s.
    """

    strategy_name = "leank_sequence_parallel"

    def __init__(self, sequence_parallel_size: int = 2, **kwargs: Any) -> None:
        """
        Args:
            sequence_parallel_size: ranks that split one sample's sequence (attention heads must divide by it).
            kwargs: anything ``DDPStrategy`` takes (``process_group_backend``, ``timeout``, ...).
        """
        super().__init__(**kwargs)
        if sequence_parallel_size < 1:
            raise ValueError(f"sequence_parallel_size must be >= 1, got {sequence_parallel_size}")
        self.sequence_parallel_size = sequence_parallel_size
        self.device_mesh: Any = None

    def setup_distributed(self) -> None:
        super().setup_distributed()
        from torch.distributed.device_mesh import init_device_mesh

        world, sp = self.world_size, self.sequence_parallel_size
        if world % sp:
            raise ValueError(f"world size {world} is not a multiple of sequence_parallel_size {sp}")
        self.device_mesh = init_device_mesh(
            self.root_device.type, (world // sp, sp), mesh_dim_names=("data_parallel", "sequence_parallel")
        )

    @property
    def sequence_parallel_group(self) -> Any:
        """The process group of the ranks sharing this rank's sample (None before setup or when size is 1)."""
        if self.device_mesh is None or self.sequence_parallel_size == 1:
            return None
        return self.device_mesh["sequence_parallel"].get_group()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Lightning's injected DistributedSampler splits the data over the data-parallel dimension only.
        sp = self.sequence_parallel_size
        return {"num_replicas": self.world_size // sp, "rank": self.global_rank // sp}
