"""The batched LeanK decode over vLLM's LeanK pages (one call per layer for every decode request), and the
write of a step's K/V into them.

CUDA tensors run the Triton kernels (:mod:`~leank_infer.vllm.triton_paged`: capturable in a CUDA graph); so do
CPU tensors in tests (``$LEANK_TRITON_ON_CPU=1`` with triton's interpreter). Other CPU tensors run the kernel
of :mod:`~leank_infer.vllm.cpu_decode` (built at first use). Where neither can run (no compiler, tensors a
kernel does not cover) it is the PyTorch reference per request (:mod:`~leank_infer.vllm.paged_reference`),
with a warning logged once per reason.

Prompt chunks gather the request's K/V and run SDPA: the model's causal attention over every channel under
the ``"dense-prompt"`` rule (:func:`dense_prefill`), the positional prefill of the HF path
(:func:`~leank_infer.decode.positional_prefill.positional_prefill_attention`) for queries that follow the
positional rule (:func:`prefill`), on every device.
"""

from __future__ import annotations

import logging

import torch

from ..decode.positional_prefill import positional_prefill_attention
from . import cpu_decode, triton_paged
from .paged_reference import full_rows, reference_attention, request_kv, write_pages
from .pool import LayerSlot, WorkerPlan

log = logging.getLogger(__name__)
_warned: set[str] = set()


def decode(
    q: torch.Tensor,
    packed: torch.Tensor,
    packed_table: torch.Tensor,
    window: torch.Tensor,
    window_table: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: WorkerPlan,
    slot: LayerSlot,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8: torch.dtype | None = None,
) -> torch.Tensor:
    """LeanK attention ``[B, Hq, D]`` of one new query per request (its K/V already in the pages)."""
    args = (q, packed, packed_table, window, window_table, seq_lens, plan, slot, scale, k_scale, v_scale, fp8)
    if triton_paged.handles(q):
        return triton_paged.decode(*args)
    if q.device.type == "cpu":
        if not cpu_decode.supports(q, packed, window, fp8):
            _once(
                f"the CPU decode kernel does not cover q {q.dtype} over pages {packed.dtype} {tuple(packed.stride())}"
            )
        elif cpu_decode.available():
            return cpu_decode.decode(*args)
        else:
            _once("the CPU decode kernel is not available")
    return torch_decode(*args)


def prefill(
    plan: WorkerPlan,
    slot: LayerSlot,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_query: int,
    scale: float,
) -> torch.Tensor:
    """LeanK attention ``[n, Hq, D]`` of a prompt chunk ``q`` ``[n, Hq, D]`` at positions ``first_query + i`` over
    a request's dense ``k``/``v`` ``[first_query + n, Hkv, D]`` (from
    :func:`~leank_infer.vllm.paged_reference.request_kv`), positional rule.

    The same outcome as :func:`~leank_infer.vllm.paged_reference.reference_attention` (tested), which scores every
    key twice in fp32; this is one SDPA call per 256 queries in the model's dtype, about 1.5x a dense prefill.
    """
    out = positional_prefill_attention(
        q.transpose(0, 1)[None],
        k.to(q.dtype).transpose(0, 1)[None],
        v.to(q.dtype).transpose(0, 1)[None],
        slot.layout.keep(q.device),
        torch.zeros(1, dtype=torch.long, device=q.device),
        plan.sink,
        plan.recent,
        plan.accumu,
        scale,
    )
    return out[0]


