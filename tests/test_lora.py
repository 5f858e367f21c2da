"""Multi-LoRA on the stage (issue 46): sequences with different adapters, and the base model, in one batch give
transformers' greedy tokens with each adapter merged into its weights; over pipeline stages and over TP ranks
in real gloo processes; slots reused as adapters come and go; every bad adapter refused with its name."""
from __future__ import annotations

import json
import re
import os
import time
from pathlib import Path

import pytest
import torch

from lora_cases import ATTENTION, make_adapter, merged_reference, peft_adapter, run_mixed, runners, settings
from mesh import START_METHOD, exit_codes, free_port, run_stagemesh, start_serve
from stagemesh.entry.forkserver import spawn_stagemesh
from parity import prompts
from stagemesh.core.errors import StagemeshError
from stagemesh.core.lora import LoRAError, LoRALimits, parse_lora_modules, read_adapter_config
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import NewSequence, ScheduledChunk, StepBatch
from stage_worker.validate import InvalidStep, check_state
from tiny_models import reference_tokens

NEW = 12
WORKER = Path(__file__).with_name("lora_tp_worker.py")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"all": make_adapter(root / "all", model, rank=8, seed=1),
            "attn": make_adapter(root / "attn", model, rank=4, targets=ATTENTION, seed=2, alpha=8),
            "rs": make_adapter(root / "rs", model, rank=16, targets=("v_proj", "down_proj"), seed=3,
                               use_rslora=True)}


@pytest.fixture(scope="module")
def cases(model, adapters):
    """(prompt, adapter) and transformers' tokens for each, with its adapter merged."""
    ps = prompts(384, lengths=(9, 23, 5, 17, 30))
    names = ["all", "", "attn", "rs", "all"]
    refs = {name: merged_reference(model, adapters[name] if name else None) for name in set(names)}
    out = [((p, n), reference_tokens(refs[n], p, NEW)) for p, n in zip(ps, names)]
    base = reference_tokens(refs[""], ps[0], NEW)
    assert base != out[0][1], "the adapter does not change the tokens: the test would prove nothing"
    return out


def test_adapters_made_by_peft_give_transformers_plus_peft_merged_tokens(model, tmp_path):
    """Adapters that PEFT itself made and saved (save_pretrained), served beside the base model in one batch over
    two stages: each sequence gets the greedy tokens of transformers with PEFT's own merge of its adapter
    (merge_and_unload)."""
    pytest.importorskip("peft")
    sql, sql_ref = peft_adapter(tmp_path / "sql", model, rank=8, targets=ATTENTION + ("down_proj",), seed=11)
    chat, chat_ref = peft_adapter(tmp_path / "chat", model, rank=4, targets=("q_proj", "v_proj", "gate_proj",
                                                                            "up_proj"), seed=12, use_rslora=True)
    ps = prompts(384, lengths=(12, 7, 19), seed=9)
    want = [reference_tokens(sql_ref, ps[0], NEW), reference_tokens(merged_reference(model, None), ps[1], NEW),
            reference_tokens(chat_ref, ps[2], NEW)]
    assert want[0] != reference_tokens(merged_reference(model, None), ps[0], NEW)  # the adapter matters
    stages = runners(model, [2, 2], settings({"sql": sql, "chat": chat}))
    assert run_mixed(stages, [(ps[0], "sql"), (ps[1], ""), (ps[2], "chat")], NEW) == want


@pytest.mark.parametrize("split", ["4", "1,3"])
def test_a_mixed_batch_gives_each_sequence_its_adapters_tokens(model, adapters, cases, split):
    stages = runners(model, [int(x) for x in split.split(",")], settings(adapters))
    got = run_mixed(stages, [seq for seq, _ in cases], NEW)
    assert got == [want for _, want in cases]


def test_slots_are_reused_as_adapters_come_and_go(model, adapters, cases):
    """--max-loras 1: one adapter in a batch at a time (with the base model, or alone: every token on one
    slot); each batch evicts the last."""
    stages = runners(model, [2, 2], settings(adapters, max_loras=1, max_cpu_loras=1))
    first = 0
    for name, base in (("all", ""), ("attn", ""), ("all", "all"), ("rs", "rs")):
        mine = [(seq, want) for seq, want in cases if seq[1] in (name, base)]
        got = run_mixed(stages, [seq for seq, _ in mine], NEW, first_seq_id=first)
        assert got == [want for _, want in mine], name
        first += len(mine)


