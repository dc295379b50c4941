// EmbedRun: the input embedding's E and EW passes on this rank's shard and their collectives
// (see embed_run.h).
#include "runtime/embed_run.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "runtime/errors.h"
#include "zbpipe/error.h"
#include "zbpipe/vocab.h"

namespace zbpipe::runtime {

EmbedRun::EmbedRun(P2P& p2p, std::shared_ptr<EmbedHandle> handle, const Program& program)
    : p2p_(p2p), handle_(std::move(handle)), pp_(program.pp), rank_(p2p.rank()), root_(embedding_root(program)),
      microbatches_(program.microbatches), shard_(handle_->shard()), slots_(program.microbatches) {}

EmbedRun::Slot& EmbedRun::slot(int mb) {
  ZB_CHECK(mb >= 0 && mb < microbatches_, "embedding microbatch ", mb, " out of range");
  return slots_[static_cast<size_t>(mb)];
}

std::string EmbedRun::name(Kind k, int mb) const { return to_string(Action(rank_, k, mb)); }

void EmbedRun::begin(const StepData& step, std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  weight_ = handle_->weight();
  std::vector<at::Tensor> ids = handle_->ids(step);
  ZB_CHECK(static_cast<int>(ids.size()) == microbatches_, "the vocabulary-parallel embedding got token ids for ",
           ids.size(), " microbatches, the program runs ", microbatches_);
  for (int mb = 0; mb < microbatches_; ++mb) {
    ZB_CHECK(ids[mb].sizes() == ids[0].sizes(), "token ids of microbatch ", mb, " have shape ", ids[mb].sizes(),
             ", microbatch 0's ", ids[0].sizes(), ": every microbatch of a step has the same shape");
    Slot& s = slot(mb);
    s = Slot{};
    s.shape = ids[mb].sizes().vec();
    s.ids = ids[mb].reshape({-1}).to(at::kLong);
  }
}

void EmbedRun::wait(const std::shared_ptr<Batch>& batch, Kind k, int mb, int64_t& wait_ns) {
  if (pp_ == 1) return;  // one shard: nothing crosses
  ZB_CHECK(batch, "'", name(k, mb), "' was not posted before it was needed");
  const auto t0 = std::chrono::steady_clock::now();
  const std::string what = k == Kind::BCAST_E ? detail::str(name(k, mb), " (from rank ", root_, ")")
                                              : detail::str(name(k, mb), " (from every rank)");
  p2p_.wait(batch, timeout_, what);
  wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

void EmbedRun::e_pass(int mb) {
  Slot& s = slot(mb);
  at::NoGradGuard no_grad;
  const int64_t rows = shard_.end - shard_.begin;
  const at::Tensor in_shard = (s.ids >= shard_.begin) & (s.ids < shard_.end);
  const at::Tensor local = (s.ids - shard_.begin).clamp(0, rows - 1);
  // Exact zeros off the shard (a fill, not a product), so the reduction's sum is exact.
  s.out = weight_.detach().index_select(0, local).masked_fill_(in_shard.logical_not().unsqueeze(1), 0);
}

void EmbedRun::post_reduce(int mb) {
  Slot& s = slot(mb);
  ZB_CHECK(s.out.defined(), "'", name(Kind::REDUCE_E, mb), "' before its E");
  if (pp_ == 1) return;
  s.reduce = p2p_.post_collective({CollectiveOp::Type::ReduceSum, root_, s.out}, timeout_, name(Kind::REDUCE_E, mb));
}

at::Tensor EmbedRun::output(int mb, int64_t& wait_ns) {
  Slot& s = slot(mb);
  wait(s.reduce, Kind::REDUCE_E, mb, wait_ns);
  ZB_CHECK(s.out.defined(), "stage 0's forward of microbatch ", mb, " before the embedding's E");
  std::vector<int64_t> shape = s.shape;
  shape.push_back(shard_.dim);
  at::Tensor out = s.out.view(shape).detach();  // a leaf: the stage's forward makes it require grad
  s.out = at::Tensor();
  return out;
}

void EmbedRun::set_grad(int mb, at::Tensor grad) {
  Slot& s = slot(mb);
  s.grad = grad.detach().reshape({-1, shard_.dim}).to(weight_.scalar_type()).contiguous();
}

void EmbedRun::post_broadcast(int mb) {
  Slot& s = slot(mb);
  if (rank_ != root_) s.grad = at::empty({s.ids.numel(), shard_.dim}, weight_.options().requires_grad(false));
  ZB_CHECK(s.grad.defined(), "'", name(Kind::BCAST_E, mb), "' on the root before stage 0's backward");
  if (pp_ == 1) return;
  s.bcast = p2p_.post_collective({CollectiveOp::Type::Broadcast, root_, s.grad}, timeout_, name(Kind::BCAST_E, mb));
}

void EmbedRun::ew_pass(int mb, int64_t& wait_ns) {
  Slot& s = slot(mb);
  if (rank_ != root_) wait(s.bcast, Kind::BCAST_E, mb, wait_ns);
  at::NoGradGuard no_grad;
  const int64_t rows = shard_.end - shard_.begin;
  at::Tensor counted = (s.ids >= shard_.begin) & (s.ids < shard_.end);
  if (shard_.padding_idx >= 0) counted.logical_and_(s.ids != shard_.padding_idx);
  const at::Tensor local = (s.ids - shard_.begin).clamp(0, rows - 1);
  const at::Tensor g = s.grad.masked_fill(counted.logical_not().unsqueeze(1), 0);
  // This microbatch's gradient of the rows, then added as autograd's AccumulateGrad adds one.
  at::Tensor rows_grad = at::zeros_like(weight_, at::MemoryFormat::Contiguous).index_add_(0, local, g);
  at::Tensor& grad = weight_.mutable_grad();
  if (grad.defined()) grad.add_(rows_grad);
  else grad = std::move(rows_grad);
  if (auto& hook = torch::autograd::impl::post_acc_grad_hooks(weight_)) (*hook)(weight_);
  s.grad = at::Tensor();
}

void EmbedRun::end() {
  for (Slot& s : slots_) s = Slot{};
  weight_ = at::Tensor();
}

}  // namespace zbpipe::runtime
