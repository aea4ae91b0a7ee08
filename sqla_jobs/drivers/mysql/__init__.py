"""MariaDB/MySQL: ``driver`` holds ``MySQLDriver``; ``stats`` its aggregate queries."""

from .driver import JSONText, MySQLDriver

__all__ = ["JSONText", "MySQLDriver"]
