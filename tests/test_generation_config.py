"""The model's generation_config.json as vLLM reads it (router.generation_config, --generation-config
auto|vllm|FOLDER, --override-generation-config): what it supplies, the merge rules (a request's own value
wins; max_tokens defaults to max_new_tokens and is capped where vLLM caps it), and what reaches a replica
through every door of the real router app (HTTP with the official openai client, the Responses API, the gRPC
frontend) over a fake replica that records it (tests/fake_replicas.py; word tokenizer: "w5 w6" is [5, 6])."""
from __future__ import annotations

import json

import grpc
import pytest

from fake_replicas import FakeRouter
from router.generation_config import SamplingDefaults, load
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stagemesh.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tiny_models import with_word_tokenizer

M = "fake-model"
QWEN3_LIKE = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.95,
              "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 7, "num_beams": 1}
MODEL_VALUES = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}


def model_with(base, target, config: dict | None):
    """A copy of the tiny model with a word tokenizer and `config` as its generation_config.json (None: none)."""
    path = with_word_tokenizer(base, target)
    (path / "generation_config.json").unlink(missing_ok=True)
    if config is not None:
        (path / "generation_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return tiny_model_dir("llama")


# --- reading the file -------------------------------------------------------------------------------------------

def test_auto_takes_the_six_fields_vllm_takes_and_max_new_tokens_as_max_tokens(base, tmp_path):
    model = model_with(base, tmp_path / "m", {**QWEN3_LIKE, "top_p": None})
    d = load(model)
    expected = {k: v for k, v in MODEL_VALUES.items() if k != "top_p"}  # (a null field is none, as in vLLM)
    assert d.values == {**expected, "max_tokens": 7} and d.max_tokens == 7
    assert d.max_tokens_cap is None and d.source == "model"
    assert "temperature" in d.describe() and "Using default sampling params from model" in d.describe()


def test_vllm_ignores_the_file_and_a_model_without_one_has_no_defaults(base, tmp_path):
    assert load(model_with(base, tmp_path / "m", QWEN3_LIKE), "vllm").values == {}
    assert load(model_with(base, tmp_path / "none", None)).values == {}


def test_the_override_goes_over_the_file_and_its_max_new_tokens_caps_every_request(base, tmp_path):
    model = model_with(base, tmp_path / "m", QWEN3_LIKE)
    d = load(model, "auto", '{"temperature": 0.2, "max_new_tokens": 5}')
    assert d.values == {**MODEL_VALUES, "temperature": 0.2, "max_tokens": 5} and d.max_tokens_cap == 5
    assert load(model, "vllm", '{"top_k": 3}').values == {"top_k": 3}
    assert load(model, "auto", '{"top_k": 3}').max_tokens_cap is None  # (the file's max_new_tokens: no cap)


def test_a_folder_supplies_them_and_its_max_new_tokens_caps_every_request(base, tmp_path):
    model = model_with(base, tmp_path / "m", None)
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "max_new_tokens": 9}))
    d = load(model, str(folder))
    assert d.values == {"temperature": 0.3, "max_tokens": 9} and d.max_tokens_cap == 9 and d.source == str(folder)


@pytest.mark.parametrize("config, override, words", [
    ("{not json", None, ["generation_config.json", "not valid JSON"]),
    ("[1, 2]", None, ["generation_config.json", "JSON object"]),
    (json.dumps({"temperature": 5}), None, ["temperature", "5", "[0, 2]"]),
    (json.dumps({"top_k": -3}), None, ["top_k", "-3"]),
    (json.dumps({"max_new_tokens": 0}), None, ["max_new_tokens", "0"]),
    (json.dumps({"temperature": 0.5}), '{"do_sample": false}', ["do_sample", "--override-generation-config"]),
    (json.dumps({"temperature": 0.5}), "temperature=1", ["--override-generation-config", "JSON"]),
    (json.dumps({"temperature": 0.5}), '{"top_p": 7}', ["top_p", "7"]),
])
def test_what_cannot_be_honoured_stops_start_up_naming_it(base, tmp_path, config, override, words):
    model = with_word_tokenizer(base, tmp_path / "m")
    (model / "generation_config.json").write_text(config)
    with pytest.raises(StagemeshError) as err:
        load(model, "auto", override)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_folder_is_refused_when_missing_or_when_it_names_other_end_tokens(base, tmp_path):
    model = model_with(base, tmp_path / "m", None)
    with pytest.raises(StagemeshError, match="not 'auto', 'vllm' or a folder"):
        load(model, str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(StagemeshError, match="has no generation_config.json"):
        load(model, str(tmp_path / "empty"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 77]}))
    with pytest.raises(StagemeshError, match=r"eos_token_id names \[77\]"):
        load(model, str(tmp_path / "other"))


