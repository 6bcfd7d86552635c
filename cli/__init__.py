"""``grok-runner``: the command (``python run.py`` is the same command).

    grok-runner [generate] [--prompt TEXT] ...   stream continuations (the default subcommand)
    grok-runner serve [--checkpoint DIR] ...     the OpenAI-compatible HTTP server
    grok-runner convert SRC DST                  a checkpoint (ckpt-0/ with --config, Hugging Face) to the native format
    grok-runner plan --preset grok-1 --mesh 1,8  the per-device memory plan

``cli/main.py`` dispatches; each subcommand's flags come from one table (``cli/flags.py``), and
``grok-runner SUBCOMMAND --help`` lists them. Without ``--checkpoint`` the model shipped with the package is used.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # a start's phases count from here (imports included)
