"""Text from anywhere (file names, test output, stored rows) made safe to print on one line.

A name can hold a newline, a terminal escape or a lone surrogate; printed raw it can start a
line of its own (a GitHub workflow command is any line starting with `::`), recolour the
terminal or fail to encode. `printable` shows every such character as a visible escape.
"""

from __future__ import annotations

import re

ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u2028\u2029\ud800-\udfff]")
CONTROL_OR_NEWLINE = re.compile(r"[\x00-\x1f\x7f\u2028\u2029\ud800-\udfff]")


def escape_char(match: re.Match) -> str:
    code = ord(match.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """One visible line: colour codes dropped, control characters, newlines and lone
    surrogates as \\xNN / \\uNNNN."""
    return CONTROL_OR_NEWLINE.sub(escape_char, ANSI.sub("", text))
