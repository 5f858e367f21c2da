"""--quantization-activations and the int8-activation fast path's accuracy contract (tests/quant_contract.py):
its refusals, what it switches, and, on the embedded model, the contract measured for GGUF Q4_1 and an INT8
W8A8 checkpoint: a format allows int8 (stage_worker.activations.ALLOWED_INT8), or makes it its default, only where
it holds."""
from __future__ import annotations

import pytest
import torch

from parity import prompts
from quant_checkpoints import write_quantized
from quant_contract import MAX_KL_RATIO, MIN_TOP1, kl, set_int8_activations, teacher_forced_logits, top1
from stagemesh.core.errors import StagemeshError
from stage_worker.activations import ALLOWED_INT8, DEFAULT_INT8, integer_weights
from stage_worker.runner import StageRunner


@pytest.fixture(scope="module")
def gptq(tiny_model_dir, tmp_path_factory):
    return write_quantized(tiny_model_dir("llama"), tmp_path_factory.mktemp("gptq"), "gptq-int4")[0]


def test_int8_path_runs_every_integer_weight_and_stays_close(gptq):
    ids = prompts(384, lengths=(60,))[0]
    runner = StageRunner.of(gptq, 0, 4, quantization_activations="exact")
    assert runner.activations == "exact" and not any(w.int8_activations for w in integer_weights(runner.model))
    a = teacher_forced_logits(runner, ids)
    set_int8_activations(runner.model, True)
    b = teacher_forced_logits(runner, ids)
    assert not torch.equal(a, b)  # the int8 products differ from the exact ones ...
    assert kl(a, b) < 1e-2 and top1(a, b) >= 0.9  # ... by a rounding of the activations


def test_what_the_int8_path_cannot_take_is_refused(gptq, tiny_model_dir, tmp_path):
    fp8, _ = write_quantized(tiny_model_dir("llama"), tmp_path / "fp8", "fp8-block")
    for args, match in [(dict(model_dir=gptq, quantization_activations="int8"),
                         "int8 is not allowed for gptq: the int8 path misses the accuracy contract"),
                        (dict(model_dir=tiny_model_dir("llama"), quantization_activations="int8"),
                         "holds no quantised weights"),
                        (dict(model_dir=tiny_model_dir("llama"), quantization="w8a8", quantization_activations="exact"),
                         "contradicts it")]:
        with pytest.raises(StagemeshError, match=match):
            StageRunner.of(args.pop("model_dir"), 0, 4, **args)
    assert StageRunner.of(fp8, 0, 4).activations == "exact"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gguf", "compressed-tensors"])
def test_the_contract_decides_the_default(default_model_dir, tmp_path, fmt):
    """Teacher-forced over a text: KL(exact || int8) <= 0.1 KL(bf16 || exact) and top-1 agreement >= 99% for
    a format that allows int8; a format that misses it refuses int8."""
    from transformers import AutoTokenizer

    from stagemesh.core.default_model import gguf_path
    from quant_contract import EVAL_TEXT

    ids = AutoTokenizer.from_pretrained(default_model_dir).encode(EVAL_TEXT)[:160]
    reference = teacher_forced_logits(StageRunner.of(default_model_dir, 0, 30, dtype="bfloat16"), ids)
    if fmt == "gguf":
        quantised = StageRunner.of(default_model_dir, 0, 30, dtype="float32", quantization="gguf",
                                   gguf_file=str(gguf_path()), quantization_activations="exact")
    else:
        path, _ = write_quantized(default_model_dir, tmp_path, "ct-int8")
        quantised = StageRunner.of(path, 0, 30, dtype="float32", quantization_activations="exact")
    exact = teacher_forced_logits(quantised, ids)
    set_int8_activations(quantised.model, True)
    fast = teacher_forced_logits(quantised, ids)
    met = kl(exact, fast) <= MAX_KL_RATIO * kl(reference, exact) and top1(exact, fast) >= MIN_TOP1
    assert met == (fmt in ALLOWED_INT8), (kl(exact, fast), kl(reference, exact), top1(exact, fast))
    assert DEFAULT_INT8 <= ALLOWED_INT8
