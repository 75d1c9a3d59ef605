"""``leank import``: a mask released with the LeanK reference implementation -> a leank mask repo folder.

The paper's authors ship their learned masks as PyTorch pickles inside Microsoft's MInference
repository (``minference/configs/leank/*.pth``), read by their decode patch. This is the only
place in leank that reads a pickle, and only through PyTorch's weights-only loader (no code is
executed: only tensors and plain containers are rebuilt); what it writes is the safe mask format
(safetensors + JSON), so nothing on the load path of a mask repo ever unpickles anything.

    leank import ../shared/reference-masks/llama3.1-8b-instruct.pth hub/llama-3.1-8b-instruct

The folder holds ``mask.safetensors`` + ``config.json`` (the reference's decode sizes, ratio and
align derived from the mask, provenance), the licence text, a model card and the pattern plot.
It is written into a temporary folder beside the target and renamed into place at the end, so a
failure leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch

from .mask import ChannelMask, MaskError, check_mask_target, write_mask_folder
from .mask.format import MAX_MASK_BYTES

REFERENCE_REPO = "https://github.com/microsoft/MInference"
REFERENCE_COMMIT = "fb56c917f618e8645f1cfc37535afd7424d78f0d"
# The decode sizes of the reference's patch: defaults of ``patch_leank`` / ``LeanKCache`` in
# minference/modules/leank.py at REFERENCE_COMMIT (``sink_size`` 128, ``recent_size`` 768,
# ``accumu_size`` 128; its patch reads the accumulation size from the ``recent_size`` key with
# default 128, which with default settings still gives 128).
REFERENCE_SIZES = {"sink_size": 128, "recent_size": 768, "accumu_size": 128}
REFERENCE_LICENSE = "MIT"
REFERENCE_COPYRIGHT = "Copyright (c) Microsoft Corporation"

# What the authors report for these masks (paper abstract, arXiv 2508.02215, and LeanK/README.md at
# REFERENCE_COMMIT). Quoted claims, never measured by leank; the card labels them so.
REFERENCE_REPORTED = [
    "up to 70% of the K cache and 16%-18% of the V cache memory removed \"without sacrificing accuracy\" "
    "(paper abstract, arXiv 2508.02215; evaluated on RULER and LongBench)",
    "decode attention kernel 5.31 ms dense vs 4.13 ms LeanK (1.3x; LeanK/README.md, kernel benchmark)",
]

# Files released at REFERENCE_COMMIT, by sha256: base model, path in that repository, parameters of the
# base model (its published size; tests/test_reference_masks.py recounts them from the real config).
KNOWN_RELEASES: dict[str, dict[str, Any]] = {
    "b254888925227e6efdc470e626c419c261f61fa8916ec15a1f668c5d3881ab57": {
        "base_model": "meta-llama/Llama-3.1-8B-Instruct",
        "path": "minference/configs/leank/llama3.1-8b-instruct.pth",
        "base_model_parameters": 8_030_261_248,
        "reported": [
            "Llama-3.1-8B-Instruct end to end at batch 52 x 4096 tokens: generation 47.27 s dense (HF) vs 38.32 s "
            "LeanK, peak memory 64.64 vs 57.27 GB; LeanK at batch 64 (1.2x larger): 47.62 s, 67.03 GB (LeanK/README.md)",
        ],
    },
    "e28fef532083f9862880311e882cf4bb40662e1b2fdecbb680118a051c2bb0d5": {
        "base_model": "Qwen/Qwen2.5-7B-Instruct",
        "path": "minference/configs/leank/qwen2.5-7b-insturct.pth",  # (sic) as named upstream
        "base_model_parameters": 7_615_616_512,
        "notes": [
            "Qwen2.5-7B-Instruct's native context is 32,768 tokens; longer contexts need YaRN (rope_scaling factor "
            "4). The reference trains Qwen masks with and without YaRN (LeanK/scripts/qwen2.5-7b.yaml, "
            "qwen2.5-7b-yarn.yaml) and does not record which setting produced this file.",
        ],
    },
}


class ReferenceMaskError(MaskError):
    """A reference mask file is not the single 0/1 ``[layers, kv_heads, head_dim]`` tensor expected."""


def sha256_of(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_reference_mask(path: str | os.PathLike) -> torch.Tensor:
    """The keep tensor of a reference ``.pth``, as bool ``[layers, kv_heads, head_dim]``.

    Read with ``torch.load(weights_only=True)`` (PyTorch's restricted unpickler: tensors and plain
    containers only, no code runs). Anything but one real-valued 3-D tensor of 0s and 1s is refused.
    """
    path = Path(path)
    if not path.is_file():
        raise ReferenceMaskError(f"{path}: no such file")
    check_archive(path)
    try:  # mmap: a storage is mapped from the file (bounded just above), never decompressed or copied whole
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - the weights-only unpickler raises many kinds; each means "refused"
        text = " ".join(str(e).split())[:300]
        raise ReferenceMaskError(
            f"{path} cannot be read with PyTorch's weights-only loader ({type(e).__name__}: {text}); "
            "only a plain tensor file is accepted"
        ) from None
    if not isinstance(obj, torch.Tensor):
        raise ReferenceMaskError(
            f"{path} holds a {type(obj).__name__}, not a single tensor [layers, kv_heads, head_dim]"
        )
    t = obj.detach()
    if t.layout != torch.strided or t.device.type != "cpu":
        raise ReferenceMaskError(f"{path}: expected a dense tensor, got a {t.layout} tensor on {t.device.type} "
                                 "(sparse and meta tensors hold no mask)")
    if t.ndim != 3 or min(t.shape) < 1:
        raise ReferenceMaskError(f"{path}: expected a tensor [layers, kv_heads, head_dim], got shape {tuple(t.shape)}")
    if t.numel() > MAX_MASK_BYTES:  # e.g. a stride-0 view: 1.6 KB on disk, 2e9 elements once compared
        raise ReferenceMaskError(f"{path}: the tensor has {t.numel():,} elements; a mask has at most {MAX_MASK_BYTES:,}")
    if t.is_complex() or not (t.is_floating_point() or t.dtype in (torch.bool, torch.uint8, torch.int8,
                                                                     torch.int16, torch.int32, torch.int64)):
        raise ReferenceMaskError(f"{path}: expected a real-valued 0/1 tensor, got dtype {t.dtype}")
    if not bool(((t == 0) | (t == 1)).all()):
        bad = t[(t != 0) & (t != 1)].flatten()[:3].tolist()
        raise ReferenceMaskError(f"{path}: a keep mask holds only 0 and 1, found e.g. {bad}")
    return t.bool().contiguous()


def check_archive(path: Path) -> None:
    """Refuse a ``.pth`` whose sizes could make loading it allocate more than a mask ever needs: the file
    bounded like ``mask.safetensors``, a ``torch.save`` zip archive (the legacy format declares storage
    sizes the loader allocates before reading), its entries stored as ``torch.save`` writes them (a
    compressed entry could inflate a 2 MB file to gigabytes), their total size bounded too."""
    size = path.stat().st_size
    if size > MAX_MASK_BYTES:
        raise ReferenceMaskError(f"{path} is {size:,} bytes; a mask file is at most {MAX_MASK_BYTES:,}")
    if not zipfile.is_zipfile(path):
        raise ReferenceMaskError(
            f"{path} cannot be read with PyTorch's weights-only loader: it is not a torch.save zip archive "
            "(the legacy format is not read)"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise ReferenceMaskError(f"{path} is a damaged zip archive: {e}") from None
    packed = [e.filename for e in entries if e.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise ReferenceMaskError(f"{path}: entry {packed[0]} is compressed; torch.save stores its entries as they "
                                 "are, and a compressed one could inflate without bound")
    total = sum(e.file_size for e in entries)
    if total > MAX_MASK_BYTES:
        raise ReferenceMaskError(f"{path}: its entries hold {total:,} bytes; a mask file is at most {MAX_MASK_BYTES:,}")


def derived_align(keep: torch.Tensor) -> int:
    """The largest alignment every per-head kept count honours (a divisor of head_dim)."""
    return math.gcd(keep.shape[-1], *(int(c) for c in keep.sum(-1).flatten()))


def reference_mask(
    keep: torch.Tensor,
    base_model: str,
    source: dict[str, Any],
    base_model_parameters: int | None = None,
) -> ChannelMask:
    """A ChannelMask for a reference keep tensor: reference decode sizes, ratio/align from the mask, provenance."""
    kept = float(keep.float().mean())
    if kept == 0.0:
        raise ReferenceMaskError("the mask keeps no channel at all; nothing to import")
    extra: dict[str, Any] = {"provenance": source}
    if base_model_parameters:
        extra["base_model_parameters"] = int(base_model_parameters)
    return ChannelMask(
        keep=keep,
        ratio=round(1.0 - kept, 6),
        align=derived_align(keep),
        base_model=base_model,
        extra=extra,
        **REFERENCE_SIZES,
    )


def import_reference_mask(
    pth: str | os.PathLike,
    out_dir: str | os.PathLike,
    base_model: str | None = None,
    license_file: str | os.PathLike | None = None,
    repo: str | None = None,
    force: bool = False,
    source_path: str | None = None,
    commit: str = REFERENCE_COMMIT,
) -> ChannelMask:
    """Convert a reference ``.pth`` into the mask repo folder ``out_dir`` (see the module docstring).

    A file released at ``REFERENCE_COMMIT`` is recognised by its sha256 (base model, upstream path and
    base-model size then default from ``KNOWN_RELEASES``); any other needs ``base_model``. The licence
    text (``license_file``, default ``LICENSE`` beside the file) is copied into the folder: the MIT
    notice must travel with every copy. ``repo`` is the name the card's usage snippet loads.
    """
    pth, out = Path(pth), Path(out_dir)
    if out.exists() and not force:
        raise ReferenceMaskError(f"{out} already exists (pass --force to replace it)")
    check_mask_target(out)  # a file, a link, '/' or a folder of other files: refused before anything is read
    keep = read_reference_mask(pth)
    digest = sha256_of(pth)
    known = KNOWN_RELEASES.get(digest, {})
    base_model = base_model or known.get("base_model")
    if not base_model:
        raise ReferenceMaskError(
            f"{pth} is not a release known to leank (sha256 {digest[:12]}...): name its base model with --base-model"
        )
    lic = Path(license_file) if license_file else pth.parent / "LICENSE"
    if not lic.is_file():
        raise ReferenceMaskError(
            f"licence file {lic} not found: the reference masks are MIT-licensed and their notice must travel "
            "with them (pass --license-file)"
        )
    source = {
        "source": REFERENCE_REPO,
        "commit": commit,
        "path": source_path or known.get("path") or pth.name,
        "sha256": digest,
        "license": REFERENCE_LICENSE,
        "copyright": REFERENCE_COPYRIGHT,
        "license_file": "LICENSE",
        "trained_by": "the LeanK authors (reference implementation)",
        "trained_by_leank": False,
        "converted_by": "leank import",
        "reported": REFERENCE_REPORTED + known.get("reported", []),
        "notes": known.get("notes", []),
    }
    mask = reference_mask(keep, base_model, source, known.get("base_model_parameters"))

    def write(folder: Path) -> None:  # straight into the fresh folder (no nested folder swap inside it)
        from .hub.card import write_card_files

        mask.write_files(folder)
        shutil.copyfile(lic, folder / "LICENSE")
        write_card_files(folder, repo=repo or str(out_dir))

    write_mask_folder(out, write)
    return mask


def import_command(
    pth: str,
    out_dir: str,
    *,
    base_model: str | None = None,
    license_file: str | None = None,
    source_path: str | None = None,
    commit: str = REFERENCE_COMMIT,
    repo: str | None = None,
    force: bool = False,
) -> int:
    """Convert a mask released with the LeanK reference implementation (.pth) into a mask repo folder.

    Args:
        pth: reference mask file (one 0/1 tensor [layers, kv_heads, head_dim], read weights-only).
        out_dir: mask repo folder to write (mask.safetensors, config.json, LICENSE, README.md, pattern.png).
        base_model: Hub id of the base model (default: known from the file's sha256 for the released masks).
        license_file: licence text to copy (default: LICENSE beside the file).
        source_path: path of the file in the reference repository (provenance).
        commit: reference repository commit the file comes from.
        repo: name the card's usage snippet loads (default: OUT_DIR as given).
        force: replace an existing mask repo folder.
    """
    mask = import_reference_mask(
        pth, out_dir, base_model=base_model, license_file=license_file, repo=repo,
        force=force, source_path=source_path, commit=commit,
    )  # fmt: skip
    print(f"wrote {out_dir}: {mask!r}")
    return 0
