"""The LeanK mask format: one definition, used by training (export) and inference (load).

A mask repo is a folder (or a Hub model repo) holding

- ``mask.safetensors``: tensor ``keep`` (uint8 0/1, ``[layers, kv_heads, head_dim]``) and
  optionally ``scores`` (float32, same shape: the learned channel scalers, alpha),
- ``config.json``: the format version, the base model and how to load it, the shape, the
  sink/recent/accumulation sizes the mask was trained for, the ratio and align, the recipe.

Only safetensors and JSON are ever read: nothing from a mask repo is unpickled.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..folders.atomic import FolderError, refusal, write_folder
from ..folders.names import MAX_LOCAL_PATH, inner_file_problem, revision_problem

# A version above 1 is written only for masks an older reader cannot honour, so that it refuses them
# instead of loading the bare base model and decoding a model the mask was not learned on: 2 for a
# mask naming a PEFT adapter, 3 for one with base-model config overrides (YaRN's rope_parameters),
# which a version-2 reader would ignore. Every other mask is still written as version 1. All are read.
FORMAT_VERSION = 3
READ_VERSIONS = (1, 2, 3)
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
# sizes (a 126-layer x 8-head x 128-channel mask with scores is 0.6 MB) and JSON only this deep.
MAX_CONFIG_BYTES = 1 << 20
MAX_MASK_BYTES = 64 << 20
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


class MaskError(ValueError):
    """A mask, a mask file or a mask/model pairing is not valid; the message says what and where."""


def check_ratio_align(ratio: float, align: int, head_dim: int) -> None:
    """Raise MaskError unless ``ratio`` is in [0, 1) and ``align`` is a positive divisor of ``head_dim``."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (0.0 <= float(ratio) < 1.0):
        raise MaskError(f"ratio must be a number in [0, 1) (the fraction of K channels pruned), got {ratio!r}")
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or head_dim % align != 0:
        raise MaskError(f"align must be a positive integer that divides head_dim={head_dim}, got {align!r}")


