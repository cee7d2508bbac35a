// A sparse MoE block as one native call (layer_stack.h: MoE): the router, each used expert's SwiGLU and down
// projections in its weight format, and the gated shared expert, with no Python between them. From Python the
// 35B-A3B's 40 MoE layers cost ~20 tensor ops each per token around 19 kernel calls.
#include "layer_stack.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>

namespace qwenrt {

namespace {

constexpr int64_t kGroupedRows = 4;  // the rows per expert on average from which the grouped int4 path pays

// expert e's rows [first, first + n) of a bank's piece, or nothing where the format has no such piece
std::vector<at::Tensor> rows_of(const std::optional<at::Tensor>& piece, int64_t e, int64_t first, int64_t n) {
  if (!piece) return {};
  return {piece->select(0, e).narrow(0, first, n)};
}

// expert e's rows of a bank as the weights of a Projection: one slice per (first, n)
Projection expert_slices(const ExpertBank& bank, int64_t e, const std::vector<std::pair<int64_t, int64_t>>& parts) {
  std::vector<at::Tensor> weights, scales, zeros;
  for (const auto& [first, n] : parts) {
    weights.push_back(bank.weight.select(0, e).narrow(0, first, n));
    for (auto& s : rows_of(bank.scales, e, first, n)) scales.push_back(s);
    for (auto& z : rows_of(bank.zeros, e, first, n)) zeros.push_back(z);
  }
  return Projection(bank.format, weights, scales, zeros, bank.group_size);
}

// rows [first, first + n) of an int4 weight [.., K/2] (stored layout) with its bf16 scales and zeros [.., K/G]
Int4Matrix int4_rows(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros, int64_t G, int64_t first,
                     int64_t n) {
  const int64_t K = 2 * q.size(-1), groups = K / G;
  return {q.data_ptr<uint8_t>() + first * (K / 2),
          reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()) + first * groups,
          reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::BFloat16>()) + first * groups, n, K, G};
}

// whether the tensors are contiguous uint8 codes or bf16 scales and zeros, as Int4Matrix reads them
bool int4_tensors(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors)
    if (!t.is_contiguous() || (t.scalar_type() != at::kByte && t.scalar_type() != at::kBFloat16)) return false;
  return true;
}

}  // namespace

MoE::MoE(Projection router, const ExpertBank& gate_up, const ExpertBank& down,
         std::optional<Projection> shared_gate_up, std::optional<Projection> shared_down, int64_t top_k, bool grouped,
         bool renormalize)
    : router_(std::move(router)), shared_gate_up_(std::move(shared_gate_up)), shared_down_(std::move(shared_down)),
      top_k_(top_k), renormalize_(renormalize) {
  TORCH_CHECK(shared_gate_up_.has_value() == shared_down_.has_value(), "MoE: a shared expert has both projections");
  TORCH_CHECK(router_.outputs() == (shared_gate_up_ ? 2 : 1),
              "MoE: the router projects to the expert logits (and the shared-expert gate where there is one)");
  TORCH_CHECK(!shared_gate_up_ || (shared_gate_up_->outputs() == 2 && shared_gate_up_->runs.size() == 1 &&
                                   shared_down_->outputs() == 1),
              "MoE: the shared expert has a gate and an up projection of one format, and a down projection");
  const at::Tensor &wu = gate_up.weight, &wd = down.weight;
  TORCH_CHECK(wu.dim() == 3 && wd.dim() == 3 && wu.size(0) == wd.size(0) && wu.size(1) % 2 == 0,
              "MoE: expert banks gate_up [E, 2I, *] and down [E, D, *]");
  const int64_t E = wu.size(0), I = wu.size(1) / 2, D = wd.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "MoE: top_k in 1..E");
  for (int64_t e = 0; e < E; ++e) {
    gate_up_.push_back(expert_slices(gate_up, e, {{0, I}, {I, I}}));
    down_.push_back(expert_slices(down, e, {{0, D}}));
  }
  if (!grouped || gate_up.format != "q4" || down.format != "q4") return;
  if (!int4_tensors({wu, *gate_up.scales, *gate_up.zeros, wd, *down.scales, *down.zeros})) return;
  const int64_t G = gate_up.group_size, Gd = down.group_size;
  for (int64_t e = 0; e < E; ++e)
    int4_.push_back({int4_rows(wu, *gate_up.scales, *gate_up.zeros, G, 2 * I * e, I),
                     int4_rows(wu, *gate_up.scales, *gate_up.zeros, G, 2 * I * e + I, I),
                     int4_rows(wd, *down.scales, *down.zeros, Gd, D * e, D)});
  if (!grouped_q4_fits(int4_)) {
    int4_.clear();
    return;
  }
  if (!shared_gate_up_) return;
  const Projection::Run &su = shared_gate_up_->runs[0], &sd = shared_down_->runs[0];
  if (su.format != "q4" || sd.format != "q4" || shared_down_->runs.size() != 1) return;
  const std::vector<at::Tensor> shared = {su.weights[0], su.scales[0], su.zeros[0], su.weights[1], su.scales[1],
                                          su.zeros[1], sd.weights[0], sd.scales[0], sd.zeros[0]};
  if (!int4_tensors(shared)) return;
  int4_.push_back({int4_rows(su.weights[0], su.scales[0], su.zeros[0], su.group_size, 0, su.weights[0].size(0)),
                   int4_rows(su.weights[1], su.scales[1], su.zeros[1], su.group_size, 0, su.weights[1].size(0)),
                   int4_rows(sd.weights[0], sd.scales[0], sd.zeros[0], sd.group_size, 0, sd.weights[0].size(0))});
  int4_shared_ = grouped_q4_fits(int4_);
  if (!int4_shared_) int4_.pop_back();
}

