"""Publish a quantized-drafter artifact on the Hugging Face Hub in one commit.

Flow: check the artifact -> read what will be uploaded -> create the repo if needed -> create the branch
if needed -> `HfApi.create_commit` with one `CommitOperationAdd` per file listed in the manifest (plus
manifest.json).

Everything is checked before the first network call: every manifest entry is a plain relative path to a
regular file inside the artifact with its recorded sha256 and size, no symlink exists anywhere in the
tree and no visible file is unlisted (`dflash_quant.artifact.manifest`), the required files are there and
provenance.json is well formed. `--force` never overrides these; it only overrides a missing, unreadable
or failed parity gate (parity.json). The bytes uploaded are the bytes hashed: a file up to
IN_MEMORY_LIMIT is read once into memory while hashing; a larger one is uploaded from a descriptor opened
(without following symlinks) on the very file that was checked, re-hashed by huggingface_hub as it reads
it, and refused if that hash differs. huggingface_hub decides per file, from the Hub's preupload answer,
whether it travels inline in the commit or as a large file (xet when hf_xet is installed and not disabled,
otherwise the git-LFS batch API + PUT).

`create_commit` is used instead of `upload_folder`: with hf_xet installed, huggingface_hub 2.x routes
`upload_folder` through its streamed pipeline, which may split a folder into several commits; a
drafter release must be one commit, and must contain exactly the files the manifest vouches for.

The token is resolved by huggingface_hub (HF_TOKEN, then the login cache) and only ever handed to
HfApi; it never appears in a message, a log line or a file written here.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import io
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_quant import __version__
from dflash_quant.artifact.manifest import (
    MANIFEST,
    REEXPORT,
    VerifiedFile,
    check_artifact_files,
    parse_files,
    summarize,
)
from dflash_quant.artifact.provenance import provenance_problem
from dflash_quant.artifact.reports import Manifest, Parity
from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.io.weights import COMPRESSED, GGUF, GPTQ, MLX, config_format, format_of, read_raw_config, weight_files

# parity.json is required too, but its absence is a parity-gate problem (--force overrides it); the weight
# files (and a GPTQ artifact's quantize_config.json) depend on the format: see required_files.
REQUIRED_FILES = ("config.json", "provenance.json", "README.md", MANIFEST)
IN_MEMORY_LIMIT = 1 << 30  # files up to this size are uploaded from the bytes that were hashed
RECOMMENDED_FILES = ("quant_report.json", "memory.json")

# The Hub stores these as large files (the default .gitattributes of a new model repo), as well as any
# file of 10 MB or more and any binary file (NUL byte in the first 512 bytes, the `sample` huggingface_hub
# sends to preupload). The Hub's preupload answer is what counts; this only predicts it for --dry-run.
LFS_PATTERNS = (
    "*.7z",
    "*.arrow",
    "*.bin",
    "*.bz2",
    "*.ckpt",
    "*.ftz",
    "*.gz",
    "*.h5",
    "*.joblib",
    "*.lfs.*",
    "*.mlmodel",
    "*.model",
    "*.msgpack",
    "*.npy",
    "*.npz",
    "*.onnx",
    "*.ot",
    "*.parquet",
    "*.pb",
    "*.pickle",
    "*.pkl",
    "*.pt",
    "*.pth",
    "*.rar",
    "*.safetensors",
    "*.tar.*",
    "*.tar",
    "*.tflite",
    "*.tgz",
    "*.wasm",
    "*.xz",
    "*.zip",
    "*.zst",
    "*tfevents*",
)
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
SAMPLE_BYTES = 512

TRANSIENT_STATUS = (408, 429, 500, 502, 503, 504)
MAX_ATTEMPTS = 3
RETRY_WAIT_S = 1.0


@dataclass
class PlannedFile:
    path: str
    bytes: int
    large_file: bool
    why: str


@dataclass
class PushPlan:
    artifact: str
    repo_id: str
    revision: str
    create_pr: bool
    private: bool
    endpoint: str
    commit_message: str
    commit_description: str
    files: list[PlannedFile] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        d["num_files"] = len(self.files)
        return d


@dataclass
class PushResult:
    commit_url: str
    commit_oid: str
    pr_url: str | None
    repo_url: str
    revision: str
    num_files: int
    total_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- checks


@dataclass
class ArtifactCheck:
    integrity: list[str]  # never overridden: the artifact is not what the export wrote
    gate: list[str]  # the parity gate: --force overrides
    notes: list[str]
    verified: list[VerifiedFile]


def _parity_problems(root: Path) -> list[str]:
    parity, problem = Parity.problem(root)
    if problem == "is missing":
        return ["parity.json is missing (the parity check never ran)"]
    if problem:
        return [f"parity.json is unreadable ({problem})"]
    if parity.passed is not True:
        why = "; ".join(str(r) for r in (parity.reasons or []))
        ratio = parity.tau_ratio
        detail = f"tau ratio {ratio}" if isinstance(ratio, (int, float)) else "no passing verdict"
        return [f"parity check did not pass ({detail}{'; ' + why if why else ''})"]
    return []


def required_files(root: Path) -> tuple[list[str], list[str]]:
    """(files every artifact of this format must hold, problems naming them): the common ones, the weight
    files of the artifact's own format (safetensors or its GGUF), and quantize_config.json for GPTQ v1."""
    fmt = format_of(root)
    try:
        weights = [f.relative_to(root).as_posix() for f in weight_files(root, required=False)]
    except DFlashQuantError as exc:
        return list(REQUIRED_FILES), [str(exc)]
    if not weights:
        named = (read_raw_config(root).get("quantization_config") or {}).get("file")
        weights = (
            [named if isinstance(named, str) else "a drafter .gguf file"] if fmt == GGUF else ["model.safetensors"]
        )
    extra = ["quantize_config.json"] if fmt == GPTQ else []
    return [*REQUIRED_FILES, *weights, *extra], []


