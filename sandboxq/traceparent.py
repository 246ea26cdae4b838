"""The W3C trace context ``traceparent`` a job may carry, checked without pydantic.

Its own module, imported by ``models`` (a job's options) and by ``tracing`` (the child's
context): the pool child's import of ``tracing`` must not bring pydantic into the fork
server, whose start every pool waits for (pydantic was two thirds of that import).
"""

from __future__ import annotations

import re

#: A ``traceparent`` of version 00 (trace id and span id not all zero): the only form a
#: job's stored trace context may take (sandboxq/tracing.py).
TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
TRACEPARENT_LENGTH = 55


def is_traceparent(value: object) -> bool:
    return (
        isinstance(value, str)
        and len(value) == TRACEPARENT_LENGTH
        and TRACEPARENT.fullmatch(value) is not None
    )
