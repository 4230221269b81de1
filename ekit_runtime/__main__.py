"""``python -m ekit_runtime``: the ``ekit`` command line (see :mod:`ekit_runtime.cli`)."""

from ekit_runtime.cli import main

raise SystemExit(main())
