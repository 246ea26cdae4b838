"""A FastAPI service that enqueues without blocking its event loop (``sandboxq.aio``).

    SANDBOXQ_URL=redis://localhost:6379/0 python examples/fastapi_app.py [--port 8000]
    sandboxq worker reports jobs_service:render_report --url $SANDBOXQ_URL   # elsewhere

    POST /reports {"customer": "acme", "pages": 3}   -> 202 {"job_id": "..."}
    GET  /reports/{job_id}?wait_s=10                 -> 200 {"state": "completed", "result": ...}
                                                        504 still running after wait_s
                                                        422 failed or cancelled, with the cause
                                                        404 no such job

One ``aio.Queue`` for the whole app, opened and closed by the lifespan. A request that
waits for a result awaits an ``XREAD BLOCK`` on Redis: hundreds of them can wait at once
while the same event loop keeps answering other requests.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from sandboxq import aio
from sandboxq.errors import JobFailed, SandboxqError

QUEUE = os.environ.get("REPORTS_QUEUE", "reports")
PROCESSOR = "jobs_service:render_report"  # what the workers of QUEUE run


class ReportRequest(BaseModel):
    customer: str = Field(min_length=1, max_length=200)
    pages: int = Field(ge=1, le=500)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with aio.Queue(QUEUE, os.environ.get("SANDBOXQ_URL")) as queue:
        app.state.reports = queue.options(hard_timeout_s=120, retries=1)
        yield


app = FastAPI(title="reports", lifespan=lifespan)


@app.post("/reports", status_code=202)
async def create_report(request: ReportRequest) -> dict[str, str]:
    job = await app.state.reports.enqueue(request.customer, pages=request.pages)
    return {"job_id": job.id}


@app.get("/reports/{job_id}")
async def get_report(job_id: str, wait_s: float = 0.0) -> dict[str, Any]:
    try:
        job = app.state.reports.job(job_id)
        await job.info()  # 404 before waiting on a job that does not exist
        value = await job.result(timeout_s=min(max(wait_s, 0.001), 60.0))
    except TimeoutError:
        raise HTTPException(504, f"job {job_id} is still {await job.state()}") from None
    except JobFailed as exc:
        raise HTTPException(422, {"state": "failed", "error": exc.error}) from None
    except SandboxqError as exc:
        raise HTTPException(404, str(exc)) from None
    return {"state": "completed", "result": value}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
