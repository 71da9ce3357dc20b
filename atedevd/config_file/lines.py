"""Where a key, a table or a `[[device]]` entry of a TOML document is: its line, from the parser alone.

TOML is a sequence of statements that each end at a newline, so the first N lines of a valid
document parse exactly when line N ends a statement. A binary search over such prefixes finds
the statement that makes a value exist; an invalid document's problem starts after its longest
parsing prefix. A few extra parses of a file of a few hundred bytes cost microseconds, and only
when reporting. A hand-written line scanner (what this replaced) has to re-implement TOML's
strings, quoting and headers and silently points at wrong lines when it errs; this way a line
is either the parser's or absent.
"""

import sys
from typing import Dict, Optional

from atedevd.config import MAX_FILE_BYTES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class Lines:
    """Line numbers from the parser itself: TOML is a sequence of statements that
    each end at a newline, so the first N lines of a valid document parse exactly
    when line N ends a statement. A value is on the line of the statement that
    first makes it appear in a parsed prefix, and an invalid document's problem
    begins on the line after its longest parsing prefix.

    This costs a few parses of the document per line asked for (a binary
    search over cached prefixes), bounded by PARSE_BUDGET bytes parsed per
    document: thousands of lines for a real configuration of a few KiB; a
    file of hundreds of KiB with thousands of errors gets lines for the first
    ones and the rest without, in well under a second rather than many.
    """

    PARSE_BUDGET = MAX_FILE_BYTES

    def __init__(self, text: str):
        self._lines = text.split("\n")  # TOML lines end at \n only (a \r before it stays on its line)
        self._ends = []
        end = 0
        for line in self._lines:
            end += len(line) + 1
            self._ends.append(end)
        self._text = text + "\n"
        self._parsed: Dict[int, Optional[dict]] = {0: {}}
        self._budget = self.PARSE_BUDGET

    def whole(self, data: dict) -> None:
        """The whole document, parsed already."""
        self._parsed[len(self._lines)] = data

    def _prefix(self, n: int) -> Optional[dict]:
        """The first `n` lines, parsed; None when they are not a valid document."""
        if n not in self._parsed:
            size = self._ends[n - 1]
            if size > self._budget:
                raise _OutOfBudget
            self._budget -= size
            try:
                self._parsed[n] = tomllib.loads(self._text[:size])
            except (tomllib.TOMLDecodeError, RecursionError, MemoryError):
                self._parsed[n] = None
        return self._parsed[n]

    def first_invalid(self) -> Optional[int]:
        """The line where the first invalid statement begins."""
        try:
            for n in range(len(self._lines) - 1, -1, -1):
                if self._prefix(n) is not None:
                    return n + 1
        except _OutOfBudget:
            pass
        return None

    def of(self, *path) -> Optional[int]:
        """The line of the statement that makes `path` (keys and array indexes) exist."""
        try:
            return self._of(path)
        except _OutOfBudget:
            return None

    def _of(self, path: tuple) -> Optional[int]:
        lo, hi = 0, len(self._lines)  # absent in the first lo lines, present in the first hi
        if not _has(self._prefix(hi), path):
            return None
        step = 1
        while lo + step < hi:  # gallop first: what is asked for is mostly near the top
            n = self._statement_end(lo, lo + step, hi)
            if n is None:
                break
            if _has(self._prefix(n), path):
                hi = n
                break
            lo, step = n, step * 2
        while hi - lo > 1:
            n = self._statement_end(lo, (lo + hi) // 2, hi)
            if n is None:
                break  # no statement ends strictly between lo and hi: one statement spans them
            if _has(self._prefix(n), path):
                hi = n
            else:
                lo = n
        return lo + 1  # the statement ending on line hi begins after the last statement end

    def _statement_end(self, lo: int, near: int, hi: int) -> Optional[int]:
        """A line strictly between lo and hi, as close to `near` as found, where a statement ends."""
        n = near
        while n > lo and self._prefix(n) is None:  # inside a multi-line value
            n -= 1
        if n > lo:
            return n
        n = near + 1
        while n < hi and self._prefix(n) is None:
            n += 1
        return n if n < hi else None


class _OutOfBudget(Exception):
    pass


def _has(data, path: tuple) -> bool:
    for key in path:
        if isinstance(key, int):
            if not (isinstance(data, list) and key < len(data)):
                return False
        elif not (isinstance(data, dict) and key in data):
            return False
        data = data[key]
    return True
