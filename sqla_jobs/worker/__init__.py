"""The worker (internal): the control loop and its parts. ``Worker`` and ``AsyncWorker`` are public through
``sqla_jobs``; the map of the parts is in docs/development.md ("The worker's parts")."""
