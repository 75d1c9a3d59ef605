"""The Triton decode kernel against the PyTorch reference, on triton's CPU interpreter.

fp16 and fp32 only: under TRITON_INTERPRET=1, tl.dot of bf16 operands is wrong (docs/architecture.md,
"Known pitfalls"); bf16 is checked on a GPU by benchmarks/kernel.py. Shapes are tiny: the
interpreter runs every program in numpy.
"""

import os
import sys

# triton.language builds its own jit helpers (tl.max, ...) at import, so the interpreter needs the
# variable set before triton is first imported. leank_infer imports it only at the first launch,
# but transformers' attention registry pulls it in through torch: in a full test run that has
# happened already, and test_whole_file_in_a_fresh_process reruns this file in its own process.
_TRITON_PREIMPORTED = "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from leank_infer.decode import backend as bk  # noqa: E402
from leank_infer.decode import triton_decode as td  # noqa: E402
from leank_infer.decode.layout import ChannelGroups, DecodeLayout, DecodeMasks  # noqa: E402
from leank_infer.decode.torch_decode import torch_decode_attention  # noqa: E402


def _keep(counts: list[int], d: int, gen: torch.Generator) -> torch.Tensor:
    keep = torch.zeros(len(counts), d, dtype=torch.bool)
    for h, c in enumerate(counts):
        keep[h, torch.randperm(d, generator=gen)[:c]] = True
    return keep


def make_case(
    counts: list[int],
    g: int = 2,
    d: int = 64,
    head: int = 5,
    mid: int = 7,
    tail: int = 9,
    starts: tuple[int, ...] = (0,),
    sink: int = 2,
    dtype: torch.dtype = torch.float16,
    masked: bool = False,
    seed: int = 0,
) -> tuple:
    """Random decode inputs ``(query, layout, masks, scaling)``; head keys j of a row with start s:
    padding below s, sink up to s + sink, middle (kept channels) after; optional random mid/tail masks."""
    gen = torch.Generator().manual_seed(seed)
    b, hkv = len(starts), len(counts)
    groups = ChannelGroups.from_keep(_keep(counts, d, gen))

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    query = rnd(b, hkv * g, 1, d)
    mid_k = [rnd(b, len(h), mid, c) for h, c in zip(groups.heads, groups.counts, strict=True)]
    mid_v = rnd(b, len(groups.nonzero_order), mid, d)
    j = torch.arange(head)
    s = torch.tensor(starts).view(-1, 1)
    head_full = ((j >= s) & (j < s + sink)).unsqueeze(1)
    head_mid = (j >= s + sink).unsqueeze(1)
    mid_mask = tail_mask = None
    if masked:
        mid_mask = torch.rand(b, 1, mid, generator=gen) > 0.3
        tail_mask = torch.rand(b, 1, tail, generator=gen) > 0.3
    hk, hv, tk, tv = rnd(b, hkv, head, d), rnd(b, hkv, head, d), rnd(b, hkv, tail, d), rnd(b, hkv, tail, d)
    layout = DecodeLayout.from_parts(hk, hv, tk, tv, mid_k, mid_v, groups, torch.tensor(starts), sink)
    return query, layout, DecodeMasks(head_full, head_mid, mid_mask, tail_mask), d**-0.5


def _fp32(case: tuple) -> tuple:
    """The same decode case in fp32 (the reference's precision)."""
    q, layout, *rest = case
    return (q.float(), layout.float(), *rest)


def test_whole_file_in_a_fresh_process():
    """In a full test run, transformers imports triton before this file can set TRITON_INTERPRET;
    the interpreter then cannot run kernels here, so this file runs again in its own process."""
    import subprocess

    if not _TRITON_PREIMPORTED:
        pytest.skip("this process already runs the kernels on the interpreter")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


@pytest.fixture(autouse=True)
def poisoned_workspace(monkeypatch, request):
    """Partials start as NaN: a slot the merge reads but no program wrote shows up in the output."""
    if _TRITON_PREIMPORTED and request.node.name != "test_whole_file_in_a_fresh_process":
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1: covered by test_whole_file_in_a_fresh_process"
        )
    monkeypatch.setattr(
        td,
        "_workspace",
        lambda shape, device: torch.full(shape, math.nan, dtype=torch.float32, device=device),
    )


