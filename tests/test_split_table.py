"""Every implementation of the LeanK rule splits the keys as :mod:`leank_infer.decode.rule` does, key for key.

The split (padding and future keys not attended, sink and recent keys with every channel, middle keys with the
kept channels only, a head keeping none skipping its middle) is computed by ``rule.py``; the kernels, the prefill
and the caches each apply it their own way. This table test recovers each implementation's split from its
outputs and compares it with ``rule.py``'s (:func:`~leank_infer.decode.rule.key_regions` with
:func:`~leank_infer.decode.rule.row_recent_from`, :func:`~leank_infer.decode.rule.training_recent_from` or the
decode schedule :func:`~leank_infer.decode.rule.recent_from`), over a grid of prompt lengths, query positions,
sink / recent / accumu sizes and left padding:

- key ``j``'s V is the one-hot ``e_j`` (``head_dim`` exceeds the number of keys), so a query's output *is* its
  attention weights;
- every key's K is ``log 8`` on a channel the mask drops and 0 on the one it keeps, the query 1 on the dropped
  channel: a key scored with every channel weighs 8 times a key scored with the kept channel only, and a key
  not attended weighs 0.

KV head 0 keeps one channel, KV head 1 none (its middle keys are not attended); two query heads per KV head.
Triton kernels run on triton's CPU interpreter (like ``tests/test_triton_decode.py``, the file reruns itself
in a fresh process when triton was imported before it could set ``TRITON_INTERPRET``).
"""

import math
import os
import sys

_TRITON_PREIMPORTED = "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers.masking_utils import sdpa_mask  # noqa: E402
from vllm_pages import random_pages  # noqa: E402

from leank_infer.decode import layer_handoff, quant_cpu, rule  # noqa: E402
from leank_infer.decode import triton_decode as td  # noqa: E402
from leank_infer.decode.attention import leank_attention_forward  # noqa: E402
from leank_infer.decode.cache import LeanKLayer  # noqa: E402
from leank_infer.decode.masked_attention import leank_attention  # noqa: E402
from leank_infer.decode.positional_prefill import positional_prefill_attention  # noqa: E402
from leank_infer.mask import ChannelMask  # noqa: E402
from leank_infer.vllm import cpu_decode, kernels, triton_paged  # noqa: E402
from leank_infer.vllm.paged_reference import request_kv, write_pages  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

HAS_TRITON = importlib.util.find_spec("triton") is not None
HKV, G, D = 2, 2, 64
HQ = HKV * G
LOG8 = math.log(8.0)
# (sink, recent, accumu): no sink, accumu 1, accumu > recent, sink > recent, ...
SIZES = [(0, 1, 1), (1, 3, 2), (2, 5, 3), (4, 2, 5), (3, 6, 4)]
KEEP = torch.zeros(HKV, D, dtype=torch.bool)
KEEP[0, 0] = True  # head 0 keeps channel 0 (where every K is 0), head 1 keeps none


def kv(n: int, first: int = 0, batch: int | None = None, dtype: torch.dtype = torch.float32):
    """K and one-hot V ``[n, Hkv, D]`` (``[B, Hkv, n, D]`` with ``batch``) of the keys at positions ``first + i``."""
    k = torch.zeros(n, HKV, D)
    k[..., 1] = LOG8
    v = torch.zeros(n, HKV, D)
    pos = torch.arange(first, first + n)
    v[torch.arange(n), :, pos] = 1.0
    if batch is not None:
        k = k.transpose(0, 1).unsqueeze(0).expand(batch, -1, -1, -1).contiguous()
        v = v.transpose(0, 1).unsqueeze(0).expand(batch, -1, -1, -1).contiguous()
    return k.to(dtype), v.to(dtype)


