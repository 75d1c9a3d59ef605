"""Hybrid models in vLLM: KV capacity of plain vLLM and of LeanK on tiny random models whose layers mix
full attention and sliding-window attention.

    .venv-vllm/bin/python benchmarks/vllm_hybrid.py [--families gemma2 gemma3] [--kv-gib 1] [--save]

Per family it writes a tiny random model (4 layers, alternating sliding-window and full attention) and a
mask that prunes the full-attention layers only (the windowed ones keep every channel: LeanK leaves them
whole), then starts a plain and a LeanK engine, each in a fresh process (fp32, ``VLLM_CPU_KVCACHE_SPACE``,
eager mode, which does not change the pool), and prints what vLLM reports at start-up ("KV cache size: N
tokens", its maximum concurrency at ``max_model_len`` times that length), the pool's blocks and KV cache
groups, and the bytes per token of the full-attention layers (plain: every channel; LeanK: the packed row
of a token outside the sink and the window). The last thing printed is a markdown table.

:func:`build` is also what ``tests/vllm_plugin/test_vllm_hybrid.py`` serves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

FAMILIES = ("gemma2", "gemma3")
LAYER_TYPES = ["sliding_attention", "full_attention"] * 2
WINDOW = 48  # tokens: prompts of a few hundred tokens leave it
HEAD_DIM = 64
MAX_MODEL_LEN = 4096
SINK, RECENT, ACCUMU = 16, 32, 16
QK_GAIN = 8.0  # the mask's full-channel tokens: far fewer than a prompt's


def build(family: str, folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """A tiny random ``family`` model in ``folder/model`` and a LeanK mask for it in ``folder/mask`` (the mask
    keeps every channel of the sliding-window layers, about 40% of each full-attention layer's K channels)."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

    from leank_infer.mask import ChannelMask, dense_layers_of

    common = dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM, max_position_embeddings=8192,
        sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=HEAD_DIM,
    )  # fmt: skip
    if family == "gemma2":
        # vLLM's LeanK layers do not soft-cap attention logits (they refuse a layer that does)
        config = Gemma2Config(attn_logit_softcapping=None, **common)
    elif family == "gemma3":
        config = Gemma3TextConfig(**common)
    else:
        raise ValueError(f"unknown family {family!r}; known: {list(FAMILIES)}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # peaked attention (random q/k projections score every key about alike): the keys'
        for name, weight in model.named_parameters():  # pruned channels then change tokens
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                weight.mul_(QK_GAIN)
    model.save_pretrained(folder / "model")
    keep = torch.rand(len(LAYER_TYPES), 1, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1)) < 0.4
    for layer in dense_layers_of(config):
        keep[layer] = True
    mask = ChannelMask(keep=keep, sink_size=SINK, recent_size=RECENT, accumu_size=ACCUMU, ratio=0.6, align=1)
    mask.save_pretrained(folder / "mask")
    return folder / "model", folder / "mask"


def prompts(seed: int = 3) -> list[list[int]]:
    """Random token ids, each prompt longer than the window and than the mask's sink + recent tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in (150, 97, 260)]


def child(args: argparse.Namespace) -> None:
    """One engine: greedy tokens of :func:`prompts`, vLLM's report and its KV cache groups; one JSON line."""
    from vllm import LLM, SamplingParams

    extra = {"additional_config": {"leank_mask": args.mask}} if args.mask else {}
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_MODEL_LEN,
              max_num_seqs=4, enforce_eager=True, **extra)  # fmt: skip
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    cache = llm.llm_engine.vllm_config.cache_config
    kv_config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    groups = [
        {"spec": type(g.kv_cache_spec).__name__, "layers": list(g.layer_names), "block_size": g.kv_cache_spec.block_size,
         "page_bytes": g.kv_cache_spec.page_size_bytes}
        for g in kv_config.kv_cache_groups
    ]  # fmt: skip
    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    leank = sorted(n for n, m in ctx.items() if getattr(getattr(m, "impl", None), "slot", None) is not None)
    packed = {getattr(m.impl, "plan", None).packed_row for n, m in ctx.items() if n in leank}
    print("RESULT " + json.dumps({
        "mask": args.mask or "plain", "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "kv_cache_tokens": cache.kv_cache_size_tokens, "num_blocks": cache.num_gpu_blocks, "groups": groups,
        "leank_layers": leank, "packed_row": packed.pop() if packed else None,
    }), flush=True)  # fmt: skip


def engine(model: Path, mask: Path | None, kv_gib: int = 1, new_tokens: int = 16) -> dict:
    """Run :func:`child` in a fresh process (vLLM's state is per process) and return its record."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "HF_HUB_OFFLINE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT)}  # fmt: skip
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--mask", str(mask or ""),
           "--new-tokens", str(new_tokens)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    if run.returncode or not line:
        raise RuntimeError(f"engine failed ({mask or 'plain'}):\n{run.stderr[-4000:]}")
    return json.loads(line[-1][7:])


def full_layer_bytes(record: dict) -> int:
    """K+V bytes one token outside the window costs in the full-attention layers (fp32)."""
    if record["packed_row"] is not None:
        return 4 * record["packed_row"]
    full = sum(t == "full_attention" for t in LAYER_TYPES)
    return 4 * 2 * 1 * HEAD_DIM * full


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_hybrid.py", description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    p.add_argument("--out", type=Path, default=Path("/tmp/leank-hybrid"), help="where the tiny models are written")
    p.add_argument("--save", action="store_true", help="write the table to docs/results/vllm-hybrid.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--mask", default="", help=argparse.SUPPRESS)
    p.add_argument("--new-tokens", type=int, default=16, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    lines = [
        f"Tiny random models, {len(LAYER_TYPES)} layers alternating sliding-window ({WINDOW} tokens) and full "
        f"attention, 1 KV head of {HEAD_DIM}, fp32, VLLM_CPU_KVCACHE_SPACE={args.kv_gib} GiB, "
        f"max_model_len {MAX_MODEL_LEN}.",
        "",
        "| family | engine | KV cache size (tokens) | vs plain | blocks | KV cache groups (block size) "
        "| full-attention bytes/token |",
        "|---|---|---|---|---|---|---|",
    ]
    for family in args.families:
        model, mask = build(family, args.out / family)
        plain = engine(model, None, args.kv_gib)
        leank = engine(model, mask, args.kv_gib)
        for name, r in (("plain", plain), ("LeanK", leank)):
            groups = ", ".join(f"{g['spec']} ({g['block_size']})" for g in r["groups"])
            ratio = r["kv_cache_tokens"] / plain["kv_cache_tokens"]
            lines.append(f"| {family} | {name} | {r['kv_cache_tokens']:,} | {ratio:.2f}x | {r['num_blocks']:,} "
                         f"| {groups} | {full_layer_bytes(r)} |")  # fmt: skip
        print(f"{family}: plain {plain['kv_cache_tokens']:,} tokens, LeanK {leank['kv_cache_tokens']:,}", flush=True)
    print("\n" + "\n".join(lines))
    if args.save:
        import results

        print(f"saved {results.save('vllm-hybrid', chr(10).join(lines))}")


if __name__ == "__main__":
    main()