def run_and_check(args: tuple, rel: float | None = None, **kw) -> torch.Tensor:
    """Kernel (into a NaN-filled output) vs the reference evaluated in fp32 on the same values.

    fp32 reference, because the fp16 reference rounds scores to fp16 before the softmax, which is
    itself ~4e-4 off; the kernel keeps fp32 scores.
    """
    q = args[0]
    b, hq, _, d = q.shape
    out = torch.full((b, 1, hq, d), math.nan, dtype=q.dtype)
    got = td.triton_decode_attention(*args, out=out, **kw)
    assert got.data_ptr() == out.data_ptr() and got.shape == (b, 1, hq, d)
    ref = torch_decode_attention(*_fp32(args))
    assert torch.isfinite(got).all()
    rel = rel if rel is not None else (1e-3 if q.dtype == torch.float16 else 1e-5)
    err = (got.float() - ref).norm() / ref.norm().clamp_min(1e-6)
    assert err < rel, f"relative error {err:.2e}"
    assert (got.float() - ref).abs().max() < 10 * rel * ref.abs().max().clamp_min(1e-6)
    return got


@pytest.mark.parametrize(
    "counts",
    [[0, 0, 0], [64, 64, 64], [16, 32, 48], [0, 48, 16], [32, 0, 32]],
    ids=["all-zero", "all-full", "16-32-48", "mixed-with-zero", "shared-group"],
)
@pytest.mark.parametrize("mid", [0, 1, 7, 33])
def test_kept_count_mixes_and_lengths(counts, mid):
    run_and_check(make_case(counts, mid=mid, seed=mid))


@pytest.mark.parametrize("splits", [None, 1, 2, 3, 16, 40])
def test_split_counts(splits):
    # block_n 16: a 5-key head (padded to 16), 9 tail keys and 41 middle keys span several tiles;
    # 600 middle keys at 16 a tile give 38 middle splits + 2 full: more than one merge step (32)
    mid = 600 if splits == 40 else 41
    run_and_check(make_case([16, 0, 32, 48], head=5, mid=mid, tail=9), splits=splits, block_n=16)


@pytest.mark.parametrize("g", [1, 2, 4])
def test_gqa(g):
    run_and_check(make_case([0, 16, 32], g=g, mid=20), block_n=16)


@pytest.mark.parametrize("masked", [False, True])
def test_batch_rows_with_different_starts(masked):
    # row 1 is left-padded by 3: head keys 0..2 are padding, 3..4 sink, 5..7 its middle keys
    args = make_case([16, 0, 48], head=8, mid=19, starts=(0, 3), masked=masked, seed=3)
    run_and_check(args, splits=2, block_n=16)


def test_fp32_is_tight():
    run_and_check(make_case([16, 0, 64, 48], dtype=torch.float32, mid=21, masked=True), splits=2, block_n=16)


def test_empty_head_and_tail():
    run_and_check(make_case([16, 32], head=0, tail=0, mid=12))
    run_and_check(make_case([16, 32], head=0, tail=3, mid=0))


def test_fully_masked_row_gives_zeros():
    q, layout, masks, scale = make_case([16, 0], starts=(0, 1), mid=9, tail=4, masked=True)
    fields = {k: getattr(masks, k).clone() for k in ("head_full", "head_mid", "mid", "tail")}
    for m in fields.values():  # row 1 attends to nothing
        m[1] = False
    got = run_and_check((q, layout, DecodeMasks(**fields), scale), block_n=16)
    assert (got[1] == 0).all()


def test_broadcast_masks_and_strided_query():
    q, layout, masks, scale = make_case([32, 16], starts=(0, 0), mid=10, tail=6, seed=5)
    gen = torch.Generator().manual_seed(1)
    # batch-broadcast masks, as the model's mask gives
    masks = dataclasses.replace(masks, mid=torch.rand(1, 1, 10, generator=gen) > 0.2, tail=torch.rand(1, 1, 6, generator=gen) > 0.2)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # HF's [B, Q, Hq, D] -> [B, Hq, Q, D] view
    run_and_check((q, layout, masks, scale))


