"""alembic templates shipped with sqla-jobs (installed as ``sqla_jobs.alembic_templates``).

``sqla_jobs/`` is an ``alembic init`` template: ``sqla-jobs migrations init DIR``
uses it, or ``alembic init -t "$(sqla-jobs migrations template-path)" DIR``.
Its ``script.py.mako`` is also what ``sqla-jobs migrations render`` writes
revisions with in projects made from it.
"""
