"""Decode attention of one layer on a GPU: dense flash-decoding vs the LeanK Triton kernel.

Llama-3.1-8B head shapes (32 query heads, 8 KV heads, head_dim 128), a mask at ratio 0.7 /
align 32 binarised from random per-head-scaled scores (so kept counts differ and some heads keep
nothing, as trained masks do), sink 128 and recent 768 (the cache right after a prefill).
First a correctness check (kernel vs the PyTorch path, fp16 and bf16, two rows with different
starts, with and without soft-capping), then timings at batch x length, each the median of CUDA-event timed calls after warmup,
with L2 flushed between calls. Prints achieved bytes/s against the byte floor (LeanK K+V bytes
over the device-to-device copy bandwidth) and the speedup over dense; the markdown table is last.

    python benchmarks/kernel.py [--batches 1 16 64] [--lengths 8192 32768 131072] [--dtype bf16]

Dense baselines: torch SDPA (GQA, one query token) and, when installed, flash_attn's
``flash_attn_with_kvcache``; plus the same Triton kernel over a full-channel cache ("dense, same
kernel"), which isolates the saving of the pruned bytes from kernel quality.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class LayerConfig:
    """One layer's decode problem: batch x cached length, Llama-3.1-8B heads, LeanK window sizes."""

    batch: int
    seq_len: int
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    sink: int = 128
    recent: int = 768

    def parts(self) -> dict[str, int]:
        """Tokens in the full head, compressed middle and full tail right after a prefill of seq_len."""
        head = min(self.sink, self.seq_len)
        tail = min(self.recent, self.seq_len - head)
        return {"head": head, "middle": self.seq_len - head - tail, "tail": tail}


def configs(batches: list[int], lengths: list[int]) -> list[LayerConfig]:
    return [LayerConfig(b, n) for b in batches for n in lengths]


def dense_bytes(cfg: LayerConfig, item: int) -> int:
    """K+V bytes a dense decode step reads."""
    return 2 * cfg.batch * cfg.kv_heads * cfg.head_dim * cfg.seq_len * item


def leank_bytes(cfg: LayerConfig, keep: torch.Tensor, item: int) -> int:
    """K+V bytes a LeanK decode step must read: full head/tail, kept K channels + V of nonzero heads."""
    p = cfg.parts()
    full = 2 * cfg.kv_heads * cfg.head_dim * (p["head"] + p["tail"])
    mid = p["middle"] * (int(keep.sum()) + int(keep.any(-1).sum()) * cfg.head_dim)
    return cfg.batch * item * (full + mid)


def fits(cfg: LayerConfig, keep: torch.Tensor, item: int, free_bytes: int) -> bool:
    """Dense and LeanK caches live together while timing; keep 15% headroom for workspaces."""
    return dense_bytes(cfg, item) + leank_bytes(cfg, keep, item) <= 0.85 * free_bytes


def make_mask(cfg: LayerConfig, seed: int = 1) -> torch.Tensor:
    """``[Hkv, D]`` keep from ChannelMask.from_scores at ratio 0.7 / align 32 (one layer)."""
    from leank_infer.mask import ChannelMask

    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(0.5 * torch.randn(1, cfg.kv_heads, 1, generator=gen))  # heads differ in importance
    scores = torch.rand(1, cfg.kv_heads, cfg.head_dim, generator=gen) * scale
    mask = ChannelMask.from_scores(scores, ratio=0.7, align=32, sink_size=cfg.sink, recent_size=cfg.recent)
    return mask.keep[0]


def build_inputs(
    cfg: LayerConfig,
    keep: torch.Tensor,
    dtype: torch.dtype,
    starts: list[int] | None = None,
    device: str = "cuda",
):
    """(dense q/k/v/padding, decode contract args ``(query, layout, masks, scaling)``) over one random cache;
    rows may start late (left padding)."""
    from leank_infer.decode.cache import mid_capacity, middle_k_storage
    from leank_infer.decode.layout import ChannelGroups, DecodeLayout, DecodeMasks

    dev = torch.device(device)
    b, hkv, d = cfg.batch, cfg.kv_heads, cfg.head_dim
    q = torch.randn(b, cfg.q_heads, 1, d, device=dev, dtype=dtype)
    k = torch.randn(b, hkv, cfg.seq_len, d, device=dev, dtype=dtype)
    v = torch.randn(b, hkv, cfg.seq_len, d, device=dev, dtype=dtype)
    groups = ChannelGroups.from_keep(keep).to(dev)
    starts_t = torch.tensor(starts or [0] * b, device=dev)
    p = cfg.parts()
    h = min(cfg.seq_len, int(starts_t.max()) + p["head"])
    m = cfg.seq_len - p["tail"]
    cap = mid_capacity(m - h)
    mid_k = []  # channel-major storage [B, Hg, c, cap] seen as [B, Hg, n, c], as the LeanK cache stores it
    for heads, ch in zip(groups.heads, groups.channels, strict=True):
        buf = middle_k_storage(k, b, len(heads), cap, ch.shape[-1])[:, :, : m - h]
        buf.copy_(k[:, heads, h:m].gather(-1, ch.view(1, len(heads), 1, -1).expand(b, -1, m - h, -1)))
        mid_k.append(buf)
    mid_v = v[:, groups.nonzero_order, h:m].contiguous()
    j = torch.arange(h, device=dev)
    s = starts_t.view(-1, 1)
    head_full = ((j >= s) & (j < s + cfg.sink)).unsqueeze(1)
    head_mid = (j >= s + cfg.sink).unsqueeze(1)
    layout = DecodeLayout.from_parts(
        k[:, :, :h], v[:, :, :h], k[:, :, m:], v[:, :, m:], mid_k, mid_v, groups, starts_t, cfg.sink
    )
    args = (q, layout, DecodeMasks(head_full, head_mid), d**-0.5)
    pad = (torch.arange(cfg.seq_len, device=dev).view(1, -1) >= s).view(b, 1, 1, -1)
    return (q, k, v, pad), args


