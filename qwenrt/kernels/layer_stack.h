// The decode step's layer loop as one native call (cpu_layer_stack.cpp): the kernels of every layer in order, with
// no Python between them. Shared by the kernels' sources and bindings.cpp, which exposes both classes.
#pragma once

#include <ATen/core/Tensor.h>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gemv_common.h"

namespace qwenrt {

// The projections of a layer that share one input: a run of weights in one format per GEMV call, bf16 weights
// [N_i, K], int8 weights with bf16 row scales, or int4 (stored layout) with bf16 scales and zeros in groups of
// `group_size`. Mostly one run; int4 keeps weights whose N its layout cannot hold in bf16 (qwenrt-tiny's DeltaNet b
// and a projections), which makes a layer's input projections two runs.
struct Projection {
  struct Run {
    // "bf16" | "q8" | "q4" | "q8g" | "q4g" | "q4k" (GGUF blocks: fp32-scaled groups; Q4_K's or Q4_0's headers)
    std::string format;
    std::vector<at::Tensor> weights, scales, zeros;
    int64_t group_size = 0;
    std::vector<at::Tensor> operator()(const at::Tensor& x, const std::string& mode) const;  // one GEMV call
  };
  std::vector<Run> runs;

  Projection(std::string format, std::vector<at::Tensor> weights, std::vector<at::Tensor> scales,
             std::vector<at::Tensor> zeros, int64_t group_size);
  // the parts' runs in order: their outputs, one after another
  explicit Projection(const std::vector<Projection>& parts);
  // x [M, K] bf16 -> one [M, N_i] per weight ("bf16"; "bf16_fp32" those values in fp32; "fp32" unrounded), or
  // silu(gate)·up [M, N] per (gate, up) pair ("swiglu", one run); more than gemv::kMaxRows rows go that many at a
  // time
  std::vector<at::Tensor> operator()(const at::Tensor& x, const std::string& mode) const;
  size_t outputs() const;  // the weights, over all runs
  // ids [N] int64 -> rows ids of the one weight, bf16 [N, K] (quantized ones dequantized as looked up): the token
  // lookup of a table bound as a Projection (a tied quantized model looks its tokens up in its head)
  at::Tensor rows(const at::Tensor& ids) const;

  // A LoRA adapter on one output (qwenrt/served_adapters.py): A [r, K] and Bt = Bᵀ [r, N], fp32
  struct Adapter {
    at::Tensor A, Bt;
    double scale;
  };
  // adapters[i][s]: output i's adapter of slot s (slot 0, the base alone, never has one)
  std::vector<std::vector<std::optional<Adapter>>> adapters;
  void add_adapter(int64_t output, int64_t slot, at::Tensor A, at::Tensor Bt, double scale);
  // operator() with row m through the adapters of slot slots[m] ("bf16" or "swiglu"): each output's bf16 rows then
  // lora_add_rows; swiglu then as torch's bf16 ops, silu(gate)·up. What qwenrt/served_adapters.py's modules compute
  // at decode sizes, bit for bit.
  std::vector<at::Tensor> operator()(const at::Tensor& x, const std::string& mode,
                                     const std::vector<int64_t>& slots) const;
};

// E experts' weights of one projection, stacked as published: gate_up [E, 2I, *] or down [E, D, *] in one format
// (as a Projection's), scales and zeros [E, ...] where the format has them.
struct ExpertBank {
  std::string format;
  at::Tensor weight;
  std::optional<at::Tensor> scales, zeros;
  int64_t group_size = 0;
};

// One int4 matrix (stored layout: rows [rows, K/2], bf16 scales and zeros [rows, K/G]) as raw pointers, and an
// expert's three: gate and up [I, K], down [D, I].
struct Int4Matrix {
  const uint8_t* q;
  const uint16_t* scales;
  const uint16_t* zeros;
  int64_t rows, K, G;
};
struct Int4Expert {
  Int4Matrix gate, up, down;
};

// Whether grouped_experts_q4 takes these experts (cpu_moe_gemm.cpp): one x width and group size for all, one down
// width and group size, rows and K in whole panels of its vectors.
bool grouped_q4_fits(const std::vector<Int4Expert>& experts);
// x [N, K] bf16; per expert its rows' tokens and weights -> per token Σ weight·down(silu(gate·x)·up·x) over the
// experts that have it, summed in fp32 in the experts' order and rounded once: [N, D] bf16. x and the SwiGLU go
// through the integer sums in 8 bits per row and group (within Σ|W|·d/2 per output of their exact products).
at::Tensor grouped_experts_q4(const at::Tensor& x, const std::vector<Int4Expert>& experts,
                              const std::vector<std::vector<int64_t>>& tokens,
                              const std::vector<std::vector<float>>& weights);

// A sparse MoE block (qwenrt/moe.py SparseMoeBlock) bound once: the router and the shared expert's gate as one
// projection, the experts' fused gate/up and down banks (each expert's slices are views, no copy) and the shared
// expert's SwiGLU MLP. At decode sizes its call computes what the block's modules compute (`dispatched`), op for op
// and rounding for rounding: fp32 softmax, top-k, weights renormalised (unless `renormalize` is off) in bf16, each used expert run once on its
// rows (ascending expert order, index_add into a bf16 sum), plus sigmoid(gate)·shared(x). At prefill sizes (more
// than gemv::kMaxRows rows, 4 or more per expert on average) int4 experts go through grouped_experts_q4 (the shared
// expert too where it is int4 of the same shapes: last, with weight sigmoid(gate) in fp32), unless `grouped` is
// off (the per-expert calls, kept for benchmarks).
class MoE {
 public:
  // router: outputs [N, E] expert logits then [N, 1] shared-expert gate logits (none without a shared expert)
  MoE(Projection router, const ExpertBank& gate_up, const ExpertBank& down, std::optional<Projection> shared_gate_up,
      std::optional<Projection> shared_down, int64_t top_k, bool grouped = true, bool renormalize = true);
  // h [N, D] bf16 (post-attention-normed) -> the block's output [N, D] bf16
  at::Tensor operator()(const at::Tensor& h) const;

