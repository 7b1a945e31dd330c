"""hf_omni.testing.LoopbackHub answers the real huggingface_hub client: pushes land as the commits the tests count,
pulls return the pushed bytes, and injected failures surface quickly as the client's own errors."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
)

from hf_omni.testing import LoopbackHub

FOLDER = {"README.md": b"---\nlicense: mit\n---\n# tiny\n", "config.json": b'{"a": 1}',
          "weights/model.bin": bytes(range(256)) * 8, "weights/deep/extra.txt": b"extra\n"}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The in-process recipe: huggingface_hub read its env at import, so patch the constants it reads at call time."""
    with LoopbackHub() as hub:
        for name, value in hub.client_constants(tmp_path / "hub-cache").items():
            monkeypatch.setattr(constants, name, value)
        yield hub


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "folder"
    for rel, data in FOLDER.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def _read_tree(path) -> dict:
    """{relative path: bytes} of a downloaded folder, without the .cache/ that a local_dir download keeps."""
    tree = {}
    for d, _, files in os.walk(path):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), path).replace(os.sep, "/")
            if not rel.startswith(".cache/"):
                with open(os.path.join(d, f), "rb") as fh:
                    tree[rel] = fh.read()
    return tree


def test_create_repo_and_upload_folder_in_one_commit(hub, folder):
    api = HfApi(endpoint=hub.endpoint)
    assert api.create_repo("me/model", private=True) == f"{hub.endpoint}/me/model"
    api.create_repo("me/public")
    assert api.create_repo("me/model", exist_ok=True) == f"{hub.endpoint}/me/model"
    with pytest.raises(HfHubHTTPError, match="409"):
        api.create_repo("me/model")
    info = api.upload_folder(repo_id="me/model", folder_path=folder, commit_message="first push")
    assert hub.files("me/model") == FOLDER
    created, pushed = hub.commits("me/model")  # like the Hub: create_repo makes an (empty) initial commit
    assert (created["message"], created["paths"]) == ("initial commit", [])
    assert (pushed["sha"], pushed["message"], sorted(pushed["paths"])) == (info.oid, "first push", sorted(FOLDER))
    assert hub.repos["me/model"]["private"] is True and hub.repos["me/public"]["private"] is False
    assert hub.repos["me/model"]["branches"]["main"] == info.oid == api.repo_info("me/model").sha
    again = api.upload_folder(repo_id="me/model", folder_path=folder)  # unchanged: the client skips the commit
    assert again.oid == info.oid and len(hub.commits("me/model")) == 2


def test_branch_upload_leaves_main_untouched(hub, folder):
    api = HfApi(endpoint=hub.endpoint)
    api.create_repo("me/model")
    main = api.upload_folder(repo_id="me/model", folder_path=folder).oid
    api.create_branch("me/model", branch="exp/lr-1e-4")
    with pytest.raises(HfHubHTTPError, match="409"):
        api.create_branch("me/model", branch="exp/lr-1e-4")
    api.create_branch("me/model", branch="exp/lr-1e-4", exist_ok=True)
    api.upload_file(path_or_fileobj=b"new", path_in_repo="weights/model.bin", repo_id="me/model",
                    revision="exp/lr-1e-4", commit_message="on the branch")
    assert hub.files("me/model") == FOLDER and hub.repos["me/model"]["branches"]["main"] == main
    assert hub.files("me/model", revision="exp/lr-1e-4") == {**FOLDER, "weights/model.bin": b"new"}
    assert [c["revision"] for c in hub.commits("me/model")] == ["main", "main", "exp/lr-1e-4"]
    assert {ref.name for ref in api.list_repo_refs("me/model").branches} == {"main", "exp/lr-1e-4"}


