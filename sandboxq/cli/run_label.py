"""A fleet run's batch label: which input lines its members are, so that ``--resume``,
from any process, writes each finished member as the line it came from.

    make_label: {"sandboxq_run": INPUT, "lines": "1-3, 5", "malformed": "4"}
                or, when ranges would pass MAX_LABEL_BYTES, {"sandboxq_run": INPUT,
                "line_map": base64(zlib("gggmg"))}
    read_label: the same read back, bounded by the batch's member count
"""

from __future__ import annotations

import base64
import json
import re
import zlib

from sandboxq import text
from sandboxq.backends.rules import MAX_LABEL_BYTES
from sandboxq.errors import ConfigError

#: The label's key naming the input file: what marks a batch as sent by ``sandboxq run``.
LABEL_KEY = "sandboxq_run"


#: Where a label too big as ranges keeps its line numbers instead: one character per input
#: line ("g" sent, "m" malformed, "-" neither: blank), zlib-compressed, base64.
LINE_MAP = "line_map"


def make_label(input_name: str, lines: list[int], bad: dict[int, str]) -> str:
    """The batch's label: the input's name, then its sent and malformed line numbers as
    ranges ("1-3, 5"), or, when a file that mixes them line by line makes those longer than
    a label may be (``MAX_LABEL_BYTES``), as a compressed map of every line."""
    label = json.dumps(
        {
            LABEL_KEY: input_name,
            "lines": text.number_ranges(lines),
            "malformed": text.number_ranges(bad),
        }
    )
    if len(label.encode()) <= MAX_LABEL_BYTES:
        return label
    codes = bytearray(b"-" * max([*lines, *bad, 0]))
    for n in lines:
        codes[n - 1] = ord("g")
    for n in bad:
        codes[n - 1] = ord("m")
    packed = base64.b64encode(zlib.compress(bytes(codes), 9)).decode()
    label = json.dumps({LABEL_KEY: input_name, LINE_MAP: packed})
    if len(label.encode()) > MAX_LABEL_BYTES:
        raise ConfigError(
            f"the line numbers of {input_name} do not fit in a batch's label "
            f"({MAX_LABEL_BYTES:,} bytes), so the run could not be resumed: send the "
            "file in parts, or drop its malformed lines first"
        )
    return label


#: The most malformed lines a resumed run reports from its label (the run that sent the
#: batch printed each one), and the most input lines a label's map may cover (one byte a
#: line: zlib inflates a stored field, up to 1 MiB, a thousandfold).
MAX_RESUMED_MALFORMED = 10_000_000


MAX_MAPPED_LINES = 100_000_000


def _read_line_map(packed: str, members: int) -> tuple[list[int], list[int]]:
    """``make_label``'s map read back: the sent line numbers (``members`` of them at most:
    ``ValueError`` past that, as past the map's own bound), and the malformed ones."""
    inflate = zlib.decompressobj()
    codes = inflate.decompress(base64.b64decode(packed, validate=True), MAX_MAPPED_LINES)
    if inflate.unconsumed_tail:
        raise ValueError(f"its map covers more than {MAX_MAPPED_LINES:,} lines")
    if codes.count(b"g") > members:
        raise ValueError("its map names more lines than the batch has members")
    if codes.count(b"m") > MAX_RESUMED_MALFORMED:
        raise ValueError(f"its map names more than {MAX_RESUMED_MALFORMED:,} malformed lines")
    # found by the regex engine: a Python loop over every line took 15 s for 100 million
    return [m.start() + 1 for m in re.finditer(b"g", codes)], [
        m.start() + 1 for m in re.finditer(b"m", codes)
    ]


def parse_ranges(spans: str, most: int) -> list[int]:
    """``text.number_ranges`` read back: ``"1-3, 5"`` -> ``[1, 2, 3, 5]``; ``ValueError``
    when that would be more than ``most`` numbers."""
    out: list[int] = []
    for span in filter(None, (s.strip() for s in spans.split(","))):
        first, _, last = span.partition("-")
        low, high = int(first), int(last or first)
        if len(out) + max(0, high - low + 1) > most:  # not len(range): it overflows
            raise ValueError(f"they name more than {most:,} lines")
        out += range(low, high + 1)
    return out


def read_label(batch_id: str, label: str | None, members: int) -> tuple[list[int], list[int]]:
    """The sent line numbers (one per member, in member order) and the malformed ones that
    ``make_label`` wrote in batch ``batch_id``'s ``label``; a ConfigError saying why when
    they cannot be read. Any user may label a batch, and anyone who can write to Redis may
    rewrite a label: what it names is read up to what the batch can hold, never into a
    list of billions."""
    try:
        data = json.loads(label or "")
        assert isinstance(data[LABEL_KEY], str)
    except (ValueError, KeyError, TypeError, AssertionError, RecursionError):
        raise ConfigError(
            f"batch {batch_id!r} was not sent by sandboxq run: its label holds no line numbers"
        ) from None
    try:
        if LINE_MAP in data:
            lines, malformed = _read_line_map(data[LINE_MAP], members)
        else:
            lines = parse_ranges(data["lines"], members)
            malformed = parse_ranges(data.get("malformed", ""), MAX_RESUMED_MALFORMED)
    except (ValueError, KeyError, TypeError, AttributeError, zlib.error) as exc:
        raise ConfigError(
            f"batch {batch_id!r}: its label's line numbers cannot be read ({exc}), so it "
            "cannot be resumed"
        ) from None
    if len(lines) != members:
        raise ConfigError(
            f"batch {batch_id!r}: its label names {len(lines)} lines for {members} members"
        )
    return lines, malformed
