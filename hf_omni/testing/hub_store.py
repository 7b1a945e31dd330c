"""The loopback hub's state: repos, branches and immutable commits behind one lock.

Kept apart from the HTTP plumbing so the rules (what a commit does to a branch, what a revision resolves to) can be
read on their own; every method answers copies, so callers never hold references into the store.
"""

import base64
import hashlib
import itertools
import threading


def git_blob_sha(data: bytes) -> str:
    """The git blob id, which the Hub (and huggingface_hub's no-op detection) uses as a regular file's oid/ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubError(Exception):
    """An answer the Hub gives as an HTTP error: status, `X-Error-Code` header (or None) and message."""

    def __init__(self, status: int, code, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class HubStore:
    """Repos keyed by repo_id (one type per id); a commit is a full {path: bytes} snapshot plus its parent."""

    def __init__(self):
        self.lock = threading.RLock()
        self._repos = {}
        self._serial = itertools.count()

    def _repo(self, repo_id: str, repo_type: str = None) -> dict:
        repo = self._repos.get(repo_id)
        if repo is None or (repo_type is not None and repo["type"] != repo_type):
            raise HubError(404, "RepoNotFound", f"Repository {repo_id!r} not found")
        return repo

    def _new_commit(self, repo: dict, parent, files: dict, revision: str, message: str, paths) -> str:
        seed = f"{repo['id']}|{parent}|{message}|{next(self._serial)}|" + "|".join(
            f"{p}:{git_blob_sha(d)}" for p, d in sorted(files.items()))
        sha = hashlib.sha1(seed.encode()).hexdigest()
        repo["commits"][sha] = {"sha": sha, "parent": parent, "files": files, "revision": revision,
                                "message": message, "paths": list(paths)}
        repo["order"].append(sha)
        return sha

    def create_repo(self, repo_id: str, repo_type: str = "model", private: bool = False) -> None:
        """Like the Hub: `main` exists at once, on an "initial commit" (empty: no .gitattributes, tests compare files)."""
        with self.lock:
            if repo_id in self._repos:
                raise HubError(409, None, f"You already created this {repo_type} repo: {repo_id}")
            repo = {"id": repo_id, "type": repo_type, "private": bool(private), "branches": {}, "commits": {},
                    "order": []}
            self._repos[repo_id] = repo
            repo["branches"]["main"] = self._new_commit(repo, None, {}, "main", "initial commit", [])

    def resolve(self, repo_id: str, revision: str, repo_type: str = None) -> str:
        """A branch name or a full commit sha of this repo -> the commit sha."""
        with self.lock:
            repo = self._repo(repo_id, repo_type)
            sha = repo["branches"].get(revision, revision if revision in repo["commits"] else None)
            if sha is None:
                raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return sha

    def create_branch(self, repo_id: str, branch: str, starting_point: str = None, repo_type: str = None) -> None:
        with self.lock:
            repo = self._repo(repo_id, repo_type)
            if branch in repo["branches"]:
                raise HubError(409, None, f"Reference already exists: refs/heads/{branch}")
            repo["branches"][branch] = self.resolve(repo_id, starting_point or "main")

    def commit(self, repo_id: str, revision: str, header: dict, operations, repo_type: str = None) -> str:
        """Applies the NDJSON operations on top of the branch head; a stale `parentCommit` is refused (412)."""
        with self.lock:
            repo = self._repo(repo_id, repo_type)
            if revision not in repo["branches"]:
                raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision} (commits go to branches)")
            head = repo["branches"][revision]
            if header.get("parentCommit") not in (None, head):
                raise HubError(412, None, f"A commit has happened since. Please refresh and try again. ({head})")
            files, paths = dict(repo["commits"][head]["files"]), []
            for key, value in operations:
                path = value.get("path", "").strip("/")
                paths.append(path)
                if key == "file":
                    files[path] = base64.b64decode(value["content"]) if value.get("encoding") == "base64" \
                        else value["content"].encode()
                elif key == "deletedFile":
                    if files.pop(path, None) is None:
                        raise HubError(404, "EntryNotFound", f"A file with this name doesn't exist: {path}")
                elif key == "deletedFolder":
                    files = {p: d for p, d in files.items() if not p.startswith(path + "/")}
                else:
                    raise HubError(400, None, f"loopback hub: unsupported commit operation {key!r} ({path})")
            message = "\n\n".join(m for m in (header.get("summary"), header.get("description")) if m)
            sha = self._new_commit(repo, head, files, revision, message, paths)
            repo["branches"][revision] = sha
            return sha

    def files(self, repo_id: str, revision: str = "main", repo_type: str = None) -> dict:
        with self.lock:
            sha = self.resolve(repo_id, revision, repo_type)
            return dict(self._repos[repo_id]["commits"][sha]["files"])

    def info(self, repo_id: str, revision: str = "main", repo_type: str = None) -> dict:
        """The pieces of /api/models/{repo}[/revision/{rev}] that come from the store."""
        with self.lock:
            sha = self.resolve(repo_id, revision, repo_type)
            repo = self._repos[repo_id]
            files = repo["commits"][sha]["files"]
            siblings = [{"rfilename": p, "size": len(files[p]), "blobId": git_blob_sha(files[p])} for p in sorted(files)]
            return {"id": repo_id, "sha": sha, "private": repo["private"], "siblings": siblings}

    def entries(self, repo_id: str, revision: str, paths=None, under: str = "", recursive: bool = False,
                repo_type: str = None) -> list:
        """Tree entries, either the named `paths` (paths-info) or the tree `under` a folder (404 if no such folder)."""
        files = self.files(repo_id, revision, repo_type)
        folders = {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}
        if paths is None:
            under = under.strip("/")
            if under and under not in folders:
                raise HubError(404, "EntryNotFound", f"{under} does not exist on {revision}")
            prefix = under + "/" if under else ""
            paths = [p for p in sorted(set(files) | folders) if p.startswith(prefix)
                     and (recursive or "/" not in p[len(prefix):])]
        result = []
        for path in paths:
            path = path.strip("/")
            if path in files:
                data = files[path]
                result.append({"type": "file", "oid": git_blob_sha(data), "size": len(data), "path": path})
            elif path in folders:
                inside = "|".join(f"{p}:{git_blob_sha(d)}" for p, d in sorted(files.items()) if p.startswith(path + "/"))
                result.append({"type": "directory", "oid": hashlib.sha1(inside.encode()).hexdigest(), "size": 0,
                               "path": path})
        return result

    def repos(self) -> dict:
        with self.lock:
            return {rid: {"private": r["private"], "type": r["type"], "branches": dict(r["branches"]),
                          "commits": len(r["order"])} for rid, r in self._repos.items()}

    def commits(self, repo_id: str) -> list:
        """Every commit of every branch, oldest first: create_repo's "initial commit" (paths []), then each push."""
        with self.lock:
            repo = self._repo(repo_id)
            return [{k: list(v) if k == "paths" else v for k, v in repo["commits"][sha].items()
                     if k in ("sha", "revision", "message", "paths")} for sha in repo["order"]]
