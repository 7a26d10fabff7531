"""`dflash-quant card` / `push` as real subprocesses against the loopback Hub.

Each CLI start imports the whole package (seconds), so the scenarios run concurrently, once, in a
module fixture; the tests then assert on the recorded results. The refusal / 403 variants that need no
process boundary are covered in-process in tests/test_push.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hub_fixtures import FAKE_TOKEN, SOURCE_ID, make_artifact
from hub_server import FakeHub
from huggingface_hub import ModelCard

from dflash_quant.artifact.manifest import write_manifest

pytestmark = pytest.mark.slow

CLI = str(Path(sys.executable).with_name("dflash-quant"))
REPO = "dflash-org/qwen3-8b-dflash-int4"


@dataclass
class Run:
    args: list[str]
    env: dict
    hub: FakeHub | None = None
    artifact: Path | None = None
    home: Path | None = None
    rc: int | None = None
    stdout: str = ""
    stderr: str = ""
    extra: dict = field(default_factory=dict)


def _closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def _env(home: Path, **extra: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "HUGGINGFACE_HUB_TOKEN"}
    env.update(
        {
            "HF_HOME": str(home),
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_TOKEN": FAKE_TOKEN,
            "PYTHONUNBUFFERED": "1",
            "COLUMNS": "200",
        }
    )
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hubcli")
    base = make_artifact(root / "base")

    def artifact(name: str, **kw) -> Path:
        if not kw:
            dest = root / name
            shutil.copytree(base, dest)
            return dest
        return make_artifact(root / name, **kw)

    scenarios: dict[str, Run] = {}

    def add(name: str, args: list[str], *, hub: FakeHub | None = None, art: Path | None = None, **env) -> None:
        home = root / f"home-{name}"
        home.mkdir()
        art = art or artifact(f"art-{name}")
        if hub is not None:
            hub.start()
        full = [CLI, *[a.format(art=art, hub=hub.url if hub else "") for a in args]]
        scenarios[name] = Run(full, _env(home, **env), hub, art, home)

    add(
        "regular",
        ["push", "{art}", "--repo-id", REPO],
        hub=FakeHub(FAKE_TOKEN, upload_mode="regular"),
        HF_ENDPOINT="{hub}",
    )
    add(
        "lfs",
        ["push", "{art}", "--repo-id", REPO, "--endpoint", "{hub}", "--json", "--commit-message", "int4 drafter"],
        hub=FakeHub(FAKE_TOKEN, upload_mode="auto"),
        HF_HUB_DISABLE_XET="1",
    )
    add(
        "dry_run",
        ["push", "{art}", "--repo-id", REPO, "--dry-run", "--endpoint", f"http://127.0.0.1:{_closed_port()}"],
        HF_TOKEN=None,
    )
    mismatch = artifact("art-mismatch-src")
    (mismatch / "parity.json").write_text((mismatch / "parity.json").read_text().replace("4.2137", "4.9"))
    add(
        "mismatch",
        ["push", "{art}", "--repo-id", REPO, "--endpoint", "{hub}"],
        art=mismatch,
        hub=FakeHub(FAKE_TOKEN, upload_mode="regular"),
    )
    forced = artifact("art-forced-src", parity_passed=False)
    add(
        "forced",
        ["push", "{art}", "--repo-id", REPO, "--endpoint", "{hub}", "--force"],
        art=forced,
        hub=FakeHub(FAKE_TOKEN, upload_mode="regular"),
    )
    add(
        "e401", ["push", "{art}", "--repo-id", REPO, "--endpoint", "{hub}"], hub=FakeHub("hf_someOtherValidToken000000")
    )
    h409 = FakeHub(FAKE_TOKEN, upload_mode="regular")
    h409.fail("POST", r"/commit/", 409, times=-1, body={"error": "A commit has happened since"})
    add("e409", ["push", "{art}", "--repo-id", REPO, "--endpoint", "{hub}"], hub=h409)
    h500 = FakeHub(FAKE_TOKEN, upload_mode="regular")
    h500.fail("POST", r"/commit/", 500, times=1)
    add("e500_then_ok", ["push", "{art}", "--repo-id", REPO, "--endpoint", "{hub}"], hub=h500)
    add("refused", ["push", "{art}", "--repo-id", REPO, "--endpoint", f"http://127.0.0.1:{_closed_port()}"])
    add("no_token", ["push", "{art}", "--repo-id", REPO, "--endpoint", "{hub}"], hub=FakeHub(FAKE_TOKEN), HF_TOKEN=None)
    add("usage_pr_revision", ["push", "{art}", "--repo-id", REPO, "--revision", "dev", "--create-pr", "--dry-run"])
    card_art = artifact("art-card-src", card=False)
    add("card", ["card", "{art}", "--json", "--repo-id", REPO], art=card_art)

    # Integrity (issue #13): refused before any request, --force or not; card/memory keep the manifest.
    outside = root / "outside.txt"
    outside.write_bytes(b"private notes that must never reach the Hub\n")

    def listed(art: Path, name: str, content: bytes) -> None:
        manifest = json.loads((art / "manifest.json").read_text())
        manifest["files"][name] = {"sha256": hashlib.sha256(content).hexdigest(), "bytes": len(content)}
        (art / "manifest.json").write_text(json.dumps(manifest))

    sym = artifact("art-symlink-src")
    (sym / "notes.txt").symlink_to(outside)
    listed(sym, "notes.txt", outside.read_bytes())
    dotdot = artifact("art-dotdot-src")
    listed(dotdot, "../outside.txt", outside.read_bytes())
    absolute = artifact("art-abs-src")
    listed(absolute, str(outside), outside.read_bytes())
    for name, art in (("push_symlink", sym), ("push_dotdot", dotdot), ("push_abs", absolute)):
        add(
            name,
            ["push", "{art}", "--repo-id", REPO, "--endpoint", "{hub}", "--force"],
            art=art,
            hub=FakeHub(FAKE_TOKEN, upload_mode="regular"),
        )
    for name, cmd in (
        ("card_tampered", ["card", "{art}"]),
        ("memory_tampered", ["memory", "{art}", "--device", "none"]),
    ):
        art = artifact(f"art-{name}-src")
        data = bytearray((art / "model.safetensors").read_bytes())
        data[-100] ^= 1
        (art / "model.safetensors").write_bytes(bytes(data))
        add(name, cmd, art=art)
        scenarios[name].extra["manifest"] = (art / "manifest.json").read_bytes()
    bad_prov = artifact("art-bad-prov-src")
    (bad_prov / "provenance.json").write_text(json.dumps({"source_drafter": "z-lab/x"}))
    write_manifest(bad_prov)
    add("card_bad_provenance", ["card", "{art}"], art=bad_prov)

    for run in scenarios.values():  # HF_ENDPOINT given as a template above
        if run.env.get("HF_ENDPOINT") == "{hub}":
            run.env["HF_ENDPOINT"] = run.hub.url

    def execute(run: Run) -> Run:
        proc = subprocess.run(run.args, env=run.env, capture_output=True, text=True, timeout=300)
        run.rc, run.stdout, run.stderr = proc.returncode, proc.stdout, proc.stderr
        return run

    with ThreadPoolExecutor(max_workers=len(scenarios)) as pool:
        list(pool.map(execute, scenarios.values()))
    yield scenarios
    for run in scenarios.values():
        if run.hub is not None:
            run.hub.stop()


def _files_written_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def _assert_all_arrived(run: Run, revision: str = "main") -> None:
    files = run.hub.files(REPO, revision)
    manifest = json.loads((run.artifact / "manifest.json").read_text())
    assert set(files) == set(manifest["files"]) | {"manifest.json"}
    for name, data in files.items():
        assert data == (run.artifact / name).read_bytes(), name


def test_token_never_leaks(runs):
    for name, run in runs.items():
        assert FAKE_TOKEN not in run.stdout, name
        assert FAKE_TOKEN not in run.stderr, name
        for path in _files_written_under(run.home) + _files_written_under(run.artifact):
            assert FAKE_TOKEN.encode() not in path.read_bytes(), (name, path)
        if run.hub is not None:
            assert FAKE_TOKEN not in repr(run.hub.state.requests), name


def test_push_regular_via_hf_endpoint(runs):
    run = runs["regular"]
    assert run.rc == 0, run.stderr
    commits = run.hub.commits(REPO)
    assert len(commits) == 1
    assert run.stdout.strip() == f"{run.hub.url}/{REPO}/commit/{commits[0]['oid']}"
    _assert_all_arrived(run)
    card = ModelCard(run.hub.files(REPO)["README.md"].decode())
    assert card.data.base_model == SOURCE_ID
    assert card.data.to_dict()["base_model_relation"] == "quantized"
    assert {"dflash", "speculative-decoding", "gptq", "int4"} <= set(card.data.tags)
    assert all(r.auth_ok for r in run.hub.requests() if r.path.startswith("/api/"))
    assert all(r.user_agent.startswith("dflash-quant/") for r in run.hub.requests() if r.path.startswith("/api/"))


def test_push_lfs_path_json(runs):
    run = runs["lfs"]
    assert run.rc == 0, run.stderr
    result = json.loads(run.stdout)
    commit = run.hub.commits(REPO)[0]
    assert result["commit_oid"] == commit["oid"] and result["commit_url"].endswith(commit["oid"])
    assert commit["summary"] == "int4 drafter"
    assert commit["kinds"]["model.safetensors"] == "lfsFile"
    assert len(run.hub.requests("PUT", "/lfs-upload/")) == 2
    assert run.hub.requests("POST", ".git/info/lfs/objects/batch")
    _assert_all_arrived(run)


def test_dry_run_makes_no_network_call(runs):
    run = runs["dry_run"]
    assert run.rc == 0, run.stderr
    assert "model.safetensors" in run.stdout and "large file" in run.stdout
    size = (run.artifact / "model.safetensors").stat().st_size
    assert f"{size:,}" in run.stdout
    assert "nothing is sent" in run.stderr


@pytest.mark.parametrize(
    "name,expect",
    [
        ("mismatch", "parity.json does not match its sha256"),
        ("push_symlink", "notes.txt is a symlink"),
        ("push_dotdot", "'..' part"),
        ("push_abs", "is an absolute path"),
    ],
)
def test_refusals(runs, name, expect):
    run = runs[name]
    assert run.rc == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expect in errors[0] and "dflash-quant gptq" in errors[0], run.stderr
    assert "Traceback" not in run.stderr
    assert not run.hub.requests()  # refused before any request, create_repo included, even with --force
    assert "private notes" not in repr(run.hub.state.requests)


@pytest.mark.parametrize(
    "name,expect",
    [
        ("card_tampered", "card: artifact"),
        ("memory_tampered", "memory: artifact"),
        ("card_bad_provenance", "provenance.json field 'source_drafter' must be an object"),
    ],
)
def test_later_stages_refuse_a_damaged_artifact(runs, name, expect):
    run = runs[name]
    assert run.rc == 1, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expect in errors[0] and "dflash-quant gptq" in errors[0], run.stderr
    assert "Traceback" not in run.stderr
    if "manifest" in run.extra:  # the recorded (original) hash is kept, so push refuses too
        assert (run.artifact / "manifest.json").read_bytes() == run.extra["manifest"]
        assert "model.safetensors does not match its sha256" in errors[0]


def test_force_pushes_with_warning(runs):
    run = runs["forced"]
    assert run.rc == 0, run.stderr
    assert "warning: --force" in run.stderr and "parity check did not pass" in run.stderr
    _assert_all_arrived(run)


@pytest.mark.parametrize(
    "name,expect",
    [
        ("e401", "set HF_TOKEN to a valid write token or run `hf auth login`"),
        ("e409", "conflict"),
        ("refused", "cannot connect to"),
        ("no_token", "no Hugging Face token found"),
    ],
)
def test_errors_are_one_line(runs, name, expect):
    run = runs[name]
    assert run.rc == 1, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expect in errors[0], run.stderr
    assert "Traceback" not in run.stderr
    assert run.stdout == ""


def test_500_then_success(runs):
    run = runs["e500_then_ok"]
    assert run.rc == 0, run.stderr
    assert [r.status for r in run.hub.requests("POST", "/commit/")] == [500, 200]
    assert "retrying" in run.stderr
    _assert_all_arrived(run)


def test_usage_error_exit_2(runs):
    run = runs["usage_pr_revision"]
    assert run.rc == 2 and "--create-pr" in run.stderr


def test_card_command(runs):
    run = runs["card"]
    assert run.rc == 0, run.stderr
    out = json.loads(run.stdout)
    assert Path(out["readme"]).is_file() and Path(out["chart"]).is_file()
    card = ModelCard.load(out["readme"])
    assert card.data.base_model == SOURCE_ID
    assert f'"model": "{REPO}"' in card.text
