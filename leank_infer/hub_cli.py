"""``leank push DIR REPO_ID`` and ``leank pull REPO_ID``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .mask import ChannelMask, MaskError


def push_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="leank push", description="Upload a mask repo folder in one commit.")
    p.add_argument("folder")
    p.add_argument("repo_id")
    p.add_argument("--private", action="store_true")
    p.add_argument("--revision", default=None, help="branch to commit to (created if missing)")
    p.add_argument("--commit-message", default=None)
    args = p.parse_args(argv)
    try:
        mask = ChannelMask.from_dir(args.folder)  # refuse to push something that does not load
        url = mask.push_to_hub(
            args.repo_id,
            private=args.private or None,
            revision=args.revision,
            commit_message=args.commit_message,
            folder=args.folder,
        )
    except MaskError as e:
        raise SystemExit(f"leank push: {e}") from None
    print(url)
    return 0


def pull_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="leank pull", description="Download a mask repo into the Hub cache.")
    p.add_argument("repo_id")
    p.add_argument("--revision", default=None, help="branch, tag or commit")
    args = p.parse_args(argv)
    from .hub import resolve_mask_dir

    try:
        folder = resolve_mask_dir(args.repo_id, revision=args.revision)
        mask = ChannelMask.from_dir(folder)
    except MaskError as e:
        raise SystemExit(f"leank pull: {e}") from None
    print(folder)
    print(mask)
    return 0
