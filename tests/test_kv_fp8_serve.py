"""`stagemesh serve --kv-cache-dtype fp8` on the embedded model, end to end (one mesh start): the official openai
client's "What is the capital of France?" is answered with Paris at temperature 0, and the replica's start-up lines
count the fp8 cache (twice a bf16 cache's tokens in the same --kv-cache-memory)."""
from __future__ import annotations

import re
import signal

import pytest

from stagemesh.core.model_config import ModelConfig
from test_drain import _started
from test_serve import serving

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_the_default_model_with_an_fp8_cache_names_paris(default_model_dir, tmp_path):
    import openai

    memory = 32 * 2**20  # per stage
    log_path = tmp_path / "serve.log"
    with serving(default_model_dir, log_path, "--kv-cache-dtype", "fp8", "--kv-cache-memory", str(memory),
                 "--served-model-name", "m") as proc:
        base, _ = _started(log_path)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        out = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=30, temperature=0)
        assert "Paris" in out.choices[0].message.content, out.choices[0].message.content
        proc.send_signal(signal.SIGTERM)  # every child drained and stopped
        assert proc.wait(timeout=60) == 0
    log = log_path.read_text()
    cfg = ModelConfig.from_path(default_model_dir)
    layers = cfg.num_hidden_layers // 2  # the heavier of the two stages (15 and 15)
    per_block = {nbytes: 2 * layers * 16 * cfg.num_key_value_heads * cfg.head_dim * nbytes for nbytes in (1, 2)}
    fp8_tokens, bf16_tokens = (memory // per_block[n] * 16 for n in (1, 2))
    assert f"KV cache size: {fp8_tokens:,} tokens" in log and fp8_tokens >= 1.9 * bf16_tokens
    assert "KV cache dtype fp8_e4m3 (--kv-cache-dtype)" in log
    assert re.search(r"stage \d: KV cache in float8_e4m3fn \(--kv-cache-dtype fp8\), [\d,]+ bytes per token, scales "
                     r"1.0 \(the checkpoint has none\)", log), log
