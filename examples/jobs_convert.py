"""The processor tested by examples/test_my_processor.py: it converts a document by piping
it through an external program, the kind of job that hangs in production.

The converter here is a few lines of Python standing in for LibreOffice, ImageMagick or
Ghostscript; like them, it never finishes on some malformed inputs (here: a NUL byte).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sandboxq import SoftTimeout

CONVERTER = """
import sys, time
text = sys.stdin.read()
while "\\x00" in text:  # a malformed document: the converter hangs
    time.sleep(1)
sys.stdout.write(text.upper())
"""


def convert(name: str, text: str, out_dir: str) -> str:
    """Write the converted ``text`` to ``out_dir/name.txt``; returns that path."""
    out = Path(out_dir) / f"{name}.txt"
    partial = out.with_suffix(".part")
    try:
        with open(partial, "w") as sink:
            # On any exception (SoftTimeout included) run() kills the converter it started.
            subprocess.run(
                [sys.executable, "-c", CONVERTER], input=text, stdout=sink, text=True, check=True
            )
        partial.replace(out)
    except SoftTimeout:
        partial.unlink(missing_ok=True)  # out of time: no half-converted file left behind
        raise
    return str(out)
