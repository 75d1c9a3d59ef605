"""``leank bench``: decode step latency, tokens/s and KV bytes, dense (HF generate, DynamicCache, SDPA) vs LeanK.

Runs the mask's base model in one process. Each configuration runs plain ``model.generate`` on
the same random prompt, once with a DynamicCache under SDPA and once with a LeanK cache (on CUDA
the Triton kernel, on CPU the PyTorch path); a stopping criterion timestamps every step, so the
decode step latency is the median gap between consecutive steps. The prompt is prefilled once per
context (batch 1, dense: LeanK's prompt attention is dense too under the default rule) and every run decodes from a copy
of its K/V, the row repeated to the batch; the LeanK cache takes it through its own prefill update.
Under ``--rule positional`` the prompt attends by the mask too: the LeanK cache is prefilled through the
LeanK model (batch 1, then its row repeated), and decodes from the dense prefill's next token as well.
Example:

    leank bench hub/smollm2-135m-instruct --contexts 2048 --batches 1 --new_tokens 16
    leank bench --estimate meta-llama/Llama-3.1-8B-Instruct --ratio 0.7   # bytes only, no weights
    leank bench hub/llama-3.1-8b-instruct --capacity 80                   # largest batch on an 80 GiB GPU
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Literal

import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from .cli_types import Fraction, PositiveInt, UsageError, output_file, staged
from .decode.cache import check_rule_options, dynamic_cache_bytes, fill_from_prefill
from .decode.rule import DEFAULT_RULE, POSITIONAL
from .mask import ChannelMask, model_positions, model_shape
from .model.generation import CACHE_KWARG
from .model.leank_model import LeanKModel
from .model.loading import BaseModelError, load_base_model, load_mask_base_model

DEFAULT_MASK = Path("hub") / "smollm2-135m-instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class _StepClock(StoppingCriteria):
    """Records a timestamp after every generation step; never stops anything. ``clock``: wall time, or
    the CPU time of this process (all its threads): robust on a shared CPU, exact with one thread."""

    def __init__(self, clock: str = "wall") -> None:
        self.now = CLOCKS[clock]
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.times.append(self.now())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _mask(path: str | None) -> tuple[ChannelMask | None, str]:
    """The mask to benchmark: a folder or Hub id, else hub/smollm2-135m-instruct, else None (random, said so)."""
    if path:
        return ChannelMask.from_pretrained(path), f"mask {path}"
    if (DEFAULT_MASK / "config.json").is_file():
        return ChannelMask.from_pretrained(DEFAULT_MASK), f"trained mask {DEFAULT_MASK}"
    return None, f"RANDOM mask (no {DEFAULT_MASK}): ratio 0.7, align 16, sink 16, recent 64, accumu 16"


def _peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


def estimate_main(model_id: str, ratio: float, zero_heads: float, dtype: torch.dtype) -> int:
    """Print K/V bytes per token dense vs LeanK for ``model_id``'s config (no weights are loaded)."""
    from transformers import AutoConfig

    from .folders.names import repo_id_problem
    from .mask.estimate import estimate_kv_bytes

    if not Path(model_id).is_dir() and repo_id_problem(model_id):
        raise BaseModelError(f"--estimate {model_id[:200]!r}: not a model folder, and {repo_id_problem(model_id)}")
    try:
        cfg = AutoConfig.from_pretrained(model_id, trust_remote_code=False)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise BaseModelError(f"--estimate {model_id!r}: cannot read its config: {first}") from None
    e = estimate_kv_bytes(cfg, ratio=ratio, zero_head_fraction=zero_heads, dtype=dtype)
    print(f"{model_id}: {e['layers']} layers ({e['global_layers']} global), {e['kv_heads']} KV heads x "
          f"{e['head_dim']} channels, {e['dtype']}")
    print(f"  KV bytes per token: dense {e['dense_bytes_per_token']:,}, LeanK {e['leank_bytes_per_token']:,} "
          f"({e['ratio']:.3f} of dense) at ratio {ratio}, {zero_heads:.0%} zero-channel heads")
    for ctx in (8192, 32768, 131072):
        print(f"  {ctx:>6} tokens: dense {e['dense_bytes_per_token'] * ctx / 2**30:7.2f} GiB, "
              f"LeanK {e['leank_bytes_per_token'] * ctx / 2**30:7.2f} GiB per sequence")
    return 0


