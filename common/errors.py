"""User-facing errors: every CLI turns a `UserError` into one line on stderr and exit code 2."""
from __future__ import annotations

import errno
import functools
import os
import sys

# A write the machine refused (a full disk or quota, a file past the size limit, a read-only file system): the run's
# own cleanup has run by then (temporaries removed, an earlier run's results kept), so it is one line, exit 1
WRITE_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


class UserError(Exception):
    """Bad input from the user (unknown task, bad flag value, missing file...). Never a bug."""


def cli_entry(main):
    """Decorate a CLI `main(argv=None)`: `UserError` -> 'error: ...' on stderr (one line: the message's lines
    joined by '; ') and exit 2, no traceback; a write the machine refused (`WRITE_FAILURES`: a full disk) -> one
    line and exit 1."""

    @functools.wraps(main)
    def wrapper(argv=None):
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
        except OSError as e:
            if e.errno not in WRITE_FAILURES:
                raise
            where = f" ({e.filename})" if e.filename else ""
            print(f"error: a write failed: {e.strerror}{where}", file=sys.stderr)
            raise SystemExit(1)

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
