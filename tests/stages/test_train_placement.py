"""Where the training ranks compute: train.device / train.dtype, bfloat16 autocast against its
single-process reference, and CUDA where present.

Needs torch and the stages only (no Zarr, Dask or MLflow), so benchmarks/gpu.sh runs it with
``--noconftest`` on a GPU machine that has none of the flows' packages.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_decoder_config, make_model, make_rollout_arrays
from stages.config import ConfigError, TrainConfig
from stages.policy import hf_named_parameters, hf_state
from stages.train.batch import build_global_batch
from stages.train.engine import TrainSetup, cuda_layout_error, train_placement
from stages.train.local import run_local_pipeline
from stages.train.loss import LossConfig, grpo_microbatch_loss, token_logp

LOSS = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.1, temperature=0.9)
_CUDA = torch.cuda.is_available()


def _batch(model):
    arrays = make_rollout_arrays(model, num_groups=4, group_size=4, prompt_width=5, max_new_tokens=6)
    return build_global_batch(arrays, "token-mean", 0)


def _reference(model, batch, autocast: torch.dtype | None, device: str = "cpu"):
    """Single-process full-batch gradient (HF names, on the host) and log-probs, the forward under
    torch.autocast in ``autocast`` (None: float32)."""
    model = model.to(device)
    model.zero_grad(set_to_none=True)
    kwargs = {k: v.to(device) for k, v in batch.stage_kwargs().items()}
    with torch.autocast(torch.device(device).type, dtype=autocast or torch.float32, enabled=autocast is not None):
        out = model(batch.input_ids.to(device), **kwargs)
    loss, _ = grpo_microbatch_loss(out, batch.target.to(device), LOSS)
    loss.backward()
    grads = {n: p.grad.detach().cpu().clone() for n, p in hf_named_parameters(model)}
    with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=autocast or torch.float32,
                                         enabled=autocast is not None):
        logp = token_logp(model(batch.input_ids.to(device), **kwargs), batch.target[..., 0].to(device), LOSS.temperature)
    model.to("cpu")
    return grads, logp.float().cpu()


def _merged(outputs, call: int) -> dict[str, torch.Tensor]:
    got = {}
    for out in outputs:
        assert out.errors[call] is None, out.errors[call]
        got.update(out.grads[call])
    return got


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_placement_rules():
    assert train_placement("cpu", "float32", 3, 4) == (torch.device("cpu"), None)
    assert train_placement("cpu", "bfloat16", 0, 2) == (torch.device("cpu"), torch.bfloat16)
    if not _CUDA:
        assert train_placement("auto", "float32", 0, 2) == (torch.device("cpu"), None)
        with pytest.raises(ValueError, match="train.device=cuda but torch .* sees no CUDA device"):
            train_placement("cuda", "float32", 0, 1)
    with pytest.raises(ValueError, match="train.device='tpu'"):
        train_placement("tpu", "float32", 0, 1)
    with pytest.raises(ValueError, match="train.dtype='float16'"):
        TrainSetup(model=make_decoder_config(), pipeline_parallel_size=2, num_microbatches=2, dtype="float16")
    for bad in ({"device": "gpu"}, {"dtype": "fp16"}):
        with pytest.raises(ConfigError, match=f"train.{next(iter(bad))}="):
            TrainConfig(**bad)
    # Looped virtual stages send every microbatch of a stage before receiving for the next: not on NCCL.
    assert "interleaved-1f1b with virtual_pipeline_model_parallel_size=2" in cuda_layout_error("interleaved-1f1b", 2)
    assert cuda_layout_error("1f1b", 1) is None and cuda_layout_error("zbv", 2) is None


@pytest.mark.parametrize("chunk_tokens", [None, 4])
def test_bfloat16_pipeline_matches_its_single_process_autocast_reference(chunk_tokens):
    """PP 2 1F1B with train.dtype=bfloat16: the gradient and the reference pass's log-probs agree
    with one process running the same model's full batch under the same autocast, far more closely
    than either agrees with float32 (microbatching changes only which rows share a bfloat16 matmul),
    and they do differ from float32: the forwards ran in bfloat16. With chunk_tokens the head's
    forward runs in chunks under autocast too, but its hand-written backward (stages/train/loss.py)
    runs outside autocast, in float32: that gradient lies between the two references, within
    bfloat16's difference of the autocast one."""
    cfg = make_decoder_config()
    model = make_model(cfg)
    batch = _batch(model)
    g16, logp16 = _reference(model, batch, torch.bfloat16)
    g32, logp32 = _reference(model, batch, None)
    precision = _worst(g16, g32)
    assert precision > 1e-4  # bfloat16 rounding shows at this size
    setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=4, loss=LOSS, dtype="bfloat16",
                       logprob_chunk_tokens=chunk_tokens, timeout_s=60)
    outputs = run_local_pipeline(setup, hf_state(model), [batch, batch], calls=["grad", "reference"])
    got = _merged(outputs, 0)
    assert _worst(got, g16) < (precision / 4 if chunk_tokens is None else precision), (_worst(got, g16), precision)
    assert _worst(got, g32) > precision / 4  # not float32's gradient
    logp = [out.logps[1] for out in outputs if out.logps[1] is not None]
    assert len(logp) == 1
    assert (logp[0] - logp16).abs().max() < (logp16 - logp32).abs().max() / 4


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="torch sees no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_rank_on_cuda_matches_the_same_step_on_the_host(dtype):
    """PP 1 on the GPU (one GPU holds one rank: NCCL does not share a GPU between ranks): float32
    within 1e-5 of the host's single-process gradient, bfloat16 within a quarter of bfloat16's own
    difference from float32 of the GPU's single-process autocast gradient; the reference pass's
    log-probs likewise; the weights come back to the host after the optimiser step."""
    cfg = make_decoder_config()
    model = make_model(cfg)
    batch = _batch(model)
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    want, want_logp = _reference(model, batch, autocast, device="cuda")
    g32, logp32 = _reference(model, batch, None)
    setup = TrainSetup(model=cfg, pipeline_parallel_size=1, num_microbatches=4, loss=LOSS, device="cuda",
                       dtype=dtype, timeout_s=60)
    outputs = run_local_pipeline(setup, hf_state(model), [batch, batch, batch], calls=["grad", "reference", "train"])
    (out,) = outputs
    assert all(e is None for e in out.errors), out.errors
    tol = 1e-5 if autocast is None else max(_worst(want, g32) / 4, 1e-5)
    assert _worst(out.grads[0], want) <= tol
    assert (out.logps[1] - want_logp).abs().max() <= (1e-5 if autocast is None else
                                                      max((want_logp - logp32).abs().max().item() / 4, 1e-5))
    assert all(w.device.type == "cpu" for w in out.state.values())
    assert any((out.state[n] - w).abs().max() > 1e-6 for n, w in hf_state(model).items())
