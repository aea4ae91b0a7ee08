"""alembic environment with sqla-jobs wired in (made by ``sqla-jobs migrations init``)."""

from logging.config import fileConfig

from alembic import context
from sqlalchemy import create_engine, pool

from sqla_jobs.alembic import app_metadata, configure_options, database_url

config = context.config
if config.config_file_name is not None:
    # Keep loggers that already exist (the app's, sqla-jobs') working when migrations run in-process.
    fileConfig(config.config_file_name, disable_existing_loggers=False)

# Your models' MetaData: the one your JobMixin/DeadJobMixin classes and your
# other models share. By default, the MetaData of the JobQueue named by
# `sqla_jobs.app` in alembic.ini (or SQLA_JOBS_APP). Once you have your own
# models, replace this with e.g.:
#     from myapp.models import Base
#     target_metadata = Base.metadata
target_metadata = app_metadata(config)


def run_migrations_offline() -> None:
    """Write SQL to stdout (``alembic upgrade head --sql``) without a database."""
    context.configure(
        url=database_url(config),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        **configure_options(target_metadata),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Migrate the database at SQLA_JOBS_URL or sqlalchemy.url."""
    engine = create_engine(database_url(config), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            **configure_options(target_metadata),
        )
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
