#!/usr/bin/env bash
# The GPU checks in one command, for a machine with an NVIDIA GPU and a Python that has torch (CUDA) and Lightning:
# `pytest -m gpu` and the GPU benchmark (`benchmarks/stall.py --device cuda`). Wheels of this package and of what the
# machine lacks (zfec, tenacity, torchdata) go in .whl/ first (`pip wheel --no-deps -w .whl .` and `pip download`),
# and are installed into /tmp/site; outputs go to $OUT (default: ./gpu-out). Time limits: BENCH_S, PYTEST_S (s).
#   METHODS=ours-agent,ours-local,dcp BENCH_S=300 PYTEST_S=170 bash scripts/gpu_check.sh
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
set -o pipefail
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, lightning, sys; print(sys.version.split()[0], torch.__version__, lightning.__version__, torch.cuda.get_device_name())"
df -h /dev/shm /tmp | tail -2
T1=$(date +%s)
timeout ${BENCH_S:-240} python3 benchmarks/stall.py --device cuda --quick --no-restore --methods ${METHODS:-ours-agent,ours-local,torch-save,async-io,dcp} --json $OUT/stall_gpu.json 2>&1 | tee $OUT/stall.log | tail -80
echo "bench took $(( $(date +%s) - T1 )) s"
T0=$(date +%s)
timeout ${PYTEST_S:-200} python3 -m pytest -p no:cacheprovider -m gpu -q -n ${NPROC:-10} -rA --tb=short tests/test_gpu.py 2>&1 | grep -v -i benchmark > $OUT/pytest.log; tail -40 $OUT/pytest.log
echo "pytest took $(( $(date +%s) - T0 )) s"
