"""``leank push DIR REPO_ID`` and ``leank pull REPO_ID``: the Hub side of mask repos.

Both go through huggingface_hub, so ``HF_ENDPOINT``, ``HF_TOKEN`` (or ``hf auth login``),
``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` work as they do for every Hub client.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .mask import ChannelMask, MaskError


def push_main(argv: Sequence[str]) -> int:
    """Upload a mask repo folder (mask, config, card, plot) to ``REPO_ID`` in one commit."""
    p = argparse.ArgumentParser(prog="leank push", description="Upload a mask repo folder in one commit.")
    p.add_argument("folder", help="mask repo folder: mask.safetensors, config.json, README.md, pattern.png")
    p.add_argument("repo_id", help="Hub model repo (owner/name), created if missing")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", default=None, help="branch to commit to (created from main if missing)")
    p.add_argument("--commit-message", default=None)
    args = p.parse_args(argv)
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled

    from .hub.publish import push_mask
    from .hub.transfer import check_push_target

    try:
        check_push_target(args.repo_id, args.revision)
        mask = ChannelMask.from_dir(args.folder)  # refuse to push something that does not load
        for name in ("README.md", "pattern.png"):
            if not (Path(args.folder) / name).is_file():
                print(
                    f"leank push: note: {args.folder} has no {name} "
                    "(write the card and plot with leank_infer.hub.card.write_model_card)",
                    file=sys.stderr,
                )
        info = push_mask(
            mask,
            args.repo_id,
            private=args.private or None,
            revision=args.revision,
            commit_message=args.commit_message,
            folder=args.folder,
        )
    except (MaskError, HfHubHTTPError, HFValidationError, OfflineModeIsEnabled, OSError) as e:
        text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:500]
        print(f"leank push: error: {args.repo_id[:200]} (revision {args.revision or 'main'}): {text}", file=sys.stderr)
        return 2
    print(info)
    return 0


def pull_main(argv: Sequence[str]) -> int:
    """Download a mask repo into the Hub cache (or find it there); print its folder and the mask."""
    p = argparse.ArgumentParser(prog="leank pull", description="Download a mask repo into the Hub cache.")
    p.add_argument("repo_id", help="Hub model repo (owner/name)")
    p.add_argument("--revision", default=None, help="branch, tag or full commit id (default: main)")
    p.add_argument("--cache-dir", default=None, help="Hub cache folder (default: HF_HUB_CACHE)")
    args = p.parse_args(argv)
    from .hub.transfer import resolve_mask_dir

    kwargs = {"cache_dir": args.cache_dir} if args.cache_dir else {}
    try:
        folder = resolve_mask_dir(args.repo_id, revision=args.revision, **kwargs)
        mask = ChannelMask.from_dir(folder)
    except MaskError as e:
        print(f"leank pull: error: {e}", file=sys.stderr)
        return 2
    print(folder)
    print(mask)
    return 0
