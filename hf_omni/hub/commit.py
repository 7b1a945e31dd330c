"""One commit to a Hub repo: the repo (and branch) created if missing, stale files of an earlier push deleted in the
same commit, a failure raised as `HubPushError` naming what was pushed where. `push` and `released_push` commit
through it.
"""

from __future__ import annotations


class HubPushError(RuntimeError):
    """A push to the Hub failed: names the module (or the composition) and the repo."""


def commit(api, repo_id: str, operations: list, message: str, what: str, token, private, revision,
           managed=lambda path: path != ".gitattributes") -> str:
    """One commit to `repo_id` (created if missing; `revision` a branch created from main if missing). Files a
    previous push left under the paths this push manages (`managed(path)`) and does not write again are deleted in
    the same commit: a stale adapter or shard must not load beside the new weights."""
    from huggingface_hub import CommitOperationDelete

    try:
        api.create_repo(repo_id, token=token, private=private, exist_ok=True)
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
        added = {op.path_in_repo for op in operations}
        existing = api.list_repo_files(repo_id, revision=revision, token=token)
        operations = operations + [CommitOperationDelete(p) for p in existing if p not in added and managed(p)]
        info = api.create_commit(repo_id, operations, commit_message=message, token=token, revision=revision)
    except Exception as err:  # network, HTTP or file errors: one error naming what was pushed where
        raise HubPushError(f"{what}: pushing to {repo_id} failed: {type(err).__name__}: {err}") from err
    return info.oid
