"""``python -m sandboxq``: the command line (``sandboxq.cli``)."""

from sandboxq.cli import main

raise SystemExit(main())