def _fp32(args: tuple) -> tuple:
    """The same decode case in fp32 (the reference's precision)."""
    q, layout, *rest = args
    return (q.float(), layout.float(), *rest)


def _dense_case(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, head: int, masks, scaling: float):
    """Every key with all channels (a full mask): head ``[0, head)``, the rest as tail, no middle."""
    from leank_infer.decode.layout import ChannelGroups, DecodeLayout

    ones = ChannelGroups.from_keep(torch.ones_like(keep)).to(k.device)
    empty_v = v.new_zeros(v.shape[0], v.shape[1], 0, v.shape[3])
    layout = DecodeLayout.from_parts(k[:, :, :head], v[:, :, :head], k[:, :, head:], v[:, :, head:], [], empty_v, ones)
    return (q, layout, masks, scaling)


TOLERANCE = {"fp16": 1e-3, "bf16": 8e-3}  # relative (norm) error against an fp32 evaluation
SOFTCAP = 1.0


def check_correctness(
    keep: torch.Tensor,
    cfg: LayerConfig | None = None,
    device: str = "cuda",
    dtypes: tuple[str, ...] = ("fp16", "bf16"),
) -> list[str]:
    """Kernel vs the PyTorch path (in fp32 on the same values), and full-mask kernel vs SDPA; left-padded batch of 2."""
    from leank_infer.decode.layout import DecodeMasks
    from leank_infer.decode.torch_decode import torch_decode_attention
    from leank_infer.decode.triton_decode import triton_decode_attention

    lines, ok = [], True
    cfg = cfg or LayerConfig(batch=2, seq_len=4096 + 37)
    for name in dtypes:
        dtype, tol = DTYPES[name], TOLERANCE[name]
        torch.manual_seed(0)
        (_, k, v, pad), args = build_inputs(cfg, keep, dtype, starts=[0, 45], device=device)
        ref = torch_decode_attention(*_fp32(args))
        got = triton_decode_attention(*args)
        rel = float((got.float() - ref).norm() / ref.norm())
        good = bool(torch.isfinite(got).all()) and rel < tol
        # Gemma 2's soft-capping, at a cap the N(0, 1) logits here feel (GPU exp2/division, not numpy's)
        ref_cap = torch_decode_attention(*_fp32(args), softcap=SOFTCAP)
        got_cap = triton_decode_attention(*args, softcap=SOFTCAP)
        rel_cap = float((got_cap.float() - ref_cap).norm() / ref_cap.norm())
        good &= bool(torch.isfinite(got_cap).all()) and rel_cap < tol
        # with a full-channel mask the kernel must equal dense attention
        masks = args[2]
        full_head = DecodeMasks(masks.head_full | masks.head_mid, torch.zeros_like(masks.head_mid))
        dense_args = _dense_case(args[0], k, v, keep, args[1].head_len, full_head, args[-1])
        got_dense = triton_decode_attention(*dense_args)
        q = args[0]
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=pad, enable_gqa=True
        ).transpose(1, 2)
        rel_dense = float((got_dense.float() - sdpa).norm() / sdpa.norm())
        good &= rel_dense < tol
        ok &= good
        lines.append(f"{name}: LeanK vs PyTorch path rel err {rel:.2e}, soft-capped at {SOFTCAP} {rel_cap:.2e}, "
                     f"full mask vs SDPA {rel_dense:.2e} (tol {tol:.0e}) {'ok' if good else 'FAIL'}")  # fmt: skip
        del k, v, args, dense_args
    if not ok:
        raise SystemExit("correctness check failed:\n" + "\n".join(lines))
    return lines


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), median of 10."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_ms(partial(dst.copy_, src), flush=False)
    del src, dst
    return 2 * (nbytes // 2) / (t * 1e-3)


_FLUSH: torch.Tensor | None = None


def time_ms(fn, warmup: int = 3, reps: int = 15, flush: bool = True) -> float:
    """Median CUDA-event time of ``fn`` in ms; L2 overwritten before each call so caches start cold."""
    global _FLUSH
    if flush and _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if flush:
            _FLUSH.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _time_or_nan(fn) -> float:
    """A dense baseline that does not fit (e.g. SDPA falling back to a GQA copy) must not cost the row."""
    try:
        return time_ms(fn)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return float("nan")


def bench_one(cfg: LayerConfig, keep: torch.Tensor, dtype: torch.dtype, bw: float) -> dict[str, float]:
    """Times (ms) of the dense baselines and of LeanK for one configuration, with LeanK's byte floor."""
    from leank_infer.decode.layout import DecodeMasks
    from leank_infer.decode.triton_decode import triton_decode_attention

    item = torch.empty((), dtype=dtype).element_size()
    (q, k, v, _), args = build_inputs(cfg, keep, dtype)
    row: dict[str, float] = {"flash_attn": float("nan")}
    row["sdpa"] = _time_or_nan(
        partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, enable_gqa=True)
    )
    try:
        from flash_attn import flash_attn_with_kvcache

        kf, vf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        row["flash_attn"] = _time_or_nan(
            partial(flash_attn_with_kvcache, q.transpose(1, 2).contiguous(), kf, vf)
        )
        del kf, vf
    except (ImportError, torch.OutOfMemoryError):
        torch.cuda.empty_cache()
    # dense flash-decoding with the same kernel: every key in the full "tail", all channels
    dense_args = _dense_case(q, k, v, keep, 0, DecodeMasks(), args[-1])
    row["dense_kernel"] = time_ms(partial(triton_decode_attention, *dense_args))
    del k, v, dense_args
    row["leank"] = time_ms(partial(triton_decode_attention, *args))
    row["dense_best"] = min(x for x in (row["sdpa"], row["flash_attn"], row["dense_kernel"]) if x == x)
    row["leank_bytes"] = leank_bytes(cfg, keep, item)
    row["dense_bytes"] = dense_bytes(cfg, item)
    row["floor"] = row["leank_bytes"] / bw * 1e3
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernel.py needs a CUDA GPU (torch.cuda.is_available() is False); "
              "the kernel's CPU tests are tests/test_triton_decode.py", file=sys.stderr)  # fmt: skip
        return 2
    from leank_infer.decode.triton_decode import HAS_TRITON, kernels_interpreted

    if not HAS_TRITON or kernels_interpreted():
        print("benchmarks/kernel.py needs triton, compiled (unset TRITON_INTERPRET)", file=sys.stderr)
        return 2
    dtype, item = DTYPES[a.dtype], DTYPES[a.dtype].itemsize
    keep = make_mask(LayerConfig(1, 1))
    counts = keep.sum(-1).tolist()
    print(f"mask: kept channels per KV head {counts}, K kept {keep.float().mean():.3f}, "
          f"V kept {keep.any(-1).float().mean():.3f}")  # fmt: skip
    for line in check_correctness(keep):
        print(line)
    bw = copy_bandwidth()

    rows = []
    for cfg in configs(a.batches, a.lengths):
        free, _ = torch.cuda.mem_get_info()
        if not fits(cfg, keep, item, free):
            print(f"skip batch {cfg.batch} x {cfg.seq_len}: needs "
                  f"{(dense_bytes(cfg, item) + leank_bytes(cfg, keep, item)) / 2**30:.1f} GiB")  # fmt: skip
            continue
        try:
            r = bench_one(cfg, keep, dtype, bw)
        except torch.OutOfMemoryError:
            print(f"skip batch {cfg.batch} x {cfg.seq_len}: out of memory")
            torch.cuda.empty_cache()
            continue
        torch.cuda.empty_cache()
        rows.append((cfg, r))
        print(f"batch {cfg.batch:3d} x {cfg.seq_len:6d}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()
              if not k.endswith("bytes")))  # fmt: skip

    print()
    print(f"GPU: {torch.cuda.get_device_name()}, {a.dtype}, copy bandwidth {bw / 1e9:.0f} GB/s; "
          f"command: python {' '.join(sys.argv)}")  # fmt: skip
    print()
    print("| batch | tokens | SDPA ms | flash_attn ms | dense (same kernel) ms | LeanK ms | speedup vs best dense "
          "| dense kernel GB/s | LeanK GB/s | LeanK floor ms | floor / LeanK |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cfg, r in rows:
        fa = "-" if r["flash_attn"] != r["flash_attn"] else f"{r['flash_attn']:.3f}"
        print(f"| {cfg.batch} | {cfg.seq_len} | {r['sdpa']:.3f} | {fa} | {r['dense_kernel']:.3f} | "
              f"{r['leank']:.3f} | {r['dense_best'] / r['leank']:.2f}x | "
              f"{r['dense_bytes'] / r['dense_kernel'] / 1e6:.0f} | {r['leank_bytes'] / r['leank'] / 1e6:.0f} | "
              f"{r['floor']:.3f} | {r['floor'] / r['leank']:.0%} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
