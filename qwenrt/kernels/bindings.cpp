// The Python module: only this file sees pybind11 and torch's Python bindings (the kernels include ATen's tensor
// headers alone: torch/extension.h costs ~30 s of compile per file, and every level is compiled on first use).
#include <ATen/core/Tensor.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"
#include "layer_stack.h"

using qwenrt::longs;  // token ids from a list: well under a microsecond; torch.tensor took ~9 us a cycle

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  m.def("gemv_bf16", &gemv_bf16, "x [M<=8, K] bf16 · each w [N, K]ᵀ bf16 -> [M, N] per weight (mode fp32|bf16|bf16_fp32|swiglu)",
        arg("x"), arg("ws"), arg("mode"));
  m.def("gemv_q8", &gemv_q8, "x [M<=8, K] bf16 · each int8 W [N, K]ᵀ (bf16 row scales) -> [M, N] per weight",
        arg("x"), arg("qs"), arg("scales"), arg("mode"));
  m.def("gemv_q4", &gemv_q4, "x [M<=8, K] bf16 · each int4 W (stored layout, groups of G) -> [M, N] per weight",
        arg("x"), arg("qs"), arg("scales"), arg("zeros"), arg("G"), arg("mode"));
  m.def("gemv_q8g", &gemv_q8g, "x [M<=8, K] bf16 · each int8 W [N, K]ᵀ in fp32-scaled groups of G (16, 32), "
        "zeros optional (GGUF blocks) -> [M, N] per weight",
        arg("x"), arg("qs"), arg("scales"), arg("zeros"), arg("G"), arg("mode"));
  m.def("gemv_q4g", &gemv_q4g, "x [M<=8, K] bf16 · each int4 W (stored layout) in fp32-scaled groups of 32 with zeros "
        "(GGUF blocks) -> [M, N] per weight",
        arg("x"), arg("qs"), arg("scales"), arg("zeros"), arg("mode"));
  m.def("gemv_q4k", &gemv_q4k, "x [M<=8, K] bf16 · each int4 W (stored layout, groups of 32) with GGUF block headers for "
        "scales and zeros (Q4_K's uint8 [N, K/256, 16] or Q4_0's fp16 d [N, K/32]) -> [M, N] per weight",
        arg("x"), arg("qs"), arg("headers"), arg("mode"));
  m.def("gemm_bf16", &gemm_bf16, "x [M, K] bf16 · bf16 W [N, K]ᵀ -> [M, N] bf16: prefill, fp32 products and sums",
        arg("x"), arg("w"));
  m.def("gemm_q8", &gemm_q8, "x [M, K] bf16 · int8 W [N, K]ᵀ (bf16 row scales) -> [M, N] bf16: prefill, int32 sums",
        arg("x"), arg("q"), arg("scales"));
  m.def("gemm_q4", &gemm_q4, "x [M, K] bf16 · int4 W (stored layout, groups of G) -> [M, N] bf16: prefill, x in 8 bits "
        "per group",
        arg("x"), arg("q"), arg("scales"), arg("zeros"), arg("G"));
  m.def("gemm_q8g", &gemm_q8g, "x [M, K] bf16 · int8 W [N, K]ᵀ in fp32-scaled groups of G (16, 32), zeros optional "
        "(GGUF blocks) -> [M, N] bf16: prefill, x in 16-bit fixed point, int32 sums per group",
        arg("x"), arg("q"), arg("scales"), arg("zeros"), arg("G"));
  m.def("gemm_q4g", &gemm_q4g, "x [M, K] bf16 · int4 W (stored layout) in fp32-scaled groups of 32 with zeros (GGUF "
        "blocks) -> [M, N] bf16: prefill, x in 8 bits per group",
        arg("x"), arg("q"), arg("scales"), arg("zeros"));
  m.def("gemm_q4k", &gemm_q4k, "x [M, K] bf16 · int4 W (stored layout) with GGUF block headers (Q4_K's, Q4_0's) -> [M, N] bf16: prefill, "
        "x in 8 bits per group",
        arg("x"), arg("q"), arg("headers"));
  m.def("dequantize_q4", &dequantize_q4, "int4 stored layout -> the dense weight written into out (bf16 or fp32)",
        arg("q"), arg("scales"), arg("zeros"), arg("G"), arg("out"));
  m.def("dequantize_rows", &dequantize_rows, "rows ids [N] of an int8 or int4 (stored layout) weight, dequantized "
        "into out [N, K] (bf16 or fp32): a token lookup in a quantized table",
        arg("ids"), arg("q"), arg("scales"), arg("zeros"), arg("G"), arg("out"));
  m.def("dequantize_group_rows", &dequantize_group_rows, "rows ids [N] of an int8 or int4 weight in fp32-scaled "
        "groups, dequantized into out [N, K] (bf16 or fp32): a token lookup in a GGUF-quantized table",
        arg("ids"), arg("q"), arg("scales"), arg("zeros"), arg("G"), arg("out"));
  m.def("attention_decode_step", &attention_decode_step,
        "q/k norm, RoPE, KV write, attention and output gate (where gated) for one new token per sequence",
        arg("qg"), arg("k"), arg("v"), arg("q_norm_w"), arg("k_norm_w"), arg("cos"), arg("sin"), arg("keys"),
        arg("values"), arg("lengths"), arg("eps"), arg("gated") = true);
  m.def("attention_prefill", &attention_prefill,
        "causal attention of q [T, H, Dh] (positions start..start+T-1) over a sequence's stores [1, Hkv, cap, Dh] "
        "-> [T, H, Dh]: key tiles with an online softmax, memory O(T·tile) whatever the context",
        arg("q"), arg("keys"), arg("values"), arg("start"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "zero-centred RMSNorm: (x [+ residual], normed)");
  m.def("causal_conv1d_silu", &causal_conv1d_silu,
        "DeltaNet short conv and its SiLU over a prefill chunk, token-major (state in place)");
  m.def("gdn_decode_step", &gdn_decode_step, "fused Gated DeltaNet decode step (state updated in place)");
  m.def("gdn_decode_steps", &gdn_decode_steps,
        "the fused step over T successive tokens of one sequence, the state after each but the last saved");
  m.def("lora_add_rows", &lora_add_rows, "LoRA at decode, in place: y[m] += scale·Btᵀ·(A·x[m]) for the listed rows, "
        "rounded to bf16 once", arg("x"), arg("y"), arg("A"), arg("Bt"), arg("scale"), arg("rows"));
  m.def("argmax_rows", &argmax_rows, "x [B, V] fp32 -> [B] int64: each row's first largest (first NaN), as torch.argmax",
        arg("x"));
  m.def("argmax_allowed_rows", &argmax_allowed_rows,
        "x [B, V] fp32, allowed [ceil(V / 32)] int32 packed bits -> [B] int64: argmax_rows with the tokens the "
        "mask does not allow at -inf", arg("x"), arg("allowed"));
  using qwenrt::ExpertBank, qwenrt::GreedyCycle, qwenrt::LayerStack, qwenrt::MoE, qwenrt::Projection;
  pybind11::class_<Projection>(m, "Projection",
                                "projections sharing one input, a GEMV call per run of one format (bf16, q8 or q4)")
      .def(pybind11::init<std::string, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          int64_t>(),
           arg("format"), arg("weights"), arg("scales"), arg("zeros"), arg("group_size"))
      .def(pybind11::init<std::vector<Projection>>(), arg("parts"), "the parts' projections, outputs in order")
      .def("__call__", [](const Projection& p, const at::Tensor& x, const std::string& mode) { return p(x, mode); },
           arg("x"), arg("mode"))
      .def("add_adapter", &Projection::add_adapter, arg("output"), arg("slot"), arg("A"), arg("Bt"), arg("scale"),
           "a LoRA adapter (A [r, K], Bt = Bᵀ [r, N] fp32) on output `output` for the rows of adapter slot `slot`");
  pybind11::class_<ExpertBank>(m, "ExpertBank", "E experts' stacked weights of one projection, in one format")
      .def(pybind11::init([](std::string format, at::Tensor weight, std::optional<at::Tensor> scales,
                             std::optional<at::Tensor> zeros, int64_t group_size) {
             return ExpertBank{std::move(format), std::move(weight), std::move(scales), std::move(zeros),
                               group_size};
           }),
           arg("format"), arg("weight"), arg("scales"), arg("zeros"), arg("group_size"));
  pybind11::class_<MoE>(m, "MoE", "a sparse MoE block bound once: router, experts and shared expert in one call")
      .def(pybind11::init<Projection, const ExpertBank&, const ExpertBank&, std::optional<Projection>,
                          std::optional<Projection>, int64_t, bool, bool>(),
           arg("router"), arg("gate_up"), arg("down"), arg("shared_gate_up"), arg("shared_down"), arg("top_k"),
           arg("grouped") = true, arg("renormalize") = true)
      .def("__call__", &MoE::operator(), arg("h"), pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<LayerStack>(m, "LayerStack", "decoder layers bound once; run() is a decode step's layers")
      .def(pybind11::init<double>(), arg("eps"))
      .def("add_deltanet", &LayerStack::add_deltanet)
      .def("add_attention", &LayerStack::add_attention)
      .def("add_mlp", &LayerStack::add_mlp, arg("gate_up"), arg("down"))
      .def("add_moe", &LayerStack::add_moe, arg("moe"))
      .def("run", &LayerStack::run, arg("x"), arg("final_norm"), arg("cos"), arg("sin"), arg("counts"), arg("conv"),
           arg("recurrent"), arg("keys"), arg("values"), arg("lengths"), arg("adapters") = std::vector<int64_t>{},
           pybind11::call_guard<pybind11::gil_scoped_release>(),
           "rows of successive tokens per sequence through every layer -> (final-normed hidden, saved states)");
  pybind11::class_<GreedyCycle>(m, "GreedyCycle",
                                 "a greedy speculative cycle (verify, accept, commit, MTP drafts) as one call")
      .def(pybind11::init<LayerStack, at::Tensor, Projection, Projection, at::Tensor, at::Tensor, Projection,
                          LayerStack, at::Tensor, Projection, double>())
      .def("run",
           [](const GreedyCycle& cycle, std::vector<int64_t> ids, std::vector<int64_t> counts,
              std::vector<int64_t> positions, std::vector<int64_t> ks, at::Tensor cos, at::Tensor sin,
              std::vector<qwenrt::Stores> conv, std::vector<qwenrt::Stores> recurrent,
              std::vector<qwenrt::Stores> keys, std::vector<qwenrt::Stores> values, std::vector<int64_t> lengths,
              at::Tensor pending, std::vector<int64_t> pending_next, std::vector<int64_t> pending_counts,
              std::vector<at::Tensor> mtp_keys, std::vector<at::Tensor> mtp_values,
              std::vector<int64_t> mtp_lengths, std::vector<int64_t> adapters) {
             auto r = cycle.run(longs(ids), counts, positions, ks, cos, sin, conv, recurrent, keys, values, lengths,
                                pending, longs(pending_next), pending_counts, mtp_keys, mtp_values, mtp_lengths,
                                adapters);
             return std::make_tuple(r.logits, r.picks, r.hidden, r.accepted, r.drafts, r.saved);
           },
           pybind11::call_guard<pybind11::gil_scoped_release>(),
           "ids and pending_next as lists of ints -> (logits [N, V] fp32, picks [N], hidden [N, D], accepted per "
           "sequence, drafts per sequence, saved states per sequence)");
}
