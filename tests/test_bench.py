"""`stagemesh bench`: workloads, report math, and real runs against a mesh over HTTP and gRPC."""
from __future__ import annotations

import json

import pytest

from mesh import Mesh, Router
from stagemesh.entry.bench.report import Result, percentile, summarize
from stagemesh.entry.bench.workload import as_text, load_jsonl, parse_range, prefix_repetition, synthetic
from stagemesh.entry.cli import main
from stagemesh.core.errors import StagemeshError
from tiny_models import with_word_tokenizer


def test_synthetic_workload_is_seeded_with_exact_lengths():
    a = synthetic(384, {0, 1, 2}, 20, (4, 9), (2, 5), seed=7)
    assert a == synthetic(384, {0, 1, 2}, 20, (4, 9), (2, 5), seed=7)
    assert a != synthetic(384, {0, 1, 2}, 20, (4, 9), (2, 5), seed=8)
    for r in a:
        assert 4 <= len(r.prompt_ids) == r.input_len <= 9 and 2 <= r.max_tokens <= 5
        assert not {0, 1, 2} & set(r.prompt_ids)
    assert {len(r.prompt_ids) for r in a} > {4} and parse_range("16", "--x") == (16, 16)
    for bad in ("a:b", "5:2", "0:3"):
        with pytest.raises(StagemeshError, match="--input-len-range"):
            parse_range(bad, "--input-len-range")


def test_prefix_repetition_workload_shares_its_prefixes_and_text_prompts_decode_the_ids(tiny_model_dir, tmp_path):
    reqs = prefix_repetition(384, {0, 1, 2}, 12, 3, 20, (4, 9), (5, 7), seed=1)
    assert reqs == prefix_repetition(384, {0, 1, 2}, 12, 3, 20, (4, 9), (5, 7), seed=1)
    prefixes = {tuple(r.prompt_ids[:20]) for r in reqs}
    assert len(prefixes) == 3 and all(24 <= r.input_len == len(r.prompt_ids) <= 29 for r in reqs)
    assert sorted(sum(r.prompt_ids[:20] == list(p) for r in reqs) for p in prefixes) == [4, 4, 4]
    assert all(t not in (0, 1, 2) for r in reqs for t in r.prompt_ids) and all(5 <= r.max_tokens <= 7 for r in reqs)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "m")))
    text = as_text(reqs, tok)
    assert [t.prompt for t in text] == [tok.decode(r.prompt_ids) for r in reqs]
    assert [t.max_tokens for t in text] == [r.max_tokens for r in reqs] and all(t.prompt_ids is None for t in text)


def test_jsonl_dataset_and_its_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hello", "max_tokens": 3}\n\n{"prompt": [5, 6, 7]}\n'
                    '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}\n')
    reqs = load_jsonl(good, default_max_tokens=9)
    assert [(r.prompt, r.prompt_ids, r.max_tokens) for r in reqs[:2]] == [("hello", None, 3), (None, [5, 6, 7], 9)]
    assert reqs[2].messages[0]["content"] == "hi"
    for text, message in (('{"prompt": "x"}\nnot json\n', "line 2: not JSON"),
                          ('{"max_tokens": 3}\n', "line 1: need an object with 'prompt' or 'messages'"),
                          ('{"prompt": "x", "max_tokens": -1}\n', "max_tokens must be a positive integer")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(StagemeshError, match=message):
            load_jsonl(bad)


def test_report_math():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    results = [Result(True, "", 10, 5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
               Result(True, "", 20, 3, ttft=0.3, latency=0.5, itl=[0.1, 0.1]),
               Result(False, "HTTP 503: busy")]
    s = summarize(results, duration=2.0)
    assert (s["successful_requests"], s["failed_requests"], s["total_output_tokens"]) == (2, 1, 8)
    assert s["output_throughput"] == 4.0 and s["request_throughput"] == 1.0 and s["total_token_throughput"] == 19.0
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["p50_tpot_ms"] == pytest.approx(100)
    assert s["errors"] == ["HTTP 503: busy"]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("bench")
    model = with_word_tokenizer(tiny_model_dir("llama"), logs / "model")
    with Mesh(model, [2, 2], handoff="grpc", log_dir=logs, scheduler_args=("--served-model-name", "m")) as mesh:
        with Router(model, [mesh.address], log_dir=logs, grpc_frontend=True) as router:
            router.model, router.logs = model, logs
            yield router


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["openai", "grpc"])
def test_bench_against_a_real_mesh(served, backend, capsys):
    out = served.logs / f"{backend}.json"
    code = main(["bench", "--backend", backend, "--base-url", served.base_url,
                 "--grpc-target", f"127.0.0.1:{served.grpc_port}", "--model-path", str(served.model),
                 "--num-prompts", "8", "--input-len-range", "3:12", "--output-len-range", "2:9", "--seed", "3",
                 "--max-concurrency", "4", "--no-progress", "--json", str(out)])
    assert code == 0
    s = json.loads(out.read_text())
    assert s["successful_requests"] == 8 and s["failed_requests"] == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(served.model))
    reqs = synthetic(len(tok), set(tok.all_special_ids), 8, (3, 12), (2, 9), 3)
    assert s["output_lens"] == [r.max_tokens for r in reqs]  # ignore_eos: exactly what was asked, per request
    assert s["input_lens"] == [r.input_len for r in reqs]  # token-id prompts: exact lengths
    assert s["total_output_tokens"] == sum(r.max_tokens for r in reqs)
    assert s["total_input_tokens"] == sum(r.input_len for r in reqs)
    assert s["duration_s"] > 0 and s["request_throughput"] == pytest.approx(8 / s["duration_s"])
    assert all(t > 0 for t in s["ttfts_ms"]) and s["mean_itl_ms"] > 0 and s["p50_tpot_ms"] > 0
    assert s["output_throughput"] > 0 and 0 < s["p50_ttft_ms"] <= s["p99_ttft_ms"]
    assert "Serving Benchmark Result" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_with_the_transformers_baseline(served, capsys):
    code = main(["bench", "--base-url", served.base_url, "--model-path", str(served.model), "--num-prompts", "6",
                 "--input-len-range", "3:8", "--output-len-range", "4:6", "--request-rate", "50",
                 "--baseline", "transformers", "--baseline-batch-size", "4", "--no-progress", "--json", "-"])
    assert code == 0
    text = capsys.readouterr().out
    s = json.loads(text[text.index("{"):])
    assert s["baseline"]["total_output_tokens"] == s["total_output_tokens"]
    assert s["ratio_to_baseline"] == pytest.approx(s["output_throughput"] / s["baseline"]["output_throughput"])
    assert "Ratio (serving / baseline)" in text


