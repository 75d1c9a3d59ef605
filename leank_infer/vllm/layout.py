"""What one token of a LeanK layer occupies in vLLM's paged KV cache, and how it is packed.

A page slot of a LeanK layer holds one token as a single row of ``width`` elements of the model
dtype: the kept K channels of every KV head (heads in order, channels ascending), then the whole V
of each head that keeps at least one channel. That is exactly what the HF cache stores for a
middle token (``ChannelMask.kv_bytes_per_token()["leank_middle"]``); the page of the layer is
``block_size * width * itemsize`` bytes instead of ``block_size * 2 * kv_heads * head_dim * itemsize``.
Sink and recent tokens (and, under the ``"dense-prompt"`` rule, a prompt while it is computed) need every
channel. Their packed row already holds the kept ones, so beside it they get a *rest row* only
(:meth:`PackedLayout.pack_rest`): the K channels the layer drops (heads in order, channels ascending), then
the whole V of each head that keeps no channel. Packed row and rest row together are the full K and V,
each element stored once (:attr:`PackedLayout.full_columns`).
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

    @cached_property
    def kr_index(self) -> torch.Tensor:
        """``[nkr]`` long: the dropped (head, channel) pairs of K, the rest row's first columns."""
        keep = torch.zeros(self.num_kv_heads * self.head_dim, dtype=torch.bool, device=self.k_index.device)
        keep[self.k_index] = True
        return torch.nonzero(~keep).flatten()

    @cached_property
    def vr_index(self) -> torch.Tensor:
        """``[nvr]`` long: every V channel of the heads keeping none, the rest row's last columns."""
        stored = torch.zeros(self.num_kv_heads * self.head_dim, dtype=torch.bool, device=self.v_index.device)
        stored[self.v_index] = True
        return torch.nonzero(~stored).flatten()

    @property
    def rest_width(self) -> int:
        """Elements of a rest row: what a token's packed row lacks of its full K and V (0 for a layer keeping all)."""
        return self.kr_index.numel() + self.vr_index.numel()

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

    def pack_rest(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``[T, kv_heads, head_dim]`` K and V to ``[T, rest_width]`` rest rows (what :meth:`pack` leaves out)."""
        t = key.shape[0]
        return torch.cat(
            [key.reshape(t, -1).index_select(1, self.kr_index), value.reshape(t, -1).index_select(1, self.vr_index)],
            dim=1,
        )

    @cached_property
    def full_columns(self) -> torch.Tensor:
        """``[2 * kv_heads * head_dim]`` long: where each element of a token's full K then V row is in its packed row
        followed by its rest row (``cat([packed_row, rest_row])``): one ``index_select`` puts a full row together."""
        hd, width, nk, nkr = self.num_kv_heads * self.head_dim, self.width, self.k_index.numel(), self.kr_index.numel()
        cols = torch.empty(2 * hd, dtype=torch.long, device=self.k_index.device)
        cols[self.k_index] = torch.arange(nk, device=cols.device)
        cols[self.kr_index] = width + torch.arange(nkr, device=cols.device)
        cols[hd + self.v_index] = nk + torch.arange(self.v_index.numel(), device=cols.device)
        cols[hd + self.vr_index] = width + nkr + torch.arange(self.vr_index.numel(), device=cols.device)
        return cols

    @cached_property
    def v_heads(self) -> list[int]:
        """KV heads whose V a page row stores, in row order."""
        return (self.v_index[:: self.head_dim] // self.head_dim).tolist()

    @cached_property
    def rest_v_heads(self) -> list[int]:
        """KV heads whose V a rest row stores (those keeping no channel), in row order."""
        return sorted(set(range(self.num_kv_heads)) - set(self.v_heads))

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
