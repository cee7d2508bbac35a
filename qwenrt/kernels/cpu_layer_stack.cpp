// The decode step's layer loop in C++ (layer_stack.h). On a small model most of a step was the Python around ~8
// kernel calls per layer (each call's argument conversion and dispatch costs more than its arithmetic there).
#include "layer_stack.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>

#include <algorithm>
#include <cstring>

#include "kernels.h"

namespace qwenrt {

at::Tensor longs(const std::vector<int64_t>& values) {
  auto t = at::empty({static_cast<int64_t>(values.size())}, at::kLong);
  if (!values.empty()) std::memcpy(t.data_ptr<int64_t>(), values.data(), values.size() * sizeof(int64_t));
  return t;
}

Projection::Projection(std::string format, std::vector<at::Tensor> weights, std::vector<at::Tensor> scales,
                       std::vector<at::Tensor> zeros, int64_t group_size)
    : runs{{std::move(format), std::move(weights), std::move(scales), std::move(zeros), group_size}} {
  const std::string& f = runs[0].format;
  TORCH_CHECK(f == "bf16" || f == "q8" || f == "q4" || f == "q8g" || f == "q4g" || f == "q4k",
              "Projection: format bf16, q8, q4, q8g, q4g or q4k");
}

Projection::Projection(const std::vector<Projection>& parts) {
  for (const Projection& part : parts) runs.insert(runs.end(), part.runs.begin(), part.runs.end());
  TORCH_CHECK(!runs.empty(), "Projection: no parts");
}

std::vector<at::Tensor> Projection::Run::operator()(const at::Tensor& x, const std::string& mode) const {
  if (format == "bf16") return gemv_bf16(x, weights, mode);
  if (format == "q8") return gemv_q8(x, weights, scales, mode);
  if (format == "q8g") return gemv_q8g(x, weights, scales, zeros, group_size, mode);
  if (format == "q4g") return gemv_q4g(x, weights, scales, zeros, mode);
  if (format == "q4k") return gemv_q4k(x, weights, scales, mode);
  return gemv_q4(x, weights, scales, zeros, group_size, mode);
}

std::vector<at::Tensor> Projection::operator()(const at::Tensor& x, const std::string& mode) const {
  TORCH_CHECK(mode != "swiglu" || runs.size() == 1, "Projection: swiglu takes a gate and an up weight of one format");
  auto call = [&](const at::Tensor& rows) {
    if (runs.size() == 1) return runs[0](rows, mode);  // the common case: no gathering copy
    std::vector<at::Tensor> out;
    for (const Run& run : runs) {
      auto part = run(rows, mode);
      out.insert(out.end(), part.begin(), part.end());
    }
    return out;
  };
  constexpr int64_t kRows = gemv::kMaxRows;
  if (x.dim() != 2 || x.size(0) <= kRows) return call(x);
  std::vector<std::vector<at::Tensor>> groups;  // kRows rows at a time, each group one pass over the weights
  for (int64_t r = 0; r < x.size(0); r += kRows) groups.push_back(call(x.narrow(0, r, std::min(kRows, x.size(0) - r))));
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < groups[0].size(); ++i) {
    std::vector<at::Tensor> pieces;
    for (const auto& g : groups) pieces.push_back(g[i]);
    out.push_back(at::cat(pieces));
  }
  return out;
}

void Projection::add_adapter(int64_t output, int64_t slot, at::Tensor A, at::Tensor Bt, double scale) {
  const int64_t n = static_cast<int64_t>(outputs());
  TORCH_CHECK(0 <= output && output < n && slot >= 1, "Projection.add_adapter: output in [0, ", n, "), slot >= 1");
  TORCH_CHECK(A.dim() == 2 && Bt.dim() == 2 && A.size(0) == Bt.size(0) && A.scalar_type() == at::kFloat &&
              Bt.scalar_type() == at::kFloat, "Projection.add_adapter: A [r, K] and Bt [r, N] fp32");
  adapters.resize(n);
  auto& slots = adapters[output];
  if (static_cast<int64_t>(slots.size()) <= slot) slots.resize(slot + 1);
  slots[slot] = Adapter{A.contiguous(), Bt.contiguous(), scale};
}

