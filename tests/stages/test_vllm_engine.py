"""vLLM behind the rollout engine contract (stages/rollout/vllm_engine.py), against independent
references: the trainer's own forward on the same tokens, a fresh engine on the same version, and
the same call again. vLLM runs in its own environment (.venv-vllm, `make vllm`; `make test` builds
it): without it these tests fail, naming the fix, rather than skip.

One server is started for the module (about 10 s on the 2-core box), a second one for the
fresh-engine comparison."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from conftest import make_model
from stages.policy import DecoderConfig, hf_state, load_hf_state
from stages.rollout.contract import EngineError, PolicyVersionError, PolicyWeights, RolloutEngine
from stages.rollout.engine import FINISH_LENGTH, FINISH_STOP, SamplingParams
from stages.rollout.sampling import truncated_logprobs
from stages.rollout.vllm_engine import VLLMEngine, default_vllm_python
from stages.tasks.addition import make_tokenizer_json
from storage.model_folder import ModelFolderError
from storage.policies import PolicyStore

# vLLM's CPU attention takes head sizes of 32 and up: the smallest such Llama.
_CFG = dict(vocab_size=24, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_PROMPTS = [[1, 5, 7, 9, 11], [1, 6, 8], [1, 12, 13, 14, 15, 16, 17]]
# Log-probs of one token by two implementations in float32: vLLM's CPU kernels against the
# trainer's decoder (SmolLM2-135M: 5.4e-5 at most over 1,300 tokens, benchmarks/rollout.py).
_LOGP_ATOL = 2e-4


def _engine(**kw) -> VLLMEngine:
    python = default_vllm_python()
    assert os.path.exists(python), f"no vLLM environment at {python}: run `make vllm`"
    return VLLMEngine(max_model_len=32, max_num_seqs=16, timeout_s=300, **kw)


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Two policy versions of the small Llama, as published folders."""
    cfg = DecoderConfig(**_CFG)
    store = PolicyStore(tmp_path_factory.mktemp("vllm") / "policy")
    states = {v: hf_state(make_model(cfg, seed=v, std=0.3)) for v in (1, 2)}
    refs = {v: store.save_policy(v, cfg.to_hf(), make_tokenizer_json(), states[v]) for v in (1, 2)}
    return cfg, states, refs


@pytest.fixture(scope="module")
def served(versions):
    """A vLLM engine holding v1 (started on its folder)."""
    cfg, states, refs = versions
    engine = RolloutEngine(_engine())
    engine.load(PolicyWeights(1, refs[1].path, refs[1].sha256))
    yield engine
    engine.close()


def _trainer_logp(cfg: DecoderConfig, state: dict, prompt: list[int], completion: list[int], params) -> np.ndarray:
    """log-probs of ``completion`` after ``prompt`` under the trainer's decoder, through the
    distribution the sampler draws from (temperature, top-k, top-p)."""
    model = make_model(cfg)
    load_hf_state(model, state)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1])[None])[0, len(prompt) - 1: len(prompt) - 1 + len(completion)]
    logp = truncated_logprobs(logits, params.temperature, params.top_k, params.top_p)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0].numpy()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_behaviour_logprobs_are_the_trainers_own(versions, served, temperature, top_k, top_p):
    cfg, states, refs = versions
    params = SamplingParams(4, 6, temperature, top_p, stop_ids=(2,), pad_id=0, top_k=top_k)
    batch = served.generate(1, _PROMPTS, params, seed=11)
    assert batch.tokens.shape == (12, 6) and batch.policy_version == 1
    worst = 0.0
    for row in range(12):
        prompt, n = _PROMPTS[row // 4], int(batch.length[row])
        assert list(batch.prompt_ids[row, : batch.prompt_len[row]]) == prompt
        completion = batch.tokens[row, :n].tolist()
        assert 1 <= n <= 6 and (batch.tokens[row, n:] == 0).all() and (batch.behav_logp[row, n:] == 0).all()
        stopped = completion[-1] == 2
        assert batch.finish_reason[row] == (FINISH_STOP if stopped else FINISH_LENGTH)
        assert stopped or n == 6
        want = _trainer_logp(cfg, states[1], prompt, completion, params)
        worst = max(worst, float(np.abs(batch.behav_logp[row, :n] - want).max()))
    assert worst < _LOGP_ATOL, worst


def test_a_seeded_call_is_reproducible_and_seeds_differ(served):
    params = SamplingParams(4, 6, 1.0, stop_ids=(2,), pad_id=0)
    a, b = (served.generate(1, _PROMPTS, params, seed=3) for _ in range(2))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.behav_logp, b.behav_logp)
    c = served.generate(1, _PROMPTS, params, seed=4)
    assert not np.array_equal(a.tokens, c.tokens)
    # A prompt's G samples differ from each other (each its own seed).
    assert len({tuple(r) for r in a.tokens[:4]}) > 1


