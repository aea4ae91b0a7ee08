"""PostgreSQL, the production backend: ``driver`` holds ``PostgreSQLDriver``; the other modules are its parts
(the claim, limits, LISTEN/NOTIFY, keepalives, the partitioned table, vacuum, the bench's statements)."""

from .driver import PostgreSQLDriver

__all__ = ["PostgreSQLDriver"]
