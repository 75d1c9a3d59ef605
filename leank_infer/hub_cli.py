"""``leank push DIR REPO_ID``, ``leank pull REPO_ID`` and ``leank card DIR``: the Hub side of mask repos.

push and pull go through huggingface_hub, so ``HF_ENDPOINT``, ``HF_TOKEN`` (or ``hf auth login``),
``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` work as they do for every Hub client.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .cli_types import UsageError
from .mask import ChannelMask, MaskError


def push(
    folder: str, repo_id: str, *, private: bool = False, revision: str | None = None, commit_message: str | None = None
) -> int:
    """Upload a mask repo folder (mask, config, card, plot) to the Hub in one commit.

    Examples:
        leank push runs/mine/mask your-name/smollm2-135m-leank      # the mask leank run --out_dir runs/mine made
        leank push runs/mine/mask your-name/smollm2-135m-leank --revision v2 --private

    Args:
        folder: mask repo folder: mask.safetensors, config.json, README.md, pattern.png.
        repo_id: Hub model repo (owner/name), created if missing.
        private: create the repo private.
        revision: branch to commit to (created from main if missing).
        commit_message: the commit's message.
    """
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled

    from .hub.publish import push_mask
    from .hub.transfer import check_push_target

    try:
        check_push_target(repo_id, revision)
        mask = ChannelMask.from_dir(folder)  # refuse to push something that does not load
        for name in ("README.md", "pattern.png"):
            if not (Path(folder) / name).is_file():
                print(
                    f"leank push: note: {folder} has no {name} "
                    "(write the card and plot with leank_infer.hub.card.write_model_card)",
                    file=sys.stderr,
                )
        info = push_mask(
            mask, repo_id, private=private or None, revision=revision, commit_message=commit_message, folder=folder
        )
    except (MaskError, HfHubHTTPError, HFValidationError, OfflineModeIsEnabled, OSError) as e:
        text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:500]
        raise UsageError(f"{repo_id[:200]} (revision {revision or 'main'}): {text}") from None
    print(info)
    return 0


def pull(repo_id: str, *, revision: str | None = None, cache_dir: str | None = None) -> int:
    """Download a mask repo into the Hub cache (or find it there); print its folder and the mask.

    Examples:
        leank pull your-name/smollm2-135m-leank
        leank pull your-name/smollm2-135m-leank --revision v2

    Args:
        repo_id: Hub model repo (owner/name).
        revision: branch, tag or full commit id (default: main).
        cache_dir: Hub cache folder (default: HF_HUB_CACHE).
    """
    from .hub.transfer import resolve_mask_dir

    kwargs = {"cache_dir": cache_dir} if cache_dir else {}
    folder = resolve_mask_dir(repo_id, revision=revision, **kwargs)
    mask = ChannelMask.from_dir(folder)
    print(folder)
    print(mask)
    return 0


def card(folders: list[str]) -> int:
    """Rewrite mask folders' model cards (README.md) and pattern.png from their files and eval.json, evaluating nothing.

    Args:
        folders: mask folders (mask.safetensors, config.json and, when evaluated, eval.json), e.g. hub/*/.
    """
    from .hub.card import write_model_card

    for folder in folders:
        try:
            write_model_card(folder, repo=str(folder).rstrip("/"))
        except MaskError as e:
            raise UsageError(str(e)) from None
        print(f"card: {Path(folder) / 'README.md'}")
    return 0