def test_bench_says_when_no_server_answers(tiny_model_dir, tmp_path, capsys):
    model = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    common = ["bench", "--model-path", str(model), "--num-prompts", "1", "--no-progress"]
    assert main([*common, "--base-url", "http://127.0.0.1:9", "--model", "m"]) == 2
    assert "no server answered at http://127.0.0.1:9" in capsys.readouterr().err
    assert main([*common, "--backend", "grpc", "--grpc-target", "127.0.0.1:9"]) == 2
    assert "no gRPC frontend answered at 127.0.0.1:9" in capsys.readouterr().err
    assert main([*common, "--output-len-range", "9:3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--output-len-range '9:3': need 1 <= A <= B" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert main([*common, "--dataset", str(bad)]) == 2
    assert f"--dataset {bad}, line 1: not JSON" in capsys.readouterr().err


def test_bench_baseline_only_needs_no_server(tiny_model_dir, tmp_path, capsys):
    model = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    assert main(["bench", "--baseline-only", "--model-path", str(model), "--num-prompts", "5", "--input-len-range",
                 "2:6", "--output-len-range", "3:3", "--baseline-batch-size", "2", "--no-progress",
                 "--json", "-"]) == 0
    text = capsys.readouterr().out
    s = json.loads(text[text.index("{"):])
    assert s["baseline"]["total_output_tokens"] == 15 and s["baseline"]["output_throughput"] > 0
    assert "static batches of 2" in text.splitlines()[0]


def test_a_dataset_goes_as_text_with_prompt_format_text_and_is_not_a_second_workload(tiny_model_dir, tmp_path):
    import argparse

    from stagemesh.entry.bench.cli import add_arguments, build_workload

    model = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": [5, 6, 7], "max_tokens": 3}\n')
    p = argparse.ArgumentParser()
    add_arguments(p)
    text = build_workload(p.parse_args(["--dataset", str(data), "--prompt-format", "text"]), model)
    from transformers import AutoTokenizer

    decoded = AutoTokenizer.from_pretrained(str(model)).decode([5, 6, 7])
    assert [(r.prompt, r.max_tokens) for r in text] == [(decoded, 3)]
    with pytest.raises(StagemeshError, match="two workloads"):
        build_workload(p.parse_args(["--dataset", str(data), "--prefix-repetition-num-prefixes", "2"]), model)


@pytest.mark.slow
@pytest.mark.parametrize("prompt_format", ["ids", "text"])
def test_streams_without_usage_are_counted_again_by_the_routers_tokenize_or_the_local_tokenizer(
        served, prompt_format, capsys):
    """--count-tokens server / local: the client asks for no usage and no token ids (the router then sends
    neither, as llama-cpp-python's server), and the counts made from the text equal the router's usage."""
    def bench(*extra):
        out = served.logs / f"count-{prompt_format}-{len(extra)}-{extra[-1] if extra else ''}.json"
        code = main(["bench", "--base-url", served.base_url, "--model-path", str(served.model), "--num-prompts", "6",
                     "--input-len-range", "3:12", "--output-len-range", "2:9", "--seed", "5", "--prompt-format",
                     prompt_format, "--max-concurrency", "3", "--no-progress", "--json", str(out), *extra])
        assert code == 0
        return json.loads(out.read_text()), capsys.readouterr().out

    usage, _ = bench()
    assert usage["tokens_counted_by"] == ["usage (the server's)"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(served.model))
    reqs = synthetic(len(tok), set(tok.all_special_ids), 6, (3, 12), (2, 9), 5)
    assert usage["output_lens"] == [r.max_tokens for r in reqs]
    server, table = bench("--count-tokens", "server")
    assert server["tokens_counted_by"] == ["server POST /tokenize"]
    assert "Tokens counted by: server POST /tokenize" in table
    local, table = bench("--count-tokens", "local")
    assert local["tokens_counted_by"] == [f"local tokenizer ({served.model})"]
    for s in (server, local):
        assert s["failed_requests"] == 0 and s["output_lens"] == usage["output_lens"]
        assert s["input_lens"] == usage["input_lens"] and s["total_output_tokens"] == sum(r.max_tokens for r in reqs)
        assert s["mean_tpot_ms"] > 0
