"""One process of the 2-process server test: 4 CPU devices here, a (2, 4) mesh over both.
Process 0 serves HTTP on the given port; process 1 follows its rounds."""

import os
import sys

process_id, num_processes, port, http_port, tokenizer = sys.argv[1:6]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import COMPILE_FAST  # noqa: E402

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 " + COMPILE_FAST
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.distributed.initialize(f"127.0.0.1:{port}", int(num_processes), int(process_id))

from tests.test_server import multihost_runner  # noqa: E402

runner = multihost_runner(tokenizer)
if jax.process_index() == 0:
    from server import Server, serve_forever

    serve_forever(Server(runner, "multihost"), "127.0.0.1", int(http_port))
else:
    runner.engine.broadcast = True
    runner.engine.follow()
jax.distributed.shutdown()  # together: neither leaves the other's collectives hanging
print(f"process {jax.process_index()} done", flush=True)
