"""The fused CPU kernels (kernels/csrc/cpu_ops.cpp, the MoE layer in moe_ops.cpp) and the
shared-memory collectives of CPU tensor parallelism (kernels/csrc/shm_comm.cpp): built once
per machine, loaded on demand.

`make install` builds them (`python -m kernels`); a process that finds no
build compiles it on first use (about half a minute, logged) into the stagemesh cache,
keyed by the source, so an edit rebuilds; one process at a time, and none held up by a compile
that was killed (kernels.build_lock).
Without a C++ compiler, or with STAGEMESH_KERNELS=torch, the CPU path stays on the
torch reference. Every entry point keeps the reference's signature.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kernels import build_lock, isa, moe_reference, reference
from kernels.kv_quant import is_fp8

if TYPE_CHECKING:
    from kernels.masked_attention import AttentionMask

log = logging.getLogger("stagemesh.kernels")
CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "cpu_ops.cpp", CSRC / "shm_comm.cpp", CSRC / "moe_ops.cpp", CSRC / "bf16_linear.cpp",
           CSRC / "bf16_linear_avx512bf16.cpp", CSRC / "quant_linear.cpp", CSRC / "decode_attention_avx2.cpp",
           CSRC / "decode_attention_avx512.cpp", CSRC / "decoder_layer.cpp", CSRC / "lora_ops.cpp",
           CSRC / "attention_merge.cpp", CSRC / "mla_decode.cpp"]


def _capability() -> str:
    """The -march level of this CPU's build, from /proc/cpuinfo (kernels/isa.py): avx512, avx2 or generic."""
    return isa.march(isa.cpu_flags())


def _flags(capability: str) -> list[str]:
    # x86-64-v3 (AVX2 + FMA) rather than -march=native: a build may serve other machines of its level
    level = {"avx2": ["-march=x86-64-v3"], "avx512": ["-march=x86-64-v4"]}.get(capability, [])
    # -fno-trapping-math: lets the clamp and floor of exp_poly vectorize (nothing here reads FP exception flags)
    return ["-O3", "-fopenmp", "-fno-trapping-math", *level]


def _build_dir(name: str) -> Path:
    """$STAGEMESH_KERNEL_CACHE (the stagemesh command line sets it to the stagemesh cache for itself and
    its children; a container image to a folder built into it), else a folder in the temp directory; one
    folder per torch, Python, CPU level and source version. Kernels know nothing of the project above them:
    the cache directory is the caller's to give."""
    root = os.environ.get("STAGEMESH_KERNEL_CACHE") or Path(tempfile.gettempdir()) / "stagemesh-kernels"
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(root) / f"torch{torch.__version__.replace('+', '_')}-{python}" / name


def _module_name(capability: str) -> str:
    code = b"".join(p.read_bytes() for p in sorted(CSRC.iterdir()))
    digest = hashlib.sha256(code + " ".join(_flags(capability)).encode()).hexdigest()[:10]
    return f"stagemesh_cpu_ops_{capability}_{digest}"


def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # (a path ending in .so always has a loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load(verbose: bool = False):
    """The compiled module, or None where it cannot be built (the reason is logged once)."""
    if os.environ.get("STAGEMESH_KERNELS", "").lower() == "torch":
        return None
    capability = _capability()
    name = _module_name(capability)
    return load_module(name, SOURCES, _flags(capability), _build_dir(name), verbose)


def load_module(name: str, sources: list[Path], cflags: list[str], build_dir: Path, verbose: bool = False):
    """compile_module, or None (the reason logged) where it cannot be built."""
    try:
        return compile_module(name, sources, cflags, build_dir, verbose)
    except build_lock.KernelBuildTimeout as err:
        log.error("CPU kernels unavailable, the CPU path uses the torch reference (slower): %s", err)
    except Exception as err:  # noqa: BLE001 - no compiler, no ninja, read-only cache: the torch reference serves
        log.warning("CPU kernels unavailable, the CPU path uses the torch reference (slower): %s",
                    (str(err).strip().splitlines() or [type(err).__name__])[0])
    return None