def prefill_kv(lk: LeanKModel, ids: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """K/V of every layer after a dense prefill of ``ids`` (what LeanK's prefill computes too: its attention
    is dense) and the next token, so dense and LeanK runs decode from one prefill."""
    cache = DynamicCache(config=lk.model.config)
    with torch.inference_mode(), lk.dense():
        logits = lk.model(ids, **{CACHE_KWARG: cache}, use_cache=True).logits[:, -1]
    return [(layer.keys, layer.values) for layer in cache.layers], logits.argmax(-1, keepdim=True)


def filled(cache, kv: list[tuple[torch.Tensor, torch.Tensor]], batch: int):
    """``cache`` after the prefill that gave ``kv`` (batch 1), its row repeated ``batch`` times."""
    with torch.inference_mode():
        return fill_from_prefill(cache, [k.expand(batch, -1, -1, -1).contiguous() for k, _ in kv],
                                 [v.expand(batch, -1, -1, -1).contiguous() for _, v in kv])


def free_bytes(device: torch.device) -> int | None:
    """Memory a run on ``device`` may still take: the GPU's free memory, or the host's available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(mask: ChannelMask, contexts: list[int], batches: list[int], new_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> None:
    """Refuse a configuration whose dense K/V cache alone exceeds the free memory (``--batches 100000``), before
    anything is allocated: one line, not an allocator error after the first runs."""
    free = free_bytes(device)
    per_token = mask.kv_bytes_per_token(dtype)["dense"]
    worst = max(contexts) + new_tokens
    need = max(batches) * worst * per_token
    if free is not None and need > free:
        raise UsageError(
            f"--batches {max(batches):,} x --contexts {max(contexts):,} (+{new_tokens} new tokens) needs "
            f"{need / 2**30:,.1f} GiB of dense K/V cache, more than the {free / 2**30:,.1f} GiB free on {device}"
        )


def leank_filled(lk: LeanKModel, prompt: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], batch: int):
    """A fresh LeanK cache after ``prompt``'s prefill (batch 1), its row repeated ``batch`` times: filled from the
    dense prefill's ``kv`` under the dense-prompt rule, prefilled through the LeanK model under the positional one."""
    if lk.rule != POSITIONAL:
        return filled(lk.new_cache(), kv, batch)
    cache = lk.new_cache()
    with torch.inference_mode():
        lk(prompt, cache=cache, logits_to_keep=1)
    cache.batch_repeat_interleave(batch)
    return cache


def _run(model, ids: torch.Tensor, cache, new_tokens: int, clock_name: str = "wall") -> dict[str, float]:
    clock = _StepClock(clock_name)
    t0 = clock.now()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **{CACHE_KWARG: cache},
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([clock]),
            pad_token_id=0,
        )
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
    return {
        "prefill_s": clock.times[0] - t0,
        "step_ms": 1000 * statistics.median(gaps),
        "tok_s": ids.shape[0] * len(gaps) / sum(gaps),
    }


