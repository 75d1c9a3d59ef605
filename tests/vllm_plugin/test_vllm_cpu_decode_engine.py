"""The CPU decode kernel inside the engine: vLLM's decode steps through it give the PyTorch path's tokens."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_engine_decodes_through_the_kernel_as_through_the_pytorch_path(leank_eager_llm, tokenizer, monkeypatch):
    """Requests of several lengths (inside the window, a few tiles, past the middle's first pieces) in one batch:
    every decode step calls the kernel (once per layer), every prompt runs in vLLM's CPU attention (cpu_prefill, never
    the per-request SDPA), and switching the kernel off (the PyTorch path) changes no token and moves no
    log-probability by more than fp32 rounding."""
    import pydoc_data.topics

    from vllm import SamplingParams, TokensPrompt

    from leank_infer.vllm import cpu_decode, cpu_prefill, kernels

    text = " ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text).input_ids
    prompts = [ids[1000 * i : 1000 * i + n] for i, n in enumerate((40, 330, 1300))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    calls = []
    real = cpu_decode.LayerKernel.decode  # what each layer's bound calls run (kernels.BoundLayer)
    monkeypatch.setattr(cpu_decode.LayerKernel, "decode", lambda s, q, *a: calls.append(q.shape[0]) or real(s, q, *a))
    prompted, attend = [], cpu_prefill.attend
    monkeypatch.setattr(cpu_prefill, "attend", lambda batch, *a: prompted.append(len(batch.seq_lens)) or attend(batch, *a))
    monkeypatch.setattr(kernels, "dense_prefill", lambda *a, **k: pytest.fail("a CPU prompt chunk ran the SDPA path"))
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_decode.ENV_SWITCH, switch)
        outs = leank_eager_llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        runs[switch] = [
            (list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
            for o in outs
        ]
        if switch == "1":
            assert len(calls) >= 30 * 7 and max(calls) == len(prompts)
            assert len(prompted) >= 30 and sum(prompted) >= 30 * len(prompts)  # every layer, every prompt
    assert [t for t, _ in runs["1"]] == [t for t, _ in runs["0"]]
    diff = max(
        abs(x - y)
        for (_, a), (_, b) in zip(runs["1"], runs["0"], strict=True)
        for x, y in zip(a, b, strict=True)
    )
    assert diff < 1e-3
