"""Mask repos to and from the Hub, folder in, folder out, through huggingface_hub's own API.

Pull (:func:`resolve_mask_dir`): the revision resolved to one commit and its listing checked against the
limits, then ``snapshot_download`` of exactly the listed safe files (names, not patterns) at that commit, so the
Hub cache, revision pinning (branch, tag or commit) and offline mode (``HF_HUB_OFFLINE=1``) are
huggingface_hub's; every failure is one :class:`MaskError` that names the repo and the revision.
Push (:func:`upload_folder`): ``create_repo`` (and ``create_branch``), then one ``create_commit``
holding the whole folder. This layer moves folders only: it never builds a mask or a card (that is
:mod:`leank_infer.hub.publish`, above the mask and the card).
``endpoint=`` and ``token=`` reach huggingface_hub unchanged; by default it uses ``HF_ENDPOINT``
and ``HF_TOKEN`` (or the saved login) as usual.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..folders.names import MAX_LOCAL_PATH, repo_id_problem, revision_problem
from ..mask.folder import read_repo_files
from ..mask.format import (
    ALLOW_PATTERNS,
    CONFIG_FILE,
    MASK_FILE,
    MAX_REPO_BYTES,
    MAX_REPO_FILES,
    MaskError,
    file_limit,
)

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_TRUE = {"1", "ON", "YES", "TRUE"}


def is_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set, at import time or since."""
    from huggingface_hub import constants

    env = (os.environ.get(name, "").upper() for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return constants.is_offline_mode() or any(v in _TRUE for v in env)


def _where(repo_id: str, revision: str | None) -> str:
    return f"mask repo {repo_id!r} at revision {revision or 'main'!r}"


def resolve_mask_dir(path_or_repo: str | os.PathLike, revision: str | None = None, **hub_kwargs: Any) -> Path:
    """A local folder as is, or a Hub repo id downloaded (or found in the Hub cache) at ``revision``.

    ``revision`` is a branch, a tag or a full commit id; ``hub_kwargs`` go to
    ``huggingface_hub.snapshot_download`` (``endpoint``, ``token``, ``cache_dir``, ``force_download``...).
    Only :data:`ALLOW_PATTERNS` are fetched: pickle files in a repo are never downloaded.
    """
    repo_id = str(path_or_repo)
    if revision is not None and revision_problem(revision):
        raise MaskError(f"{revision_problem(revision)}; give a branch, a tag or a full commit id")
    if not repo_id.strip():
        raise MaskError("the mask path is empty: give a mask folder or a Hub repo id (owner/name)")
    if len(repo_id) > MAX_LOCAL_PATH:
        raise MaskError(f"mask path of {len(repo_id):,} characters is neither a folder nor a Hub repo id")
    local = Path(path_or_repo)
    try:
        if local.is_dir():
            if revision is not None:
                raise MaskError(f"{repo_id[:200]!r} is a local folder, which has no revisions; revision "
                                f"{revision!r} names a branch, tag or commit of a Hub repo (drop it, or give a repo id)")
            return local
        exists = local.exists()
        why = "it is not a folder" if exists else "no such folder"
    except OSError as e:  # a name too long for the file system, ...
        exists, why = True, e.strerror
    if exists or repo_id.startswith((".", "/", "~")) or repo_id.count("/") > 1:
        raise MaskError(f"mask path {repo_id[:200]!r} is not a folder and not a Hub repo id (owner/name): {why}")
    problem = repo_id_problem(repo_id)
    if problem:
        raise MaskError(f"{repo_id[:200]!r} is neither a local folder nor a valid Hub repo id: {problem[:300]}")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        FileMetadataError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = _where(repo_id, revision)
    endpoint = hub_kwargs.get("endpoint") or constants.ENDPOINT
    if hub_kwargs.get("cache_dir") is not None:
        existing = Path(hub_kwargs["cache_dir"]).absolute()
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise MaskError(f"{where}: the Hub cache {hub_kwargs['cache_dir']} cannot be made: {existing} is a file "
                            "(give a cache folder)")
    if is_offline():
        hub_kwargs["local_files_only"] = True
    try:
        folder = None
        if revision is not None and _COMMIT_RE.fullmatch(revision) and not hub_kwargs.get("local_files_only"):
            try:  # a commit pulled before is served from the cache without a request (its sizes were checked then)
                folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                                **{**hub_kwargs, "local_files_only": True}))
            except LocalEntryNotFoundError:
                folder = None
        if folder is None:
            listed = None if hub_kwargs.get("local_files_only") else checked_download(repo_id, revision, hub_kwargs)
            if listed is None:  # the Hub cannot be asked: the cache is used
                folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                                **hub_kwargs))
            else:  # the exact names listed, at the commit listed: a push meanwhile changes nothing fetched
                names, commit = listed
                folder = Path(snapshot_download(repo_id, revision=commit,
                                                allow_patterns=[glob.escape(n) for n in names], **hub_kwargs))
                _check_downloaded(folder, names, where)
                _remember_revision(folder, revision, commit)
    except HFValidationError as e:
        raise MaskError(f"{repo_id!r} is neither a local folder nor a valid Hub repo id: {e}") from None
    except RevisionNotFoundError:
        raise MaskError(f"{where}: the repo has no branch, tag or commit named {revision!r}") from None
    except RepositoryNotFoundError:
        raise MaskError(
            f"{where} was not found on the Hub ({endpoint}): no such repo, or it is private and no valid "
            f"token was given (and there is no local folder {repo_id!r})"
        ) from None
    except LocalEntryNotFoundError as e:  # before RemoteEntryNotFoundError: both are EntryNotFoundError
        cache = hub_kwargs.get("cache_dir") or constants.HF_HUB_CACHE
        if hub_kwargs.get("local_files_only"):
            why = "offline mode is on (HF_HUB_OFFLINE=1)" if is_offline() else "local_files_only=True"
        else:
            cause = e.__cause__ or e
            why = f"the Hub ({endpoint}) cannot be reached ({type(cause).__name__})"
        raise MaskError(
            f"{where} is not (completely) in the local Hub cache {cache} and {why}; "
            f"pull it once online (leank pull {repo_id}) or pass a local folder"
        ) from None
    except RemoteEntryNotFoundError as e:
        raise MaskError(f"{where}: a file listed by the Hub could not be downloaded ({e})") from None
    except (HfHubHTTPError, FileMetadataError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MaskError(f"{where}: the Hub ({endpoint}) refused the download: {first}") from None
    except OSError as e:  # the cache folder is a file, read-only, or the disk is full
        cache = hub_kwargs.get("cache_dir") or constants.HF_HUB_CACHE
        raise MaskError(f"{where}: cannot write the Hub cache {cache}: {e.strerror or e} (give a cache folder leank "
                        "may write into)") from None
    missing = [name for name in (MASK_FILE, CONFIG_FILE) if not (folder / name).is_file()]
    if missing:
        _explain_missing(repo_id, revision, folder, missing, hub_kwargs)
    return folder


def checked_download(
    repo_id: str, revision: str | None, hub_kwargs: dict[str, Any]
) -> tuple[list[str], str] | None:
    """The files of the repo that a pull downloads and the commit they are listed at (the revision resolved
    once, so the download is of that commit), once their sizes (the Hub's listing) are checked against the
    limits a mask folder is read with (:func:`~leank_infer.mask.format.file_limit`, a count and a total), so
    nothing over them is downloaded at all. Only top-level mask repo files: ``*.png`` must not pull a folder of
    photos. None when the Hub cannot be asked (unreachable: the cache is used, as before)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    api = HfApi(endpoint=hub_kwargs.get("endpoint"), token=hub_kwargs.get("token"))
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError):
        raise  # named by the caller, as snapshot_download's own
    except Exception:  # noqa: BLE001 - unreachable, refused, down: snapshot_download decides (cache or error)
        return None
    where = _where(repo_id, revision)
    if not isinstance(info.sha, str) or not _COMMIT_RE.fullmatch(info.sha):
        raise MaskError(f"{where}: the Hub gave no commit id for the revision ({info.sha!r}); nothing was downloaded")
    sizes = {
        e.rfilename: int(getattr(e, "size", 0) or 0) for e in info.siblings or ()
        if "/" not in e.rfilename and any(fnmatch.fnmatch(e.rfilename, pat) for pat in ALLOW_PATTERNS)
    }
    if len(sizes) > MAX_REPO_FILES:
        raise MaskError(f"{where} holds {len(sizes)} mask repo files; a mask repo has at most {MAX_REPO_FILES} "
                        "(nothing was downloaded)")
    big = [(n, b) for n, b in sorted(sizes.items()) if b > file_limit(n)]
    if big:
        name, size = big[0]
        raise MaskError(f"{where}: {name} is {size:,} bytes; a mask's {name} may hold at most {file_limit(name):,} "
                        "(nothing was downloaded)")
    if sum(sizes.values()) > MAX_REPO_BYTES:
        raise MaskError(f"{where}: its mask repo files hold {sum(sizes.values()):,} bytes together; at most "
                        f"{MAX_REPO_BYTES:,} (nothing was downloaded)")
    return sorted(sizes), info.sha


def _check_downloaded(folder: Path, names: list[str], where: str) -> None:
    """The bound again on what arrived: exactly the listed names, each and all within the limits."""
    total = 0
    for name in names:
        try:
            size = (folder / name).stat().st_size
        except OSError:
            continue  # not there: said by the caller's missing-file check
        total += size
        if size > file_limit(name) or total > MAX_REPO_BYTES:
            raise MaskError(f"{where}: {name} arrived as {size:,} bytes, over a mask repo's limits "
                            f"({file_limit(name):,} for the file, {MAX_REPO_BYTES:,} in all)")


def _remember_revision(folder: Path, revision: str | None, commit: str) -> None:
    """Record in the Hub cache that ``revision`` (a branch or tag) was at ``commit``, as snapshot_download does
    when given the branch, so an offline pull of the branch finds it."""
    if revision is not None and revision == commit:
        return
    try:
        from huggingface_hub.file_download import _cache_commit_hash_for_specific_revision
    except ImportError:  # a huggingface_hub without it: the commit is cached, the branch name is not
        return
    if folder.parent.name == "snapshots" and folder.name == commit:
        _cache_commit_hash_for_specific_revision(str(folder.parent.parent), revision or "main", commit)


def _explain_missing(
    repo_id: str, revision: str | None, folder: Path, missing: list[str], hub_kwargs: dict[str, Any]
) -> None:
    """Raise the MaskError for a snapshot that lacks ``missing`` files, naming pickle files the repo holds."""
    names: list[str] | None = None
    if not hub_kwargs.get("local_files_only"):
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        commit = folder.name if _COMMIT_RE.fullmatch(folder.name) else revision
        try:
            api = HfApi(endpoint=hub_kwargs.get("endpoint"), token=hub_kwargs.get("token"))
            names = api.list_repo_files(repo_id, revision=commit)
        except (HfHubHTTPError, OSError):  # unreachable now: the snapshot is all we know
            names = None
    if names is None:
        names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    where = _where(repo_id, revision)
    listing = ", ".join(n for n in names if n != ".gitattributes") or "none"
    message = f"{where} has no {' and no '.join(missing)} (files: {listing})"
    pickles = sorted(n for n in names if n.lower().endswith(PICKLE_SUFFIXES))
    if pickles:
        message += (
            f"; its pickle files ({', '.join(pickles)}) are not read: leank reads only safetensors and JSON "
            f"({MASK_FILE} + {CONFIG_FILE}) and never unpickles downloaded files"
        )
    raise MaskError(message)


def mask_repo_files(folder: str | os.PathLike) -> dict[str, bytes]:
    """The files of a mask repo folder that are pushed, by name: top-level :data:`ALLOW_PATTERNS` matches, read
    once as regular files inside the folder (a link or anything else is refused; what is uploaded is what was read)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MaskError(f"{folder} is not a folder")
    files = read_repo_files(folder)
    missing = [name for name in (MASK_FILE, CONFIG_FILE) if name not in files]
    if missing:
        raise MaskError(f"{folder} has no {' and no '.join(missing)}: nothing to push")
    return files


def check_push_target(repo_id: str, revision: str | None = None) -> None:
    """Raise MaskError unless ``repo_id`` and ``revision`` are valid names and the Hub may be reached (not offline)."""
    problem = repo_id_problem(repo_id) or (revision_problem(revision) if revision is not None else None)
    if problem:
        raise MaskError(f"cannot push to {repo_id[:200]!r}: {problem[:300]}")
    if is_offline():
        raise MaskError("cannot push while offline mode is on (HF_HUB_OFFLINE=1): unset it to upload")


def upload_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str,
    commit_description: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> CommitInfo:
    """Create ``repo_id`` if needed and upload the mask repo files of ``folder`` in one commit.

    ``revision`` is a branch, created from ``main`` when missing. The result is a ``str`` (the
    commit URL) with ``.oid``. Hub errors (auth, permissions) are huggingface_hub's own exceptions.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    check_push_target(repo_id, revision)
    files = mask_repo_files(folder)
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision is not None and revision != "main":
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data) for name, data in files.items()]
    return api.create_commit(
        repo_id,
        operations,
        commit_message=commit_message,
        commit_description=commit_description,
        revision=revision,
    )
