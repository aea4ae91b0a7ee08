"""What a fan-out's join costs: 1 -> N -> 1 against 1 -> N (the same root, no join) and a plain drain of N + 2.

::

    python docs/bench/fan_join_cost.py --url postgresql+psycopg://postgres@127.0.0.1/test [--fan-out 100000] [--runs 3]

In the bench's scratch schema, with the bench's worker processes (2 x 64 threads, as ``sqla-jobs bench --graphs
fan``), each run times three graphs taking turns going first, every figure by the database clock from the first
claim to the last finish:

* ``join``: a root, N jobs depending on it and a join depending on all N (the bench's fan-out);
* ``no join``: the same root and N dependents, and one more job depending on the root only;
* ``plain``: N + 2 independent jobs.

It prints each run and the medians: jobs/s, each graph's ratio to the plain drain, and the seconds from the
root's finish to its first dependent's claim (the root's count-down of its N dependents, in both graphs). The
difference between the two graphs is what the join's count-down, one more row updated by every exchange of
every worker, costs the drain of the middle (docs/performance.md, "Job graphs").
"""

from __future__ import annotations

import argparse
import statistics

from sqlalchemy import create_engine
from sqlalchemy.engine import URL, Engine, make_url

from sqla_jobs.bench import graphs, run

GRAPHS = ("join", "no join", "plain")


def fan(args: argparse.Namespace, url: URL, engine: Engine, join: bool) -> tuple[float, float]:
    """Jobs/s of the bench's fan-out, with its join or without (``graphs.fan_graph``); and the seconds from the
    root's finish (the first job added) to the first claim of one of its N dependents (``graphs.fan_phases``)."""
    rate = graphs.fan_graph(args, url, engine, "noop", join=join)
    return rate, graphs.fan_phases(engine)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="a PostgreSQL URL (postgresql+psycopg://...)")
    parser.add_argument("--fan-out", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    bench_args = argparse.Namespace(fan_out=args.fan_out, concurrency=64, processes=2, batch_size=None,
                                 use_async=False, vacuum_dead_rows=None)
    rates: dict[str, list[float]] = {g: [] for g in GRAPHS}
    releases: dict[str, list[float]] = {g: [] for g in GRAPHS[:2]}
    with run.scratch(make_url(args.url)) as url:
        engine = create_engine(url)
        for r in range(args.runs):
            for name in GRAPHS[r % 3:] + GRAPHS[:r % 3]:
                run._reset(engine)
                if name == "plain":
                    rates[name].append(graphs.plain_drain(bench_args, url, engine, "noop"))
                else:
                    rate, release = fan(bench_args, url, engine, join=name == "join")
                    rates[name].append(rate)
                    releases[name].append(release)
            print(f"run {r + 1}: " + ", ".join(f"{g} {rates[g][-1]:,.0f} jobs/s" for g in GRAPHS), flush=True)
    medians = {g: statistics.median(v) for g, v in rates.items()}
    print(f"medians of {args.runs}, N = {args.fan_out:,}:")
    for g in GRAPHS:
        ratio = f", {medians[g] / medians['plain']:.2f} of the plain drain" if g != "plain" else ""
        release = f", root's count-down {statistics.median(releases[g]):.2f} s" if g in releases else ""
        print(f"  {g:8} {medians[g]:>9,.0f} jobs/s{ratio}{release}")


if __name__ == "__main__":
    main()
