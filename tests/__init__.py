"""The test suite (python -m pytest -q)."""

# XLA flags of every process the tests start: tests compile far more than they compute (tiny
# configs, every bucket of every runner compiled at start), so LLVM's backend optimisations are
# off (the HLO passes, and so every result's arithmetic, are the same; only the machine code is
# less tuned). Measured on a 2-core EPYC: tests/test_core.py 82 -> 56 s.
COMPILE_FAST = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
