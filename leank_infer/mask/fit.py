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
