"""The documentation site builds with ``mkdocs build --strict`` (mkdocs.yml), so CI catches broken links,
pages missing from the navigation and an API reference that lost a public name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

import sqla_jobs
import sqla_jobs.testing
from tests.conftest import ROOT


def nav_pages(items: list[object]) -> list[str]:
    pages: list[str] = []
    for item in items:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += nav_pages(value) if isinstance(value, list) else [str(value)]
    return pages


def test_every_page_is_in_the_navigation() -> None:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    docs = ROOT / "docs"
    pages = sorted(p.relative_to(docs).as_posix() for p in docs.rglob("*.md"))
    assert sorted(nav_pages(config["nav"])) == pages


def test_the_site_builds_strictly_with_search_and_the_generated_api(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not re.search(r"^(WARNING|ERROR)", result.stderr, re.M), result.stderr
    search = json.loads((site / "search" / "search_index.json").read_text())
    assert any("run_due" in doc["text"] for doc in search["docs"])  # the search index covers the pages
    api = (site / "reference" / "python-api" / "index.html").read_text()
    # Each public name gets its entry from its docstring: a new public name must be added to the page.
    # (The MAX_ constants have no docstrings: docs/reference/api.md documents them, see test_package.)
    for name in [n for n in sqla_jobs.__all__ if not n.startswith("MAX_")]:
        assert f'id="sqla_jobs.{name}"' in api or f'id="sqla_jobs.errors.{name}"' in api, name
    for name in sqla_jobs.testing.__all__:
        assert f'id="sqla_jobs.testing.{name}"' in api, name
    assert "Run every due job with a real worker" in api  # the text comes from the docstrings


def test_readme_says_how_to_build_and_open_the_site() -> None:
    readme = (ROOT / "README.md").read_text()
    assert '`pip install -e ".[docs]" && mkdocs serve`, then open http://127.0.0.1:8000' in readme
