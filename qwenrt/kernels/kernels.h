// The kernels' entry points (each defined in its cpu_*.cpp): what bindings.cpp exposes to Python and the layer
// loop (cpu_layer_stack.cpp) calls. Including it where they are defined checks the signatures agree.
#pragma once

#include <ATen/core/Tensor.h>
#include <optional>
#include <string>
#include <vector>

std::vector<at::Tensor> gemv_bf16(at::Tensor x, std::vector<at::Tensor> ws, std::string mode);
std::vector<at::Tensor> gemv_q8(at::Tensor x, std::vector<at::Tensor> qs, std::vector<at::Tensor> scales,
                                std::string mode);
std::vector<at::Tensor> gemv_q4(at::Tensor x, std::vector<at::Tensor> qs, std::vector<at::Tensor> scales,
                                std::vector<at::Tensor> zeros, int64_t G, std::string mode);
std::vector<at::Tensor> gemv_q8g(at::Tensor x, std::vector<at::Tensor> qs, std::vector<at::Tensor> scales,
                                 std::vector<at::Tensor> zeros, int64_t G, std::string mode);
std::vector<at::Tensor> gemv_q4g(at::Tensor x, std::vector<at::Tensor> qs, std::vector<at::Tensor> scales,
                                 std::vector<at::Tensor> zeros, std::string mode);
std::vector<at::Tensor> gemv_q4k(at::Tensor x, std::vector<at::Tensor> qs, std::vector<at::Tensor> headers,
                                 std::string mode);
at::Tensor gemm_bf16(at::Tensor x, at::Tensor w);
at::Tensor gemm_q8(at::Tensor x, at::Tensor q, at::Tensor scales);
at::Tensor gemm_q4(at::Tensor x, at::Tensor q, at::Tensor scales, at::Tensor zeros, int64_t G);
at::Tensor gemm_q8g(at::Tensor x, at::Tensor q, at::Tensor scales, c10::optional<at::Tensor> zeros, int64_t G);
at::Tensor gemm_q4g(at::Tensor x, at::Tensor q, at::Tensor scales, at::Tensor zeros);
at::Tensor gemm_q4k(at::Tensor x, at::Tensor q, at::Tensor headers);
at::Tensor dequantize_q4(at::Tensor q, at::Tensor scales, at::Tensor zeros, int64_t G, at::Tensor out);
at::Tensor dequantize_rows(at::Tensor ids, at::Tensor q, at::Tensor scales, c10::optional<at::Tensor> zeros,
                           int64_t G, at::Tensor out);
at::Tensor dequantize_group_rows(at::Tensor ids, at::Tensor q, at::Tensor scales, c10::optional<at::Tensor> zeros,
                                 int64_t G, at::Tensor out);
at::Tensor gdn_decode_step(at::Tensor mixed, at::Tensor conv_state, at::Tensor conv_w, at::Tensor a, at::Tensor b,
                           at::Tensor A_log, at::Tensor dt_bias, at::Tensor state, at::Tensor z, at::Tensor norm_w,
                           int64_t num_k_heads, double eps, bool bf16);
at::Tensor gdn_decode_steps(at::Tensor mixed, at::Tensor conv_state, at::Tensor conv_w, at::Tensor a, at::Tensor b,
                            at::Tensor A_log, at::Tensor dt_bias, at::Tensor state, at::Tensor z, at::Tensor norm_w,
                            int64_t num_k_heads, double eps, bool bf16, at::Tensor saved_conv,
                            at::Tensor saved_state);
std::vector<at::Tensor> rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor w, double eps);
at::Tensor causal_conv1d_silu(at::Tensor x, at::Tensor conv_state, at::Tensor conv_w);
at::Tensor attention_decode_step(at::Tensor qg, at::Tensor k, at::Tensor v, at::Tensor q_norm_w, at::Tensor k_norm_w,
                                 at::Tensor cos, at::Tensor sin, at::Tensor keys, at::Tensor values,
                                 at::Tensor lengths, double eps, bool gated = true);
// causal attention of q [T, H, Dh] at positions start.. over a sequence's stores [1, Hkv, cap, Dh] -> [T, H, Dh]
at::Tensor attention_prefill(at::Tensor q, at::Tensor keys, at::Tensor values, int64_t start);
// y [M, N] bf16 in place: rows[i]'s y += scale·Btᵀ·(A·x) (A [r, K], Bt [r, N] fp32), one bf16 rounding (LoRA)
void lora_add_rows(at::Tensor x, at::Tensor y, at::Tensor A, at::Tensor Bt, double scale, at::Tensor rows);
at::Tensor argmax_rows(at::Tensor x);
at::Tensor argmax_allowed_rows(at::Tensor x, at::Tensor allowed);
