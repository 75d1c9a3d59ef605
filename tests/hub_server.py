"""A small Hugging Face Hub stand-in for tests: the model-repo endpoints huggingface_hub 2.4 calls.

It keeps git-like history in memory: every commit is a full snapshot of the repo's files with
a 40-hex id, a parent and a message; branches and tags name commits. It answers

- ``POST /api/repos/create`` (with the Hub's initial ``.gitattributes`` commit), ``POST /api/validate-yaml``,
- ``GET /api/models/{repo}`` and ``/revision/{rev}`` (model_info / repo_info), ``/tree/{rev}[/{path}]``,
  ``/refs``, ``/commits/{rev}``,
- ``POST /api/models/{repo}/preupload/{rev}`` (every file is "regular", so no LFS or Xet upload),
  ``/commit/{rev}`` (ndjson: header, base64 files, deletions), ``/branch/{name}``, ``/tag/{rev}``,
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` with ``ETag`` (the git blob id), ``X-Repo-Commit``
  and ``Content-Length``,

and reports errors the way the Hub does (``X-Error-Code: RepoNotFound | RevisionNotFound |
EntryNotFound``), so huggingface_hub raises its own exception types. Writes need an
``Authorization`` header (any token); private repos are invisible without one. Every request is
recorded in ``FakeHub.requests`` as ``(method, path)``.

Usage: ``with FakeHub() as hub: HfApi(endpoint=hub.url, token="x")...``
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote

USER = "tester"
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
SHA_RE = re.compile(r"[0-9a-f]{40}")


def blob_oid(content: bytes) -> str:
    """The git blob id of ``content`` (what the Hub sends as a regular file's ETag and tree ``oid``)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class HubError(Exception):
    """An HTTP error answer: status, Hub error code (``X-Error-Code``) and message."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.headers = status, code, headers or {}


@dataclass
class Commit:
    oid: str
    parent: str | None
    title: str
    message: str
    date: str
    files: dict[str, bytes]  # the whole tree at this commit: path -> content


@dataclass
class Repo:
    repo_id: str
    private: bool = False
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit:
        """The commit a branch, tag or full commit id names; RevisionNotFound otherwise."""
        oid = self.branches.get(revision) or self.tags.get(revision)
        if oid is None and SHA_RE.fullmatch(revision) and revision in self.commits:
            oid = revision
        if oid is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return self.commits[oid]

    def history(self, revision: str) -> list[Commit]:
        """Commits reachable from ``revision``, newest first."""
        out: list[Commit] = []
        commit: Commit | None = self.resolve(revision)
        while commit is not None:
            out.append(commit)
            commit = self.commits[commit.parent] if commit.parent else None
        return out


class FakeHub:
    """The in-memory Hub and its HTTP server on 127.0.0.1 (a free port), served from a daemon thread."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.RLock()
        self._counter = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        self.url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- repository state ------------------------------------------------------------------
    def repo(self, repo_id: str, authorized: bool = True) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not authorized):
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def create_repo(self, repo_id: str, private: bool = False) -> Repo:
        with self.lock:
            if repo_id in self.repos:
                raise HubError(409, "You already created this model repo")
            repo = self.repos[repo_id] = Repo(repo_id, private=private)
            self.commit(repo, "main", {".gitattributes": GITATTRIBUTES}, [], "initial commit")
            return repo

    def commit(
        self, repo: Repo, branch: str, added: dict[str, bytes], deleted: list[str], title: str, message: str = ""
    ) -> Commit:
        """A new commit on ``branch`` (created from nothing if the repo is empty): add files, delete paths/folders."""
        with self.lock:
            parent = repo.commits[repo.branches[branch]] if branch in repo.branches else None
            files = dict(parent.files) if parent else {}
            for path in deleted:
                folder = path.rstrip("/") + "/"
                gone = [p for p in files if p == path or p.startswith(folder)]
                if not gone:
                    raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                for p in gone:
                    del files[p]
            files.update(added)
            self._counter += 1
            tree = "".join(f"{p} {blob_oid(c)}\n" for p, c in sorted(files.items()))
            body = f"tree {hashlib.sha1(tree.encode()).hexdigest()}\nparent {parent.oid if parent else ''}\n"
            oid = hashlib.sha1(f"{body}seq {self._counter}\n\n{title}\n{message}".encode()).hexdigest()
            date = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            commit = Commit(oid, parent.oid if parent else None, title, message, date, files)
            repo.commits[oid] = commit
            repo.branches[branch] = oid
            return commit


