"""``python -m tangram_hpc``: the ``tangram-hpc`` command, for a Python whose scripts are not on PATH."""
from .cli import main

raise SystemExit(main())
