"""Pulling and pushing mask repos through huggingface_hub (no hand-written HTTP)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .mask import CONFIG_FILE, MASK_FILE, MaskError

if TYPE_CHECKING:
    from .mask import ChannelMask

# What is ever downloaded from a mask repo: safe formats, the card and the plot.
ALLOW_PATTERNS = [MASK_FILE, CONFIG_FILE, "README.md", "*.png"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def resolve_mask_dir(path_or_repo: str | os.PathLike, revision: str | None = None, **hub_kwargs: Any) -> Path:
    """A local folder as is, or a Hub repo id downloaded (or found in the Hub cache) at ``revision``."""
    local = Path(path_or_repo)
    if local.is_dir():
        return local
    repo_id = str(path_or_repo)
    if local.exists() or repo_id.startswith((".", "/")) or repo_id.count("/") > 1:
        raise MaskError(f"mask path {repo_id!r} is not a folder and not a Hub repo id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id!r} at revision {revision or 'main'!r}"
    try:
        folder = Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS, **hub_kwargs)
        )
    except RevisionNotFoundError:
        raise MaskError(f"mask repo {repo_id!r} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise MaskError(f"mask repo {where} not found on the Hub (or it is private and no token was given)") from None
    except EntryNotFoundError as e:
        raise MaskError(f"mask repo {where}: a file is missing ({e})") from None
    except LocalEntryNotFoundError:
        raise MaskError(
            f"mask repo {where} is not in the local Hub cache and the Hub cannot be reached "
            "(offline mode or no network); connect once or pass a local folder"
        ) from None
    except HFValidationError as e:
        raise MaskError(f"{repo_id!r} is not a valid Hub repo id: {e}") from None
    if not (folder / MASK_FILE).is_file():
        _explain_missing(repo_id, revision, folder, **hub_kwargs)
    return folder


def _explain_missing(repo_id: str, revision: str | None, folder: Path, **hub_kwargs: Any) -> None:
    """Raise the right MaskError for a snapshot without mask.safetensors."""
    names: list[str] = []
    try:
        from huggingface_hub import HfApi

        names = HfApi(endpoint=hub_kwargs.get("endpoint")).list_repo_files(
            repo_id, revision=revision, token=hub_kwargs.get("token")
        )
    except Exception:  # offline: the snapshot is all we know
        names = [p.name for p in folder.iterdir()]
    where = f"{repo_id!r} at revision {revision or 'main'!r}"
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise MaskError(
            f"mask repo {where} holds only pickle files ({', '.join(sorted(pickles))}); leank reads "
            "safetensors + JSON only and never unpickles downloaded files"
        )
    raise MaskError(f"mask repo {where} has no {MASK_FILE}")


def push_mask(
    mask: ChannelMask,
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    folder: str | os.PathLike | None = None,
) -> str:
    """Create ``repo_id`` if needed and upload the mask folder in one commit; returns the commit URL.

    ``folder`` (a mask repo folder with its card and plot) is uploaded as is when given;
    otherwise the mask is saved to a temporary folder first.
    """
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision is not None and revision != "main":
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    message = commit_message or f"Upload LeanK mask for {mask.base_model or 'its base model'}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(folder) if folder is not None else mask.save_pretrained(tmp)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(src),
            revision=revision,
            commit_message=message,
            allow_patterns=ALLOW_PATTERNS,
        )
    return str(info)
