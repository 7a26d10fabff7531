"""Output-directory safety: preflight checks, one lock per output, temp dir beside it, no-replace publish.

A run writes into `.NAME.tmp-<pid>-<rand>` next to the output and publishes it with one rename at the end.
While it runs it holds `.NAME.lock` (fcntl.flock, so a killed run's lock is free again) so that two runs
can never write the same output. An existing directory is only ever replaced with --overwrite, and only
when it is a previous dflash-quant artifact (it has our manifest.json) that does not overlap an input.

Single files are replaced the same way (replace_atomic, write_json_atomic: a temp file beside, one rename), and
read_json is the one parser of the JSON files an artifact holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from dflash_quant.errors import UsageError

MANIFEST = "manifest.json"  # the name dflash_quant.artifact.manifest writes; only read here
# Signals whose default action would kill us mid-write; Ctrl-C (SIGINT) already raises KeyboardInterrupt.
TERMINATING = tuple(
    getattr(signal, n) for n in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM") if hasattr(signal, n)
)
_LOCK_TEXT = re.compile(r"^(dflash-quant (\d+)\n?)?$")


class Terminated(BaseException):
    """A terminating signal, raised like KeyboardInterrupt so every `finally` and cleanup runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# --- JSON files -------------------------------------------------------------------------------------------


def read_json(path: Path) -> tuple[Any, str | None]:
    """(parsed JSON, None) or (None, why not) for one file, never raising; a link or a non-file is refused."""
    path = Path(path)
    if not path.exists():
        return None, "is missing"
    if path.is_symlink() or not path.is_file():
        return None, "is not a regular file"
    try:
        return loads_json(path.read_bytes())
    except OSError as exc:
        return None, f"cannot be read ({exc.__class__.__name__})"


def loads_json(raw: bytes) -> tuple[Any, str | None]:
    """(parsed JSON, None) or (None, why not) for bytes already read (push hashes what it parses)."""
    try:
        return json.loads(raw.decode("utf-8")), None
    except (UnicodeDecodeError, ValueError) as exc:
        return None, f"is not valid JSON ({exc.__class__.__name__})"


# --- checks ---------------------------------------------------------------------------------------------


def resolve_output(path: Path | str) -> Path:
    """Absolute path with symlinks, `.`, `..` and trailing slashes resolved (the name temp dirs are named after)."""
    return Path(os.path.expanduser(str(path))).resolve()


def is_artifact(path: Path) -> bool:
    """True for a directory written by dflash-quant: it holds our manifest.json ({"format": 1, "files": {...}})."""
    data, problem = read_json(Path(path) / MANIFEST)
    return not problem and isinstance(data, dict) and data.get("format") == 1 and isinstance(data.get("files"), dict)


def _overlaps(a: Path, b: Path) -> bool:
    return a.is_relative_to(b) or b.is_relative_to(a)  # either way round, equal included


def _nearest_existing(path: Path) -> Path:
    while not os.path.lexists(path) and path.parent != path:
        path = path.parent
    return path


def check_writable_dir(path: Path | str, flag: str) -> Path:
    """A directory that exists or can be created, and that we can write into; else a one-line UsageError."""
    path = resolve_output(path)
    if os.path.lexists(path) and not path.is_dir():
        raise UsageError(f"{flag} {path} exists and is not a directory; pass a directory path")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise UsageError(f"{flag} {path} cannot be created: {base} is not a directory; choose another {flag}")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path} is not writable ({base} denies writing); choose a writable {flag}")
    return path


def check_not_an_input(output: Path | str, flag: str, inputs: Iterable[Path | str]) -> Path:
    """Refuse an output that is, contains or lies inside an input (symlinks resolved); returns it resolved."""
    final = resolve_output(output)
    for item in inputs:
        src = resolve_output(item)
        if _overlaps(final, src):
            how = "is" if final == src else "contains" if src.is_relative_to(final) else "lies inside"
            raise UsageError(f"{flag} {final} {how} the input {src}; choose {flag} outside every input")
    return final