def test_a_float_adapter_on_w8a16_base_weights(model, adapters, tmp_path):
    """--quantization w8a16 keeps the base products quantised and adds each adapter's in float: transformers on
    the dequantised weights, with the adapter merged on top."""
    from test_quant_cuda import dequantised_dir

    reference_dir = dequantised_dir(model, tmp_path / "dequantised", "w8a16")
    ps = prompts(384, lengths=(13, 21), seed=7)
    want = [reference_tokens(merged_reference(reference_dir, adapters["all"]), ps[0], NEW),
            reference_tokens(merged_reference(reference_dir, None), ps[1], NEW)]
    stages = runners(model, [2, 2], settings(adapters), quantization="w8a16")
    assert run_mixed(stages, [(ps[0], "all"), (ps[1], "")], NEW) == want


def test_adapters_added_and_removed_at_run_time_take_free_slots(model, adapters, cases):
    """stage_worker.lora.LoRAManager.add / remove (what a run-time load does on each stage): an adapter added
    later gives its tokens in a mixed batch; a removed one's slot goes to the next, and a step that names it is
    refused; adding a name again from the same path changes nothing, from another replaces it."""
    stages = runners(model, [2, 2], settings({"all": adapters["all"]}, max_loras=2))
    for stage in stages:
        assert stage.lora.add("rs", str(adapters["rs"])) and stage.lora.add("attn", str(adapters["attn"]))
        assert not stage.lora.add("rs", str(adapters["rs"]))
    got = run_mixed(stages, [seq for seq, _ in cases if seq[1] != "all"], NEW)
    assert got == [want for seq, want in cases if seq[1] != "all"]
    for stage in stages:
        assert stage.lora.remove("rs") and not stage.lora.remove("rs")
    with pytest.raises(InvalidStep, match="LoRA adapter 'rs' is not loaded on this stage"):
        check_state(stages[0], StepBatch(0, [NewSequence(90, [5, 6], SamplingParams(), lora_name="rs")],
                                     [ScheduledChunk(90, [5, 6], 0, [0], True)]), 64)
    mine = [(seq, want) for seq, want in cases if seq[1] in ("all", "")]
    assert run_mixed(stages, [seq for seq, _ in mine], NEW, first_seq_id=100) == [want for _, want in mine]
    for stage in stages:  # "attn" now read from rs's directory: its tokens are rs's
        assert stage.lora.add("attn", str(adapters["rs"]))
    rs = next((p, "attn") for (p, n), _ in cases if n == "rs")
    assert run_mixed(stages, [rs], NEW, first_seq_id=200) == [next(w for (p, n), w in cases if n == "rs")]


@pytest.mark.parametrize("dcp", [1, 2], ids=["tp2", "tp2-dcp2"])
def test_tp2_shards_each_adapter_like_its_base_layer(model, adapters, cases, tmp_path, dcp):
    """-dcp 2: the adapters' layers are the TP shards they are without it; attention spreads the KV."""
    out, port = tmp_path / "tokens.json", free_port()
    spec = json.dumps({"model": str(model), "adapters": {k: str(v) for k, v in adapters.items()},
                       "seqs": [seq for seq, _ in cases], "new_tokens": NEW, "out": str(out), "dcp": dcp})
    procs = [spawn_stagemesh([str(rank), "2", str(port), spec], env={**os.environ, "OMP_NUM_THREADS": "1"},
                             script=str(WORKER), start_method=START_METHOD) for rank in range(2)]
    codes = exit_codes(procs)
    assert codes == [0, 0]
    assert json.loads(out.read_text()) == [want for _, want in cases]


def test_a_step_is_refused_before_it_changes_anything(model, adapters):
    stage = runners(model, [4], settings(adapters, max_loras=1))[0]
    plain = runners(model, [4], None)[0]

    def step(*names):
        news = [NewSequence(i, [5, 6, 7], SamplingParams(), lora_name=n) for i, n in enumerate(names)]
        return StepBatch(0, news, [ScheduledChunk(i, [5, 6, 7], 0, [i], True) for i in range(len(names))])

    with pytest.raises(InvalidStep, match="LoRA adapter 'nope' is not loaded on this stage"):
        check_state(stage, step("nope"), 64)
    with pytest.raises(InvalidStep, match="a step uses 2 LoRA adapters; --max-loras is 1"):
        check_state(stage, step("all", "attn"), 64)
    with pytest.raises(InvalidStep, match="asks for LoRA adapter 'all'; this stage runs without --enable-lora"):
        check_state(plain, step("all"), 64)
    check_state(stage, step("all", "", "all"), 64)  # one adapter and the base model fit one slot


