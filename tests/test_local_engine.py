"""The in-process engine keeps transformers' greedy tokens through prefix-cache hits and preemption."""
from __future__ import annotations

from parity import prompts
from stagemesh.entry.local_engine import LocalEngine
from stagemesh.core.sampling_params import SamplingParams
from tiny_models import reference_model, reference_tokens


def test_prefix_cache_hits_and_preemption_keep_greedy_tokens(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    ref = reference_model(model_dir)
    batch = prompts(384, (5, 40, 17, 70, 3, 33))
    batch.append(batch[3][:50] + [7, 8, 9])  # shares 48 tokens (3 full blocks) with batch[3]
    want = [reference_tokens(ref, p, 12) for p in batch]
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)

    with LocalEngine.of(model_dir, max_num_batched_tokens=16) as cached:
        assert cached.generate(batch, sampling) == want
        assert cached.stats().prefix_cache_hits >= 48

    with LocalEngine.of(model_dir, layer_split=[1, 3], num_kv_blocks=12, max_num_batched_tokens=32) as tight:
        assert tight.generate(batch, sampling) == want
        assert tight.stats().num_preemptions > 0


def test_a_step_that_raises_fails_its_requests_instead_of_hanging(tiny_model_dir):
    """A bug in a step (not a StagemeshError) ends the requests with the error, at once: nothing restarts
    in-process, so nothing is kept waiting for a pipeline to re-form."""
    import threading

    import pytest

    from stagemesh.core.errors import StagemeshError

    with LocalEngine.of(tiny_model_dir("llama")) as engine:
        def broken(*args, **kwargs):
            raise AttributeError("no attribute 'num_tokens'")
        engine.runners[0].execute = broken
        raised: list[BaseException] = []

        def run() -> None:
            try:
                engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
            except BaseException as err:  # noqa: BLE001 - checked below
                raised.append(err)
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(20)
        assert not worker.is_alive(), "generate hung on a step that raised"
        with pytest.raises(StagemeshError, match="internal error: AttributeError: no attribute 'num_tokens'"):
            raise raised[0]