def inspect_artifact(artifact_dir: Path) -> ArtifactCheck:
    """Every check push makes, without a network call."""
    root = Path(artifact_dir)
    integrity, verified = check_artifact_files(root)
    required, unreadable = required_files(root)
    integrity = (
        unreadable
        + [
            f"required file {name} is missing"
            for name in required
            if name != MANIFEST and not os.path.lexists(root / name)
        ]
        + [p for p in integrity if not any(p.startswith(f"{name} is listed") for name in required)]
    )
    bad_provenance = provenance_problem(root) if not integrity else None
    if bad_provenance:
        integrity.append(f"provenance.json {bad_provenance}")
    notes = [
        f"{name} is missing; the card says 'not measured' for it"
        for name in RECOMMENDED_FILES
        if not (root / name).is_file()
    ]
    return ArtifactCheck(list(dict.fromkeys(integrity)), _parity_problems(root), notes, verified)


def _checked(artifact_dir: Path, force: bool) -> tuple[list[str], list[VerifiedFile]]:
    root = Path(artifact_dir)
    if not root.is_dir():
        raise DFlashQuantError(f"artifact directory {root} does not exist; pass the --output of `dflash-quant gptq`")
    if not any(True for _ in root.iterdir()):
        raise DFlashQuantError(f"artifact directory {root} is empty; nothing to push")
    check = inspect_artifact(root)
    if check.integrity:
        raise DFlashQuantError(
            f"refusing to push {root}: {summarize(check.integrity)}; {REEXPORT} "
            "(--force does not override integrity checks)"
        )
    if check.gate and not force:
        raise DFlashQuantError(
            f"refusing to push {root}: {summarize(check.gate)}; re-run the parity check with "
            "`dflash-quant gptq` or pass --force to push it anyway"
        )
    warnings = [f"--force: pushing despite: {p}" for p in check.gate] if check.gate else []
    return warnings + check.notes, check.verified


def check_artifact(artifact_dir: Path, force: bool = False) -> list[str]:
    """Warnings to show before a push. Raises DFlashQuantError on a problem (`force`: parity-gate ones pass)."""
    return _checked(artifact_dir, force)[0]


# --------------------------------------------------------------------------- plan


