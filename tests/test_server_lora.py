"""Multi-LoRA serving through the official clients: a live server on 127.0.0.1 over a tiny llama with two adapters
from --lora-modules. Each route run with an adapter (the request's `model`) answers what the offline LLM answers
greedily with that adapter; adapters load and unload at run time; unknown names are 404s, bad loads 400s, and no
KV block leaks."""
import argparse
import json
import os

import anthropic
import httpx
import openai
import peft
import pytest
import torch
import transformers

from inferno import LLM, LoRARequest, SamplingParams
from inferno.entrypoints.cli import main
from inferno.server.cli_args import LoRAModulePath, lora_module
from test_server import RemoteServer
from tiny_lora import write_peft_adapter
from tiny_models import write_hf_model

BASE = "tiny-llama"
API_KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# byte-level tokens, so any text is a prompt; a template of our own (the tiny model has none)
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
QUESTION = "Name three primes."
MAX_TOKENS = 8
ENGINE_ARGS = dict(dtype="float32", kv_cache_dtype="float32", quantization=None, max_model_len=256,
                   kv_cache_memory=16 << 20, enable_lora=True, max_loras=2, max_lora_rank=16)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """The base model's folder and the adapters' (two served from the start, one loaded at run time, one too wide)."""
    root = tmp_path_factory.mktemp("server_lora")
    hf_model = write_hf_model(root / "base", "llama")
    config_path = root / "base" / "tokenizer_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"chat_template": CHAT_TEMPLATE}))
    write_peft_adapter(root / "sql", hf_model, 8, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=1)
    write_peft_adapter(root / "poet", hf_model, 4, ["gate_proj", "up_proj", "down_proj"], seed=2)
    write_peft_adapter(root / "late", hf_model, 16, ["q_proj", "v_proj", "up_proj"], seed=3)
    write_peft_adapter(root / "wide", hf_model, 32, ["q_proj"], seed=4)  # above --max-lora-rank
    return {name: str(root / name) for name in ("base", "sql", "poet", "late", "wide")}


