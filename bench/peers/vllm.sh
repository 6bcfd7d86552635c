#!/usr/bin/env bash
# Start the vLLM CPU peer in the foreground. Usage: [VLLM_DTYPE=bfloat16] vllm.sh [PORT]   (default 8101; float32)
PORT="${1:-8101}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}"
export VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-/tmp/peers/vllm-cache}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/peers/torchinductor-cache}"
export TMPDIR="${TMPDIR_PEERS:-/tmp/peers/tmp}"  # keeps torch/inductor temp files under /tmp/peers
exec /tmp/peers/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \
  --model /tmp/peers/hf-mixtral --dtype "${VLLM_DTYPE:-float32}" \
  --max-num-seqs 8 --max-model-len 2048 \
  --kv-cache-memory-bytes "${VLLM_KV_CACHE_BYTES:-1073741824}" \
  --host 127.0.0.1 --port "$PORT"
