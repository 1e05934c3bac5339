#!/bin/sh
# Installs OpenBLAS on Debian/Ubuntu when it is missing, so MLX's CPU matmuls are fast.
# Never fails the build: without it base still runs, only slower (`base doctor` says so).
[ "$(uname -s)" = "Linux" ] || exit 0
for lib in /usr/lib/*/openblas-pthread/libopenblas.so.0 /usr/lib/*/libopenblas.so.0 /usr/lib64/libopenblas.so.0; do
  [ -f "$lib" ] && exit 0
done
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
  echo "installing libopenblas0-pthread (fast float32 matmul for MLX's CPU backend)"
  apt-get update -qq >/dev/null 2>&1
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 \
    || echo "warning: could not install libopenblas0-pthread; base will run on the slow reference BLAS"
else
  echo "warning: no OpenBLAS found; install libopenblas0-pthread (or your system's OpenBLAS) for ~40x faster CPU matmuls"
fi
exit 0
