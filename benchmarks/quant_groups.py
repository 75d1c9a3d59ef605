"""Choose kv_quant's group sizes: attention error vs bytes of a quantised LeanK middle, on the model's real K/V.

Prefills suite probes (dense, the queries of the last ``--queries`` positions recorded), then for every layer
the mask prunes and each recorded query, the LeanK decode attention (PyTorch path, fp32) over its own
prefix: sink, middle of kept channels, recent window. The middle is stored full precision (the reference)
and quantised by the cache's own store (:class:`leank_infer.decode.quant_middle.QuantMiddleStore`) at each
(bits, K tokens per group, V channels per group); the table gives the relative L2 error of the attention
output, mean over layers, queries and probes, next to the bytes of a middle token (scales included,
:func:`leank_infer.mask.kv_bytes.quantized_token_bytes`) and of a token at 8k (sink and recent full, bf16).

    python benchmarks/quant_groups.py hub/smollm2-135m-instruct-s3 --length 2048 --probes 4
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time

import torch

from leank_infer import LeanKModel
from leank_infer.decode.kv_quant import KVQuant
from leank_infer.decode.layout import ChannelGroups, DecodeLayout, DecodeMasks
from leank_infer.decode.quant_middle import QuantMiddleStore
from leank_infer.decode.torch_decode import torch_decode_attention
from leank_infer.mask.kv_bytes import quantized_token_bytes
from leank_train.evaluation.prefill import prefill
from leank_train.evaluation.tasks import build_probes, chat_ids


def layer_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, sink: int, recent: int,
                fmt: KVQuant | None, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(LeanK attention output of query ``q`` [1, Hq, 1, D] over K/V [1, Hkv, T, D] with a full or quantised
    middle, the same with the full-precision middle)."""
    groups = ChannelGroups.from_keep(keep)
    t = k.shape[2]
    m = t - recent
    kept = [k[:, h][:, :, sink:m].gather(-1, ch.view(1, len(h), 1, -1).expand(1, -1, m - sink, -1))
            for h, ch in zip(groups.heads, groups.channels, strict=True)]
    mid_v = v[:, groups.nonzero_order, sink:m]
    ref = DecodeLayout.from_parts(k[:, :, :sink], v[:, :, :sink], k[:, :, m:], v[:, :, m:], kept, mid_v, groups,
                                  sink_size=sink)
    out_ref = torch_decode_attention(q, ref, DecodeMasks(), scaling)
    if fmt is None:
        return out_ref, out_ref
    store = QuantMiddleStore(fmt, groups, 1, v.shape[-1], v.dtype, v.device, 16)
    store.write(kept, mid_v, 64)
    mk, mv, params = store.view()
    lay = dataclasses.replace(ref, mid_k=mk, mid_v=mv, quant=params)
    return torch_decode_attention(q, lay, DecodeMasks(), scaling), out_ref


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mask")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--probes", type=int, default=4)
    p.add_argument("--queries", type=int, default=8)
    p.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    p.add_argument("--k-groups", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--v-groups", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--threads", type=int, default=2)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    lm = LeanKModel.from_pretrained(args.mask)
    mask, cfg = lm.mask, lm.model.config
    tasks = ["niah_single_number", "niah_single_uuid", "niah_multikey", "passkey"]
    probes = build_probes(lm.tokenizer, tasks, [args.length], -(-args.probes // len(tasks)), seed=99)[: args.probes]
    hd = cfg.hidden_size // cfg.num_attention_heads
    scaling = hd**-0.5
    fmts: list[KVQuant] = [KVQuant(f"int{b}", b, kg, vg) for b in args.bits for kg in args.k_groups for vg in args.v_groups
                           if vg <= hd]
    err = {f: [] for f in fmts}
    for probe in probes:
        ids = torch.tensor([chat_ids(lm.tokenizer, probe.messages, probe.answer_prefix)])
        pre = prefill(lm.model, ids, torch.ones_like(ids), window=args.queries)
        for layer in range(mask.num_layers):
            if layer in mask.dense_layers:
                continue
            k, v, qs = pre.keys[layer], pre.values[layer], pre.queries[layer]
            t = k.shape[2]
            for w in range(args.queries):
                end = t - args.queries + w + 1  # query at position end - 1 sees keys [0, end)
                q = qs[:, :, w : w + 1]
                for f in fmts:
                    out, ref = layer_error(q, k[:, :, :end], v[:, :, :end], mask.keep[layer], mask.sink_size,
                                           mask.recent_size, f, scaling)
                    err[f].append(float((out - ref).norm() / ref.norm()))
    counts = mask.keep.sum(-1)[[i for i in range(mask.num_layers) if i not in mask.dense_layers]]
    dense_tok = 2 * mask.num_layers * mask.keep.shape[1] * hd * 2  # bf16
    lean_tok = int(counts.sum()) * 2 + int((counts > 0).sum()) * hd * 2
    full = mask.sink_size + mask.recent_size + mask.accumu_size // 2  # full tokens held, mean over the schedule
    n8k = 8192
    print(f"`{shlex.join(['python', 'benchmarks/quant_groups.py', *argv])}`\n")
    print(f"{args.probes} probes of {args.length} tokens x {args.queries} queries x {int((counts >= 0).all(-1).sum())} layers; "
          f"LeanK middle token (bf16): {lean_tok:,} B, dense {dense_tok:,} B\n")
    print("| bits | K group (tokens) | V group (channels) | rel. error of attention output (mean) | p95 | "
          "middle token bytes | bytes/token at 8k |")
    print("|---|---|---|---|---|---|---|")
    for f in fmts:
        e = torch.tensor(err[f])
        mid = quantized_token_bytes(counts, hd, f)
        at8k = (full * dense_tok + (n8k - full) * mid) / n8k
        print(f"| {f.bits} | {f.k_group} | {f.v_group} | {e.mean():.4f} | {e.quantile(0.95):.4f} | {mid:,.1f} | {at8k:,.0f} |")
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