def bench(
    mask: str | None = None,
    *,
    contexts: list[PositiveInt] = [2048, 4096, 8160],  # noqa: B006 (read only; shown in --help; 8160 + 32 new = 8192)
    batches: list[PositiveInt] = [1, 4],  # noqa: B006
    new_tokens: PositiveInt = 32,
    dtype: Literal["float32", "bfloat16", "float16"] | None = None,
    device: str = "cpu",
    threads: PositiveInt | None = None,
    repeats: PositiveInt = 1,
    clock: Literal["wall", "cpu"] = "wall",
    dense_until: int = 0,
    rule: str = DEFAULT_RULE,
    kv_quant: Literal["int8", "int4"] | None = None,
    estimate: str | None = None,
    plot: Path | None = None,
    card: bool = False,
    ratio: Fraction = 0.7,
    zero_heads: Fraction = 0.0,
    capacity: list[float] | None = None,
    weights_gib: float | None = None,
) -> int:
    """Decode ms/step, tokens/s and KV bytes, dense vs LeanK, on the mask's base model.

    Examples:
        leank bench hub/smollm2-135m-instruct --contexts 2048 4096 --batches 1 4 --new_tokens 16
        leank bench --estimate meta-llama/Llama-3.1-8B-Instruct --ratio 0.7   # bytes only, no weights
        leank bench hub/llama-3.1-8b-instruct --capacity 80 141               # largest batch on 80/141 GiB GPUs

    Args:
        mask: mask folder or Hub id (default: hub/smollm2-135m-instruct if present, else a random mask).
        contexts: prompt lengths in tokens.
        batches: batch sizes.
        new_tokens: tokens generated per run (>= 3).
        dtype: default: float32 on CPU, bfloat16 on CUDA.
        device: cpu, or cuda (LeanK then decodes with the Triton kernel).
        threads: torch CPU threads (default: torch's choice).
        repeats: runs per configuration, dense and LeanK alternating; the best is kept.
        clock: step time as wall time, or as this process's CPU time (robust when other jobs share the
            CPU; with more than one thread it also counts OpenMP's spin-waiting).
        dense_until: LeanK decodes dense until a sequence holds this many tokens (LeanKModel's dense_until;
            0 = off, the default): the short-context switch, measured against plain dense.
        rule: the LeanK rule, dense-prompt (the default): the prompt attends with every channel, each
            generated token by its position; or positional: every query, the prompt's too, by its position alone (no
            --dense-until).
        kv_quant: store LeanK's middle quantised, int8 or int4 (KIVI's grouping, leank_infer.decode.kv_quant);
            sink and recent tokens stay full precision. Default: the model's dtype.
        estimate: only print KV bytes/token dense vs LeanK for this model's config (no weights).
        plot: also draw decode time vs context to this PNG.
        card: with --plot and a mask folder: put the figure (and this command) in the mask's model card.
        ratio: with --estimate: fraction of K channels pruned.
        zero_heads: with --estimate: fraction of KV heads keeping no channel (the paper saw 0.16-0.18).
        capacity: GIB [GIB ...]: only print, for the mask and these GPU memory sizes, KV GiB per sequence and the
            largest batch at 4k/32k/128k tokens, dense vs LeanK (bf16 unless --dtype; see leank_infer.mask.capacity).
        weights_gib: with --capacity: GiB of model weights (default: the mask's recorded base-model size).
    """
    from .cli import invocation

    command = invocation("leank bench", bench, dict(locals()))
    if plot:  # a bad path fails now, not after the whole run; inside a mask folder only when --card takes it in
        plot = output_file(plot, "--plot", ".png", carded=[mask] if card and mask else ())
    if capacity:
        from .mask.capacity import capacity_main

        try:
            return capacity_main(mask or str(DEFAULT_MASK), capacity, weights_gib, DTYPES[dtype or "bfloat16"], command)
        except ValueError as e:  # MaskError included
            raise UsageError(f"--capacity: {' '.join(str(e).split())}") from None
    try:
        torch_device = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device: {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if torch_device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: leank bench measures on cpu or cuda, not {device!r}")
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device: CUDA is not available on this machine")
    device = torch_device
    torch_dtype = DTYPES[dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    if estimate:
        return estimate_main(estimate, ratio, zero_heads, torch_dtype)
    if dense_until < 0:
        raise UsageError(f"--dense-until: must be >= 0 tokens, got {dense_until}")
    try:
        check_rule_options(rule, dense_until)
    except ValueError as e:
        raise UsageError(f"--rule: {e}") from None
    if threads and threads > 4 * (os.cpu_count() or 1):
        raise UsageError(f"--threads {threads}: this machine has {os.cpu_count()} CPUs; give at most {4 * (os.cpu_count() or 1)}")
    if threads:
        torch.set_num_threads(threads)
    new_tokens = max(3, new_tokens)
    dtype = torch_dtype
    mask_path = mask

    print(f"command: {command}")
    mask, where = _mask(mask_path)
    if mask is None:
        model, _ = load_base_model("embedded", dtype=dtype)
        scores = torch.rand(*model_shape(model.config), generator=torch.Generator().manual_seed(0))
        mask = ChannelMask.from_scores(scores, 0.7, 16, sink_size=16, recent_size=64, accumu_size=16)
        check_memory(mask, contexts, batches, new_tokens, dtype, device)
    else:
        check_memory(mask, contexts, batches, new_tokens, dtype, device)  # before the model loads
        model, _ = load_mask_base_model(mask, dtype=dtype)
    limit = model_positions(model.config)
    if limit is not None and max(contexts) + new_tokens > limit:
        raise UsageError(
            f"--contexts {max(contexts):,} + {new_tokens} new tokens exceeds the model's {limit:,} "
            f"positions (max_position_embeddings); use contexts up to {limit - new_tokens:,}"
        )
    model.to(device)
    stats = mask.stats(dtype=dtype)
    print(
        f"model: {mask.base_model or 'embedded SmolLM2-135M-Instruct'}, {str(dtype)[6:]} on {device}, "
        f"torch threads {torch.get_num_threads()}, {clock} clock, CPU load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        + (f", GPU {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
    )
    print(f"mask: {where}; K kept {stats['k_kept_fraction']:.1%}, V kept {stats['v_kept_fraction']:.1%}"
          + (f"; LeanK decodes dense until {dense_until:,} tokens" if dense_until else "")
          + (f"; rule {rule}" if rule != DEFAULT_RULE else "")
          + (f"; middle quantised {kv_quant}" if kv_quant else ""))
    lk = LeanKModel(model, mask, dense_until=dense_until, rule=rule, kv_quant=kv_quant)
    header = (
        f"{'context':>7} {'batch':>5} | {'dense ms/step':>13} {'LeanK ms/step':>13} {'speedup':>7} | "
        f"{'dense tok/s':>11} {'LeanK tok/s':>11} | {'dense KV MiB':>12} {'LeanK KV MiB':>12} {'KV ratio':>8} {'alloc ratio':>11}"
        + (f" | {'dense peak GiB':>14} {'LeanK peak GiB':>14}" if device.type == "cuda" else "")
    )
    print(header)
    print("-" * len(header))
    rows = []
    for ctx in contexts:
        prompt = torch.randint(100, model.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(ctx))
        kv, first = prefill_kv(lk, prompt.to(device))
        for batch in batches:
            # every run continues the one prefill: its K/V (rows repeated) in a fresh cache and its next token
            ids = torch.cat([prompt.to(device), first], 1).expand(batch, -1)
            dense = leank = None
            peaks = {}
            for _ in range(max(1, repeats)):  # alternate, keep the best of each (shared CPUs are noisy)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                dense_cache = filled(DynamicCache(config=model.config), kv, batch)
                with lk.dense():
                    run = _run(model, ids, dense_cache, new_tokens, clock)
                peaks["dense"] = _peak(device)
                dense = run if dense is None or run["step_ms"] < dense["step_ms"] else dense
                dense_bytes = dynamic_cache_bytes(dense_cache)
                del dense_cache
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                leank_cache = leank_filled(lk, prompt.to(device), kv, batch)
                run = _run(model, ids, leank_cache, new_tokens, clock)
                peaks["leank"] = _peak(device)
                leank = run if leank is None or run["step_ms"] < leank["step_ms"] else leank
                leank_bytes = lk.kv_cache_bytes(leank_cache)
                leank_alloc = leank_cache.allocated_bytes()
                del leank_cache
            print(
                f"{ctx:>7} {batch:>5} | {dense['step_ms']:>13.1f} {leank['step_ms']:>13.1f} "
                f"{dense['step_ms'] / leank['step_ms']:>6.2f}x | {dense['tok_s']:>11.1f} {leank['tok_s']:>11.1f} | "
                f"{dense_bytes / 2**20:>12.1f} {leank_bytes / 2**20:>12.1f} {leank_bytes / dense_bytes:>8.3f} "
                f"{leank_alloc / dense_bytes:>11.3f}"
                + (f" | {peaks['dense']:>14.2f} {peaks['leank']:>14.2f}" if device.type == "cuda" else ""),
                flush=True,
            )
            rows.append({"context": ctx, "batch": batch, "dense_ms": dense["step_ms"], "leank_ms": leank["step_ms"]})
    if plot:
        from .hub.plots import plot_decode_time

        with staged(plot) as draw_to:  # drawn beside the card's folder, copied in by its swap
            plot_decode_time(rows, draw_to, command)
            if card and mask_path and Path(mask_path).is_dir():
                from .hub.card import write_model_card

                write_model_card(mask_path, figures={plot.name: command}, figure_files=[draw_to])
        print(f"plot: {plot}")
    print(
        "speedup = dense ms/step / LeanK ms/step (median decode step, prefill excluded); KV ratio = LeanK/dense bytes "
        "held; alloc ratio = LeanK storage reserved (its preallocated spare slots included) / dense"
    )
    return 0

