#!/usr/bin/env bash
# nccl-tests on the node, and its -J document through `nccltune import`: build all_reduce_perf from
# its source against the NCCL the node's torch loads, run it, import what it wrote, and show it in
# history, report and compare beside a sweep's run; then nccltune's own document of that sweep.
#   SRC=<nccl-tests source> OUT=/tmp/x bash bench/gpu_nccl_tests_import.sh
set -u
SRC=${SRC:-.nccl-tests-src}
OUT=${OUT:-/tmp/nccltune-nccl-tests}
STATE=${STATE:-/tmp/nccltune-nccl-tests-state}
BUILD=${BUILD:-/tmp/nccl-tests-build}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_env.sh"
[ -x .venv-node/bin/nccltune ] || bash bringup.sh --plan >/dev/null 2>&1
NT=.venv-node/bin/nccltune

step "the NCCL torch loads, and a CUDA compiler"
nccl_dir=$(.venv-node/bin/python -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])' 2>/dev/null)
echo "NCCL package: ${nccl_dir:-not found}"; ls "$nccl_dir/include" "$nccl_dir/lib" 2>&1 | head
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc); "$nvcc" --version | tail -2
# The wheel ships libnccl.so.2 only: a link-time name for -lnccl, in a directory of our own.
home=/tmp/nccl-home; rm -rf "$home"; mkdir -p "$home/lib"; ln -s "$nccl_dir/include" "$home/include"
ln -s "$nccl_dir/lib/libnccl.so.2" "$home/lib/libnccl.so"; ln -s "$nccl_dir/lib/libnccl.so.2" "$home/lib/libnccl.so.2"

step "build all_reduce_perf (sm_90)"
s0=$(date +%s)
make -C "$SRC/src" -j16 BUILDDIR="$BUILD" NCCL_HOME="$home" CUDA_HOME="$(dirname "$(dirname "$nvcc")")" \
  NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" "$BUILD/all_reduce_perf" > "$OUT/build.log" 2>&1
echo "rc=$? $(( $(date +%s) - s0 )) s"; tail -3 "$OUT/build.log"

step "all_reduce_perf -g 1 -J"
LD_LIBRARY_PATH="$home/lib:${LD_LIBRARY_PATH:-}" "$BUILD/all_reduce_perf" -b 4K -e 64M -f 4 -g 1 -w 5 -n 20 \
  -J "$OUT/all_reduce_perf.json" 2>&1 | tail -15
head -c 1500 "$OUT/all_reduce_perf.json"; echo

step "nccltune import"
$NT import "$OUT/all_reduce_perf.json" --state-dir "$STATE" 2>&1; echo "rc=$?"
$NT import "$OUT/all_reduce_perf.json" --state-dir "$STATE" --json > "$OUT/import.json" 2>&1; echo "rc=$? (again, --json)"
head -c 800 "$OUT/import.json"; echo
step "history, report --run 1"
$NT history --state-dir "$STATE" 2>&1; $NT report --run 1 --state-dir "$STATE" 2>&1 | head -20
step "compare 1 2"
$NT compare 1 2 --state-dir "$STATE" 2>&1 | head -20; echo "rc=$?"
step "report --format nccl-tests-json --run 1, imported again"
$NT report --format nccl-tests-json --run 1 --state-dir "$STATE" > "$OUT/reexport.json" 2>"$OUT/reexport.err"; echo "rc=$?"
cat "$OUT/reexport.err"; $NT import "$OUT/reexport.json" --state-dir "$STATE" 2>&1 | tail -3
$NT compare 1 3 --state-dir "$STATE" 2>&1 | head -12
step done
