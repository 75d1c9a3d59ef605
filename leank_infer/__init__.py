"""leank_infer: LeanK masks and decoding for transformers (no training dependencies)."""

from .decode.layer_handoff import LeanKCacheError
from .mask import ChannelMask, MaskError
from .model.loading import EMBEDDED_MODEL_ID, BaseModelError, load_base_model

__all__ = [
    "ChannelMask",
    "MaskError",
    "BaseModelError",
    "LeanKCacheError",
    "load_base_model",
    "EMBEDDED_MODEL_ID",
    "LeanKModel",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LeanKModel pulls in the cache and attention code; load it on first use.
    if name == "LeanKModel":
        from .model.leank_model import LeanKModel

        return LeanKModel
    raise AttributeError(f"module 'leank_infer' has no attribute {name!r}")