def test_trivial_masks():
    """No masks at all (one query, no padding: the common decode step; the torch fast path's case)."""
    q, layout, _, scale = make_case([16, 0, 48], mid=21, tail=7, seed=6, dtype=torch.float32)
    run_and_check((q, layout, DecodeMasks(), scale), splits=2, block_n=16)


def test_real_cache_layer_layout():
    """The views of a LeanKLayer (preallocated storage, partly used) after a left-padded prefill and a
    few steps, with its masks, as the model passes them."""
    from leank_infer.decode.cache import LeanKLayer

    gen = torch.Generator().manual_seed(7)
    b, hkv, g, d, total = 2, 3, 2, 32, 60
    layer = LeanKLayer(_keep([0, 16, 32], d, gen), sink_size=4, recent_size=8, accumu_size=4)
    k = torch.randn(b, hkv, total, d, generator=gen).half()
    v = torch.randn(b, hkv, total, d, generator=gen).half()
    # row 1 left-padded by 8, a multiple of accumu_size: the rows' recent parts start together (other amounts:
    # test_left_padded_dense_prompt_decode_stays_on_the_kernel)
    pos = torch.arange(total).expand(b, total) - torch.tensor([[0], [8]])
    layer.update(k, v, kwargs={"position_ids": pos.clamp_min(0)})
    assert layer.starts.tolist() == [0, 8]
    for _ in range(6):
        layer.update(torch.randn(b, hkv, 1, d, generator=gen).half(), torch.randn(b, hkv, 1, d, generator=gen).half())
    assert layer.mid_k[0].stride(1) != layer.mid_len * layer.mid_k[0].shape[-1]  # spare capacity: not compact
    for mk in layer.mid_k:  # the kernel reads channel-major K up to the capacity: spare slots must not leak in
        cap = mk.stride(1) // mk.shape[-1]
        assert cap % 16 == 0 and cap > layer.mid_len
        torch.as_strided(mk, (*mk.shape[:2], cap, mk.shape[-1]), mk.stride())[:, :, layer.mid_len :] = float("nan")
    q = torch.randn(b, hkv * g, 1, d, generator=gen).half()
    run_and_check((q, layer.layout(), layer.decode_masks(None, 1), d**-0.5), block_n=16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-k8"])
@pytest.mark.parametrize("padded", [False, True])
def test_quantised_middle_in_the_kernel(dtype, fmt, padded):
    """kv_quant: the kernel reads the int8/int4 codes of a real cache layer (odd kept counts: a half-used int4
    byte; a K group phase; with ``int4-k8`` an open group) and scales them per group, as the PyTorch path over
    the dequantised middle does; spare slots past the last token are poisoned and must not leak in."""
    from leank_infer.decode.cache import LeanKLayer
    from leank_infer.decode.kv_quant import KVQuant

    gen = torch.Generator().manual_seed(11)
    quant = {"int8": KVQuant("int8", 8, 16, 16), "int4": KVQuant("int4", 4, 16, 8),
             "int4-k8": KVQuant("int4", 4, 8, 32)}[fmt]
    b, hkv, g, d, total = 2, 3, 2, 32, 70
    # sink 3: a first middle write of 4m - 3 tokens, so a K group phase whatever the group
    layer = LeanKLayer(_keep([0, 17, 6], d, gen), sink_size=3, recent_size=8, accumu_size=4, kv_quant=quant)
    k = torch.randn(b, hkv, total, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, total, d, generator=gen).to(dtype)
    shift = 8 if padded else 0  # a multiple of accumu_size (see test_real_cache_layer_layout)
    pos = torch.arange(total).expand(b, total) - torch.tensor([[0], [shift]])
    layer.update(k, v, kwargs={"position_ids": pos.clamp_min(0)})
    for _ in range(6):  # the last roll leaves a K group of 8 half-filled (int4-k8: an open group)
        layer.update(torch.randn(b, hkv, 1, d, generator=gen).to(dtype), torch.randn(b, hkv, 1, d, generator=gen).to(dtype))
    st = layer._quant
    assert st.phase > 0 and layer.layout().quant is not None
    if fmt == "int4-k8":
        assert st.open_tokens() > 0
    q = torch.randn(b, hkv * g, 1, d, generator=gen).to(dtype)
    layout = layer.layout()  # checked here (spare parameters too); then the spare slots are poisoned: the kernel
    masks = layer.decode_masks(None, 1)  # must not read them (the masks first: building them checks the cache)
    st.v_params[:, :, st.n :] = float("nan")
    for kp in (*st.k_scale, *st.k_min):
        kp[..., st.k_groups() :] = float("nan")
    st.v_codes[:, :, st.n :] = 255
    for c in st.k_codes:
        c[..., st.phase + st.n :] = 255
    run_and_check((q, layout, masks, d**-0.5), block_n=16, splits=2)  # reference: torch over layout.float()
    assert td.unsupported(q, layout, masks) is None  # the dispatcher sends a quantised middle to the kernel


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_softcap_in_the_kernel(monkeypatch, dtype):
    """Gemma 2's logit soft-capping runs in the kernel (workspaces allocated = kernel launched), on
    logits large enough (scale 0.5 on d=64: |logit| ~ 4-30) that capping at 5 changes the output."""
    launched = []
    poisoned = td._workspace
    monkeypatch.setattr(td, "_workspace", lambda shape, device: launched.append(shape) or poisoned(shape, device))
    args = make_case([16, 0, 48], head=8, mid=37, tail=11, starts=(0, 2), masked=True, dtype=dtype, seed=11)
    args = (*args[:-1], 0.5)
    got = run_and_check((*args, 5.0), rel=1e-3 if dtype == torch.float16 else 1e-5, splits=3, block_n=16)
    assert launched, "the soft-capped call fell back to the PyTorch path"
    uncapped = torch_decode_attention(*_fp32(args))
    assert (got.float() - uncapped).norm() / uncapped.norm() > 0.05  # the cap mattered


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_model_decodes_through_the_kernel(monkeypatch, family):
    """A tiny model's LeanK decode steps with LEANK_BACKEND=triton (kernel, interpreted) equal the
    PyTorch backend's: the cache's tensors and masks and Gemma 2's softcap reach the kernel as the model
    passes them (Gemma 2: a sliding dense layer beside a pruned global one)."""
    from conftest import tiny_model

    from leank_infer import ChannelMask, LeanKModel
    from leank_infer.mask import dense_layers_of, model_shape

    model = tiny_model(family)
    scores = torch.rand(*model_shape(model.config), generator=torch.Generator().manual_seed(4))
    scores[-1, 0] *= 0.05  # the last layer is global in both families: its head 0 keeps nothing
    dense = dense_layers_of(model.config)
    mask = ChannelMask.from_scores(scores, 0.5, 4, sink_size=4, recent_size=8, dense_layers=dense)
    lk = LeanKModel(model, mask)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(5))
    ids[1, :3] = 0  # row 1 left-padded
    attn = (ids != 0).long()

    @torch.no_grad()
    def steps(backend: str) -> list[torch.Tensor]:
        monkeypatch.setenv("LEANK_BACKEND", backend)
        cache, x, a = lk.new_cache(), ids, attn
        pos = (a.cumsum(-1) - 1).clamp_min(0)  # as generate() numbers left-padded rows
        out = [lk(x, attention_mask=a, position_ids=pos, cache=cache).logits[:, -1]]
        for _ in range(4):
            x = out[-1].argmax(-1, keepdim=True)
            a = torch.cat([a, torch.ones_like(x)], 1)
            out.append(lk(x, attention_mask=a, position_ids=a.sum(-1, keepdim=True) - 1, cache=cache).logits[:, -1])
        return out

    launched = []
    poisoned = td._workspace
    monkeypatch.setattr(td, "_workspace", lambda shape, device: launched.append(shape) or poisoned(shape, device))
    want = steps("torch")
    assert not launched
    got = steps("triton")
    assert len(launched) == 3 * 4 * (model.config.num_hidden_layers - len(dense))  # acc, m, l per layer and step
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_q_len_above_one_falls_back_to_torch():
    q, layout, masks, scale = make_case([16, 32], mid=5)
    q = torch.randn(1, 4, 3, 64).half()
    q3 = lambda m: m.expand(1, 3, m.shape[-1])  # noqa: E731
    masks = DecodeMasks(q3(masks.head_full), q3(masks.head_mid))
    with pytest.raises(ValueError, match="q_len > 1"):
        td.triton_decode_attention(q, layout, masks, scale)
    got = bk.decode_attention(q, layout, masks, scale, backend="triton")
    torch.testing.assert_close(got, torch_decode_attention(q, layout, masks, scale))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tail_masked", [False, True])