@pytest.mark.parametrize("change,message", [
    (dict(rank=32), r"its rank 32 is above --max-lora-rank 16"),
    (dict(targets=("q_proj", "lm_head")), r"target modules lm_head are not ones the model's LoRA layers have"),
    (dict(config={"target_modules": ".*proj"}), r"target_modules as a regular expression"),
    (dict(config={"bias": "all"}), r"bias='all' is not supported"),
    (dict(config={"use_dora": True}), r"use_dora=True is not supported"),
    (dict(config={"peft_type": "IA3"}), r"peft_type 'IA3'; only LORA adapters are served"),
    (dict(config={"r": 0}), r"r must be a positive integer"),
])
def test_a_bad_adapter_config_is_refused_with_its_name(model, tmp_path, change, message):
    path = make_adapter(tmp_path / "bad", model, **change) if "lm_head" not in str(change) else None
    if path is None:  # a target the model's LoRA layers lack: only the config names it
        path = make_adapter(tmp_path / "bad", model, targets=("q_proj",), config={"target_modules": ["q_proj",
                                                                                                     "lm_head"]})
    with pytest.raises(LoRAError, match=r"LoRA adapter 'bad' \(.*bad\): " + message):
        read_adapter_config("bad", path, 16)


def test_bad_adapter_weights_stop_the_stage_as_it_starts(model, tiny_model_dir, tmp_path):
    other = tiny_model_dir("llama", hidden_size=96)
    cases = {
        "other_model": (make_adapter(tmp_path / "other_model", other), r"has shape .* want .*another base model"),
        "corrupt": (make_adapter(tmp_path / "corrupt", model), r"adapter_model.safetensors cannot be read"),
        "empty_dir": (tmp_path / "empty_dir", r"no adapter_config.json"),
        "unpaired": (make_adapter(tmp_path / "unpaired", model, targets=("q_proj",)), r"lora_A without its pair"),
    }
    (tmp_path / "empty_dir").mkdir()
    blob = (tmp_path / "corrupt" / "adapter_model.safetensors").read_bytes()
    (tmp_path / "corrupt" / "adapter_model.safetensors").write_bytes(blob[:len(blob) // 2])
    from safetensors.torch import load_file, save_file

    file = tmp_path / "unpaired" / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(str(file)).items() if "layers.1.self_attn.q_proj.lora_B" not in k},
              str(file))
    for name, (path, message) in cases.items():
        with pytest.raises(LoRAError, match=f"LoRA adapter '{name}' .*" + message):
            runners(model, [2, 2], settings({name: path}))


def test_lora_module_flags_take_vllms_two_forms():
    got = parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/b", "base_model_name": "m"}'])
    assert [(m.name, m.path, m.base_model_name) for m in got] == [("sql", "/a/sql", None), ("chat", "/b", "m")]
    for bad, message in [(["x"], "expected name=path"), (["a=/1", "a=/2"], "given twice"),
                         (['{"name": "a"}'], "the JSON form is"), (["bad name=/x"], "must be 1-128")]:
        with pytest.raises(LoRAError, match=message):
            parse_lora_modules(bad)
    with pytest.raises(LoRAError, match="--max-lora-rank 12: must be one of 1, 8, 16"):
        LoRALimits(max_lora_rank=12)
    with pytest.raises(LoRAError, match="--max-cpu-loras 1 must be at least --max-loras 2"):
        LoRALimits(max_loras=2, max_cpu_loras=1)


def _engine(model, adapters, **kw):
    from stagemesh.entry.local_engine import LocalEngine

    return LocalEngine.of(model, layer_split=[2, 2], lora_modules=[f"{name}={path}" for name, path in adapters.items()],
                          **kw)


def test_the_engine_runs_each_request_on_its_adapter(model, adapters, cases):
    """The scheduler carries each request's adapter to the stages: a continuous batch of mixed adapters gives
    transformers' tokens; with --max-loras 1 the other adapters' requests wait their turn."""
    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True)
    for max_loras in (3, 1):
        with _engine(model, adapters, max_loras=max_loras) as engine:
            got = engine.generate([p for (p, _), _ in cases], greedy, [n for (_, n), _ in cases])
        assert got == [want for _, want in cases], f"--max-loras {max_loras}"


def test_the_prefix_cache_never_shares_kv_between_adapters(model, adapters):
    """One long prompt under the base model, then under an adapter, then again under it: the adapter's run
    computes its own KV (the base model's cached blocks would give the wrong tokens) and the third reuses it."""
    prompt = prompts(384, lengths=(50,), seed=7)[0]  # three full blocks of 16
    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True)
    want = reference_tokens(merged_reference(model, adapters["all"]), prompt, NEW)
    with _engine(model, adapters) as engine:
        base = engine.generate([prompt], greedy)[0]
        assert engine.generate([prompt], greedy, ["all"])[0] == want != base
        hits = engine.stats().prefix_cache_hits
        assert engine.generate([prompt], greedy, ["all"])[0] == want
        assert engine.stats().prefix_cache_hits - hits == 48  # its own three blocks, cached by the run before
        with pytest.raises(StagemeshError, match="the LoRA adapter 'nope' is not served by this replica"):
            engine.generate([prompt], greedy, ["nope"])