 private:
  // the gate and up weights of `experts` as one run of (gate, up) pairs: swiglu over them all in one GEMV call
  Projection::Run merged_gate_up(const std::vector<int64_t>& experts) const;

  // the routed experts (each row's weight in w [N, top_k] at its slot) and the shared expert (weight
  // sigmoid(shared_gate) [N, 1]) through grouped_experts_q4
  at::Tensor grouped(const at::Tensor& h, const at::Tensor& shared_gate, const at::BFloat16* w,
                     const std::vector<std::vector<int64_t>>& rows,
                     const std::vector<std::vector<int64_t>>& slots) const;

  Projection router_;
  std::optional<Projection> shared_gate_up_, shared_down_;  // none: no shared expert (Qwen3-VL-MoE)
  std::vector<Projection> gate_up_, down_;  // per expert, one run each
  // per expert, then the shared expert where it fits too; empty: no grouped path. It points into the tensors the
  // Projections above hold (views of the same storage).
  std::vector<Int4Expert> int4_;
  bool int4_shared_ = false;
  int64_t top_k_;
  bool renormalize_;
};

// values as an int64 tensor [n] (token ids, row indices), copied at once
at::Tensor longs(const std::vector<int64_t>& values);

// One stored tensor per layer slot of a sequence (None where the layer is of the other kind).
using Stores = std::vector<std::optional<at::Tensor>>;

// Decoder layers (DeltaNet or gated attention, then a SwiGLU MLP or an MoE block) bound once; `run` takes a decode step's rows
// through all of them, as qwenrt/decode_plan.py's _run_layers does call for call (the results are bit-identical).
class LayerStack {
 public:
  explicit LayerStack(double eps) : eps_(eps) {}

  // conv_w [C, K], A_log, dt_bias [Hv], norm_w [Dv]: fp32, as GatedDeltaNet.fp32_parameters gives them
  void add_deltanet(int64_t slot, at::Tensor input_norm, at::Tensor post_norm, Projection project, Projection out,
                    at::Tensor conv_w, at::Tensor A_log, at::Tensor dt_bias, at::Tensor norm_w, int64_t num_k_heads,
                    int64_t num_v_heads, int64_t head_v_dim, double mixer_eps);
  // q_norm, k_norm [Dh] fp32 (stored w); gated: q_proj emits query | gate per head (Qwen3-VL: the query alone)
  void add_attention(int64_t slot, at::Tensor input_norm, at::Tensor post_norm, Projection project,
                     Projection out, at::Tensor q_norm, at::Tensor k_norm, int64_t num_heads, int64_t head_dim,
                     double mixer_eps, bool gated = true);
  // the MLP of the layer added last: a SwiGLU MLP (gate and up, down) or an MoE block
  void add_mlp(Projection gate_up, Projection down);
  void add_moe(MoE moe);

  // x [N, D] bf16: counts[b] successive tokens of sequence b, in sequence order; cos, sin [N, R] bf16; per sequence
  // its stores (conv, recurrent, keys, values, each a slot per layer) and lengths[b] (int64 [counts[b]], the cache
  // slots its rows write); adapters[b] the adapter slot of sequence b's rows (empty: none). Returns the final-normed
  // hidden states [N, D], then per sequence the DeltaNet states after each of its tokens but the last, [conv [n-1,
  // C, K-1], recurrent [n-1, Hv, Dk, Dv]] per DeltaNet layer in order (empty for a sequence of one row).
  std::pair<at::Tensor, std::vector<std::vector<at::Tensor>>> run(
      at::Tensor x, at::Tensor final_norm, at::Tensor cos, at::Tensor sin, std::vector<int64_t> counts,
      std::vector<Stores> conv, std::vector<Stores> recurrent, std::vector<Stores> keys,
      std::vector<Stores> values, std::vector<at::Tensor> lengths, std::vector<int64_t> adapters = {}) const;