def predict_large_file(path: Path, size: int) -> tuple[bool, str]:
    name = path.name
    if any(fnmatch.fnmatch(name, pattern) for pattern in LFS_PATTERNS):
        return True, "large file (matches the Hub's default .gitattributes)"
    if size >= LFS_SIZE_THRESHOLD:
        return True, "large file (10 MB or more)"
    with open(path, "rb") as fh:
        if b"\x00" in fh.read(SAMPLE_BYTES):
            return True, "large file (binary content)"
    return False, "inline in the commit"


def default_commit_message(artifact_dir: Path) -> str:
    return f"Upload {recipe_label(Path(artifact_dir))} DFlash drafter (dflash-quant {__version__})"


def recipe_label(root: Path) -> str:
    """`GPTQ int4 g128`, `compressed-tensors int4 g32`, `MLX int4 g64`, `GGUF Q4_0`: from config.json."""
    raw = read_raw_config(root)
    fmt = config_format(raw)
    if fmt == GGUF:
        types = (raw.get("quantization_config") or {}).get("types") or []
        return "GGUF " + "+".join(str(t) for t in types) if types else "GGUF"
    if fmt == MLX:
        q = raw.get("quantization") or {}
    elif fmt == COMPRESSED:
        groups = list(((raw.get("quantization_config") or {}).get("config_groups") or {}).values())
        q = groups[0].get("weights") or {} if len(groups) == 1 and isinstance(groups[0], dict) else {}
        q = {"bits": q.get("num_bits"), "group_size": q.get("group_size")}
    else:
        q = raw.get("quantization_config") or {}
    name = {GPTQ: "GPTQ", MLX: "MLX", COMPRESSED: "compressed-tensors"}.get(fmt, fmt)
    bits, group = q.get("bits"), q.get("group_size")
    return f"{name} int{bits}" + (f" g{group}" if group else "") if bits else name


def _commit_description(artifact_dir: Path) -> str:
    parity, _ = Parity.problem(Path(artifact_dir))
    base = parity.baseline.tau if parity and parity.baseline else None
    quant = parity.quantized.tau if parity and parity.quantized else None
    if base is None or quant is None:
        return "Acceptance parity: not measured."
    return f"Acceptance parity: tau bf16 {base:.3f}, quantized {quant:.3f} (passed: {parity.passed})."


def _resolve_endpoint(endpoint: str | None) -> str:
    if endpoint:
        return endpoint.rstrip("/")
    from huggingface_hub import constants

    return constants.ENDPOINT


def validate_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError
    from huggingface_hub.utils import validate_repo_id as _hf_validate

    if not repo_id or repo_id.count("/") != 1:
        raise UsageError(f"--repo-id must be ORG/NAME (got {repo_id!r})")
    try:
        _hf_validate(repo_id)
    except HFValidationError as exc:
        raise UsageError(f"--repo-id {repo_id!r} is not a valid Hub repo id: {str(exc).splitlines()[0]}") from exc


def plan_push(
    artifact_dir: Path,
    repo_id: str,
    *,
    revision: str | None = None,
    create_pr: bool = False,
    private: bool = False,
    commit_message: str | None = None,
    endpoint: str | None = None,
    verified: list[VerifiedFile] | None = None,
) -> PushPlan:
    """What a push would send: the verified manifest files plus manifest.json; no network call, no token."""
    _validate_args(repo_id, revision, create_pr)
    root = Path(artifact_dir)
    if verified is None:
        verified = check_artifact_files(root)[1] if root.is_dir() else []
    plan = PushPlan(
        artifact=str(root),
        repo_id=repo_id,
        revision=revision or "main",
        create_pr=create_pr,
        private=private,
        endpoint=_resolve_endpoint(endpoint),
        commit_message=commit_message or default_commit_message(root),
        commit_description=_commit_description(root),
    )
    for f in sorted(verified, key=lambda v: v.name):
        large, why = predict_large_file(f.path, f.bytes)
        plan.files.append(PlannedFile(f.name, f.bytes, large, why))
    manifest = root / MANIFEST
    if verified or (manifest.is_file() and not manifest.is_symlink()):
        size = manifest.stat().st_size
        plan.files.append(PlannedFile(MANIFEST, size, *predict_large_file(manifest, size)))
    return plan


def _validate_args(repo_id: str, revision: str | None, create_pr: bool) -> None:
    validate_repo_id(repo_id)
    if create_pr and revision not in (None, "main"):
        raise UsageError("--create-pr opens a pull request against main; do not combine it with --revision")


