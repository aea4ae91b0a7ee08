"""MariaDB/MySQL: ``driver`` holds ``MySQLDriver``; ``schema`` how it stores the job tables, ``stats`` its
aggregate queries, ``bench`` what the bench asks of it."""

from .driver import MySQLDriver
from .schema import JSONText

__all__ = ["JSONText", "MySQLDriver"]
