"""``python -m memguard``: the same as the ``memguard`` command."""
from memguard.cli import main

raise SystemExit(main())
