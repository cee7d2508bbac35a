#include <torch/extension.h>

std::vector<torch::Tensor> gemv_bf16(torch::Tensor x, std::vector<torch::Tensor> ws, std::string mode);
torch::Tensor gdn_decode_step(torch::Tensor mixed, torch::Tensor conv_state, torch::Tensor conv_w, torch::Tensor a,
                              torch::Tensor b, torch::Tensor A_log, torch::Tensor dt_bias, torch::Tensor state,
                              torch::Tensor z, torch::Tensor norm_w, int64_t num_k_heads, double eps, bool bf16);

std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor w,
                                    double eps);

std::vector<torch::Tensor> gemv_q8(torch::Tensor x, std::vector<torch::Tensor> qs, std::vector<torch::Tensor> scales,
                                   std::string mode);
std::vector<torch::Tensor> gemv_q4(torch::Tensor x, std::vector<torch::Tensor> qs, std::vector<torch::Tensor> scales,
                                   std::vector<torch::Tensor> zeros, int64_t G, std::string mode);

torch::Tensor causal_conv1d(torch::Tensor x, torch::Tensor conv_state, torch::Tensor conv_w);
torch::Tensor dequantize_q4(torch::Tensor q, torch::Tensor scales, torch::Tensor zeros, int64_t G,
                            c10::ScalarType dtype);
torch::Tensor attention_decode_step(torch::Tensor qg, torch::Tensor k, torch::Tensor v, torch::Tensor q_norm_w,
                                    torch::Tensor k_norm_w, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                                    torch::Tensor values, torch::Tensor lengths, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  m.def("gemv_bf16", &gemv_bf16, "x [M<=4, K] bf16 · each w [N, K]ᵀ bf16 -> [M, N] per weight (mode fp32|bf16|swiglu)",
        arg("x"), arg("ws"), arg("mode"));
  m.def("gemv_q8", &gemv_q8, "x [M<=4, K] bf16 · each int8 W [N, K]ᵀ (bf16 row scales) -> [M, N] per weight",
        arg("x"), arg("qs"), arg("scales"), arg("mode"));
  m.def("gemv_q4", &gemv_q4, "x [M<=4, K] bf16 · each int4 W (stored layout, groups of G) -> [M, N] per weight",
        arg("x"), arg("qs"), arg("scales"), arg("zeros"), arg("G"), arg("mode"));
  m.def("dequantize_q4", &dequantize_q4, "int4 stored layout -> dense weight (bf16 or fp32)");
  m.def("attention_decode_step", &attention_decode_step,
        "q/k norm, RoPE, KV write, attention and output gate for one new token per sequence");
  m.def("rms_norm", &rms_norm, "zero-centred RMSNorm: (x [+ residual], normed)");
  m.def("causal_conv1d", &causal_conv1d, "DeltaNet short conv over a prefill chunk, token-major (state in place)");
  m.def("gdn_decode_step", &gdn_decode_step, "fused Gated DeltaNet decode step (state updated in place)");
}
