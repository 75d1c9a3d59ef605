"""vLLM's own Triton attention (``TRITON_ATTN``'s decode) without vLLM installed: the baseline that
``benchmarks/gpu_check.py`` times the LeanK decode against.

The GPU machine has no network and vLLM does not fit the device tool's 64 MiB carry, so the kernel
file and its helpers are vendored verbatim from vLLM 0.32.0 (``benchmarks/vendor/``, Apache-2.0) and
loaded here with the few ``vllm`` modules they import replaced by stand-ins (logger, platform: fp8 is
e4m3fn, batch invariance off, ``KVQuantMode``); the stand-ins leave ``sys.modules`` when the files are
loaded, so ``import vllm`` still tells whether vLLM is really installed.

:class:`VllmDecode` calls ``unified_attention`` as ``TritonAttentionImpl.forward`` does for a batch of
decodes with a CUDA-graph-enabled builder (``TritonAttentionMetadataBuilder``): the 3D kernel with 16
softmax segments and ``reduce_segments`` up to ``seq_threshold_3D`` sequences, the 2D kernel above.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import sys
import types
from pathlib import Path
from typing import Any

import torch

VENDOR = Path(__file__).resolve().parent / "vendor"
MIN_LAUNCH_GRID_SIZE_2D = 128  # vllm/v1/attention/backends/triton_attn.py
NUM_PAR_SOFTMAX_SEGMENTS = 16
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]  # vLLM's default cudagraph capture sizes (start)
_module: Any = None


class KVQuantMode(enum.IntEnum):
    """vllm.v1.kv_cache_interface.KVQuantMode (the values the kernel tests)."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4


def _stand_ins() -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    platform = types.SimpleNamespace(
        fp8_dtype=lambda: torch.float8_e4m3fn, is_device_capability_family=lambda family: False
    )
    mods = {
        "vllm": module("vllm"),
        "vllm.envs": module("vllm.envs", VLLM_BATCH_INVARIANT=False),
        "vllm.logger": module("vllm.logger", init_logger=logging.getLogger),
        "vllm.platforms": module("vllm.platforms", current_platform=platform),
        "vllm.triton_utils": module("vllm.triton_utils", triton=triton, tl=tl),
        "vllm.v1": module("vllm.v1"),
        "vllm.v1.attention": module("vllm.v1.attention"),
        "vllm.v1.attention.ops": module("vllm.v1.attention.ops"),
        "vllm.v1.kv_cache_interface": module("vllm.v1.kv_cache_interface", KVQuantMode=KVQuantMode),
    }
    mods["vllm"].envs = mods["vllm.envs"]
    return mods


def _exec(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load() -> types.ModuleType:
    """The vendored ``triton_unified_attention`` module (loaded once; ``TRITON_INTERPRET`` applies)."""
    global _module
    if _module is not None:
        return _module
    stand_ins = _stand_ins()
    helpers = "vllm.v1.attention.ops.triton_attention_helpers"
    saved = {name: sys.modules.get(name) for name in [*stand_ins, helpers]}
    try:
        sys.modules.update(stand_ins)
        _exec(helpers, VENDOR / "vllm_triton_attention_helpers.py")
        _module = _exec("leank_vendored_vllm_unified_attention", VENDOR / "vllm_triton_unified_attention.py")
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return _module


class VllmDecode:
    """vLLM's Triton decode of ``[B, Hq, D]`` queries over a ``[blocks, Hkv, block_size, 2 D]`` KV cache
    (vLLM's layout: K and V of a token side by side), buffers allocated once as vLLM's builder does."""

    def __init__(
        self, max_batch: int, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
    ):
        self.unified_attention = load().unified_attention
        threshold = MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads
        self.seq_threshold_3D = min(CAPTURE_SIZES, key=lambda x: abs(x - threshold))
        rows = self.seq_threshold_3D
        pad = 1 << (head_dim - 1).bit_length()
        f32 = dict(dtype=torch.float32, device=device)
        self.segm_output = torch.empty(rows, num_heads, NUM_PAR_SOFTMAX_SEGMENTS, pad, **f32)
        self.segm_max = torch.empty(rows, num_heads, NUM_PAR_SOFTMAX_SEGMENTS, **f32)
        self.segm_expsum = torch.empty(rows, num_heads, NUM_PAR_SOFTMAX_SEGMENTS, **f32)
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.ones = torch.ones(1, **f32)

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        b, d = q.shape[0], q.shape[2]
        key_cache, value_cache = kv_cache.transpose(1, 2).split(d, dim=-1)
        descale = self.ones.expand(b, key_cache.shape[2])
        self.unified_attention(
            q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=self.cu_seqlens_q[: b + 1], max_seqlen_q=1,
            seqused_k=seq_lens, max_seqlen_k=max_seq_len, softmax_scale=scale, causal=True,
            window_size=(-1, -1), block_table=block_table, softcap=0, q_descale=None, k_descale=descale,
            v_descale=descale, seq_threshold_3D=self.seq_threshold_3D,
            num_par_softmax_segments=NUM_PAR_SOFTMAX_SEGMENTS, softmax_segm_output=self.segm_output,
            softmax_segm_max=self.segm_max, softmax_segm_expsum=self.segm_expsum,
        )  # fmt: skip
        return out
