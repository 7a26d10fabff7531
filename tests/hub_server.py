"""A small loopback stand-in for the Hugging Face Hub, enough for create_repo + create_branch + create_commit.

Routes (the ones huggingface_hub 2.4 calls for this flow):
  POST /api/repos/create                               -> {"url"}; 409 with "url" when it exists
  GET  /api/models/{repo}[/revision/{rev}]              -> repo info (create_repo's 401/403 fallback)
  GET  /api/models/{repo}/refs                          -> branches (create_branch's 403 fallback)
  POST /api/models/{repo}/branch/{branch}               -> create a branch ({"startingPoint"})
  POST /api/validate-yaml                               -> {"errors": [], "warnings": []}
  POST /api/models/{repo}/preupload/{rev}               -> {"files": [{path, uploadMode, shouldIgnore, oid}]}
  POST /{repo}.git/info/lfs/objects/batch               -> basic transfer: upload href (+ verify href)
  PUT  /lfs-upload/{oid}                                -> stores the object (sha256 and size checked)
  POST /lfs-verify/{repo}                               -> 200 when the object is stored
  POST /api/models/{repo}/commit/{rev}                  -> ndjson header/file/lfsFile/deletedFile
Xet: huggingface_hub 2.4 sends every "lfs" file through hf_xet when hf_xet is importable and
HF_HUB_DISABLE_XET is unset, and asks nothing of the server first. This server has no xet storage, so
`upload_mode="regular"` makes a xet-capable client commit every file inline; `upload_mode="auto"` (Hub-like:
*.safetensors, binary or >= threshold -> lfs) is for clients run with HF_HUB_DISABLE_XET=1.

Requests are recorded without Authorization values (only whether one was sent and whether it matched).
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

LFS_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.npz", "*.onnx", "*.zip", "*.gz")


@dataclass
class Recorded:
    method: str
    path: str
    query: dict
    status: int
    has_auth: bool
    auth_ok: bool
    user_agent: str
    content_length: int
    body_json: Any = None


@dataclass
class Failure:
    method: str
    pattern: str  # regex searched in the request path
    status: int
    times: int = 1  # -1: forever
    body: dict | None = None
    headers: dict | None = None


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    heads: dict[str, str] = field(default_factory=lambda: {"main": "0" * 40})
    commits: list[dict] = field(default_factory=list)
    prs: list[str] = field(default_factory=list)


class HubState:
    def __init__(self, token: str | None, upload_mode: str, lfs_threshold: int, send_verify: bool):
        self.lock = threading.RLock()  # routes answer while holding it, and answering logs the request
        self.token = token
        self.upload_mode = upload_mode
        self.lfs_threshold = lfs_threshold
        self.send_verify = send_verify
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.requests: list[Recorded] = []
        self.failures: list[Failure] = []
        self.validated_yaml: list[str] = []
        self.preupload_modes: dict[str, str] = {}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, fmt: str, *args: Any) -> None:  # keep test output clean; requests are recorded
        pass

    # ------------------------------------------------------------------ plumbing
    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size_line = self.rfile.readline().strip()
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, payload: Any = None, headers: dict | None = None) -> None:
        self._record(status)  # before the client can see the response: a test reads the log as soon as its call returns
        body = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _record(self, status: int) -> None:
        """Log this request once, with the status of its first response."""
        if self._pending is None:
            return
        with self.server.state.lock:
            self.server.state.requests.append(replace(self._pending, status=status))
        self._pending = None

    def _handle(self, method: str) -> None:
        state = self.server.state
        split = urlsplit(self.path)
        path, query = split.path, parse_qs(split.query)
        body = self._read_body()
        auth = self.headers.get("Authorization")
        auth_ok = state.token is None or auth == f"Bearer {state.token}"
        body_json = None
        if (
            body
            and "json" in (self.headers.get("Content-Type") or "")
            and "ndjson" not in (self.headers.get("Content-Type") or "")
            and len(body) < 100_000
        ):
            try:
                body_json = json.loads(body)
            except ValueError:
                body_json = None
        self._pending: Recorded | None = Recorded(
            method,
            path,
            {k: v[0] for k, v in query.items()},
            0,
            auth is not None,
            auth is not None and auth_ok,
            self.headers.get("User-Agent", ""),
            len(body),
            body_json,
        )
        try:
            self._dispatch(method, path, query, body, body_json, auth_ok)
        except Exception as exc:  # a server bug must show up as a 500, not a hang
            self._send(500, {"error": f"test server error: {exc!r}"})
        self._record(0)  # a route that sent nothing (none should)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    # ------------------------------------------------------------------ routes
    def _dispatch(self, method: str, path: str, query: dict, body: bytes, data: Any, auth_ok: bool) -> None:
        state = self.server.state
        with state.lock:
            for failure in state.failures:
                if failure.times != 0 and failure.method in (method, "*") and re.search(failure.pattern, path):
                    if failure.times > 0:
                        failure.times -= 1
                    self._send(failure.status, failure.body or {"error": f"injected {failure.status}"}, failure.headers)
                    return
        if path.startswith("/lfs-upload/"):  # presigned-style URL: no Authorization expected
            return self._lfs_put(path.rsplit("/", 1)[1], body)
        if not auth_ok:
            return self._send(
                401,
                {"error": "Invalid credentials in Authorization header"},
                {"X-Error-Message": "Invalid credentials in Authorization header"},
            )
        if method == "POST" and path == "/api/repos/create":
            return self._create_repo(data or {})
        if method == "POST" and path == "/api/validate-yaml":
            return self._validate_yaml(data or {})
        if method == "POST" and path.startswith("/lfs-verify/"):
            oid = (data or {}).get("oid")
            return self._send(200 if oid in state.lfs else 404, {"ok": oid in state.lfs})
        m = re.fullmatch(r"/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch", path)
        if m and method == "POST":
            return self._lfs_batch(m.group("repo"), data or {})
        m = re.fullmatch(r"/api/models/(?P<repo>[^/]+/[^/]+)(?P<rest>/.*)?", path)
        if m:
            repo = state.repos.get(m.group("repo"))
            if repo is None:
                return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            rest = m.group("rest") or ""
            if method == "GET" and (rest == "" or rest.startswith("/revision/")):
                rev = unquote(rest[len("/revision/") :]) if rest else "main"
                return self._repo_info(repo, rev)
            if method == "GET" and rest == "/refs":
                return self._send(
                    200,
                    {
                        "branches": [
                            {"name": b, "ref": f"refs/heads/{b}", "targetCommit": h}
                            for b, h in repo.heads.items()
                            if not b.startswith("refs/pr/")
                        ],
                        "converts": [],
                        "tags": [],
                    },
                )
            mm = re.fullmatch(r"/branch/(?P<b>.+)", rest)
            if mm and method == "POST":
                return self._create_branch(repo, unquote(mm.group("b")), data or {})
            mm = re.fullmatch(r"/preupload/(?P<rev>.+)", rest)
            if mm and method == "POST":
                return self._preupload(repo, unquote(mm.group("rev")), data or {}, query)
            mm = re.fullmatch(r"/commit/(?P<rev>.+)", rest)
            if mm and method == "POST":
                return self._commit(repo, unquote(mm.group("rev")), body, query)
        return self._send(404, {"error": f"test hub: no route for {method} {path}"})

    def _base(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def _create_repo(self, data: dict) -> None:
        state = self.server.state
        repo_id = (
            f"{data.get('organization')}/{data.get('name')}" if data.get("organization") else f"user/{data.get('name')}"
        )
        url = f"{self._base()}/{repo_id}"
        with state.lock:
            if repo_id in state.repos:
                return self._send(409, {"error": "You already created this model repo", "url": url})
            state.repos[repo_id] = Repo(repo_id, data.get("visibility") == "private")
        return self._send(200, {"url": url, "name": repo_id, "id": hashlib.sha1(repo_id.encode()).hexdigest()[:24]})

    def _validate_yaml(self, data: dict) -> None:
        import yaml

        content = data.get("content", "")
        self.server.state.validated_yaml.append(content)
        m = re.match(r"^\s*---\r?\n([\s\S]*?)\r?\n---", content)
        if m:
            try:
                meta = yaml.safe_load(m.group(1))
            except yaml.YAMLError as exc:
                return self._send(400, {"errors": [{"message": f"invalid YAML: {exc}"}], "warnings": []})
            if meta is not None and not isinstance(meta, dict):
                return self._send(400, {"errors": [{"message": "metadata must be a mapping"}], "warnings": []})
        return self._send(200, {"errors": [], "warnings": []})

    def _repo_info(self, repo: Repo, rev: str) -> None:
        if rev not in repo.heads:
            return self._send(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
        files = repo.branches[rev]
        return self._send(
            200,
            {
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "sha": repo.heads[rev],
                "private": repo.private,
                "siblings": [{"rfilename": p} for p in sorted(files)],
            },
        )

    def _create_branch(self, repo: Repo, branch: str, data: dict) -> None:
        start = data.get("startingPoint") or "main"
        with self.server.state.lock:
            if branch in repo.heads:
                return self._send(409, {"error": f"Reference refs/heads/{branch} already exists"})
            if start not in repo.heads:
                return self._send(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
            repo.branches[branch] = dict(repo.branches[start])
            repo.heads[branch] = repo.heads[start]
        return self._send(200, {})

    def _mode_for(self, path: str, size: int, sample: bytes) -> str:
        state = self.server.state
        if state.upload_mode in ("regular", "lfs"):
            return state.upload_mode
        name = path.rsplit("/", 1)[-1]
        if any(fnmatch.fnmatch(name, g) for g in LFS_GLOBS) or size >= state.lfs_threshold or b"\x00" in sample:
            return "lfs"
        return "regular"

    def _preupload(self, repo: Repo, rev: str, data: dict, query: dict) -> None:
        if rev not in repo.heads and "create_pr" not in query:
            return self._send(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
        out = []
        for f in data.get("files", []):
            mode = self._mode_for(f["path"], int(f["size"]), base64.b64decode(f.get("sample", "")))
            self.server.state.preupload_modes[f["path"]] = mode
            out.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": None})
        return self._send(200, {"files": out, "commitOid": repo.heads.get(rev)})

    def _lfs_batch(self, repo_id: str, data: dict) -> None:
        state = self.server.state
        if repo_id not in state.repos:
            return self._send(404, {"message": "Repository not found"})
        objects = []
        for obj in data.get("objects", []):
            oid, size = obj["oid"], int(obj["size"])
            entry: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if oid not in state.lfs:
                actions: dict[str, Any] = {"upload": {"href": f"{self._base()}/lfs-upload/{oid}", "header": {}}}
                if state.send_verify:
                    actions["verify"] = {"href": f"{self._base()}/lfs-verify/{repo_id}", "header": {}}
                entry["actions"] = actions
            objects.append(entry)
        return self._send(200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"})

    def _lfs_put(self, oid: str, body: bytes) -> None:
        if hashlib.sha256(body).hexdigest() != oid:
            return self._send(400, {"error": "sha256 mismatch"})
        with self.server.state.lock:
            self.server.state.lfs[oid] = body
        return self._send(200, None)

    def _commit(self, repo: Repo, rev: str, body: bytes, query: dict) -> None:
        state = self.server.state
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = next((x["value"] for x in lines if x.get("key") == "header"), None)
        if header is None or not header.get("summary"):
            return self._send(400, {"error": "commit header with a summary is required"})
        with state.lock:
            if rev not in repo.heads:
                return self._send(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
            if header.get("parentCommit") and header["parentCommit"] != repo.heads[rev]:
                return self._send(409, {"error": "parent commit is not the head of the branch"})
            files = dict(repo.branches[rev])
            for item in lines:
                key, value = item.get("key"), item.get("value", {})
                if key == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "lfsFile":
                    if value["oid"] not in state.lfs:
                        return self._send(400, {"error": f"LFS object {value['oid']} was never uploaded"})
                    files[value["path"]] = state.lfs[value["oid"]]
                elif key == "deletedFile":
                    files.pop(value["path"], None)
            oid = hashlib.sha1(json.dumps([repo.heads[rev], sorted(files), header], default=str).encode()).hexdigest()
            pr_url = None
            target = rev
            if query.get("create_pr", ["0"])[0] == "1":
                number = len(repo.prs) + 1
                target = f"refs/pr/{number}"
                pr_url = f"{self._base()}/{repo.repo_id}/discussions/{number}"
                repo.prs.append(target)
            repo.branches[target] = files
            repo.heads[target] = oid
            repo.commits.append(
                {
                    "oid": oid,
                    "revision": target,
                    "summary": header.get("summary"),
                    "description": header.get("description"),
                    "paths": sorted(files),
                    "kinds": {v["value"]["path"]: v["key"] for v in lines if v.get("key") != "header"},
                }
            )
        return self._send(
            200,
            {
                "success": True,
                "commitOid": oid,
                "commitUrl": f"{self._base()}/{repo.repo_id}/commit/{oid}",
                "pullRequestUrl": pr_url,
            },
        )


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: HubState


class FakeHub:
    """Start with `with FakeHub(...) as hub:`; `hub.url` is the endpoint."""

    def __init__(
        self,
        token: str | None = None,
        *,
        upload_mode: str = "auto",
        lfs_threshold: int = 10 * 1024 * 1024,
        send_verify: bool = True,
    ):
        self.state = HubState(token, upload_mode, lfs_threshold, send_verify)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> FakeHub:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.state = self.state
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
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

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # ------------------------------------------------------------------ test helpers
    def fail(
        self,
        method: str,
        pattern: str,
        status: int,
        times: int = 1,
        body: dict | None = None,
        headers: dict | None = None,
    ) -> None:
        with self.state.lock:
            self.state.failures.append(Failure(method, pattern, status, times, body, headers))

    def add_repo(self, repo_id: str, private: bool = False) -> Repo:
        with self.state.lock:
            repo = self.state.repos.setdefault(repo_id, Repo(repo_id, private))
        return repo

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        return dict(self.state.repos[repo_id].branches[revision])

    def commits(self, repo_id: str) -> list[dict]:
        return list(self.state.repos[repo_id].commits)

    def requests(self, method: str | None = None, contains: str = "") -> list[Recorded]:
        return [r for r in self.state.requests if (method is None or r.method == method) and contains in r.path]