class _Handler(BaseHTTPRequestHandler):
    """Routes one request to the FakeHub; HTTP/1.0, so a stopped hub closes every connection."""

    fake_hub: FakeHub
    server_version = "FakeHub/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    # ---- plumbing --------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        raw_path, _, query = self.path.partition("?")
        self.fake_hub.requests.append((method, unquote(raw_path)))
        self.query = {k: v[-1] for k, v in parse_qs(query).items()}
        self.authorized = self.headers.get("Authorization", "").startswith("Bearer ")
        parts = [unquote(p) for p in raw_path.strip("/").split("/")]
        try:
            if method == "POST" and parts[:2] != ["api", "validate-yaml"] and not self.authorized:
                raise HubError(401, "Invalid username or password.")
            if parts[:1] == ["api"]:
                self._api(method, parts[1:])
            elif len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
                self._resolve(method, "/".join(parts[:2]), parts[3], "/".join(parts[4:]))
            else:
                raise HubError(404, f"Not found: {method} {raw_path}")
        except HubError as e:
            self._send_error(e)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _json_body(self) -> Any:
        try:
            return json.loads(self._body() or b"{}")
        except json.JSONDecodeError as e:
            raise HubError(400, f"invalid JSON body: {e}") from None

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, data: Any, status: int = 200) -> None:
        self._send(status, json.dumps(data).encode(), {"Content-Type": "application/json"})

    def _send_error(self, e: HubError) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": str(e), **e.headers}
        if e.code:
            headers["X-Error-Code"] = e.code
        self._send(e.status, json.dumps({"error": str(e)}).encode(), headers)

    # ---- /api ------------------------------------------------------------------------------
    def _api(self, method: str, parts: list[str]) -> None:
        hub = self.fake_hub
        if method == "POST" and parts == ["repos", "create"]:
            return self._create_repo(self._json_body())
        if method == "POST" and parts == ["validate-yaml"]:
            return self._validate_yaml(self._json_body())
        if method == "GET" and parts == ["whoami-v2"]:
            return self._send_json({"type": "user", "name": USER, "auth": {"type": "access_token"}})
        if len(parts) < 3 or parts[0] != "models":
            raise HubError(404, f"Not found: /api/{'/'.join(parts)}", "RepoNotFound")
        repo_id, action, args = "/".join(parts[1:3]), parts[3] if len(parts) > 3 else None, parts[4:]
        with hub.lock:
            repo = hub.repo(repo_id, self.authorized)
            if method == "GET" and action is None:
                return self._model_info(repo, "main")
            if method == "GET" and action == "revision" and len(args) == 1:
                return self._model_info(repo, args[0])
            if method == "GET" and action == "tree" and len(args) in (1, 2):
                return self._tree(repo, args[0], args[1] if len(args) == 2 else "")
            if method == "GET" and action == "refs" and not args:
                return self._refs(repo)
            if method == "GET" and action == "commits" and len(args) == 1:
                return self._commits(repo, args[0])
            if method == "POST" and action == "preupload" and len(args) == 1:
                return self._preupload(repo, args[0], self._json_body())
            if method == "POST" and action == "commit" and len(args) == 1:
                return self._commit(repo, args[0], self._body())
            if method == "POST" and action == "branch" and len(args) == 1:
                return self._create_branch(repo, args[0], self._json_body())
            if method == "POST" and action == "tag" and len(args) == 1:
                return self._create_tag(repo, args[0], self._json_body())
        raise HubError(404, f"Not found: {method} /api/{'/'.join(parts)}")

    def _create_repo(self, payload: dict[str, Any]) -> None:
        if payload.get("type", "model") != "model":
            raise HubError(400, "this test hub only hosts model repos")
        name, org = payload.get("name"), payload.get("organization") or USER
        repo_id = f"{org}/{name}"
        url = f"{self.fake_hub.url}/{repo_id}"
        try:
            self.fake_hub.create_repo(repo_id, private=payload.get("visibility") == "private")
        except HubError as e:
            if e.status == 409:
                return self._send_json({"error": str(e), "url": url}, status=409)
            raise
        self._send_json({"url": url, "name": repo_id, "id": repo_id})

    def _validate_yaml(self, payload: dict[str, Any]) -> None:
        import yaml

        text = payload.get("content", "")
        match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, re.DOTALL)
        try:
            meta = yaml.safe_load(match.group(1)) if match else {}
        except yaml.YAMLError as e:
            return self._send_json({"errors": [{"message": f"invalid YAML: {e}"}]}, status=400)
        if meta is not None and not isinstance(meta, dict):
            return self._send_json({"errors": [{"message": "metadata must be a YAML mapping"}]}, status=400)
        self._send_json({"errors": [], "warnings": []})

    def _model_info(self, repo: Repo, revision: str) -> None:
        commit = repo.resolve(revision)
        with_blobs = self.query.get("blobs", "").lower() == "true"
        siblings = [
            {"rfilename": p, **({"size": len(c), "blobId": blob_oid(c)} if with_blobs else {})}
            for p, c in sorted(commit.files.items())
        ]
        self._send_json(
            {
                "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "author": repo.repo_id.split("/")[0],
                "sha": commit.oid,
                "lastModified": commit.date,
                "private": repo.private,
                "disabled": False,
                "gated": False,
                "tags": [],
                "siblings": siblings,
            }
        )

    def _tree(self, repo: Repo, revision: str, path: str) -> None:
        commit = repo.resolve(revision)
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        recursive = self.query.get("recursive", "").lower() == "true"
        files = {p: c for p, c in commit.files.items() if p.startswith(prefix)}
        if prefix and not files:
            raise HubError(404, f"{path} does not exist at {revision}", "EntryNotFound")
        entries: dict[str, dict[str, Any]] = {}
        for p, content in sorted(files.items()):
            rest = p[len(prefix) :].split("/")
            for depth in range(1, len(rest)):  # the folders on the way
                if recursive or depth == 1:
                    d = prefix + "/".join(rest[:depth])
                    entries.setdefault(d, {"type": "directory", "oid": blob_oid(d.encode()), "size": 0, "path": d})
            if recursive or len(rest) == 1:
                entries[p] = {"type": "file", "oid": blob_oid(content), "size": len(content), "path": p}
        self._send_json(list(entries.values()))

    def _refs(self, repo: Repo) -> None:
        def refs(names: dict[str, str], kind: str) -> list[dict[str, str]]:
            return [{"name": n, "ref": f"refs/{kind}/{n}", "targetCommit": oid} for n, oid in sorted(names.items())]

        self._send_json({"branches": refs(repo.branches, "heads"), "tags": refs(repo.tags, "tags"), "converts": []})

    def _commits(self, repo: Repo, revision: str) -> None:
        self._send_json(
            [
                {"id": c.oid, "title": c.title, "message": c.message, "authors": [{"user": USER}], "date": c.date}
                for c in repo.history(revision)
            ]
        )

    def _branch_head(self, repo: Repo, branch: str) -> Commit:
        if self.query.get("create_pr"):
            raise HubError(400, "this test hub does not do pull requests")
        if branch not in repo.branches:
            raise HubError(404, f"Invalid rev id: {branch} (commits go to branches)", "RevisionNotFound")
        return repo.commits[repo.branches[branch]]

    def _preupload(self, repo: Repo, revision: str, payload: dict[str, Any]) -> None:
        head = self._branch_head(repo, revision)
        files = [
            {
                "path": f["path"],
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": blob_oid(head.files[f["path"]]) if f["path"] in head.files else None,
            }
            for f in payload.get("files", [])
        ]
        self._send_json({"files": files, "commitOid": head.oid})

    def _commit(self, repo: Repo, branch: str, body: bytes) -> None:
        head = self._branch_head(repo, branch)
        header: dict[str, Any] = {}
        added: dict[str, bytes] = {}
        deleted: list[str] = []
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item.get("key"), item.get("value", {})
            if key == "header":
                header = value
            elif key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, f"unsupported encoding {value.get('encoding')!r}")
                added[value["path"]] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
            else:
                raise HubError(400, f"this test hub does not accept {key!r} operations (no LFS)")
        if not header.get("summary"):
            raise HubError(400, "a commit needs a header with a summary")
        parent = header.get("parentCommit")
        if parent and parent != head.oid:
            raise HubError(412, f"{branch} moved: its head is {head.oid}, not {parent}")
        commit = self.fake_hub.commit(repo, branch, added, deleted, header["summary"], header.get("description", ""))
        url = f"{self.fake_hub.url}/{repo.repo_id}/commit/{commit.oid}"
        self._send_json({"success": True, "commitOid": commit.oid, "commitUrl": url, "pullRequestUrl": None})

    def _create_branch(self, repo: Repo, branch: str, payload: dict[str, Any]) -> None:
        if branch in repo.branches or branch in repo.tags:
            raise HubError(409, f"Reference {branch} already exists")
        repo.branches[branch] = repo.resolve(payload.get("startingPoint") or "main").oid
        self._send_json({})

    def _create_tag(self, repo: Repo, revision: str, payload: dict[str, Any]) -> None:
        tag = payload.get("tag")
        if not tag:
            raise HubError(400, "a tag needs a name")
        if tag in repo.tags or tag in repo.branches:
            raise HubError(409, f"Tag {tag} already exists")
        repo.tags[tag] = repo.resolve(revision).oid
        self._send_json({})

    # ---- /{repo}/resolve/{rev}/{path} ----------------------------------------------------------
    def _resolve(self, method: str, repo_id: str, revision: str, path: str) -> None:
        with self.fake_hub.lock:
            commit = self.fake_hub.repo(repo_id, self.authorized).resolve(revision)
        headers = {"X-Repo-Commit": commit.oid}
        if path not in commit.files:
            raise HubError(404, "Entry not found", "EntryNotFound", headers)
        content = commit.files[path]
        headers.update({"ETag": f'"{blob_oid(content)}"', "Content-Type": "application/octet-stream"})
        headers["Accept-Ranges"] = "bytes"
        status = 200
        ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if ranged and method == "GET":
            start = int(ranged.group(1))
            end = int(ranged.group(2)) if ranged.group(2) else len(content) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(content)}"
            content, status = content[start : end + 1], 206
        self._send(status, content, headers)
