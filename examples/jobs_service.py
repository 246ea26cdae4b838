"""The processor of examples/service.py: render a report page by page, reporting progress."""

from __future__ import annotations

import hashlib

from sandboxq import current_job


def render_report(customer: str, pages: int) -> dict[str, object]:
    digest = hashlib.sha256(customer.encode())
    for page in range(1, pages + 1):
        for _ in range(20_000):  # stands in for laying out one page: CPU work
            digest.update(digest.digest())
        current_job().progress(page / pages, f"page {page} of {pages}")
    return {"customer": customer, "pages": pages, "digest": digest.hexdigest()[:16]}