def test_tail_keys_with_kept_channels_in_the_kernel(dtype, tail_masked):
    """The positional rule with left padding scores a row's oldest tail keys with the kept channels
    (``DecodeMasks.tail_mid``, its own pattern per row); a zero-channel head attends none of them. The tail spans
    several tiles and splits, and a row's kept-channel keys reach into the second tile."""
    q, layout, masks, scale = make_case([16, 0, 48], head=6, mid=11, tail=40, starts=(0, 3, 5), dtype=dtype, seed=9)
    j = torch.arange(layout.tail_len).view(1, 1, -1)
    tail_mid = j < torch.tensor([0, 3, 21]).view(-1, 1, 1)  # row 0: none, row 2 past the first 16-key tile
    tail = ~tail_mid
    if tail_masked:  # the model's own mask on top (both regions)
        seen = torch.rand(3, 1, layout.tail_len, generator=torch.Generator().manual_seed(2)) > 0.2
        tail_mid, tail = tail_mid & seen, tail & seen
    masks = dataclasses.replace(masks, tail=tail, tail_mid=tail_mid)
    assert td.unsupported(q, layout, masks) is None
    got = run_and_check((q, layout, masks, scale), splits=3, block_n=16)
    # the kept channels matter: scoring those keys with every channel gives another answer
    full = dataclasses.replace(masks, tail=tail | tail_mid, tail_mid=None)
    assert not torch.allclose(got, torch_decode_attention(q, layout, full, scale), atol=1e-2)


