// A greedy speculative cycle in one native call (layer_stack.h: GreedyCycle). On qwenrt-tiny a cycle through
// Python (verify, the picks, commit, the MTP head's draft: ~15 native calls and the tensors between them) took
// 1.0 ms, twice a plain step; the arithmetic is a fraction of that.
#include "layer_stack.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>

#include "kernels.h"

namespace qwenrt {

GreedyCycle::GreedyCycle(LayerStack stack, at::Tensor final_norm, Projection head, Projection embed,
                         at::Tensor norm_embed, at::Tensor norm_hidden, Projection fc, LayerStack mtp,
                         at::Tensor mtp_norm, Projection draft_head, double mtp_eps)
    : stack_(std::move(stack)), mtp_(std::move(mtp)), final_norm_(final_norm), norm_embed_(norm_embed),
      norm_hidden_(norm_hidden), mtp_norm_(mtp_norm), head_(std::move(head)), embed_(std::move(embed)),
      fc_(std::move(fc)), draft_head_(std::move(draft_head)), mtp_eps_(mtp_eps) {
  TORCH_CHECK(embed_.outputs() == 1, "GreedyCycle: embed is one table");
}

namespace {

at::Tensor join(std::vector<at::Tensor>& parts) { return parts.size() == 1 ? parts[0] : at::cat(parts); }

// rows [first, first + n) of a [P, R] table for each (first, n), one after another
at::Tensor table_rows(const at::Tensor& table, const std::vector<int64_t>& firsts, const std::vector<int64_t>& counts) {
  std::vector<at::Tensor> parts;
  for (size_t b = 0; b < firsts.size(); ++b) {
    TORCH_CHECK(firsts[b] >= 0 && firsts[b] + counts[b] <= table.size(0), "GreedyCycle: positions ", firsts[b],
                "..", firsts[b] + counts[b], " beyond the rotary table's ", table.size(0), " rows");
    parts.push_back(table.narrow(0, firsts[b], counts[b]));
  }
  return join(parts);
}

at::Tensor slots(int64_t start, int64_t n, const at::TensorOptions& options) {
  return at::arange(start, start + n, options.dtype(at::kLong));
}

}  // namespace

at::Tensor GreedyCycle::draft_rows(const at::Tensor& hidden, const at::Tensor& next, const at::Tensor& cos,
                                   const at::Tensor& sin, const std::vector<int64_t>& counts,
                                   const std::vector<Stores>& keys, const std::vector<Stores>& values,
                                   std::vector<at::Tensor> lengths) const {
  const auto e = rms_norm(embed_.rows(next), c10::nullopt, norm_embed_, mtp_eps_)[1];
  const auto h = rms_norm(hidden, c10::nullopt, norm_hidden_, mtp_eps_)[1];
  const auto z = fc_(at::cat({e, h}, 1), "bf16")[0];
  const std::vector<Stores> none(counts.size());  // the head's one layer is attention: no DeltaNet state
  return mtp_.run(z, mtp_norm_, cos, sin, counts, none, none, keys, values, std::move(lengths)).first;
}

GreedyCycle::Result GreedyCycle::run(at::Tensor ids, std::vector<int64_t> counts, std::vector<int64_t> positions,
                                     std::vector<int64_t> ks, at::Tensor cos, at::Tensor sin,
                                     std::vector<Stores> conv, std::vector<Stores> recurrent,
                                     std::vector<Stores> keys, std::vector<Stores> values,
                                     std::vector<int64_t> lengths, at::Tensor pending, at::Tensor pending_next,
                                     std::vector<int64_t> pending_counts, std::vector<at::Tensor> mtp_keys,
                                     std::vector<at::Tensor> mtp_values, std::vector<int64_t> mtp_lengths,
                                     std::vector<int64_t> adapters) const {
  const size_t S = counts.size();
  TORCH_CHECK(positions.size() == S && ks.size() == S && lengths.size() == S && pending_counts.size() == S &&
              mtp_keys.size() == S && mtp_values.size() == S && mtp_lengths.size() == S && ids.dim() == 1 &&
              ids.scalar_type() == at::kLong, "GreedyCycle.run: sequences and their arguments disagree");
  const auto options = ids.options();
  std::vector<at::Tensor> where;  // the cache slots each sequence's rows write
  for (size_t b = 0; b < S; ++b) where.push_back(slots(lengths[b], counts[b], options));
  Result r;
  auto verified = stack_.run(embed_.rows(ids), final_norm_, table_rows(cos, positions, counts),
                             table_rows(sin, positions, counts), counts, conv, recurrent, keys, values, where,
                             adapters);
  r.hidden = verified.first;
  r.saved = std::move(verified.second);
  r.logits = head_(r.hidden, "bf16_fp32")[0];
  r.picks = argmax_rows(r.logits);
  const int64_t* pick = r.picks.data_ptr<int64_t>();
  const int64_t* input = ids.data_ptr<int64_t>();
  const auto linear = stack_.linear_slots();

  // accept, and keep the DeltaNet state after the last accepted input; gather the head's rows
  std::vector<int64_t> drafting, rows, row_positions, row_starts;  // sequences that draft, and their rows
  std::vector<at::Tensor> hidden_rows, next_rows;
  int64_t start = 0, pending_start = 0, most = 0;
  for (size_t b = 0; b < S; ++b) {
    const int64_t n = counts[b];
    int64_t a = 0;
    while (a < n - 1 && pick[start + a] == input[start + a + 1]) ++a;
    r.accepted.push_back(a);
    if (a < n - 1) {  // saved[b]: conv [n-1, ...], recurrent [n-1, ...] per DeltaNet layer
      for (size_t j = 0; j < linear.size(); ++j) {
        conv[b][linear[j]]->copy_(r.saved[b][2 * j].narrow(0, a, 1));
        recurrent[b][linear[j]]->copy_(r.saved[b][2 * j + 1].narrow(0, a, 1));
      }
    }
    const int64_t c = pending_counts[b];
    if (ks[b] > 0) {
      drafting.push_back(static_cast<int64_t>(b));
      rows.push_back(c + a + 1);
      row_positions.push_back(positions[b] - c);
      row_starts.push_back(mtp_lengths[b]);
      if (c > 0) {
        hidden_rows.push_back(pending.narrow(0, pending_start, c));
        next_rows.push_back(pending_next.narrow(0, pending_start, c));
      }
      hidden_rows.push_back(r.hidden.narrow(0, start, a + 1));
      next_rows.push_back(r.picks.narrow(0, start, a + 1));
      most = std::max(most, ks[b]);
    }
    start += n;
    pending_start += c;
  }
  r.drafts.resize(S);
  if (drafting.empty()) return r;

  // the MTP head over each drafting sequence's pending rows and its accepted rows (the token after each of those is
  // its pick), then over its own output for each further draft
  const size_t R = drafting.size();
  std::vector<Stores> head_keys, head_values;
  for (const int64_t b : drafting) {
    head_keys.push_back({mtp_keys[b]});
    head_values.push_back({mtp_values[b]});
  }
  std::vector<at::Tensor> head_where;
  for (size_t j = 0; j < R; ++j) head_where.push_back(slots(row_starts[j], rows[j], options));
  auto out = draft_rows(join(hidden_rows), join(next_rows), table_rows(cos, row_positions, rows),
                        table_rows(sin, row_positions, rows), rows, head_keys, head_values, head_where);
  std::vector<at::Tensor> last;  // each sequence's newest row
  int64_t row = 0;
  for (size_t j = 0; j < R; ++j) {
    row += rows[j];
    last.push_back(out.narrow(0, row - 1, 1));
  }
  auto h = join(last);  // [R, D]
  const std::vector<int64_t> ones(R, 1);
  for (int64_t i = 0; i < most; ++i) {
    const auto token = argmax_rows(draft_head_(h, "bf16_fp32")[0]);  // [R]
    const int64_t* t = token.data_ptr<int64_t>();
    for (size_t j = 0; j < R; ++j)
      if (i < ks[drafting[j]]) r.drafts[drafting[j]].push_back(t[j]);
    if (i + 1 == most) break;
    std::vector<int64_t> next_positions;
    head_where.clear();
    for (size_t j = 0; j < R; ++j) {
      next_positions.push_back(row_positions[j] + rows[j] + i);
      head_where.push_back(slots(row_starts[j] + rows[j] + i, 1, options));
    }
    h = draft_rows(h, token, table_rows(cos, next_positions, ones), table_rows(sin, next_positions, ones), ones,
                   head_keys, head_values, head_where);
  }
  return r;
}

}  // namespace qwenrt