def prompt_rows(
    plan: WorkerPlan,
    slot: LayerSlot,
    packed: torch.Tensor,
    packed_table: torch.Tensor,
    window: torch.Tensor,
    window_table: torch.Tensor,
    n: int,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8: torch.dtype | None = None,
    *,
    first: int = 0,
) -> None:
    """Every channel of a request's prompt tokens ``[first, first + n)`` (their packed and rest rows: the dense-prompt
    rule keeps the rest rows until the prompt is computed) into ``k``/``v`` ``[>= n, Hkv, D]``: one pass of the CPU
    library where it covers the pages (:func:`~leank_infer.vllm.cpu_decode.gather`), else PyTorch's
    (:func:`~leank_infer.vllm.paged_reference.full_rows`, four copies; fp8 pages, CUDA). Pages of a 2-byte float under
    wider ``k``/``v`` (``kv_cache_dtype`` bfloat16 under fp32 weights): the library's rows, then widened."""
    if cpu_decode.supports_gather(packed, window, k.dtype) and k.is_contiguous() and cpu_decode.available():
        cpu_decode.gather(packed, packed_table, window, window_table, n, slot, k, v, first=first)
    elif cpu_decode.supports_gather(packed, window, packed.dtype) and cpu_decode.available():
        rows = torch.empty(2, n, *k.shape[1:], dtype=packed.dtype)
        cpu_decode.gather(packed, packed_table, window, window_table, n, slot, rows[0], rows[1], first=first)
        k[:n], v[:n] = rows[0], rows[1]  # exact: every bf16/fp16 value is an fp32 one
    else:
        positions = torch.arange(first, first + n, device=packed.device)
        k[:n], v[:n] = full_rows(
            plan, slot, packed, packed_table, window, window_table, positions, k.dtype, k_scale, v_scale, fp8
        )


def prompt_kv(
    plan: WorkerPlan,
    slot: LayerSlot,
    packed: torch.Tensor,
    packed_table: torch.Tensor,
    window: torch.Tensor,
    window_table: torch.Tensor,
    length: int,
    first_query: int,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    dtype: torch.dtype,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K/V ``[length, Hkv, D]`` of a prompt chunk's request under the dense-prompt rule: every earlier token
    with every channel (:func:`prompt_rows`), then the chunk's own (what
    :func:`~leank_infer.vllm.paged_reference.request_kv` with ``whole=True`` builds)."""
    k = torch.empty(length, plan.num_kv_heads, plan.head_dim, dtype=dtype, device=packed.device)
    v = torch.empty_like(k)
    prompt_rows(plan, slot, packed, packed_table, window, window_table, first_query, k, v, k_scale, v_scale, fp8)
    k[first_query:] = new_k.to(dtype)
    v[first_query:] = new_v.to(dtype)
    return k, v


def dense_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_query: int, scale: float,
                  q_chunk: int = 1024) -> torch.Tensor:
    """The model's own causal attention ``[n, Hq, D]`` of prompt queries at positions ``first_query + i`` over
    every channel of the request's K/V ``[first_query + n, Hkv, D]`` (the ``"dense-prompt"`` rule): one SDPA
    call with its own causal mask from position 0, else one per ``q_chunk`` queries with a ``[q_chunk, keys]``
    mask. The inputs are 4-D (a batch of one): PyTorch's CPU SDPA takes its fused kernel only then (3-D inputs
    measured 8x slower)."""
    n = q.shape[0]
    qt = q.transpose(0, 1)[None]
    kt, vt = k.to(q.dtype).transpose(0, 1)[None], v.to(q.dtype).transpose(0, 1)[None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if first_query == 0:
        return sdpa(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    out = torch.empty_like(q)
    keys = torch.arange(k.shape[0], device=q.device)
    for s in range(0, n, q_chunk):
        e = min(n, s + q_chunk)
        last = first_query + e  # no query of the chunk sees a key at or past it
        allowed = keys[:last].view(1, -1) <= torch.arange(first_query + s, last, device=q.device).view(-1, 1)
        o = sdpa(qt[:, :, s:e], kt[:, :, :last], vt[:, :, :last], attn_mask=allowed, scale=scale, enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)
    return out


def _once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("LeanK: %s; decoding with the PyTorch reference (slow)", reason)


def torch_decode(
    q: torch.Tensor,
    packed: torch.Tensor,
    packed_table: torch.Tensor,
    window: torch.Tensor,
    window_table: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: WorkerPlan,
    slot: LayerSlot,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`decode` in PyTorch, one request at a time (a gather of its pages, then the reference attention)."""
    out = torch.empty_like(q)
    for i, length in enumerate(seq_lens.tolist()):
        p = length - 1
        tables = (packed, packed_table[i], window, window_table[i])
        own = full_rows(plan, slot, *tables, torch.tensor([p], device=packed.device), q.dtype, k_scale, v_scale, fp8)  # a window key
        k, v = request_kv(plan, slot, *tables, length, p, *own, q.dtype, k_scale, v_scale, fp8)
        out[i] = reference_attention(plan, slot, q[i : i + 1], k, v, p, scale)[0]
    return out


