"""TextCodec over a real HF tokenizer folder, checked against transformers' AutoTokenizer on small
BPE tokenizers built here (Llama-3-style with a chat template, Qwen2-style without BOS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from stages.policy.tokenizer import TextCodec, TokenizerFolderError
from stages.tasks.addition import make_tokenizer_json

import transformers  # a test dependency: these parity tests fail, never skip, without it

_SENTENCES = [
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "A train travels 120 km in 2 hours; what is its speed in km per hour?",
    "The answer is 7. Think step by step and put the answer in a box.",
    "Émilie paid $12.50 for 5 pencils, so each pencil costs $2.50.",
]
_LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>"]
# Llama-3's template, shortened (no tools, no dated system prompt).
_LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
_QWEN_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)


def _train_bpe(specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_SENTENCES, trainer)
    return tok


def _write(folder: Path, name: str, obj: dict) -> None:
    (folder / name).write_text(json.dumps(obj))


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama3_tok")
    tok = _train_bpe(_LLAMA_SPECIALS)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(str(folder / "tokenizer.json"))
    _write(folder, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>", "model_max_length": 8192, "clean_up_tokenization_spaces": True,
        "chat_template": _LLAMA_TEMPLATE})
    _write(folder, "special_tokens_map.json", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    _write(folder, "generation_config.json", {
        "bos_token_id": bos, "eos_token_id": [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]})
    return folder


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2_tok")
    tok = _train_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    _write(folder, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": _QWEN_TEMPLATE})
    return folder


def _hf_ids(result) -> list[int]:
    return list(result["input_ids"] if hasattr(result, "keys") else result)


@pytest.mark.parametrize("folder_name", ["llama_folder", "qwen_folder"])
def test_ids_and_template_equal_transformers(folder_name, request):
    folder = request.getfixturevalue(folder_name)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    plain = TextCodec.from_folder(folder, use_chat_template=False)
    chat = TextCodec.from_folder(folder)
    for text in _SENTENCES + ["  leading spaces, 1,234.5 and ünïcödé  "]:
        assert plain.encode_prompt(text) == _hf_ids(hf(text))
        assert plain.encode(text) == _hf_ids(hf(text, add_special_tokens=False))
        messages = [{"role": "user", "content": text}]
        rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert chat.render_prompt(text) == rendered
        assert chat.encode_prompt(text) == _hf_ids(
            hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
        ids = plain.encode(text)
        assert plain.decode(ids + [plain.eos_id]) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("folder_name", ["llama_folder", "qwen_folder"])
def test_decode_prompt_gives_back_the_user_text(folder_name, request):
    """The sample tables show a prompt as it was asked, not wrapped in the chat template (a system
    prompt and role markers first); a prompt without a template decodes as before."""
    folder = request.getfixturevalue(folder_name)
    chat, plain = TextCodec.from_folder(folder), TextCodec.from_folder(folder, use_chat_template=False)
    for text in _SENTENCES + ["What is 23 + 58? Answer with only the number."]:
        ids = chat.encode_prompt(text)
        assert chat.decode(ids) != text.strip() and chat.decode_prompt(ids) == text
        assert plain.decode_prompt(plain.encode_prompt(text)) == plain.decode(plain.encode_prompt(text))
    other = chat.encode("no template here")  # ids the template did not make: decoded whole
    assert chat.decode_prompt(other) == chat.decode(other)


def test_llama_specials_come_from_the_config_files(llama_folder):
    codec = TextCodec.from_folder(llama_folder)
    tok = Tokenizer.from_file(str(llama_folder / "tokenizer.json"))
    eot, end = tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|end_of_text|>")
    assert codec.bos_id == tok.token_to_id("<|begin_of_text|>")
    assert codec.eos_ids == (eot, end)  # tokenizer_config's eos first, then generation_config's
    assert codec.pad_id == eot  # no pad token: falls back to eos
    assert codec.encode_prompt("hi")[0] == codec.bos_id
    assert codec.encode_prompt("hi").count(codec.bos_id) == 1  # the template writes BOS once


def test_qwen_has_no_bos_and_its_own_pad(qwen_folder):
    codec = TextCodec.from_folder(qwen_folder)
    tok = Tokenizer.from_file(str(qwen_folder / "tokenizer.json"))
    assert codec.bos_id is None
    assert codec.eos_ids == (tok.token_to_id("<|im_end|>"),)
    assert codec.pad_id == tok.token_to_id("<|endoftext|>")


def test_folder_errors_name_the_file_and_key(tmp_path, llama_folder):
    with pytest.raises(TokenizerFolderError, match="tokenizer.json: not found"):
        TextCodec.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text((llama_folder / "tokenizer.json").read_text())
    _write(tmp_path, "tokenizer_config.json", {"eos_token": "</s>"})
    with pytest.raises(TokenizerFolderError, match=r"eos_token='</s>' is not in"):
        TextCodec.from_folder(tmp_path)
    _write(tmp_path, "tokenizer_config.json", {})
    with pytest.raises(TokenizerFolderError, match="no eos token"):
        TextCodec.from_folder(tmp_path)


def test_builtin_tokenizer_still_prepends_bos():
    codec = TextCodec.from_json(make_tokenizer_json())
    assert codec.encode_prompt("12+34=") == [codec.bos_id] + codec.encode("12+34=")
    assert codec.eos_ids == (codec.eos_id,)


@pytest.mark.parametrize("folder_name", ["llama_folder", "qwen_folder"])
def test_system_prompt_and_messages_lists_render_as_transformers_does(folder_name, request):
    """dataset.system_prompt goes first as a system message; a messages-list prompt renders as given
    (its own system message kept); the sample table still shows the user's text."""
    folder = request.getfixturevalue(folder_name)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    system = "Answer with the number only."
    codec = TextCodec.from_policy_folder(folder, system_prompt=system)
    text = _SENTENCES[0]
    with_system = [{"role": "system", "content": system}, {"role": "user", "content": text}]
    assert codec.encode_prompt(text) == _hf_ids(hf.apply_chat_template(with_system, tokenize=True,
                                                                      add_generation_prompt=True))
    assert codec.encode_prompt(text) != TextCodec.from_policy_folder(folder).encode_prompt(text)
    assert codec.decode_prompt(codec.encode_prompt(text)) == text
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "4"}, {"role": "user", "content": text}]
    assert codec.encode_prompt(turns) == _hf_ids(hf.apply_chat_template(turns, tokenize=True,
                                                                       add_generation_prompt=True))


