"""Publish a mask repo: check that the folder loads (or build it, card and plot included), then upload it.

Above the mask and the card: :mod:`leank_infer.hub.transfer` moves folders and knows nothing of either.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..mask import ChannelMask
from .card import write_card_files
from .transfer import check_push_target, upload_folder

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo


def push_folder(folder: str | os.PathLike, repo_id: str, *, commit_message: str | None = None,
                **upload: Any) -> CommitInfo:
    """Upload the mask repo ``folder`` as it is (card and plot included) in one commit, once it loads.

    ``upload`` goes to :func:`~leank_infer.hub.transfer.upload_folder` (private, revision,
    commit_description, token, endpoint).
    """
    check_push_target(repo_id, upload.get("revision"))
    mask = ChannelMask.from_dir(folder)  # never push something that does not load
    message = commit_message or f"Upload LeanK mask for {mask.base_model or 'its base model'}"
    return upload_folder(Path(folder), repo_id, commit_message=message, **upload)


def push_mask(mask: ChannelMask, repo_id: str, *, folder: str | os.PathLike | None = None,
              commit_message: str | None = None, **upload: Any) -> CommitInfo:
    """Upload ``mask`` in one commit: its ``folder`` as it is when given, else the mask saved to a
    temporary folder with a fresh card and plot pointing at ``repo_id`` (the plot needs matplotlib)."""
    if folder is not None:
        return push_folder(folder, repo_id, commit_message=commit_message, **upload)
    check_push_target(repo_id, upload.get("revision"))
    message = commit_message or f"Upload LeanK mask for {mask.base_model or 'its base model'}"
    with tempfile.TemporaryDirectory() as tmp:
        src = mask.save_pretrained(tmp)
        write_card_files(src, repo=repo_id)
        return upload_folder(src, repo_id, commit_message=message, **upload)
