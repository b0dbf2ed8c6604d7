#!/usr/bin/env bash
# A Triton other than the GPU machine's own (its torch 2.11 pins Triton 3.6) for the device tool's
# calls, stripped to fit their 64 MiB carry limit beside .whl: libtriton.so without its symbols, no
# AMD backend, no profiler libraries, no Blackwell ptxas (~49 MB as an xz tar for 3.8.0; the wheel is
# 237 MB). Usage, from the repository root where pip has an index:
#   bash benchmarks/triton_bundle.sh 3.8.0     # -> .tri/triton-3.8.0.tar.xz (~2 minutes; ignore /.tri/)
# then each call carries [".whl", ".tri"], and benchmarks/device_env.sh unpacks it into /tmp/tri-VERSION
# and puts it first on PYTHONPATH. Why 3.8: torch 2.14's Triton, the first whose Gluon releases a ring
# slot across the CTAs of a cluster (docs/performance.md, "TMA multicast in the Triton of torch 2.12
# to 2.14"; benchmarks/proto_multicast.py). One bundle at a time: an older one is removed.
set -euo pipefail
version=${1:?usage: bash benchmarks/triton_bundle.sh VERSION (e.g. 3.8.0)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
  -d "$tmp/whl" "triton==$version"
mkdir -p "$tmp/site" && unzip -q "$tmp"/whl/*.whl -d "$tmp/site"
t=$tmp/site/triton
rm -rf "$t"/backends/amd "$t"/backends/nvidia/lib/cupti* "$t"/instrumentation "$t"/_C/libproton.so \
  "$t"/backends/nvidia/bin/ptxas-blackwell "$t"/backends/nvidia/bin/cuobjdump "$t"/backends/nvidia/bin/nvdisasm
strip --strip-unneeded "$t"/_C/libtriton.so
mkdir -p .tri && rm -f .tri/triton-*.tar.xz
XZ_OPT="-9 -T0" tar cJf ".tri/triton-$version.tar.xz" -C "$tmp/site" triton
grep -qx '/.tri/' .git/info/exclude 2>/dev/null || echo "note: add /.tri/ to .git/info/exclude"
ls -la .tri
