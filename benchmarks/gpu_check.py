"""The one prepared command for a GPU session: every GPU-only measurement of leank, in under 8 minutes.

    python benchmarks/gpu_check.py --out $OUT/gpu_check.md          # on the GPU machine, no network
    python benchmarks/gpu_check.py --cpu-small                      # the CPU-sized variant (tests run it)

Parts, each timed and guarded (a failing part is a FAILED row, the others still run):

1. kernel: the Triton decode-kernel table of ``benchmarks/kernel.py`` (Llama-3.1-8B heads, batch 1/16/64 x
   8k/32k/128k), after its fp16/bf16 correctness check;
2. decode: end to end, dense (SDPA + DynamicCache) vs LeanK (the committed hub/llama-3.1-8b-instruct mask,
   Triton kernel), with the Llama-3.1-8B-Instruct configuration and random bf16 weights, at the paper's
   batch 52 x 4k and at 8 x 32k: ms per decode step (median, prefill excluded) and peak GPU memory;
3. train: a few bf16 steps of recipes/llama-3.1-8b.yaml's settings (sink 128, training recent 1024, ratio 0.7,
   align 32, activation checkpointing) on the same random model through a Lightning Trainer, at a 32k-token
   context: seconds per step and peak memory against ``leank_train.memory``'s estimate;
4. vllm: the vLLM plugin's Triton kernels (leank_infer/vllm/triton_paged.py; vLLM itself is not needed):
   (a) the decode against the PyTorch reference on the Llama-8B mask's pages (every layer, bf16; fp8
   e4m3/e5m2; block 128) and the page write against the PyTorch write, byte for byte; (b) ms per call of
   one layer's decode against vLLM 0.32's own Triton attention (vendored, benchmarks/vllm_triton_baseline.py)
   at batch 1/16/64 x 2k/8k, both replayed in CUDA graphs; (c) one decode step of a LeanK layer (write +
   decode) captured in a CUDA graph, replayed on other lengths and compared with eager, once after a
   warm-up and once compiling inside the capture as vLLM does. Then, when vLLM (CUDA build) and the leank
   plugin are installed, a plain and a LeanK engine on the 8B shape with random weights (``load_format
   "dummy"``), each in its own process, started as a user starts one: no attention-backend argument, the
   LeanK one naming the mask only (:func:`engine_args`); per engine the attention implementation vLLM gave
   its layers, its KV tokens, the sequences running and decode tokens/s at 32k in 8 GiB of KV.
   ``--parts vllm`` alone takes about 3 minutes (estimated: not run on a GPU yet).

The last thing printed is one short markdown table; it is also written to ``--out``. Random weights: the
timings and memory are the real model's (same shapes, same kernels), the generated tokens are noise.

No network on the GPU machine: everything needed is in the repo (the masks are committed). Packages the
machine lacks travel as wheels in the gitignored ``.whl/`` folder: ``pip download --no-deps
--only-binary=:all: --python-version 3.12 -d .whl PACKAGE==VERSION`` here, carry ``.whl`` with the run
(the device tool's ``carry``, 64 MiB in all), and start the command with
``pip install --no-index --find-links .whl PACKAGE &&``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
MASK_DIR = ROOT / "hub" / "llama-3.1-8b-instruct"
GiB = 1024**3
# (batch, context) of the end-to-end decode: the paper's 52 x 4k and a long-context 8 x 32k
DECODE_GPU = [(52, 4096), (8, 32768)]
DECODE_CPU = [(2, 160), (1, 320)]
NO_GPU = ("benchmarks/gpu_check.py needs a CUDA GPU (torch.cuda.is_available() is False); "
          "--cpu-small runs the CPU-sized variant of every part")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check.md"), help="where the summary table is written")
    p.add_argument("--parts", default="kernel,decode,train,vllm",
                   help="comma-separated subset of kernel,decode,train,vllm")
    p.add_argument("--cpu-small", action="store_true",
                   help="CPU-sized variant: 2-layer model with the real heads, tiny batches, interpreter kernel check")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per configuration (>= 3)")
    p.add_argument("--train-steps", type=int, default=3, help="training steps (the first includes warmup)")
    p.add_argument("--train-context", type=int, default=32768, help="context tokens of each training sample")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="skip parts not yet started once this many seconds have passed (the whole run stays < 8 min)")
    p.add_argument("--engine-child", help=argparse.SUPPRESS)  # one vLLM engine of the vllm part (JSON spec)
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = [x for x in parts if x not in ("kernel", "decode", "train", "vllm")]
    if bad or not parts:
        p.error(f"--parts: unknown part(s) {bad or parts}; choose from kernel, decode, train, vllm")
    if args.new_tokens < 3 or args.train_steps < 1 or args.train_context < 2048:
        p.error("--new-tokens must be >= 3, --train-steps >= 1 and --train-context >= 2048")
    args.parts = parts
    return args


# ---- the model --------------------------------------------------------------------------------------


def llama_config(small: bool) -> Any:
    """Llama-3.1-8B-Instruct's configuration (leank_train.memory's offline copy, + its llama3 rope scaling);
    small: 2 layers, hidden 256 and vocabulary 512, the real 32/8 heads of 128 channels."""
    from transformers import AutoConfig

    from leank_train.memory import KNOWN_CONFIGS

    fields = dict(KNOWN_CONFIGS[LLAMA])
    fields.update(max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})  # fmt: skip
    if small:
        fields.update(num_hidden_layers=2, hidden_size=256, intermediate_size=64, vocab_size=512)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def llama_mask(small: bool):
    from leank_infer import ChannelMask

    mask = ChannelMask.from_dir(MASK_DIR)
    if small:  # 2 of its layers, windows scaled to the tiny prompts
        mask = ChannelMask(keep=mask.keep[[2, 10]], ratio=mask.ratio, align=mask.align, sink_size=16,
                           recent_size=64, accumu_size=16)  # fmt: skip
    return mask


def build_model(small: bool, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(llama_config(small), dtype=dtype)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ---- parts -----------------------------------------------------------------------------------------


def _kernel_module():
    spec = importlib.util.spec_from_file_location("leank_bench_kernel", ROOT / "benchmarks" / "kernel.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def part_kernel(small: bool) -> list[dict[str, str]]:
    """benchmarks/kernel.py's table (GPU) or its correctness check on the interpreter (CPU)."""
    kernel = _kernel_module()
    if small:
        cfg = kernel.LayerConfig(batch=2, seq_len=300, q_heads=8, kv_heads=4, head_dim=64, sink=16, recent=64)
        lines = kernel.check_correctness(kernel.make_mask(cfg), cfg, device="cpu", dtypes=("fp16",))
        return [{"part": "kernel", "setting": "interpreter, fp16, 2 x 300 (CPU-sized)", "result": lines[0]}]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = kernel.main([])
    text = buf.getvalue()
    print(text, end="")
    if rc != 0:
        raise RuntimeError(f"benchmarks/kernel.py exited with {rc}")
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 11 and cells[0].isdigit() and (cells[0], cells[1]) in (("64", "32768"), ("1", "131072")):
            rows.append({"part": "kernel", "setting": f"batch {cells[0]} x {cells[1]}, bf16, one layer",
                         "result": f"LeanK {cells[5]} ms vs SDPA {cells[2]}, flash_attn {cells[3]}, same kernel "
                                   f"dense {cells[4]} ms: {cells[6]} vs best dense"})  # fmt: skip
    return rows or [{"part": "kernel", "setting": "bf16", "result": "no table row (see the log above)"}]


