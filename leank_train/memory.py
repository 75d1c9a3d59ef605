"""Device memory of one training step, estimated from a model config (no weights, no GPU).

Why: before renting GPUs for a 32k-128k run, a user wants to know whether one step fits and what
sequence parallelism or activation checkpointing buys. The terms follow the step of
:mod:`leank_train.distill.module` (teacher prefill without grad that records the context K/V, then the
answer tokens with grad against it); each is a dominant term, not an allocator trace:

- weights: ``params x bytes`` (FSDP divides it by the number of ranks that shard the model);
- context K/V recorded by the teacher, alive until the backward: ``2 x kv_heads x head_dim x bytes``
  per token and layer (sequence parallel: ``/ W``, each rank keeps its heads);
- teacher transient: one layer at a time, dominated by the MLP (gate, up, their product) and the
  residual stream for the rank's ``T / W`` tokens;
- student, saved for the backward per layer: the attention probabilities of ``heads / W`` heads x
  answer x context (fp32 softmax output, its fp32 ``nan_to_num`` and the bf16 copy: 10 bytes), and the
  concatenated context + answer K/V, and the answer tokens' own activations. Activation
  checkpointing keeps one layer of that at a time (plus every layer's input).

``leank memory MODEL_ID_OR_DIR --context 32768 [--answer 64] [--sp 1 2 8] [--fsdp 1]``
"""

from __future__ import annotations

from typing import Any

from leank_infer.cli_types import PositiveInt, UsageError
from leank_infer.mask.kv_bytes import dense_token_bytes

GiB = 1024**3

# Published architectures, so the estimate works offline for the recipes' models.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen2.5-7B-Instruct": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, head_dim=128, vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


def known_config(model: str) -> Any:
    """The config of one of ``KNOWN_CONFIGS`` built locally."""
    from transformers import AutoConfig

    fields = dict(KNOWN_CONFIGS[model])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def load_config(model: str) -> Any:
    """A transformers config for a Hub id or folder; the recipes' models also offline."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=False)
    except (OSError, ValueError) as e:
        if model not in KNOWN_CONFIGS:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"{model[:200]!r}: cannot read its config: {first}") from None
        return known_config(model)


def count_params(cfg: Any) -> int:
    """Parameters of a dense decoder-only LM from its config (attention, gated MLP, norms, embeddings)."""
    h, n = int(cfg.hidden_size), int(cfg.num_hidden_layers)
    d = int(getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads)
    q, kv, inter = int(cfg.num_attention_heads) * d, int(cfg.num_key_value_heads) * d, int(cfg.intermediate_size)
    attn = h * q + 2 * h * kv + q * h
    if getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2":
        attn += q + 2 * kv
    layer = attn + 3 * h * inter + 2 * h
    embed = int(cfg.vocab_size) * h * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    return n * layer + embed + h


def estimate_step_memory(
    config: Any,
    context: int,
    answer: int = 64,
    sequence_parallel: int = 1,
    fsdp_shards: int = 1,
    activation_checkpointing: bool = True,
    bytes_per_value: int = 2,
) -> dict[str, Any]:
    """Bytes per rank of one training step (see the module docstring for the terms)."""
    if context <= 0 or answer <= 0 or sequence_parallel < 1 or fsdp_shards < 1:
        raise ValueError("context, answer, sequence_parallel and fsdp_shards must be positive")
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, hidden, inter = int(cfg.num_hidden_layers), int(cfg.hidden_size), int(cfg.intermediate_size)
    heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    w, b = sequence_parallel, bytes_per_value
    if kv_heads % w:
        raise ValueError(f"sequence_parallel={w} must divide the {kv_heads} KV heads")
    local = -(-context // w)
    kv_per_token_layer = dense_token_bytes(1, kv_heads, head_dim, b) // w
    weights = count_params(cfg) * b / fsdp_shards
    kv = kv_per_token_layer * context * layers
    teacher = local * (3 * inter + 4 * hidden + (heads + 2 * kv_heads) * head_dim) * b
    probs_per_layer = (heads // w) * answer * (context + answer) * 10
    cat_per_layer = kv_per_token_layer * (context + answer)
    saved_layers = 1 if activation_checkpointing else layers
    acts_per_layer = answer * (8 * hidden + 3 * inter) * b  # the answer tokens' own activations
    student = saved_layers * (probs_per_layer + cat_per_layer + acts_per_layer)
    if activation_checkpointing:
        student += layers * answer * hidden * b  # each layer's input, kept for the replay
    peak = weights + kv + max(teacher, student)
    return {
        "params": count_params(cfg),
        "kv_bytes_per_token_per_layer": kv_per_token_layer,
        "student_bytes_per_answer_token_per_context_token_per_layer": (heads // w) * 10,
        "weights_gib": weights / GiB,
        "context_kv_gib": kv / GiB,
        "teacher_transient_gib": teacher / GiB,
        "student_saved_gib": student / GiB,
        "peak_gib": peak / GiB,
    }


def memory(
    model: str,
    *,
    context: PositiveInt = 32768,
    answer: PositiveInt = 64,
    sp: list[PositiveInt] = [1, 2, 8],  # noqa: B006 (read only; shown in --help)
    fsdp: PositiveInt = 1,
) -> int:
    """Device memory of one training step, estimated from a model config (no weights, no GPU).

    Args:
        model: Hub id or local folder (the recipes' models work offline).
        context: context tokens per sample.
        answer: answer tokens per sample (the student's part).
        sp: sequence-parallel sizes to show.
        fsdp: ranks sharding the frozen weights.
    """
    cfg = load_config(model)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    kv_heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    fits = [w for w in sp if kv_heads % w == 0]  # sequence parallelism splits the KV heads between ranks
    if not fits:
        raise UsageError(f"--sp: none of {', '.join(map(str, sp))} divides the model's {kv_heads} KV heads "
                         "(sequence parallelism splits the KV heads between ranks)")
    print(f"{model}: {count_params(cfg) / 1e9:.2f} B params, bf16, context {context}, answer {answer}")
    if len(fits) < len(sp):
        print(f"(--sp {', '.join(str(w) for w in sp if w not in fits)} left out: the model has {kv_heads} KV heads, "
              "which sequence parallelism splits between the ranks)")
    sp = fits
    print("| SP ranks | act. ckpt | K/V B/token/layer | weights GiB | context K/V GiB | teacher GiB | student GiB | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for w in sp:
        for ckpt in (False, True):
            e = estimate_step_memory(cfg, context, answer, w, fsdp, ckpt)
            print(f"| {w} | {'yes' if ckpt else 'no'} | {e['kv_bytes_per_token_per_layer']} | {e['weights_gib']:.1f} | "
                  f"{e['context_kv_gib']:.2f} | {e['teacher_transient_gib']:.2f} | {e['student_saved_gib']:.2f} | "
                  f"{e['peak_gib']:.1f} |")
    return 0


if __name__ == "__main__":
    import sys

    from leank_infer.cli import main

    raise SystemExit(main(["memory", *sys.argv[1:]]))