def check_output(output: Path | str, overwrite: bool, inputs: Iterable[Path] = ()) -> Path:
    """Refuse outputs that would lose data; returns the resolved output path. Creates nothing."""
    final = resolve_output(output)
    if final.parent == final:
        raise UsageError(f"--output {final} is the filesystem root; choose a new directory")
    check_not_an_input(final, "--output", inputs)
    check_writable_dir(final.parent, "--output parent")
    if not os.path.lexists(final):
        return final
    if not final.is_dir():
        raise UsageError(f"--output {final} exists and is not a directory; choose another --output")
    if not any(final.iterdir()):
        if os.stat(final).st_dev != os.stat(final.parent).st_dev:
            raise UsageError(f"--output {final} is a mount point; pass a new subdirectory of it")
        return final  # an empty directory is filled in place: nothing can be lost
    if not is_artifact(final):
        raise UsageError(
            f"--output {final} exists and is not a dflash-quant artifact (no manifest.json); "
            "--overwrite only replaces previous artifacts: choose another --output"
        )
    if not overwrite:
        raise UsageError(f"--output {final} already exists; pass --overwrite to replace it or choose another --output")
    return final


# --- umask ------------------------------------------------------------------------------------------------


def current_umask() -> int:
    """The process umask, read without changing it where the kernel reports it (os.umask is process-wide)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """Give root and everything in it the permissions a plain mkdir/open would (mkdtemp and safetensors use 0700/0600)."""
    mask = current_umask()
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o777 & ~mask, follow_symlinks=False)
        for f in filenames:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p):
                os.chmod(p, 0o666 & ~mask)


# --- signals ----------------------------------------------------------------------------------------------

_signal_depth = 0
_installed: set[int] = set()  # the signals signals_raise gave to _handler
_deferred = 0  # depth of deferred_signals sections (and of handler set-up) in the main thread
_pending: int | None = None  # the first signal that arrived inside one
_stopped_by: int | None = None  # the signal _stop raised for

# Python runs a signal's handler between bytecodes, at the end of a call at the latest, so a handler that
# raises can land between any two calls of the code below. Each counter change is one statement without a
# call (no handler can run inside it), and while the counter is up the handler only records the signal.


def _handler(signum: int, frame: Any) -> None:
    global _pending
    if _deferred:  # inside deferred_signals: raised when it ends
        if _pending is None:
            _pending = signum
        return
    _stop(signum)


def _stop(signum: int) -> None:
    global _stopped_by
    _stopped_by = signum  # native code (safetensors' reader) may swallow the exception into its own error
    for sig in _installed:  # a second signal must not interrupt the cleanup the first one started
        signal.signal(sig, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def stop_signal() -> int | None:
    """The signal that stopped this run under signals_raise, if any: an error raised after it is its echo."""
    return _stopped_by


def _raise_pending() -> None:
    global _pending
    if not _deferred and _pending is not None:
        signum, _pending = _pending, None
        _stop(signum)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn terminating signals into Terminated (Ctrl-C stays KeyboardInterrupt) through one handler that
    deferred_signals can hold back, for the duration (main thread only; nests; restores the handlers)."""
    global _signal_depth, _deferred, _stopped_by
    if threading.current_thread() is not threading.main_thread() or _signal_depth:
        yield  # an outer level (or no main thread) owns the handlers
        return
    _stopped_by = None
    previous: dict[int, Any] = {}
    _deferred += 1  # a signal while the handlers go in is held back like in a section
    try:
        for sig in (*TERMINATING, signal.SIGINT):
            current = signal.getsignal(sig)
            if current == signal.SIG_DFL or (sig == signal.SIGINT and current is signal.default_int_handler):
                previous[sig] = current
                signal.signal(sig, _handler)
        _installed.update(previous)
        _signal_depth = 1
        _deferred -= 1
        _raise_pending()
        yield
    finally:
        if _signal_depth:  # else set-up was interrupted and still holds its count
            _deferred += 1  # the handlers come out with signals held back, raised after
        _signal_depth = 0
        _installed.clear()
        for sig, old in previous.items():
            signal.signal(sig, old)
        _deferred -= 1
        _raise_pending()


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold signals back while renames (or a temp file's naming) are half done; they raise right after.

    Blocking in this thread is not enough: the kernel hands a process-directed signal to any thread that does
    not block it (torch and the hashing pool have threads), and Python then runs the handler in the main
    thread at once. So the handler defers while a section is open, and the end raises. Ctrl-C is held back
    too: outside signals_raise its default handler is swapped for ours for the section."""
    global _deferred
    sigs = {*TERMINATING, signal.SIGINT}
    if threading.current_thread() is not threading.main_thread():
        old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return
    _deferred += 1
    swapped = False
    old_mask: set[Any] | None = None
    try:
        if _deferred == 1 and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _handler)
            swapped = True
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)  # a single-threaded process: not even SIG_DFL
        yield
    finally:
        if old_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        _deferred -= 1
        if swapped:  # were this skipped by a signal, _handler outside a section raises KeyboardInterrupt too
            signal.signal(signal.SIGINT, signal.default_int_handler)
        _raise_pending()


# --- single files -------------------------------------------------------------------------------------------


def replace_atomic(path: Path, write: Callable[[Path], object]) -> Path:
    """Have `write` fill a fresh hidden temp file beside `path`, then rename it over `path`.

    Readers never see half a file and concurrent writers never share a temp file; on an error, or a signal
    under signals_raise, the temp file is removed. The file gets the umask's permissions (mkstemp: 0600).
    """
    path = Path(path)
    tmp: Path | None = None
    try:
        with deferred_signals():  # a signal between mkstemp creating the file and `tmp` naming it would leave it
            fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            tmp = Path(name)
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return path


def write_json_atomic(path: Path, data: Any) -> Path:
    """Write JSON through replace_atomic (readers never see half a file)."""
    text = json.dumps(data, indent=2) + "\n"
    return replace_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


# --- lock -------------------------------------------------------------------------------------------------

_held: dict[Path, int] = {}  # resolved output -> lock fd held by this process


def lock_path(final: Path) -> Path:
    return final.parent / f".{final.name}.lock"


def _acquire(final: Path) -> int:
    path = lock_path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {final.parent} ({exc.strerror}); choose a writable --output") from exc
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise UsageError(f"cannot create the lock {path} ({exc.strerror}); choose a writable --output") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 64, 0).decode(errors="replace")
            os.close(fd)
            match = _LOCK_TEXT.match(text)
            who = f"pid {match.group(2)}" if match and match.group(2) else "pid unknown"
            raise UsageError(
                f"--output {final} is being written by another dflash-quant run ({who}); wait for it or choose another --output"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # we locked a file its previous owner had just unlinked: take the new one
    if not _LOCK_TEXT.match(os.pread(fd, 64, 0).decode(errors="replace")):
        os.close(fd)
        raise UsageError(f"{path} exists and is not a dflash-quant lock; remove it or choose another --output")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"dflash-quant {os.getpid()}\n".encode(), 0)
    return fd


def _release(final: Path, fd: int) -> None:
    path = lock_path(final)
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(final: Path) -> list[Path]:
    """Under the lock: remove temp dirs of dead runs of this output; an interrupted swap gets its old artifact back."""
    pattern = re.compile(rf"^\.{re.escape(final.name)}\.(tmp|old)-(\d+)-[a-z0-9_]+$")
    removed = []
    for entry in sorted(final.parent.iterdir()):
        match = pattern.match(entry.name)
        if not match or entry.is_symlink() or not entry.is_dir() or _pid_alive(int(match.group(2))):
            continue
        inner = entry / "artifact"
        if match.group(1) == "old" and not os.path.lexists(final) and is_artifact(inner):
            os.rename(inner, final)  # killed between moving the old artifact aside and renaming the new one in
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


@contextlib.contextmanager
def guard_output(output: Path | str, overwrite: bool, inputs: Iterable[Path] = ()) -> Iterator[Path]:
    """Check the output, take its lock, clean stale temp dirs, and raise Terminated on signals, until exit.

    Re-entrant within one process (a nested guard of the same output is a no-op), so the lock and signal
    handlers are only set up and released by the outermost level.
    """
    final = check_output(output, overwrite, list(inputs))
    with signals_raise():
        if final in _held:
            yield final
            return
        fd: int | None = None
        try:
            with deferred_signals():  # a signal between creating the lock file and owning it would leave it behind
                fd = _acquire(final)
                _held[final] = fd
            remove_stale(final)
            yield final
        finally:
            if fd is not None:
                del _held[final]
                with deferred_signals():
                    _release(final, fd)


# --- staging and publishing ------------------------------------------------------------------------------


def _libc_renameat2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_RENAMEAT2 = _libc_renameat2()
_AT_FDCWD, _RENAME_NOREPLACE = -100, 1


def rename_noreplace(src: Path, dst: Path) -> None:
    """rename(2) that fails with FileExistsError instead of replacing dst (plain rename replaces empty dirs)."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):  # EINVAL: the filesystem lacks the flag
            raise OSError(err, os.strerror(err), str(dst))
    # Fallback: the lock keeps other dflash-quant runs out; the check narrows the window for anything else.
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def _fill(tmp: Path, final: Path) -> None:
    """Move the finished files into an existing empty directory (keeps its inode: `--output .` stays the cwd)."""
    names = sorted(os.listdir(tmp), key=lambda n: n == MANIFEST)  # manifest last: it marks the artifact complete
    moved = []
    try:
        for name in names:
            rename_noreplace(tmp / name, final / name)
            moved.append(name)
    except BaseException:
        for name in moved:
            os.rename(final / name, tmp / name)
        raise
    tmp.rmdir()


def _publish(tmp: Path, final: Path, overwrite: bool) -> None:
    apply_umask(tmp)
    old: Path | None = None
    try:
        with deferred_signals():
            try:
                if not os.path.lexists(final):
                    rename_noreplace(tmp, final)
                    return
                if final.is_dir() and not any(final.iterdir()):
                    _fill(tmp, final)
                    return
            except FileExistsError:
                pass
            if not (overwrite and final.is_dir() and is_artifact(final)):
                raise UsageError(
                    f"--output {final} appeared while this run was writing it; nothing was replaced, choose another --output"
                )
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-{os.getpid()}-", dir=final.parent))
            os.rename(final, old / "artifact")  # into our own fresh dir: never replaces anything
            try:
                rename_noreplace(tmp, final)
            except BaseException:
                os.rename(old / "artifact", final)
                raise
    finally:
        if old is not None:  # the replaced artifact, or the empty dir after a failed swap; also after a signal
            with deferred_signals():  # a signal must not stop the removal half-way
                shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staging(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield `.NAME.tmp-<pid>-<rand>` beside final; publish it on success, remove it on any error or signal."""
    final = resolve_output(final)
    tmp: Path | None = None
    try:
        # a signal between mkdtemp creating the directory and `tmp` naming it would leave it behind: held back
        # until then, it raises inside this try and the finally removes the directory
        with deferred_signals():
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
            os.chmod(tmp, 0o777 & ~current_umask())
        yield tmp
        _publish(tmp, final, overwrite)
    finally:
        if tmp is not None and tmp.exists():
            with deferred_signals():
                shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(final: Path | str, overwrite: bool = False, inputs: Iterable[Path] = ()) -> Iterator[Path]:
    """guard_output + staging in one, for writers that have nothing to compute before they write."""
    with guard_output(final, overwrite, inputs) as resolved, staging(resolved, overwrite) as tmp:
        yield tmp


check_output_dir = check_output  # the name this check had before the lock and overlap rules
