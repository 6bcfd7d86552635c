"""One process of the 2-process test: 4 CPU devices here, a (2, 4) mesh over both processes."""

import json
import os
import sys

process_id, num_processes, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import COMPILE_FAST  # noqa: E402

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 " + COMPILE_FAST
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id)

from tests.test_sharding import multihost_case  # noqa: E402

tokens = multihost_case()
with open(out, "w") as f:
    json.dump({"process": jax.process_index(), "devices": jax.device_count(), "tokens": tokens}, f)
