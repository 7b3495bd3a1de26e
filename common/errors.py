"""User-facing errors: every CLI turns a `UserError` into one line on stderr and exit code 2."""
from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """Bad input from the user (unknown task, bad flag value, missing file...). Never a bug."""


def cli_entry(main):
    """Decorate a CLI `main(argv=None)`: `UserError` -> 'error: ...' on stderr and exit 2, no traceback."""

    @functools.wraps(main)
    def wrapper(argv=None):
        try:
            return main(argv)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise SystemExit(130)

    return wrapper
