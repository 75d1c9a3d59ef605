"""What a mask repo holds: its file names, format versions, required config keys and size limits.

A mask repo is a folder (or a Hub model repo) holding

- ``mask.safetensors``: tensor ``keep`` (uint8 0/1, ``[layers, kv_heads, head_dim]``) and
  optionally ``scores`` (float32, same shape: the learned channel scalers, alpha),
- ``config.json``: the format version, the base model and how to load it, the shape, the
  sink/recent/accumulation sizes the mask was trained for, the ratio and align, the recipe,

and, for people, ``README.md`` (the model card), ``eval.json`` (its measured rows), plots and a LICENSE.
Only safetensors and JSON are ever read: nothing from a mask repo is unpickled.
"""

from __future__ import annotations

import json
from typing import Any

# A version above 1 is written only for masks an older reader cannot honour, so that it refuses them
# instead of loading the bare base model and decoding a model the mask was not learned on: 2 for a
# mask naming a PEFT adapter, 3 for one with base-model config overrides (YaRN's rope_parameters),
# which a version-2 reader would ignore. Every other mask is still written as version 1. All are read.
FORMAT_VERSION = 3  # the newest version: this leank reads every version up to it, and none above
READ_VERSIONS = tuple(range(1, FORMAT_VERSION + 1))


def format_version(*, adapter: bool, config_overrides: bool) -> int:
    """The version a mask is written as: the lowest one whose readers honour everything it records."""
    return FORMAT_VERSION if config_overrides else 2 if adapter else 1
MASK_FILE = "mask.safetensors"
CONFIG_FILE = "config.json"
REQUIRED_KEYS = (
    "format_version",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "sink_size",
    "recent_size",
    "accumu_size",
    "ratio",
    "align",
)


# What a mask folder may hold: a stranger's config.json or mask.safetensors is read only up to these
# What is ever downloaded from (or uploaded to) a mask repo, and all a folder leank may replace holds:
# safe formats, the card and the plot. LICENSE: an imported mask (leank import) carries its licence text.
ALLOW_PATTERNS = [MASK_FILE, CONFIG_FILE, "README.md", "eval.json", "*.png", "LICENSE"]

# sizes (a 126-layer x 8-head x 128-channel mask with scores is 0.6 MB) and JSON only this deep.
MAX_CONFIG_BYTES = 1 << 20
MAX_MASK_BYTES = 64 << 20
MAX_OTHER_BYTES = 8 << 20  # the card, eval.json, a plot, the LICENSE (the committed ones are < 0.3 MB)
MAX_REPO_FILES = 24  # mask, config, card, eval.json, LICENSE and the plots
MAX_REPO_BYTES = 96 << 20  # all of a mask repo's files together, pushed or pulled
MAX_JSON_DEPTH = 32
MAX_TOKENS = 2**31 - 1  # sink/recent/accumulation sizes: no model has more positions
# from_pretrained options a mask's config_overrides may never set: they choose what code and which
# files are loaded (trust_remote_code!), not the model's configuration. Overrides are config attributes.
LOADER_KEYWORDS = frozenset({
    "trust_remote_code", "revision", "code_revision", "token", "use_auth_token", "cache_dir", "subfolder",
    "force_download", "local_files_only", "proxies", "resume_download", "mirror", "gguf_file", "variant",
    "use_safetensors", "weights_only", "from_tf", "from_flax", "state_dict", "config", "device_map",
    "max_memory", "offload_folder", "offload_state_dict", "offload_buffers", "low_cpu_mem_usage",
    "quantization_config", "load_in_8bit", "load_in_4bit", "dtype", "torch_dtype", "attn_implementation",
    "experts_implementation", "tp_plan", "tp_size", "device_mesh", "distributed_config", "key_mapping",
    "adapter_name", "adapter_kwargs", "output_loading_info", "generation_config", "pretrained_model_name_or_path",
    "auto_map", "architectures", "model_type", "name_or_path", "transformers_version", "kwargs",
})


def file_limit(name: str) -> int:
    """The most bytes a mask repo's file ``name`` may hold (read, pushed or downloaded)."""
    return {MASK_FILE: MAX_MASK_BYTES, CONFIG_FILE: MAX_CONFIG_BYTES}.get(name, MAX_OTHER_BYTES)


class MaskError(ValueError):
    """A mask, a mask file or a mask/model pairing is not valid; the message says what and where."""


def check_config_overrides(overrides: Any) -> dict[str, Any]:
    """Base-model config attributes set at load (``{"rope_parameters": {...}}`` for YaRN): a JSON object
    with string keys whose values survive ``json.dumps`` (they are written to config.json as they are)."""
    if not isinstance(overrides, dict):
        raise MaskError(f"config_overrides must be a JSON object (dict), got {type(overrides).__name__}")
    bad = [k for k in overrides if not isinstance(k, str) or not k.isidentifier() or k.startswith("_")]
    if bad:
        raise MaskError(f"config_overrides keys must be model config attribute names, got {bad}")
    loader = sorted(k for k in overrides if k in LOADER_KEYWORDS)
    if loader:
        raise MaskError(
            f"config_overrides may set only model config attributes, not loader options: {', '.join(loader)} "
            "refused (a mask never chooses what code or which files are loaded)"
        )
    try:
        return json.loads(json.dumps(overrides, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise MaskError(f"config_overrides must hold plain JSON values: {e}") from None
