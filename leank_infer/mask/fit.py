"""Does this mask fit this model? The one answer both the transformers path and the vLLM plugin use.

A mask fits a model when (always enforced) its shape is the model's and it leaves sliding-window
layers whole (:meth:`ChannelMask.validate`), and (enforced unless the caller opts out, when the
model is a fine-tune or a renamed copy the caller vouches for) the model is the one the mask was
learned on: its Hub id is the mask's ``base_model``, the mask names no PEFT adapter the model may
lack, and the model's config carries the attributes the mask was learned with (``config_overrides``,
e.g. YaRN's ``rope_parameters``). A mask that fits the shape but not the model decodes without an
error and answers worse, which is why the second part is an error by default.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .channel_mask import ChannelMask
from .format import MaskError


def same_model_id(a: str | None, b: str | None) -> bool:
    """Whether two base-model ids can be compared and agree (local paths are not comparable: True)."""
    if not a or not b or Path(a).exists() or Path(b).exists():
        return True
    return a.strip("/").lower() == b.strip("/").lower()


def config_differences(config: Any, overrides: dict[str, Any]) -> list[str]:
    """``"name: model has X, mask wants Y"`` for each override the model's config does not carry; a
    dict override (``rope_parameters``) counts as carried when each of its keys has the wanted value
    (transformers adds defaults of its own to such dicts)."""

    def carried(have: Any, want: Any) -> bool:
        if isinstance(want, dict):
            return isinstance(have, dict) and all(carried(have.get(k), v) for k, v in want.items())
        return have == want

    return [
        f"{name}: model has {getattr(config, name, None)!r}, mask wants {want!r}"
        for name, want in overrides.items()
        if not carried(getattr(config, name, None), want)
    ]


# Overrides that extend the context a model reads (YaRN and its kin) without changing what it computes within
# its trained length: a mask may carry these as they are. Any other override that changes the base model's
# config (``hidden_act``, ``rms_norm_eps``, ``rope_theta``, ``tie_word_embeddings``...) needs a stated reason.
CONTEXT_OVERRIDES = frozenset({"rope_parameters", "rope_scaling", "max_position_embeddings"})
OVERRIDES_REASON = "config_overrides_reason"  # the key in a mask's ``extra`` that says why it changes the model


def _rope_theta(config: Any) -> Any:
    params = getattr(config, "rope_parameters", None)
    return params.get("rope_theta") if isinstance(params, dict) and "rope_theta" in params else getattr(
        config, "rope_theta", None)


def computing_overrides(config: Any, overrides: dict[str, Any]) -> list[str]:
    """The overrides that change what the base model (its ``config``, before them) computes: every one whose
    value differs from the config's, except the context-extension ones (:data:`CONTEXT_OVERRIDES`), whose
    ``rope_theta`` must stay the model's."""
    changed = []
    for name, want in overrides.items():
        if getattr(config, name, object()) == want:
            continue
        if name in CONTEXT_OVERRIDES:
            theta = want.get("rope_theta") if isinstance(want, dict) else None
            if theta is None or theta == _rope_theta(config):
                continue
        changed.append(name)
    return sorted(changed)


def overrides_reason(mask: ChannelMask) -> str | None:
    """The mask's stated reason for overrides that change what the base model computes (None when it has none)."""
    reason = mask.extra.get(OVERRIDES_REASON)
    return reason.strip() if isinstance(reason, str) and reason.strip() else None


def check_fit(
    mask: ChannelMask,
    model_config: Any,
    names: Iterable[str | None] = (),
    check_base_model: bool = True,
    opt_out: str = "pass check_base_model=False",
) -> None:
    """Raise :class:`MaskError` if ``mask`` does not fit the model (module docstring).

    ``names``: what the model is called (a served name, ``config._name_or_path``); local paths
    are not compared. With ``check_base_model=False`` the model-identity problems become one
    warning; ``opt_out`` says how the caller turns the check off, for the error message.
    """
    mask.validate(model_config)
    problems = []
    named = [n for n in names if n]
    if named and not any(same_model_id(mask.base_model, n) for n in named):
        problems.append(f"the mask was trained for {mask.base_model!r} but the model is {named[0]!r}")
    if mask.adapter:
        problems.append(
            f"the mask was learned on {mask.base_model!r} with the PEFT adapter {mask.adapter!r} merged "
            "(use the merged fine-tune)"
        )
    differ = config_differences(model_config, mask.config_overrides)
    if differ:
        problems.append(f"the mask was learned with config overrides the model lacks ({'; '.join(differ)})")
    if not problems:
        return
    message = "; ".join(problems)
    if check_base_model:
        raise MaskError(f"{message} ({opt_out} to use it anyway)")
    warnings.warn(f"{message}; shapes fit, so it is used as requested", stacklevel=3)
