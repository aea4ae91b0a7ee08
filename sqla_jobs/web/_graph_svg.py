"""The job page's picture of a job's graph: the job, its upstreams and its dependents, one step each way.

Drawn on the server as an inline SVG (no script, nothing fetched): three columns,
upstreams on the left, the job in the middle, dependents on the right, an arrow
from each upstream to the job and from the job to each dependent. At most
``DRAWN`` neighbours a side are drawn; the rest are one ``and N more`` node. Each
node is a link to its job's page (not a job that is gone: it has none) and
carries ``state-<state>`` as a class, so the stylesheet colours it as it colours
that state's badge (``dashboard.css``). Every text is escaped: a kind is the
application's string, and its characters are shown, never interpreted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from html import escape

from markupsafe import Markup

from .._neighbourhood import Neighbour, Neighbourhood

__all__ = ["DRAWN", "neighbourhood_svg"]

#: Neighbours drawn on each side; more become one "and N more" node.
DRAWN = 8
_W, _H, _GAP, _COLUMN_GAP, _PAD = 190, 40, 10, 70, 6
_LABEL = 24  # characters of "#id kind" a node shows; its tooltip has all of it


@dataclass(frozen=True)
class _Node:
    label: str
    detail: str
    classes: str
    href: str | None
    tooltip: str
    job_id: int | None = None


def neighbourhood_svg(job_id: int, kind: str, state: str, hood: Neighbourhood, link: Callable[[int], str]) -> Markup:
    """The SVG of job ``job_id`` (``kind``, ``state``) and ``hood``; ``link(id)`` is a job page's URL."""
    me = _Node(f"#{job_id} {kind}", state, f"node self state-{state}", None, f"job {job_id}: {kind}, {state}", job_id)
    ups = _side(hood.upstreams, hood.upstream_total, "upstream", link)
    downs = _side(hood.dependents, hood.dependent_total, "dependent", link)
    middle = [me]
    columns = [column for column in (ups, middle, downs) if column]
    rows = max(len(column) for column in columns)
    width = 2 * _PAD + len(columns) * _W + (len(columns) - 1) * _COLUMN_GAP
    height = 2 * _PAD + rows * _H + (rows - 1) * _GAP
    places: dict[int, list[tuple[float, float]]] = {}
    for index, column in enumerate(columns):
        x = _PAD + index * (_W + _COLUMN_GAP)
        top = (height - (len(column) * _H + (len(column) - 1) * _GAP)) / 2
        places[id(column)] = [(x, top + n * (_H + _GAP)) for n in range(len(column))]
    [(my_x, my_y)] = places[id(middle)]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="graph" id="graph" role="img" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" aria-label="{_attr(_summary(job_id, hood))}">',
        '<defs><marker id="graph-arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="8" markerHeight="8" '
        'orient="auto"><path d="M0,0 L10,5 L0,10 z"/></marker></defs>',
    ]
    if ups:
        for node, (x, y) in zip(ups, places[id(ups)], strict=True):
            parts.append(_edge(x + _W, y + _H / 2, my_x, my_y + _H / 2, node, node.job_id, job_id))
    if downs:
        for node, (x, y) in zip(downs, places[id(downs)], strict=True):
            parts.append(_edge(my_x + _W, my_y + _H / 2, x, y + _H / 2, node, job_id, node.job_id))
    for column in columns:
        for node, (x, y) in zip(column, places[id(column)], strict=True):
            parts.append(_node(node, x, y))
    parts.append("</svg>")
    return Markup("\n".join(parts))


def _side(neighbours: list[Neighbour], total: int, name: str, link: Callable[[int], str]) -> list[_Node]:
    nodes = []
    for n in neighbours[:DRAWN]:
        state = n.shown_state
        tooltip = f"{name} job {n.id}: {n.kind or '?'}, {state}" + (f" ({n.note})" if n.note else "")
        detail = state if not n.ended else f"{state}, {'counted as done' if n.upstream else 'does without it'}"
        nodes.append(_Node(f"#{n.id} {n.kind or ''}".rstrip(), detail,
                           f"node state-{state}", None if n.state is None else link(n.id), tooltip, n.id))
    more = total - len(nodes)
    if more > 0:
        plural = "s" if more > 1 else ""
        nodes.append(_Node(f"and {more} more", f"{name}{plural}", "node more", f"#{name}s",
                           f"and {more} more {name}{plural}: listed below"))
    return nodes


def _summary(job_id: int, hood: Neighbourhood) -> str:
    return f"job {job_id}, its {hood.upstream_total} upstream(s) and {hood.dependent_total} dependent(s)"


def _attr(text: str) -> str:
    return escape(text, quote=True)


def _cut(text: str) -> str:
    return text if len(text) <= _LABEL else text[: _LABEL - 1] + "…"


def _node(node: _Node, x: float, y: float) -> str:
    job = "" if node.job_id is None else f' data-job="{node.job_id}"'
    body = (f'<title>{_attr(node.tooltip)}</title>'
            f'<rect x="{x:g}" y="{y:g}" width="{_W}" height="{_H}" rx="6"/>'
            f'<text x="{x + 8:g}" y="{y + 16:g}" class="label">{_attr(_cut(node.label))}</text>'
            f'<text x="{x + 8:g}" y="{y + 32:g}" class="detail">{_attr(_cut(node.detail))}</text>')
    if node.href is None:
        return f'<g class="{_attr(node.classes)}"{job}>{body}</g>'
    return f'<a href="{_attr(node.href)}" class="{_attr(node.classes)}"{job}>{body}</a>'


def _edge(x1: float, y1: float, x2: float, y2: float, node: _Node, source: int | None, target: int | None) -> str:
    """An arrow from (x1, y1) to (x2, y2): upstream to downstream; dashed to or from an "and N more" node."""
    bend = (x2 - x1) / 2
    ends = "" if source is None or target is None else f' data-from="{source}" data-to="{target}"'
    kind = "edge more" if node.job_id is None else "edge"
    return (f'<path class="{kind}"{ends} d="M{x1:g},{y1:g} C{x1 + bend:g},{y1:g} {x2 - bend:g},{y2:g} '
            f'{x2 - 1:g},{y2:g}" marker-end="url(#graph-arrow)"/>')