@pytest.mark.slow  # (a whole mesh: serve's processes)
def test_serve_with_lora_answers_each_adapter_and_loads_and_unloads_them_at_run_time(model, adapters, cases,
                                                                                       tmp_path):
    """`stagemesh serve --enable-lora --lora-modules ...` (PP=2, TP=2: the stages and their TP followers load the
    adapters, the scheduler carries each request's, the router maps `model` to it): concurrent requests of every
    adapter and the base model get transformers' tokens through the openai client and the gRPC frontend.
    With VLLM_ALLOW_RUNTIME_LORA_UPDATING, /v1/load_lora_adapter loads an adapter while requests stream (none is
    lost or changed), /v1/unload_lora_adapter waits for the adapter's requests to finish, and every bad load is
    refused with its reason and leaves nothing behind."""
    import grpc
    import openai
    import requests
    import shutil
    import signal
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from stagemesh.core.wire import sampling_to_pb
    from stagemesh.v1 import frontend_pb2, frontend_pb2_grpc

    from mesh import stop_process, wait_http_ok
    from tiny_models import with_word_tokenizer

    model = with_word_tokenizer(model, tmp_path / "model")  # the same weights, and a tokenizer for the router
    port, grpc_port, log = free_port(), free_port(), tmp_path / "serve.log"
    root = adapters["rs"].parent  # what run-time loads may read; "rs" is loaded at run time
    modules = [f"{name}={path}" for name, path in adapters.items() if name != "rs"]
    proc = start_serve([str(model), "--port", str(port), "--grpc-port", str(grpc_port), "-pp", "2", "-tp", "2",
                        "--threads", "1", "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
                        "--allowed-local-lora-path", str(root), "--lora-modules", *modules],
                       log, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    base_url = f"http://127.0.0.1:{port}"

    def post(path, body):
        return requests.post(base_url + path, json=body, timeout=150)

    def listed():
        return {m.id: m.model_extra.get("parent") for m in client.models.list().data}

    def complete(case):
        (prompt, adapter), _ = case
        reply = client.completions.create(model=adapter or "base", prompt=prompt, max_tokens=NEW, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
        assert reply.model == (adapter or "base")
        return reply.choices[0].model_extra["token_ids"]

    try:
        wait_http_ok(proc, f"{base_url}/ready", 180, "serve", log)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        assert listed() == {"base": None, "all": "base", "attn": "base"}
        static = [c for c in cases if c[0][1] != "rs"]
        with ThreadPoolExecutor(len(static)) as pool:  # loaded while these stream: none lost or changed
            streaming = [pool.submit(complete, c) for c in static * 2]
            loaded = post("/v1/load_lora_adapter", {"lora_name": "rs", "lora_path": str(adapters["rs"])})
            assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'rs' added successfully."
            assert [f.result() for f in streaming] == [want for _, want in static * 2]
        assert listed() == {"base": None, "all": "base", "attn": "base", "rs": "base"}
        with ThreadPoolExecutor(len(cases)) as pool:
            assert list(pool.map(complete, cases)) == [want for _, want in cases]
        with pytest.raises(openai.NotFoundError, match="the model 'nope' does not exist"):
            client.completions.create(model="nope", prompt=[5, 6], max_tokens=2)
        (prompt, adapter), want = cases[0]  # n > 1, logprobs and a structured output, under an adapter
        reply = client.completions.create(model=adapter, prompt=prompt, max_tokens=NEW, temperature=0, n=2,
                                          logprobs=2, extra_body={"ignore_eos": True, "return_token_ids": True})
        assert [c.model_extra["token_ids"] for c in reply.choices] == [want, want]
        assert all(len(c.logprobs.token_logprobs) == NEW for c in reply.choices)
        picked = client.completions.create(model=adapter, prompt=prompt, max_tokens=4, temperature=0,
                                           extra_body={"structured_outputs": {"choice": ["w5 w6", "w9"]}})
        assert picked.choices[0].text.strip() in ("w5 w6", "w9")  # (a word-level tokenizer decodes " w9")
        metrics = requests.get(f"{base_url}/metrics", timeout=10).text
        assert re.search(r'vllm:lora_requests_info\{[^}]*max_lora="2"', metrics), metrics
        for names, ok in ((["all", "attn"], 6), (["nope"], 0)):  # `stagemesh bench` spreads requests over adapters
            bench = run_stagemesh(["bench", "--base-url", base_url, "--model-path",
                                    str(model), "--num-prompts", "6", "--input-len-range", "4:8",
                                    "--output-len-range", "3:3", "--lora-modules", *names, "--no-progress", "--json",
                                    "-"], timeout=120)
            summary = json.loads(bench.stdout[bench.stdout.index("{"):])
            assert summary["successful_requests"] == ok and summary["failed_requests"] == 6 - ok, bench.stdout[-2000:]
        (prompt, adapter), want = cases[0]  # the gRPC frontend picks the adapter by its model too
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = frontend_pb2_grpc.FrontendStub(channel)
            assert list(stub.ListModels(frontend_pb2.ListModelsRequest(), timeout=10).models) == \
                ["base", "all", "attn", "rs"]
            replies = stub.Generate(frontend_pb2.GenerateRequest(
                model=adapter, token_ids=frontend_pb2.TokenIds(ids=prompt),
                sampling=sampling_to_pb(SamplingParams(max_tokens=NEW, ignore_eos=True))), timeout=60)
            assert [t for r in replies for t in r.token_ids] == want

        # an unload while the adapter's requests stream lets them finish token-exact (the scheduler refuses to
        # unload an adapter in use, test_lora_admin; the router waits for that), then the name is vLLM's 404
        rs_case = next(c for c in cases if c[0][1] == "rs")
        started = threading.Barrier(5)

        def stream_rs():
            chunks = iter(client.completions.create(
                model="rs", prompt=rs_case[0][0], max_tokens=NEW, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True}))
            got = list(next(chunks).choices[0].model_extra.get("token_ids") or [])
            started.wait(60)  # every stream runs before the unload is asked for
            for chunk in chunks:
                got += chunk.choices[0].model_extra.get("token_ids") or [] if chunk.choices else []
            return got

        with ThreadPoolExecutor(4) as pool:
            using = [pool.submit(stream_rs) for _ in range(4)]
            started.wait(60)
            unloaded = post("/v1/unload_lora_adapter", {"lora_name": "rs"})
            assert unloaded.status_code == 200, unloaded.text
            assert [f.result() for f in using] == [rs_case[1]] * 4
        assert "rs" not in listed()
        with pytest.raises(openai.NotFoundError, match="the model 'rs' does not exist"):
            complete(rs_case)
        assert post("/v1/unload_lora_adapter", {"lora_name": "attn"}).status_code == 200  # a --lora-modules one
        assert listed() == {"base": None, "all": "base"}
        again = post("/v1/load_lora_adapter", {"lora_name": "rs", "lora_path": str(adapters["rs"])})
        assert again.status_code == 200, again.text  # again, into a slot another adapter had
        assert complete(rs_case) == rs_case[1]

        # a stage or a scheduler that restarts after a run-time load serves the adapter again: the stage learns it
        # from its RegisterStage reply, the scheduler from the router (which loaded it)
        for child in ("stage[0.1]", "scheduler[0]"):
            pid = int(re.findall(rf"started {re.escape(child)} \(pid (\d+)\)", log.read_text())[-1])
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while True:
                try:
                    assert complete(rs_case) == rs_case[1]
                    break
                except (openai.InternalServerError, openai.APIConnectionError):
                    assert time.monotonic() < deadline, f"the adapter was not served again after {child} restarted"
                    time.sleep(0.5)

        # bad loads: each refused with its reason (vLLM's 400 / 404), nothing listed after them
        outside = shutil.copytree(adapters["rs"], tmp_path / "outside")
        (root / "escape").symlink_to(outside)
        broken = shutil.copytree(adapters["attn"], root / "broken")
        (broken / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
        for body, status, message in [
                ({"lora_name": "x", "lora_path": str(outside)}, 400, "is not an absolute path under "
                 "--allowed-local-lora-path"),
                ({"lora_name": "x", "lora_path": f"{root}/../outside"}, 400, "--allowed-local-lora-path"),
                ({"lora_name": "x", "lora_path": str(root / "escape")}, 400, "is outside --allowed-local-lora-path"),
                ({"lora_name": "x", "lora_path": str(broken)}, 400, "LoRA adapter 'x' .*adapter_model.safetensors "
                 "cannot be read"),
                ({"lora_name": "x", "lora_path": str(root / "missing")}, 400, "LoRA adapter 'x' .*not a directory"),
                ({"lora_name": "all", "lora_path": str(adapters["rs"])}, 400, "The lora adapter 'all' has already "
                 "been loaded"),
                ({"lora_name": "x y", "lora_path": str(adapters["rs"])}, 400, "must be 1-128 letters"),
                ({"lora_name": "x"}, 400, "lora_path \\(a string\\) is required"),
                ({"lora_name": "x", "lora_path": str(adapters["rs"]), "load_inplace": True}, 400, "load_inplace")]:
            reply = post("/v1/load_lora_adapter", body)
            assert reply.status_code == status and re.search(message, reply.json()["error"]["message"]), \
                (body, reply.text)
        reply = post("/v1/unload_lora_adapter", {"lora_name": "nope"})
        assert reply.status_code == 404 and "The lora adapter 'nope' cannot be found." in reply.text
        reply = post("/v1/unload_lora_adapter", {"lora_name": "rs", "lora_int_id": 1})  # refused, not ignored
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "lora_int_id", reply.text
        assert listed() == {"base": None, "all": "base", "rs": "base"}
        assert complete(cases[0]) == cases[0][1]  # and the mesh serves on
    finally:
        stop_process(proc, 30)


def test_serve_refuses_bad_lora_flags_before_anything_starts(model, tmp_path):
    for argv, message in [(["--lora-modules", f"a={tmp_path}"], "--lora-modules needs --enable-lora"),
                          (["--enable-lora", "--lora-modules", f"a={tmp_path}"], r"'a' .*no adapter_config"),
                          (["--enable-lora", "--max-lora-rank", "12"], "--max-lora-rank 12: must be one of")]:
        done = run_stagemesh(["serve", str(model), "--port", "0", *argv], timeout=120)
        assert done.returncode != 0 and re.search(message, done.stderr), done.stderr


def test_the_scheduler_refuses_a_stage_without_its_adapters_or_slots():
    from scheduler.lora_table import LoRATable
    from scheduler.rendezvous import ModelIdentity, Rendezvous, StageInfo

    ident = ModelIdentity("llama", 4, 64, 384, 4, 2)

    def stage(adapters, slots):
        return StageInfo(0, 0, 4, 1, "cpu", 100, 16, ident, "127.0.0.1:1", "grpc", lora_adapters=adapters,
                         max_loras=slots)

    r = Rendezvous(1, 16, ident, lora=LoRATable(max_loras=2, adapters={"sql": "/a/sql", "chat": "/a/chat"}))
    with pytest.raises(StagemeshError, match=r"does not serve the LoRA adapter\(s\) chat \(its --enable-lora"):
        r.register(stage(("sql",), 2))
    with pytest.raises(StagemeshError, match=r"holds 1 LoRA adapter\(s\) at once \(--max-loras\); the scheduler "):
        r.register(stage(("sql", "chat"), 1))
    assert r.register(stage(("chat", "sql", "more"), 4)) == 0
    assert Rendezvous(1, 16, ident).register(stage((), 0)) == 0  # without LoRA nothing is asked


def test_lora_aware_routing_prefers_a_replica_that_runs_the_adapter_or_has_a_free_slot():
    """router.replica_set.lora_affinity, on the replicas' stats (--max-loras and running adapters), weighed against
    load: a replica running the adapter first, then one with a free slot, unless those are far busier."""
    from dataclasses import dataclass

    from router.replica_set import LORA_LOAD_SLACK, lora_affinity

    @dataclass
    class R:  # what lora_affinity reads of a replica (router.replicas.Replica)
        address: str
        load: int = 0
        max_loras: int = 2
        running_adapters: frozenset = frozenset()

    full = R("full", running_adapters=frozenset({"x", "y"}))
    runs = R("runs", load=5, running_adapters=frozenset({"sql"}))
    room = R("room", load=3, running_adapters=frozenset({"x"}))
    idle = R("idle", load=0)
    both = [full, runs, room, idle]
    assert lora_affinity(both, "") == both  # the base model: every replica
    assert lora_affinity(both, "sql") == [runs]  # it joins the batches that run it
    assert lora_affinity(both, "chat") == [runs, room, idle]  # no replica runs it: those with a free slot
    runs.load = LORA_LOAD_SLACK + 1  # far busier than the idle one: any with a slot
    assert lora_affinity(both, "sql") == [runs, room, idle]
    for r in (runs, room, idle):
        r.load = 10 * LORA_LOAD_SLACK
    assert lora_affinity(both, "chat") == both  # the slots are all far busier than the full one: load decides


def test_a_run_time_load_that_fails_on_one_replica_is_undone_on_the_others():
    """router.lora_api.load_everywhere: whatever stops one replica's load (a refusal, or any other exception),
    the replicas that did load the adapter unload it again, so none keeps an adapter the router does not list."""
    import asyncio
    from types import SimpleNamespace

    from router.lora_api import load_everywhere

    class Replica:  # the two calls load_everywhere makes of router.replicas.Replica
        def __init__(self, address, error=None):
            self.address, self.error, self.forgotten, self.lora_adapters, self.held = address, error, False, {}, set()

        async def load_lora(self, name, path):
            if self.error is not None:
                raise self.error
            self.held.add(name)

        async def unload_lora(self, name):
            self.held.discard(name)

    for error, raised in [(RuntimeError("the replica's answer could not be read"), RuntimeError),
                          (ValueError("bad"), ValueError)]:
        good, bad = Replica("a"), Replica("b", error)
        registry = SimpleNamespace(replica_set=SimpleNamespace(replicas=[good, bad]))
        with pytest.raises(raised):
            asyncio.run(load_everywhere(registry, "x", "/adapters/x"))
        assert good.held == set() and good.lora_adapters == {}
    good = Replica("a")
    asyncio.run(load_everywhere(SimpleNamespace(replica_set=SimpleNamespace(replicas=[good])), "x", "/adapters/x"))
    assert good.held == {"x"} and good.lora_adapters == {"x": "/adapters/x"}


def test_the_kv_aware_policy_matches_an_adapters_blocks_only_for_that_adapter():
    """The schedulers hash an adapter's blocks from its root (EngineRequest.hash_root): the router's index does
    too, so a base model's cached prefix is no hit for an adapter's request, nor the other way round."""
    from dataclasses import dataclass

    from router.kv_index import KVAware, KVIndex
    from stagemesh.core.block_hash import adapter_root, prefix_hashes

    @dataclass
    class R:  # what the policy reads of a replica
        address: str
        load: int = 0

    index = KVIndex()
    policy = KVAware(index)
    base, sql = R("base"), R("sql", load=1)
    prompt = list(range(100, 140))
    index.stored("base", prefix_hashes(prompt, 16), 16)
    index.stored("sql", prefix_hashes(prompt, 16, adapter_root("sql")), 16)
    assert policy.pick([base, sql], prompt) is base and policy.last_matched_tokens == 32
    assert policy.pick([base, sql], prompt, adapter_root("sql")) is sql and policy.last_matched_tokens == 32
    assert policy.pick([base, sql], prompt, adapter_root("chat")) is base and policy.last_matched_tokens == 0


def test_the_c_plus_plus_layer_plan_runs_lora_steps_up_to_the_kernels_length(tiny_model_dir, tmp_path):
    """With --enable-lora each layer of a step runs as one C++ call: its LoRALinears' base products, plus the
    adapters' products (kernels/csrc/lora_ops.h) for a step of up to CPU_LORA_MAX_TOKENS tokens; a longer step
    with adapter tokens runs the Python layer. Every way gives transformers' tokens. (A head size the C++
    attention covers: the plan runs for it.)"""
    from unittest import mock

    from kernels import cpu_ops, dispatch
    from stage_worker.layer_plan import LayerPlan

    model = tiny_model_dir("llama", num_attention_heads=2)  # head size 32
    if cpu_ops.load() is None or not cpu_ops.covers(cpu_ops.current_attention_family(), 32):
        pytest.skip("the C++ kernels are not built here")
    adapter = make_adapter(tmp_path / "a", model, seed=5)
    ps = prompts(384, lengths=(11, 20), seed=3)
    base_want = [reference_tokens(merged_reference(model, None), p, NEW) for p in ps]
    lora_want = reference_tokens(merged_reference(model, adapter), ps[0], NEW)
    assert lora_want != base_want[0]
    stage = runners(model, [4], settings({"a": adapter}))[0]
    with mock.patch.object(LayerPlan, "__call__", autospec=True, side_effect=LayerPlan.__call__) as plan_calls:
        assert run_mixed([stage], [(p, "") for p in ps], NEW) == base_want
        assert plan_calls.call_count == 4 * NEW  # every layer of every step
        assert run_mixed([stage], [(ps[0], "a"), (ps[1], "")], NEW, first_seq_id=10) == [lora_want, base_want[1]]
        assert plan_calls.call_count == 2 * 4 * NEW  # every step: the plan adds the adapter's products
        long = prompts(384, lengths=(dispatch.CPU_LORA_MAX_TOKENS + 9,), seed=4)[0]
        long_want = reference_tokens(merged_reference(model, adapter), long, NEW)
        assert run_mixed([stage], [(long, "a")], NEW, first_seq_id=20) == [long_want]
        assert plan_calls.call_count == 3 * 4 * NEW - 4  # but its prompt's step: the Python layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_triton_lora_kernel_equals_the_reference(dtype):
    """kernels.triton_lora (TRITON_INTERPRET=1 on CPU) against kernels.reference.add_lora: tokens of three
    adapters and of none, a rank width that is not a power of two, outputs wider than a block."""
    triton_lora = pytest.importorskip("kernels.triton_lora")
    from kernels import reference
    from stage_worker.lora import LoRAMapping

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(4)
    tokens, k, n, w, slots = 9, 96, 150, 24, 3
    x = torch.randn(tokens, k, generator=g).to(device, dtype)
    y = torch.randn(tokens, n, generator=g).to(device, dtype)
    a = (torch.randn(slots, w, k, generator=g) * 0.1).to(device, dtype)
    b = (torch.randn(slots, n, w, generator=g) * 0.1).to(device, dtype)
    mapping = LoRAMapping(device)
    rows = {0: [0, 1, 2, 7], 2: [4, 5], 1: [8]}  # tokens 3 and 6: the base model
    mapping.set([(s, torch.tensor(r, device=device)) for s, r in rows.items()], tokens)
    assert mapping.token_slots.tolist() == [0, 0, 0, -1, 2, 2, -1, 0, 1]
    want, got = y.float().clone(), y.clone()
    reference.add_lora(want, x.float(), a.float(), b.float(), mapping.groups)
    triton_lora.add_lora(got, x, a, b, mapping.token_slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert torch.equal(got[3], y[3]) and torch.equal(got[6], y[6])  # no adapter: untouched
    whole = LoRAMapping(device)
    whole.set([(1, None)], tokens)
    assert whole.token_slots.tolist() == [1] * tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_lora_kernel_equals_the_reference(dtype):
    """kernels/csrc/lora_ops.cpp (what a decode-sized CPU step runs) against kernels.reference.add_lora: tokens
    of three adapters and of none, odd sizes; a slot out of range is refused."""
    from kernels import cpu_ops, reference
    from stage_worker.lora import LoRAMapping

    if cpu_ops.load() is None:
        pytest.skip("the C++ CPU kernels are not built here")
    g = torch.Generator().manual_seed(5)
    tokens, k, n, w, slots = 9, 97, 151, 24, 3
    x, y = torch.randn(tokens, k, generator=g).to(dtype), torch.randn(tokens, n, generator=g).to(dtype)
    a = (torch.randn(slots, w, k, generator=g) * 0.1).to(dtype)
    b = (torch.randn(slots, n, w, generator=g) * 0.1).to(dtype)
    mapping = LoRAMapping("cpu")
    mapping.set([(s, torch.tensor(r)) for s, r in {0: [0, 1, 2, 7], 2: [4, 5], 1: [8]}.items()], tokens)
    want, got = y.float().clone(), y.clone()
    reference.add_lora(want, x.float(), a.float(), b.float(), mapping.groups)
    cpu_ops.add_lora(got, x, a, b.transpose(1, 2).contiguous(), mapping.token_slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert torch.equal(got[3], y[3]) and torch.equal(got[6], y[6])  # no adapter: untouched
    with pytest.raises(RuntimeError, match="lora_add: token 0 names slot 3 of 3"):
        cpu_ops.add_lora(got, x, a, b.transpose(1, 2).contiguous(), torch.full((tokens,), 3, dtype=torch.int32))


def text_count(log: Path, pattern: str) -> int:
    return len(re.findall(pattern, log.read_text()))


@pytest.mark.slow  # (a whole mesh: serve's processes)
def test_disaggregated_prefill_carries_the_adapter_with_its_kv(model, adapters, cases, tmp_path):
    """serve -dp 2 --prefill-replicas 1 --enable-lora: each request's prompt is computed on the prefill replica
    under its adapter and its KV pulled by the decode replica, which goes on under the same adapter: transformers'
    tokens with the adapter merged (the KV of one adapter is never another's). An adapter loaded at run time
    reaches both replicas (the router passes the load to each)."""
    import openai
    import requests

    from mesh import stop_process, wait_http_ok
    from tiny_models import with_word_tokenizer

    model = with_word_tokenizer(model, tmp_path / "model")
    port, log = free_port(), tmp_path / "serve.log"
    proc = start_serve([str(model), "--port", str(port), "-dp", "2", "--prefill-replicas", "1", "--threads", "1",
                        "--served-model-name", "base", "--enable-lora", "--max-loras", "3",
                        "--allowed-local-lora-path", str(adapters["rs"].parent),
                        "--lora-modules", *(f"{n}={p}" for n, p in adapters.items() if n != "rs")],
                       log, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    try:
        wait_http_ok(proc, f"http://127.0.0.1:{port}/ready", 180, "serve", log)
        deadline = time.monotonic() + 180  # (serve answers once one replica does: here the prefill one too)
        while not all(r["healthy"] for r in requests.get(f"http://127.0.0.1:{port}/ready", timeout=10)
                      .json()["replicas"]):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        loaded = requests.post(f"http://127.0.0.1:{port}/v1/load_lora_adapter",
                               json={"lora_name": "rs", "lora_path": str(adapters["rs"])}, timeout=150)
        assert loaded.status_code == 200, loaded.text
        assert text_count(log, r"LoRA adapter 'rs' loaded at run time from .* \(1 stage\(s\)\)") == 2
        rs = next(c for c in cases if c[0][1] == "rs")
        for (prompt, adapter), want in [*cases[:3], rs]:
            reply = client.completions.create(model=adapter or "base", prompt=prompt, max_tokens=NEW, temperature=0,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
            assert reply.choices[0].model_extra["token_ids"] == want, adapter
        text = log.read_text()
        assert len(re.findall(r"its prompt's KV \(\d+ tokens.*\) fetched from", text)) == 4, text[-3000:]
    finally:
        stop_process(proc, 30)
