"""``python -m sqla_jobs.cli``: the same as the ``sqla-jobs`` command."""

import sys

from .main import main

sys.exit(main())
