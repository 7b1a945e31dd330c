"""A loopback stand-in for the subset of the Hugging Face Hub HTTP API that huggingface_hub's calls use.

The calls: create_repo / create_branch / upload_folder / create_commit / snapshot_download / hf_hub_download /
repo_info (and list_repo_refs, list_repo_tree, get_paths_info, file_exists). Used by hf_omni's tests and its
quickstart notebook so that pushes and pulls run offline; never for real use: no auth, no LFS/Xet (every file is a
"regular" base64 blob), all in memory.

The client reads its environment once, at import, so inside a process that may have imported it already (pytest)
patch the module attributes it reads at call time, then HfApi(), snapshot_download, hf_hub_download and
transformers' from_pretrained all reach the loopback hub::

    with LoopbackHub() as hub, pytest.MonkeyPatch.context() as mp:
        for name, value in hub.client_constants(cache_dir).items():
            mp.setattr(huggingface_hub.constants, name, value)   # ENDPOINT, the resolve URL template, no Xet, ...

(or, patching only HF_HUB_DISABLE_XET, pass `endpoint=hub.endpoint` to HfApi and to every download call). A fresh
interpreter gets the same through its environment: `subprocess.run(..., env={**os.environ, **hub.client_env(home)})`
(and without HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE / HF_TOKEN in os.environ). Xet must be off: with hf_xet installed,
upload_folder takes a pipelined path that retries a failed commit for ~23 s; a failed preupload is retried so anyway.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from .hub_store import HubError, HubStore, git_blob_sha

_KINDS = {"models": "model", "datasets": "dataset", "spaces": "space"}


class LoopbackHub:
    """A Hub on 127.0.0.1 (free port, bound at construction); the tests read its store and may inject failures."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.store = HubStore()
        self._failing = None
        self._requests = []
        self._server = _Server((host, port), _Handler)
        self._server.hub = self
        self._thread = None
        self.endpoint = f"http://{host}:{self._server.server_address[1]}"

    def start(self) -> str:
        if self._thread is not None:
            return self.endpoint
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="loopback-hub",
                                        daemon=True)  # a short poll: stop() waits for it, once per test
        self._thread.start()
        return self.endpoint

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def client_constants(self, cache_dir: str = None) -> dict:
        """huggingface_hub.constants attributes to patch in-process (see the module docstring)."""
        patch = {"ENDPOINT": self.endpoint, "HF_HUB_DISABLE_XET": True, "HF_HUB_OFFLINE": False,
                 "HUGGINGFACE_CO_URL_TEMPLATE": self.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
                 "HF_HUB_DISABLE_TELEMETRY": True}
        return {**patch, "HF_HUB_CACHE": str(cache_dir)} if cache_dir is not None else patch

    def client_env(self, hf_home: str) -> dict:
        """Environment variables for a subprocess that imports huggingface_hub after they are set."""
        return {"HF_ENDPOINT": self.endpoint, "HF_HOME": str(hf_home), "HF_HUB_DISABLE_XET": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1"}

    def files(self, repo_id: str, revision: str = "main") -> dict:
        """{path: bytes} at a branch head or commit sha; an unknown repo or revision raises HubError (a 404)."""
        return self.store.files(repo_id, revision)

    @property
    def repos(self) -> dict:
        return self.store.repos()

    def commits(self, repo_id: str) -> list:
        return self.store.commits(repo_id)

    def fail(self, predicate) -> None:
        """predicate(method, path) -> bool: matching requests get a 500 from now on (None clears it)."""
        with self.store.lock:
            self._failing = predicate

    @property
    def requests(self) -> list:
        """(method, unquoted path without query, headers with lower-cased names), in arrival order."""
        with self.store.lock:
            return list(self._requests)

    def _seen(self, method: str, path: str, headers: dict) -> bool:
        """Records the request; True when it must fail."""
        with self.store.lock:
            self._requests.append((method, path, headers))
            failing = self._failing
        return failing is not None and bool(failing(method, path))


class _Server(ThreadingHTTPServer):
    """A backlog for parallel downloads (each request is a fresh HTTP/1.0 connection); threads die with the hub."""
    request_queue_size = 128
    daemon_threads = True


class _Handler(BaseHTTPRequestHandler):
    """One request: route on the raw path's segments (a revision may hold a quoted '/'), answer JSON or bytes."""

    def log_message(self, *args):
        pass  # the tests read hub.requests; stderr noise would hide their output

    def do_GET(self):
        """Every method lands here; the routes say which they answer (the rest: a JSON 404 naming the request)."""
        method, split, self.extra = self.command, urlsplit(self.path), {}
        segments = [unquote(s) for s in split.path.strip("/").split("/")]
        self.query = parse_qs(split.query)
        body = self._body()
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            if self.server.hub._seen(method, unquote(split.path), headers):
                return self._json(500, {"error": f"loopback hub: injected failure for {method} {split.path}"})
            if segments[0] == "api":
                return self._api(method, segments[1:], body)
            return self._resolve(method, segments)
        except HubError as error:
            return self._json(error.status, {"error": error.message}, code=error.code, extra=self.extra)
        except Exception as error:  # a bug (here or in a fail predicate): answer, so the client does not retry a
            self._json(500, {"error": f"loopback hub: {type(error).__name__}: {error}"})  # dropped connection,
            raise  # and let socketserver print the traceback

    do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, data: bytes, content_type: str, headers: dict = None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _json(self, status: int, payload, code=None, extra: dict = None):
        headers = dict(extra or {})
        if code is not None:
            headers.update({"X-Error-Code": code, "X-Error-Message": payload.get("error", "")})
        self._send(status, json.dumps(payload).encode(), "application/json", headers)

    def _api(self, method: str, segments: list, body: bytes):
        store = self.server.hub.store
        if method == "POST" and segments == ["repos", "create"]:
            return self._create(json.loads(body or b"{}"))
        if method == "POST" and segments == ["validate-yaml"]:
            return self._json(200, {})
        if len(segments) < 3 or segments[0] not in _KINDS:
            raise HubError(404, None, f"loopback hub: no route for {method} /api/{'/'.join(segments)}")
        kind, repo_id, action, args = _KINDS[segments[0]], "/".join(segments[1:3]), (segments[3:] or [None])[0], \
            segments[4:]
        revision = args[0] if args else "main"
        if method == "GET" and action in (None, "revision"):
            info = store.info(repo_id, revision, kind)
            return self._json(200, {**info, "modelId": repo_id, "tags": [], "downloads": 0, "likes": 0,
                                    "disabled": False, "gated": False, "cardData": {}})
        if method == "GET" and action == "refs":
            store.resolve(repo_id, "main", kind)  # an unknown repo (or type) answers 404 RepoNotFound
            refs = [{"name": name, "ref": f"refs/heads/{name}", "targetCommit": sha}
                    for name, sha in store.repos()[repo_id]["branches"].items()]
            return self._json(200, {"branches": refs, "converts": [], "tags": [], "pullRequests": []})
        if method == "GET" and action == "tree":
            recursive = self.query.get("recursive", ["false"])[0].lower() in ("1", "true")
            return self._json(200, store.entries(repo_id, revision, under="/".join(args[1:]), recursive=recursive,
                                                 repo_type=kind))
        if method == "POST" and action == "paths-info":
            paths = _form_or_json(self.headers.get("Content-Type", ""), body).get("paths", [])
            return self._json(200, store.entries(repo_id, revision, paths=paths, repo_type=kind))
        if method == "POST" and action == "preupload":
            present = {e["path"]: e["oid"] for e in store.entries(repo_id, revision, recursive=True, repo_type=kind)}
            files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": present.get(f["path"])}
                     for f in json.loads(body or b"{}").get("files", [])]
            return self._json(200, {"files": files})
        if method == "POST" and action == "commit":
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            header = next((line["value"] for line in lines if line["key"] == "header"), {})
            operations = [(line["key"], line["value"]) for line in lines if line["key"] != "header"]
            sha = store.commit(repo_id, revision, header, operations, kind)
            prefix = "" if kind == "model" else f"{kind}s/"
            return self._json(200, {"success": True, "commitOid": sha,
                                    "commitUrl": f"{self.server.hub.endpoint}/{prefix}{repo_id}/commit/{sha}"})
        if method == "POST" and action == "branch" and args:
            start = json.loads(body or b"{}").get("startingPoint")
            store.create_branch(repo_id, args[0], start, kind)
            return self._json(200, {})
        raise HubError(404, None, f"loopback hub: no route for {method} /api/{'/'.join(segments)}")

    def _create(self, payload: dict):
        name, organization = payload.get("name", ""), payload.get("organization")
        repo_id = f"{organization}/{name}" if organization else name
        if repo_id.count("/") != 1:
            raise HubError(400, None, f"loopback hub: repo ids are 'namespace/name', got {repo_id!r}")
        kind = payload.get("type") or "model"
        private = payload.get("private", payload.get("visibility") == "private")
        prefix = "" if kind == "model" else f"{kind}s/"
        url = f"{self.server.hub.endpoint}/{prefix}{repo_id}"
        try:
            self.server.hub.store.create_repo(repo_id, kind, bool(private))
        except HubError as error:  # the Hub's 409 carries the url too: create_repo(exist_ok=True) returns it
            return self._json(error.status, {"error": error.message, "url": url})
        return self._json(200, {"url": url, "name": repo_id})

    def _resolve(self, method: str, segments: list):
        """`{prefix/}{repo_id}/resolve/{rev}/{path}`: the file, with the headers hf_hub_download checks."""
        kind = _KINDS[segments[0]] if segments[0] in ("datasets", "spaces") else "model"
        rest = segments[1:] if kind != "model" else segments
        if method not in ("GET", "HEAD") or len(rest) < 5 or rest[2] != "resolve":
            raise HubError(404, None, f"loopback hub: no route for {method} /{'/'.join(segments)}")
        repo_id, revision, path = "/".join(rest[:2]), rest[3], "/".join(rest[4:])
        store = self.server.hub.store
        sha = store.resolve(repo_id, revision, kind)
        self.extra = {"X-Repo-Commit": sha}
        data = store.files(repo_id, sha, kind).get(path)
        if data is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {revision}")
        self._send(200, data, "application/octet-stream",
                   {"ETag": f'"{git_blob_sha(data)}"', "X-Repo-Commit": sha})


def _form_or_json(content_type: str, body: bytes) -> dict:
    """paths-info posts a form (`paths` repeated); accept JSON too."""
    if "json" in content_type:
        return json.loads(body or b"{}")
    return parse_qs(body.decode())
