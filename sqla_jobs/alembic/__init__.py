"""Keep the job tables in your own alembic history.

Install the extra (``pip install "sqla-jobs[alembic]"``); importing
``sqla_jobs`` alone never imports alembic.

Autogenerate
------------

Your models already include ``JobMixin`` / ``DeadJobMixin`` classes, so
``alembic revision --autogenerate`` sees the job tables. Left alone, alembic
writes a revision that does not run or is incomplete: it renders the
PostgreSQL ``JSONB`` variant as ``postgresql.JSONB(astext_type=Text())``
without importing ``Text`` (``NameError`` on upgrade), on SQLite it leaves out
the claim index ``ix_<table>_pending`` (an expression index) and then reports
it as changed forever, and it never notices a changed partial-index
predicate. Add our options to both ``context.configure(...)`` calls in your
``env.py``::

    from sqla_jobs.alembic import configure_options

    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        **configure_options(target_metadata),
    )

This adds a ``render_item`` for the JSONB types, takes sqla-jobs' own
indexes away from alembic's index comparison (``include_object``) and
compares them itself (existence, columns with their order, ``WHERE``
predicate), compares the job tables' server defaults, and, when your tables live in named PostgreSQL schemas, looks into
those schemas only. If you already have a ``render_item``, ``include_object``
or ``include_name`` of your own, hand them over and they are still called
first::

    **configure_options(target_metadata, render_item=my_render_item, include_object=my_filter)

After ``alembic upgrade head``, ``alembic check`` reports no difference on
PostgreSQL and SQLite. ``render_item`` (a drop-in ``render_item`` callable)
and ``wrap_render_item(yours)`` are also available on their own.

Rendered revision
-----------------

``sqla-jobs migrations render --app myapp.jobs:queue`` writes a revision into
your versions folder (``--alembic-ini``, default ``./alembic.ini``) whose
``down_revision`` is your current head: without a database it creates both
tables and their indexes; with ``--url`` (or ``SQLA_JOBS_URL``) it compares
the database with this version's models and renders exactly the difference,
which is how you upgrade the schema after upgrading sqla-jobs. See
``render_revision``.

New project
-----------

``sqla-jobs migrations init DIR`` runs ``alembic init`` with our template: an
``env.py`` that already uses ``configure_options`` and reads the database URL
from ``SQLA_JOBS_URL`` when set. ``sqla-jobs migrations template-path``
prints the template's folder for ``alembic init -t PATH DIR``. Its ``env.py``
finds your models through ``sqla_jobs.app`` in ``alembic.ini`` (or
``SQLA_JOBS_APP``) until you point ``target_metadata`` at your own ``Base``.
"""

from .helpers import (
    Rendered,
    app_metadata,
    configure_options,
    database_url,
    job_tables,
    render_item,
    render_revision,
    template_dir,
    wrap_render_item,
)

__all__ = [
    "Rendered",
    "app_metadata",
    "configure_options",
    "database_url",
    "job_tables",
    "render_item",
    "render_revision",
    "template_dir",
    "wrap_render_item",
]
