"""Job graphs on the dashboard, on every backend: `blocked` in the figures, the lists and the state filter;
a job's page lists its upstreams and dependents as links and draws them as an inline SVG (read back as XML)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any

from sqlalchemy.orm import Session

from tests import app
from tests.conftest import Database
from tests.dashboard_helpers import TOKEN, client, figure, post
from tests.helpers import enqueue, job, mixed_graph

SVG = "{http://www.w3.org/2000/svg}"
DRAWN = 8  # neighbours the picture draws a side (docs/howto/dashboard.md); the rest are one "and N more" node
LISTED = 50  # neighbours each list shows


def picture(html: str) -> ET.Element:
    """The page's graph, parsed as XML (so it is well formed: every text escaped)."""
    match = re.search(r'<svg xmlns="http://www.w3.org/2000/svg" class="graph".*?</svg>', html, re.S)
    assert match, "the page draws no graph"
    return ET.fromstring(match.group(0))


def nodes(svg: ET.Element) -> dict[str, tuple[str, str, str | None]]:
    """{job id or the node's label: (element tag, its classes, its link)} of every node drawn."""
    found = {}
    for element in svg.iter():
        classes = element.get("class", "")
        if classes.split()[:1] == ["node"]:
            label = "".join(element.find(f"{SVG}text[@class='label']").itertext())  # type: ignore[union-attr]
            found[element.get("data-job") or label] = (element.tag.removeprefix(SVG), classes, element.get("href"))
    return found


def edges(svg: ET.Element) -> list[tuple[int, int]]:
    return [(int(p.get("data-from", 0)), int(p.get("data-to", 0))) for p in svg.iter(f"{SVG}path")
            if p.get("class") == "edge"]


def links_in(html: str, table: str) -> list[int]:
    """The job ids linked from the rows of ``table`` (id ``upstreams`` or ``dependents``)."""
    match = re.search(rf'<table id="{table}">(.*?)</table>', html, re.S)
    assert match, f"no table {table}"
    return [int(i) for i in re.findall(r'<a href="[^"]*/jobs/(\d+)">\1</a>', match.group(1))]


def test_a_job_page_draws_its_upstreams_and_dependents_coloured_by_state(db: Database) -> None:
    ids = mixed_graph(db.engine)
    ok, bad, later, join, after = (ids[name] for name in ("ok", "bad", "later", "join", "after"))
    html = client(db).get(f"/jobs/{join}").text
    svg = picture(html)
    link = "http://testserver/jobs/{}"
    assert nodes(svg) == {
        str(ok): ("g", "node state-gone", None),  # pruned: no page to link to
        str(bad): ("a", "node state-dead", link.format(bad)),
        str(later): ("a", "node state-pending", link.format(later)),
        str(join): ("g", "node self state-blocked", None),
        str(after): ("a", "node state-blocked", link.format(after)),
    }
    assert sorted(edges(svg)) == sorted([(ok, join), (bad, join), (later, join), (join, after)])  # upstream -> down
    assert all(p.get("marker-end") == "url(#graph-arrow)" for p in svg.iter(f"{SVG}path") if p.get("class"))
    assert "dead, counted as done" in ET.tostring(svg, encoding="unicode")
    # The lists: links in depends_on order (not to the pruned one), the dependents, and what it waits for.
    assert links_in(html, "upstreams") == [bad, later]
    assert links_in(html, "dependents") == [after]
    assert 'badge state-gone">gone<' in html and "no longer in the tables" in html
    assert re.search(r"Blocked: waits for 1 of its 3\s+upstream\(s\) to finish", html)
    assert "<code>on_upstream_failure</code> run: if an upstream fails, this job runs anyway" in html
    # The stylesheet colours a node as it colours its state's badge: one custom property per state.
    css = client(db).get("/static/dashboard.css").text
    assert ".state-blocked { --state:" in css and "fill: var(--state" in css and "background: var(--state" in css


def test_a_dead_job_page_names_the_dependents_waiting_for_its_requeue(db: Database) -> None:
    ids = mixed_graph(db.engine)
    html = client(db).get(f"/jobs/{ids['bad']}").text
    svg = picture(html)
    assert nodes(svg)[str(ids["bad"])] == ("g", "node self state-dead", None)
    assert sorted(edges(svg)) == sorted([(ids["bad"], ids["join"]), (ids["bad"], ids["waiter"])])
    assert links_in(html, "dependents") == sorted([ids["join"], ids["waiter"]])
    assert '<table id="upstreams">' not in html
    assert re.search(rf"Dependent\(s\) {ids['waiter']} wait for this job", html)  # not `join`: it does without