@pytest.mark.parametrize("pad", [5, 6])
def test_left_padded_dense_prompt_decode_stays_on_the_kernel(monkeypatch, pad):
    """A LeanKLayer under the default rule (dense-prompt), row 1 left-padded by an amount that is not a multiple
    of accumu_size: the rows reach a key's middle at different steps, so steps carry ``tail_mid``. The dispatcher
    runs the kernel on them (not the PyTorch fallback), and it equals the PyTorch path."""
    from leank_infer.decode.cache import LeanKLayer

    gen = torch.Generator().manual_seed(11)
    b, hkv, g, d, prompt = 2, 3, 2, 32, 24
    layer = LeanKLayer(_keep([0, 16, 32], d, gen), sink_size=4, recent_size=8, accumu_size=4)
    kv = lambda n: torch.randn(b, hkv, n, d, generator=gen).half()  # noqa: E731
    pos = torch.arange(prompt).expand(b, prompt) - torch.tensor([[0], [pad]])
    layer.update(kv(prompt), kv(prompt), kwargs={"position_ids": pos.clamp_min(0)})
    assert layer.starts.tolist() == [0, pad]
    calls = []
    real = td.triton_decode_attention
    monkeypatch.setattr(td, "triton_decode_attention", lambda *a: calls.append(1) or real(*a))
    with_tail_mid = 0
    for _ in range(12):
        layer.update(kv(1), kv(1))
        q = torch.randn(b, hkv * g, 1, d, generator=gen).half()
        layout, masks = layer.layout(), layer.decode_masks(None, 1)
        before = len(calls)
        got = bk.decode_attention(q, layout, masks, d**-0.5, backend="triton")
        assert len(calls) == before + 1  # the kernel, not the fallback
        if masks.tail_mid is not None:
            with_tail_mid += 1
            assert (masks.tail_mid[0] != masks.tail_mid[1]).any()  # the rows' own patterns
        want = torch_decode_attention(*_fp32((q, layout, masks, d**-0.5)))
        torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)
    assert with_tail_mid >= 4, with_tail_mid


