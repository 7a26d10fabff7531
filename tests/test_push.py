"""push: artifact checks, the dry-run plan, and real uploads to the loopback Hub (in-process)."""

from __future__ import annotations

import json

import pytest
from hub_fixtures import FAKE_TOKEN, SOURCE_ID, make_artifact
from hub_server import FakeHub
from huggingface_hub import ModelCard

import dflash_quant.hub.push as push_mod
from dflash_quant.artifact.manifest import write_manifest
from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.hub.push import check_artifact, plan_push, push_artifact

REPO = "dflash-org/qwen3-8b-dflash-int4"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return make_artifact(tmp_path_factory.mktemp("push") / "art")


@pytest.fixture(autouse=True)
def online_fast_retries(monkeypatch):
    """The suite runs with HF_HUB_OFFLINE=1 (tests/conftest.py); these tests only talk to 127.0.0.1."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(push_mod, "RETRY_WAIT_S", 0.01)


@pytest.fixture
def no_xet(monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)


def _push(artifact, hub, **kw):
    kw.setdefault("token", FAKE_TOKEN)
    return push_artifact(artifact, REPO, endpoint=hub.url, **kw)


def _assert_all_arrived(hub, artifact, revision="main"):
    files = hub.files(REPO, revision)
    manifest = json.loads((artifact / "manifest.json").read_text())
    expected = set(manifest["files"]) | {"manifest.json"}
    assert set(files) == expected
    for name in expected:
        assert files[name] == (artifact / name).read_bytes(), name


# --------------------------------------------------------------------------- checks and plan


def test_check_clean_artifact(artifact):
    assert check_artifact(artifact) == []


def test_plan_lists_files_without_network(artifact):
    plan = plan_push(artifact, REPO, endpoint="http://127.0.0.1:9")
    by_path = {f.path: f for f in plan.files}
    assert by_path["model.safetensors"].large_file and by_path["acceptance.png"].large_file
    assert not by_path["README.md"].large_file and "manifest.json" in by_path
    assert by_path["model.safetensors"].bytes == (artifact / "model.safetensors").stat().st_size
    assert plan.total_bytes == sum((artifact / p).stat().st_size for p in by_path)
    assert plan.commit_message.startswith("Upload GPTQ int4 g128 DFlash drafter")
    assert plan.revision == "main" and not plan.create_pr


def test_plan_rejects_bad_args(artifact):
    with pytest.raises(UsageError):
        plan_push(artifact, "not-a-repo-id")
    with pytest.raises(UsageError):
        plan_push(artifact, REPO, revision="dev", create_pr=True)


def test_manifest_mismatch_refused_even_forced(tmp_path):
    art = make_artifact(tmp_path / "a", big_bytes=0)
    data = (art / "config.json").read_text()
    (art / "config.json").write_text(data.replace('"hidden_size": 256', '"hidden_size": 257'))  # same size
    for force in (False, True):
        with pytest.raises(DFlashQuantError, match="config.json does not match its sha256.*gptq.*does not override"):
            check_artifact(art, force=force)


def test_missing_and_failing_parity_refused(tmp_path):
    art = make_artifact(tmp_path / "m", big_bytes=0, parity=False)
    with pytest.raises(DFlashQuantError, match="parity.json is missing"):
        check_artifact(art)
    art2 = make_artifact(tmp_path / "f", big_bytes=0, parity_passed=False)
    with pytest.raises(DFlashQuantError, match="parity check did not pass"):
        check_artifact(art2)
    assert any("parity" in w for w in check_artifact(art2, force=True))


def test_missing_directory(tmp_path):
    with pytest.raises(DFlashQuantError, match="does not exist"):
        check_artifact(tmp_path / "nope", force=True)


# --------------------------------------------------------------------------- uploads


def test_push_regular_path(artifact):
    with FakeHub(FAKE_TOKEN, upload_mode="regular") as hub:
        result = _push(artifact, hub)
        _assert_all_arrived(hub, artifact)
        commits = hub.commits(REPO)
        assert len(commits) == 1 and set(commits[0]["kinds"].values()) == {"file"}
        assert result.commit_url == f"{hub.url}/{REPO}/commit/{commits[0]['oid']}"
        assert result.commit_oid == commits[0]["oid"] and result.pr_url is None
        assert not hub.requests("PUT")
        card = ModelCard(hub.files(REPO)["README.md"].decode())
        assert card.data.base_model == SOURCE_ID
        assert hub.state.validated_yaml and "base_model_relation: quantized" in hub.state.validated_yaml[0]
        assert all(r.auth_ok for r in hub.requests() if r.path.startswith("/api/"))


def test_push_lfs_path(artifact, no_xet):
    with FakeHub(FAKE_TOKEN, upload_mode="auto") as hub:
        _push(artifact, hub)
        _assert_all_arrived(hub, artifact)
        kinds = hub.commits(REPO)[0]["kinds"]
        assert kinds["model.safetensors"] == "lfsFile" and kinds["acceptance.png"] == "lfsFile"
        assert kinds["config.json"] == "file"
        assert len(hub.requests("PUT", "/lfs-upload/")) == 2
        assert len(hub.requests("POST", "/lfs-verify/")) == 2
        # The PUT to the storage href carries no Authorization header.
        assert not any(r.has_auth for r in hub.requests("PUT"))


def test_existing_repo_branch_and_pr(artifact):
    with FakeHub(FAKE_TOKEN, upload_mode="regular") as hub:
        hub.add_repo(REPO)
        _push(artifact, hub, revision="int4-g128")
        create = hub.requests("POST", "/api/repos/create")
        assert create[0].status == 409  # exists: create_repo(exist_ok=True) goes on
        assert hub.requests("POST", "/branch/int4-g128")[0].status == 200
        _assert_all_arrived(hub, artifact, "int4-g128")
        assert hub.files(REPO, "main") == {}
        result = _push(artifact, hub, create_pr=True, commit_message="Add int4 drafter")
        assert result.pr_url == f"{hub.url}/{REPO}/discussions/1"
        assert hub.commits(REPO)[-1]["summary"] == "Add int4 drafter"
        _assert_all_arrived(hub, artifact, "refs/pr/1")


def test_500_then_success_on_commit(artifact):
    with FakeHub(FAKE_TOKEN, upload_mode="regular") as hub:
        hub.fail("POST", r"/commit/", 500, times=1)
        _push(artifact, hub)
        assert [r.status for r in hub.requests("POST", "/commit/")] == [500, 200]
        assert len(hub.commits(REPO)) == 1
        _assert_all_arrived(hub, artifact)


def test_the_loopback_hub_logs_a_request_before_it_answers(monkeypatch):
    """A test reads the request log as soon as its call returns, so the log must be written before the response
    (logged after it, the retried commit above was missing under load)."""
    import urllib.error
    import urllib.request

    import hub_server

    logged_at_answer: list[int] = []
    send_response = hub_server._Handler.send_response

    def spy(handler, code, message=None):
        logged_at_answer.append(len(handler.server.state.requests))
        send_response(handler, code, message)

    monkeypatch.setattr(hub_server._Handler, "send_response", spy)
    with FakeHub(FAKE_TOKEN) as hub:
        hub.fail("GET", r"/probe", 503)
        with pytest.raises(urllib.error.HTTPError, match="503"):
            urllib.request.urlopen(f"{hub.url}/probe", timeout=10)
        assert [r.status for r in hub.requests("GET", "/probe")] == [503]
    assert logged_at_answer == [1]


def test_500_then_success_on_preupload(artifact):
    with FakeHub(FAKE_TOKEN, upload_mode="regular") as hub:
        hub.fail("POST", r"/preupload/", 503, times=1)
        _push(artifact, hub)  # huggingface_hub's own http_backoff retries preupload
        assert [r.status for r in hub.requests("POST", "/preupload/")] == [503, 200]


@pytest.mark.parametrize(
    "status,pattern,expect",
    [
        (401, None, "set HF_TOKEN"),
        (403, r"^/api/repos/create$", "no write access to 'dflash-org'"),
        (409, r"/commit/", "conflict"),
        (404, r"/preupload/", "not found"),
    ],
)
def test_http_errors(artifact, status, pattern, expect):
    token = FAKE_TOKEN if status != 401 else FAKE_TOKEN + "x"  # 401: the server expects another token
    with FakeHub(token, upload_mode="regular") as hub:
        if pattern:
            hub.fail("POST", pattern, status, times=-1)
        with pytest.raises(DFlashQuantError) as info:
            _push(artifact, hub)
        message = str(info.value)
        assert expect in message
        assert FAKE_TOKEN not in message and "\n" not in message
        assert info.value.__cause__ is None and info.value.__suppress_context__


def test_persistent_500_gives_up(artifact):
    with FakeHub(FAKE_TOKEN, upload_mode="regular") as hub:
        hub.fail("POST", r"/commit/", 502, times=-1)
        with pytest.raises(DFlashQuantError, match=r"after 3 attempts \(HTTP 502\)"):
            _push(artifact, hub)


def test_connection_refused(artifact):
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(DFlashQuantError, match="cannot connect to .*check --endpoint"):
        push_artifact(artifact, REPO, endpoint=f"http://127.0.0.1:{port}", token=FAKE_TOKEN)


def test_offline_mode_is_named(artifact, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with FakeHub(FAKE_TOKEN) as hub:
        with pytest.raises(DFlashQuantError, match="unset HF_HUB_OFFLINE"):
            _push(artifact, hub)
        assert not hub.requests()


def test_token_inside_artifact_refused(tmp_path):
    art = make_artifact(tmp_path / "t", big_bytes=0)
    (art / "notes.txt").write_text(f"token={FAKE_TOKEN}\n")
    write_manifest(art)
    with FakeHub(FAKE_TOKEN) as hub:
        with pytest.raises(DFlashQuantError, match="notes.txt contains your Hugging Face token") as info:
            push_artifact(art, REPO, endpoint=hub.url, token=FAKE_TOKEN, force=True)
        assert FAKE_TOKEN not in str(info.value)
        assert not hub.requests()