def compile_module(name: str, sources: list[Path], cflags: list[str], build_dir: Path, verbose: bool = False):
    """The module `name` built from `sources` in build_dir: imported when built before (by `make install`, an
    image build or another process), else compiled there, one process at a time (kernels.build_lock)."""
    built = build_dir / f"{name}.so"
    if built.is_file():
        return _import(name, built)
    with build_lock.exclusive_build(build_dir):
        if built.is_file():  # the process this one waited for built it
            return _import(name, built)
        from torch.utils import cpp_extension

        log.info("compiling the CPU kernels %s (once per machine: about 80 s on 2 cores) into %s", name, build_dir)
        return cpp_extension.load(name=name, sources=[str(p) for p in sources], extra_cflags=cflags,
                                  extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=verbose)


# -- the kernel API (kernels.dispatch), on fp32 or bf16 CPU tensors (fused_moe: fp32) ----------

def rms_norm(x, weight, eps, residual=None):
    return tuple(load().rms_norm(x, weight, eps, residual))


def apply_rotary(q, k, positions, cos_sin_cache):
    return tuple(load().apply_rotary(q, k, positions, cos_sin_cache))


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    load().write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rotary_and_cache(qkv, num_heads, num_kv_heads, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                     k_scale: float = 1.0, v_scale: float = 1.0):
    return load().rotary_and_cache(qkv, num_heads, num_kv_heads, positions, cos_sin_cache, k_cache, v_cache,
                                   slot_mapping, k_scale, v_scale)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, k_scale: float = 1.0,
                    v_scale: float = 1.0):
    """Where this CPU's attention family covers the head_dim, every query row (decode tokens and prefill
    chunks alike) is one row of the family's kernel, seeing the positions up to its own; else decode rows
    take the portable loop and prefill chunks torch's attention, one sequence at a time (an fp8 cache, which
    the portable loop does not read: the torch reference's decode too)."""
    family = current_attention_family()
    if not covers(family, q.shape[-1]):
        return reference.paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                         decode=None if is_fp8(k_cache.dtype) else _decode, k_scale=k_scale,
                                         v_scale=v_scale)
    seqs, visible = reference.step_memo("query rows", (context_lens, query_start_loc),
                                        lambda: query_rows(context_lens, query_start_loc))
    return load().decode_attention(q, k_cache, v_cache, block_tables, seqs, visible, scale, family, k_scale, v_scale)


