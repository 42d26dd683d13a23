"""Exclusive, atomic replacement of a checkpoint directory (OUTPUT_DIR of `convert`).

One convert at a time writes a given OUTPUT_DIR: `locked(out)` holds an fcntl lock on
`.NAME.lock` beside it, taken without waiting, so a second convert into the same place fails
at once with `OutputLockedError`. While the lock is held:

- staging directories left beside OUTPUT_DIR by converts that died (killed, power loss) are
  removed: the lock is free, so whoever wrote them is gone;
- the new checkpoint is written into a fresh staging directory `.NAME.staging-XXXXXXXX`;
- `swap_in` puts it in place: a plain rename when OUTPUT_DIR is absent, otherwise an atomic
  exchange of the two paths (Linux `renameat2(RENAME_EXCHANGE)`), so at every instant
  OUTPUT_DIR holds the complete old checkpoint or the complete new one. The old one then
  sits at the staging path and is removed last.

A kill at any point leaves OUTPUT_DIR complete (old or new), plus at most one staging
directory and the lock file, which the next convert removes. Where the exchange is not
available (another OS, a file system without it) the swap falls back to two renames, with a
moment between them where OUTPUT_DIR is absent (never half-written).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from checkpoints_tools.source import ConversionError

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


class OutputLockedError(ConversionError):
    """Another convert is writing the same OUTPUT_DIR right now."""


def _reached(step: str) -> None:
    """Called at each step of a write (`staging`, `written`, `swapped`, `done`); tests
    replace it to stop a convert at a chosen point."""


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


def _stale_names(out: Path) -> re.Pattern:
    # Only this module's own names: `.NAME.XXXXXXXX` (what converts before it left) could
    # just as well be a user's `.NAME.backup01`.
    return re.compile(rf"\.{re.escape(out.name)}\.staging-[a-z0-9_]{{8}}")


@contextlib.contextmanager
def locked(out: Path, wait: bool = False) -> Iterator[None]:
    """Holds OUTPUT_DIR's lock (created beside it); `wait` blocks instead of failing."""
    path = lock_path(out)
    fd = _acquire(path, out, wait)
    try:
        yield
    finally:
        # Unlinked while still held: a convert that opened the old file then finds it gone
        # when it checks (see _acquire) and opens a fresh one.
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _acquire(path: Path, out: Path, wait: bool) -> int:
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConversionError(f"cannot create {out}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise OutputLockedError(
                f"another convert is writing {out} right now (it holds {path}); "
                "wait for it to finish, or write somewhere else"
            ) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder unlinked it as we opened it: lock the new one


def remove_stale(out: Path) -> None:
    """Removes staging directories of dead converts (call with the lock held)."""
    pattern = _stale_names(out)
    for entry in os.scandir(out.parent):
        if pattern.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def make_staging(out: Path) -> Path:
    """A fresh, empty staging directory beside `out` (call with the lock held)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
    _reached("staging")
    return staging


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths; False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def swap_in(staging: Path, out: Path) -> None:
    """Puts the complete directory `staging` at `out`, replacing what is there."""
    _reached("written")
    if not os.path.lexists(out):
        os.rename(staging, out)
        _reached("swapped")
    elif _exchange(staging, out):
        _reached("swapped")
        _remove(staging)  # now the old checkpoint
    else:
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
        os.rename(out, old / "old")
        os.rename(staging, out)
        _reached("swapped")
        shutil.rmtree(old)
    _reached("done")
