#!/usr/bin/env bash
# Produce the shipped MetaSchedule logs of the tensor-core PIT matmul on the H100.
#
# Here, once (downloads the cp312 wheels of psutil, cloudpickle, tqdm that MetaSchedule and
# the progress bar need into .gpu/tunedeps, ignored by git like the rest of .gpu/):
#     bash benchmarks/tune_h100.sh --prepare
# On the warm GPU machine (TVM unpacked, see ../shared/gpu/README.md), carrying
# [".gpu/rest", ".gpu/tunedeps"]:
#     source .gpu/rest/activate.sh && bash benchmarks/tune_h100.sh
# Writes $OUT/tuning_logs.tar.gz (the two JSON database files per shape, the KEEP=16 fastest
# records of each, to unpack into the repo root: tuning_logs/<gpu>/[wgmma_]matmul[_RxC]_k*_n*_float16/),
# $OUT/tuning_run_logs.tar.gz (the full databases and MetaSchedule's per-trial logs) and
# $OUT/tune_summary.json.
# Shapes/trials/targets/micro-tiles: SIZES="4096 8192" TRIALS="64 64" TARGETS="cuda cuda:sm_90"
# MICRO_TILES="rows" (cuda: the wgmma kernels' spaces of at most 16 / 32 configs; cuda:sm_90: the
# mma.sync schedules', about 2-3 min of device time per shape; MICRO_TILES="32x64 32x1 1x64": the
# tiles kinds' kernels, logs [wgmma_]matmul_RxC_k*_n*_float16/).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
if [ "${1:-}" = "--prepare" ]; then
  mkdir -p .gpu/tunedeps
  grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  python3 -m pip download -q --no-deps -d .gpu/tunedeps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 psutil cloudpickle tqdm
  ls -la .gpu/tunedeps
  exit 0
fi
OUT="${OUT:-$root/out}"
mkdir -p "$OUT"
if ! python3 -c "import psutil, cloudpickle, tqdm" 2>/dev/null; then
  if ls .gpu/tunedeps/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /opt/tunedeps .gpu/tunedeps/*.whl
    export PYTHONPATH="/opt/tunedeps${PYTHONPATH:+:$PYTHONPATH}"
  fi
  python3 -c "import psutil, cloudpickle" || { echo "psutil/cloudpickle missing: carry .gpu/tunedeps"; exit 3; }
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader 2>/dev/null || true
SIZES=${SIZES:-"4096 8192"}
TRIALS=${TRIALS:-"64 64"}
TARGETS=${TARGETS:-"cuda cuda:sm_90"}
MICRO_TILES=${MICRO_TILES:-"rows"}
# MetaSchedule prints a table per iteration; keep the output tail readable
python3 benchmarks/tune_h100.py --sizes $SIZES --trials $TRIALS --targets $TARGETS --micro-tiles $MICRO_TILES --out "$OUT" 2>&1 \
  | grep -v "^\s*$" | grep -v "XGB iter\|^ *[0-9]* | main \|^---\|^ ID | Name\|Total trials\|Total latency"
rc=${PIPESTATUS[0]}
if [ -d "$OUT/work/tuning_logs" ]; then
  tar -C "$OUT/work" -czf "$OUT/tuning_run_logs.tar.gz" tuning_logs
  # the shipped databases keep their KEEP fastest records (the working tree travels with every
  # GPU call under a size limit; the full ones are in tuning_run_logs.tar.gz)
  python3 -c "import sys; from pathlib import Path; from pit_tvm.tuning.tune import trim_log
for d in Path(sys.argv[1]).glob('*/*/'): print(d.name, 'dropped', trim_log(d, int(sys.argv[2])))" \
      "$OUT/work/tuning_logs" "${KEEP:-16}"
  tar -C "$OUT/work" -czf "$OUT/tuning_logs.tar.gz" --exclude=logs tuning_logs
  rm -rf "$OUT/work"
fi
ls -la "$OUT"
exit $rc
