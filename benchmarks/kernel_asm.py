"""What the compiled LeanK decode kernels do with memory, read off their code without a GPU.

Compiles the two kernels of ``leank_infer/decode/triton_decode.py`` for a Hopper GPU (sm_90: H100/H200)
exactly as a launch specialises them: triton's own binder sees real tensors of
``benchmarks/kernel.py``'s problem (Llama-3.1-8B heads, a ratio 0.7 / align 32 mask, batch 2 x 4k),
so pointer alignment, unit strides and divisible lengths are what a GPU run would give; a stand-in
driver answers "sm_90" and nothing is launched (run it as its own process: the kernels keep the
stand-in's compilations in their caches). For each kernel it prints what decides how close a
memory-bound decode gets to the byte floor: global->shared async copies by width (16 bytes is a
full vector), other global loads by width, how many copy groups stay in flight while a tile is
computed (the software pipeline at work), shared memory (at most 227 KiB per block on Hopper),
registers and spills (``ptxas -v``).

    python benchmarks/kernel_asm.py [--dtype bf16 fp16 fp32] [--softcap] [--json]

This checks code, not speed: the timings are ``benchmarks/kernel.py``'s, on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ARCH = 90
SM_COUNT = 132  # H100 SXM / H200


class _StandInDriver:
    """Just enough of triton's driver for its binder and compiler: device 0, an sm_90 target."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", ARCH, 32)


class _Capture:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` compiles (``warmup``) instead of launching."""

    def __init__(self, name: str, fn: Any, out: dict[str, Any]) -> None:
        self.name, self.fn, self.out = name, fn, out

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def compile_only(*args: Any, **kwargs: Any) -> None:
            self.out[self.name] = self.fn.warmup(*args, grid=grid, **kwargs)

        return compile_only


def compile_kernels(dtype: torch.dtype, softcap: float | None = None) -> dict[str, Any]:
    """``{"partials": CompiledKernel, "merge": CompiledKernel}`` for one decode step of the benchmark's problem."""
    import kernel as bench
    from triton.runtime import driver

    from leank_infer.decode import triton_decode as td

    if td.kernels_interpreted():
        raise SystemExit("kernel_asm.py compiles for a GPU: unset TRITON_INTERPRET")
    td._load_triton()
    cfg = bench.LayerConfig(batch=2, seq_len=4096)
    keep = bench.make_mask(bench.LayerConfig(1, 1))
    _, args = bench.build_inputs(cfg, keep, dtype, starts=[0, 45], device="cpu")
    out: dict[str, Any] = {}
    saved = td._partials_kernel, td._merge_kernel, td.kernels_interpreted, td._sm_count
    active = driver._active  # reset_active() would look for a real GPU driver: put back what was there
    driver.set_active(_StandInDriver())
    try:
        td._partials_kernel = _Capture("partials", saved[0], out)
        td._merge_kernel = _Capture("merge", saved[1], out)
        td.kernels_interpreted = lambda: True  # lets CPU tensors through the device check
        td._sm_count = lambda device: SM_COUNT  # split counts as on the GPU (a count of 1 compiles as a constant)
        td.triton_decode_attention(*args, softcap=softcap)
    finally:
        td._partials_kernel, td._merge_kernel, td.kernels_interpreted, td._sm_count = saved
        driver._active = active
    return out


def _ptxas_usage(ptx: str) -> dict[str, int]:
    """Registers and spill bytes from ``ptxas -v`` (the ptxas triton itself uses for sm_90)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [get_ptxas(ARCH).path, "-v", f"-arch=sm_{ARCH}a", str(src), "-o", str(Path(tmp) / "k.cubin")]
        r = subprocess.run(cmd, capture_output=True, text=True)
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    if r.returncode or regs is None or len(spills) != 2:
        raise RuntimeError(f"ptxas -v failed or printed no register/spill lines:\n{log[-2000:]}")
    return {"registers": int(regs.group(1)), "spill_bytes": sum(spills)}


def describe(kernel: Any) -> dict[str, Any]:
    """What one compiled kernel does with memory (see the module docstring)."""
    ptx = kernel.asm["ptx"]
    copy_ops = re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*;", ptx)
    copies = Counter(int(m.group(1), 0) for op in copy_ops if (m := re.search(r", (0x[0-9a-f]+|\d+)(?:, %r\d+)?;$", op)))
    if sum(copies.values()) != len(copy_ops):
        raise RuntimeError(f"unparsed async copies in the PTX: {copy_ops[:3]}")
    loads: Counter[str] = Counter()
    for op in re.findall(r"\bld\.global[\w.:]*", ptx):  # e.g. ld.global.L1::evict_last.v4.b32
        vec = re.search(r"\.(v[248])\.", op + ".")
        loads[f"{vec.group(1) if vec else 'v1'}.{op.rsplit('.', 1)[-1]}"] += 1
    waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx)]
    return {
        "async_copies_by_bytes": dict(sorted(copies.items())),
        "global_loads": dict(sorted(loads.items())),
        # largest N of "wait until at most N copy groups are pending": N >= 1 means later tiles are in
        # flight while one is computed (a software pipeline), 0 alone means none
        "groups_in_flight": max(waits, default=0),
        "shared_bytes": kernel.metadata.shared,
        **_ptxas_usage(ptx),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp16"])
    ap.add_argument("--softcap", action="store_true", help="also the soft-capped (Gemma 2) variant")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = ap.parse_args(argv)
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError as e:
        print(f"kernel_asm.py needs triton with its NVIDIA backend: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    rows = {}
    for name in a.dtype:
        for cap in (None, 50.0) if a.softcap else (None,):
            for kernel, compiled in compile_kernels(DTYPES[name], cap).items():
                rows[f"{name}{'-softcap' if cap else ''}/{kernel}"] = describe(compiled)
    if a.json:
        print(json.dumps(rows))
        return 0
    print(f"sm_{ARCH}, benchmarks/kernel.py's problem; command: python {' '.join(sys.argv)}\n")
    print("| variant | async copies (bytes: count) | other global loads | copy groups in flight | shared KiB "
          "| registers | spill bytes |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|")
    for key, r in rows.items():
        copies = ", ".join(f"{b}: {n}" for b, n in r["async_copies_by_bytes"].items()) or "-"
        loads = ", ".join(f"{k}: {n}" for k, n in r["global_loads"].items()) or "-"
        print(f"| {key} | {copies} | {loads} | {r['groups_in_flight']} | {r['shared_bytes'] / 1024:.0f} | "
              f"{r['registers']} | {r['spill_bytes']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