def paged_attention_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention and each row's log-sum-exp, [tokens, heads] fp32 (kernels.reference.paged_attention_lse),
    from the same family kernel, which stores it only when asked; where no family covers the head_dim, the
    torch reference."""
    family = current_attention_family()
    if not covers(family, q.shape[-1]):
        return reference.paged_attention_lse(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                             k_scale, v_scale)
    seqs, visible = reference.step_memo("query rows", (context_lens, query_start_loc),
                                        lambda: query_rows(context_lens, query_start_loc))
    out, lse = load().decode_attention_lse(q, k_cache, v_cache, block_tables, seqs, visible, scale, family, k_scale,
                                           v_scale)
    return out, lse


def paged_attention_window(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                           mask: AttentionMask, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor | None:
    """kernels.masked_attention.paged_attention_masked for a mask without softcap, from the family kernel: each
    query row sees the positions of its sliding window only (the blocks before it are not read), and a head's
    sink joins its softmax as a logit with no value: the output times sigmoid(lse - sink) = Z / (Z + e^sink).
    None where no family covers the head_dim (the caller runs the reference)."""
    window, sinks = mask.window, mask.sinks
    family = current_attention_family()
    if not covers(family, q.shape[-1]):
        return None
    seqs, visible = reference.step_memo("query rows", (context_lens, query_start_loc),
                                        lambda: query_rows(context_lens, query_start_loc))
    first = (visible - window).clamp_(min=0) if window is not None else torch.zeros_like(visible)
    out, lse = load().decode_attention_window(q, k_cache, v_cache, block_tables, seqs, visible, first, scale, family,
                                              k_scale, v_scale)
    if sinks is None:
        return out
    weight = torch.sigmoid(lse - sinks.float()[None, :])  # [rows, heads]: the keys' share beside the sink
    return (out.float() * weight[..., None]).to(out.dtype)


def paged_attention_rows_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                             row_seqs: torch.Tensor, row_visible: torch.Tensor, scale: float,
                             k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.paged_attention_rows_lse from the family kernel, whose rows are given just so (each
    row's sequence and count of visible positions); where no family covers the head_dim, the reference."""
    family = current_attention_family()
    if not covers(family, q.shape[-1]):
        return reference.paged_attention_rows_lse(q, k_cache, v_cache, block_tables, row_seqs, row_visible, scale,
                                                  k_scale, v_scale)
    out, lse = load().decode_attention_lse(q, k_cache, v_cache, block_tables, row_seqs.to(torch.int32),
                                           row_visible.to(torch.int32), scale, family, k_scale, v_scale)
    return out, lse


def mla_attention_rows(q, k_cache, v_cache, block_tables, row_seqs, row_visible, scale, kv_lora_rank):
    """kernels.mla_reference.mla_attention_rows in one C++ call (kernels/csrc/mla_decode.cpp): (weighted c_kv
    [rows, heads, kv_lora_rank] in q's dtype, lse [rows, heads] fp32)."""
    out, lse = load().mla_attention_rows(q.contiguous(), k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
                                         row_seqs.to(torch.int32).contiguous(),
                                         row_visible.to(torch.int32).contiguous(), float(scale), int(kv_lora_rank))
    return out, lse


def merge_attention_states(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.merge_attention_states in one C++ call (kernels/csrc/attention_merge.cpp)."""
    out, lse = load().merge_attention_states(outputs, lses)
    return out, lse


def query_rows(context_lens, query_start_loc):
    """Each query row's sequence and the positions it sees: a chunk of n queries over a context of c
    positions ends at the context's end, so its i-th row sees c - n + i + 1 of them."""
    counts = query_start_loc[1:] - query_start_loc[:-1]
    seqs = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), counts)
    first_row = torch.repeat_interleave(query_start_loc[:-1], counts)
    visible = (context_lens.repeat_interleave(counts) - counts.repeat_interleave(counts)
               + torch.arange(len(seqs), dtype=first_row.dtype) - first_row + 1)
    return seqs, visible.to(torch.int32)


@functools.cache
def covers(family: str, head_dim: int) -> bool:
    """Whether `family`'s decode attention kernel covers this head_dim here."""
    module = load()
    return module.decode_attention_covers(family, head_dim)


def _decode(q, k_cache, v_cache, block_tables, plan, scale, k_scale: float = 1.0, v_scale: float = 1.0):
    return load().decode_attention(q, k_cache, v_cache, block_tables, plan.decode_seqs, plan.decode_lens, scale,
                                   current_attention_family(), k_scale, v_scale)


def attention_family() -> str:
    """The family whose decode attention runs here: avx512 where the CPU and the build have it, else avx2
    (the portable loop where neither covers the head_dim, or below AVX2)."""
    module = load()
    return isa.family_for("attention", isa.cpu_flags(), module is not None and module.attention_avx512_available())


_pinned_attention: str | None = None


def pin_attention_family(family: str | None) -> None:
    """Run every later attention of this process on `family` ("portable", "avx2", "avx512"; None: this
    CPU's best again), for benchmarks that compare the families in one process."""
    global _pinned_attention
    if family not in (None, "portable", "avx2", "avx512"):
        raise ValueError(f"no attention family {family!r} (portable, avx2, avx512)")
    _pinned_attention = family


