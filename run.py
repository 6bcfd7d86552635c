"""``python run.py``: the ``grok-runner`` command from a checkout (``cli/``; ``python run.py --help``).

    python run.py                         # generate from the shipped model
    python run.py serve                   # the OpenAI-compatible server
    python run.py convert SRC DST --config grok-1
    python run.py plan --preset grok-1 --mesh 1,8
"""

import sys

from cli.main import main

if __name__ == "__main__":
    sys.exit(main())
