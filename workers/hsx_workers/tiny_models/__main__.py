"""`python -m hsx_workers.tiny_models`: see cli.py."""

from hsx_workers.tiny_models.cli import main

raise SystemExit(main())
