"""The LeanK mask: its files and their folder, binarisation, which layers it prunes, what it saves.

Inside the package, each module imports only those listed before it:
``format`` (file names, versions, limits, MaskError) -> ``layers`` (shape, positions, dense layers)
-> ``binarize``, ``kv_bytes`` (bytes per token, the one formula) -> ``folder`` (read and write a mask
folder) -> ``channel_mask`` (ChannelMask) -> ``fit`` (does a mask fit a model), ``estimate``, ``capacity``
(any config, per sequence, batches).
"""

from .binarize import binarize, check_ratio_align
from .channel_mask import ChannelMask
from .fit import check_fit
from .folder import check_mask_target, is_mask_repo, update_mask_folder, write_mask_folder
from .format import (
    ALLOW_PATTERNS,
    CONFIG_FILE,
    MASK_FILE,
    MAX_CONFIG_BYTES,
    MaskError,
    check_config_overrides,
)
from .layers import dense_layers_of, model_positions, model_shape

__all__ = [
    "ALLOW_PATTERNS",
    "CONFIG_FILE",
    "MASK_FILE",
    "MAX_CONFIG_BYTES",
    "ChannelMask",
    "MaskError",
    "binarize",
    "check_config_overrides",
    "check_fit",
    "check_mask_target",
    "check_ratio_align",
    "dense_layers_of",
    "is_mask_repo",
    "model_positions",
    "model_shape",
    "update_mask_folder",
    "write_mask_folder",
]
