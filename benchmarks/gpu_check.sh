#!/usr/bin/env bash
# The GPU measurements issue 12 still owes, as one prepared run on a lent GPU machine.
# Here, from the project root: ../shared/gpu/prepare.sh (wheels and tokenizer into .gpu/).
# There, with .gpu carried, one call per line, most wanted first (each well under the
# 10-minute limit of a call; estimates, not yet timed on a GPU):
#   bash benchmarks/gpu_check.sh "llm cluster"    # issue 12's targets (~4 min)
#   bash benchmarks/gpu_check.sh sweep            # the decode kernel's launch options (~4 min)
#   bash benchmarks/gpu_check.sh tests            # the suite, natively (~5 min)
# Steps:
#   tests    the suite but the slow tests, 4 pytest workers sharing the GPU ($TESTS: a selection)
#   llm      nano-vllm's workload (Qwen3-0.6B shape, 256 requests, prompts and outputs of
#            100-1024 tokens) through LLM, lockstep then async scheduling, same process
#   cluster  launch.py + throughput_bench over ZMQ, lockstep then async: output tok/s and
#            rank 0's idle share while it waits for the EngineCore (target <= 3 %)
#   sweep    the Triton decode launch (tile width, warps, stages, splits) on that workload's
#            decode mix (256 decodes, contexts 100-2048), against the default; then the
#            same with the longest contexts dispatched first
#   profile  one decode step at 256 running: wall time, host phases, top GPU kernels
# Logs land in $OUT.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .gpu/whl/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$(pwd)
G=$(pwd)/.gpu Q=/tmp/qwen3-0.6b
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
git log --oneline -1 2>/dev/null
python3 -c "import sys; sys.path.insert(0, '$G'); from gpu_bench import make; make('qwen3-0.6b')"

stop_cluster() {  # $1: launch.py's pid; its roles run with --parent-pid of it
  kill -INT $1 2>/dev/null
  for _ in $(seq 40); do kill -0 $1 2>/dev/null || break; sleep 1; done
  kill -0 $1 2>/dev/null && echo "--- cluster still up 40 s after SIGINT: killed"
  pkill -KILL -f -- "--parent-pid $1 "; kill -KILL $1 2>/dev/null; wait $1
}

cluster_run() {  # $1: --async-scheduling or --no-async-scheduling
  rm -f /tmp/addr
  python3 launch.py --model $Q --dtype bfloat16 --no-api --address-file /tmp/addr "$1" \
    > "$OUT/cluster$1.log" 2>&1 &
  local pid=$!
  for _ in $(seq 150); do [ -s /tmp/addr ] && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
  [ -s /tmp/addr ] || { echo "--- cluster $1 did not start"; tail -20 "$OUT/cluster$1.log"; stop_cluster $pid; return; }
  echo "--- cluster $1"
  timeout 120 python3 -m benchmarks.throughput_bench --address /tmp/addr --num-requests 256 \
    --prompt-len 100 1024 --output-len 100 1024 2>&1 | tail -5
  stop_cluster $pid
}

for s in ${1:-tests}; do
  echo "=== $s $(date +%T)"
  case $s in
    tests)
      # -v: one line per test as it ends, so a run cut off by the timeout still tells
      timeout ${TESTS_TIMEOUT:-500} python3 -m pytest -v -p no:cacheprovider -m "not slow" -n 4 \
        --timeout 150 ${TESTS:-tests} > "$OUT/tests.log" 2>&1
      echo "$(grep -c " PASSED " "$OUT/tests.log") passed so far"
      grep -E " (FAILED|ERROR) |^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -40 ;;
    llm)
      timeout 240 python3 -m benchmarks.throughput_bench --mode llm --compare-async --model $Q \
        --dtype bfloat16 --num-requests 256 --prompt-len 100 1024 --output-len 100 1024 \
        --max-model-len 4096 2>&1 | tee "$OUT/llm.log" | grep -v -E "^(INFO|WARNING)" | tail -14 ;;
    cluster)
      cluster_run --no-async-scheduling
      cluster_run --async-scheduling ;;
    sweep)
      timeout 200 python3 -m benchmarks.attention_bench --sweep --decodes 256 \
        --context 100 2048 --heads 16 --kv-heads 8 --head-dim 128 --threads 16 \
        --sweep-block-n 16 32 64 --sweep-warps 2 4 8 --sweep-stages 2 3 \
        --sweep-targets 256 4096 2>&1 | tail -60
      echo "--- the same decodes, longest context first"
      timeout 60 python3 -m benchmarks.attention_bench --sweep --longest-first --decodes 256 \
        --context 100 2048 --heads 16 --kv-heads 8 --head-dim 128 --threads 16 \
        --sweep-block-n 32 64 --sweep-warps 4 --sweep-stages 2 3 2>&1 | tail -6 ;;
    profile)
      timeout 200 python3 "$G/gpu_profile.py" 2>&1 | grep -v -E "Writing|Loading" \
        | tee "$OUT/profile.log" | tail -40 ;;
  esac
done
echo "=== done $(date +%T)"