def test_its_end_of_sequence_ids_join_config_jsons_for_every_service(base, tmp_path):
    model = model_with(base, tmp_path / "m", {"eos_token_id": [2, 5, 9]})
    assert ModelConfig.from_path(model).eos_token_ids == (2, 5, 9)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(StagemeshError, match="eos_token_id must be a token id"):
        ModelConfig.from_path(model)


def test_fill_lets_the_request_win_then_the_model_then_the_door():
    d = SamplingDefaults({"temperature": 0.6, "top_k": 20, "max_tokens": 7})
    assert d.fill({"top_k": 5}, {"temperature": 1.0, "top_p": 0.5}) == {"temperature": 0.6, "top_k": 5, "top_p": 0.5}
    assert SamplingDefaults().fill({}, {"temperature": 1.0}) == {"temperature": 1.0}


# --- what reaches a replica, through each door --------------------------------------------------------------------

@pytest.fixture(scope="module")
def routers(base, tmp_path_factory):
    """Routers over the model with QWEN3_LIKE: auto, vllm, and a FOLDER that caps max_tokens at 7."""
    model = model_with(base, tmp_path_factory.mktemp("genconfig") / "m", QWEN3_LIKE)
    modes = {"auto": load(model), "vllm": load(model, "vllm"), "folder": load(model, str(model))}
    opened = {name: FakeRouter(model, M, grpc_frontend=True, sampling_defaults=d) for name, d in modes.items()}
    for r in opened.values():
        r.__enter__()
    yield opened
    for r in opened.values():
        r.__exit__()


def sent(router) -> dict:
    """The sampling parameters of the last request that reached the replica."""
    s = router.replica.submitted[-1][2]
    return rounded({name: getattr(s, name) for name in (*MODEL_VALUES, "max_tokens", "min_tokens")})


def rounded(values: dict) -> dict:
    """Floats as the wire's float32 carries them, to 4 places."""
    import numpy as np

    return {k: v if isinstance(v, int) else round(float(np.float32(v)), 4) for k, v in values.items()}


def test_a_request_that_names_no_sampling_parameter_gets_the_models(routers):
    client = routers["auto"].client()
    client.completions.create(model=M, prompt="w5 w6")
    assert sent(routers["auto"]) == {**rounded(MODEL_VALUES), "max_tokens": 7, "min_tokens": 0}
    client.chat.completions.create(model=M, messages=[{"role": "user", "content": "w5"}])
    assert sent(routers["auto"]) == {**rounded(MODEL_VALUES), "max_tokens": 7, "min_tokens": 0}
    client.responses.create(model=M, input="w5 w6")
    assert sent(routers["auto"]) == {**rounded(MODEL_VALUES), "max_tokens": 7, "min_tokens": 0}


def test_a_requests_own_values_win_max_tokens_too(routers):
    client = routers["auto"].client()
    client.chat.completions.create(model=M, messages=[{"role": "user", "content": "w5"}], temperature=0,
                                   max_tokens=20, extra_body={"top_k": 3})
    assert sent(routers["auto"]) == {**rounded(MODEL_VALUES), "temperature": 0.0, "top_k": 3, "max_tokens": 20,
                                     "min_tokens": 0}
    client.responses.create(model=M, input="w5", temperature=1.5, top_p=0.5, max_output_tokens=30)
    assert sent(routers["auto"]) == {**rounded(MODEL_VALUES), "temperature": 1.5, "top_p": 0.5, "max_tokens": 30,
                                     "min_tokens": 0}


