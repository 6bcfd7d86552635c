"""The test suite (python -m pytest -q)."""

# XLA flags of every process the tests start: tests compile far more than they compute (tiny
# configs, a runner's steps and many small checks), so LLVM's backend optimisations are off (the
# HLO passes, and so every result's arithmetic, are the same; only the machine code is less
# tuned; measured on a 2-core EPYC: tests/test_core.py 82 -> 56 s), and fusions are emitted by
# XLA:CPU's elemental IR emitter rather than its MLIR fusion emitters, which take twice as long
# to compile a small program (2-core Xeon, 2026-12-05: 42 -> 22 ms a small check, 833 -> 523 ms
# the tiny model's forward, lowering included); the tests' tolerances and exact equalities (both
# sides compiled alike) hold as before.
COMPILE_FAST = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false")
