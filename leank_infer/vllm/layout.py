"""What one token of a LeanK layer occupies in vLLM's paged KV cache, and how it is packed.

A page slot of a LeanK layer holds one token as a single row of ``width`` elements of the model
dtype: the kept K channels of every KV head (heads in order, channels ascending), then the whole V
of each head that keeps at least one channel. That is exactly what the HF cache stores for a
middle token (``ChannelMask.kv_bytes_per_token()["leank_middle"]``); the page of the layer is
``block_size * width * itemsize`` bytes instead of ``block_size * 2 * kv_heads * head_dim * itemsize``.
Sink and recent tokens need every channel: the backend keeps those few per request beside the
pages (see :mod:`leank_infer.vllm.backend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class PackedLayout:
    """Flat indices into ``[kv_heads * head_dim]`` K and V rows of the channels a layer keeps."""

    k_index: torch.Tensor  # [nk] long: kept (head, channel) pairs of K
    v_index: torch.Tensor  # [nv] long: every channel of the heads keeping any
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_keep(cls, keep: torch.Tensor) -> PackedLayout:
        """Layout of one layer from its ``[kv_heads, head_dim]`` bool keep mask."""
        keep = keep.bool().cpu()
        h, d = keep.shape
        k_index = torch.nonzero(keep.reshape(-1)).flatten()
        v_heads = torch.nonzero(keep.any(-1)).flatten()
        v_index = (v_heads[:, None] * d + torch.arange(d)).flatten()
        return cls(k_index, v_index, h, d)

    @property
    def width(self) -> int:
        """Elements per token in a page; at least 1, as vLLM needs a non-empty page."""
        return max(1, self.k_index.numel() + self.v_index.numel())

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.width * torch.empty((), dtype=dtype).element_size()

    def keep(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The ``[kv_heads, head_dim]`` bool mask of kept K channels (the inverse of :meth:`from_keep`)."""
        keep = torch.zeros(self.num_kv_heads * self.head_dim, dtype=torch.bool, device=device)
        keep[self.k_index.to(device)] = True
        return keep.view(self.num_kv_heads, self.head_dim)

    def to(self, device: torch.device) -> PackedLayout:
        return PackedLayout(
            self.k_index.to(device), self.v_index.to(device), self.num_kv_heads, self.head_dim
        )

    def pack(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``[T, kv_heads, head_dim]`` K and V to ``[T, width]`` page rows."""
        t = key.shape[0]
        parts = [
            key.reshape(t, -1).index_select(1, self.k_index),
            value.reshape(t, -1).index_select(1, self.v_index),
        ]
        out = torch.cat(parts, dim=1)
        if out.shape[1] < self.width:  # a layer that keeps nothing: one padding element
            out = torch.cat([out, out.new_zeros(t, self.width - out.shape[1])], dim=1)
        return out

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, width]`` page rows to dense ``[n, kv_heads, head_dim]`` K and V, zeros where nothing is stored.

        A zero K channel adds nothing to q.k, so dense attention over these K equals the sum over kept
        channels; heads storing no V get their middle scores masked by the caller.
        """
        n = rows.shape[0]
        nk = self.k_index.numel()
        k = rows.new_zeros(n, self.num_kv_heads * self.head_dim)
        v = rows.new_zeros(n, self.num_kv_heads * self.head_dim)
        k.index_copy_(1, self.k_index, rows[:, :nk])
        v.index_copy_(1, self.v_index, rows[:, nk : nk + self.v_index.numel()])
        shape = (n, self.num_kv_heads, self.head_dim)
        return k.view(shape), v.view(shape)

    @cached_property
    def v_heads(self) -> list[int]:
        """KV heads whose V a page row stores, in row order."""
        return (self.v_index[:: self.head_dim] // self.head_dim).tolist()

    @cached_property
    def head_has_middle(self) -> torch.Tensor:
        """``[kv_heads]`` bool: heads that attend to middle keys (those keeping any channel)."""
        heads = torch.zeros(self.num_kv_heads, dtype=torch.bool, device=self.v_index.device)
        heads[self.v_index // self.head_dim] = True
        return heads

    @cached_property
    def _k_head_onehot(self) -> torch.Tensor:
        heads = self.k_index // self.head_dim
        return torch.nn.functional.one_hot(heads, self.num_kv_heads).float()[:, :, None]

    def k_head_onehot(self, dtype: torch.dtype) -> torch.Tensor:
        """``[nk, kv_heads, 1]``: 1 where packed K channel j belongs to KV head h (built once per layout)."""
        return self._k_head_onehot.to(dtype)
