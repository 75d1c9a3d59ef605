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
4. vllm: the vLLM backend's Triton paged decode (leank_infer/vllm/triton_paged.py) against the dense rule
   on one Llama-8B layer at 8k/32k (error, ms per call next to dense SDPA); then, when vLLM (CUDA build)
   and the leank plugin are installed, ``benchmarks/vllm_throughput.py`` on the 8B shape with random
   weights (``--load-format dummy``, ``--attention-backend TRITON_ATTN``): plain vs LeanK KV tokens,
   sequences running and decode tokens/s at 32k in 8 GiB of KV.

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
import os
import statistics
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


def _time_paged(args: tuple, k: torch.Tensor, v: torch.Tensor, device: torch.device) -> str:
    """ms per call of the Triton paged decode and of dense SDPA over all ``k``/``v`` (the plain baseline)."""
    from leank_infer.vllm.triton_paged import triton_paged_decode

    q = args[0]
    qd, kd, vd = (x.transpose(0, 1)[None] for x in (q[:, None], k, v))  # [1, H, n, D]
    t_kernel = _median_ms(lambda: triton_paged_decode(*args), device, 20)
    t_dense = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), device, 20)
    return f"{t_kernel:.3f} ms vs dense SDPA {t_dense:.3f} ms"


def _dense_rule(q, k, v, keep, sink: int, mid_end: int, scale: float) -> torch.Tensor:  # noqa: ANN001
    """The LeanK rule written densely (fp32): keys [sink, mid_end) with the kept channels only, heads keeping none
    skip them; the reference of the Triton paged decode."""
    q, k, v = q.float(), k.float(), v.float()
    hkv = keep.shape[0]
    grp = q.shape[0] // hkv
    out = []
    for h in range(hkv):
        kk = k[:, h].clone()
        kk[sink:mid_end] *= keep[h]
        s = q[h * grp : (h + 1) * grp] @ kk.t() * scale
        if not keep[h].any():
            s[:, sink:mid_end] = float("-inf")
        out.append(torch.softmax(s, -1) @ v[:, h])
    return torch.cat(out)


def part_vllm_kernel(small: bool, device: torch.device) -> list[dict[str, str]]:
    """The vLLM backend's Triton paged decode (one request, one layer of the Llama mask) against the dense rule:
    max error, and ms per call next to dense SDPA over the same context (GPU)."""
    from leank_infer.decode import triton_decode
    from leank_infer.vllm.layout import PackedLayout
    from leank_infer.vllm.triton_paged import triton_paged_decode

    if device.type != "cuda" and not triton_decode.kernels_interpreted():
        return [{"part": "vllm", "setting": "paged kernel", "result": "skipped: no GPU and no triton interpreter"}]
    mask = llama_mask(small)
    keep = mask.keep[1 if small else 10]
    layout = PackedLayout.from_keep(keep).to(device)
    hkv, d = keep.shape
    hq, bs = hkv * 4, 16
    dtype = torch.float16 if small else torch.bfloat16
    rows = []
    for n in [300] if small else [8192, 32768]:
        gen = torch.Generator(device=device).manual_seed(0)
        k = torch.randn(n, hkv, d, device=device, dtype=dtype, generator=gen)
        v = torch.randn(n, hkv, d, device=device, dtype=dtype, generator=gen)
        q = torch.randn(hq, d, device=device, dtype=dtype, generator=gen)
        nblocks = -(-n // bs)
        block_row = torch.randperm(nblocks, device=device, generator=gen).int()
        pages = torch.zeros(nblocks, bs, layout.width, device=device, dtype=dtype)
        pos = torch.arange(n, device=device)
        pages.view(-1, layout.width)[block_row.long()[pos // bs] * bs + pos % bs] = layout.pack(k, v)
        sink, recent = min(mask.sink_size, n // 4), min(mask.recent_size, n // 4)
        full = torch.cat([torch.arange(sink, device=device), torch.arange(n - recent, n, device=device)])
        args = (q, k[full], v[full], pages, block_row, sink, n - recent, layout, d**-0.5)
        got = triton_paged_decode(*args).float()
        ref = _dense_rule(q, k, v, keep.to(device), sink, n - recent, d**-0.5)
        err = (got - ref).abs().max().item()
        ok = err < 2e-2
        setting = f"paged kernel, {str(dtype)[6:]}, 1 request x {n}, Llama-8B layer heads"
        result = f"max abs error vs the dense rule {err:.1e} ({'ok' if ok else 'MISMATCH'})"
        if device.type == "cuda":
            result += "; " + _time_paged(args, k, v, device)
        rows.append({"part": "vllm", "setting": setting, "result": result})
    return rows


def part_vllm_engine(small: bool, device: torch.device, budget) -> list[dict[str, str]]:
    """vLLM vs vLLM + LeanK end to end on the 8B shape with random weights (benchmarks/vllm_throughput.py
    on --attention-backend TRITON_ATTN): KV tokens, sequences running, decode tokens/s (GPU only)."""
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

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import vllm_throughput

    with tempfile.TemporaryDirectory() as tmp:
        llama_config(False).save_pretrained(tmp)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rows = vllm_throughput.main([
                "--model", tmp, "--load-format", "dummy", "--dtype", "bfloat16", "--attention-backend",
                "TRITON_ATTN", "--any-base-model", "--mask", str(MASK_DIR), "--kv-mib", "8192",
                "--contexts", "32768", "--steps", "8",
            ])  # fmt: skip
        print(buf.getvalue(), end="")
    out = []
    for r in rows:
        f, s = r["full"], r["same_batch"]
        out.append({"part": "vllm", "setting": f"{setting}, {r['engine']}, 8B random weights, 32k, 8 GiB KV",
                    "result": f"{r['kv_cache_tokens']:,} KV tokens, {r['running']} seqs running, "
                              f"{f['tok_s']:.1f} decode tok/s; at batch {s['batch']}: {s['tok_s']:.1f} tok/s"})  # fmt: skip
    return out


def part_vllm(small: bool, device: torch.device, budget) -> list[dict[str, str]]:
    return part_vllm_kernel(small, device) + part_vllm_engine(small, device, budget)


# ---- driver ----------------------------------------------------------------------------------------


def table(rows: list[dict[str, str]]) -> str:
    lines = ["| part | setting | result |", "|---|---|---|"]
    lines += [f"| {r['part']} | {r['setting']} | {r['result']} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
