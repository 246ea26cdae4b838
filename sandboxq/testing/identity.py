"""A processor that says who imported it: its module is imported by the child, and only
by a pool with ``user=``/``group=`` set (no other pool preloads it into the fork server),
so ``imported_as`` shows the credentials in force when the processor was imported."""

from __future__ import annotations

import os

#: (uid, gid, supplementary groups) of the process that imported this module.
IMPORTED_AS = (os.getuid(), os.getgid(), sorted(os.getgroups()))


def imported_as() -> list[object]:
    """ok: the credentials at import, then those at run time."""
    return [list(IMPORTED_AS), [os.getuid(), os.getgid(), sorted(os.getgroups())]]
