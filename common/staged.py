"""Replace a run's several output files and folders together, only once every new one is complete.

    with Staged(out) as st:
        adir = st.dir("activations")           # an empty temporary folder to fill
        st.file("report.html", html_text)      # str, bytes, or a callable write(tmp_path), like atomic_write
        st.file("results.json", json_text)     # committed last of the files: it marks a complete run
        st.commit(remove=["old_extra.txt"])    # rename everything into place, then delete old leftovers

Every new output is first written in full to a temporary (`.<name>.<random>.tmp`) in the destination
directory; `commit()` renames folders first (an old folder of that name is moved aside and deleted only
after every rename succeeded), then files in the order staged (`os.replace`, atomic each), then deletes
`remove`. Leaving the block without a completed commit (an error, an interrupt) deletes every temporary and
puts a moved-aside old folder back, so an earlier run's results are never lost to a failed one.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from common.errors import UserError
from common.io import current_umask, remove_owned


def _rm(p: str | Path) -> None:
    p = Path(p)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink(missing_ok=True)


class Staged:
    def __init__(self, directory: str | Path):
        self.root = Path(directory)
        self.files: list[tuple[Path, Path]] = []  # (temporary, final)
        self.dirs: list[tuple[Path, Path]] = []
        self.aside: list[tuple[Path, Path]] = []  # (old folder moved aside, its name)
        self.placed: list[Path] = []  # new folders already renamed into place
        self.done = False

    def __enter__(self):
        return self

    def _tmp_name(self, name: str) -> str:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"not a plain file name: {name!r}")
        return f".{name}."

    def dir(self, name: str) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=self._tmp_name(name), suffix=".tmp", dir=self.root))
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700; the result gets a plain mkdir's mode
        self.dirs.append((tmp, self.root / name))
        return tmp

    def file(self, name: str, data) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self._tmp_name(name), suffix=".tmp", dir=self.root)
        self.files.append((Path(tmp), self.root / name))  # registered first: removed on every exit path
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600; the result gets a plain open()'s mode
        if callable(data):
            os.close(fd)
            data(tmp)
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
        return Path(tmp)

    def commit(self, remove=()) -> None:
        for _, final in self.files:  # before anything moves: a folder where a file goes would stop it midway
            if final.is_dir() and not final.is_symlink():
                raise UserError(f"{final} is a folder where this run writes a file: move it or choose another "
                                "output folder")
        for tmp, final in self.dirs:
            if final.exists() or final.is_symlink():
                if final.is_dir() and not final.is_symlink():
                    aside = Path(tempfile.mkdtemp(prefix=self._tmp_name(final.name + ".old"), suffix=".tmp",
                                                  dir=self.root))
                    os.rmdir(aside)
                    os.rename(final, aside)
                    self.aside.append((aside, final))
                else:
                    final.unlink()
            os.rename(tmp, final)
            self.placed.append(final)
        for tmp, final in self.files:
            os.replace(tmp, final)
        self.done = True
        for aside, _ in self.aside:
            _rm(aside)
        remove_owned(self.root, [n for n in remove if n not in {f.name for _, f in self.dirs + self.files}])

    def __exit__(self, exc_type, exc, tb):
        for tmp, _ in self.files + self.dirs:
            _rm(tmp)
        if not self.done:  # a failed commit: new folders out, old ones back
            for final in self.placed:
                _rm(final)
            for aside, final in self.aside:
                if aside.exists() and not final.exists():
                    os.rename(aside, final)
        return False