def model_shape(model_config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers config (text config for multimodal ones)."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    layers = int(cfg.num_hidden_layers)
    q_heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or q_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads
    return layers, kv_heads, int(head_dim)


def model_positions(model_config: Any) -> int | None:
    """How many positions the model was built for (``max_position_embeddings``), None where it does not say.

    Every entry point bounds prompt + new tokens by it: beyond it a model decodes garbage (or runs
    until memory is gone) and transformers only warns.
    """
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    value = getattr(cfg, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _quantile(flat: torch.Tensor, q: float) -> torch.Tensor:
    """Linear-interpolation quantile of an already sorted 1-D tensor, without torch.quantile's 16M-element limit."""
    pos = q * (flat.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, flat.numel() - 1)
    return flat[lo] + (flat[hi] - flat[lo]) * (pos - lo)


def _counts(s: torch.Tensor, threshold: torch.Tensor, align: int) -> torch.Tensor:
    above = (s > threshold).sum(-1)
    return torch.floor(above.float() / align + 0.5).long().mul(align).clamp(0, s.shape[-1])


def dense_layers_of(model_config: Any) -> tuple[int, ...]:
    """Layers LeanK leaves whole: the model's sliding-window (or chunked) attention layers.

    Their cache is already bounded by the window and stays the model's own cache layer; LeanK
    prunes only full (global) attention layers. Layer types come from transformers itself
    (``get_layer_types_and_kwargs``: ``config.layer_types``, else ``sliding_window``). A window at
    least ``max_position_embeddings`` long never bites (Phi-3-128k's 262144): such a layer is global.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    types, kwargs = get_layer_types_and_kwargs(cfg)
    limit = getattr(cfg, "max_position_embeddings", None)
    return tuple(
        i
        for i, (kind, kw) in enumerate(zip(types, kwargs, strict=True))
        if kind != "full_attention"
        and not (limit is not None and kw.get("sliding_window") is not None and kw["sliding_window"] >= limit)
    )


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


def _check_dense_layers(dense_layers: Any, num_layers: int) -> tuple[int, ...]:
    """``dense_layers`` as a sorted tuple of distinct layer indices, or MaskError."""
    if isinstance(dense_layers, (str, bytes)) or not hasattr(dense_layers, "__iter__"):
        raise MaskError(f"dense_layers must be a list of layer indices, got {dense_layers!r}")
    out = tuple(sorted(set(dense_layers)))
    bad = [i for i in out if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise MaskError(f"dense_layers must be layer indices in [0, {num_layers}), got {bad}")
    return out


def binarize(
    scores: torch.Tensor, ratio: float, align: int, min_kept: int = 0, dense_layers: Any = ()
) -> torch.Tensor:
    """LeanK's binarisation (LEANK.md, stage 2): global quantile, per-head count rounded to ``align``, top-k.

    The threshold is the ``ratio``-quantile of all scores; a head keeps
    ``round(#scores above threshold / align) * align`` channels, namely its highest-scoring ones.
    Ties are broken by channel index, so the result is deterministic. ``dense_layers`` (sliding-window
    layers) keep every channel and take no part in the quantile: ``ratio`` is the pruned fraction of
    the layers LeanK prunes.

    ``min_kept > 0`` favours whole-head pruning: a head that would keep fewer than ``min_kept``
    channels keeps none (its V is then dropped too), and the channel budget it frees goes to the
    other heads (the threshold is the one whose total kept count is nearest the budget).
    """
    if scores.ndim != 3:
        raise MaskError(f"scores must be [layers, kv_heads, head_dim], got shape {tuple(scores.shape)}")
    head_dim = scores.shape[-1]
    check_ratio_align(ratio, align, head_dim)
    if not 0 <= min_kept <= head_dim:
        raise MaskError(f"min_kept must be in [0, head_dim={head_dim}], got {min_kept}")
    s = scores.detach().float().cpu()
    if not torch.isfinite(s).all():
        raise MaskError("scores contain NaN or inf; cannot binarise")
    dense = _check_dense_layers(dense_layers, s.shape[0])
    pruned = [i for i in range(s.shape[0]) if i not in dense]
    if not pruned:
        raise MaskError("every layer is a dense (sliding-window) layer: LeanK has no global layer to prune")
    if not 0 <= min_kept <= head_dim:
        raise MaskError(f"min_kept must be in [0, head_dim={head_dim}], got {min_kept}")
    sp = s[pruned]
    flat = sp.flatten().sort().values
    counts_p = _counts(sp, _quantile(flat, ratio), align)
    if min_kept > 0:
        # the total kept falls as the threshold rises: bisect for the threshold whose total is nearest the budget
        budget = (1 - ratio) * sp.numel()

        def total(i: int) -> torch.Tensor:
            c = _counts(sp, flat[i], align)
            return c * (c >= min_kept)

        lo, hi = 0, flat.numel() - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if total(mid).sum() <= budget:
                hi = mid
            else:
                lo = mid + 1
        counts_p = total(lo)
        if lo > 0 and abs(total(lo - 1).sum() - budget) < abs(counts_p.sum() - budget):
            counts_p = total(lo - 1)
    counts = torch.full(s.shape[:2], head_dim, dtype=torch.long)
    counts[pruned] = counts_p
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(head_dim).expand_as(order).contiguous())
    keep = rank < counts.unsqueeze(-1)
    keep[list(dense)] = True
    return keep


@dataclass
class ChannelMask:
    """A static per-(layer, KV head, channel) keep mask for the middle part of the K cache.

    ``keep`` is a bool tensor ``[layers, kv_heads, head_dim]``; ``scores`` the optional float
    scalers it was binarised from. The sizes say which tokens are never pruned: the first
    ``sink_size`` and the last ``recent_size`` (plus up to ``accumu_size`` awaiting compression).
    """

    keep: torch.Tensor
    scores: torch.Tensor | None = None
    sink_size: int = 128
    recent_size: int = 768
    accumu_size: int = 128
    ratio: float = 0.7
    align: int = 32
    base_model: str | None = None
    base_revision: str | None = None
    loader: dict[str, Any] = field(default_factory=dict)
    recipe: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    adapter: str | None = None
    adapter_revision: str | None = None
    dense_layers: tuple[int, ...] = ()
    config_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.keep, torch.Tensor) or self.keep.ndim != 3:
            shape = tuple(self.keep.shape) if isinstance(self.keep, torch.Tensor) else type(self.keep)
            raise MaskError(f"keep must be a 3-D tensor [layers, kv_heads, head_dim], got {shape}")
        if 0 in self.keep.shape:
            raise MaskError(f"keep has an empty dimension {tuple(self.keep.shape)}: layers, heads and head_dim are >= 1")
        if self.keep.dtype != torch.bool:
            if not bool(((self.keep == 0) | (self.keep == 1)).all()):
                raise MaskError("keep must hold only 0 and 1")
            self.keep = self.keep.bool()
        self.keep = self.keep.cpu()
        if self.scores is not None:
            if tuple(self.scores.shape) != tuple(self.keep.shape):
                raise MaskError(
                    f"scores shape {tuple(self.scores.shape)} differs from keep shape {tuple(self.keep.shape)}"
                )
            self.scores = self.scores.detach().float().cpu()
            if not bool(torch.isfinite(self.scores).all()):
                raise MaskError("scores contain NaN or inf")
        for name in ("loader", "extra"):
            if not isinstance(getattr(self, name), dict):
                raise MaskError(f"{name} must be a JSON object (dict), got {type(getattr(self, name)).__name__}")
        gguf = self.loader.get("gguf_file")
        if gguf is not None and inner_file_problem(gguf):
            raise MaskError(f"loader.gguf_file: {inner_file_problem(gguf)}")
        for name in ("base_model", "base_revision", "recipe", "adapter", "adapter_revision"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise MaskError(f"{name} must be a string or null, got {type(value).__name__}")
        for name in ("base_model", "adapter"):  # a local path or a Hub id: either fits the file system's limits
            value = getattr(self, name)
            if value is not None and (not value or len(value) > MAX_LOCAL_PATH or max(map(len, value.split("/"))) > 255):
                raise MaskError(f"{name} {value[:80]!r}{'...' if len(value) > 80 else ''} is neither a folder path "
                                "nor a Hub repo id (empty, or a name too long for any file system)")
        for name in ("base_revision", "adapter_revision"):
            value = getattr(self, name)
            if value is not None and revision_problem(value):
                raise MaskError(f"{name}: {revision_problem(value)}")
        check_ratio_align(self.ratio, self.align, self.head_dim)
        for name in ("sink_size", "recent_size", "accumu_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
                raise MaskError(f"{name} must be an integer in [0, {MAX_TOKENS}], got {value!r}")
        if self.accumu_size < 1:
            raise MaskError(f"accumu_size must be at least 1, got {self.accumu_size}")
        if self.adapter_revision is not None and self.adapter is None:
            raise MaskError("adapter_revision is set but adapter is not")
        self.config_overrides = check_config_overrides(self.config_overrides)
        self.dense_layers = _check_dense_layers(self.dense_layers, self.num_layers)
        partial = [i for i in self.dense_layers if not bool(self.keep[i].all())]
        if partial:
            raise MaskError(f"dense_layers {partial} must keep every channel (their cache is never pruned)")

    # ---- shape ---------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.keep.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keep.shape[1]

    @property
    def head_dim(self) -> int:
        return self.keep.shape[2]

    @property
    def kept_counts(self) -> torch.Tensor:
        """Kept channels per (layer, KV head), int64 ``[layers, kv_heads]``."""
        return self.keep.sum(-1)

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_scores(
        cls, scores: torch.Tensor, ratio: float = 0.7, align: int = 32, min_kept: int = 0, **meta: Any
    ) -> ChannelMask:
        """Binarise learned scalers with LeanK's rule (see :func:`binarize`); ``meta`` fills the other fields."""
        keep = binarize(scores, ratio, align, min_kept, meta.get("dense_layers", ()))
        return cls(keep=keep, scores=scores, ratio=float(ratio), align=int(align), **meta)

    @classmethod
    def full(cls, num_layers: int, num_kv_heads: int, head_dim: int, **meta: Any) -> ChannelMask:
        """A mask that keeps every channel (LeanK decoding then equals dense decoding)."""
        meta.setdefault("ratio", 0.0)
        meta.setdefault("align", 1)
        return cls(keep=torch.ones(num_layers, num_kv_heads, head_dim, dtype=torch.bool), **meta)

    # ---- checks and statistics -------------------------------------------------------------
    def validate(self, model_config: Any) -> None:
        """Raise MaskError naming the first field where this mask does not fit ``model_config``."""
        layers, kv_heads, head_dim = model_shape(model_config)
        for name, want, got in (
            ("num_layers", layers, self.num_layers),
            ("num_kv_heads", kv_heads, self.num_kv_heads),
            ("head_dim", head_dim, self.head_dim),
        ):
            if want != got:
                raise MaskError(
                    f"mask does not fit the model: {name} is {got} in the mask but {want} in the model "
                    f"(mask base_model={self.base_model!r}, model={getattr(model_config, '_name_or_path', '?')!r})"
                )
        pruned = [i for i in dense_layers_of(model_config) if not bool(self.keep[i].all())]
        if pruned:
            raise MaskError(
                f"mask does not fit the model: layers {pruned} use sliding-window attention, which LeanK leaves "
                "whole (their cache is bounded by the window), but the mask prunes channels there"
            )

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.float16) -> dict[str, int]:
        """K+V bytes one token costs in every layer: dense, and a LeanK middle (pruned) token."""
        item = torch.empty((), dtype=dtype).element_size()
        dense = 2 * self.num_layers * self.num_kv_heads * self.head_dim * item
        k = int(self.keep.sum()) * item
        v = int((self.kept_counts > 0).sum()) * self.head_dim * item
        return {"dense": dense, "leank_middle": k + v}

    def full_token_count(self, seq_len: int) -> tuple[int, int]:
        """(full tokens, pruned middle tokens) that a cache holds right after a prefill of ``seq_len`` tokens."""
        middle = max(0, seq_len - self.sink_size - self.recent_size)
        return seq_len - middle, middle

    def kv_cache_bytes(self, seq_len: int, batch_size: int = 1, dtype: torch.dtype = torch.float16) -> int:
        """Bytes of K/V a LeanK cache holds after a prefill of ``seq_len`` tokens (the formula the cache meets)."""
        per = self.kv_bytes_per_token(dtype)
        full, middle = self.full_token_count(seq_len)
        return batch_size * (full * per["dense"] + middle * per["leank_middle"])

    def stats(self, model_config: Any = None, dtype: torch.dtype = torch.float16) -> dict[str, Any]:
        """What the mask saves: kept fractions, zero heads, per-layer counts, bytes/token dense vs LeanK."""
        if model_config is not None:
            self.validate(model_config)
        counts = self.kept_counts
        per = self.kv_bytes_per_token(dtype)
        return {
            "k_kept_fraction": float(self.keep.float().mean()),
            "v_kept_fraction": float((counts > 0).float().mean()),
            "zero_heads": int((counts == 0).sum()),
            "total_heads": counts.numel(),
            "per_layer": counts.tolist(),
            "bytes_per_token": {
                "dtype": str(dtype).replace("torch.", ""),
                "dense": per["dense"],
                "leank": per["leank_middle"],
                "ratio": per["leank_middle"] / per["dense"],
            },
        }

    # ---- files ------------------------------------------------------------------------------
    def to_config(self) -> dict[str, Any]:
        """The ``config.json`` object; adapter, override and dense-layer fields appear only when set (old readers)."""
        adapter = {"adapter": self.adapter, "adapter_revision": self.adapter_revision} if self.adapter else {}
        overrides = {"config_overrides": dict(self.config_overrides)} if self.config_overrides else {}
        return {
            "format_version": 3 if overrides else 2 if adapter else 1,
            "base_model": self.base_model,
            "base_revision": self.base_revision,
            **adapter,
            **overrides,
            "loader": dict(self.loader),
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "sink_size": self.sink_size,
            "recent_size": self.recent_size,
            "accumu_size": self.accumu_size,
            "ratio": self.ratio,
            "align": self.align,
            **({"dense_layers": list(self.dense_layers)} if self.dense_layers else {}),
            "recipe": self.recipe,
            **({"extra": self.extra} if self.extra else {}),
        }

    def write_files(self, folder: str | os.PathLike) -> None:
        """Write ``mask.safetensors`` and ``config.json`` into ``folder`` as they are (a fresh folder being
        built by :func:`write_mask_folder`; :meth:`save_pretrained` is the safe way to write a mask)."""
        from safetensors.torch import save_file

        tensors = {"keep": self.keep.to(torch.uint8).contiguous()}
        if self.scores is not None:
            tensors["scores"] = self.scores.float().contiguous()
        save_file(tensors, str(Path(folder) / MASK_FILE), metadata={"format": "leank"})
        text = json.dumps(self.to_config(), indent=2, sort_keys=False) + "\n"
        (Path(folder) / CONFIG_FILE).write_text(text)

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Make ``save_directory`` a mask folder holding this mask, as a whole (see :func:`write_mask_folder`).

        It may be a new or empty folder or an older mask repo (which is replaced, card and plot
        included); a file, a link or any other folder is refused with a MaskError.
        """
        return write_mask_folder(save_directory, self.write_files)

    @classmethod
    def from_pretrained(
        cls, path_or_repo: str | os.PathLike, revision: str | None = None, **hub_kwargs: Any
    ) -> ChannelMask:
        """Load a mask from a local folder or a Hub repo id (only safetensors and JSON are read)."""
        from ..hub.transfer import resolve_mask_dir

        folder = resolve_mask_dir(path_or_repo, revision=revision, **hub_kwargs)
        return cls.from_dir(folder)

    @classmethod
    def from_dir(cls, folder: str | os.PathLike) -> ChannelMask:
        """Load and check a local mask folder; every problem is one MaskError naming the file.

        Both files are read through one handle on the folder, so a folder swapped in by a concurrent
        :meth:`save_pretrained` is read whole, old or new, never half of each.
        """
        folder = Path(folder)
        cfg_path, mask_path = folder / CONFIG_FILE, folder / MASK_FILE
        cfg_bytes, mask_bytes = _read_mask_folder(folder)
        cfg = _parse_config(cfg_bytes, cfg_path)
        version = cfg.get("format_version")
        if type(version) is not int or version not in READ_VERSIONS:
            raise MaskError(
                f"{cfg_path}: unknown format_version {version!r} (this leank reads versions {READ_VERSIONS})"
            )
        missing = [k for k in REQUIRED_KEYS if k not in cfg]
        if missing:
            raise MaskError(f"{cfg_path} lacks required keys: {', '.join(missing)}")
        for key in ("num_layers", "num_kv_heads", "head_dim"):
            if type(cfg[key]) is not int or cfg[key] < 1:
                raise MaskError(f"{cfg_path}: {key} must be a positive integer, got {cfg[key]!r}")
        tensors = _read_safetensors(mask_bytes, mask_path)
        if "keep" not in tensors:
            raise MaskError(f"{mask_path} has no tensor named 'keep'")
        keep = tensors["keep"]
        want = (cfg["num_layers"], cfg["num_kv_heads"], cfg["head_dim"])
        if tuple(keep.shape) != tuple(want):
            raise MaskError(f"{mask_path}: keep has shape {tuple(keep.shape)} but {cfg_path.name} says {want}")
        if keep.dtype != torch.uint8:
            raise MaskError(f"{mask_path}: keep must be uint8, got {keep.dtype}")
        scores = tensors.get("scores")
        if scores is not None and tuple(scores.shape) != tuple(want):
            raise MaskError(f"{mask_path}: scores has shape {tuple(scores.shape)}, expected {want}")
        try:
            return cls(
                keep=keep,
                scores=scores,
                sink_size=cfg["sink_size"],
                recent_size=cfg["recent_size"],
                accumu_size=cfg["accumu_size"],
                ratio=cfg["ratio"],
                align=cfg["align"],
                base_model=cfg.get("base_model"),
                base_revision=cfg.get("base_revision"),
                loader=_or(cfg.get("loader"), {}),
                recipe=cfg.get("recipe"),
                extra=_or(cfg.get("extra"), {}),
                adapter=cfg.get("adapter"),
                adapter_revision=cfg.get("adapter_revision"),
                dense_layers=_or(cfg.get("dense_layers"), ()),
                config_overrides=_or(cfg.get("config_overrides"), {}),
            )
        except MaskError as e:
            raise MaskError(f"{folder}: {e}") from None

    def push_to_hub(self, repo_id: str, **kwargs: Any) -> str:
        """Upload this mask (and its model card) to the Hub in one commit; see :func:`leank_infer.hub.transfer.push_mask`."""
        from ..hub.transfer import push_mask

        return push_mask(self, repo_id, **kwargs)

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"ChannelMask(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"k_kept={s['k_kept_fraction']:.3f}, zero_heads={s['zero_heads']}, sink={self.sink_size}, "
            f"recent={self.recent_size}, accumu={self.accumu_size}, base_model={self.base_model!r})"
        )


def _or(value: Any, default: Any) -> Any:
    """A config field's value, its default where it is null (an empty list is not an empty dict)."""
    return default if value is None else value


def is_mask_repo(folder: Path) -> bool:
    """Whether ``folder`` is a mask repo leank may replace: mask or config (a damaged repo may lack one),
    and nothing but a mask repo's own files (mask, config, card, eval.json, plots), none of them a link."""
    import fnmatch

    from ..hub.transfer import ALLOW_PATTERNS

    names = {p.name: p for p in folder.iterdir()}
    return (
        (MASK_FILE in names or CONFIG_FILE in names)
        and all(
            p.is_file() and not p.is_symlink() and any(fnmatch.fnmatch(n, pat) for pat in ALLOW_PATTERNS)
            for n, p in names.items()
        )
    )


def check_mask_target(target: str | os.PathLike) -> None:
    """Raise MaskError unless ``target`` is a place a mask repo may be written (new, empty, or a mask repo)."""
    why = refusal(Path(target), is_mask_repo, "mask repo")
    if why:
        raise MaskError(why)


def write_mask_folder(target: str | os.PathLike, fill: Any) -> Path:
    """Make ``target`` exactly what ``fill(tmp)`` writes (mask files, card, plot), swapped in as a whole.

    Only a new or empty folder or an older mask repo is replaced; a file, a symlink, ``/`` or a
    folder with other files is refused up front (MaskError, nothing written). Concurrent writers
    take turns; readers see the old folder or the new one. See :mod:`leank_infer.folders.atomic`.
    """
    try:
        return write_folder(target, fill, is_mask_repo, "mask repo")
    except FolderError as e:
        raise MaskError(str(e)) from None


class _Vanished(Exception):
    """A file disappeared while reading (the folder was being swapped, or it is missing)."""


def _read_limited(dir_fd: int, folder: Path, name: str, limit: int) -> bytes:
    """The bytes of regular file ``name`` in the folder open as ``dir_fd``, at most ``limit`` of them."""
    path = folder / name
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)  # a FIFO must not block
    except FileNotFoundError:
        raise _Vanished(name) from None
    except OSError as e:
        raise MaskError(f"{path} cannot be opened: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = ("folder" if stat.S_ISDIR(info.st_mode) else "pipe (FIFO)" if stat.S_ISFIFO(info.st_mode)
                    else "device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else "socket or other")
            raise MaskError(f"{path} is a {kind}, not a regular file; a mask folder holds plain files only")
        if info.st_size > limit:
            raise MaskError(f"{path} is {info.st_size:,} bytes; a mask's {name} may hold at most {limit:,}")
        chunks, size = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise MaskError(f"{path} holds more than {limit:,} bytes, the most a mask's {name} may hold")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read_mask_folder(folder: Path) -> tuple[bytes, bytes]:
    """(config.json, mask.safetensors) bytes, both from one version of ``folder`` (retried if it was swapped)."""
    for attempt in range(20):
        try:
            dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if attempt < 3:  # a writer without an atomic exchange moves the old folder aside for a moment
                time.sleep(0.01)
                continue
            raise MaskError(f"mask folder {folder} does not exist") from None
        except NotADirectoryError:
            raise MaskError(f"{folder} is not a folder") from None
        except OSError as e:
            raise MaskError(f"mask folder {folder} cannot be opened: {e.strerror}") from None
        try:
            return (
                _read_limited(dir_fd, folder, CONFIG_FILE, MAX_CONFIG_BYTES),
                _read_limited(dir_fd, folder, MASK_FILE, MAX_MASK_BYTES),
            )
        except _Vanished as e:
            if not _swapped(folder, dir_fd):
                where = folder if folder.is_absolute() else f"{folder} (that is {folder.absolute()})"
                raise MaskError(f"{e} is missing in {where}") from None
        finally:
            os.close(dir_fd)
    raise MaskError(f"mask folder {folder} kept changing while it was read; try again")


def _swapped(folder: Path, dir_fd: int) -> bool:
    """Whether ``folder`` now names another folder than the one open as ``dir_fd`` (a writer replaced it)."""
    held = os.fstat(dir_fd)
    try:
        now = os.stat(folder)
    except OSError:
        return True
    return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)


def _json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            depth = max(depth, d)
            if d <= MAX_JSON_DEPTH:
                stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return depth


def _parse_config(data: bytes, path: Path) -> dict[str, Any]:
    """``config.json`` as a dict; anything else (bad UTF-8 or JSON, too deep, huge numbers) is one MaskError."""
    try:
        cfg = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise MaskError(f"{path} is not UTF-8 text: {e}") from None
    except RecursionError:
        raise MaskError(f"{path} nests JSON too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as e:  # JSONDecodeError, and integers too long to convert
        raise MaskError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise MaskError(f"{path} must hold a JSON object")
    if _json_depth(cfg) > MAX_JSON_DEPTH:
        raise MaskError(f"{path} nests JSON too deeply (at most {MAX_JSON_DEPTH} levels)")
    return cfg


def _read_safetensors(data: bytes, path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise MaskError(f"{path} is damaged or truncated and cannot be read as safetensors: {e}") from None
