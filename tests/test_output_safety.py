"""Output-directory safety (issue #13): no data loss through --output/--overwrite, locks, signals, stale temp dirs, umask."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny import save_drafter, save_target

from dflash_quant.artifact.manifest import verify_manifest, write_manifest
from dflash_quant.errors import UsageError
from dflash_quant.io import atomic

CLI = [sys.executable, "-m", "dflash_quant.cli.app"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A user's folder holding drafter, target, prompt files, a note, and (hostile) a manifest.json of its own."""
    root = tmp_path_factory.mktemp("safety") / "models"
    rng = random.Random(0)

    def line():
        return " ".join(f"w{rng.randint(3, 119)}" for _ in range(8))

    save_drafter(root / "drafter", std=0.2)
    save_target(root / "target")
    (root / "calib.txt").write_text("\n".join(line() for _ in range(8)))
    (root / "eval.txt").write_text(line())
    (root / "notes.txt").write_text("mine")
    (root / "manifest.json").write_text(json.dumps({"format": 1, "files": {}}))  # looks like an artifact
    return root


def snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def cmd(pair, output, *extra):
    return CLI + [
        "gptq",
        str(pair / "drafter"),
        "--target",
        str(pair / "target"),
        "--calib-prompts",
        str(pair / "calib.txt"),
        "--eval-prompts",
        str(pair / "eval.txt"),
        "--max-new-tokens",
        "4",
        "--eval-max-new-tokens",
        "4",
        "--eval-num-prompts",
        "1",
        "--group-size",
        "32",
        "--no-card",
        "--output",
        str(output),
        *extra,
    ]


