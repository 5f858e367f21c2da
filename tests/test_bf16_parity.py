"""bf16 against transformers in bf16 on the same weights: logits within a few bf16 steps of the reference's
(teacher-forced on our tokens), and greedy tokens equal until a first divergence that a logit tie within
bf16 resolution explains (the reference's own top two are that close), in-process for every dense tiny
architecture and the default model, and through the real services with TP=2, PP=2 and both handoffs.

On a CPU without bf16 instructions (this project's CI machine) the products are emulated and slow, not
wrong; the speed of bf16 is a benchmark's business (issue 22), its correctness is this file's.
"""
from __future__ import annotations

import math

import pytest
import torch

from mesh import Mesh
from parity import chained_logits, prompts
from stagemesh.core.sampling_params import SamplingParams
from tiny_models import ARCHS, reference_greedy

NEW_TOKENS = 32


def ulp(x: float) -> float:
    """The spacing of bf16 numbers at magnitude x (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def reference_bf16(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


def check_greedy(ours: list[int], ref_logits: torch.Tensor, want: list[int], what: str) -> None:
    """Equal, or equal up to a first divergence where the reference's logits of its token and ours are within
    four bf16 steps, the logits' tolerance (a tie at bf16 resolution: rounding in another order may swap
    them, and either is a correct greedy choice)."""
    k = next((i for i, (a, b) in enumerate(zip(ours, want)) if a != b), None)
    if k is None:
        assert len(ours) == len(want), what
        return
    row = ref_logits[k].float()
    gap = float(row[want[k]] - row[ours[k]])
    assert 0 <= gap <= 4 * ulp(float(row[want[k]])), (
        f"{what}: token {k} is {ours[k]}, transformers' {want[k]}, and its logit is {gap:.4f} below the top "
        f"(bf16 step there: {ulp(float(row[want[k]])):.4f}): not a tie")


@torch.inference_mode()
def check_logits(ref, prompt: list[int], ours: list[int], logits: torch.Tensor, what: str) -> None:
    forced = ref(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].float()
    tolerance = 4 * ulp(float(forced.abs().max()))
    diff = float((logits.float() - forced).abs().max())
    assert diff <= tolerance, f"{what}: logits differ by {diff:.4f}, more than 4 bf16 steps ({tolerance:.4f})"


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_slices_match_transformers_in_bf16(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    ref = reference_bf16(model_dir)
    for prompt in prompts(384, (5, 40, 17)):
        ours, logits = chained_logits(model_dir, [2, 2], prompt, NEW_TOKENS, dtype=torch.bfloat16)
        want, ref_logits = reference_greedy(ref, prompt, NEW_TOKENS)
        check_logits(ref, prompt, ours, logits, f"{arch}, prompt of {len(prompt)}")
        check_greedy(ours, ref_logits, want, f"{arch}, prompt of {len(prompt)}")


@pytest.mark.slow
def test_the_default_model_in_bf16_matches_transformers_in_bf16(default_model_dir):
    from transformers import AutoTokenizer

    ref = reference_bf16(default_model_dir)
    prompt = AutoTokenizer.from_pretrained(default_model_dir).encode("The capital of France is")
    ours, logits = chained_logits(default_model_dir, [30], prompt, NEW_TOKENS, dtype=torch.bfloat16)
    want, ref_logits = reference_greedy(ref, prompt, NEW_TOKENS)
    check_logits(ref, prompt, ours, logits, "default model")
    check_greedy(ours, ref_logits, want, "default model")


@pytest.mark.slow
@pytest.mark.parametrize("split,tp,handoff", [([2, 2], [2, 1], "nccl"), ([2, 2], [1, 1], "grpc")],
                         ids=["tp2-then-tp1-nccl", "pp2-grpc"])
def test_bf16_through_the_services_matches_transformers_in_bf16(tiny_model_dir, tmp_path, split, tp, handoff):
    model_dir = tiny_model_dir("llama")
    ref = reference_bf16(model_dir)
    batch = prompts(384, (5, 40, 17, 70, 3, 33))
    with Mesh(model_dir, split, tp=tp, handoff=handoff, stage_args=("--dtype", "bfloat16"), log_dir=tmp_path) as mesh:
        got = mesh.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert "bf16 path" in (tmp_path / "stage0.log").read_text()
    for i, (prompt, ours) in enumerate(zip(batch, got)):
        want, ref_logits = reference_greedy(ref, prompt, NEW_TOKENS)
        check_greedy(ours, ref_logits, want, f"request {i}")


@pytest.mark.slow
def test_the_embedded_gguf_in_bf16_answers_as_the_bf16_model_of_its_weights(default_model_dir):
    """The embedded GGUF (Q4_1) served in bf16, teacher-forced 32 rows a step (the quantised products' many-row
    tiles, as prefill chunks and batches run them): transformers' bf16 model of the dequantised weights (the
    default model's directory) within four bf16 steps at every position, the same top-1 nearly everywhere, and our
    own bf16 model's logits bit for bit (the same bf16 weights, the same fp32 sums of the same products, in the
    same order). A CPU without avx512_bf16 keeps the exact weights in these products (the avx2 tiles on x widened
    to fp32: tests/test_quant_kernels.py), so it is not the bf16 model's."""
    from quant_contract import EVAL_TEXT, teacher_forced_logits
    from transformers import AutoTokenizer

    from kernels import cpu_ops
    from stage_worker.runner import StageRunner
    from stagemesh.core.default_model import gguf_path

    if not cpu_ops.load().quant_bf16_available():
        pytest.skip("this CPU has no avx512_bf16: its quantised products keep the exact weights")
    ids = AutoTokenizer.from_pretrained(default_model_dir).encode(EVAL_TEXT)[:129]
    quantised = teacher_forced_logits(StageRunner.of(default_model_dir, 0, 30, dtype="bfloat16", quantization="gguf",
                                                     gguf_file=str(gguf_path())), ids)
    with torch.inference_mode():
        forced = reference_bf16(default_model_dir)(torch.tensor([ids])).logits[0, :-1].float()
    tolerance = 4 * ulp(float(forced.abs().max()))
    diff = float((quantised - forced).abs().max())
    assert diff <= tolerance, f"logits differ by {diff:.4f}, more than 4 bf16 steps ({tolerance:.4f})"
    assert (quantised.argmax(-1) == forced.argmax(-1)).float().mean() >= 0.98
    dense = teacher_forced_logits(StageRunner.of(default_model_dir, 0, 30, dtype="bfloat16"), ids)
    assert torch.equal(quantised, dense)
