"""How to build the vLLM plugin's CPU decode kernel: C++ through ctypes, torch's C++ extension, or numba, measured.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_kernel_build.py [--contexts 2048,8192] [--batches 1,16]

(a) **ctypes**: ``leank_infer/vllm/cpu_decode.cpp`` compiled by the system C++ compiler (OpenMP), loaded with
ctypes (what :mod:`leank_infer.vllm.cpu_decode` ships). (b) **load_inline**: the same source behind a pybind11
wrapper taking tensors, built by ``torch.utils.cpp_extension.load_inline`` (its threads are the same: with
PyTorch's OpenMP backend ``at::parallel_for`` is an OpenMP parallel region, so the kernel body is unchanged).
(c) **numba**: the same algorithm (pieces of whole 128-key tiles, online softmax, the query heads of a KV head
together) in ``@njit(parallel=True, fastmath=True, cache=True)`` with ``prange`` over the pieces; fp32 only.

For each: the first build (an empty cache, in a fresh process), the start of a later process (the cache warm:
import, load, first call), and the median time of a layer call of the embedded SmolLM2's shapes (9 query
heads, 3 KV heads, head_dim 64, fp32) over the mask ``hub/smollm2-135m-instruct-s3``'s layers (mean over the
layers), every request at the same context, blocks of 16; threads from ``--threads``. Prints a table.

Measured on the 2-core development VM (Xeon, AVX-512; load average 6-9 from other jobs, so the 2-thread wall
times are not meaningful and only the order of the 1-thread ones is), with the kernel of commit fb884ea (one
piece per request and KV head; the same source for ctypes and load_inline):

    method        first use   later process   us per layer call, 1 thread (2k x1, 2k x16, 8k x1, 8k x16)
    ctypes           10.2 s          0.25 s      114     6102     1488    45487
    load_inline     122.4 s         13.60 s      128     8870      719    55433
    numba            28.1 s          1.91 s      551    41269     5612   160285

ctypes and load_inline run the same code (their differences are noise); numba is 4-5x slower per call. A
later process pays 13.6 s with load_inline (it re-checks its build with ninja) and ~2 s with numba (its cache
reload), 0.25 s with ctypes (import, load, first call).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

# ---- (b) torch's C++ extension: the same kernel behind a tensor-taking wrapper ---------------------------------
WRAPPER = r"""
torch::Tensor decode_ext(torch::Tensor q, torch::Tensor packed, torch::Tensor ptable, torch::Tensor window,
                         torch::Tensor wtable, torch::Tensor seq_lens, torch::Tensor k_off, torch::Tensor k_ch,
                         torch::Tensor v_col, std::vector<int64_t> ints, std::vector<double> floats) {
    auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(torch::kFloat32));
    Args a;
    a.B = q.size(0); a.Hq = q.size(1); a.Hkv = ints[0]; a.D = q.size(2); a.block_size = packed.size(1);
    a.q = q.data_ptr(); a.out = out.data_ptr<float>(); a.packed = packed.data_ptr(); a.window = window.data_ptr();
    a.packed_block_stride = packed.stride(0); a.packed_row = packed.size(2);
    a.window_block_stride = window.stride(0); a.window_row = window.size(2); a.window_block = window.size(1);
    a.packed_table = ptable.data_ptr<int32_t>(); a.window_table = wtable.data_ptr<int32_t>();
    a.packed_table_stride = ptable.stride(0); a.window_table_stride = wtable.stride(0);
    a.seq_lens = seq_lens.data_ptr<int32_t>(); a.packed_offset = ints[1]; a.window_offset = ints[2];
    a.k_off = k_off.data_ptr<int64_t>(); a.k_ch = k_ch.data_ptr<int64_t>(); a.v_col = v_col.data_ptr<int64_t>();
    a.sink = ints[3]; a.recent = ints[4]; a.accumu = ints[5];
    a.scale = floats[0]; a.k_scale = 1.0; a.v_scale = 1.0; a.q_type = 0; a.kv_type = 0; a.lut = nullptr;
    a.threads = at::get_num_threads(); a.split = ints[6];
    TORCH_CHECK(leank_cpu_decode(&a) == 0, "kernel failed");
    return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode", &decode_ext); }
