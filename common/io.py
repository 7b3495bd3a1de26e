"""Result files that are never half-written, never lost, and never written by two runs at once.

- `atomic_write(path, data)`: a temporary file in the same directory, then `os.replace`; the temporary is
  removed on every exit path (error, interrupt).
- `json_text(obj)`: strict JSON (a NaN or inf is a bug, never written as bare `NaN`).
- `DirLock(dir)`: an exclusive, non-blocking `flock` on the directory itself for a run's duration, so a second
  run into the same directory is refused with one line; it leaves no file behind.
- `remove_owned(dir, names)`: delete an earlier run's files by name (files or folders) once the new ones exist.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from common.errors import UserError


def atomic_write(path: str | Path, data) -> Path:
    """Write `data` (str, bytes, or a callable `write(tmp_path)`) to `path` atomically."""
    path = Path(path)
    tmp = temp_beside(path, None if callable(data) else data)
    try:
        if callable(data):
            data(tmp)
            # some writers replace the file with a 0600 one (safetensors): a plain open()'s mode once it is written
            os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def temp_beside(path: str | Path, data=None) -> str:
    """A temporary file in `path`'s folder (named `.<name>.*.tmp`, the suite's temporaries), holding `data`
    (str or bytes; None: empty, for a writer to fill) with a plain open()'s mode (mkstemp makes 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if data is not None:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o666 & ~current_umask())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _link_new(tmp: str, path: Path) -> None:
    """Put `tmp` at `path` only if nothing is there (never replaced; FileExistsError otherwise)."""
    try:
        os.link(tmp, path)  # atomic, and fails when the target exists
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: claim the name first, then fill it atomically
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def commit_outputs(items, overwrite: bool) -> None:
    """Move written temporaries [(path, tmp)] into place, in order. Without `overwrite` an existing file is never
    replaced, even one another run wrote after this run's checks: refused in one line, and the files this call
    already placed are taken back. The temporaries are gone on every exit path."""
    placed = []
    try:
        for path, _ in items:  # before anything moves: a folder where a file goes would stop it midway
            if Path(path).is_dir() and not Path(path).is_symlink():
                raise UserError(f"{path} is a folder where this run writes a file: move it or choose another "
                                "output folder")
        for path, tmp in items:
            if overwrite:
                os.replace(tmp, path)
                continue
            try:
                _link_new(tmp, path)
            except FileExistsError:
                raise UserError(f"{path} appeared while this run was working (another run wrote it); pass "
                                "--overwrite to replace it") from None
            placed.append(path)
    except BaseException:
        for path in placed:
            Path(path).unlink(missing_ok=True)
        raise
    finally:
        for _, tmp in items:
            if os.path.exists(tmp):
                os.unlink(tmp)


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def json_text(obj, indent: int | None = 1, **kw) -> str:
    """JSON with NaN/inf refused (ValueError) instead of written as invalid bare tokens."""
    return json.dumps(obj, indent=indent, allow_nan=False, **kw) + "\n"


class DirLock:
    """Exclusive lock on a directory (created if missing) for the duration of a `with` block.

    Another process holding it -> UserError (refused, nothing touched). The lock is on the directory's own file
    descriptor, so no lock file is left in or beside it. `created` says whether this lock made the directory;
    a block left with an exception removes every directory the lock made (it and the parents it had to make)
    that is still empty: a refused or failed run leaves no folder behind.
    """

    def __init__(self, directory: str | Path, what: str = "run"):
        self.dir = Path(directory)
        self.what = what
        self.fd = -1
        self.created = False
        self.made: list[Path] = []  # the directories this lock made, innermost first

    def _make(self) -> None:
        """Make the missing directories one by one, outermost first, noting those this process made (another
        run making one of them at the same moment is not an error, and its folder is not this lock's)."""
        missing, d = [], self.dir.absolute()
        while not d.exists() and d != d.parent:
            missing.append(d)
            d = d.parent
        for m in reversed(missing):
            try:
                m.mkdir()
            except FileExistsError:
                continue
            self.made.insert(0, m)
        self.created = self.created or self.dir.absolute() in self.made

    def __enter__(self):
        for _ in range(100):
            self._make()
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise UserError(f"another {self.what} is writing to {self.dir} right now; wait for it or choose "
                                "another output directory") from None
            try:  # a failed run removes the empty folder it made: locked after that, this one would be gone
                same = os.path.samestat(os.fstat(fd), os.stat(self.dir))
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return self
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        raise UserError(f"{self.dir} keeps being removed while this {self.what} locks it; try again")

    def __exit__(self, exc_type, exc, tb):
        # A run that failed before writing anything leaves no empty directory it made itself (removed while still
        # locked: a run that opened it meanwhile sees it gone and makes its own).
        if exc_type is not None:
            for d in self.made:
                try:
                    d.rmdir()
                except OSError:  # not empty (or gone): it and its parents stay
                    break
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1
        return False


def remove_owned(directory: str | Path, names, keep=()) -> None:
    """Remove the named files/folders of an earlier run from `directory` (except those in `keep`)."""
    d = Path(directory)
    for name in names:
        if name in keep:
            continue
        p = d / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def remove_stale_tmp(directory: str | Path, folders: bool = True) -> None:
    """Delete the temporaries (`.*.tmp` files, and folders unless `folders` is False) a killed earlier run may have
    left in `directory` (SIGKILL skips every cleanup). Call it holding the folder's lock: a live run's temporaries
    are its own. A trainer keeps its folders: a complete pending checkpoint is the newest one (training.checkpoint)."""
    d = Path(directory)
    if d.is_dir():
        for p in d.glob(".*.tmp"):
            if p.is_dir() and not p.is_symlink():
                if folders:
                    shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def require_finite_json(obj, what: str = "results") -> None:
    try:
        json.dumps(obj, allow_nan=False)
    except ValueError:
        raise UserError(f"{what} contain NaN or inf; refusing to write invalid JSON") from None


@contextmanager
def fresh_output(out: Path, outputs, overwrite: bool, what: str, refusal: str):
    """The one way an analysis CLI takes its output folder: refuse if it holds any of `outputs` (without
    `overwrite`; `refusal` is the one-line message), then lock it (DirLock, `what` names the run), refuse again
    under the lock (another run may have finished meanwhile) and remove an earlier killed run's temporaries."""
    out = Path(out)

    def refuse():
        if not overwrite and any((out / f).exists() for f in outputs):
            raise UserError(refusal)

    refuse()
    with DirLock(out, what):
        refuse()
        remove_stale_tmp(out)
        yield out
