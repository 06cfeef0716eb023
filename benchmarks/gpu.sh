#!/usr/bin/env bash
# The GPU checks, as one prepared script for a lent GPU machine (one H200; 15 minutes of device time
# in all, a machine's start included). From the repository root, through the device tool:
#
#   run(command="bash benchmarks/gpu.sh", timeout_s=360)
#
# which leaves room for one rerun (each step below has its own cap; they add up to 340 s). It uses that machine's own python3 (its CUDA PyTorch and
# transformers) and installs nothing; the flows' packages (Dask, Zarr, MLflow, OmegaConf) are not
# there, so it runs what needs torch and the stages only:
#   1. the rollout engine's and the training rank's tests, the CUDA ones included
#      (tests/stages/test_rollout_placement.py, test_train_placement.py: one rank's step on the GPU
#      against the host's), without loading tests/conftest.py as a plugin (its fixtures need the flows);
#   2. decode tokens/s of the engine against transformers' generate (sampling, with the scores a
#      rollout needs), bfloat16, at 16 and 128 prompts x G 8, skewed and fixed lengths, and the
#      decode matmul rate (benchmarks/rollout.py);
#   3. one training rank's step on the GPU, float32 and bfloat16 autocast, beside the CPU
#      (benchmarks/gpu_train_step.py: the tiny config's and the bench shape's step);
#   4. speculative decoding, k = 2 and 4, at 16 prompts.
# On the GPU the matmul reference of step 2 is the decode shapes' GEMMs one after another, launch-
# bound at this model size: read its "% of matmul" as a bound on launch overhead, not a roofline.
# Everything it prints also goes to $OUT/gpu.log (the device tool brings $OUT back).
set -uo pipefail
OUT=${OUT:-/tmp/grpoflow-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests PYTHONUNBUFFERED=1  # tests/: the helpers' `from conftest import ...`
PY=${PY:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.get_device_name())"
  echo "== 1. rollout engine and training rank tests (CUDA included)"
  "$PY" -c "import pytest" || echo "no pytest for $PY on this machine: step 1 cannot run"
  timeout 100 "$PY" -m pytest -q --noconftest -p no:cacheprovider -rs \
    tests/stages/test_rollout_placement.py tests/stages/test_rollout_engine.py tests/stages/test_train_placement.py
  echo "== 2. decode: engine vs transformers, bfloat16"
  timeout 70 "$PY" benchmarks/rollout.py --device cuda --dtype bfloat16 --reps 3 --only skewed --prompts 16 --prompts 128
  timeout 60 "$PY" benchmarks/rollout.py --device cuda --dtype bfloat16 --reps 2 --only fixed --prompts 16 --prompts 128
  echo "== 3. one training rank's step: GPU and CPU"
  timeout 70 "$PY" benchmarks/gpu_train_step.py --reps 5
  echo "== 4. speculative decoding"
  timeout 40 "$PY" benchmarks/rollout.py --device cuda --dtype bfloat16 --only speculative --no-hf --prompts 16
} 2>&1 | tee "$OUT/gpu.log"