"""


def ext_module(build_dir: str):
    from torch.utils.cpp_extension import load_inline

    source = (ROOT / "leank_infer" / "vllm" / "cpu_decode.cpp").read_text()
    return load_inline(
        "leank_cpu_decode_ext", cpp_sources=[source + WRAPPER], extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"], build_directory=build_dir, verbose=False,
    )  # fmt: skip


# ---- (c) numba ---------------------------------------------------------------------------------------------------
NUMBA_SOURCE = r'''
import numpy as np
from numba import njit, prange

TILE = 128


@njit(fastmath=True, cache=True)
def _keys(base, bstride, row, table, bs, kcol, vcol, n, q, G, D, a, e, s, m, l, acc):
    t0 = a
    while t0 < e:
        nt = min(TILE, e - t0)
        for t in range(nt):
            pos = t0 + t
            r = table[pos // bs] * bstride + (pos % bs) * row
            for g in range(G):
                x = np.float32(0.0)
                for c in range(n):
                    x += q[g, c] * base[r + kcol + c]
                s[g, t] = x
        for g in range(G):
            mx = m[g]
            for t in range(nt):
                mx = max(mx, s[g, t])
            c = np.exp(m[g] - mx)
            tot = np.float32(0.0)
            for t in range(nt):
                w = np.exp(s[g, t] - mx)
                s[g, t] = w
                tot += w
            l[g] = l[g] * c + tot
            m[g] = mx
            for d in range(D):
                acc[g, d] *= c
        for t in range(nt):
            pos = t0 + t
            r = table[pos // bs] * bstride + (pos % bs) * row + vcol
            for g in range(G):
                w = s[g, t]
                for d in range(D):
                    acc[g, d] += w * base[r + d]
        t0 += TILE


@njit(parallel=True, fastmath=True, cache=True)
def decode(q, packed, pstride, prow, ptable, window, wstride, wrow, wtable, bs, seq_lens, poff, woff,
           k_off, k_ch, v_col, sink, recent, accumu, scale, split):
    B, Hq, D = q.shape
    Hkv = v_col.shape[0]
    G = Hq // Hkv
    nitems = 0
    for b in range(B):
        p = seq_lens[b] - 1
        rf = accumu * ((p - recent) // accumu)
        mid = max(rf - sink, 0)
        for h in range(Hkv):
            nitems += (mid + split - 1) // split if v_col[h] >= 0 and mid > split else 1
    items = np.empty((nitems, 5), np.int64)  # b, h, mid_a, mid_e, part
    first = np.empty(B * Hkv, np.int64)
    splits = np.empty(B * Hkv, np.int64)
    i = 0
    parts = 0
    for b in range(B):
        p = seq_lens[b] - 1
        rf = accumu * ((p - recent) // accumu)
        mid = max(rf - sink, 0)
        for h in range(Hkv):
            m = mid if v_col[h] >= 0 else 0
            k = (m + split - 1) // split if m > split else 1
            splits[b * Hkv + h] = k
            first[b * Hkv + h] = parts if k > 1 else -1
            for j in range(k):
                items[i, 0] = b
                items[i, 1] = h
                items[i, 2] = sink + j * split
                items[i, 3] = sink + m if j == k - 1 else sink + (j + 1) * split
                items[i, 4] = parts + j if k > 1 else -1
                i += 1
            if k > 1:
                parts += k
    out = np.empty((B, Hq, D), np.float32)
    part = np.empty((max(parts, 1), G, D + 2), np.float32)
    for j in prange(nitems):
        b, h, ma, me, pi = items[j, 0], items[j, 1], items[j, 2], items[j, 3], items[j, 4]
        p = seq_lens[b] - 1
        rf = accumu * ((p - recent) // accumu)
        qf = np.empty((G, D), np.float32)
        qk = np.empty((G, D), np.float32)
        s = np.empty((G, TILE), np.float32)
        acc = np.zeros((G, D), np.float32)
        m = np.full(G, -1e30, np.float32)  # finite: fastmath assumes no infinities
        l = np.zeros(G, np.float32)
        c0 = k_off[h]
        nk = k_off[h + 1] - c0
        for g in range(G):
            for d in range(D):
                qf[g, d] = q[b, h * G + g, d] * scale
            for c in range(nk):
                qk[g, c] = qf[g, k_ch[c0 + c]]
        if ma == sink:  # the first piece: the full-channel keys too
            wt = wtable[b]
            _keys(window, wstride, wrow, wt, bs, woff + h * D, woff + Hkv * D + h * D, D, qf, G, D, 0,
                  min(sink, p + 1), s, m, l, acc)
            _keys(window, wstride, wrow, wt, bs, woff + h * D, woff + Hkv * D + h * D, D, qf, G, D, max(sink, rf),
                  p + 1, s, m, l, acc)
        if me > ma:
            _keys(packed, pstride, prow, ptable[b], bs, poff + c0, poff + v_col[h], nk, qk, G, D, ma, me, s, m, l,
                  acc)
        if pi < 0:
            for g in range(G):
                for d in range(D):
                    out[b, h * G + g, d] = acc[g, d] / l[g]
        else:
            for g in range(G):
                part[pi, g, 0] = m[g]
                part[pi, g, 1] = l[g]
                for d in range(D):
                    part[pi, g, 2 + d] = acc[g, d]
    for bh in prange(B * Hkv):
        k = splits[bh]
        if k > 1:
            b = bh // Hkv
            h = bh % Hkv
            f = first[bh]
            for g in range(G):
                mx = np.float32(-1e30)
                for j in range(k):
                    mx = max(mx, part[f + j, g, 0])
                tot = np.float32(0.0)
                o = np.zeros(D, np.float32)
                for j in range(k):
                    c = np.exp(part[f + j, g, 0] - mx)
                    tot += part[f + j, g, 1] * c
                    for d in range(D):
                        o[d] += part[f + j, g, 2 + d] * c
                for d in range(D):
                    out[b, h * G + g, d] = o[d] / tot
    return out
'''


def numba_module(cache_dir: str):
    """The numba kernel, written to ``cache_dir`` (numba caches next to the source)."""
    import importlib

    path = Path(cache_dir) / "leank_numba_decode.py"
    if not path.exists():
        path.write_text(NUMBA_SOURCE)
    sys.path.insert(0, cache_dir)  # an importable module: numba's cache reloads it by name
    return importlib.import_module("leank_numba_decode")


# ---- the three callers, over one layer's pages ---------------------------------------------------------------------
def flat(pages: torch.Tensor) -> torch.Tensor:
    """The 1-D span of a block-strided page view (what numba indexes)."""
    n = (pages.shape[0] - 1) * pages.stride(0) + pages.shape[1] * pages.shape[2]
    return torch.as_strided(pages, (n,), (1,))


def make_callers(kind: str, build_dir: str):
    """``call(q, packed, table, window, wtable, seq, plan, slot, scale)`` of one method."""
    from leank_infer.vllm import cpu_decode

    if kind == "ctypes":
        assert cpu_decode.available()
        return cpu_decode.decode
    if kind == "load_inline":
        mod = ext_module(build_dir)

        def call(q, packed, table, window, wtable, seq, plan, slot, scale):
            a, (k_off, k_ch, v_col) = cpu_decode._layer(plan, slot)
            ints = [plan.num_kv_heads, slot.packed_offset, slot.window_offset, plan.sink, plan.recent, plan.accumu,
                    cpu_decode.SPLIT]  # fmt: skip
            return mod.decode(q, packed, table, window, wtable, seq, k_off, k_ch, v_col, ints, [scale])

        return call
    mod = numba_module(build_dir)
    import numba

    def call(q, packed, table, window, wtable, seq, plan, slot, scale):
        numba.set_num_threads(torch.get_num_threads())
        _, (k_off, k_ch, v_col) = cpu_decode._layer(plan, slot)
        out = mod.decode(
            q.numpy(), flat(packed).numpy(), packed.stride(0), packed.shape[2], table.numpy(), flat(window).numpy(),
            window.stride(0), window.shape[2], wtable.numpy(), packed.shape[1], seq.numpy(), slot.packed_offset,
            slot.window_offset, k_off.numpy(), k_ch.numpy(), v_col.numpy(), plan.sink, plan.recent, plan.accumu,
            scale, cpu_decode.SPLIT,
        )  # fmt: skip
        return torch.from_numpy(out)

    return call


def child(kind: str, build_dir: str, timing: str) -> None:
    """One fresh process: build or load (timed), check one call against the reference, time the layer calls."""
    t0 = time.perf_counter()
    os.environ["LEANK_CACHE"] = build_dir
    call = make_callers(kind, build_dir)
    from vllm_kernel import HQ, leank_pages

    from leank_infer.mask import ChannelMask
    from leank_infer.vllm.pool import WorkerPlan

    mask = ChannelMask.from_pretrained(str(ROOT / "hub" / "smollm2-135m-instruct-s3"))
    layers = list(range(mask.num_layers))
    plans = {i: WorkerPlan.build(mask, [i]) for i in layers}
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, mask.head_dim, generator=g)
    pk, tb, wn, wt = leank_pages(plans[0], 1, 300, g)
    call(q, pk, tb, wn, wt, torch.tensor([300], dtype=torch.int32), plans[0], plans[0].slots[0], 0.125)
    start = time.perf_counter() - t0  # import + build or load + first call (JIT specialisation included)
    res = {"kind": kind, "start_s": start, "times": []}
    if timing:
        from vllm_kernel import median_us

        from leank_infer.vllm import cpu_decode

        widest = max(layers, key=lambda i: plans[i].packed_row)
        for spec in timing.split(";"):
            batch, context, threads = (int(x) for x in spec.split(","))
            torch.set_num_threads(threads)
            q = torch.randn(batch, HQ, mask.head_dim, generator=g)
            seq = torch.full((batch,), context, dtype=torch.int32)
            big, tb, wn, wt = leank_pages(plans[widest], batch, context, g)
            per_layer, err = [], 0.0
            for i in layers:
                plan = plans[i]
                pk = big.view(-1)[: big.shape[0] * big.shape[1] * plan.packed_row].view(
                    big.shape[0], big.shape[1], plan.packed_row
                )
                a = (q, pk, tb, wn, wt, seq, plan, plan.slots[i], 0.125)
                if i % 10 == 0:  # each method computes the same thing (the shipped kernel is tested)
                    err = max(err, (call(*a) - cpu_decode.decode(*a)).abs().max().item())
                per_layer.append(median_us(lambda a=a: call(*a), 0.1))
            res["times"].append(dict(batch=batch, context=context, threads=threads, us=statistics.fmean(per_layer),
                                     err=err))  # fmt: skip
    print("RESULT " + json.dumps(res))


def spawn(kind: str, build_dir: str, timing: str = "") -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--dir", build_dir, "--timing", timing],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode or not line:
        raise SystemExit(f"{kind} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads(line[-1][7:])


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_kernel_build.py", description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="ctypes,load_inline,numba")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--contexts", default="2048,8192")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--child", default=None)
    p.add_argument("--dir", default=None)
    p.add_argument("--timing", default="")
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.dir, args.timing)
        return []
    timing = ";".join(
        f"{b},{c},{t}" for c in args.contexts.split(",") for b in args.batches.split(",") for t in args.threads.split(",")
    )
    print(f"load {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")
    results = []
    for kind in args.kinds.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            first = spawn(kind, tmp)  # empty cache: the first use on a machine
            first_wall = time.perf_counter() - t
            warm = spawn(kind, tmp, timing)  # cache warm: every later process
            results.append(dict(kind=kind, first_s=first["start_s"], first_wall=first_wall, warm_s=warm["start_s"],
                                times=warm["times"]))  # fmt: skip
            print(f"{kind}: first use {first['start_s']:.1f} s, later process start {warm['start_s']:.2f} s", flush=True)
    head = "".join(f" | {r['kind']:>11}" for r in results)
    print(f"{'batch':>5} {'ctx':>6} {'thr':>3}{head}   (us per layer call, mean of the 30 layers' medians)")
    for j, row in enumerate(results[0]["times"]):
        cells = "".join(f" | {r['times'][j]['us']:>11.0f}" for r in results)
        print(f"{row['batch']:>5} {row['context']:>6} {row['threads']:>3}{cells}")
    print("max abs difference from the shipped kernel: "
          + ", ".join(f"{r['kind']} {max(t['err'] for t in r['times']):.1e}" for r in results))  # fmt: skip
    print(f"load {os.getloadavg()[0]:.2f} (1 min) at the end")
    return results


if __name__ == "__main__":
    main()