# ---- dispatcher --------------------------------------------------------------------------------
def test_auto_picks_triton_for_cuda_tensors_when_triton_is_there():
    """The choice itself, device and availability faked at the dispatcher's seam."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert bk.choose_backend("auto", cuda, triton_available=True) == "triton"
    assert bk.choose_backend(None, "cuda", triton_available=True) == "triton"
    assert bk.choose_backend("auto", cuda, triton_available=False) == "torch"
    assert bk.choose_backend("auto", cpu, triton_available=True) == "torch"
    assert bk.choose_backend("torch", cuda, triton_available=True) == "torch"
    assert bk.choose_backend("triton", cpu, triton_available=False) == "triton"  # asked for: the call then says why not


def test_dispatcher_runs_what_it_chose(monkeypatch):
    """decode_attention routes by choose_backend (faked to "triton" for CPU tensors here)."""
    calls = []
    monkeypatch.setattr(bk, "choose_backend", lambda backend, device, available: "triton")
    monkeypatch.setattr(td, "triton_decode_attention", lambda *a, **k: calls.append("triton"))
    bk.decode_attention(*make_case([16], mid=3))
    assert calls == ["triton"]


def test_auto_picks_torch_on_cpu(monkeypatch):
    monkeypatch.delenv("LEANK_BACKEND", raising=False)
    calls = []
    monkeypatch.setattr(td, "triton_decode_attention", lambda *a, **k: calls.append(1))
    args = make_case([16], mid=3)
    torch.testing.assert_close(bk.decode_attention(*args), torch_decode_attention(*args))
    assert not calls


def test_backend_triton_runs_kernel_in_interpreter():
    args = make_case([16, 0], mid=3)
    torch.testing.assert_close(
        bk.decode_attention(*args, backend="triton"),
        torch_decode_attention(*_fp32(args)).half(),
        atol=2e-3,
        rtol=0,
    )


def test_leank_backend_env_is_honoured(monkeypatch):
    calls = []
    monkeypatch.setattr(td, "triton_decode_attention", lambda *a, **k: calls.append("triton"))
    args = make_case([16], mid=3)
    monkeypatch.setenv("LEANK_BACKEND", "triton")
    bk.decode_attention(*args)
    assert calls == ["triton"]
    monkeypatch.setenv("LEANK_BACKEND", "torch")
    bk.decode_attention(*args)
    assert calls == ["triton"]
    bk.decode_attention(*args, backend="triton")  # the argument beats the variable
    assert calls == ["triton", "triton"]
    monkeypatch.setenv("LEANK_BACKEND", "cuda-please")
    with pytest.raises(ValueError, match="LEANK_BACKEND"):
        bk.decode_attention(*args)
    with pytest.raises(ValueError, match="backend"):
        bk.decode_attention(*args, backend="tpu")


def test_triton_backend_without_cuda_or_interpreter_raises(monkeypatch):
    monkeypatch.setattr(td, "kernels_interpreted", lambda: False)
    args = make_case([16], mid=3)
    with pytest.raises(RuntimeError, match="CUDA"):
        bk.decode_attention(*args, backend="triton")
    with pytest.raises(RuntimeError, match="CUDA"):
        td.triton_decode_attention(*args)
    monkeypatch.setattr(td, "HAS_TRITON", False)
    with pytest.raises(RuntimeError, match="needs triton"):
        bk.decode_attention(*args, backend="triton")
    torch.testing.assert_close(bk.decode_attention(*args), torch_decode_attention(*args))  # auto -> torch


def test_import_does_not_import_triton():
    import subprocess

    code = "import sys, leank_infer.decode.triton_decode as td; assert td.HAS_TRITON and 'triton' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_module_imports_without_triton():
    import subprocess

    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import leank_infer.decode.triton_decode as td; assert not td.HAS_TRITON and not td.kernels_interpreted()"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr


def test_num_splits_heuristic(monkeypatch):
    cpu = torch.device("cpu")
    assert td.num_splits(0, 8, cpu) == 0
    assert td.num_splits(1, 8, cpu) == 1
    assert td.num_splits(64 * 1000, 1, cpu) == 4 * 4  # WAVES x the interpreter's 4 "SMs"
    assert td.num_splits(64 * 8, 1, cpu) == 2  # no split below MIN_BLOCKS_PER_SPLIT tiles
    assert td.num_splits(64 * 1000, 10_000, cpu) == 1
    monkeypatch.setattr(td, "_sm_count", lambda device: 1000)
    assert td.num_splits(64 * 100_000, 1, cpu) == td.MAX_SPLITS
    per, n = td._split_len(100, 3, 16)  # 7 tiles over 3 splits: 3 + 3 + 1
    assert (per, n) == (48, 3)
    assert td._split_len(20, 5, 16) == (16, 2)  # more splits than tiles: none left empty


# ---- the benchmark's CPU-side logic ------------------------------------------------------------
def _bench():
    from conftest import load_benchmark

    return load_benchmark("kernel")


def test_benchmark_byte_floor_and_configs():
    bench = _bench()
    cfg = bench.LayerConfig(batch=2, seq_len=8192)
    keep = torch.zeros(8, 128, dtype=torch.bool)
    keep[:4, :32] = True  # 4 heads keep 32 channels, 4 keep none
    parts = cfg.parts()
    assert parts == {"head": 128, "middle": 8192 - 128 - 768, "tail": 768}
    dense = bench.dense_bytes(cfg, 2)
    assert dense == 2 * 2 * 8 * 128 * 8192 * 2
    leank = bench.leank_bytes(cfg, keep, 2)
    full_tokens = 128 + 768
    mid = 8192 - full_tokens
    assert leank == 2 * 2 * (2 * 8 * 128 * full_tokens + mid * (4 * 32 + 4 * 128))
    assert bench.fits(cfg, keep, 2, free_bytes=10 * dense) and not bench.fits(
        cfg, keep, 2, free_bytes=dense // 2
    )
    grid = bench.configs([1, 16], [8192, 32768])
    assert [(c.batch, c.seq_len) for c in grid] == [(1, 8192), (1, 32768), (16, 8192), (16, 32768)]


def test_benchmark_fails_cleanly_without_cuda():
    import subprocess

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel.py"
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr


def test_benchmark_correctness_check_runs_on_the_interpreter():
    """The benchmark's GPU correctness check, shrunk to interpreter size (fp16: bf16 dots are wrong there)."""
    bench = _bench()
    cfg = bench.LayerConfig(batch=2, seq_len=300, q_heads=8, kv_heads=4, head_dim=64, sink=16, recent=64)
    keep = bench.make_mask(cfg)
    lines = bench.check_correctness(keep, cfg, device="cpu", dtypes=("fp16",))
    assert len(lines) == 1 and lines[0].endswith("ok")


