"""`stagemesh bench` against servers whose streams carry no usage (llama-cpp-python's): the tokens are counted
again from the text, by the server's tokenize endpoint or the local tokenizer, the summary says which, and a
count that cannot be made is an error, never 0 tokens. The servers are real processes: a small one that
streams as llama-cpp-python's does (tests/text_stream_server.py), and llama-cpp-python's own where it is
installed (its python: $LLAMA_CPP_PYTHON, default this one)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from mesh import free_port, stop_process, wait_http_ok
from stagemesh.entry.bench.workload import synthetic
from stagemesh.entry.cli import main
from tiny_models import with_word_tokenizer

HERE = Path(__file__).parent


class Server:
    def __init__(self, argv: list[str], port: int, log: Path, ready_s: float = 60):
        self.base_url, self.ready_s = f"http://127.0.0.1:{port}", ready_s
        self.log = log
        self.proc = subprocess.Popen(argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT)

    def __enter__(self) -> "Server":
        wait_http_ok(self.proc, f"{self.base_url}/v1/models", self.ready_s, "server", self.log)
        return self

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)


def text_server(tmp_path: Path, tokenize: str) -> Server:
    port = free_port()
    return Server([sys.executable, str(HERE / "text_stream_server.py"), str(port), "--tokenize", tokenize], port,
                  tmp_path / f"server-{tokenize}.log")


@pytest.fixture
def word_model(tiny_model_dir, tmp_path):
    return with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")


def bench(base_url: str, model: Path, out: Path, *extra: str) -> int:
    return main(["bench", "--base-url", base_url, "--model-path", str(model), "--num-prompts", "5",
                 "--input-len-range", "3:9", "--output-len-range", "3:8", "--seed", "2", "--prompt-format", "text",
                 "--no-progress", "--json", str(out), *extra])


def workload(model: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    return synthetic(len(tok), set(tok.all_special_ids), 5, (3, 9), (3, 8), 2)


def test_no_usage_in_the_stream_counts_with_the_servers_extras_tokenize(word_model, tmp_path, capsys):
    """Two words a chunk: counting chunks would give half; /extras/tokenize puts a BOS before any text,
    which the prompt's count keeps (the server's prompt has it) and the completion's does not."""
    with text_server(tmp_path, "extras") as server:
        assert bench(server.base_url, word_model, tmp_path / "s.json") == 0
    s = json.loads((tmp_path / "s.json").read_text())
    reqs = workload(word_model)
    assert s["failed_requests"] == 0 and s["tokens_counted_by"] == ["server POST /extras/tokenize"]
    assert s["output_lens"] == [r.max_tokens for r in reqs]
    assert s["input_lens"] == [r.input_len + 1 for r in reqs]
    assert s["total_output_tokens"] == sum(r.max_tokens for r in reqs) and s["mean_tpot_ms"] > 0
    assert "Tokens counted by: server POST /extras/tokenize" in capsys.readouterr().out


def test_no_usage_and_no_tokenize_endpoint_counts_with_the_local_tokenizer(word_model, tmp_path, capsys):
    with text_server(tmp_path, "none") as server:
        assert bench(server.base_url, word_model, tmp_path / "s.json") == 0
        out = capsys.readouterr().out
        assert bench(server.base_url, word_model, tmp_path / "e.json", "--count-tokens", "server") == 2
        assert f"{server.base_url} has no tokenize endpoint" in capsys.readouterr().err
    s = json.loads((tmp_path / "s.json").read_text())
    reqs = workload(word_model)
    assert s["failed_requests"] == 0 and s["tokens_counted_by"] == [f"local tokenizer ({word_model})"]
    assert s["output_lens"] == [r.max_tokens for r in reqs] and s["input_lens"] == [r.input_len for r in reqs]
    assert f"Tokens counted by: local tokenizer ({word_model})" in out


def test_tokens_that_cannot_be_counted_are_an_error_not_zero(tiny_model_dir, tmp_path, capsys):
    """No usage, no tokenize endpoint, and a --model-path without a tokenizer (an id dataset needs none)."""
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir("llama"), bare)
    for f in bare.iterdir():
        if "token" in f.name:
            f.unlink()
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": [5, 6, 7], "max_tokens": 4}\n')
    with text_server(tmp_path, "none") as server:
        code = main(["bench", "--base-url", server.base_url, "--model-path", str(bare), "--dataset", str(data),
                     "--no-progress", "--json", str(tmp_path / "s.json")])
    assert code == 2 and not (tmp_path / "s.json").exists()
    err = capsys.readouterr().err
    assert "has no tokenize endpoint" in err and f"the local tokenizer ({bare}) does not load" in err
    assert "cannot count the tokens" in err


def _llama_python() -> str | None:
    python = os.environ.get("LLAMA_CPP_PYTHON", sys.executable)
    try:
        ok = subprocess.run([python, "-c", "import llama_cpp.server"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return python if ok else None


@pytest.mark.slow
def test_bench_drives_llama_cpp_pythons_server(tmp_path, capsys):
    """The real thing: llama-cpp-python's server on the embedded GGUF, --prompt-format text. Its stream has
    no usage and it refuses a non-UUID X-Request-Id; every request succeeds, counted by its /extras/tokenize,
    and the prompt counts equal its own tokenizer's."""
    python = _llama_python()
    if python is None:
        pytest.skip("llama-cpp-python's server is not installed (set LLAMA_CPP_PYTHON to a python that has it)")
    from stagemesh.core.default_model import gguf_path, resolve_model

    port = free_port()
    argv = [python, "-m", "llama_cpp.server", "--model", str(gguf_path()), "--n_threads", "2", "--n_ctx", "512",
            "--host", "127.0.0.1", "--port", str(port)]
    with Server(argv, port, tmp_path / "llama.log", ready_s=180) as server:
        code = main(["bench", "--base-url", server.base_url, "--num-prompts", "3", "--input-len-range", "8:16",
                     "--output-len-range", "4:8", "--prompt-format", "text", "--max-concurrency", "1",
                     "--no-progress", "--json", str(tmp_path / "s.json")])
        s = json.loads((tmp_path / "s.json").read_text())
        from transformers import AutoTokenizer

        from stagemesh.entry.bench.workload import as_text

        reqs = as_text(workload_of(resolve_model(None)), AutoTokenizer.from_pretrained(str(resolve_model(None))))
        counts = [len(requests.post(f"{server.base_url}/extras/tokenize", json={"input": r.prompt},
                                    timeout=30).json()["tokens"]) for r in reqs]
    assert code == 0, s.get("errors")
    assert s["successful_requests"] == 3 and s["tokens_counted_by"] == ["server POST /extras/tokenize"]
    assert s["input_lens"] == counts
    assert all(1 <= n <= r.max_tokens for n, r in zip(s["output_lens"], reqs))
    assert s["mean_tpot_ms"] > 0 and "Tokens counted by: server POST /extras/tokenize" in capsys.readouterr().out


def workload_of(model: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    return synthetic(len(tok), set(tok.all_special_ids), 3, (8, 16), (4, 8), 0)