@pytest.fixture(scope="module")
def server(files):
    os.environ["INFERNO_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # inherited by the server's process
    try:
        server = RemoteServer(
            "--model", files["base"], "--served-model-name", BASE, "--dtype", "float32", "--kv-cache-dtype",
            "float32", "--quantization", "none", "--max-model-len", "256", "--kv-cache-memory", str(16 << 20),
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
            "--lora-modules", f"sql={files['sql']}", json.dumps({"name": "poet", "path": files["poet"]}),
            api_key=API_KEY)
    finally:
        del os.environ["INFERNO_ALLOW_RUNTIME_LORA_UPDATING"]
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def offline(files):
    """What the offline LLM answers greedily to the question, per adapter (None: the base model)."""
    llm = LLM(files["base"], **ENGINE_ARGS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    loras = {None: None, **{name: LoRARequest(name, i + 1, files[name]) for i, name in enumerate(("sql", "poet"))}}
    messages = [{"role": "user", "content": QUESTION}]
    chat = llm.chat([messages] * len(loras), params, use_tqdm=False, lora_request=list(loras.values()))
    completion = llm.generate([QUESTION] * len(loras), params, use_tqdm=False, lora_request=list(loras.values()))
    answers = {"chat": {name: out.outputs[0].text for name, out in zip(loras, chat)},
               "completion": {name: out.outputs[0].text for name, out in zip(loras, completion)}}
    llm.llm_engine.shutdown()
    return answers


def test_models_lists_the_adapters_with_their_parent(client, files):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {BASE, "sql", "poet"}
    assert models["sql"].parent == models["poet"].parent == BASE
    assert models["sql"].root == files["sql"] and getattr(models[BASE], "parent", None) is None


def test_the_adapters_change_the_answer(offline):
    """Else the route tests below could pass with the adapter ignored."""
    for answers in offline.values():
        assert len({answers[None], answers["sql"], answers["poet"]}) == 3


@pytest.mark.parametrize("model", [BASE, "sql", "poet"])
def test_completions_answer_as_the_offline_llm_with_the_adapter(client, offline, model):
    out = client.completions.create(model=model, prompt=QUESTION, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    assert out.choices[0].text == offline["completion"][None if model == BASE else model]


@pytest.mark.parametrize("model", ["sql", "poet"])
def test_chat_and_its_stream_answer_as_the_offline_llm(client, offline, model):
    kwargs = dict(model=model, messages=[{"role": "user", "content": QUESTION}], max_completion_tokens=MAX_TOKENS,
                  temperature=0, extra_body={"ignore_eos": True})
    out = client.chat.completions.create(**kwargs)
    assert out.model == model and out.choices[0].message.content == offline["chat"][model]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert {c.model for c in chunks} == {model}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline["chat"][model]


def test_responses_answer_as_the_offline_llm(client, offline):
    out = client.responses.create(model="poet", input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert out.model == "poet" and out.output_text == offline["chat"]["poet"]


def test_messages_answer_as_the_offline_llm(server, offline):
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    out = client.messages.create(model="sql", messages=[{"role": "user", "content": QUESTION}],
                                 max_tokens=MAX_TOKENS, extra_body={"temperature": 0, "ignore_eos": True})
    assert out.model == "sql" and out.content[0].text == offline["chat"]["sql"]


def test_embeddings_with_an_adapter_are_the_peft_models(client, files):
    """The last token's final hidden state, normalized (the default pooling), of the adapter's PEFT model."""
    token_ids = list(QUESTION.encode())  # byte-level tokens: token id = byte
    base = transformers.AutoModelForCausalLM.from_pretrained(files["base"], dtype=torch.float32)
    reference = peft.PeftModel.from_pretrained(base, files["sql"]).eval()
    with torch.inference_mode():
        hidden = reference(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    out = client.embeddings.create(model="sql", input=[token_ids])
    assert out.model == "sql"
    torch.testing.assert_close(torch.tensor(out.data[0].embedding), torch.nn.functional.normalize(hidden, dim=-1),
                               rtol=0, atol=1e-4)
    base_vector = torch.tensor(client.embeddings.create(model=BASE, input=[token_ids]).data[0].embedding)
    assert not torch.allclose(base_vector, torch.tensor(out.data[0].embedding), atol=1e-2)


def test_unknown_model_is_a_404_in_each_routes_shape(server, client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="nope", prompt="Hi", max_tokens=1)
    assert raised.value.code == "model_not_found" and raised.value.param == "model"
    assert "`sql`" in raised.value.message  # the names that are served
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="Hi", max_output_tokens=1)
    with pytest.raises(anthropic.NotFoundError) as raised:
        anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0).messages.create(
            model="nope", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert raised.value.body["error"]["type"] == "not_found_error"


def load(server, name: str, path: str, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                      headers=headers, timeout=60)


def unload(server, name: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=AUTH, timeout=60)


def test_an_adapter_loaded_at_run_time_is_served_until_unloaded(server, client, files):
    assert load(server, "late", files["late"]).status_code == 200
    assert "late" in {m.id for m in client.models.list().data}
    kwargs = dict(prompt=QUESTION, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    late = client.completions.create(model="late", **kwargs).choices[0].text
    assert late != client.completions.create(model=BASE, **kwargs).choices[0].text
    assert unload(server, "late").status_code == 200
    assert "late" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", **kwargs)
    assert load(server, "late", files["late"]).status_code == 200  # the name is free again; same adapter, same text
    assert client.completions.create(model="late", **kwargs).choices[0].text == late
    assert unload(server, "late").status_code == 200


def test_requests_running_with_an_unloaded_adapter_finish_with_it(server, client, files):
    assert load(server, "late-2", files["late"]).status_code == 200
    kwargs = dict(model="late-2", prompt=QUESTION, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
    expected = client.completions.create(**kwargs).choices[0].text
    stream = client.completions.create(**kwargs, stream=True)
    texts = [next(stream).choices[0].text]
    assert unload(server, "late-2").status_code == 200
    texts += [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(texts) == expected
    server.wait_for_idle_engine(timeout=30)  # no KV block left behind


@pytest.mark.parametrize("name, path, message", [
    ("sql", "sql", "has already been loaded"),
    (BASE, "sql", "base model's served name"),
    ("", "sql", "must not be empty"),
    ("ghost", "/nonexistent/adapter", "does not exist"),
    ("wide", "wide", "max_lora_rank"),
    ("model", "base", "adapter_config.json"),  # a model folder is not an adapter
])
def test_bad_loads_are_400s_that_say_why(server, files, name, path, message):
    response = load(server, name, files.get(path, path))
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    server.wait_for_idle_engine(timeout=30)  # no KV block left behind


def test_unloading_an_unknown_adapter_is_a_404(server):
    response = unload(server, "never-loaded")
    assert response.status_code == 404 and response.json()["error"]["code"] == "lora_not_found"


def test_load_and_unload_need_the_api_key(server, files):
    assert load(server, "late", files["late"], headers={}).status_code == 401


def test_without_the_flag_the_runtime_routes_do_not_exist(files):
    server = RemoteServer("--model", files["base"], "--quantization", "none", "--max-model-len", "64",
                          "--kv-cache-memory", str(4 << 20), "--enable-lora")
    try:
        assert load(server, "late", files["late"]).status_code == 404
    finally:
        server.close()


# --lora-modules
@pytest.mark.parametrize("value, expected", [
    ("sql=/srv/sql", LoRAModulePath("sql", "/srv/sql")),
    ("eq=a=b.gguf", LoRAModulePath("eq", "a=b.gguf")),
    ('{"name": "sql", "path": "/srv/sql", "base_model_name": "qwen"}', LoRAModulePath("sql", "/srv/sql", "qwen")),
])
def test_lora_modules_take_name_path_or_vllms_json(value, expected):
    assert lora_module(value) == expected


@pytest.mark.parametrize("value", ["sql", "=path", "sql=", '{"name": "sql"}', '{"name": 1, "path": "p"}', "{nope"])
def test_malformed_lora_modules_are_refused(value):
    with pytest.raises(argparse.ArgumentTypeError, match="--lora-modules"):
        lora_module(value)


def test_an_adapter_that_cannot_load_stops_the_server_at_start(files, capsys):
    with pytest.raises(SystemExit) as raised:
        main(["serve", "--model", files["base"], "--quantization", "none", "--max-model-len", "64", "--kv-cache-memory",
              str(4 << 20), "--enable-lora", "--max-lora-rank", "16", "--lora-modules", f"wide={files['wide']}"])
    assert raised.value.code == 2 and "max_lora_rank" in capsys.readouterr().err
