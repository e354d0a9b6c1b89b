#!/usr/bin/env bash
# Sets up the llama.cpp CPU peer once under $PEERS_DIR/llamacpp (default: ~/.cache/splitserve-peers):
#   venv/  llama-cpp-python[server] built from source (its OpenAI server: one sequence at a time)
#   build/bin/llama-server  llama.cpp's own server (continuous batching, --parallel N), built
#                           with cmake from the same vendored llama.cpp source as the wheel
# About 15 minutes on 2 cores the first time; a no-op after that.
# compare_llamacpp.py runs llama-cpp-python on build/bin's libraries (LLAMA_CPP_LIB_PATH), so
# both peers run one ggml build.
#   setup_llamacpp.sh [--print-python | --print-server | --print-lib | --print-version]
set -e
VERSION=0.3.36
P=${PEERS_DIR:-$HOME/.cache/splitserve-peers}/llamacpp
PY=$P/venv/bin/python SERVER=$P/build/bin/llama-server
case "$1" in
  --print-python) echo "$PY"; exit 0 ;;
  --print-server) echo "$SERVER"; exit 0 ;;
  --print-lib) echo "$P/build/bin"; exit 0 ;;
  --print-version) echo "$VERSION"; exit 0 ;;
esac
JOBS=${JOBS:-$(nproc)}
# This CPU's ISA without AMX: ggml's AMX matmul (in 0.3.36's llama.cpp) dies on its first
# ldtilecfg here (SIGILL/SIGSEGV), in both the wheel and llama-server.
ISA="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
grep -q avx512f /proc/cpuinfo && ISA="$ISA -DGGML_AVX512=ON"
for f in avx512_vbmi avx512_vnni avx512_bf16 avx_vnni; do
  grep -q "$f" /proc/cpuinfo && ISA="$ISA -DGGML_$(echo "${f/avx512_/AVX512_}" | tr a-z A-Z)=ON"
done
mkdir -p "$P"
if ! { [ -x "$PY" ] && "$PY" -c "import llama_cpp.server" 2>/dev/null; }; then
  python3 -m venv "$P/venv" && "$P/venv/bin/pip" install -q -U pip
  CMAKE_ARGS="-DLLAVA_BUILD=OFF $ISA" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
    "$P/venv/bin/pip" install -q "llama-cpp-python[server]==$VERSION"
fi
if [ ! -x "$SERVER" ] || ! grep -q "GGML_NATIVE:BOOL=OFF" "$P/build/CMakeCache.txt"; then
  SRC=$P/src/llama_cpp_python-$VERSION
  if [ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]; then
    "$P/venv/bin/pip" download -q --no-deps --no-binary :all: -d "$P/src" "llama-cpp-python==$VERSION"
    tar xzf "$P/src/llama_cpp_python-$VERSION.tar.gz" -C "$P/src"
  fi
  cmake -S "$SRC/vendor/llama.cpp" -B "$P/build" -DCMAKE_BUILD_TYPE=Release $ISA \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
  cmake --build "$P/build" --target llama-server -j "$JOBS" >/dev/null
fi
"$PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
"$SERVER" --version 2>&1 | head -1