# --------------------------------------------------------------------------- errors


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _request_url(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    try:
        return str(response.request.url) if response is not None else ""
    except Exception:
        return ""


def _server_message(exc: BaseException) -> str:
    msg = getattr(exc, "server_message", None) or ""
    return str(msg).strip().splitlines()[0][:200] if msg else ""


def _root_cause(exc: BaseException) -> BaseException:
    seen = set()
    while exc.__cause__ is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__
    return exc


def _chain(exc: BaseException | None) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _is_network_error(exc: BaseException) -> bool:
    import httpx2

    return _status(exc) is None and any(
        isinstance(e, (httpx2.TransportError, ConnectionError, TimeoutError)) for e in _chain(exc)
    )


def _is_connect_error(exc: BaseException) -> bool:
    import httpx2

    return any(isinstance(e, (httpx2.ConnectError, ConnectionRefusedError)) for e in _chain(exc))


def _is_offline(exc: BaseException) -> bool:
    from huggingface_hub.errors import OfflineModeIsEnabled

    return any(isinstance(e, OfflineModeIsEnabled) for e in _chain(exc))


def is_transient(exc: BaseException) -> bool:
    """Worth another attempt: 408/429/5xx answers, timeouts and dropped connections (not refused ones)."""
    if _is_offline(exc):
        return False
    status = _status(exc)
    if status is not None:
        return status in TRANSIENT_STATUS
    if _is_connect_error(exc):
        return False
    return _is_network_error(exc)


def _scrub(text: str, token: str | None) -> str:
    if token:
        text = text.replace(token, "***")
    return text


def explain(
    exc: BaseException,
    *,
    stage: str,
    repo_id: str,
    endpoint: str,
    revision: str,
    token: str | None = None,
    attempts: int = 1,
) -> str:
    """One line naming the problem and the fix."""
    status = _status(exc)
    server = _server_message(exc)
    extra = f" (server said: {server})" if server else ""
    namespace = repo_id.split("/")[0]
    tried = f" after {attempts} attempts" if attempts > 1 else ""
    if status == 401:
        msg = (
            f"{endpoint} rejected the token while {stage} (401 Unauthorized){extra}: set HF_TOKEN to a valid "
            "write token or run `hf auth login`"
        )
    elif status == 403:
        msg = (
            f"no write access to '{namespace}' on {endpoint} while {stage} (403 Forbidden){extra}: use a token "
            f"with write permission for '{namespace}', or push to a namespace you own"
        )
    elif status == 404:
        if "revision" in exc.__class__.__name__.lower():
            msg = f"branch '{revision}' of {repo_id} was not found while {stage} (404){extra}: check --revision"
        else:
            msg = (
                f"{repo_id} was not found on {endpoint} while {stage} (404){extra}: check --repo-id and "
                "--endpoint; a private repo is invisible to a token without access"
            )
    elif status == 409:
        msg = (
            f"conflict while {stage} on {repo_id}@{revision} (409){extra}: the branch changed or another "
            "operation is running; retry, or push to a new --revision or with --create-pr"
        )
    elif status == 429:
        msg = f"rate limited by {endpoint} while {stage}{tried} (429){extra}: wait a few minutes and retry"
    elif status is not None and status >= 500:
        msg = f"{endpoint} failed while {stage}{tried} (HTTP {status}){extra}: the Hub had a problem; retry later"
    elif status is not None:
        msg = f"{endpoint} refused the request while {stage} (HTTP {status}){extra}"
    elif _is_offline(exc):
        msg = (
            f"huggingface_hub is in offline mode (HF_HUB_OFFLINE is set) while {stage}: unset HF_HUB_OFFLINE "
            "(or set it to 0) to push"
        )
    elif _is_connect_error(exc):
        msg = (
            f"cannot connect to {endpoint} while {stage}: check --endpoint / HF_ENDPOINT and your network "
            "(proxy, firewall, offline mode)"
        )
    elif _is_network_error(exc):
        cause = _root_cause(exc)
        msg = (
            f"network error talking to {endpoint} while {stage}{tried} ({cause.__class__.__name__}): "
            "check your network and retry"
        )
    else:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        msg = f"push failed while {stage}: {first}"
    return _scrub(msg, token)


# --------------------------------------------------------------------------- push


def _retrying(
    fn: Callable[[], Any],
    *,
    stage: str,
    log: Callable[[str], None],
    retry: bool = True,
    library_retried: Callable[[BaseException], bool] | None = None,
) -> tuple[Any, int]:
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn(), attempt
        except Exception as exc:
            again = (
                retry
                and attempt < MAX_ATTEMPTS
                and is_transient(exc)
                and not (library_retried is not None and library_retried(exc))
            )
            if not again:
                exc.__dict__["_dfq_attempts"] = attempt
                raise
            wait = RETRY_WAIT_S * (2 ** (attempt - 1))
            status = _status(exc)
            what = f"HTTP {status}" if status is not None else _root_cause(exc).__class__.__name__
            log(f"{stage}: {what}; retrying in {wait:.0f}s (attempt {attempt + 1}/{MAX_ATTEMPTS})")
            time.sleep(wait)


def _already_retried_by_hub(exc: BaseException) -> bool:
    """huggingface_hub retries preupload, LFS batch and LFS PUT itself (http_backoff); not commit/validate."""
    if isinstance(exc, RuntimeError) and "Error while uploading" in str(exc):  # LFS PUT (http_backoff)
        return True
    url = _request_url(exc)
    return any(part in url for part in ("/preupload/", "/info/lfs/"))


def _check_no_token_in_files(payloads: list[tuple[str, bytes | io.BufferedReader]], token: str) -> None:
    needle = token.encode()
    for name, data in payloads:
        if isinstance(data, bytes) and len(data) <= LFS_SIZE_THRESHOLD and needle in data:
            raise DFlashQuantError(
                f"{name} contains your Hugging Face token; remove it from the artifact "
                "(then re-export) before pushing, and revoke the token"
            )


def _open_verified(f: VerifiedFile) -> io.BufferedReader:
    """A descriptor on the very file that was checked: symlinks not followed, same inode, size and mtime."""
    try:
        fd = os.open(f.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise DFlashQuantError(f"{f.name} cannot be opened ({exc.strerror}); {REEXPORT}") from None
    fh = os.fdopen(fd, "rb")
    st = os.fstat(fh.fileno())
    if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != (f.dev, f.ino, f.bytes, f.mtime_ns):
        fh.close()
        raise DFlashQuantError(f"{f.name} changed while pushing; push again once nothing writes to the artifact")
    return fh


def _read_payloads(
    root: Path, verified: list[VerifiedFile], stack: contextlib.ExitStack
) -> list[tuple[str, bytes | io.BufferedReader]]:
    """What the commit sends, read from the checked files; a changed byte or a swapped file is refused."""
    payloads: list[tuple[str, bytes | io.BufferedReader]] = []
    for f in sorted(verified, key=lambda v: v.name):
        fh = stack.enter_context(_open_verified(f))
        if f.bytes > IN_MEMORY_LIMIT:
            payloads.append((f.name, fh))  # hashed again by huggingface_hub as it reads; see _operations
            continue
        data = fh.read()
        if hashlib.sha256(data).hexdigest() != f.sha256:
            raise DFlashQuantError(f"{f.name} changed while pushing; push again once nothing writes to the artifact")
        payloads.append((f.name, data))
    try:
        fd = os.open(root / MANIFEST, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as fh:
            data = fh.read()
        listed, _ = parse_files(Manifest.loads(data)[0])
        if listed is None:
            raise ValueError("no files in the manifest")  # handled below, like any unreadable manifest
        recorded = {name: entry["sha256"] for name, entry in listed.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        recorded = None
    if recorded != {f.name: f.sha256 for f in verified}:
        raise DFlashQuantError(f"{MANIFEST} changed while pushing; push again once nothing writes to the artifact")
    payloads.append((MANIFEST, data))
    return payloads


def _operations(payloads: list[tuple[str, bytes | io.BufferedReader]], verified: list[VerifiedFile]) -> list:
    from huggingface_hub import CommitOperationAdd

    sha = {f.name: f.sha256 for f in verified}
    ops = []
    for name, data in payloads:
        if not isinstance(data, bytes):
            data.seek(0)
        op = CommitOperationAdd(path_in_repo=name, path_or_fileobj=data)
        if name in sha and op.upload_info.sha256.hex() != sha[name]:  # computed from the bytes it will send
            raise DFlashQuantError(f"{name} changed while pushing; push again once nothing writes to the artifact")
        ops.append(op)
    return ops


def resolve_token(token: str | None) -> str:
    if token:
        return token
    from huggingface_hub import get_token

    found = get_token()
    if not found:
        raise DFlashQuantError("no Hugging Face token found: set HF_TOKEN to a write token or run `hf auth login`")
    return found


def push_artifact(
    artifact_dir: Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> PushResult:
    """Check and read everything, then create repo/branch if needed and upload the artifact in one commit."""
    with contextlib.ExitStack() as stack:
        return _push(
            stack,
            Path(artifact_dir),
            repo_id,
            private=private,
            revision=revision,
            create_pr=create_pr,
            commit_message=commit_message,
            endpoint=endpoint,
            token=token,
            force=force,
            log=log or (lambda _msg: None),
        )


def _push(
    stack: contextlib.ExitStack,
    root: Path,
    repo_id: str,
    *,
    private: bool,
    revision: str | None,
    create_pr: bool,
    commit_message: str | None,
    endpoint: str | None,
    token: str | None,
    force: bool,
    log: Callable[[str], None],
) -> PushResult:
    from huggingface_hub import HfApi

    _validate_args(repo_id, revision, create_pr)
    warnings, verified = _checked(root, force)
    for warning in warnings:
        log(f"warning: {warning}")
    plan = plan_push(
        root,
        repo_id,
        revision=revision,
        create_pr=create_pr,
        private=private,
        commit_message=commit_message,
        endpoint=endpoint,
        verified=verified,
    )
    secret = resolve_token(token)
    payloads = _read_payloads(root, verified, stack)
    _check_no_token_in_files(payloads, secret)
    _operations(payloads, verified)  # a first pass: a mismatch is refused before any network call
    api = HfApi(endpoint=plan.endpoint, token=secret, library_name="dflash-quant", library_version=__version__)
    branch = None if plan.revision == "main" else plan.revision

    stage = "creating the repository"
    attempts = 1
    try:
        log(f"creating {repo_id} on {plan.endpoint} if needed")
        repo_url, attempts = _retrying(
            lambda: api.create_repo(repo_id, repo_type="model", private=private or None, exist_ok=True),
            stage=stage,
            log=log,
        )
        if branch is not None:
            stage = f"creating branch '{branch}'"
            log(f"creating branch {branch} if needed")
            _, attempts = _retrying(
                lambda: api.create_branch(repo_id, branch=branch, repo_type="model", exist_ok=True),
                stage=stage,
                log=log,
            )
        stage = "uploading the files and committing"
        log(f"uploading {len(plan.files)} files ({plan.total_bytes:,} bytes) in one commit")

        def commit():
            operations = _operations(payloads, verified)  # fresh per attempt: an operation is single-use
            return api.create_commit(
                repo_id,
                operations,
                commit_message=plan.commit_message,
                commit_description=plan.commit_description,
                repo_type="model",
                revision=branch,
                create_pr=create_pr or None,
            )

        # A retried commit with create_pr could open a second pull request: no retries then.
        info, attempts = _retrying(
            commit, stage=stage, log=log, retry=not create_pr, library_retried=_already_retried_by_hub
        )
    except DFlashQuantError:
        raise
    except Exception as exc:
        attempts = exc.__dict__.get("_dfq_attempts", attempts)
        raise DFlashQuantError(
            explain(
                exc,
                stage=stage,
                repo_id=repo_id,
                endpoint=plan.endpoint,
                revision=plan.revision,
                token=secret,
                attempts=attempts,
            )
        ) from None
    return PushResult(
        commit_url=str(info.commit_url),
        commit_oid=str(info.oid),
        pr_url=info.pr_url,
        repo_url=str(repo_url),
        revision=plan.revision,
        num_files=len(plan.files),
        total_bytes=plan.total_bytes,
    )