Projection::Run MoE::merged_gate_up(const std::vector<int64_t>& experts) const {
  Projection::Run merged = gate_up_[experts[0]].runs[0];
  for (size_t j = 1; j < experts.size(); ++j) {
    const Projection::Run& run = gate_up_[experts[j]].runs[0];
    merged.weights.insert(merged.weights.end(), run.weights.begin(), run.weights.end());
    merged.scales.insert(merged.scales.end(), run.scales.begin(), run.scales.end());
    merged.zeros.insert(merged.zeros.end(), run.zeros.begin(), run.zeros.end());
  }
  return merged;
}

at::Tensor MoE::operator()(const at::Tensor& h) const {
  const int64_t N = h.size(0), E = static_cast<int64_t>(gate_up_.size());
  const auto routed = router_(h, "bf16");  // [N, E] expert logits (then [N, 1] shared-expert gate logits)
  const auto probs = routed[0].softmax(-1, at::kFloat);
  const auto picked = probs.topk(top_k_, -1);  // weights, indices [N, A]
  const auto& top = std::get<0>(picked);
  const auto weight = (renormalize_ ? top.div(top.sum(-1, true)) : top).to(at::kBFloat16).contiguous();
  const auto index = std::get<1>(picked).contiguous();
  // each expert's rows and the slot of its weight there, experts in ascending order
  std::vector<std::vector<int64_t>> rows(E), slots(E);
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t a = 0; a < top_k_; ++a) {
      rows[idx[n * top_k_ + a]].push_back(n);
      slots[idx[n * top_k_ + a]].push_back(a);
    }
  std::vector<int64_t> used;
  for (int64_t e = 0; e < E; ++e)
    if (!rows[e].empty()) used.push_back(e);
  // grouped once the experts get a few rows each on average: with fewer, transposing every used expert's weights
  // costs more than the GEMV calls (35B-A3B block, CPU time: 512 rows 231 vs 413 ms, 64 rows 101 vs 68 ms)
  if (N > gemv::kMaxRows && N * top_k_ >= kGroupedRows * E && !int4_.empty())
    return grouped(h, shared_gate_up_ ? routed[1] : at::Tensor(), weight.data_ptr<at::BFloat16>(), rows, slots);
  // one row (a decode step's token): every used expert's gate and up in one call, one pass over the threads
  std::vector<at::Tensor> acts;
  if (N == 1) acts = merged_gate_up(used)(h, "swiglu");
  auto out = at::zeros_like(h);
  const auto* w = weight.data_ptr<at::BFloat16>();
  for (size_t j = 0; j < used.size(); ++j) {
    const int64_t e = used[j], n = static_cast<int64_t>(rows[e].size());
    const auto which = longs(rows[e]);
    auto scale = at::empty({n, 1}, weight.options());
    auto* s = scale.data_ptr<at::BFloat16>();
    for (int64_t r = 0; r < n; ++r) s[r] = w[rows[e][r] * top_k_ + slots[e][r]];
    const auto act = N == 1 ? acts[j] : gate_up_[e](h.index_select(0, which), "swiglu")[0];
    out.index_add_(0, which, down_[e](act, "bf16")[0].mul(scale));
  }
  if (!shared_gate_up_) return out;
  const auto shared = (*shared_down_)((*shared_gate_up_)(h, "swiglu")[0], "bf16")[0];
  return out.add(routed[1].sigmoid().mul(shared));
}

at::Tensor MoE::grouped(const at::Tensor& h, const at::Tensor& shared_gate, const at::BFloat16* w,
                       const std::vector<std::vector<int64_t>>& rows,
                       const std::vector<std::vector<int64_t>>& slots) const {
  const int64_t N = h.size(0), E = static_cast<int64_t>(gate_up_.size());
  std::vector<Int4Expert> experts;
  std::vector<std::vector<int64_t>> tokens;
  std::vector<std::vector<float>> weights;
  for (int64_t e = 0; e < E; ++e) {
    if (rows[e].empty()) continue;
    experts.push_back(int4_[e]);
    tokens.push_back(rows[e]);
    weights.emplace_back();
    for (size_t r = 0; r < rows[e].size(); ++r)
      weights.back().push_back(static_cast<float>(w[rows[e][r] * top_k_ + slots[e][r]]));
  }
  if (!shared_gate_up_) return grouped_experts_q4(h, experts, tokens, weights);
  const auto gate = shared_gate.to(at::kFloat).sigmoid().contiguous();  // [N, 1]
  if (int4_shared_) {
    experts.push_back(int4_.back());
    tokens.emplace_back(N);
    for (int64_t n = 0; n < N; ++n) tokens.back()[n] = n;
    weights.emplace_back(gate.data_ptr<float>(), gate.data_ptr<float>() + N);
    return grouped_experts_q4(h, experts, tokens, weights);
  }
  const auto shared = (*shared_down_)((*shared_gate_up_)(h, "swiglu")[0], "bf16")[0];
  return grouped_experts_q4(h, experts, tokens, weights).add(shared_gate.sigmoid().mul(shared));
}

}  // namespace qwenrt
