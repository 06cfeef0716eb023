"""A user's own data, model and reward, end to end: the shipped word problems (JSONL), an HF model
folder made with transformers (random weights of a Llama-3.1-style model with llama3 RoPE scaling, or a
Qwen3-style one with q/k norms, and a BPE tokenizer with a chat template) and a reward function given
by import path, trained for two iterations through the real Dask cluster; the saved versions load
back in transformers."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flows.config import load_config
from flows.loop import run
from storage.run_folder import RunFolder

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[2] / "data" / "word_problems.jsonl"
_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
             "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
             "{%- endif %}")
_REWARD = '''
    import re


    def boxed_number(prompt: str, completion: str, answer: str) -> float:
        """1 for the right number in the completion, 0.25 for any other number, else 0."""
        numbers = re.findall(r"-?[0-9]+", completion)
        return 1.0 if answer in numbers else 0.25 if numbers else 0.0
'''


def _model_config(kind: str, vocab_size: int, eos: int, pad: int):
    """A tiny random-weight config of a real family: Llama 3.1 (llama3 RoPE scaling) or Qwen3 (q/k norms)."""
    sizes = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                 eos_token_id=eos, pad_token_id=pad)
    if kind == "llama3.1":
        return transformers.LlamaConfig(**sizes, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
    return transformers.Qwen3Config(**sizes, head_dim=8)


def _model_folder(root: Path, kind: str) -> Path:
    folder = root / "my-model"
    folder.mkdir()
    texts = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": _TEMPLATE}))
    config = _model_config(kind, tok.get_vocab_size(), tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("kind", ["llama3.1", "qwen3"])
def test_train_on_my_jsonl_model_and_reward(tmp_path, monkeypatch, kind):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(_REWARD))
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver checks the reward when the config loads
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # workers and the reward process import it too
    model = _model_folder(tmp_path, kind)
    cfg = load_config(None, [
        "run_name=byo", f"runs_dir={tmp_path / 'runs'}", "iterations=2",
        "dataset.kind=jsonl", f"dataset.path={DATA}", "dataset.max_prompt_tokens=96", "dataset.overflow=truncate",
        f"model.path={model}", "reward.functions=[my_rewards:boxed_number]", "reward.timeout_s=20",
        "task.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
        "train.micro_batch_size=8", "train.lr=1e-2",
        *(["dataset.system_prompt=Show your work."] if kind == "qwen3" else [])])
    summary = run(cfg, progress=False)
    assert summary.iterations == 2

    folder = RunFolder.at(tmp_path / "runs", "byo")
    store = folder.rollout_store()
    texts = [json.loads(line) for line in DATA.read_text().splitlines()]
    for step in (0, 1):
        a = store.read(step, "reward", "reward_failed", "prompt_len", "group_id")
        assert not a["reward_failed"].any()
        assert set(np.unique(a["reward"])) <= {0.0, 0.25, 1.0}
        assert np.all(a["prompt_len"] <= 96)
    # The rollout saw the chat-templated prompt, decoded here by transformers' own tokenizer.
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder.policy_store().ref(0).path)
    first = store.read(0, "prompt_ids", "prompt_len", stop=1)
    shown = hf_tok.decode(first["prompt_ids"][0, : first["prompt_len"][0]].tolist())
    system = "<|im_start|>system\nShow your work.<|im_end|>\n" if kind == "qwen3" else ""
    assert shown.startswith(system + "<|im_start|>user\n") and shown.endswith("<|im_start|>assistant\n")
    assert any(t["prompt"][:40] in shown for t in texts)

    v2 = folder.policy_store().ref(2)
    assert (Path(v2.path) / "tokenizer_config.json").is_file()  # the version is a whole HF folder
    loaded = transformers.AutoModelForCausalLM.from_pretrained(v2.path)
    base = transformers.AutoModelForCausalLM.from_pretrained(model)
    moved = [name for name, p in loaded.state_dict().items() if not torch.equal(p, base.state_dict()[name])]
    assert moved, "two GRPO steps left every weight of the user's model unchanged"
    ids = torch.tensor([[1, 2, 3]])
    assert torch.isfinite(loaded(ids).logits).all()


def test_the_notebooks_explore_a_run_of_my_model(tmp_path, monkeypatch):
    """The quickstart and the rollout explorer pointed at a run folder of an HF model (its own
    tokenizer, chat template and system prompt) instead of training the tiny run."""
    from test_notebook import _text, execute

    model = _model_folder(tmp_path, "qwen3")
    cfg = load_config(None, [
        "run_name=mine", f"runs_dir={tmp_path / 'runs'}", "iterations=2", "dataset.kind=jsonl", f"dataset.path={DATA}",
        "dataset.max_prompt_tokens=96", "dataset.overflow=truncate", "dataset.system_prompt=Show your work.",
        f"model.path={model}", "reward.functions=[last_number]", "task.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=8", "train.micro_batch_size=8"])
    run(cfg, progress=False)
    monkeypatch.setenv("GRPOFLOW_NOTEBOOK_RUN_DIR", str(tmp_path / "runs" / "mine"))
    quick = _text(execute("quickstart.ipynb", passes_per_kernel=(1,))[0])
    assert "exploring" in quick and "checked 2 steps" in quick and "Show your work" not in quick
    explored = _text(execute("rollout_explorer.ipynb", passes_per_kernel=(1,))[0])
    assert "published steps [0, 1]" in explored and "checked 2 steps, 8 groups, 32 samples" in explored
    assert "Show your work" not in explored and "<|im_start|>" not in explored  # the user's own prompt text
    assert any(json.loads(line)["prompt"][:30] in explored for line in DATA.read_text().splitlines())