def test_the_version_is_checked_on_every_generate(served):
    params = SamplingParams(2, 3, stop_ids=(2,), pad_id=0)
    with pytest.raises(PolicyVersionError, match="asks for policy v2, the rollout engine holds v1"):
        served.generate(2, _PROMPTS, params, seed=0)


def test_an_in_memory_update_equals_a_fresh_engine_on_that_version(versions, served):
    """v2 loaded into the running server (from memory, then from its folder) generates what a
    server started on v2's folder generates, bit for bit; v1 again restores v1's samples."""
    cfg, states, refs = versions
    params = SamplingParams(4, 6, 1.0, stop_ids=(2,), pad_id=0)
    before = served.generate(1, _PROMPTS, params, seed=21)
    load = served.load(PolicyWeights(2, refs[2].path, refs[2].sha256, tensors=states[2]))
    assert load["weights_from"] == "memory" and served.backend.restarts == 0
    in_memory = served.generate(2, _PROMPTS, params, seed=21)
    served.load(PolicyWeights(1, refs[1].path, refs[1].sha256))
    again = served.generate(1, _PROMPTS, params, seed=21)
    np.testing.assert_array_equal(again.tokens, before.tokens)  # the prefix cache of v2 was dropped
    served.load(PolicyWeights(2, refs[2].path, refs[2].sha256))
    from_disk = served.generate(2, _PROMPTS, params, seed=21)
    fresh = RolloutEngine(_engine())
    try:
        fresh.load(PolicyWeights(2, refs[2].path, refs[2].sha256))
        reference = fresh.generate(2, _PROMPTS, params, seed=21)
    finally:
        fresh.close()
    assert not np.array_equal(in_memory.tokens, before.tokens)
    for got in (in_memory, from_disk):
        np.testing.assert_array_equal(got.tokens, reference.tokens)
        np.testing.assert_array_equal(got.behav_logp, reference.behav_logp)
    served.load(PolicyWeights(1, refs[1].path, refs[1].sha256))


def test_a_killed_server_is_started_again_on_the_version_it_held(versions, served):
    params = SamplingParams(4, 6, 1.0, stop_ids=(2,), pad_id=0)
    before = served.generate(1, _PROMPTS, params, seed=8)
    pid = served.backend.pid
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    after = served.generate(1, _PROMPTS, params, seed=8)
    assert served.backend.restarts == 1 and served.backend.pid != pid and served.version == 1
    assert after.metrics["engine_starts"] == 1 and after.metrics["engine_start_seconds"] > 0
    np.testing.assert_array_equal(after.tokens, before.tokens)
    np.testing.assert_array_equal(after.behav_logp, before.behav_logp)


def test_a_missing_environment_or_folder_is_one_line(tmp_path, versions):
    with pytest.raises(EngineError, match=r"no vLLM environment at /nowhere/python; run `make vllm`"):
        VLLMEngine(python="/nowhere/python", max_model_len=8)
    engine = RolloutEngine(_engine())
    try:
        with pytest.raises(ModelFolderError, match="no-such-folder"):
            engine.load(PolicyWeights(1, str(tmp_path / "no-such-folder")))
        assert engine.version is None
    finally:
        engine.close()


def test_more_prompt_tokens_than_one_scheduler_step_holds(versions):
    """Prompts whose prefill exceeds the scheduler's token budget are scheduled whole over several
    steps; a split prompt would make vLLM rewind its seeded CPU generator, which torch refuses
    ("CPU Generator does not use offset": the held-out evaluation of a SmolLM2 run met it)."""
    cfg, states, refs = versions
    engine = RolloutEngine(_engine(max_num_batched_tokens=32))
    try:
        engine.load(PolicyWeights(1, refs[1].path, refs[1].sha256))
        prompts = [[1] + [3 + (i + k) % 20 for k in range(9)] for i in range(12)]  # 120 prompt tokens
        params = SamplingParams(2, 4, 1.0, stop_ids=(2,), pad_id=0)
        batch = engine.generate(1, prompts, params, seed=5)
        assert batch.tokens.shape == (24, 4) and (batch.length >= 1).all()
        again = engine.generate(1, prompts, params, seed=5)
        np.testing.assert_array_equal(batch.tokens, again.tokens)
    finally:
        engine.close()
