# alembic configuration made by `sqla-jobs migrations init` (sqla-jobs template).

[alembic]
# Where env.py and versions/ live.
script_location = ${script_location}
# The project folder goes on sys.path, so env.py can import your models.
prepend_sys_path = .
path_separator = os

# The database to migrate; the SQLA_JOBS_URL environment variable wins when set.
sqlalchemy.url = sqlite:///app.db

# Your JobQueue as module:attr (SQLA_JOBS_APP wins when set). env.py migrates
# the MetaData of its models until you point target_metadata at your own Base.
sqla_jobs.app =

[loggers]
keys = root,sqlalchemy,alembic

[handlers]
keys = console

[formatters]
keys = generic

[logger_root]
level = WARNING
handlers = console
qualname =

[logger_sqlalchemy]
level = WARNING
handlers =
qualname = sqlalchemy.engine

[logger_alembic]
level = INFO
handlers =
qualname = alembic

[handler_console]
class = StreamHandler
args = (sys.stderr,)
level = NOTSET
formatter = generic

[formatter_generic]
format = %(levelname)-5.5s [%(name)s] %(message)s
datefmt = %H:%M:%S
