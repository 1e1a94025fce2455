#!/usr/bin/env bash
# Build llama.cpp (llama-server, llama-batched-bench) from the source bundled in the
# llama-cpp-python sdist, under $KVSERVE_PEERS. Idempotent; exits 3 if it cannot be built.
source "$(dirname "$0")/common.sh"
BUILD="$LLAMA_CPP_DIR/build"
# NOTE: with -march=native on a CPU that has AMX (Sapphire Rapids and later), ggml compiles its
# AMX matmul path, and at version 0.3.36 that path segfaults on this model's Q4_1 tensors
# (gdb: ggml_backend_amx_mul_mat, right after "llama threadpool init"). Explicit -mno-amx-*
# flags win over -march=native in GCC, so the build keeps AVX-512/VNNI and drops only AMX.
# The stamp makes a build made with other flags rebuild.
CPU_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
STAMP="$BUILD/.kvserve-build-flags"
mkdir -p "$LLAMA_CPP_DIR"
exec 9> "$LLAMA_CPP_DIR/.install.lock"
flock 9  # NOTE: a second caller waits for a build in progress instead of racing it
if [ ! -x "$BUILD/bin/llama-server" ] || [ ! -x "$BUILD/bin/llama-batched-bench" ] \
    || [ "$(cat "$STAMP" 2>/dev/null)" != "$CPU_FLAGS" ]; then
  rm -rf "$BUILD"
  SRC="$LLAMA_CPP_DIR/src"
  mkdir -p "$SRC"
  if [ ! -d "$SRC/llama_cpp_python-$LLAMA_CPP_PY_VERSION" ]; then
    echo "[peers] fetching the llama-cpp-python==$LLAMA_CPP_PY_VERSION sdist" >&2
    "$KVSERVE_PY" -m pip download -q --no-deps --no-binary :all: \
      "llama-cpp-python==$LLAMA_CPP_PY_VERSION" -d "$SRC" || {
      echo "[peers] cannot fetch llama.cpp sources; skipping llama.cpp" >&2; exit 3; }
    tar -xzf "$SRC/llama_cpp_python-$LLAMA_CPP_PY_VERSION.tar.gz" -C "$SRC"
  fi
  echo "[peers] building llama.cpp (about 12 minutes on 2 cores, niced)" >&2
  if ! { nice -n 19 cmake -S "$SRC/llama_cpp_python-$LLAMA_CPP_PY_VERSION/vendor/llama.cpp" \
      -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
      -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$CPU_FLAGS" -DCMAKE_CXX_FLAGS="$CPU_FLAGS" \
      >/dev/null \
    && nice -n 19 cmake --build "$BUILD" -j2 --target llama-batched-bench llama-server; }; then
    echo "[peers] llama.cpp build failed on this machine; skipping llama.cpp" >&2
    exit 3
  fi
  echo "$CPU_FLAGS" > "$STAMP"
fi
version="$("$BUILD/bin/llama-server" --version 2>&1 | grep -m1 -i version | tr -d '\r' || true)"
record_version llama.cpp "py$LLAMA_CPP_PY_VERSION ${version:-unknown}"
echo "llama.cpp ($version) at $BUILD/bin"
