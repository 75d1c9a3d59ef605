"""The plugin settings as vLLM passes them: an empty or misspelt LeanK setting stops the engine with leank's
one line, never serves dense without a word (the settings' table is tests/test_hostile_r3.py)."""

from __future__ import annotations

import pytest

from .conftest import ENGINE, MASK


@pytest.mark.parametrize("config, message", [
    ({"leank_mask": ""}, "additional_config['leank_mask'] is ''"),
    ({"leank-mask": MASK}, "unknown LeanK setting(s) ['leank-mask']"),
    ({"leank_rule": "positional"}, "sets ['leank_rule'] but no 'leank_mask'"),
])
def test_vllm_config_carries_the_settings_to_one_clear_error(model_dir, monkeypatch, config, message):
    """vLLM's own config (EngineArgs -> VllmConfig.additional_config) reaches the settings unchanged, checked as
    vLLM builds it (in the caller's process): each bad setting is leank's error, and $LEANK_MASK does not stand in
    for an explicit empty one."""
    from vllm.engine.arg_utils import EngineArgs

    from leank_infer import MaskError

    if "leank_rule" in config:
        monkeypatch.delenv("LEANK_MASK", raising=False)
    else:
        monkeypatch.setenv("LEANK_MASK", MASK)
    with pytest.raises(MaskError) as err:
        EngineArgs(model=str(model_dir), additional_config=config, **ENGINE).create_engine_config()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_engine_with_an_empty_mask_setting_does_not_start(model_dir, monkeypatch):
    """Item 18 end to end: ``leank_mask: ""`` with ``$LEANK_MASK`` set stops the engine with leank's message."""
    from vllm import LLM

    monkeypatch.setenv("LEANK_MASK", MASK)
    with pytest.raises(Exception) as err:
        LLM(model=str(model_dir), additional_config={"leank_mask": ""}, **ENGINE)
    assert "additional_config['leank_mask'] is ''" in str(err.value), err.value