def write(
    packed: torch.Tensor,
    packed_slots: torch.Tensor,
    window: torch.Tensor,
    window_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot: LayerSlot,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8: torch.dtype | None = None,
) -> None:
    """The step's K/V ``[n, Hkv, D]`` into this layer's packed columns (slot ``>= 0``) and window columns (a slot
    past the null block, block 0); on CUDA without host syncs (capturable), on the CPU one call of the C kernel's
    library (fp8 pages: the PyTorch reference, which scales and rounds)."""
    if triton_paged.handles(k):
        triton_paged.write(packed, packed_slots, window, window_slots, k, v, slot, k_scale, v_scale, fp8)
    elif cpu_decode.supports_write(packed, window, k, v, fp8) and cpu_decode.available():
        cpu_decode.write(packed, packed_slots, window, window_slots, k, v, slot)
    else:
        write_pages(packed, packed_slots, window, window_slots, k, v, slot, k_scale, v_scale, fp8)


class BoundLayer:
    """One layer's write and decode over its pages (views of vLLM's pool that stay put while the engine runs), the
    implementation chosen once rather than every call: the CPU library's (:class:`~leank_infer.vllm.cpu_decode.LayerKernel`,
    its constant arguments in place) where it covers the pages, else :func:`write` and :func:`decode`. The backend
    binds each layer at its first step and again only when the pages, the dtype or the scales change."""

    def __init__(
        self,
        plan: WorkerPlan,
        slot: LayerSlot,
        packed: torch.Tensor,
        window: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        fp8: torch.dtype | None = None,
    ) -> None:
        self.plan, self.slot, self.packed, self.window, self.scale = plan, slot, packed, window, scale
        self.scales = (k_scale, v_scale, fp8)
        probe = torch.empty(1, 1, 1, dtype=dtype, device=packed.device)
        cpu = packed.device.type == "cpu" and not triton_paged.handles(probe)
        self.cpu: cpu_decode.LayerKernel | None = None
        if cpu and cpu_decode.supports(probe, packed, window, fp8) and cpu_decode.available():
            self.cpu = cpu_decode.LayerKernel(slot, packed, window, plan, scale, k_scale, v_scale, fp8)
        self.cpu_write = self.cpu is not None and cpu_decode.pages_writable(packed, window, fp8)

    def write(self, packed_slots: torch.Tensor, window_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """:func:`write` of the step's K/V ``[n, Hkv, D]``."""
        if self.cpu_write and k.dtype != self.packed.dtype:  # pages of another float (kv_cache_dtype bfloat16)
            k, v = k.to(self.packed.dtype), v.to(self.packed.dtype)
        if self.cpu_write and cpu_decode.kv_writable(self.packed, k, v) and cpu_decode.available():
            self.cpu.write(packed_slots, window_slots, k, v)
        else:
            write(self.packed, packed_slots, self.window, window_slots, k, v, self.slot, *self.scales)

    def decode(
        self, q: torch.Tensor, packed_table: torch.Tensor, window_table: torch.Tensor, seq_lens: torch.Tensor,
        out: torch.Tensor | None = None, runs: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """:func:`decode` of the first B = ``q.shape[0]`` rows of the tables, into ``out`` ``[B, Hq, D]`` if given.
        ``runs`` marks rows that are one request's consecutive queries (:meth:`.cpu_decode.LayerKernel.decode`): the CPU
        kernel reads their shared middle once; elsewhere each row is decoded alone, with the same result."""
        if self.cpu is not None and cpu_decode.available():
            return self.cpu.decode(q, packed_table, window_table, seq_lens, out, runs)
        b = q.shape[0]
        got = decode(
            q, self.packed, packed_table[:b], self.window, window_table[:b], seq_lens[:b], self.plan, self.slot,
            self.scale, *self.scales,
        )  # fmt: skip
        return got if out is None else out.copy_(got)


def prepare(plan: WorkerPlan, device: torch.device) -> None:
    """Put what the kernels read besides the pages (per-layer channel tables) on ``device``: once per worker,
    before any CUDA graph capture (a capturing stream cannot copy from the host)."""
    if torch.device(device).type == "cuda":
        triton_paged.prepare(plan, device)
