#!/usr/bin/env bash
# One GPU check for mpdl: on a machine with an NVIDIA GPU, in a few minutes,
#   1. installs CuPy from wheels (cupy-cuda12x) into the project's .venv,
#   2. runs the GPU test subset (every autograd op on the GPU against the CPU result; collectives on
#      CuPy arrays through host staging, since PyPI's MPICH is not CUDA-aware),
#   3. runs `mpdl bench allreduce --device gpu` with 1, 2 and 4 ranks sharing the GPU, and at
#      16-64 MiB with staging in 4 MiB chunks against whole messages,
#   4. runs `mpdl train --device gpu` on synthetic MNIST-shaped data, against the same run on CPU.
# Everything goes to one folder: $OUT if set, else gpu_check_out/.
# Without a GPU it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU on this machine; nothing to check" | tee "$out/summary.txt"
  exit 0
fi
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/gpu.txt"
make install >"$out/install.log" 2>&1 || { echo "make install failed"; exit 1; }
.venv/bin/pip install -q cupy-cuda12x >>"$out/install.log" 2>&1 || { echo "cupy install failed"; exit 1; }
py=.venv/bin/python
mpiexec=.venv/bin/mpiexec
status=0
step() { echo "== $1"; shift; timeout -k 5 "$@"; rc=$?; [ $rc -eq 0 ] || { echo "   failed: rc=$rc"; status=1; }; }

step "mpdl info" 60 .venv/bin/mpdl info --json >"$out/info.json"
step "GPU tests" 240 $py -m pytest -q -p no:cacheprovider -k "gpu or cupy or device" tests \
  --ignore=tests/mpi 2>&1 | tee "$out/tests.log" | tail -3
step "collectives on CuPy arrays, 2 ranks" 120 $mpiexec -n 2 $py -m mpi4py -m pytest -q --with-mpi \
  -p no:cacheprovider tests/mpi/test_gpu.py 2>&1 | tee "$out/tests_mpi.log" | tail -3
for n in 1 2 4; do
  step "bench allreduce --device gpu, $n ranks" 120 $mpiexec -n $n .venv/bin/mpdl bench allreduce \
    --device gpu -b 1K -e 64M -f 4 -n 10 -w 2 --algorithms ring,recursive_doubling,tree,mpi \
    --json "$out/bench_gpu_p$n.jsonl" 2>&1 | tee "$out/bench_gpu_p$n.txt" | tail -12
done
# Staging in chunks (the copies of one chunk overlap the transfer of another) against whole messages.
for chunk in 4194304 1073741824; do
  export MPDL_STAGING_CHUNK_BYTES=$chunk
  step "bench 16-64 MiB, 2 ranks, staging chunk $chunk B" 120 \
    $mpiexec -n 2 .venv/bin/mpdl bench allreduce --device gpu -b 16M -e 64M -f 2 -n 10 -w 2 \
    --algorithms recursive_doubling,ring --json "$out/bench_chunk_$chunk.jsonl" 2>&1 \
    | tee "$out/bench_chunk_$chunk.txt" | tail -5
done
unset MPDL_STAGING_CHUNK_BYTES
for device in cpu gpu; do
  step "train --device $device (lenet, synthetic MNIST, batch 256)" 150 .venv/bin/mpdl train \
    --device $device --model lenet --dataset synthetic --epochs 1 --global-batch-size 256 \
    --json "$out/train_$device.jsonl" 2>&1 | tee "$out/train_$device.txt" | tail -3
done
$py - "$out" <<'PY' | tee -a "$out/summary.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = {}
for device in ("cpu", "gpu"):
    path = out / f"train_{device}.jsonl"
    if path.exists():
        lines = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
        epochs = [l for l in lines if "samples_per_s" in l and "epoch" in l]
        if epochs:
            rows[device] = epochs[-1]["samples_per_s"]
for device, sps in rows.items():
    print(f"train lenet batch 256 on {device}: {sps:.0f} samples/s")
if len(rows) == 2:
    print(f"GPU / CPU: {rows['gpu'] / rows['cpu']:.2f}x")
PY
exit $status