def test_compiled_kernels_stream_memory_in_full_vectors():
    """The kernels compiled for sm_90 (H100/H200) as a launch at the benchmark's shapes specialises them
    (benchmarks/kernel_asm.py, no GPU needed): the interpreter checks values, this checks what decides
    bandwidth and what only the compiled path can get wrong (bf16 dots, lowering, ptxas). K/V tiles move
    as 16-byte async copies in a software pipeline, shared memory fits a Hopper block, nothing spills."""
    import json
    import subprocess

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_asm.py"
    cmd = [sys.executable, str(script), "--dtype", "fp16", "bf16", "--softcap", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(rows) == sorted(f"{dt}{cap}/{k}" for dt in ("fp16", "bf16") for cap in ("", "-softcap")
                                  for k in ("partials", "merge"))  # fmt: skip
    for name, row in rows.items():
        assert row["spill_bytes"] == 0 and 0 < row["registers"] <= 255, (name, row)
        if name.endswith("/partials"):
            copies = row["async_copies_by_bytes"]
            assert set(copies) == {"16"} and copies["16"] >= 32, (name, copies)  # every K/V tile copy is 16 B
            assert row["groups_in_flight"] >= 1 and row["shared_bytes"] <= 227 * 1024, (name, row)
            narrow = sum(n for k, n in row["global_loads"].items() if k in ("v1.b16", "v2.b16"))
            assert narrow <= 16, (name, row["global_loads"])  # only q's gathered channels load 2 bytes at a time
