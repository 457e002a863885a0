"""Tokenizer: a `tokenizers.Tokenizer` plus the model's special ids and chat template.

Built from a GGUF file's `tokenizer.*` metadata (byte-level BPE only) or from a Hugging Face folder
(`tokenizer.json` and its configs). Chat templates render the way transformers renders them.
"""

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Self

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
import tokenizers
from gguf import TokenType
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from inferno.loader.gguf_file import GGUFFile

# split regexes of llama.cpp's `tokenizer.ggml.pre` flavours, as in the models' own tokenizer.json
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX_BY_PRE = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen"], _QWEN2_SPLIT),
}
# flavours that cut every digit off on its own, then apply GPT-2's regex
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "codeshell"}
# control tokens that end a turn even when the file names another eos (llama.cpp treats them the same way)
_END_OF_TURN_TOKENS = {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"}


class DecodeStream:
    """Text deltas for token ids arriving one at a time; bytes of an unfinished character are held back."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        return self._stream.step(self._tokenizer, token_id)


class Tokenizer:
    """Text <-> token ids, the ids that end generation, and the chat template of one model."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        eos_token_ids: set[int],
        chat_template: str | None,
        vocab_size: int | None = None,
    ):
        """`vocab_size`: one more than the largest token id, when known (else read from the vocabulary, a
        noticeable cost on large vocabularies)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size or max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.eos_token_ids = eos_token_ids | ({eos_token_id} if eos_token_id is not None else set())
        special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
        self.all_special_ids = special | {i for i in (bos_token_id, eos_token_id) if i is not None}
        self.chat_template = chat_template

    @classmethod
    def from_gguf(cls, source: str | GGUFFile) -> Self:
        """From a GGUF path, or from a file the model loader has already opened."""
        gguf_file = GGUFFile(source) if isinstance(source, str) else source
        meta = {key.removeprefix("tokenizer."): value for key, value in gguf_file.fields.items()}
        model = meta.get("ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"GGUF tokenizer.ggml.model is {model!r}, but only byte-level BPE ('gpt2') vocabularies "
                "are supported from GGUF so far; load the model's Hugging Face folder (with tokenizer.json) instead"
            )
        tokens: list[str] = meta["ggml.tokens"]
        token_types = meta.get("ggml.token_type")
        token_types = np.full(len(tokens), TokenType.NORMAL) if token_types is None else np.asarray(token_types)
        pre = meta.get("ggml.pre", "default")
        bpe = models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=[tuple(merge.split(" ", 1)) for merge in meta.get("ggml.merges", [])],
            ignore_merges=_SPLIT_REGEX_BY_PRE.get(pre) is _LLAMA3_SPLIT,
        )
        tokenizer = tokenizers.Tokenizer(bpe)
        tokenizer.pre_tokenizer = _gguf_pre_tokenizer(pre)
        tokenizer.decoder = decoders.ByteLevel()
        # added tokens keep their ids: their text is already a key of the BPE vocab
        control = [tokens[i] for i in np.flatnonzero(token_types == TokenType.CONTROL)]
        user_defined = [tokens[i] for i in np.flatnonzero(token_types == TokenType.USER_DEFINED)]
        tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in control])
        tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in user_defined])

        bos_token_id, eos_token_id = meta.get("ggml.bos_token_id"), meta.get("ggml.eos_token_id")
        _set_bos_eos(
            tokenizer,
            bos_token_id if meta.get("ggml.add_bos_token", False) else None,
            eos_token_id if meta.get("ggml.add_eos_token", False) else None,
        )
        eos_token_ids = {meta[key] for key in ("ggml.eot_token_id", "ggml.eom_token_id") if key in meta}
        eos_token_ids |= {tokenizer.token_to_id(token) for token in _END_OF_TURN_TOKENS.intersection(control)}
        return cls(
            tokenizer,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            eos_token_ids=eos_token_ids,
            chat_template=meta.get("chat_template"),
            vocab_size=len(tokens),  # GGUF token ids are the positions in the token list
        )

    @classmethod
    def from_hf_folder(cls, path: str) -> Self:
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(
                f"{path} has no tokenizer.json; only fast tokenizers are supported. Write one with transformers: "
                "AutoTokenizer.from_pretrained(path).save_pretrained(path)"
            )
        tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer_config = _read_json(folder / "tokenizer_config.json")
        generation_config = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")

        def token_id(name: str) -> int | None:
            if name in tokenizer_config:  # a string, an AddedToken dict, or null for "this model has none"
                token = tokenizer_config[name]
                token = token["content"] if isinstance(token, dict) else token
                return None if token is None else tokenizer.token_to_id(token)
            ids = _as_ids(generation_config.get(f"{name}_id", model_config.get(f"{name}_id")))
            return ids[0] if ids else None

        bos_token_id = token_id("bos_token")
        eos_token_id = token_id("eos_token")
        if "add_bos_token" in tokenizer_config or "add_eos_token" in tokenizer_config:
            # an explicit flag overrides tokenizer.json's post-processor, as transformers 4 did for Llama
            _set_bos_eos(
                tokenizer,
                bos_token_id if tokenizer_config.get("add_bos_token") else None,
                eos_token_id if tokenizer_config.get("add_eos_token") else None,
            )
        eos_token_ids = set(_as_ids(generation_config.get("eos_token_id", model_config.get("eos_token_id"))))
        return cls(
            tokenizer,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            eos_token_ids=eos_token_ids,
            chat_template=_hf_chat_template(folder, tokenizer_config),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The `tokenizers` tokenizer serialized (tokenizer.json), for libraries that build their own from it."""
        return self._tokenizer.to_str()

    def id_to_token(self, i: int) -> str:
        return self._tokenizer.decode([i], skip_special_tokens=False)

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        return DecodeStream(self._tokenizer, skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **kwargs: Any,
    ) -> str:
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (no tokenizer.chat_template in the GGUF, no chat_template in "
                "tokenizer_config.json or chat_template.jinja); send a plain prompt instead of chat messages"
            )
        special_tokens = {
            name: self._tokenizer.id_to_token(i)
            for name, i in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id))
            if i is not None
        }
        variables = {"documents": None, **special_tokens, **kwargs}
        return _compile_chat_template(self.chat_template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLIT_REGEX_BY_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEX_BY_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2


def _set_bos_eos(tokenizer: tokenizers.Tokenizer, bos_token_id: int | None, eos_token_id: int | None) -> None:
    """Make `encode(add_special_tokens=True)` put BOS before and EOS after the text (None: nothing there)."""
    bos = [] if bos_token_id is None else [tokenizer.id_to_token(bos_token_id)]
    eos = [] if eos_token_id is None else [tokenizer.id_to_token(eos_token_id)]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=[*bos, "$A", *eos],
        pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
        special_tokens=list(zip(bos + eos, [i for i in (bos_token_id, eos_token_id) if i is not None])),
    )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _as_ids(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _hf_chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile_chat_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