def test_vllm_mode_sends_the_apis_own_defaults(routers):
    routers["vllm"].client().completions.create(model=M, prompt="w5 w6")
    assert sent(routers["vllm"]) == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                     "repetition_penalty": 1.0, "max_tokens": 512 - 2, "min_tokens": 0}


def test_a_folders_max_new_tokens_caps_a_requests_own_max_tokens(routers):
    client = routers["folder"].client()
    client.completions.create(model=M, prompt="w5 w6", max_tokens=100)
    assert sent(routers["folder"])["max_tokens"] == 7
    client.completions.create(model=M, prompt="w5 w6", max_tokens=3)
    assert sent(routers["folder"])["max_tokens"] == 3
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=M, prompt="w5 w6", max_tokens=100, extra_body={"min_tokens": 10})
    assert err.value.body["param"] == "min_tokens" and "max_tokens=7" in err.value.body["message"]


def frontend(router, **sampling) -> None:
    """A Frontend Generate request with only `sampling` set, read to its end."""
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)
        request = frontend_pb2.GenerateRequest(model=M, text="w5 w6", sampling=common_pb2.SamplingParams(**sampling))
        list(stub.Generate(request, timeout=30))


def test_the_grpc_frontend_applies_them_to_the_fields_it_leaves_unset(routers):
    frontend(routers["auto"])
    assert sent(routers["auto"]) == {**rounded(MODEL_VALUES), "max_tokens": 7, "min_tokens": 0}
    frontend(routers["auto"], temperature=0.0, top_k=0, max_tokens=9)  # (set to 0: greedy and no top-k, not unset)
    assert sent(routers["auto"]) == {**rounded(MODEL_VALUES), "temperature": 0.0, "top_k": -1, "max_tokens": 9,
                                     "min_tokens": 0}
    frontend(routers["vllm"])  # (the frontend's own defaults: greedy)
    assert sent(routers["vllm"]) == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                     "repetition_penalty": 1.0, "max_tokens": 512 - 2, "min_tokens": 0}


# --- on a real mesh -----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_top_k_1_makes_a_bare_request_greedy_and_max_new_tokens_its_length_unless_vllm(base, tmp_path):
    """The issue's proof, through real processes and the official client: the model's file (top_k 1,
    max_new_tokens 5) makes a request that names no sampling parameter transformers' greedy tokens, 5 of them;
    --generation-config vllm ignores both (temperature 1.0 samples, max_tokens is the room left)."""
    from mesh import Mesh, Router
    from tiny_models import reference_model, reference_tokens

    model = model_with(base, tmp_path / "m", {"bos_token_id": 1, "eos_token_id": 2, "top_k": 1, "max_new_tokens": 5})
    prompt = [5, 17, 42, 99, 7]
    greedy = reference_tokens(reference_model(model), prompt, 5)
    bare = dict(model=str(model), prompt=prompt, n=3, seed=11,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    with Mesh(model, [4], log_dir=tmp_path) as mesh:
        with Router(model, [mesh.address], log_dir=tmp_path) as auto:
            out = auto.client().completions.create(**bare)
        assert [c.model_extra["token_ids"] for c in out.choices] == [greedy] * 3
        assert {c.finish_reason for c in out.choices} == {"length"}
        with Router(model, [mesh.address], ("--generation-config", "vllm", "--max-model-len", "40"),
                    log_dir=tmp_path) as plain:
            out = plain.client().completions.create(**bare)
    tokens = [c.model_extra["token_ids"] for c in out.choices]
    assert [len(t) for t in tokens] == [40 - len(prompt)] * 3
    assert any(t[:5] != greedy for t in tokens)  # (sampled at temperature 1 over the whole vocabulary)
    logged = "".join(p.read_text() for p in tmp_path.glob("router-*.log"))
    assert "Using default sampling params from model: {'top_k': 1, 'max_tokens': 5}" in logged
    assert "no default sampling parameters from vllm" in logged
