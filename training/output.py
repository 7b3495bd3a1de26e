"""The output directory of a run: what a run may do to it (checked before any work), and `RunOutput`, which locks
it and, under --overwrite, builds the new run beside it and swaps it in whole once complete."""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from common.errors import UserError
from common.io import DirLock
from training.checkpoint import (LEGACY_STATE_FILE, LOG_FILE, PENDING, STATE_FILE, check_resume_files, pending_move,
                                 remove_stale)

# Every file a run (or the evaluation and card written beside it) puts in its output directory.
RUN_FILES = frozenset({"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                       "special_tokens_map.json", STATE_FILE, LEGACY_STATE_FILE, LOG_FILE, "eval.json",
                       "MODEL_CARD.md"})


def staging_folders(out: Path) -> list[Path]:
    """The staging folders of --overwrite runs of `out` (`.<name>.staging-*` beside what `out` points to)."""
    target = Path(out).resolve()
    prefix = f".{target.name}.staging-"
    if not target.parent.is_dir():
        return []
    return sorted(p for p in target.parent.iterdir() if p.name.startswith(prefix) and p.is_dir() and not p.is_symlink())


def _has_progress(folder: Path) -> bool:
    """A checkpoint a run could continue from: its trainer state, or a complete pending one (a kill mid-move)."""
    return (folder / STATE_FILE).is_file() or pending_move(folder)


def _refuse_staged_progress(out: Path, doing: str) -> None:
    """A killed --overwrite run's progress sits in its staging folder: refuse `doing` beside it (a --resume once
    continued the earlier run and deleted the newer one); only --overwrite discards it."""
    for folder in staging_folders(out):
        if _has_progress(folder):
            raise UserError(f"{doing} refused: {folder} holds the checkpoints of a killed --overwrite run of {out} "
                            f"(or of one still running); to continue that run, move it into place (mv {out} "
                            f"{out}.old; mv {folder} {out}) and --resume; to discard it, delete it or run with "
                            "--overwrite")


def check_output(out: Path, resume: bool, overwrite: bool, staging: bool = True) -> bool:
    """Refuse (read-only, before any work) what a run may not do to `out`. True: the run is staged beside `out`
    and replaces it whole once complete (--overwrite over an earlier run); False: it writes into `out`.
    `staging`: refuse too where a killed --overwrite run's staging folder holds checkpoints (but under
    --overwrite, which discards it)."""
    if resume and overwrite:  # --resume writes on into out; there is nothing for --overwrite to replace
        raise UserError("--overwrite would have no effect with --resume (which continues the run in --out): drop it")
    if resume:
        if not out.is_dir():
            raise UserError(f"--resume: no {STATE_FILE} in {out}")
        check_resume_files(out)
        if staging:
            _refuse_staged_progress(out, "--resume")
        return False
    if staging and not overwrite:
        _refuse_staged_progress(out, "a new run")
    if not out.is_dir():
        return False
    names = {p.name for p in out.iterdir() if not p.name.endswith(".tmp")}  # temporaries: a killed run's
    ours = sorted(names & RUN_FILES)
    if pending_move(out):  # a killed run's newest checkpoint, complete (--resume moves it in): an earlier run
        ours.append(PENDING)
    if not ours:
        return False
    if not overwrite:
        what = "a checkpoint" if "model.safetensors" in ours or PENDING in ours else \
            f"files of an earlier run ({', '.join(ours)})"
        raise UserError(f"{out} already holds {what}; use --resume to continue or --overwrite to replace it")
    foreign = sorted(names - RUN_FILES)
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise UserError(f"--overwrite: {out} also holds {', '.join(foreign[:3])}{more}, which no training run "
                        "writes; move them away or choose another --out")
    parent = out.resolve().parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--overwrite: the new run is built beside {out} and swapped in at the end, but {parent} "
                        "is not writable")
    return True


def _exchange(a: Path, b: Path) -> None:
    """Swap the names of two directories: atomically where the kernel can (renameat2 RENAME_EXCHANGE), else
    by three renames."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        at_fdcwd, rename_exchange = -100, 2
        if fn(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(b))
    aside = a.with_name(a.name + ".old")
    os.rename(b, aside)
    try:
        os.rename(a, b)
    except BaseException:
        os.rename(aside, b)
        raise
    os.rename(aside, a)


class RunOutput:
    """Where a run writes, for its duration (rank 0 only; other ranks write nothing).

    `out` is locked (`common.io.DirLock`: a second run into it is refused). A staged run writes into a sibling
    folder `.<name>.staging-*` (locked too) that `commit()` swaps in whole; on error or interrupt the staging
    folder is removed and the earlier run in `out` stays as it was. Otherwise checkpoints go into `out` directly.
    """

    def __init__(self, out: Path, staged: bool, active: bool = True, resume: bool | None = None,
                 overwrite: bool = False):
        self.out, self.staged, self.active = Path(out), staged, active
        self.overwrite = overwrite or staged  # a killed --overwrite run's staging folder: discarded (CLI's help)
        self.resume = resume  # not None: check_output again once `out` is locked (another run may have written it
        #                       between this run's checks and its lock: a slow --base load is a wide window)
        self.target = self.out.resolve() if staged else self.out  # a symlinked --out: replace what it points to
        self.path = self.out
        self._locks: list[DirLock] = []

    def _lock(self, path: Path) -> None:
        lock = DirLock(path, "training run")
        lock.__enter__()
        self._locks.append(lock)

    def __enter__(self):
        if not self.active:
            return self
        self._lock(self.out)
        try:
            if self.resume is not None:
                try:  # (a staging folder's progress was the CLI's to refuse; the cleanup below keeps it)
                    changed = check_output(self.out, self.resume, self.staged, staging=False) != self.staged
                except UserError:
                    changed = True
                if changed:
                    raise UserError(f"{self.out} was written by another run after this run's checks: nothing of "
                                    "it was replaced; look at it, then run again")
            prefix = f".{self.target.name}.staging-"
            for old in staging_folders(self.out):  # a killed run's (any live one would hold the lock on out)
                if self.overwrite or not _has_progress(old):  # progress: only --overwrite discards it
                    shutil.rmtree(old, ignore_errors=True)
            remove_stale(self.out)
            if self.staged:
                self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=self.target.parent))
                os.chmod(self.path, stat.S_IMODE(self.target.stat().st_mode))  # mkdtemp's 0700 would stay
                self._lock(self.path)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def commit(self) -> None:
        if self.active and self.staged:
            try:
                _exchange(self.path, self.target)  # self.path now holds the earlier run, removed on exit
            except OSError as e:
                raise UserError(f"could not move the new run into {self.out} ({e.strerror}); {self.out} still holds "
                                "the earlier run") from None

    def __exit__(self, exc_type, exc, tb):
        try:
            if self.active and self.staged and self.path != self.out:
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            for lock in reversed(self._locks):
                lock.__exit__(exc_type, exc, tb)
            self._locks = []
        return False
