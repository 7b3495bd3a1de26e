"""User-facing errors: every CLI turns a `UserError` into one line on stderr and exit code 2."""
from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """Bad input from the user (unknown task, bad flag value, missing file...). Never a bug."""


def cli_entry(main):
    """Decorate a CLI `main(argv=None)`: `UserError` -> 'error: ...' on stderr (one line: the message's lines
    joined by '; ') and exit 2, no traceback."""

    @functools.wraps(main)
    def wrapper(argv=None):
        try:
            return main(argv)
        except UserError as e:  # one line whatever the message holds (a user's code may raise "a\nb")
            print(f"error: {'; '.join(x.strip() for x in str(e).splitlines() if x.strip())}", file=sys.stderr)
            raise SystemExit(2)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise SystemExit(130)

    return wrapper