def queries(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    q = torch.zeros(*shape, D)
    q[..., 1] = 1.0
    return q.to(dtype)


def classes(weights: torch.Tensor) -> torch.Tensor:
    """Per key: 0 not attended, 1 middle (kept channels, weight max / 8), 2 every channel (weight max)."""
    w = weights.float()
    top = w.amax(-1, keepdim=True)
    return (w > top * 0.01).long() + (w > top / math.sqrt(8.0)).long()


def expected(n_keys: int, p: torch.Tensor, start: torch.Tensor, sink: int, recent_from: torch.Tensor) -> torch.Tensor:
    """``rule.py``'s classes ``[..., Hq, n_keys]`` of queries at ``p`` (rows starting at ``start``), whose full
    recent part begins at ``recent_from`` (all broadcast to ``[..., 1]``)."""
    j = torch.arange(n_keys)
    visible, middle = rule.key_regions(j, p, start, sink, recent_from)
    kept = visible.long() * 2 - middle.long()
    none = rule.attended(visible, middle, torch.tensor(True)).long() * 2
    return torch.stack([kept] * G + [none] * G, -2)


def compare(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Class tables equal, else the first differing entries, named."""
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: split differs from rule.py at {bad} (got {got[tuple(bad[0][:-1])].tolist()}, "
                             f"want {want[tuple(bad[0][:-1])].tolist()})")


# ---- full K/V: the training reference and the positional prefill ------------------------------------------


def padded_batch(lengths: list[int]):
    """q ``[B, Hq, T, D]``, K/V ``[B, Hkv, T, D]``, row starts and the 2-D padding mask of left-padded rows."""
    t = max(lengths)
    starts = torch.tensor([t - n for n in lengths])
    pad = torch.arange(t).view(1, -1) >= starts.view(-1, 1)
    k, v = kv(t, batch=len(lengths))
    return queries(len(lengths), HQ, t), k, v, starts, pad


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("positional", [False, True], ids=["training", "positional"])
def test_training_reference(sizes, positional):
    """``masked_attention.leank_attention`` (the student's attention and every reference): each query's recent part
    from ``training_recent_from`` (training) or ``row_recent_from`` (``accumu_size``), left padding included."""
    sink, recent, accumu = sizes
    q, k, v, starts, pad = padded_batch([23, 17, 4])
    t = q.shape[2]
    out = leank_attention(q, k, v, KEEP.float(), torch.arange(t), sink, recent, 1.0, key_start=starts,
                          key_padding_mask=pad, skip_zero_heads=True, accumu_size=accumu if positional else None)
    p, row = torch.arange(t).view(1, -1, 1), starts.view(-1, 1, 1)
    rf = rule.row_recent_from(p, row, recent, accumu) if positional else rule.training_recent_from(p, recent)
    real = pad  # queries at padding have no keys
    compare(classes(out[..., :t])[real], expected(t, p, row, sink, rf).expand(len(starts), -1, -1, -1)[real], "leank_attention")


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("path", ["sdpa", "scores"])
def test_positional_prefill(sizes, path):
    """``positional_prefill.positional_prefill_attention`` (HF ``rule="positional"`` prompts, vLLM prompt chunks):
    its band of whole keys per chunk of queries (chunks of 5 here) and the 2-D padding mask; ``scores``: the
    soft-capping path (a cap so large it changes nothing)."""
    sink, recent, accumu = sizes
    q, k, v, starts, pad = padded_batch([29, 22, 9])
    t = q.shape[2]
    softcap = 1e4 if path == "scores" else None
    for last in (t, 11):  # every query; the last 11 (a later chunk of a prompt)
        out = positional_prefill_attention(q[:, :, t - last :], k, v, KEEP, starts, sink, recent, accumu, 1.0,
                                           softcap, pad, q_chunk=5)
        p, row = torch.arange(t - last, t).view(1, -1, 1), starts.view(-1, 1, 1)
        want = expected(t, p, row, sink, rule.row_recent_from(p, row, recent, accumu))
        real = pad[:, t - last :]
        compare(classes(out[..., :t])[real], want.expand(len(starts), -1, -1, -1)[real], f"positional prefill, last {last}")


# ---- the HF cache: prefill, then decode steps, through the "leank" attention ---------------------------------


class _Attn(nn.Module):
    """The attributes transformers' SDPA path reads from an attention module."""

    is_causal = True
    num_key_value_groups = G


def hf_step(layer: LeanKLayer, q, k, v, pad: torch.Tensor, past: int) -> torch.Tensor:
    """One forward of ``q_len`` new tokens through the layer and the ``"leank"`` attention, as a model runs them
    (the mask transformers builds, ``position_ids`` as generate numbers them); ``[B, Q, Hq, D]``."""
    q_len = q.shape[2]
    mask = sdpa_mask(batch_size=q.shape[0], q_length=q_len, kv_length=past + q_len, q_offset=past, attention_mask=pad)
    real = pad.long()
    kwargs: dict = {"position_ids": (real.cumsum(-1) - 1).clamp_min(0)[:, -q_len:]}
    kk, vv = layer.update(k, v, kwargs=kwargs)
    layer_handoff.offer(kk, layer)  # as LeanKCache.update hands its layer to the attention call
    out, _ = leank_attention_forward(_Attn(), q, kk, vv, mask, scaling=1.0, **kwargs)
    return out


def hf_want(rule_name: str, sizes, p: torch.Tensor, starts: torch.Tensor, prompt: int) -> torch.Tensor:
    """rule.py's first full recent key for queries at padded positions ``p`` ``[1, Q, 1]`` of rows starting at
    ``starts`` ``[B, 1, 1]`` after a prompt of ``prompt`` padded tokens, under the cache's rule ``rule_name``:
    prompt queries attend densely (``recent_from`` below every key) except under the positional rule; generated ones
    follow the positional split, or under the dense-prefill rule the decode schedule anchored at the prompt's end."""
    sink, recent, accumu = sizes
    positional = rule.row_recent_from(p, starts, recent, accumu).expand(len(starts), -1, -1)
    if rule_name == getattr(rule, "POSITIONAL", None):
        return positional
    dense = torch.full_like(positional, -1)
    if rule_name == getattr(rule, "DENSE_PREFILL", None):
        sched = torch.tensor([rule.recent_from(prompt, int(x), recent, accumu) for x in p.flatten()])
        generated = sched.view(1, -1, 1).expand_as(positional)
    else:  # the dense-prompt rule: generated tokens by the positional split
        generated = positional
    return torch.where(p < prompt, dense, generated)


def hf_table(rule_name: str, sizes, lengths: list[int], total: int, kv_quant=None, dtype=torch.float32):
    """Prefill left-padded prompts of ``lengths`` tokens, then decode one token at a time up to ``total`` padded
    positions; yields (classes got, classes wanted) over the real queries of every forward."""
    sink, recent, accumu = sizes
    layer = LeanKLayer(KEEP, sink, recent, accumu, rule=rule_name, kv_quant=kv_quant)
    width = max(lengths)
    b = len(lengths)
    starts = torch.tensor([width - n for n in lengths])
    pad = torch.arange(width).view(1, -1) >= starts.view(-1, 1)
    past = 0
    for q_len in [width] + [1] * (total - width):
        if past:
            pad = torch.cat([pad, torch.ones(b, q_len, dtype=torch.bool)], 1)
        k, v = kv(q_len, first=past, batch=b, dtype=dtype)
        out = hf_step(layer, queries(b, HQ, q_len, dtype=dtype), k, v, pad, past)
        n = past + q_len
        p = torch.arange(past, n).view(1, -1, 1)
        row = starts.view(-1, 1, 1)
        want = expected(total, p, row, sink, hf_want(rule_name, sizes, p, row, width))
        real = pad[:, past:n]
        yield classes(out[..., :total])[real], want.expand(b, -1, -1, -1)[real]
        past = n


def _check_hf(rule_name, sizes, lengths, total, what, **kw):
    for step, (got, want) in enumerate(hf_table(rule_name, sizes, lengths, total, **kw)):
        compare(got, want, f"{what}, {rule_name}, forward {step}")


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("rule_name", rule.RULES)
@pytest.mark.parametrize("lengths", [[1], [9], [17, 11, 6]], ids=["prompt1", "prompt9", "left-padded"])
def test_hf_cache_torch_decode(sizes, rule_name, lengths):
    """The HF path on the CPU (``LeanKLayer`` + ``torch_decode``: its fused path without padding, its general one
    with): the cache's compression and the decode's masks, over 36 positions."""
    _check_hf(rule_name, sizes, lengths, 36, "HF torch decode")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "pytorch"])
@pytest.mark.parametrize("rule_name", rule.RULES)
def test_hf_kv_quant(monkeypatch, fmt, kernel, rule_name):
    """kv_quant's middle, read by the C++ kernel (``quant_cpu.cpp``) or its PyTorch fallback: the kernel must run."""
    calls = []
    if kernel:
        if not quant_cpu.available():
            pytest.skip("no C++ compiler: the kv_quant kernel cannot be built")
        real = quant_cpu.k_scores
        monkeypatch.setattr(quant_cpu, "k_scores", lambda *a: calls.append(1) or real(*a))
    else:
        monkeypatch.setattr(quant_cpu, "available", lambda: False)
    for sizes in SIZES[1:]:
        _check_hf(rule_name, sizes, [5], 40, f"kv_quant {fmt}", kv_quant=fmt)
    assert bool(calls) == kernel


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_hf_triton_decode(monkeypatch, dtype):
    """``triton_decode`` (``LEANK_BACKEND=triton``, interpreted), on the steps it covers (the rest go to torch)."""
    if _TRITON_PREIMPORTED:
        pytest.skip("triton was imported before TRITON_INTERPRET was set: test_whole_file_in_a_fresh_process runs it")
    monkeypatch.setenv("LEANK_BACKEND", "triton")
    calls = []
    real = td.triton_decode_attention
    monkeypatch.setattr(td, "triton_decode_attention", lambda *a: calls.append(1) or real(*a))
    for rule_name in rule.RULES:
        for sizes in SIZES[1:2] if dtype == torch.float32 else SIZES[3:4]:
            _check_hf(rule_name, sizes, [7, 4], 18, "HF triton decode", dtype=dtype)
    assert len(calls) >= 10, calls  # the kernel ran (steps it does not cover go to the PyTorch path)


# ---- vLLM's pages: the CPU kernel, the Triton kernel, the PyTorch reference -----------------------------------


VLLM_LENGTHS = list(range(1, 41))


def one_hot_pages(sizes, lengths: list[int], dtype=torch.float32, whole_window: bool = False):
    """Pages (tests/vllm_pages.py) of one layer for requests of ``lengths`` tokens, rewritten with the one-hot
    K/V through the reference write (the window pages hold only what the engine keeps there: NaN elsewhere)."""
    sink, recent, accumu = sizes
    mask = ChannelMask(KEEP.unsqueeze(0), sink_size=sink, recent_size=recent, accumu_size=accumu)
    pages = random_pages(mask, lengths, block_size=4, dtype=dtype, whole_window=whole_window)
    bs, wbs = pages.packed.shape[1], pages.window.shape[1]  # the window pages' blocks hold their own token count
    for b, n in enumerate(lengths):
        k, v = kv(n, dtype=dtype)
        pos = torch.arange(n)
        packed_slots = pages.packed_table[b, pos // bs].long() * bs + pos % bs
        window_slots = pages.window_table[b, pos // wbs].long() * wbs + pos % wbs  # the null block: below wbs, skipped
        write_pages(pages.packed, packed_slots, pages.window, window_slots, k, v, pages.slot)
        pages.keys[b], pages.values[b] = k, v
    pages.q = queries(len(lengths), HQ, dtype=dtype)
    return pages


def vllm_want(sizes, lengths: list[int], n_keys: int) -> torch.Tensor:
    """rule.py's classes of each request's query at ``length - 1`` (positional split, no padding)."""
    sink, recent, accumu = sizes
    p = torch.tensor(lengths).view(-1, 1) - 1
    return expected(n_keys, p, torch.zeros(()), sink, rule.positional_recent_from(p, recent, accumu))


def _decode_args(pages):
    return (pages.q, pages.packed, pages.packed_table, pages.window, pages.window_table, pages.seq_lens,
            pages.plan, pages.slot, 1.0)


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("impl", ["cpu_kernel", "pytorch"])
def test_vllm_decode(sizes, impl):
    """vLLM's CPU decode: ``cpu_decode.cpp`` (through ``cpu_decode.decode``) and the PyTorch fallback
    (``kernels.torch_decode``: ``paged_reference.request_kv`` + ``reference_attention``); one query per request of
    every length from 1 to 40 in one batch."""
    if impl == "cpu_kernel" and not cpu_decode.available():
        pytest.skip("no C++ compiler: the vLLM CPU kernel cannot be built")
    pages = one_hot_pages(sizes, VLLM_LENGTHS)
    run = cpu_decode.decode if impl == "cpu_kernel" else kernels.torch_decode
    out = run(*_decode_args(pages))
    n = max(VLLM_LENGTHS)
    compare(classes(out[..., :n]), vllm_want(sizes, VLLM_LENGTHS, n), f"vLLM {impl}")


@pytest.mark.parametrize("sizes", SIZES)
def test_vllm_prefill_chunk(sizes):
    """vLLM's prompt chunk under the positional rule: ``request_kv``'s gather (the sink and the chunk's window from
    the window pages, the middle from the packed ones) then ``kernels.prefill``, chunks starting anywhere."""
    sink, recent, accumu = sizes
    n = 38
    pages = one_hot_pages(sizes, [n], whole_window=True)
    k_all, v_all = kv(n)
    for first in (0, 1, 7, 20, 31):
        k, v = request_kv(pages.plan, pages.slot, pages.packed, pages.packed_table[0], pages.window,
                          pages.window_table[0], n, first, k_all[first:], v_all[first:], torch.float32)
        out = kernels.prefill(pages.plan, pages.slot, queries(n - first, HQ), k, v, first, 1.0)
        p = torch.arange(first, n).view(-1, 1)
        want = expected(n, p, torch.zeros(()), sink, rule.positional_recent_from(p, recent, accumu))
        compare(classes(out[..., :n]), want, f"vLLM prefill chunk from {first}")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_vllm_triton_paged(monkeypatch, dtype):
    """``triton_paged`` (interpreted; ``kernels.decode`` routes CPU tensors to it with ``LEANK_TRITON_ON_CPU=1``),
    one batch per size, and one request alone (several splits of its positions, then the merge)."""
    if _TRITON_PREIMPORTED:
        pytest.skip("triton was imported before TRITON_INTERPRET was set: test_whole_file_in_a_fresh_process runs it")
    monkeypatch.setenv(triton_paged.ENV_CPU, "1")
    lengths = [1, 2, 3, 5, 8, 9, 12, 15, 20, 26, 33, 40]
    for sizes in SIZES:
        for batch in (lengths, [37]):
            pages = one_hot_pages(sizes, batch, dtype=dtype)
            assert triton_paged.handles(pages.q)
            out = kernels.decode(*_decode_args(pages))
            n = max(batch)
            compare(classes(out[..., :n]), vllm_want(sizes, batch, n), f"vLLM triton {dtype}, lengths {batch}")


def test_whole_file_in_a_fresh_process():
    """In a full test run transformers imports triton before this file can set TRITON_INTERPRET: the Triton
    cases then run here, in a process of their own."""
    import subprocess

    if not _TRITON_PREIMPORTED or not HAS_TRITON:
        pytest.skip("this process runs the Triton cases itself")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "triton"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
