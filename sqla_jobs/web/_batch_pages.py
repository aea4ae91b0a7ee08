"""The dashboard's batch pages: ``/batches`` lists them, ``/batches/{id}`` shows one's counts (sqla_jobs._batch)."""

from __future__ import annotations

from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import Response

from ._pages import _site

__all__ = ["batch", "batches"]

#: Batches a page lists; the next page starts below the last one's id.
PAGE = 50


def batches(request: Request) -> Response:
    site = _site(request)
    before = request.query_params.get("before")
    with Session(site.engine) as session:
        found = site.queue.batches(session, limit=PAGE + 1, before=int(before) if before and before.isdigit() else None)
    shown = found[:PAGE]
    return site.render(request, "batches.html", batches=shown, next_before=shown[-1].id if len(found) > PAGE else None)


def batch(request: Request) -> Response:
    site = _site(request)
    batch_id = int(request.path_params["batch_id"])
    with Session(site.engine) as session:
        status = site.queue.batch(session, batch_id)
    if status is None:
        return site.render(request, "message.html", 404, heading="No such batch",
                           message=f"There is no batch {batch_id} (it may have been pruned with its callbacks).")
    parts = [("finished", status.finished), ("dead", status.dead), ("cancelled", status.cancelled),
             ("waiting", status.waiting), ("removed", status.removed)]
    # The bar's widths, in percent of the members (a batch with none yet shows an empty bar).
    bar = [(name, count, 100 * count / status.total) for name, count in parts if count and status.total]
    return site.render(request, "batch.html", batch=status, parts=parts, bar=bar)
