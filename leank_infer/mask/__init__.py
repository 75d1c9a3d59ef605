"""The LeanK mask: its files and their folder, binarisation, which layers it prunes, what it saves."""

from .channel_mask import (
    CONFIG_FILE,
    MASK_FILE,
    MAX_CONFIG_BYTES,
    ChannelMask,
    MaskError,
    binarize,
    check_config_overrides,
    check_mask_target,
    check_ratio_align,
    dense_layers_of,
    model_positions,
    model_shape,
    write_mask_folder,
)

__all__ = [
    "CONFIG_FILE",
    "MASK_FILE",
    "MAX_CONFIG_BYTES",
    "ChannelMask",
    "MaskError",
    "binarize",
    "check_config_overrides",
    "check_mask_target",
    "check_ratio_align",
    "dense_layers_of",
    "model_positions",
    "model_shape",
    "write_mask_folder",
]
