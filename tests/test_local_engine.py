"""The in-process engine keeps transformers' greedy tokens through prefix-cache hits and preemption."""
from __future__ import annotations

from parity import prompts
from stagemesh.local_engine import LocalEngine
from stagemesh.core.sampling_params import SamplingParams
from tiny_models import reference_greedy, reference_model


def test_prefix_cache_hits_and_preemption_keep_greedy_tokens(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    ref = reference_model(model_dir)
    batch = prompts(384, (5, 40, 17, 70, 3, 33))
    batch.append(batch[3][:50] + [7, 8, 9])  # shares 48 tokens (3 full blocks) with batch[3]
    want = [reference_greedy(ref, p, 12)[0] for p in batch]
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)

    with LocalEngine(model_dir, max_num_batched_tokens=16) as cached:
        assert cached.generate(batch, sampling) == want
        assert cached.stats().prefix_cache_hits >= 48

    with LocalEngine(model_dir, split=[1, 3], num_kv_blocks=12, max_num_batched_tokens=32) as tight:
        assert tight.generate(batch, sampling) == want
        assert tight.stats().num_preemptions > 0
