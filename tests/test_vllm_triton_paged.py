"""The vLLM plugin's Triton kernels (decode and page write) against the PyTorch reference, on triton's CPU
interpreter (fp16, fp32, fp8 pages; bf16 dots are wrong in the interpreter: the GPU check covers bf16).

Like tests/test_triton_decode.py: the interpreter needs TRITON_INTERPRET=1 before triton is first
imported; in a full run something imported it already, so the file reruns itself in a fresh process.
``$LEANK_TRITON_ON_CPU=1`` sends CPU tensors through :mod:`leank_infer.vllm.kernels` to the kernels.
The pages hold NaN wherever the rule forbids reading (tests/vllm_pages.py), so a stray read fails.
"""

import os
import sys

_TRITON_PREIMPORTED = "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from vllm_pages import FP8, random_mask, random_pages, reference  # noqa: E402

from leank_infer import ChannelMask  # noqa: E402
from leank_infer.vllm import kernels, triton_paged  # noqa: E402
from leank_infer.vllm.paged_reference import write_pages  # noqa: E402
from leank_infer.vllm.pool import WorkerPlan  # noqa: E402

LLAMA = os.path.join(os.path.dirname(__file__), "..", "hub", "llama-3.1-8b-instruct")
# p < sink, p < recent, p around the window's start, several window moves, long
LENGTHS = [1, 9, 16, 17, 60, 81, 97, 300]


def test_whole_file_in_a_fresh_process():
    import subprocess

    if not _TRITON_PREIMPORTED:
        pytest.skip("this process already runs the kernels on the interpreter")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


@pytest.fixture(autouse=True)
def interpreted(request, monkeypatch):
    if _TRITON_PREIMPORTED and request.node.name != "test_whole_file_in_a_fresh_process":
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1: covered by test_whole_file_in_a_fresh_process"
        )
    monkeypatch.setenv(triton_paged.ENV_CPU, "1")  # these tests only: CPU tensors through kernels.* to Triton


def decode(pages, scale: float) -> torch.Tensor:
    """kernels.decode (the backend's call) on the pages: it dispatches CPU tensors to Triton here."""
    return kernels.decode(
        pages.q, pages.packed, pages.packed_table, pages.window, pages.window_table, pages.seq_lens,
        pages.plan, pages.slot, scale, pages.k_scale, pages.v_scale, pages.fp8,
    )  # fmt: skip


def check(pages, scale: float = 0.3) -> torch.Tensor:
    got = decode(pages, scale)
    want = reference(pages, scale)
    tol = 2e-3 if pages.q.dtype == torch.float16 else 2e-5
    assert got.dtype == pages.q.dtype and got.shape == want.shape
    assert not got.isnan().any(), "the kernel read a slot the rule forbids (NaN there)"
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    return got


