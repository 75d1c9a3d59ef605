"""leank_infer: LeanK masks and decoding for transformers (no training dependencies)."""

from .layer_handoff import LeanKCacheError
from .loading import EMBEDDED_MODEL_ID, BaseModelError, load_base_model
from .mask import ChannelMask, MaskError

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
        from .model import LeanKModel

        return LeanKModel
    raise AttributeError(f"module 'leank_infer' has no attribute {name!r}")