  // the layer slots of the DeltaNet layers, in order (the order of run's saved states)
  std::vector<int64_t> linear_slots() const;

 private:
  struct Layer {
    int64_t slot;
    bool linear;
    at::Tensor input_norm, post_norm;
    Projection project, out;
    std::optional<Projection> gate_up, down;  // a dense MLP, or
    std::shared_ptr<const MoE> moe;  // an MoE block
    at::Tensor conv_w, A_log, dt_bias, norm_w;  // DeltaNet
    int64_t num_k_heads, num_v_heads, head_v_dim;
    at::Tensor q_norm, k_norm;  // attention
    int64_t num_heads, head_dim;
    double mixer_eps;
    bool gated;
  };
  std::vector<Layer> layers_;
  double eps_;
};

// A greedy speculative cycle as one native call (cpu_greedy_cycle.cpp): verify each sequence's inputs (its last
// token, then its drafts) through the model, pick each row's argmax, accept drafts while they equal the pick before
// them, keep the DeltaNet state of the last accepted input, then draft the next tokens with the MTP head from the
// accepted rows. What qwenrt/engine/runner.py's verify, commit and draft do call for call, without the Python
// between them (on qwenrt-tiny that Python cost more than the cycle's arithmetic).
class GreedyCycle {
 public:
  // the model: its layers, final norm, LM head and token embedding (a table [V, D] read by Projection::rows); the
  // MTP head: its pre-fc norms
  // (fp32), fc, its one layer, its final norm and the draft head (the LM head's first rows)
  GreedyCycle(LayerStack stack, at::Tensor final_norm, Projection head, Projection embed, at::Tensor norm_embed,
              at::Tensor norm_hidden, Projection fc, LayerStack mtp, at::Tensor mtp_norm, Projection draft_head,
              double mtp_eps);

  struct Result {
    at::Tensor logits;  // [N, V] fp32
    at::Tensor picks;  // [N] int64: each row's argmax, the token after its input
    at::Tensor hidden;  // [N, D] bf16 final-normed hidden states
    std::vector<int64_t> accepted;  // per sequence, drafts accepted
    std::vector<std::vector<int64_t>> drafts;  // per sequence, its ks[b] drafts for the next cycle
    std::vector<std::vector<at::Tensor>> saved;  // per sequence, as LayerStack::run's
  };

  // ids [N] int64: counts[b] inputs of sequence b (its last token, then its drafts), in sequence order; positions[b]
  // the position of its first, lengths[b] its cache length; cos, sin [P, R] bf16 rows of positions 0..P-1 (each
  // sequence's rows are read at its positions, up to positions[b] + counts[b] + ks[b] - 2). The MTP head reads, for
  // the sequences with ks[b] > 0, first pending[b] rows of `pending` [C, D] (hidden states of the inputs just
  // before, with their next tokens pending_next [C]), then the accepted rows, and writes its cache (mtp_keys,
  // mtp_values) from slot mtp_lengths[b]. The caches' lengths are the caller's to move on; the DeltaNet state of a
  // sequence whose drafts were not all accepted is that after its last accepted input. adapters[b]: the adapter
  // slot of sequence b's rows through the model (empty: none; the MTP head has none).
  Result run(at::Tensor ids, std::vector<int64_t> counts, std::vector<int64_t> positions, std::vector<int64_t> ks,
             at::Tensor cos, at::Tensor sin, std::vector<Stores> conv, std::vector<Stores> recurrent,
             std::vector<Stores> keys, std::vector<Stores> values, std::vector<int64_t> lengths,
             at::Tensor pending, at::Tensor pending_next, std::vector<int64_t> pending_counts,
             std::vector<at::Tensor> mtp_keys, std::vector<at::Tensor> mtp_values,
             std::vector<int64_t> mtp_lengths, std::vector<int64_t> adapters = {}) const;

 private:
  // the MTP head over rows (hidden [M, D], the next tokens [M]) of the given sequences -> its normed outputs [M, D]
  at::Tensor draft_rows(const at::Tensor& hidden, const at::Tensor& next, const at::Tensor& cos,
                        const at::Tensor& sin, const std::vector<int64_t>& counts, const std::vector<Stores>& keys,
                        const std::vector<Stores>& values, std::vector<at::Tensor> lengths) const;

  LayerStack stack_, mtp_;
  at::Tensor final_norm_, norm_embed_, norm_hidden_, mtp_norm_;
  Projection head_, embed_, fc_, draft_head_;
  double mtp_eps_;
};

}  // namespace qwenrt