@pytest.mark.parametrize("window_block", [16, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
def test_mixed_lengths_equal_the_reference(dtype, splits, window_block, monkeypatch):
    """GQA 2, one head keeping nothing, one every channel, one a few; 16-key tiles so that the sink and
    window (up to 96 full keys) span several tiles; one split (no merge) and three (merged); window pages of the
    packed pages' 16 tokens or of 7 (a block size of their own)."""
    monkeypatch.setattr(triton_paged, "BLOCK_N", 16)
    monkeypatch.setattr(triton_paged, "CPU_SMS", 64)
    monkeypatch.setattr(triton_paged, "MAX_SPLITS", splits)
    mask = random_mask(2, 3, 32, [0, 32, 5], seed=1)
    pages = random_pages(mask, LENGTHS, q_heads=6, dtype=dtype, seed=2, window_block=window_block)
    assert pages.window.shape[1] == window_block
    assert triton_paged.num_splits(len(LENGTHS), 3, pages.q.device) == splits
    check(pages)


@pytest.mark.parametrize("block_size", [16, 128])
def test_llama_mask_real_windows(block_size, monkeypatch):
    """A layer of the Llama-3.1-8B mask (8 KV heads of 128 channels, GQA 4, kept 0..96) with its own
    sink/recent/accumu 128/768/128: up to 1024 full keys (16 tiles), the middle behind them, fp16."""
    mask = ChannelMask.from_dir(LLAMA)
    layer = ChannelMask(mask.keep[[10, 0]], sink_size=128, recent_size=768, accumu_size=128)
    pages = random_pages(layer, [5, 700, 1023, 1500], q_heads=32, dtype=torch.float16, block_size=block_size)
    monkeypatch.setattr(triton_paged, "CPU_SMS", 64)
    assert triton_paged.num_splits(4, 8, pages.q.device) == 4  # the merge runs
    check(pages, 128**-0.5)


@pytest.mark.parametrize("keep", ["none", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_keeping_nothing_or_everything(keep, dtype):
    """Layer 1 of the worker (packed columns at a non-zero offset): every head keeps no channel (a
    one-element padding row, no middle) or all of them."""
    n = 0 if keep == "none" else 32
    mask = random_mask(2, 2, 32, [n], seed=3)
    pages = random_pages(mask, [3, 40, 200], layer=1, q_heads=4, dtype=dtype)
    assert pages.slot.packed_offset > 0
    check(pages)


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("splits", [1, 2])
def test_fp8_pages(fp8, splits, monkeypatch):
    """fp8 bytes (uint8 pages) with K scale 0.5 and V scale 2, converted in the kernel; with and without
    the merge (where the V scale is applied)."""
    monkeypatch.setattr(triton_paged, "CPU_SMS", 64)
    monkeypatch.setattr(triton_paged, "MAX_SPLITS", splits)
    mask = random_mask(1, 2, 32, [0, 7, 32], seed=4)
    pages = random_pages(mask, [2, 70, 260], q_heads=4, fp8=fp8)
    assert pages.packed.dtype == torch.uint8 and (pages.k_scale, pages.v_scale) == (0.5, 2.0)
    got = check(pages)
    pages.packed, pages.window = pages.packed.view(pages.fp8), pages.window.view(pages.fp8)  # typed fp8 pages
    assert torch.equal(decode(pages, 0.3), got)


def test_padding_rows_give_zeros(monkeypatch):
    """A CUDA graph pads the batch with rows of seq_len 0 (their table rows: the null block): zeros, no NaN,
    the real rows unchanged; with and without the merge."""
    mask = random_mask(1, 2, 16, [4, 16], align=16)
    pages = random_pages(mask, [30, 90], q_heads=4)
    want = reference(pages, 0.3)
    pages.q = torch.cat([pages.q, torch.randn(1, 4, 16)])
    pages.packed_table = torch.cat([pages.packed_table, torch.zeros_like(pages.packed_table[:1])])
    pages.window_table = torch.cat([pages.window_table, torch.zeros_like(pages.window_table[:1])])
    pages.seq_lens = torch.tensor([30, 90, 0], dtype=torch.int32)
    monkeypatch.setattr(triton_paged, "CPU_SMS", 64)
    for splits in (1, 4):
        monkeypatch.setattr(triton_paged, "MAX_SPLITS", splits)
        assert triton_paged.num_splits(3, 2, pages.q.device) == splits
        got = decode(pages, 0.3)
        assert torch.equal(got[2], torch.zeros(4, 16)), splits
        torch.testing.assert_close(got[:2], want, atol=2e-5, rtol=2e-5)


class _HostRead(torch.overrides.TorchFunctionMode):
    """Fails on any op that reads a tensor's values back to the host."""

    BANNED = {"item", "tolist", "__bool__", "cpu", "numpy", "__int__", "__float__", "nonzero"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.BANNED or (name == "to" and any(str(a) == "cpu" for a in args[1:])):
            raise AssertionError(f"host read in decode: {name}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("batch", [1, 7])
def test_one_fixed_launch_per_call(batch, monkeypatch):
    """A decode call is ``launches()`` kernel launches (1 or 2) whatever the batch holds: the grid and every
    non-tensor argument are the same for other lengths of the same batch shape, and no tensor is read on
    the host (so a CUDA graph captured once replays for any lengths)."""
    mask = random_mask(1, 2, 16, [3, 16], align=16)
    calls: list[tuple] = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                plain = [a for a in args if not isinstance(a, torch.Tensor)]
                calls.append((self.name, grid, tuple(plain), tuple(sorted(kwargs.items()))))

            return launch

    triton_paged._load()
    seen = []
    for seed, top in ((0, 40), (1, 300)):
        lengths = torch.randint(1, top, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
        pages = random_pages(mask, lengths, q_heads=4, seed=seed)
        for name in ("packed_table", "window_table"):  # vLLM's tables: one width (max blocks per request)
            table = getattr(pages, name)
            setattr(pages, name, torch.cat([table, table.new_zeros(batch, 24 - table.shape[1])], 1))
        triton_paged.layer_tables(pages.slot.layout, pages.q.device)  # what prepare() does before a capture
        calls.clear()
        with monkeypatch.context() as m:
            m.setattr(triton_paged, "_decode_kernel", Recorder("decode"))
            m.setattr(triton_paged, "_merge_kernel", Recorder("merge"))
            with _HostRead():
                decode(pages, 0.3)
        assert len(calls) == triton_paged.launches(batch, 2, pages.q.device), calls
        seen.append(list(calls))
    assert seen[0] == seen[1]
    assert triton_paged.launches(1, 2, torch.device("cpu")) == 2  # batch 1: splits and the merge


@pytest.mark.parametrize("wbs", [16, 5])
@pytest.mark.parametrize("fmt", ["float32", "float16", "e4m3", "e5m2"])
@pytest.mark.parametrize("keep", [[0, 5, 16], [0]])
def test_write_equals_the_pytorch_write(fmt, keep, wbs):
    """The Triton write puts the same bytes as the PyTorch write (the backend's former _write) into both
    stores, skips padding (-1) and the null block, and leaves every other column (NaN) alone; strided
    K/V as vLLM's qkv split gives them, a layer at a non-zero offset; a layer keeping nothing (its
    padding element written 0); window pages of 16 tokens as the packed ones, or of 5."""
    g = torch.Generator().manual_seed(5)
    mask = random_mask(3, 3, 16, keep, seed=6, align=16)
    bs = 16
    plan = WorkerPlan.build(mask, [0, 1, 2], block_size=bs)
    slot = plan.slots[1]
    fp8 = FP8.get(fmt)
    dtype = torch.uint8 if fp8 else getattr(torch, fmt)
    nb = 6
    packed = torch.full((nb, bs * plan.packed_row + 3), float("nan")).to(dtype)[:, : bs * plan.packed_row]
    wnb = nb * bs // wbs
    window = torch.full((wnb, wbs * plan.window_row + 5), float("nan")).to(dtype)[:, : wbs * plan.window_row]
    if fp8:
        packed.fill_(0x7F)
        window.fill_(0x7F)
    packed = packed.view(nb, bs, plan.packed_row)
    window = window.view(wnb, wbs, plan.window_row)
    n = 9
    model = torch.float32 if fp8 else dtype
    qkv = torch.randn(n, (2 + 3 + 3) * 16, generator=g).to(model)  # q | k | v of each token, like vLLM's
    if fp8:  # on the fp8 grid (times the scales): triton's interpreter rounds fp8 wrongly where rounding
        # carries into the exponent (7.9 -> 4, not 8); the GPU check compares off-grid values on a GPU
        qkv[:, 32:80] = (qkv[:, 32:80] * 4).to(fp8).float() * 0.5
        qkv[:, 80:] = (qkv[:, 80:] * 4).to(fp8).float() * 2.0
    k, v = qkv[:, 32:80].view(n, 3, 16), qkv[:, 80:].view(n, 3, 16)
    packed_slots = torch.tensor([17, -1, 40, 3, 95, -1, 66, 33, 18])
    window_slots = torch.tensor([20, -1, 5, 0, 90, 31, 15, 16, 47])  # < wbs: the null block
    if wbs == 5:
        window_slots = torch.tensor([20, -1, 3, 0, 90, 31, 4, 5, 47])
    want_p, want_w = packed.clone(), window.clone()
    write_pages(want_p, packed_slots, want_w, window_slots, k, v, slot, 0.5, 2.0, fp8)
    got_p, got_w = packed.clone(), window.clone()
    kernels.write(got_p, packed_slots, got_w, window_slots, k, v, slot, 0.5, 2.0, fp8)
    raw = lambda t: t.view(torch.uint8)  # noqa: E731 - bytes: NaN slots compare equal
    assert torch.equal(raw(got_p), raw(want_p)) and torch.equal(raw(got_w), raw(want_w))
    assert not torch.equal(raw(want_p), raw(packed)) and not torch.equal(raw(want_w), raw(window))


def test_cpu_tensors_reach_triton_only_when_asked(monkeypatch):
    """A CPU engine (or another test) keeps its own kernels: CPU tensors go to Triton only with
    ``$LEANK_TRITON_ON_CPU=1`` (and the interpreter on)."""
    x = torch.zeros(1)
    assert triton_paged.handles(x)
    monkeypatch.delenv(triton_paged.ENV_CPU)
    assert not triton_paged.handles(x)