def test_messages_list_records_are_read_checked_and_encoded(tmp_path, llama_folder):
    from stages.data import DatasetConfig, DatasetError, open_prompt_source

    turns = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
             {"role": "user", "content": "And 2+3?"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ({"prompt": turns, "answer": 5}, {"prompt": "7+1?", "answer": 8})))
    codec = TextCodec.from_folder(llama_folder)
    records = open_prompt_source(DatasetConfig(kind="jsonl", path=str(path), shuffle=False), codec, 2).records(0)
    assert [r.prompt for r in records] == ["And 2+3?", "7+1?"]  # rewards get the last user turn as prompt=
    assert records[0].prompt_ids == tuple(codec.encode_prompt(turns)) and records[0].answer == "5"
    for bad, message in [([], "is an empty list of messages"),
                         ([{"role": "user"}], r"message 0 is not \{\"role\": str, \"content\": str\}"),
                         ([{"role": "tool", "content": "x"}], "message 0 has role 'tool'"),
                         (turns[:2], "ends in a 'assistant' message")]:
        path.write_text(json.dumps({"prompt": bad, "answer": 1}) + "\n")
        with pytest.raises(DatasetError, match=r"chat.jsonl:line 1: field 'prompt' " + message):
            open_prompt_source(DatasetConfig(kind="jsonl", path=str(path)), codec, 1)
    path.write_text(json.dumps({"prompt": turns, "answer": 1}) + "\n")
    with pytest.raises(DatasetError, match="line 1: a messages-list prompt needs a chat template"):
        open_prompt_source(DatasetConfig(kind="jsonl", path=str(path)), TextCodec.from_json(make_tokenizer_json()), 1)
    with pytest.raises(DatasetError, match="dataset.system_prompt is empty"):
        DatasetConfig(kind="jsonl", path=str(path), system_prompt=" ")


def test_system_prompt_without_a_template_goes_before_the_text(llama_folder):
    plain = TextCodec.from_folder(llama_folder, use_chat_template=False)
    told = TextCodec.from_policy_folder(llama_folder, use_chat_template=False, system_prompt="Be brief.")
    text = _SENTENCES[1]
    assert told.encode_prompt(text) == plain.encode_prompt(f"Be brief.\n\n{text}")
    assert told.decode_prompt(told.encode_prompt(text)) == text