std::vector<at::Tensor> Projection::operator()(const at::Tensor& x, const std::string& mode,
                                               const std::vector<int64_t>& slots) const {
  const bool adapted = !adapters.empty() && std::any_of(slots.begin(), slots.end(), [](int64_t s) { return s; });
  if (!adapted) return (*this)(x, mode);
  TORCH_CHECK(mode == "bf16" || mode == "swiglu", "Projection: adapters in modes bf16 and swiglu");
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == x.size(0), "Projection: a slot per row");
  auto out = (*this)(x, "bf16");
  const at::Tensor xc = x.contiguous();
  for (size_t i = 0; i < adapters.size(); ++i) {
    for (size_t s = 1; s < adapters[i].size(); ++s) {
      if (!adapters[i][s]) continue;
      std::vector<int64_t> rows;
      for (int64_t m = 0; m < x.size(0); ++m)
        if (slots[m] == static_cast<int64_t>(s)) rows.push_back(m);
      const Adapter& a = *adapters[i][s];
      if (!rows.empty()) lora_add_rows(xc, out[i], a.A, a.Bt, a.scale, longs(rows));
    }
  }
  if (mode == "swiglu") return {at::silu(out[0]).mul(out[1])};
  return out;
}

size_t Projection::outputs() const {
  size_t n = 0;
  for (const Run& run : runs) n += run.weights.size();
  return n;
}

at::Tensor Projection::rows(const at::Tensor& ids) const {
  TORCH_CHECK(runs.size() == 1 && runs[0].weights.size() == 1, "Projection.rows: one weight");
  const Run& run = runs[0];
  if (run.format == "bf16") return run.weights[0].index_select(0, ids);
  if (run.format == "q8g" || run.format == "q4g" || run.format == "q4k") {
    const int64_t K = run.format == "q8g" ? run.weights[0].size(1) : 2 * run.weights[0].size(1);
    const auto zeros = run.zeros.empty() ? c10::nullopt : c10::optional<at::Tensor>(run.zeros[0]);
    return dequantize_group_rows(ids, run.weights[0], run.scales[0], zeros, run.group_size,
                                 at::empty({ids.size(0), K}, run.scales[0].options().dtype(at::kBFloat16)));
  }
  const int64_t K = run.format == "q4" ? 2 * run.weights[0].size(1) : run.weights[0].size(1);
  const auto zeros = run.format == "q4" ? c10::optional<at::Tensor>(run.zeros[0]) : c10::nullopt;
  return dequantize_rows(ids, run.weights[0], run.scales[0], zeros, run.group_size,
                         at::empty({ids.size(0), K}, run.scales[0].options()));
}

void LayerStack::add_deltanet(int64_t slot, at::Tensor input_norm, at::Tensor post_norm, Projection project,
                              Projection out, at::Tensor conv_w, at::Tensor A_log, at::Tensor dt_bias,
                              at::Tensor norm_w, int64_t num_k_heads, int64_t num_v_heads, int64_t head_v_dim,
                              double mixer_eps) {
  TORCH_CHECK(project.outputs() == 4, "LayerStack: a DeltaNet layer projects to qkv, z, b, a");
  layers_.push_back({slot, true, input_norm, post_norm, std::move(project), std::move(out), {}, {}, nullptr, conv_w,
                     A_log, dt_bias, norm_w, num_k_heads, num_v_heads, head_v_dim, {}, {}, 0, 0, mixer_eps, false});
}

void LayerStack::add_attention(int64_t slot, at::Tensor input_norm, at::Tensor post_norm, Projection project,
                               Projection out, at::Tensor q_norm, at::Tensor k_norm, int64_t num_heads,
                               int64_t head_dim, double mixer_eps, bool gated) {
  TORCH_CHECK(project.outputs() == 3, "LayerStack: an attention layer projects to q|gate, k, v");
  layers_.push_back({slot, false, input_norm, post_norm, std::move(project), std::move(out), {}, {}, nullptr, {}, {},
                     {}, {}, 0, 0, 0, q_norm, k_norm, num_heads, head_dim, mixer_eps, gated});
}

void LayerStack::add_mlp(Projection gate_up, Projection down) {
  TORCH_CHECK(!layers_.empty() && !layers_.back().gate_up && !layers_.back().moe,
              "LayerStack.add_mlp: add a layer without an MLP first");
  TORCH_CHECK(gate_up.outputs() == 2 && gate_up.runs.size() == 1 && down.outputs() == 1,
              "LayerStack.add_mlp: a gate and an up projection of one format, and a down projection");
  layers_.back().gate_up = std::move(gate_up);
  layers_.back().down = std::move(down);
}

void LayerStack::add_moe(MoE moe) {
  TORCH_CHECK(!layers_.empty() && !layers_.back().gate_up && !layers_.back().moe,
              "LayerStack.add_moe: add a layer without an MLP first");
  layers_.back().moe = std::make_shared<const MoE>(std::move(moe));
}

std::vector<int64_t> LayerStack::linear_slots() const {
  std::vector<int64_t> slots;
  for (const Layer& layer : layers_)
    if (layer.linear) slots.push_back(layer.slot);
  return slots;
}

