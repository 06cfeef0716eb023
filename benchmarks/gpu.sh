#!/usr/bin/env bash
# The GPU checks, as one prepared script for a lent GPU machine (one H200; 15 minutes of device time
# in all, a machine's start included). From the repository root, through the device tool:
#
#   run(command="bash benchmarks/gpu.sh", timeout_s=600, carry=[".whl"])
#
# (each step below has its own cap; they add up to 600 s; on an H200 steps 1-5 took 239 s). It uses
# that machine's own python3 (its CUDA PyTorch and transformers). Steps 1-4 need torch and the stages
# only; step 5 needs the flows' packages (Dask, Zarr, MLflow, OmegaConf), which that machine
# lacks and cannot download: carry them as wheels in .whl/ (ignored by git; `bash benchmarks/gpu.sh
# --download` fills it here, where PyPI is reachable), and the script installs them into /tmp/site.
#   1. the rollout engine's and the training rank's tests, the CUDA ones included
#      (tests/stages/test_rollout_placement.py, test_train_placement.py: one rank's step on the GPU
#      against the host's), without loading tests/conftest.py as a plugin (its fixtures need the flows);
#   2. decode tokens/s of the engine against transformers' generate (sampling, with the scores a
#      rollout needs), bfloat16, at 16 and 128 prompts x G 8, skewed and fixed lengths, and the
#      decode matmul rate (benchmarks/rollout.py); the engine holds every row at once, as generate
#      does (--max-num-seqs 0), and once more at the default of 256 live sequences (128 x 8 rows in
#      4 waves) for comparison;
#   3. one training rank's step on the GPU, float32 and bfloat16 autocast, beside the CPU
#      (benchmarks/gpu_train_step.py: the tiny config's and the bench shape's step);
#   4. speculative decoding, k = 2 and 4, at 16 prompts;
#   5. whole tiny iterations on the GPU: benchmarks/iteration.py, grpoflow (PP 1: one GPU is one
#      training rank; its engine on the same GPU) against the single-process loop on the same GPU,
#      both float32; then the same with one microbatch of all 512 rows (train.micro_batch_size=512),
#      the loop's own shape: on a GPU every microbatch costs its kernel launches whatever its size.
# On the GPU the matmul reference of step 2 is the decode shapes' GEMMs one after another, launch-
# bound at this model size: read its "% of matmul" as a bound on launch overhead, not a roofline.
# Everything it prints also goes to $OUT/gpu.log (the device tool brings $OUT back).
set -uo pipefail
# The flows' packages, pinned to what the CPU set-up installs, for that machine's Python 3.12 (the
# packages its image already has are left out).
WHEELS="dask==2026.8.0 distributed==2026.8.0 zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0
tornado==6.6.1 partd==1.4.2 locket==1.0.0 tblib==3.2.2 zict==3.0.0 omegaconf==2.4.0 mlflow-skinny==3.17.2
sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3 greenlet==3.5.6 pydantic==2.14.4 pydantic-core==2.50.5
annotated-types==0.8.0 typing-inspection==0.4.5 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 databricks-sdk==0.167.0 google-auth==2.63.0
cryptography==50.0.2 cffi pycparser pyasn1==0.6.5 pyasn1-modules==0.4.2 fastapi==0.165.0 starlette==1.10.0
uvicorn==0.55.0 python-dotenv==1.2.4 gitpython==3.2.1 gitdb==4.0.12 smmap==5.0.3 sqlparse==0.6.1 cachetools==7.3.3
importlib-metadata==9.1.0"
if [ "${1:-}" = --download ]; then
  mkdir -p .whl
  # shellcheck disable=SC2086
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl $WHEELS
fi
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
  timeout 70 "$PY" benchmarks/rollout.py --device cuda --dtype bfloat16 --max-num-seqs 0 --reps 3 --only skewed \
    --prompts 16 --prompts 128
  timeout 60 "$PY" benchmarks/rollout.py --device cuda --dtype bfloat16 --max-num-seqs 0 --reps 2 --only fixed \
    --prompts 16 --prompts 128
  echo "-- the engine's default cap of 256 live sequences at 128 prompts x G 8 (4 waves), for comparison"
  timeout 30 "$PY" benchmarks/rollout.py --device cuda --dtype bfloat16 --reps 1 --only fixed --no-hf --prompts 128
  echo "== 3. one training rank's step: GPU and CPU"
  timeout 70 "$PY" benchmarks/gpu_train_step.py --reps 5
  echo "== 4. speculative decoding"
  timeout 40 "$PY" benchmarks/rollout.py --device cuda --dtype bfloat16 --only speculative --no-hf --prompts 16
  echo "== 5. whole tiny iterations on the GPU: grpoflow (PP 1) against the loop, float32"
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site:$PYTHONPATH
  fi
  if "$PY" -c "import dask, distributed, zarr, mlflow, omegaconf"; then
    timeout 150 "$PY" benchmarks/iteration.py --scenario tiny --reps 2 --iterations 8 --device cuda \
      train.pipeline_model_parallel_size=1 rollout.num_engines=1 train.device=cuda rollout.dtype=float32
    timeout 80 "$PY" benchmarks/iteration.py --scenario tiny --reps 1 --iterations 8 --device cuda \
      train.pipeline_model_parallel_size=1 rollout.num_engines=1 train.device=cuda rollout.dtype=float32 \
      train.micro_batch_size=512
  else
    echo "the flows' packages are not there (no .whl/ carried): step 5 cannot run"
  fi
} 2>&1 | tee "$OUT/gpu.log"
