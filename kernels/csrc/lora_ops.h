// Multi-LoRA's product on CPU (stage_worker/lora.py LoRALinear; kernels/reference.py add_lora is its oracle).
#pragma once

#include <ATen/ATen.h>  // (not torch/extension.h: its Python bindings cost each file ~20 s of compiling)

// y[t] += B[s] (A[s] x[t]) for each token t whose slot s = token_slots[t] is >= 0 (y, x: [T, out] and [T, in];
// A: [slots, R, in]; B^T: [slots, R, out], B transposed; token_slots: int32 [T]), in place. fp32 or bf16 (fp32 sums; A x[t]
// kept in fp32 between the two products; each y element rounded once). One call for every adapter of a
// step: for decode-sized steps the torch reference's four ops per adapter cost more than the arithmetic.
void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& token_slots);
