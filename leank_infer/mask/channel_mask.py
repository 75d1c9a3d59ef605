"""``ChannelMask``: one learned keep mask and the sizes it was trained for, as one checked object.

The format and file names are in :mod:`.format`, reading and writing the folder in :mod:`.folder`,
the binarisation rule in :mod:`.binarize`, which layers it prunes in :mod:`.layers`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..folders.names import MAX_LOCAL_PATH, control_characters, inner_file_problem, revision_problem
from .binarize import binarize, check_ratio_align
from .folder import check_config_header, parse_config, read_mask_files, read_safetensors, write_mask_folder
from .format import (
    CONFIG_FILE,
    MASK_FILE,
    MAX_TOKENS,
    MaskError,
    check_config_overrides,
    format_version,
)
from .kv_bytes import dense_token_bytes, kept_token_bytes
from .layers import check_dense_layers, dense_layers_of, model_shape


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
            if value is not None and (not value or len(value) > MAX_LOCAL_PATH or max(map(len, value.split("/"))) > 255
                                      or control_characters(value)):
                raise MaskError(f"{name} {value[:80]!r}{'...' if len(value) > 80 else ''} is neither a folder path "
                                "nor a Hub repo id (empty, too long for any file system, or with control characters)")
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
        self.dense_layers = check_dense_layers(self.dense_layers, self.num_layers)
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
        return {
            "dense": dense_token_bytes(self.num_layers, self.num_kv_heads, self.head_dim, dtype),
            "leank_middle": kept_token_bytes(self.kept_counts, self.head_dim, dtype),
        }

    def full_token_count(self, seq_len: int) -> tuple[int, int]:
        """(full tokens, pruned middle tokens) that a cache holds right after a prefill of ``seq_len`` tokens: the
        middle ends where the next query's recent part begins (:func:`~leank_infer.decode.rule.positional_recent_from`)."""
        from ..decode.rule import positional_recent_from

        middle = max(0, positional_recent_from(seq_len, self.recent_size, self.accumu_size) - self.sink_size)
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
                "leank_over_dense": per["leank_middle"] / per["dense"],
            },
        }

    # ---- files ------------------------------------------------------------------------------
    def to_config(self) -> dict[str, Any]:
        """The ``config.json`` object; adapter, override and dense-layer fields appear only when set (old readers)."""
        adapter = {"adapter": self.adapter, "adapter_revision": self.adapter_revision} if self.adapter else {}
        overrides = {"config_overrides": dict(self.config_overrides)} if self.config_overrides else {}
        return {
            "format_version": format_version(adapter=bool(adapter), config_overrides=bool(overrides)),
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
        cfg_bytes, mask_bytes = read_mask_files(folder)
        cfg = parse_config(cfg_bytes, cfg_path)
        check_config_header(cfg, cfg_path)
        for key in ("num_layers", "num_kv_heads", "head_dim"):
            if type(cfg[key]) is not int or cfg[key] < 1:
                raise MaskError(f"{cfg_path}: {key} must be a positive integer, got {cfg[key]!r}")
        tensors = read_safetensors(mask_bytes, mask_path)
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
        """Upload this mask (and its model card) to the Hub in one commit; see :func:`leank_infer.hub.publish.push_mask`."""
        from ..hub.publish import push_mask

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