def current_attention_family() -> str:
    """The family the next decode attention runs on: the pinned one, else this CPU's best."""
    return _pinned_attention or _best_attention_family()


_best_attention_family = functools.cache(attention_family)  # once per process


def silu_and_mul(x):
    return load().silu_and_mul(x)


def add_lora(y, x, lora_a, lora_bt, token_slots) -> None:
    """lora_bt: B transposed, [slots, R, out] (kernels/csrc/lora_ops.h)."""
    load().lora_add(y, x, lora_a, lora_bt, token_slots)


def fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start=0):
    moe_reference.check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    return load().fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start)


def pack_bf16_weight(weight, family: str | None = None):
    """W [N, K] in bf16, re-laid for the linear_bf16 of a kernel family (kernels/csrc/bf16_linear.h):
    by default the best this CPU runs (bf16_family)."""
    return load().pack_bf16_weight(weight, family or bf16_family())


def bf16_family() -> str:
    """The family whose linear_bf16 runs here: avx512_bf16 where the CPU and the build have it, else avx2."""
    module = load()
    return isa.family_for("bf16", isa.cpu_flags(), module is not None and module.bf16_avx512_available())


def linear_bf16(x, packed, out_features, bias=None):
    """x W^T + b in x's dtype (fp32 or bf16) from a packed bf16 W; sums in fp32, as torch's bf16 linear
    (the avx512_bf16 layout takes x in bf16: fp32 x is rounded first)."""
    return load().linear_bf16(x, packed, out_features, bias)


def quant_isa() -> str:
    """The family quant_linear was compiled for ("avx2"), or "none" (no AVX2 build, or no build at all)."""
    module = load()
    return module.quant_isa() if module is not None else "none"


def quant_family() -> str:
    """The family of the quantised products here: avx512_bf16 (avx512_vnni's, and the fp32 products of many rows
    on vdpbf16ps), avx512_vnni (fp32 products 16 lanes wide, w8a8's int8 ones on vpdpbusd), avx512 (the fp32
    ones 16 wide) where the CPU and the build have them, else avx2."""
    module = load()
    flags = isa.cpu_flags()
    if module is not None and not module.quant_bf16_available():  # a compiler without avx512bf16 intrinsics
        flags = flags - {"avx512_bf16"}
    return isa.family_for("quant", flags, module is not None and module.quant_isa() != "none")


def quant_takes(qs: torch.Tensor) -> bool:
    """Whether the built kernels take weights of qs's dtype (4-bit, int8; fp8 where the build decodes it)."""
    return qs.dtype != torch.float8_e4m3fn or _fp8_built()


@functools.cache
def _fp8_built() -> bool:
    module = load()
    return module is not None and hasattr(module, "quant_fp8")


def quant_linear(x, qs, scales, mins, bias=None, int8_activations=False, family: str | None = None):
    """x W^T + b in x's dtype, W quantised in groups along K (kernels/quant_reference.py has the layouts)."""
    return load().quant_linear(x, qs, scales, mins, bias, int8_activations, family or current_quant_family())


_pinned_quant: str | None = None


def pin_quant_family(family: str | None) -> None:
    """Run every later quantised product of this process on `family` ("avx2", "avx512", "avx512_vnni",
    "avx512_bf16"; None:
    this CPU's best again), for benchmarks that compare the families in one process."""
    global _pinned_quant
    if family not in (None, *isa.KERNELS["quant"]):
        raise ValueError(f"no quantised kernels for the family {family!r} ({', '.join(isa.KERNELS['quant'])})")
    _pinned_quant = family


_quant_family = functools.cache(quant_family)  # once per process: the products of a model keep one family


def current_quant_family() -> str:
    """The family the next quantised product runs on: the pinned one, else this CPU's best."""
    return _pinned_quant or _quant_family()