def test_snapshot_and_file_downloads(hub, folder, tmp_path):
    api = HfApi(endpoint=hub.endpoint)
    api.create_repo("me/model")
    first = api.upload_folder(repo_id="me/model", folder_path=folder).oid
    api.upload_file(path_or_fileobj=b"v2", path_in_repo="config.json", repo_id="me/model")
    weights = snapshot_download("me/model", allow_patterns=["weights/*"])
    assert _read_tree(weights) == {k: v for k, v in FOLDER.items() if k.startswith("weights/")}
    assert _read_tree(snapshot_download("me/model", revision=first)) == FOLDER
    assert _read_tree(snapshot_download("me/model", local_dir=tmp_path / "out")) == {**FOLDER, "config.json": b"v2"}
    with open(hf_hub_download("me/model", "weights/model.bin"), "rb") as f:
        assert f.read() == FOLDER["weights/model.bin"]
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download("me/model", "missing.bin")
    with pytest.raises(RevisionNotFoundError):
        api.repo_info("me/model", revision="no-such-branch")
    with pytest.raises(RepositoryNotFoundError):
        api.repo_info("me/no-such-repo")


def test_injected_failure_raises_quickly_and_spares_other_repos(hub, folder):
    api = HfApi(endpoint=hub.endpoint)
    api.create_repo("me/bad")
    api.create_repo("me/good")
    hub.fail(lambda method, path: "/commit/" in path and "bad" in path)
    start = time.monotonic()
    with pytest.raises(HfHubHTTPError, match="500"):
        api.upload_folder(repo_id="me/bad", folder_path=folder)
    assert time.monotonic() - start < 5
    assert len(hub.commits("me/bad")) == 1 and hub.files("me/bad") == {}
    api.upload_folder(repo_id="me/good", folder_path=folder)
    assert hub.files("me/good") == FOLDER
    hub.fail(None)
    api.upload_folder(repo_id="me/bad", folder_path=folder)
    assert hub.files("me/bad") == FOLDER


def test_token_reaches_the_server_as_bearer(hub, folder):
    token = "hf_secret_loopback_token"
    api = HfApi(endpoint=hub.endpoint, token=token)
    api.create_repo("me/model", private=True)
    api.upload_folder(repo_id="me/model", folder_path=folder)
    snapshot_download("me/model", token=token)
    mine = [(method, path, headers) for method, path, headers in hub.requests if "me/model" in path]
    assert {headers.get("authorization") for _, _, headers in mine} == {f"Bearer {token}"}
    assert {"/commit/", "/preupload/", "/resolve/"} <= {part for _, path, _ in mine for part in
                                                        ("/commit/", "/preupload/", "/resolve/") if part in path}
    assert any(method == "HEAD" for method, _, _ in mine)


def test_endpoint_argument_alone_needs_no_patched_urls(monkeypatch, folder, tmp_path):
    """Without the fixture's URL patches: HfApi(endpoint=) and the downloads' endpoint= reach the hub."""
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    with LoopbackHub() as hub:
        api = HfApi(endpoint=hub.endpoint)
        api.create_repo("me/model")
        api.upload_folder(repo_id="me/model", folder_path=folder)
        path = snapshot_download("me/model", endpoint=hub.endpoint, cache_dir=tmp_path / "cache")
        assert _read_tree(path) == FOLDER
        with open(hf_hub_download("me/model", "config.json", endpoint=hub.endpoint, cache_dir=tmp_path / "c2"),
                  "rb") as f:
            assert f.read() == FOLDER["config.json"]


def test_subprocess_client_configured_by_environment(folder, tmp_path):
    """The other recipe: a fresh interpreter that reads HF_ENDPOINT etc. at import."""
    script = ("import sys\nfrom huggingface_hub import HfApi, snapshot_download\n"
              "HfApi().create_repo('me/sub')\nHfApi().upload_folder(repo_id='me/sub', folder_path=sys.argv[1])\n"
              "print(snapshot_download('me/sub'))\n")
    with LoopbackHub() as hub:
        env = {k: v for k, v in os.environ.items()
               if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE")}
        env.update(hub.client_env(tmp_path / "home"))
        assert env["HF_ENDPOINT"] == hub.endpoint and env["HF_HUB_DISABLE_XET"] == "1"
        done = subprocess.run([sys.executable, "-c", script, str(folder)], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert hub.files("me/sub") == FOLDER and len(hub.commits("me/sub")) == 2
        assert _read_tree(done.stdout.strip().splitlines()[-1]) == FOLDER


def test_unknown_routes_answer_json_404(hub):
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(f"{hub.endpoint}/api/spaces/me/x/discussions")
    assert error.value.code == 404 and "no route" in json.loads(error.value.read())["error"]
