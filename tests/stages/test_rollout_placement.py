"""Where the engine runs: rollout.device / rollout.dtype, the engine in bfloat16, and on CUDA where present.

The CUDA tests (marked gpu) run only on a machine whose torch sees a GPU; everything else runs on
the CPU, the bfloat16 path included (the same code the CUDA engine runs, on another device). This
file and test_rollout_engine.py need torch and the stages only, so benchmarks/gpu.sh runs them
with ``--noconftest`` on a GPU machine that has none of the flows' packages.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.config import ConfigError, RolloutConfig
from stages.rollout.engine import engine_placement
from stages.rollout.speculative import draft_from_target, generate_speculative
from test_rollout_engine import completion, make_model, make_params, make_prompts, run

_CUDA = torch.cuda.is_available()
no_cuda = pytest.mark.skipif(_CUDA, reason="checks the refusal on a machine without CUDA")
_LOGP_ATOL = 1e-4  # float32 cached decode vs one full float32 forward (as tests/stages/test_rollout_engine.py)


def _full_logp(model, prompt: list[int], gen: list[int], temperature: float) -> torch.Tensor:
    """[len(gen), V] log-probs at the positions predicting ``gen`` after ``prompt``, under one full
    forward of ``model`` (no cache), on the host."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen], device=dev))[0, len(prompt) - 1: -1].float().cpu()
    return torch.log_softmax(logits / temperature, dim=-1)


def _errors(batch, prompts, params, model, other=None) -> tuple[float, float]:
    """Largest |behav_logp - full forward of ``model``| over the batch's sampled tokens, and largest
    |full forward of ``model`` - of ``other``| over every token of the vocabulary at those positions."""
    engine = between = 0.0
    G = params.group_size
    for row in range(len(prompts) * G):
        prompt, gen = prompts[row // G], completion(batch, row)
        full = _full_logp(model, prompt, gen, params.temperature)
        sampled = full[torch.arange(len(gen)), gen]
        engine = max(engine, (torch.from_numpy(batch.behav_logp[row, : len(gen)]) - sampled).abs().max().item())
        if other is not None:
            between = max(between, (full - _full_logp(other, prompt, gen, params.temperature)).abs().max().item())
    return engine, between


def test_placement_spellings():
    assert engine_placement("cpu", "auto") == (torch.device("cpu"), torch.float32)
    assert engine_placement("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    assert engine_placement("auto", "auto") == ((torch.device("cuda"), torch.bfloat16) if _CUDA
                                                else (torch.device("cpu"), torch.float32))
    with pytest.raises(ValueError, match="rollout.device='tpu'"):
        engine_placement("tpu")
    with pytest.raises(ValueError, match="rollout.dtype='int8'"):
        engine_placement("cpu", "int8")
    for bad in ({"device": "gpu"}, {"device": "cuda:x"}, {"dtype": "fp8"}):
        with pytest.raises(ConfigError, match=f"rollout.{next(iter(bad))}="):
            RolloutConfig(**bad)


@no_cuda
def test_cuda_without_a_gpu_is_refused_before_the_run_starts():
    from flows.config import load_config
    from flows.preflight import PreflightError, check_devices

    with pytest.raises(ValueError, match="sees no CUDA device"):
        engine_placement("cuda")
    cfg = load_config("configs/tiny.yaml", ["rollout.device=cuda"])
    with pytest.raises(PreflightError, match="rollout.device='cuda' but torch .* sees no CUDA device") as err:
        check_devices(cfg)
    assert "\n" not in str(err.value)
    with pytest.raises(PreflightError, match="train.device=cuda but torch"):
        check_devices(load_config("configs/tiny.yaml", ["train.device=cuda"]))
    check_devices(load_config("configs/tiny.yaml", ["train.device=auto"]))  # auto: the CPU here


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bfloat16_engine_adds_only_rounding(seed):
    """In bfloat16 the cached decode (hand-written attention over the paged views) and one full
    bfloat16 forward of the same tokens (SDPA, no cache) round differently, each within about the
    dtype's error d of float32 (the largest log-prob difference between the bfloat16 and float32
    models at those positions): they agree within 2 d. The logic is the float32 engine's, checked
    to 1e-4 in tests/stages/test_rollout_engine.py; this checks that bfloat16 adds only rounding."""
    f32 = make_model(seed=seed)
    bf16 = make_model(seed=seed).to(torch.bfloat16)
    prompts = make_prompts(lengths=(3, 6, 1, 17, 20), seed=seed)
    params = make_params(temperature=0.7, stop_ids=(5,), max_new_tokens=20)
    batch = run(bf16, prompts, params)
    assert batch.behav_logp.dtype == np.float32
    engine_error, dtype_error = _errors(batch, prompts, params, bf16, f32)
    assert 1e-3 < dtype_error < 1.0  # the models do differ, by rounding only
    assert engine_error <= 2 * dtype_error, (engine_error, dtype_error)
    # The KV cache is kept in the model's dtype: half the bytes of float32's, block for block.
    assert 2 * batch.kv_pool_bytes == run(f32, prompts, params).kv_pool_bytes


def test_bfloat16_speculative_decoding_records_the_targets_log_probs():
    target = make_model(seed=3).to(torch.bfloat16)
    draft = draft_from_target(target, 1)
    assert next(draft.parameters()).dtype == torch.bfloat16  # the target's dtype
    prompts = make_prompts(lengths=(3, 6, 1, 17, 20), seed=3)
    params = make_params(temperature=0.7, stop_ids=(5,), max_new_tokens=20)
    batch, stats = generate_speculative(target, draft, prompts, params, torch.Generator().manual_seed(0),
                                        num_draft_tokens=2)
    assert stats.drafted > 0 and batch.length.min() >= 1
    engine_error, dtype_error = _errors(batch, prompts, params, target, make_model(seed=3))
    assert engine_error <= 2 * dtype_error, (engine_error, dtype_error)


@pytest.mark.parametrize("dtype, speculative", [(torch.float32, False), (torch.bfloat16, False),
                                                 (torch.bfloat16, True)])
@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="torch sees no CUDA device")
def test_engine_on_cuda(dtype, speculative):
    """On the GPU: float32 within the CPU test's tolerance of a full forward, bfloat16 within twice
    its error against float32 (as on the CPU above)."""
    f32 = make_model(seed=0).cuda()
    model = make_model(seed=0).to(device="cuda", dtype=dtype)
    prompts = make_prompts(lengths=(3, 6, 1, 17, 20))
    params = make_params(temperature=0.7, stop_ids=(5,), max_new_tokens=20)
    if speculative:
        batch, _ = generate_speculative(model, draft_from_target(model, 1), prompts, params,
                                        torch.Generator().manual_seed(0), num_draft_tokens=2)
    else:
        batch = run(model, prompts, params)
    engine_error, dtype_error = _errors(batch, prompts, params, model, f32)
    assert engine_error <= (_LOGP_ATOL if dtype == torch.float32 else 2 * dtype_error), engine_error