def _cache_kwarg(model) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (5.2x); use what the installed one takes."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def _decode(model, cache, ids: torch.Tensor, steps: int, device: torch.device) -> dict[str, float]:
    """Prefill, then ``steps`` greedy single-token steps; median step time, peak memory, seconds of prefill."""
    kw = {_cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
    _reset_peak(device)
    t0 = time.perf_counter()
    nxt = model(ids, **kw).logits[:, -1:].argmax(-1)
    _sync(device)
    prefill = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        nxt = model(nxt, **kw).logits[:, -1:].argmax(-1)
        _sync(device)
        times.append(time.perf_counter() - t)
    return {"ms": 1000 * statistics.median(times[1:]), "peak": _peak_gib(device), "prefill_s": prefill}


def part_decode(model, small: bool, device: torch.device, steps: int, budget) -> list[dict[str, str]]:
    from transformers import DynamicCache

    from leank_infer import LeanKModel

    mask = llama_mask(small)
    lk = LeanKModel(model, mask)  # checks the shape; sets the "leank" attention (SDPA without a LeanK cache)
    rows = []
    dtype = next(model.parameters()).dtype
    for batch, context in DECODE_CPU if small else DECODE_GPU:
        setting = f"Llama-3.1-8B{' (2 layers, hidden 256)' if small else ''}, batch {batch} x {context}, " \
                  f"{str(dtype)[6:]}, random weights"  # fmt: skip
        if budget():
            rows.append({"part": "decode", "setting": setting, "result": "skipped: time budget"})
            continue
        ids = torch.randint(100, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)
        try:
            model.set_attn_implementation("sdpa")
            dense = _decode(model, DynamicCache(config=model.config), ids, steps, device)
            model.set_attn_implementation("leank")
            leank = _decode(model, lk.new_cache(), ids, steps, device)
        except torch.OutOfMemoryError as e:
            rows.append({"part": "decode", "setting": setting, "result": f"out of memory: {str(e).splitlines()[0]}"})
            continue
        finally:
            model.set_attn_implementation("leank")
            _reset_peak(device)
        peak = (lambda r: f", peak {r['peak']:.1f} GiB" if r["peak"] is not None else "")  # noqa: E731
        rows.append({
            "part": "decode", "setting": setting,
            "result": f"dense {dense['ms']:.2f} ms/step{peak(dense)}; LeanK {leank['ms']:.2f} ms/step{peak(leank)}; "
                      f"speedup {dense['ms'] / leank['ms']:.2f}x (prefill {dense['prefill_s']:.1f} s / "
                      f"{leank['prefill_s']:.1f} s)",
        })  # fmt: skip
        print(f"decode: {rows[-1]['setting']}: {rows[-1]['result']}", flush=True)
    return rows


def part_train(model, small: bool, device: torch.device, steps: int, context: int) -> list[dict[str, str]]:
    """A few steps of the 8B recipe's stage 1 through Lightning on random token sequences."""
    import lightning as L
    from torch.utils.data import DataLoader

    from leank_train.distill.module import LeanKDistillation
    from leank_train.memory import estimate_step_memory
    from leank_train.pipeline import load_recipe
    from leank_train.recipe import stage_config

    recipe = stage_config(load_recipe(ROOT / "recipes" / "llama-3.1-8b.yaml"), 1)
    m = s1 = recipe["model"]
    sink, recent = (16, 64) if small else (m["sink_size"], m["recent_size"])
    answer = 16 if small else 64
    context = 200 if small else context
    module = LeanKDistillation.for_model(
        model, stage=1, sink_size=sink, recent_size=recent, ratio=m["ratio"], align=m["align"],
        activation_checkpointing=m["activation_checkpointing"], lr=s1["lr"], reg_weight=s1["reg_weight"],
        warmup_steps=1, min_lr_ratio=m["min_lr_ratio"],
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        ids = torch.randint(100, model.config.vocab_size, (1, context + answer), generator=gen)
        labels = ids.clone()
        labels[:, :context] = -100
        batches.append({"input_ids": ids, "labels": labels, "context_len": torch.tensor([context]),
                        "length": torch.tensor([context + answer])})  # fmt: skip
    step_times: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            _sync(device)
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            _sync(device)
            step_times.append(time.perf_counter() - self.t)

    trainer = L.Trainer(
        max_steps=steps, accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
        precision=recipe["trainer"]["precision"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Clock()],
        limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    _reset_peak(device)
    alpha0 = module.alpha.detach().clone()
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    if trainer.global_step != steps or torch.equal(module.alpha.detach().cpu(), alpha0.cpu()):
        raise RuntimeError(f"training did not step: {trainer.global_step} steps, alpha unchanged")
    est = estimate_step_memory(model.config, context, answer, activation_checkpointing=True)
    peak = _peak_gib(device)
    measured = f"peak {peak:.1f} GiB" if peak is not None else "peak not measured (CPU)"
    per_step = statistics.median(step_times[1:] or step_times)
    return [{
        "part": "train",
        "setting": f"8B recipe stage 1{' (2 layers, hidden 256)' if small else ''}, "
                   f"{str(next(model.parameters()).dtype)[6:]} model, act. ckpt, "
                   f"context {context} + answer {answer}, {steps} steps",
        "result": f"{per_step:.2f} s/step; {measured} vs leank_train.memory estimate {est['peak_gib']:.1f} GiB",
    }]  # fmt: skip


def _median_ms(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


# ---- the vLLM plugin's kernels (no vLLM needed) ------------------------------------------------------

UNMEASURED = "unmeasured: no GPU"
# (batch, context) of the decode timing against vLLM's own Triton attention
VLLM_SPEED = [(1, 2048), (1, 8192), (16, 2048), (16, 8192), (64, 2048), (64, 8192)]


class LeanKPages:
    """One worker's LeanK pages as vLLM lays them out, random values: one pool of equal pages for every
    store, the packed store and the window store on distinct blocks, window blocks only where the rule
    reads every channel (the sink, and the window of each length in ``window_for``, default each request's)."""

    def __init__(self, mask, layer: int, lengths: list[int], q_heads: int, dtype: torch.dtype,
                 device: torch.device, block_size: int = 16, fp8: torch.dtype | None = None,
                 window_for: list[int] | None = None, seed: int = 0, window_block: int | None = None):  # fmt: skip
        from dataclasses import replace

        from leank_infer.decode.rule import positional_recent_from
        from leank_infer.vllm.pool import WorkerPlan

        self.plan = plan = WorkerPlan.build(mask, list(range(mask.num_layers)), block_size=block_size)
        if window_block is not None:  # else the plan's (pool.fit_blocks)
            self.plan = plan = replace(plan, window_block=window_block)
        self.slot = plan.slots[layer]
        self.fp8, self.dtype = fp8, dtype
        self.k_scale, self.v_scale = (0.5, 2.0) if fp8 is not None else (1.0, 1.0)
        bs, wbs = block_size, plan.window_block  # the window pages hold their own number of tokens
        width, wwidth = -(-max(lengths) // bs), -(-max(lengths) // wbs)
        full_blocks = []
        for n in lengths:
            blocks = set(range(-(-min(plan.sink, n) // wbs)))
            for m in window_for if window_for is not None else [n]:
                start = max(plan.sink, positional_recent_from(m - 1, plan.recent, plan.accumu))
                blocks.update(range(start // wbs, -(-m // wbs)))
            full_blocks.append(sorted(blocks))
        total = 1 + len(lengths) * width + sum(len(x) for x in full_blocks)
        gen = torch.Generator(device=device).manual_seed(seed)
        pool = torch.empty(total, plan.page_elements, device=device, dtype=dtype if fp8 is None else torch.float32)
        pool.normal_(generator=gen)
        self.pool = pool if fp8 is None else pool.to(fp8).view(torch.uint8)
        self.packed = self.pool[:, : bs * plan.packed_row].view(total, bs, plan.packed_row)
        self.window = self.pool[:, : wbs * plan.window_row].view(total, wbs, plan.window_row)
        ids = (torch.randperm(total - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()  # 0: null
        packed_table = torch.zeros(len(lengths), width, dtype=torch.int32)
        window_table = torch.zeros(len(lengths), wwidth, dtype=torch.int32)
        for i, blocks in enumerate(full_blocks):
            packed_table[i] = torch.tensor([ids.pop() for _ in range(width)])
            window_table[i, blocks] = torch.tensor([ids.pop() for _ in blocks], dtype=torch.int32)
        self.packed_table, self.window_table = packed_table.to(device), window_table.to(device)
        self.seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        self.q = torch.randn(len(lengths), q_heads, plan.head_dim, generator=gen, device=device).to(dtype)

    def args(self, rows: int | None = None) -> tuple:
        """kernels.decode's arguments for the first ``rows`` requests (scale 1/sqrt(D))."""
        r = slice(0, rows)
        return (self.q[r], self.packed, self.packed_table[r], self.window, self.window_table[r], self.seq_lens[r],
                self.plan, self.slot, self.plan.head_dim**-0.5, self.k_scale, self.v_scale, self.fp8)  # fmt: skip

    def reference(self) -> torch.Tensor:
        """The PyTorch reference (leank_infer.vllm.paged_reference) of every request, fp32 attention."""
        from leank_infer.vllm.paged_reference import full_rows, reference_attention, request_kv

        plan, slot = self.plan, self.slot
        out = []
        for b, n in enumerate(self.seq_lens.tolist()):
            p = n - 1  # its K/V: the packed row and the rest row in the window pages
            pages = (self.packed, self.packed_table[b], self.window, self.window_table[b])
            scales = (self.k_scale, self.v_scale, self.fp8)
            new = full_rows(plan, slot, *pages, torch.tensor([p], device=self.q.device), self.dtype, *scales)
            k, v = request_kv(plan, slot, *pages, n, p, *new, self.dtype, *scales)
            out.append(reference_attention(plan, slot, self.q[b : b + 1], k, v, p, plan.head_dim**-0.5)[0])
        return torch.stack(out)


def _vllm_mask(small: bool):
    """The committed Llama-3.1-8B mask with its own windows (128/768/128); small: 2 layers, 16/64/16."""
    from leank_infer import ChannelMask

    return llama_mask(True) if small else ChannelMask.from_dir(MASK_DIR)


def _fmt(fp8: torch.dtype | None, dtype: torch.dtype) -> str:
    return "fp8 " + str(fp8).split("_")[-1] if fp8 is not None else str(dtype)[6:]


def part_vllm_kernel(small: bool, device: torch.device) -> list[dict[str, str]]:
    """(a) The plugin's Triton decode against the PyTorch reference on the Llama mask at its real sizes (every
    layer, bf16; one layer in fp8 e4m3/e5m2 pages and at block size 128), and its page write against the
    PyTorch write (bf16, and fp8 from bf16 values off the fp8 grid: the GPU's rounding). CPU: the
    interpreter, fp16, the 2-layer mask."""
    from leank_infer.vllm import triton_paged
    from leank_infer.vllm.paged_reference import write_pages

    if device.type != "cuda" and not triton_paged.interpreted():
        return [{"part": "vllm", "setting": "plugin kernels", "result": "skipped: no GPU and no triton interpreter"}]
    mask = _vllm_mask(small)
    dtype = torch.float16 if small else torch.bfloat16
    hq = 4 * mask.num_kv_heads
    lengths = [1, 20, 90, 300] if small else [1, 100, 1000, 1100, 4000, 9000]
    last = mask.num_layers - 1
    cases = [(layer, 16, None) for layer in range(mask.num_layers)] + [(last, 128, None)]
    cases += [(last, 16, torch.float8_e4m3fn), (last, 16, torch.float8_e5m2)]
    worst: dict[str, float] = {}
    for layer, bs, fp8 in cases:
        pages = LeanKPages(mask, layer, lengths, hq, dtype, device, block_size=bs, fp8=fp8, seed=layer)
        err = (triton_paged.decode(*pages.args()).float() - pages.reference().float()).abs().max().item()
        key = f"block {bs}" if fp8 is None else _fmt(fp8, dtype)
        worst[key] = max(worst.get(key, 0.0), err)
        del pages
    tol = 2e-3 if small else 3e-2
    ok = all(e < tol for e in worst.values())
    rows = [{"part": "vllm", "setting": f"plugin decode vs PyTorch reference, {str(dtype)[6:]}, Llama-8B mask "
             f"({mask.num_layers} layers, GQA 4), lengths {lengths}",
             "result": "max abs error " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
                       + f" ({'ok' if ok else 'MISMATCH'})"}]  # fmt: skip
    # the write: 64 tokens' K/V into a layer, every 7th padding (-1), every 5th window slot in the null block
    n, results = 64, []
    for fp8 in [None] + ([] if small else [torch.float8_e4m3fn, torch.float8_e5m2]):
        pages = LeanKPages(mask, last, [2 * n * 16], hq, dtype, device, fp8=fp8, window_for=[])
        plan, slot, bs, wbs = pages.plan, pages.slot, pages.plan.block_size, pages.plan.window_block
        gen = torch.Generator(device=device).manual_seed(1)
        k = (torch.randn(n, plan.num_kv_heads, plan.head_dim, device=device, generator=gen) * 3).to(dtype)
        v = torch.randn(n, plan.num_kv_heads, plan.head_dim, device=device, generator=gen).to(dtype)
        i = torch.arange(n, device=device)
        blocks = pages.packed_table[0].long()  # 2n distinct blocks: the first n packed, the last n window
        packed_slots = torch.where(i % 7 == 3, -1, blocks[:n] * bs + i % bs)
        window_slots = torch.where(i % 5 == 1, i % wbs, blocks[n:] * wbs + i % wbs)
        want = pages.pool.clone()
        wp, ww = (want[:, : b * r].view(-1, b, r) for b, r in ((bs, plan.packed_row), (wbs, plan.window_row)))
        write_pages(wp, packed_slots, ww, window_slots, k, v, slot, pages.k_scale, pages.v_scale, fp8)
        triton_paged.write(pages.packed, packed_slots, pages.window, window_slots, k, v, slot,
                           pages.k_scale, pages.v_scale, fp8)  # fmt: skip
        differ = int((pages.pool.view(torch.uint8) != want.view(torch.uint8)).sum())
        results.append(f"{_fmt(fp8, dtype)}: {differ} bytes differ")
        del pages, want, wp, ww
    ok = all(r.endswith(": 0 bytes differ") for r in results)
    rows.append({"part": "vllm", "setting": f"plugin page write vs PyTorch write, {n} tokens (padding, null block)",
                 "result": "; ".join(results) + f" ({'ok' if ok else 'MISMATCH'})"})  # fmt: skip
    return rows


def _graph_ms(fn, device: torch.device, calls: int = 10, replays: int = 10) -> tuple[float, str]:
    """GPU ms per call of ``fn``: ``calls`` calls captured in a CUDA graph and replayed ``replays`` times (no
    launch overhead in the figure); eager (events around back-to-back calls) if the capture fails."""
    fn()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    how, run = "graph", fn
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run, calls = graph.replay, 1
        graph.replay()
    except Exception:  # noqa: BLE001 - fall back to eager timing, and say so
        how = "eager"
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(replays * (10 if how == "eager" else 1)):
        run()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / (replays * 10), how


def part_vllm_speed(small: bool, device: torch.device) -> list[dict[str, str]]:
    """(b) One LeanK layer's decode (the plugin's Triton kernel over the pages of all 32 layers) against vLLM
    0.32's own Triton attention (the TRITON_ATTN decode, vendored: benchmarks/vllm_triton_baseline.py) over a
    dense cache of one layer: bf16, block 16, batch 1/16/64 x 2k/8k, GPU ms per call replayed in a CUDA
    graph. First, everywhere (CPU: interpreter, fp16): with a mask keeping every channel LeanK is dense
    attention, so the two kernels must agree on the same pages (it checks both harnesses)."""
    from leank_infer import ChannelMask
    from leank_infer.vllm import triton_paged

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import vllm_triton_baseline as vb

    mask = _vllm_mask(small)
    hkv, d = mask.num_kv_heads, mask.head_dim
    hq, scale = 4 * hkv, d**-0.5
    dtype = torch.float16 if small else torch.bfloat16
    full = ChannelMask(torch.ones(1, hkv, d, dtype=torch.bool), sink_size=mask.sink_size,
                       recent_size=mask.recent_size, accumu_size=mask.accumu_size)  # fmt: skip
    lengths = [3, 70, 200] if small else [3, 2048, 8192]
    pages = LeanKPages(full, 0, lengths, hq, dtype, device, window_for=[], window_block=16)
    pages.window_table.copy_(pages.packed_table)  # a full-keep row is [K | V] in the packed store; no rest row
    bs = pages.plan.block_size
    kv = pages.packed.reshape(-1, bs, 2, hkv, d).permute(0, 3, 1, 2, 4).reshape(-1, hkv, bs, 2 * d)
    dense = vb.VllmDecode(len(lengths), hq, hkv, d, device)
    want = dense(pages.q, kv, pages.packed_table, pages.seq_lens, max(lengths), scale, torch.empty_like(pages.q))
    err = (triton_paged.decode(*pages.args()).float() - want.float()).abs().max().item()
    ok = err < (2e-3 if small else 3e-2)
    rows = [{"part": "vllm", "setting": f"full-keep mask: LeanK decode vs vLLM Triton attention, {str(dtype)[6:]}, "
             f"lengths {lengths}", "result": f"max abs error {err:.1e} ({'ok' if ok else 'MISMATCH'})"}]  # fmt: skip
    del pages, kv
    if device.type != "cuda":
        rows.append({"part": "vllm", "setting": "LeanK decode vs vLLM Triton attention, batch 1/16/64 x 2k/8k",
                     "result": UNMEASURED})  # fmt: skip
        return rows
    return rows + speed_rows(mask, device, VLLM_SPEED, _graph_ms)


def speed_rows(mask, device: torch.device, configs: list[tuple[int, int]], timer) -> list[dict[str, str]]:
    """(b)'s table: for each (batch, context), ``timer(fn, device) -> (ms, how)`` of the LeanK decode of the
    mask's median-width layer and of vLLM's Triton decode over a dense cache of one layer (bf16 on a GPU)."""
    from leank_infer.vllm import triton_paged
    from leank_infer.vllm.pool import WorkerPlan

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import vllm_triton_baseline as vb

    hkv, d = mask.num_kv_heads, mask.head_dim
    hq, scale = 4 * hkv, d**-0.5
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    plan = WorkerPlan.build(mask, list(range(mask.num_layers)))
    layer = sorted(plan.slots, key=lambda i: plan.slots[i].packed_width)[len(plan.slots) // 2]  # median width
    top_b, top_n = max(b for b, _ in configs), max(n for _, n in configs)
    pages = LeanKPages(mask, layer, [top_n] * top_b, hq, dtype, device, window_for=sorted({n for _, n in configs}))
    per_req = -(-top_n // 16)
    kv = torch.empty(top_b * per_req + 1, hkv, 16, 2 * d, device=device).normal_().to(dtype)
    dense_table = (torch.randperm(top_b * per_req, device=device) + 1).int().view(top_b, per_req)
    dense = vb.VllmDecode(top_b, hq, hkv, d, device)
    out = torch.empty(top_b, hq, d, dtype=dtype, device=device)
    rows = []
    for b, n in configs:
        pages.seq_lens.fill_(n)
        args, seq = pages.args(b), pages.seq_lens[:b]
        t_lk, how = timer(lambda a=args: triton_paged.decode(*a), device)
        dense_args = (pages.q[:b], kv, dense_table[:b], seq, n, scale, out[:b])
        t_vl, how_vl = timer(lambda a=dense_args: dense(*a), device)
        rows.append({"part": "vllm", "setting": f"batch {b} x {n}, {str(dtype)[6:]}, one layer (Llama-8B layer "
                     f"{layer}: {pages.slot.packed_width} of {2 * hkv * d} elements per middle token)",
                     "result": f"LeanK {t_lk:.4f} ms vs vLLM Triton {t_vl:.4f} ms: {t_vl / max(t_lk, 1e-9):.2f}x "
                               f"({how}/{how_vl}; {triton_paged.launches(b, hkv, device)} LeanK launches)"})  # fmt: skip
        print(f"vllm: {rows[-1]['setting']}: {rows[-1]['result']}", flush=True)
    del pages, kv
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _capture(fn) -> Any:
    """``fn``'s kernels captured in a CUDA graph (run by ``.replay()``)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


GRAPH_LENGTHS = ([900, 17, 4000, 130, 2500, 1, 0, 0], [4999, 128, 1, 897, 3000, 60, 0, 0])  # 0: padding rows


def graph_case(mask, layer: int, bs: int, warm: bool, device: torch.device, lengths=GRAPH_LENGTHS,
               capture=_capture, repeats: int = 20) -> dict[str, str]:  # fmt: skip
    """One (write + decode) step of ``layer`` captured for a batch of the first lengths, replayed on the
    second (inputs changed in place), against the same step run eagerly on a copy of the pages."""
    from leank_infer.vllm import triton_paged

    hkv, d, hq = mask.num_kv_heads, mask.head_dim, 4 * mask.num_kv_heads
    top, batch = max(max(x) for x in lengths), len(lengths[0])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    pages = LeanKPages(mask, layer, [top] * batch, hq, dtype, device, block_size=bs,
                       window_for=list(range(1, top + 1)))  # every block a window block: any length works  # fmt: skip
    plan, slot = pages.plan, pages.slot
    triton_paged.prepare(plan, device)  # what the backend does when it plans the worker
    k = torch.zeros(batch, hkv, d, dtype=dtype, device=device)
    v, q = torch.zeros_like(k), torch.zeros(batch, hq, d, dtype=dtype, device=device)
    seq = torch.zeros(batch, dtype=torch.int32, device=device)
    pslot = torch.full((batch,), -1, dtype=torch.long, device=device)
    wslot = torch.full((batch,), -1, dtype=torch.long, device=device)
    out = torch.zeros_like(q)

    def fill(lengths: list[int], seed: int) -> None:  # in place, as vLLM refreshes its persistent buffers
        gen = torch.Generator(device=device).manual_seed(seed)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen, device=device))
        seq.copy_(torch.tensor(lengths, dtype=torch.int32))
        p = (seq.long() - 1).clamp(min=0)
        rows = torch.arange(batch, device=device)
        for store, table, b in ((pslot, pages.packed_table, bs), (wslot, pages.window_table, plan.window_block)):
            store.copy_(torch.where(seq > 0, table[rows, p // b].long() * b + p % b, -1))

    def step() -> None:
        triton_paged.write(pages.packed, pslot, pages.window, wslot, k, v, slot)
        out.copy_(triton_paged.decode(q, pages.packed, pages.packed_table, pages.window, pages.window_table, seq,
                                      plan, slot, d**-0.5))  # fmt: skip

    pad = sum(n == 0 for n in lengths[0])
    setting = (f"CUDA graph of a LeanK decode step (write + decode), batch {batch} ({pad} padding rows), "
               f"{str(dtype)[6:]}, block {bs}, {'after an eager warm-up' if warm else 'first launch inside the capture'}")  # fmt: skip
    try:
        fill(lengths[0], 0)
        if warm:
            step()
        _sync(device)
        graph = capture(step)
        fill(lengths[1], 1)  # other lengths: other windows, splits, tiles
        before = pages.pool.clone()
        graph.replay()
        _sync(device)
        replayed, replayed_pool = out.clone(), pages.pool.clone()
        pages.pool.copy_(before)
        step()
        same_out = torch.equal(replayed, out)
        same_pages = torch.equal(replayed_pool.view(torch.uint8), pages.pool.view(torch.uint8))
        real = torch.tensor(lengths[1], device=device) > 0
        padding = bool(out[real].isfinite().all()) and bool((out[~real] == 0).all())
        t_graph, t_eager = _median_ms(graph.replay, device, repeats), _median_ms(step, device, repeats)
        ok = same_out and same_pages and padding
        result = (f"replay == eager: output {same_out}, pages {same_pages}; padding rows 0, others finite: {padding} "
                  f"({'ok' if ok else 'MISMATCH'}); {t_graph:.3f} ms per replayed step vs {t_eager:.3f} ms eager")
    except Exception as e:  # noqa: BLE001 - a failed capture is the result
        traceback.print_exc()
        result = f"FAILED: {type(e).__name__}: {str(e)[:160]}"
    print(f"vllm: {setting}: {result}", flush=True)
    return {"part": "vllm", "setting": setting, "result": result}


def part_vllm_graph(small: bool, device: torch.device) -> list[dict[str, str]]:
    """(c) One decode step of a LeanK layer (page write, then decode) captured in a CUDA graph for a batch of
    8 (2 padding rows: length 0, slot -1), replayed after its inputs changed in place (other lengths,
    queries, K/V, slots) and compared with the same step run eagerly on a copy of the pages; then the
    same with the kernels' first launch (triton's compile) inside the capture, as in vLLM, which captures
    without an attention warm-up."""
    if device.type != "cuda":
        return [{"part": "vllm", "setting": "CUDA graph of a LeanK decode step (write + decode)", "result": UNMEASURED}]
    mask = _vllm_mask(small)
    return [graph_case(mask, 4, 16, True, device), graph_case(mask, 7, 32, False, device)]


# One engine of the vllm part: (context, KV bytes, dtype, timed decode steps, requests submitted). GPU: the 8B shape
# at 32k in 8 GiB (plain holds 2 such requests); small: the 2-layer model on vLLM's CPU build (tests only).
ENGINE_GPU = (32768, 8 * GiB, "bfloat16", 8, 16)
ENGINE_SMALL = (1024, 64 * 2**20, "float32", 3, 8)


def engine_args(model_dir: str, mask: str | None, small: bool) -> dict[str, Any]:
    """``LLM(...)``'s arguments for one engine, as a user writes them: vLLM's defaults, random weights, no
    attention backend (vLLM picks one; with a mask the plugin's serves every decoder layer), and for LeanK the
    mask in ``additional_config`` (its base model check off: the weights are random, the folder unnamed)."""
    context, kv_bytes, dtype, _, _ = ENGINE_SMALL if small else ENGINE_GPU
    extra = {"additional_config": {"leank_mask": mask, "leank_check_base_model": False}} if mask else {}
    return dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, max_model_len=context,
                kv_cache_memory_bytes=kv_bytes, max_num_seqs=64, **extra)  # fmt: skip


def engine_child(spec: dict[str, Any]) -> dict[str, Any]:
    """In the engine's own process (in-process engine core): start it, submit more long requests than its pool
    holds, time pure decode steps (``benchmarks/vllm_throughput.py``'s rule), report."""
    from vllm import LLM, SamplingParams, TokensPrompt

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vllm_throughput import decode_steps

    context, _, _, steps, requests = ENGINE_SMALL if spec["small"] else ENGINE_GPU
    llm = LLM(**engine_args(spec["model"], spec["mask"], spec["small"]))
    engine, config = llm.llm_engine, llm.llm_engine.vllm_config
    decoder = [m.impl for m in config.compilation_config.static_forward_context.values()
               if getattr(m, "attn_type", None) == "decoder" and getattr(m, "impl", None) is not None]  # fmt: skip
    impls = sorted({type(impl).__name__ for impl in decoder})
    leank = sum(getattr(impl, "mask", None) is not None for impl in decoder)  # layers LeanK serves
    vocab = config.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=4 * steps + 8, ignore_eos=True, detokenize=False)
    for r in range(requests):
        ids = [(17 * (r + 1) + 31 * j) % (vocab - 2) + 1 for j in range(context - 4 * steps - 12)]
        engine.add_request(str(r), TokensPrompt(prompt_token_ids=ids), params)
    row = decode_steps(engine, steps)
    return {"impls": impls, "layers": len(decoder), "leank_layers": leank,
            "kv_cache_tokens": config.cache_config.kv_cache_size_tokens, **row}  # fmt: skip


def run_engine(model_dir: str, mask: str | None, small: bool, timeout: float = 420) -> dict[str, Any]:
    """:func:`engine_child` in a fresh process (vLLM's attention selection is cached per process)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes on the CPU build
    spec = json.dumps({"model": model_dir, "mask": mask, "small": small})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--engine-child", spec]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not line:
        raise RuntimeError(f"the {'LeanK' if mask else 'plain'} engine failed:\n{out.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT ") :])


def engine_rows(model_dir: str, mask: str, small: bool, setting: str) -> list[dict[str, str]]:
    """A plain and a LeanK engine, one row each: the implementation vLLM gave the layers and what they hold."""
    rows = []
    for name, m in (("plain", None), ("LeanK", mask)):
        r = run_engine(model_dir, m, small)
        rows.append({"part": "vllm", "setting": f"{setting}, {name}, no attention-backend argument",
                     "result": f"LeanK serves {r['leank_layers']} of {r['layers']} decoder layers "
                               f"({', '.join(r['impls'])}); {r['kv_cache_tokens']:,} KV tokens, "
                               f"{r['running']:g} seqs running, {r['tok_s']:.1f} decode tok/s"})  # fmt: skip
    return rows


def part_vllm_engine(small: bool, device: torch.device, budget) -> list[dict[str, str]]:
    """vLLM vs vLLM + LeanK end to end on the 8B shape with random weights (:func:`engine_rows`; GPU only)."""
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - any failure to import means the path is absent here
        return [{"part": "vllm", "setting": "-", "result": f"skipped: vllm not importable ({type(e).__name__})"}]
    from importlib.metadata import entry_points

    plugins = [ep.name for ep in entry_points(group="vllm.general_plugins") if "leank" in ep.value]
    found = f"leank plugin {plugins}" if plugins else "no leank plugin registered"
    setting = f"vllm {vllm.__version__}"
    if device.type != "cuda" or small or budget():
        why = "time budget" if budget() else "GPU only"
        return [{"part": "vllm", "setting": setting, "result": f"importable; {found}; engine run skipped ({why})"}]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        llama_config(False).save_pretrained(tmp)
        return engine_rows(tmp, str(MASK_DIR), False, f"{setting}, 8B random weights, 32k, 8 GiB KV")


def part_vllm(small: bool, device: torch.device, budget) -> list[dict[str, str]]:
    rows = []
    for fn in (part_vllm_kernel, part_vllm_speed, part_vllm_graph):
        if budget():
            rows.append({"part": "vllm", "setting": fn.__name__, "result": "skipped: time budget"})
            continue
        try:
            rows += fn(small, device)
        except Exception as e:  # noqa: BLE001 - one failing check must not cost the others
            traceback.print_exc()
            rows.append({"part": "vllm", "setting": fn.__name__, "result": f"FAILED: {type(e).__name__}: {str(e)[:200]}"})
    return rows + part_vllm_engine(small, device, budget)


# ---- driver ----------------------------------------------------------------------------------------


def table(rows: list[dict[str, str]]) -> str:
    lines = ["| part | setting | result |", "|---|---|---|"]
    lines += [f"| {r['part']} | {r['setting']} | {r['result']} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine_child:
        print("RESULT " + json.dumps(engine_child(json.loads(args.engine_child))), flush=True)
        return 0
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_small:
        print(NO_GPU, file=sys.stderr)
        return 2
    small = args.cpu_small
    if small:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel check runs on CPU tensors; before triton loads
    device = torch.device("cuda" if cuda and not small else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.perf_counter()

    def over_budget() -> bool:
        return time.perf_counter() - start > args.budget_s

    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    with contextlib.suppress(ImportError):
        import triton

        versions += f", triton {triton.__version__}"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (CPU-sized variant)"
    command = "python benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"gpu_check on {where}; {versions}\ncommand: {command}", flush=True)

    rows: list[dict[str, str]] = []
    model = None

    def run(part: str, fn) -> None:
        if over_budget():
            rows.append({"part": part, "setting": "-", "result": "skipped: time budget"})
            return
        t = time.perf_counter()
        try:
            rows.extend(fn())
        except Exception as e:  # noqa: BLE001 - one failing part must not cost the others (the GPU time is scarce)
            traceback.print_exc()
            rows.append({"part": part, "setting": "-", "result": f"FAILED: {type(e).__name__}: {str(e)[:200]}"})
        print(f"[{part}: {time.perf_counter() - t:.0f} s]", flush=True)

    def model_once():
        nonlocal model
        if model is None:
            model = build_model(small, device, dtype)
        return model

    if "kernel" in args.parts:
        run("kernel", lambda: part_kernel(small))
    if "decode" in args.parts:
        run("decode", lambda: part_decode(model_once(), small, device, args.new_tokens, over_budget))
    if "train" in args.parts:
        run("train", lambda: part_train(model_once(), small, device, args.train_steps, args.train_context))
    if "vllm" in args.parts:
        run("vllm", lambda: part_vllm(small, device, over_budget))

    summary = (f"gpu_check on {where} ({versions}), {time.perf_counter() - start:.0f} s\n"
               f"command: {command}\n\n{table(rows)}\n")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(summary)
    print("\n" + summary, end="")
    return 1 if any(r["result"].startswith("FAILED") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
