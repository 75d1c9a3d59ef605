"""Which leank mask a vLLM engine serves with, read the way vLLM passes plugin settings.

vLLM's place for settings of out-of-tree code is ``additional_config`` (``vllm serve ...
--additional-config '{"leank_mask": "hub/smollm2-135m-instruct"}'``, or
``LLM(..., additional_config={"leank_mask": ...})``); it reaches every process with the
``VllmConfig`` and is part of vLLM's config hash. Keys:

- ``leank_mask``: a mask folder or a Hub repo id (resolved as ``ChannelMask.from_pretrained`` does:
  safetensors + JSON only, ``HF_HUB_OFFLINE`` honoured),
- ``leank_mask_revision``: branch, tag or commit of a Hub mask (optional),
- ``leank_check_base_model``: ``false`` to serve a renamed copy or fine-tune of the mask's base model,
- ``leank_rule``: ``"dense-prompt"`` (default: the prompt attends with every channel, each generated token by
  its position; a request holds the rest of its prompt's channels in the pool while the prompt is computed) or
  ``"positional"`` (the prompt by its position too: no such rows, lower accuracy on long prompts). Both are
  rules of ``LeanKModel(rule=...)``, so the two paths give the same tokens,
- ``leank_prefix_align``: the most tokens vLLM may align prefix-cache hits to (default: the block size vLLM uses
  without LeanK, 128 on CPU and 16 on CUDA unless ``--block-size`` says otherwise, so hits are never coarser than
  plain vLLM's), within which LeanK's packed and window pages take the numbers of tokens that fill them
  (:func:`~leank_infer.vllm.pool.fit_blocks`): a larger value may hold a prompt token in flight in fewer bytes,
  and a prefix-cache hit then leaves up to that many tokens to recompute.

The environment variable ``LEANK_MASK`` names a mask when ``additional_config`` does not (handy
for scripts that cannot change the engine arguments). Without either, the plugin does nothing.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from ..decode.rule import DENSE_PROMPT, POSITIONAL
from ..mask import ChannelMask, MaskError, check_fit

ENV_MASK = "LEANK_MASK"
KEY_MASK = "leank_mask"
KEY_REVISION = "leank_mask_revision"
KEY_CHECK = "leank_check_base_model"
KEY_RULE = "leank_rule"
KEY_ALIGN = "leank_prefix_align"
_KEYS = (KEY_MASK, KEY_REVISION, KEY_CHECK, KEY_RULE, KEY_ALIGN)
SERVED_RULES = (DENSE_PROMPT, POSITIONAL)

_lock = threading.Lock()
_loaded: dict[tuple[str, str | None], ChannelMask] = {}


@dataclass(frozen=True)
class LeanKSettings:
    """The plugin settings of one engine: the mask reference and how strictly it is checked."""

    mask: str
    revision: str | None = None
    check_base_model: bool = True
    rule: str = DENSE_PROMPT
    prefix_align: int | None = None  # tokens; None: vLLM's block size (cache_config.block_size)

    @property
    def dense_prompt(self) -> bool:
        return self.rule == DENSE_PROMPT


def settings_from(additional_config: Any) -> LeanKSettings | None:
    """The LeanK settings in vLLM's ``additional_config`` (or ``$LEANK_MASK``); None when LeanK is off.

    LeanK is off only when no LeanK key is given and ``$LEANK_MASK`` is unset or empty. A ``leank_mask`` that is
    given but names nothing (``""``, null, false, 0, ``[]``), a misspelt LeanK key (``leank-mask``,
    ``LEANK_MASK``), or another LeanK setting without a mask is one clear error, never a dense engine: an
    explicit ``leank_mask`` never falls back to ``$LEANK_MASK``."""
    cfg = additional_config if isinstance(additional_config, dict) else {}
    unknown = sorted(str(k) for k in cfg
                     if isinstance(k, str) and k.lower().replace("-", "_").startswith("leank") and k not in _KEYS)
    if unknown:
        raise MaskError(f"unknown LeanK setting(s) {unknown} in additional_config; known: {list(_KEYS)} "
                        "(lower case, with underscores)")
    if KEY_MASK in cfg:
        mask = cfg[KEY_MASK]
        if not isinstance(mask, str) or not mask.strip():
            raise MaskError(
                f"additional_config[{KEY_MASK!r}] is {mask!r}: give a mask folder or Hub repo id (a non-empty "
                f"string), or leave the key out to serve without LeanK"
            )
    else:
        mask = os.environ.get(ENV_MASK, "").strip() or None
    if mask is None:
        given = [k for k in _KEYS if k in cfg]
        if given:
            raise MaskError(f"additional_config sets {given} but no {KEY_MASK!r} (nor ${ENV_MASK}): name the mask "
                            "to serve with, or leave the LeanK settings out")
        return None
    revision = cfg.get(KEY_REVISION)
    if revision is not None and not isinstance(revision, str):
        raise MaskError(f"additional_config[{KEY_REVISION!r}] must be a string, got {revision!r}")
    check = cfg.get(KEY_CHECK, True)
    if not isinstance(check, bool):
        raise MaskError(f"additional_config[{KEY_CHECK!r}] must be true or false, got {check!r}")
    rule = cfg.get(KEY_RULE, DENSE_PROMPT)
    if rule not in SERVED_RULES:
        raise MaskError(f"additional_config[{KEY_RULE!r}] must be one of {list(SERVED_RULES)}, got {rule!r}")
    align = cfg.get(KEY_ALIGN)
    if align is not None and (isinstance(align, bool) or not isinstance(align, int) or align < 1):
        raise MaskError(f"additional_config[{KEY_ALIGN!r}] must be a whole number of tokens (>= 1), got {align!r}")
    return LeanKSettings(mask, revision, check, rule, align)


def load_checked_mask(settings: LeanKSettings, hf_config: Any, served_name: str | None = None) -> ChannelMask:
    """Load the mask once per process and check it fits the served model (else one MaskError).

    The check is the transformers path's (:func:`~leank_infer.mask.fit.check_fit`): shape, sliding-window
    layers left whole, the base-model id (the served name or the config's ``_name_or_path``; a local
    folder is not comparable by name), no PEFT adapter the served model may lack, and the config
    overrides the mask was learned with (serve with ``--hf-overrides``).
    """
    key = (settings.mask, settings.revision)
    with _lock:
        mask = _loaded.get(key)
        if mask is None:
            mask = ChannelMask.from_pretrained(settings.mask, revision=settings.revision)
            _loaded[key] = mask
    try:
        check_fit(
            mask, hf_config, [served_name, getattr(hf_config, "_name_or_path", None)], settings.check_base_model,
            opt_out=f'set additional_config {{"{KEY_CHECK}": false}}',
        )  # fmt: skip
    except MaskError as e:
        raise MaskError(f"LeanK mask {settings.mask!r}: {e}") from None
    return mask


def check_length(mask: ChannelMask, max_model_len: int, name: str) -> None:
    """Refuse a mask that prunes no token of any request the engine serves (one MaskError naming its sizes).

    A token leaves the full-channel rows only once a later query's recent window starts past the sink
    (:meth:`~leank_infer.mask.ChannelMask.full_token_count`); when even the last query of a request of
    ``max_model_len`` tokens keeps every key whole, LeanK saves nothing and its pages hold more than plain vLLM's
    (a sink of 2**31 - 1 tokens would also ask the pool for that many tokens' blocks)."""
    if mask.full_token_count(max_model_len)[1]:
        return
    sink, recent, accumu = mask.sink_size, mask.recent_size, mask.accumu_size
    first = recent + (sink // accumu + 1) * accumu  # the shortest request with a pruned token
    raise MaskError(
        f"LeanK mask {name!r}: its sink_size {sink}, recent_size {recent} and accumu_size {accumu} keep every channel "
        f"of every token of a request up to max_model_len {max_model_len} (LeanK prunes a token only in requests of "
        f"at least {first} tokens), so it would prune nothing and hold more KV than plain vLLM; serve without the "
        f"mask, or with a max_model_len of at least {first}"
    )


def check_vllm_config(vllm_config: Any) -> None:
    """The LeanK settings of an engine and their mask, checked where vLLM builds the engine's config.

    Runs in the caller's process, on the config ``EngineArgs.create_engine_config`` returns
    (:func:`leank_infer.vllm.check_settings_with_the_config`), so a bad setting or a mask that does not fit stops
    ``LLM(...)`` or ``vllm serve`` with leank's one line, not with vLLM's "Engine core initialization failed" from its
    engine subprocess. The workers check the settings and the fit again when they build their layers."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:  # a config with no model (vLLM builds some): nothing is served with it
        return
    settings = settings_from(getattr(vllm_config, "additional_config", None))
    if settings is None:
        return
    mask = load_checked_mask(settings, model_config.hf_config, model_config.model)
    check_length(mask, model_config.max_model_len, settings.mask)
    check_engine(vllm_config)


KV_DTYPES = ("auto", None, "fp8", "fp8_e4m3", "fp8_e5m2")  # the model's dtype, or fp8 (one byte an element)
# a 2-byte float other than the model's (fp32 weights, bf16 pages): the CPU build's kernels read and write it; on CUDA
# the Triton kernels' conversions are untried (no GPU here), so it stays refused there
HALF_KV_DTYPES = ("float16", "bfloat16")


def check_engine(vllm_config: Any) -> None:
    """Refuse engine settings the LeanK backend does not implement (one error naming each)."""
    problems = []
    dtype = vllm_config.cache_config.cache_dtype
    cpu = vllm_config.device_config.device_type == "cpu"
    own = str(vllm_config.model_config.dtype).removeprefix("torch.")  # the model's dtype, spelt out
    if dtype not in KV_DTYPES and dtype != own and not (cpu and dtype in HALF_KV_DTYPES):
        also = "" if cpu else "; float16 or bfloat16 on the CPU build only"
        problems.append(f"kv_cache_dtype={dtype!r} (LeanK stores K/V in the model dtype or fp8{also})")
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        problems.append("decode context parallelism")
    spec = vllm_config.speculative_config
    if spec is not None and (spec.use_eagle() or spec.uses_draft_model()):
        # vLLM 0.32 runs a drafter's layers on one attention metadata, so they must form one KV cache group; its
        # grouping beside LeanK's stores (one layer each) makes a group of every drafter layer
        problems.append(
            f"speculative decoding by {spec.method!r}: a drafter with attention layers of its own (n-gram drafts run)"
        )
    if problems:
        raise MaskError("LeanK serving does not support " + "; ".join(problems))