def test_a_large_fan_out_is_cut_in_the_picture_and_the_list(db: Database) -> None:
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        source = app.Job(kind="noop", payload={})
        fan = [app.Job(kind="noop", payload={}, depends_on=[source]) for _ in range(LISTED + 3)]
        session.add_all(fan)
    fan_ids = sorted(f.id for f in fan)
    html = client(db).get(f"/jobs/{source.id}").text
    svg = picture(html)
    drawn = nodes(svg)
    assert [int(k) for k, v in drawn.items() if v[1] == "node state-blocked"] == fan_ids[:DRAWN]
    assert drawn[f"and {LISTED + 3 - DRAWN} more"] == ("a", "node more", "#dependents")
    assert len(edges(svg)) == DRAWN and [p for p in svg.iter(f"{SVG}path") if p.get("class") == "edge more"]
    assert links_in(html, "dependents") == fan_ids[:LISTED]
    assert "… and 3 more" in html and "Dependents, by id (53)" in html


def test_a_job_outside_any_graph_draws_none_and_kinds_are_escaped_in_the_picture(db: Database) -> None:
    plain = enqueue(db.engine, "noop")
    html = client(db).get(f"/jobs/{plain}").text
    assert 'id="graph"' not in html and 'id="graph-heading"' not in html
    evil = '<img src=x onerror="alert(1)">&'
    app.queue.check_kinds = False
    try:
        with Session(db.engine, expire_on_commit=False) as session, session.begin():
            upstream = app.Job(kind=evil, payload={})
            dependent = app.Job(kind="noop", payload={}, depends_on=[upstream])
            session.add(dependent)
    finally:
        app.queue.check_kinds = True
    html = client(db).get(f"/jobs/{dependent.id}").text
    assert "<img src=x" not in html
    svg = picture(html)  # parses: the kind is text
    texts = " ".join(svg.itertext())
    assert evil[:20] in texts and "&lt;img" in html


def test_blocked_in_the_overview_the_state_filter_and_the_lists(db: Database) -> None:
    ids = mixed_graph(db.engine)
    web = client(db)
    html = web.get("/").text
    stats = app.queue.stats(db.engine)
    assert stats.blocked == 3 and figure(html, "blocked") == "3"
    assert re.search(r'\?queue=default&amp;state=blocked">3</a>', html)  # the By queue table's blocked column
    listed = web.get("/jobs", params={"state": "blocked"}).text
    assert '<option value="blocked" selected>' in listed
    shown = [int(i) for i in re.findall(r'<tr class="state-blocked"><td><a href="[^"]*">(\d+)</a>', listed)]
    assert shown == sorted([ids["join"], ids["waiter"], ids["after"]], reverse=True)
    recent = web.get("/jobs", params={"since": "1h"}).text  # created within: the blocked ones too
    assert all(f">{ids[name]}</a>" in recent for name in ("join", "waiter", "after"))
    # The overview wrote a sample of the figures: the blocked ones per queue are in the history too.
    assert web.get("/api/series", params={"span": "day"}).json()["series"]["blocked"] == {"default": [3.0]}


def test_a_blocked_job_can_be_cancelled_from_its_page(db: Database) -> None:
    ids = mixed_graph(db.engine)
    web = client(db, actions=True, token=TOKEN)
    page = web.get(f"/jobs/{ids['join']}", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert 'id="action-cancel"' in page
    done: Any = post(web, "cancel", ids=str(ids["join"]), headers={"Authorization": f"Bearer {TOKEN}"})
    assert done.status_code == 303
    assert job(db.engine, ids["join"]).state == "cancelled"  # type: ignore[union-attr]
    after = job(db.engine, ids["after"])
    assert after is not None and after.state == "cancelled"  # its dependent heard of it (the default policy)


def test_purging_a_dead_upstream_from_the_dashboard_cancels_the_dependent_waiting_for_it(db: Database) -> None:
    """As `queue.purge_dead` and `sqla-jobs dead purge` do: a purged job will never come back."""
    ids = mixed_graph(db.engine)
    web = client(db, actions=True, token=TOKEN)
    done = post(web, "purge", ids=str(ids["bad"]), headers={"Authorization": f"Bearer {TOKEN}"})
    assert done.status_code == 200 and f"purged 1 dead job(s): {ids['bad']}" in done.text
    waiter = job(db.engine, ids["waiter"])
    assert waiter is not None and waiter.state == "cancelled"
    assert f"upstream job {ids['bad']} was purged from the dead letters" in (waiter.last_error or "")
    joined = job(db.engine, ids["join"])  # it did without `bad` already: still waits for `later` only
    assert joined is not None and (joined.state, joined.waiting_for) == ("blocked", 1)