def gptq(pair, output, *extra, cwd=None, umask=None, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    pre = (lambda: os.umask(umask)) if umask is not None else None
    return subprocess.run(
        cmd(pair, output, *extra), capture_output=True, text=True, env=env, cwd=cwd, preexec_fn=pre, timeout=timeout
    )


def one_error(res, code: int, *words: str) -> str:
    assert res.returncode == code, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, res.stderr
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --- refusals before any compute (fast: the CLI checks before importing torch) ---------------------------


@pytest.mark.parametrize(
    "out, how",
    [
        (".", "contains the input"),
        ("drafter", "is the input"),
        ("drafter/q", "lies inside the input"),
        ("target/../drafter/", "is the input"),
    ],
)
def test_output_overlapping_an_input_is_refused_even_with_overwrite(pair, out, how):
    before = snapshot(pair)
    res = gptq(pair, pair / out, "--overwrite")
    one_error(res, 2, how, "--output")
    assert snapshot(pair) == before
    assert not (pair / "drafter" / "q").exists()
    assert leftovers(pair.parent, "models") == [] and leftovers(pair, "drafter") == []


def test_output_overlapping_prompts_or_calib_cache_is_refused(pair, tmp_path):
    one_error(gptq(pair, pair / "calib.txt" / "x"), 2, "lies inside the input")
    (tmp_path / "link").symlink_to(pair / "drafter")
    one_error(gptq(pair, tmp_path / "link", "--overwrite"), 2, "is the input")
    assert (pair / "drafter" / "model.safetensors").is_file() and (tmp_path / "link").is_symlink()
    cache = tmp_path / "cache"
    one_error(gptq(pair, cache / "art", "--calib-cache", str(cache)), 2, "lies inside the input")
    assert not cache.exists()
    one_error(gptq(pair, tmp_path / "art2", "--check-cache", str(tmp_path / "art2" / "runs")), 2, "contains the input")
    assert not (tmp_path / "art2").exists()


def test_non_artifact_directory_is_never_replaced(pair, tmp_path):
    user = tmp_path / "results"
    user.mkdir()
    (user / "paper.tex").write_text("years of work")
    one_error(gptq(pair, user, "--overwrite"), 2, "not a dflash-quant artifact")
    assert (user / "paper.tex").read_text() == "years of work" and len(list(user.iterdir())) == 1
    (tmp_path / "paper.txt").write_text("x")
    one_error(gptq(pair, tmp_path / "paper.txt", "--overwrite"), 2, "not a directory")
    assert (tmp_path / "paper.txt").read_text() == "x"


def test_previous_artifact_needs_overwrite(pair, tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    (art / "config.json").write_text("{}")
    write_manifest(art)
    one_error(gptq(pair, art), 2, "already exists", "--overwrite")
    assert sorted(p.name for p in art.iterdir()) == ["config.json", "manifest.json"]
    assert leftovers(tmp_path, "art") == []


def test_unwritable_output_and_file_calib_cache_fail_before_compute(pair, tmp_path):
    t = time.perf_counter()
    one_error(gptq(pair, "/proc/dflash-quant-test/out"), 2, "/proc/dflash-quant-test", "writable --output")
    one_error(gptq(pair, "/proc/dflash-quant-test"), 2, "writable --output")
    (tmp_path / "cache").write_text("not a dir")
    one_error(
        gptq(pair, tmp_path / "art", "--calib-cache", str(tmp_path / "cache")), 2, "--calib-cache", "not a directory"
    )
    assert time.perf_counter() - t < 30  # refused before torch is imported, let alone calibration (about 0.6 s each)
    assert not (tmp_path / "art").exists() and leftovers(tmp_path, "art") == []


def test_second_run_on_a_locked_output_fails_fast_naming_the_holder(pair, tmp_path):
    out = tmp_path / "art"
    with atomic.guard_output(out, overwrite=False):
        assert (tmp_path / ".art.lock").read_text() == f"dflash-quant {os.getpid()}\n"
        one_error(gptq(pair, out), 2, "another dflash-quant run", f"pid {os.getpid()}")
        assert (tmp_path / ".art.lock").is_file()  # the refused run did not take or remove our lock
    assert leftovers(tmp_path, "art") == [] and not out.exists()


def test_sighup_while_loading_removes_the_lock(pair, tmp_path):
    proc = subprocess.Popen(cmd(pair, tmp_path / "art"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while proc.poll() is None and not (tmp_path / ".art.lock").exists() and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=120)
    one_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), 128 + signal.SIGHUP, "SIGHUP")
    assert not (tmp_path / "art").exists() and leftovers(tmp_path, "art") == []


# --- the building blocks -----------------------------------------------------------------------------------


def test_rename_noreplace_never_replaces_an_empty_directory(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("new")
    (tmp_path / "dst").mkdir()
    with pytest.raises(FileExistsError):
        atomic.rename_noreplace(tmp_path / "src", tmp_path / "dst")  # plain os.rename would replace it
    assert (tmp_path / "src" / "f").is_file() and (tmp_path / "dst").is_dir()
    atomic.rename_noreplace(tmp_path / "src", tmp_path / "new")
    assert (tmp_path / "new" / "f").read_text() == "new"


def test_staging_names_temp_dirs_after_the_resolved_output(tmp_path):
    (tmp_path / "a").mkdir()
    with atomic.staging(str(tmp_path / "a" / ".." / "b") + "/") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(f".b.tmp-{os.getpid()}-")
        (tmp / "x.json").write_text("{}")
    assert (tmp_path / "b" / "x.json").is_file() and leftovers(tmp_path, "b") == []


def test_staging_removes_its_temp_dir_on_error_and_never_replaces_what_appeared(tmp_path):
    final = tmp_path / "art"
    with pytest.raises(RuntimeError):
        with atomic.staging(final):
            raise RuntimeError("boom")
    assert leftovers(tmp_path, "art") == [] and not final.exists()
    with pytest.raises(UsageError, match="appeared while this run"):
        with atomic.staging(final, overwrite=True) as tmp:
            (tmp / "manifest.json").write_text("{}")
            final.mkdir()
            (final / "user.txt").write_text("keep")  # someone else's data, not an artifact
    assert (final / "user.txt").read_text() == "keep" and leftovers(tmp_path, "art") == []


def test_atomic_dir_writes_under_the_lock(tmp_path):
    with atomic.atomic_dir(tmp_path / "art") as tmp:
        assert (tmp_path / ".art.lock").is_file()
        (tmp / "a.txt").write_text("a")
    assert (tmp_path / "art" / "a.txt").is_file() and leftovers(tmp_path, "art") == []


def test_overwrite_swaps_a_previous_artifact(tmp_path):
    final = tmp_path / "art"
    final.mkdir()
    (final / "old.txt").write_text("old")
    write_manifest(final)
    with atomic.staging(final, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
        write_manifest(tmp)
    assert sorted(p.name for p in final.iterdir()) == ["manifest.json", "new.txt"]
    assert verify_manifest(final) == [] and leftovers(tmp_path, "art") == []


def test_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        with atomic.staging(tmp_path / "art") as tmp:
            os.close(os.open(tmp / "weights", os.O_CREAT | os.O_WRONLY, 0o600))  # how safetensors creates its file
            (tmp / "sub").mkdir(mode=0o700)
    finally:
        os.umask(old)

    def mode(p):
        return p.stat().st_mode & 0o777

    assert (mode(tmp_path / "art"), mode(tmp_path / "art" / "sub"), mode(tmp_path / "art" / "weights")) == (
        0o750,
        0o750,
        0o640,
    )


def test_stale_temp_dirs_of_dead_runs_are_cleaned_and_an_interrupted_swap_restored(tmp_path):
    dead = dead_pid()
    for name in (
        f".art.tmp-{dead}-abc",
        f".art.tmp-{os.getpid()}-live",
        f".other.tmp-{dead}-abc",
        f".art.tmp-{dead}-x.tmp-1-y",
    ):
        (tmp_path / name).mkdir()
    old = tmp_path / f".art.old-{dead}-zz" / "artifact"
    old.mkdir(parents=True)
    (old / "model.safetensors").write_text("weights")
    write_manifest(old)
    with atomic.guard_output(tmp_path / "art", overwrite=True) as final:
        assert (final / "model.safetensors").read_text() == "weights"  # the old artifact is back in place
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(
        ["art", f".art.tmp-{os.getpid()}-live", f".other.tmp-{dead}-abc", f".art.tmp-{dead}-x.tmp-1-y"]
    )


def test_lock_of_a_killed_run_is_reclaimed(tmp_path):
    code = "import sys,time; from dflash_quant.io.atomic import guard_output\nwith guard_output(sys.argv[1], False):\n print('locked', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "art")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(UsageError, match=f"pid {proc.pid}"):
        with atomic.guard_output(tmp_path / "art", False):
            pass
    proc.kill()
    proc.wait()
    assert (tmp_path / ".art.lock").exists()  # SIGKILL cannot clean up...
    with atomic.guard_output(tmp_path / "art", False):  # ...but the kernel released the flock
        pass
    assert leftovers(tmp_path, "art") == []


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT], ids=["SIGHUP", "SIGTERM", "SIGINT"])
def test_a_signal_while_the_lock_is_taken_leaves_no_lock_file(tmp_path, monkeypatch, sig):
    """CI caught a SIGHUP between creating `.art.lock` and owning it (the file stayed); it now waits until owned."""
    real_flock = atomic.fcntl.flock

    def flock_then_signal(fd, op):
        real_flock(fd, op)
        if op & atomic.fcntl.LOCK_EX:
            os.kill(os.getpid(), sig)  # lands right after the lock file exists, before guard_output's try

    monkeypatch.setattr(atomic.fcntl, "flock", flock_then_signal)
    expected = KeyboardInterrupt if sig == signal.SIGINT else atomic.Terminated
    entered = []
    with pytest.raises(expected):
        with atomic.guard_output(tmp_path / "art", False):
            entered.append(True)
    assert entered == []  # the deferred signal stops the run before its body
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # handlers restored


# --- whole runs -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fresh_run_then_overwrite_follow_the_umask_and_clean_stale_dirs(pair, tmp_path):
    dead = dead_pid()
    (tmp_path / f".art.tmp-{dead}-abcd1234").mkdir()
    res = gptq(pair, tmp_path / "art", "--no-verify", umask=0o022)
    assert res.returncode == 0, res.stderr
    art = tmp_path / "art"
    modes = {p.name: p.stat().st_mode & 0o777 for p in [art, *art.iterdir()]}
    assert modes.pop("art") == 0o755 and set(modes.values()) == {0o644}, modes
    assert leftovers(tmp_path, "art") == [] and verify_manifest(art) == []
    res = gptq(pair, tmp_path / "art", "--no-verify", "--overwrite", "--bits", "8", umask=0o077)
    assert res.returncode == 0, res.stderr
    assert json.loads((art / "config.json").read_text())["quantization_config"]["bits"] == 8
    modes = {p.name: p.stat().st_mode & 0o777 for p in [art, *art.iterdir()]}
    assert modes.pop("art") == 0o700 and set(modes.values()) == {0o600}, modes
    assert leftovers(tmp_path, "art") == [] and verify_manifest(art) == []


@pytest.mark.slow
def test_output_dot_fills_the_empty_working_directory(pair, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    res = gptq(pair, ".", "--no-verify", cwd=work)
    assert res.returncode == 0, res.stderr
    assert verify_manifest(work) == [] and (work / "model.safetensors").is_file()
    assert not [p for p in work.iterdir() if p.name.startswith(".")] and leftovers(tmp_path, "work") == []


@pytest.mark.slow
def test_concurrent_runs_to_one_output_exactly_one_wins(pair, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [
        subprocess.Popen(
            cmd(pair, tmp_path / "art", "--no-verify"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    results = [
        subprocess.CompletedProcess(p.args, p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs
    ]
    codes = sorted(r.returncode for r in results)
    assert codes == [0, 2], [r.stderr for r in results]
    loser = next(r for r in results if r.returncode)
    one_error(loser, 2, "another dflash-quant run", "pid ")
    assert verify_manifest(tmp_path / "art") == [] and leftovers(tmp_path, "art") == []


@pytest.mark.slow
def test_sigterm_during_export_leaves_nothing(pair, tmp_path):
    proc = subprocess.Popen(
        cmd(pair, tmp_path / "art", "--eval-max-new-tokens", "48"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 240
    while proc.poll() is None and not list(tmp_path.glob(".art.tmp-*")) and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None and list(tmp_path.glob(".art.tmp-*")), "the run never reached the export stage"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    one_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), 128 + signal.SIGTERM, "SIGTERM")
    assert not (tmp_path / "art").exists() and leftovers(tmp_path, "art") == []


def test_signal_right_after_the_staging_dir_is_made_leaves_nothing(tmp_path, monkeypatch):
    # The slow SIGTERM test polls for the staging dir and signals at once, so the signal can land between
    # mkdtemp creating the directory and `staging` naming it; here it lands exactly there, every time.
    real = atomic.tempfile.mkdtemp
    sent = [signal.SIGTERM]

    def mkdtemp_then_signal(*args, **kwargs):
        path = real(*args, **kwargs)
        os.kill(os.getpid(), sent[0])
        time.sleep(0.05)  # another thread's C handler has run by now; Python's handler is due at the next bytecode
        return path

    monkeypatch.setattr(atomic.tempfile, "mkdtemp", mkdtemp_then_signal)
    # with another thread alive (the CLI has torch's and the hashing pool's) the kernel hands the signal to that
    # thread while this one blocks it, and Python runs the handler here at once: blocking alone is not enough
    import threading

    for other_thread in (False, True):
        for sig, raised in ((signal.SIGTERM, atomic.Terminated), (signal.SIGINT, KeyboardInterrupt)):
            sent[0] = sig
            done = threading.Event()
            if other_thread:
                threading.Thread(target=done.wait, daemon=True).start()
            try:
                with pytest.raises(raised), atomic.signals_raise():
                    with atomic.staging(tmp_path / "art"):
                        pytest.fail("the held-back signal must be raised before the body runs")
            finally:
                done.set()
            assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_a_signal_swallowed_by_native_code_still_exits_as_the_signal(tmp_path, sig, code):
    # safetensors' Rust reader calls back into Python; a Ctrl-C landing there comes out as its own error
    # ("could not determine the shape of ... UntypedStorage"), which read_safetensors reports as a corrupt file.
    import typer

    from dflash_quant.cli.common import handle_errors
    from dflash_quant.errors import DFlashQuantError

    @handle_errors
    def command() -> None:
        with atomic.guard_output(tmp_path / "art", overwrite=False), atomic.staging(tmp_path / "art"):
            try:
                os.kill(os.getpid(), sig)
                time.sleep(1)
            except BaseException as exc:
                raise ValueError("could not determine the shape of object type") from exc
            pytest.fail("the signal's handler must have raised inside the try")

    with pytest.raises(typer.Exit) as exit_info:
        command()
    assert exit_info.value.exit_code == code
    assert os.listdir(tmp_path) == []

    @handle_errors
    def corrupt_without_a_signal() -> None:
        with atomic.signals_raise():
            raise DFlashQuantError("x.safetensors is not a readable safetensors file")

    with pytest.raises(typer.Exit) as exit_info:
        corrupt_without_a_signal()
    assert exit_info.value.exit_code == 1  # a stale stop from the run above is not reused

    @handle_errors
    def stopped_outside_gptq() -> None:  # export, card, memory: the signal itself reaches the wrapper
        with atomic.signals_raise():
            os.kill(os.getpid(), sig)
            time.sleep(1)

    with pytest.raises(typer.Exit) as exit_info:
        stopped_outside_gptq()
    assert exit_info.value.exit_code == code