namespace {

const at::Tensor& store(const std::vector<Stores>& stores, size_t sequence, int64_t slot, const char* what) {
  TORCH_CHECK(sequence < stores.size() && slot < static_cast<int64_t>(stores[sequence].size()) &&
              stores[sequence][slot].has_value(), "LayerStack.run: sequence ", sequence, " has no ", what,
              " store for layer slot ", slot);
  return *stores[sequence][slot];
}

at::Tensor join(std::vector<at::Tensor>& parts) { return parts.size() == 1 ? parts[0] : at::cat(parts); }

}  // namespace

std::pair<at::Tensor, std::vector<std::vector<at::Tensor>>> LayerStack::run(
    at::Tensor x, at::Tensor final_norm, at::Tensor cos, at::Tensor sin, std::vector<int64_t> counts,
    std::vector<Stores> conv, std::vector<Stores> recurrent, std::vector<Stores> keys, std::vector<Stores> values,
    std::vector<at::Tensor> lengths, std::vector<int64_t> adapters) const {
  const size_t S = counts.size();
  TORCH_CHECK(adapters.empty() || adapters.size() == S, "LayerStack.run: an adapter slot per sequence, or none");
  int64_t N = 0;
  for (const int64_t n : counts) {
    TORCH_CHECK(n >= 1, "LayerStack.run: every sequence has a row");
    N += n;
  }
  TORCH_CHECK(x.dim() == 2 && x.size(0) == N && lengths.size() == S && conv.size() == S && recurrent.size() == S &&
              keys.size() == S && values.size() == S, "LayerStack.run: rows, counts and stores disagree");
  for (const Layer& layer : layers_) TORCH_CHECK(layer.gate_up || layer.moe, "LayerStack.run: a layer has no MLP");
  std::vector<int64_t> slots;  // per row, its sequence's adapter slot
  for (size_t b = 0; b < adapters.size(); ++b) slots.insert(slots.end(), counts[b], adapters[b]);
  std::vector<std::vector<at::Tensor>> saved(S);
  std::optional<at::Tensor> delta;  // the last layer's MLP output, still to be added to x
  for (const Layer& layer : layers_) {
    auto normed = rms_norm(x, delta, layer.input_norm, eps_);
    x = normed[0];
    const auto p = layer.project(normed[1], "bf16", slots);
    std::vector<at::Tensor> parts;
    int64_t start = 0;
    for (size_t s = 0; s < S; ++s) {
      const int64_t n = counts[s];
      if (layer.linear) {
        const at::Tensor& cs = store(conv, s, layer.slot, "conv");
        const at::Tensor& rs = store(recurrent, s, layer.slot, "recurrent");
        const auto z = p[1].narrow(0, start, n).view({n, layer.num_v_heads, layer.head_v_dim});
        const auto mixed = p[0].narrow(0, start, n), b = p[2].narrow(0, start, n), a = p[3].narrow(0, start, n);
        if (n == 1) {
          parts.push_back(gdn_decode_step(mixed, cs, layer.conv_w, a, b, layer.A_log, layer.dt_bias, rs, z,
                                          layer.norm_w, layer.num_k_heads, layer.mixer_eps, true));
        } else {  // successive tokens in one call, keeping the state after each but the last
          std::vector<int64_t> conv_shape(cs.sizes().begin(), cs.sizes().end());
          std::vector<int64_t> state_shape(rs.sizes().begin(), rs.sizes().end());
          conv_shape[0] = state_shape[0] = n - 1;
          auto saved_conv = at::empty(conv_shape, cs.options()), saved_state = at::empty(state_shape, rs.options());
          parts.push_back(gdn_decode_steps(mixed, cs, layer.conv_w, a, b, layer.A_log, layer.dt_bias, rs, z,
                                           layer.norm_w, layer.num_k_heads, layer.mixer_eps, true, saved_conv,
                                           saved_state));
          saved[s].push_back(saved_conv);
          saved[s].push_back(saved_state);
        }
      } else {
        const auto qg = p[0].narrow(0, start, n).view({n, layer.num_heads, (1 + layer.gated) * layer.head_dim});
        parts.push_back(attention_decode_step(qg, p[1].narrow(0, start, n), p[2].narrow(0, start, n), layer.q_norm,
                                              layer.k_norm, cos.narrow(0, start, n), sin.narrow(0, start, n),
                                              store(keys, s, layer.slot, "key"), store(values, s, layer.slot, "value"),
                                              lengths[s], layer.mixer_eps, layer.gated));
      }
      start += n;
    }
    normed = rms_norm(x, layer.out(join(parts), "bf16", slots)[0], layer.post_norm, eps_);
    x = normed[0];
    delta = layer.moe ? (*layer.moe)(normed[1])
                      : (*layer.down)((*layer.gate_up)(normed[1], "swiglu", slots)[0], "bf16", slots)[0];
  }
  return {rms_norm(x, delta, final_norm, eps_)[1], std::move(saved)};
}

}  // namespace qwenrt
