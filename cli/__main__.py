"""``python -m cli``: the ``grok-runner`` command."""

import sys

from cli.main import main

sys.exit(main())
