"""User-facing errors: every CLI turns a `UserError` into one line on stderr and exit code 2."""
from __future__ import annotations

import errno
import functools
import os
import re
import signal
import sys
import threading

# A write the machine refused (a full disk or quota, a file past the size limit, a read-only file system): the run's
# own cleanup has run by then (temporaries removed, an earlier run's results kept), so it is one line, exit 1
WRITE_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


class UserError(Exception):
    """Bad input from the user (unknown task, bad flag value, missing file...). Never a bug."""


class Terminated(BaseException):
    """SIGTERM (a batch scheduler's stop, `kill`), raised like Ctrl-C's KeyboardInterrupt so that every cleanup runs
    (temporaries, staging folders, a folder the run made): Python's default action ends the process without them.
    A BaseException, so that no `except Exception` swallows it."""


def _terminate(signum, frame):
    # a second SIGTERM (a scheduler signals every process, and torchrun forwards its own to its workers) must not cut
    # the first one's cleanup short; SIGKILL, a scheduler's next step, still ends the process
    signal.signal(signal.SIGTERM, _terminating)
    raise Terminated


def _terminating(signum, frame):
    """SIGTERM while the first one's cleanup runs: nothing more to do."""


def _write_failure(e: BaseException) -> OSError | Exception | None:
    """The exception that reports a write the machine refused (`WRITE_FAILURES`): `e` or one it was raised *from*
    (`raise ... from err`; an exception merely raised while one unwound, a cleanup's bug, stays a traceback);
    safetensors' writer reports one as 'SafetensorError: ... (os error 28)'."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if _write_errno(e) is not None:
            return e
        e = e.__cause__
    return None


def _write_errno(e: BaseException) -> int | None:
    if isinstance(e, OSError) and e.errno in WRITE_FAILURES:
        return e.errno
    if type(e).__module__.split(".")[0] == "safetensors":
        m = re.search(r"\(os error (\d+)\)", str(e))
        if m and int(m[1]) in WRITE_FAILURES:
            return int(m[1])
    return None


def cli_entry(main):
    """Decorate a CLI `main(argv=None)`: `UserError` -> 'error: ...' on stderr (one line: the message's lines
    joined by '; ') and exit 2, no traceback; a write the machine refused (`WRITE_FAILURES`: a full disk) -> one
    line and exit 1; Ctrl-C -> 'interrupted', exit 130; SIGTERM -> 'terminated', exit 143 (128 + 15, what a shell
    reports for a process SIGTERM ended), after the same cleanup as an interrupt's."""

    @functools.wraps(main)
    def wrapper(argv=None):
        # from here on this wrapper reports interrupts: the import-time hook (quiet_import_interrupts) would hide a
        # cleanup's bug raised while an interrupt unwound as 'interrupted' (its traceback lost, atexit skipped)
        if getattr(sys.excepthook, "_quiet_import_interrupts", False):
            sys.excepthook = sys.excepthook.previous
        # SIGTERM becomes an exception only where nobody else handles it (an outer cli_entry, a host program's own
        # handler) and only in the main thread (the only one signal.signal may set)
        own_term = (threading.current_thread() is threading.main_thread()
                    and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
        if own_term:
            signal.signal(signal.SIGTERM, _terminate)
        try:
            return main(argv)
        except UserError as e:  # one line whatever the message holds (a user's code may raise "a\nb")
            # said_elsewhere: rank 0 prints it (common.distributed.SaidElsewhere); said_here: a process's own
            # environment, which no other process may share (an inconsistent torchrun environment)
            if not getattr(e, "said_elsewhere", False) and (getattr(e, "said_here", False) or _says_it()):
                print(f"error: {'; '.join(x.strip() for x in str(e).splitlines() if x.strip())}", file=sys.stderr)
            raise SystemExit(2)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise SystemExit(130)
        except Terminated:
            print("terminated", file=sys.stderr)
            raise SystemExit(143)
        except Exception as e:
            failed = _write_failure(e)
            if failed is None:
                raise
            name = getattr(failed, "filename", None)
            print(f"error: a write failed: {os.strerror(_write_errno(failed))}{f' ({name})' if name else ''}",
                  file=sys.stderr)
            raise SystemExit(1)
        finally:
            if own_term and signal.getsignal(signal.SIGTERM) in (_terminate, _terminating):  # not another's handler
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    return wrapper


def _says_it() -> bool:
    """Whether this process prints a refusal. Under torchrun every process checks the same command line before
    any of them joins the process group, so each would print the same line: the first process of each node says it for its node. Once the
    group is up, an error may be this process's own, and every process says its own."""
    if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0":  # one process a node (a node may differ)
        return True
    if os.environ.get("WORLD_SIZE", "").strip() in ("", "1"):  # one process whatever RANK says: it speaks
        return True
    dist = sys.modules.get("torch.distributed")  # never imported here just to ask
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def quiet_import_interrupts(package: str) -> None:
    """`python -m PACKAGE.module ...`: a Ctrl-C in the entry point's first seconds, while its module imports torch
    and transformers (before `cli_entry` runs), is 'interrupted' and exit 130 as later, not Python's traceback
    (nor, where a library turned the interrupt into an import error, a bogus 'could not import' one). Each package
    that holds entry points calls this at its import; `runpy` imports the package before the module. It does
    nothing unless this process was started as one of the package's modules (`sys.orig_argv`), so importing the
    package as a library (a notebook, pytest) leaves `sys.excepthook` alone. Any other error keeps its traceback."""
    module = _dash_m_module(getattr(sys, "orig_argv", []))
    if module is None or not (module == package or module.startswith(package + ".")):
        return
    if getattr(sys.excepthook, "_quiet_import_interrupts", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        if not _interrupted(value):
            return previous(kind, value, tb)
        print("interrupted", file=sys.stderr)
        if not isinstance(value, KeyboardInterrupt):  # an interrupt a library re-raised as another error
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        # a KeyboardInterrupt itself: Python ends the process by SIGINT (exit 130 in a shell) once this returns

    hook._quiet_import_interrupts = True
    hook.previous = previous  # put back by cli_entry once the entry point runs: its imports are done
    sys.excepthook = hook


def _dash_m_module(argv: list[str]) -> str | None:
    """The module of `python [options] -m MODULE ...` (`-mMODULE`, `-um MODULE`: short options cluster as CPython
    parses them), else None."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--check-hash-based-pycs":  # the one long option whose value is the next argument
            i += 2
            continue
        if arg in ("-", "--") or not arg.startswith("-"):  # stdin, a script, or `--` (a script follows)
            return None
        if arg.startswith("--"):  # --version, --help-env, ...: no value
            i += 1
            continue
        for j, flag in enumerate(arg[1:], start=2):
            if flag in "cmWX":  # an option with a value: the cluster's rest, else the next argument
                value = arg[j:] or (argv[i + 1] if i + 1 < len(argv) else None)
                if flag == "m":
                    return value or None
                if flag == "c":
                    return None
                i += 0 if arg[j:] else 1
                break
        i += 1
    return None


def _interrupted(e: BaseException | None) -> bool:
    """Whether `e` is a KeyboardInterrupt or was raised from / while handling one."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False
