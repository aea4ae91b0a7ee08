"""The registry: every registered driver is tested, an unsupported database fails with one clear error."""

from __future__ import annotations

import pytest
from sqlalchemy import make_url

from sqla_jobs.drivers import driver_class, driver_for, normalise_url, registered
from sqla_jobs.errors import ConfigError
from tests import app
from tests.conftest import BACKENDS


def test_every_registered_driver_runs_the_conformance_suite() -> None:
    assert {d.name for d in registered()} <= set(BACKENDS), "add the new backend's name to tests.conftest.BACKENDS"
    assert set(BACKENDS) <= {d.name for d in registered()}


def test_an_unsupported_database_names_the_supported_ones() -> None:
    with pytest.raises(ConfigError, match=r"supports PostgreSQL, SQLite and MariaDB/MySQL, not 'oracle'"):
        driver_class("oracle")
    with pytest.raises(ConfigError, match="not 'oracle'"):
        driver_for("oracle", app.Job.__table__, app.DeadJob.__table__)
    with pytest.raises(ConfigError, match="not 'mssql'"):
        normalise_url(make_url("mssql+pyodbc://u@h/db"))


def test_url_normalisation_picks_the_shipped_dbapi() -> None:
    assert normalise_url(make_url("postgresql://u@h/db")).drivername == "postgresql+psycopg"
    assert normalise_url(make_url("postgresql+psycopg://u@h/db")).drivername == "postgresql+psycopg"
    assert normalise_url(make_url("sqlite:///x.db")).drivername == "sqlite"
    assert normalise_url(make_url("postgres://u@h/db")).drivername == "postgresql+psycopg"
    assert normalise_url(make_url("mysql://u@h/db")).drivername == "mysql+pymysql"
    assert normalise_url(make_url("mariadb://u@h/db")).drivername == "mariadb+pymysql"
    assert normalise_url(make_url("mysql+pymysql://u@h/db")).query["charset"] == "utf8mb4"
    assert normalise_url(make_url("mysql+pymysql://u@h/db?charset=utf8")).query["charset"] == "utf8"


def test_mysql_and_mariadb_dialects_share_one_driver() -> None:
    assert driver_class("mysql") is driver_class("mariadb")
