// VocabRun: the S and T passes of this rank's shard and their collectives (see vocab_run.h).
#include "runtime/vocab_run.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <thread>

#include "runtime/device.h"
#include "runtime/errors.h"
#include "runtime/head_lane.h"
#include "zbpipe/error.h"
#include "zbpipe/vocab.h"

namespace zbpipe::runtime {

namespace {
// An emulated pass's time, without using the CPU (VocabShard::emulate_s_ms).
void spend(double ms) {
  if (ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
}

// Adds `g` to the .grad of parameter `p`, then runs its post-accumulate-grad hooks, as
// autograd's AccumulateGrad does (once per microbatch: DDP-style reducers and FSDP's
// mixed-precision move hook there). A Python hook takes the GIL itself.
void accumulate(at::Tensor& p, at::Tensor g) {
  at::Tensor& grad = p.mutable_grad();
  if (grad.defined()) grad.add_(g);
  else grad = std::move(g);
  if (auto& hook = torch::autograd::impl::post_acc_grad_hooks(p)) (*hook)(p);
}
}  // namespace

VocabRun::VocabRun(P2P& p2p, std::shared_ptr<VocabHandle> handle, const Program& program)
    : p2p_(p2p), coll_(&p2p), handle_(std::move(handle)), pp_(program.pp), rank_(p2p.rank()),
      root_(vocab_root(program)), microbatches_(program.microbatches), shard_(handle_->shard()),
      slots_(program.microbatches) {
  if (p2p_.stream_ordered() && device_has_events(p2p_.device()))
    stream_ = c10::impl::getDeviceGuardImpl(p2p_.device().type())->getStreamFromGlobalPool(p2p_.device(), false);
}

void VocabRun::set_collectives(P2P& collectives) {
  ZB_CHECK(collectives.rank() == rank_ && collectives.size() == pp_, "the vocabulary collectives' group has rank ",
           collectives.rank(), " of ", collectives.size(), ", the pipeline's ", rank_, " of ", pp_);
  coll_ = &collectives;
  if (!stream_) lane_ = std::make_unique<HeadLane>();  // the host has no stream of its own to give it
}



VocabRun::Slot& VocabRun::slot(int mb) {
  ZB_CHECK(mb >= 0 && mb < microbatches_, "vocabulary microbatch ", mb, " out of range");
  return slots_[static_cast<size_t>(mb)];
}

std::string VocabRun::name(Kind k, int mb) const { return to_string(Action(rank_, k, mb)); }

void VocabRun::begin(const StepData& step, double loss_scale, std::chrono::milliseconds timeout,
                     const std::vector<TensorSpec>* hidden) {
  loss_scale_ = loss_scale;
  timeout_ = timeout;
  weight_ = handle_->weight();
  bias_ = handle_->bias();
  std::vector<at::Tensor> targets = handle_->targets(step);
  ZB_CHECK(static_cast<int>(targets.size()) == microbatches_, "the vocabulary head got targets for ",
           targets.size(), " microbatches, the program runs ", microbatches_);
  for (int mb = 0; mb < microbatches_; ++mb) {
    ZB_CHECK(targets[mb].sizes() == targets[0].sizes(), "targets of microbatch ", mb, " have shape ",
             targets[mb].sizes(), ", microbatch 0's ", targets[0].sizes(), ": every microbatch of a step "
             "has the same shape");
    Slot& s = slot(mb);
    s = Slot{};
    s.target = targets[mb].reshape({-1}).to(at::kLong);
  }
  if (!hidden) return;
  // The root: the last stage's output must be the head's input for these targets.
  std::vector<int64_t> want = targets[0].sizes().vec();
  want.push_back(shard_.in_features);
  const TensorSpec expected{want, weight_.scalar_type()};
  if (hidden->size() != 1 || (*hidden)[0] != expected)
    throw PipelineError(detail::str(
        "the last stage's output is ", to_string(*hidden), " but the vocabulary-parallel head takes ",
        to_string(expected), " (one tensor of the targets' shape ", targets[0].sizes(),
        " by the head's input width ", shard_.in_features, ", in the head's dtype)"));
}

void VocabRun::set_input(int mb, const at::Tensor& hidden) {
  Slot& s = slot(mb);
  s.hidden_shape = hidden.sizes().vec();
  s.hidden = hidden.reshape({-1, shard_.in_features}).contiguous();
}

void VocabRun::wait(const std::shared_ptr<Batch>& batch, Kind k, int mb, int64_t& wait_ns) {
  if (pp_ == 1) return;  // one shard: nothing crosses
  ZB_CHECK(batch, "'", name(k, mb), "' was not posted before it was needed");
  const auto t0 = std::chrono::steady_clock::now();
  const std::string what = k == Kind::BCAST_F ? detail::str(name(k, mb), " (from rank ", root_, ")")
                           : k == Kind::REDUCE_B ? detail::str(name(k, mb), " (from every rank)")
                                                 : detail::str(name(k, mb), " (from every rank)");
  coll_->wait(batch, timeout_, what);
  wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

void VocabRun::do_post_broadcast(int mb, const std::shared_ptr<c10::Event>& stages_done) {
  Slot& s = slot(mb);
  // The root's reads the last stage's output: on a device the head's stream first waits for
  // the stages' up to here. The others' go into a buffer of their own.
  if (stages_done) stages_done->block(*stream_);
  if (rank_ != root_)
    s.hidden = at::empty({s.target.numel(), shard_.in_features}, weight_.options().requires_grad(false));
  ZB_CHECK(s.hidden.defined(), "'", name(Kind::BCAST_F, mb), "' on the root before the last stage's F");
  if (stream_ && rank_ == root_) record_on_stream(s.hidden, *stream_);  // made on the stages' stream
  if (pp_ == 1) return;
  s.bcast = coll_->post_collective({CollectiveOp::Type::Broadcast, root_, s.hidden}, timeout_, name(Kind::BCAST_F, mb));
}

void VocabRun::do_s_pass(int mb, int64_t& wait_ns) {
  Slot& s = slot(mb);
  // The root's own S waits for its broadcast too where the head has a lane of its own (the
  // rendezvous model's rule; on Gloo the root needs nothing from it).
  if (rank_ != root_ || stream_ || lane_) wait(s.bcast, Kind::BCAST_F, mb, wait_ns);
  at::NoGradGuard no_grad;
  const at::Tensor w = weight_.detach();
  const int64_t n = s.target.numel();
  ZB_CHECK(s.hidden.size(0) == n, "the head's input of microbatch ", mb, " has ", s.hidden.size(0),
           " tokens, its targets ", n);
  at::Tensor z = at::linear(s.hidden, w, bias_.defined() ? bias_.detach() : at::Tensor()).to(at::kFloat);
  const at::Tensor m = std::get<0>(z.max(1));
  // The target's logit, on this shard (0 elsewhere).
  const at::Tensor in_shard = (s.target >= shard_.begin) & (s.target < shard_.end);
  const at::Tensor local = (s.target - shard_.begin).clamp(0, shard_.end - shard_.begin - 1);
  const at::Tensor logit = z.gather(1, local.unsqueeze(1)).squeeze(1).mul_(in_shard.to(at::kFloat));
  z.sub_(m.unsqueeze(1)).exp_();  // e = exp(z - m), in place
  const at::Tensor sum = z.sum(1);
  // p_r = e / s_r is never formed: T and u_r = p_r W_r = (e W_r) / s_r take the 1 / s_r on the
  // token side (an [N] vector instead of a pass over [N, V_r]).
  s.soft = z;
  s.part = at::matmul(s.soft.to(w.scalar_type()), w).to(at::kFloat).div_(sum.unsqueeze(1));
  s.picked = w.index_select(0, local).to(at::kFloat).mul_(in_shard.unsqueeze(1).to(at::kFloat));
  s.stats = at::zeros({pp_, 3, n}, m.options());
  s.stats[rank_][0].copy_(m);
  s.stats[rank_][1].copy_(sum);
  s.stats[rank_][2].copy_(logit);
  spend(shard_.emulate_s_ms);
}

void VocabRun::do_post_allreduce(int mb) {
  Slot& s = slot(mb);
  ZB_CHECK(s.stats.defined(), "'", name(Kind::ALLREDUCE_S, mb), "' before its S");
  if (pp_ == 1) return;
  s.stats_batch = coll_->post_collective({CollectiveOp::Type::AllReduceSum, -1, s.stats}, timeout_,
                                       name(Kind::ALLREDUCE_S, mb));
}

void VocabRun::statistics(int mb, int64_t& wait_ns) {
  Slot& s = slot(mb);
  if (s.stats_ready) return;
  wait(s.stats_batch, Kind::ALLREDUCE_S, mb, wait_ns);
  at::NoGradGuard no_grad;
  const at::Tensor maxes = s.stats.select(1, 0), sums = s.stats.select(1, 1);  // [pp, N]
  const at::Tensor top = std::get<0>(maxes.max(0));                            // M
  const at::Tensor share = (maxes - top.unsqueeze(0)).exp_().mul_(sums);       // s_q exp(m_q - M)
  const at::Tensor total = share.sum(0);                                       // S
  const at::Tensor logit = s.stats.select(1, 2).sum(0);
  const at::Tensor counted = (s.target != shard_.ignore_index).to(at::kFloat);
  const at::Tensor count = counted.sum();
  s.loss = ((top + total.log() - logit) * counted).sum() / count;
  s.grad = counted.mul(loss_scale_).div_(count);     // d loss / d token (x the loss scale)
  s.scale = share[rank_].div(total).mul_(s.grad);    // g alpha_r
  s.stats_ready = true;
}

void VocabRun::do_post_reduce(int mb, int64_t& wait_ns) {
  statistics(mb, wait_ns);
  Slot& s = slot(mb);
  at::NoGradGuard no_grad;
  // This rank's part of the head's input gradient: g (alpha_r u_r - w_r).
  at::Tensor part = s.part.mul_(s.scale.unsqueeze(1)).sub_(s.picked.mul_(s.grad.unsqueeze(1)));
  s.picked = at::Tensor();
  s.part = part.to(weight_.scalar_type()).contiguous();  // the head's input dtype (begin checks it)
  if (pp_ == 1) return;
  s.grad_batch = coll_->post_collective({CollectiveOp::Type::ReduceSum, root_, s.part}, timeout_,
                                      name(Kind::REDUCE_B, mb));
  if (lane_ && rank_ == root_) {  // the lane completes it for the backward (await_input_grad)
    wait(s.grad_batch, Kind::REDUCE_B, mb, wait_ns);
    lane_->mark(mb);
  }
}

void VocabRun::do_t_pass(int mb, int64_t& wait_ns) {
  statistics(mb, wait_ns);
  Slot& s = slot(mb);
  at::NoGradGuard no_grad;
  // G = g (alpha_r p_r - onehot): the softmax rows rescaled in place, the targets on this shard
  // lowered by g (a scatter of 0 off the shard: no host sync, unlike selecting the rows).
  at::Tensor g = s.soft.mul_(s.scale.div(s.stats[rank_][1]).unsqueeze(1));  // e g alpha_r / s_r = g alpha_r p_r
  s.soft = at::Tensor();
  const at::Tensor in_shard = (s.target >= shard_.begin) & (s.target < shard_.end);
  const at::Tensor local = (s.target - shard_.begin).clamp(0, shard_.end - shard_.begin - 1);
  g.scatter_add_(1, local.unsqueeze(1), s.grad.mul(in_shard.to(at::kFloat)).neg_().unsqueeze(1));
  const at::Tensor gw = g.to(weight_.scalar_type());
  accumulate(weight_, at::matmul(gw.t(), s.hidden.to(weight_.scalar_type())));
  if (bias_.defined()) accumulate(bias_, g.sum(0).to(bias_.scalar_type()));
  s.hidden = at::Tensor();
  spend(shard_.emulate_t_ms);
}

// ---- the actions, each on the head's lane --------------------------------------------------

template <typename F>
void VocabRun::on_lane(F&& f, int64_t& wait_ns) {
  if (lane_) {
    lane_->push([f = std::forward<F>(f)]() mutable {
      int64_t unused = 0;  // the lane's waits are its own time, not the action's
      f(unused);
    });
    return;
  }
  const OnHead head(stream_);
  f(wait_ns);
}

void VocabRun::post_broadcast(int mb) {
  std::shared_ptr<c10::Event> stages_done;
  if (stream_ && rank_ == root_) {  // the last stage's output is made on the stages' stream
    stages_done = std::make_shared<c10::Event>(p2p_.device().type());
    stages_done->record(current_stream(p2p_.device()));
  }
  int64_t unused = 0;
  on_lane([this, mb, stages_done](int64_t&) { do_post_broadcast(mb, stages_done); }, unused);
}

void VocabRun::s_pass(int mb, int64_t& wait_ns) {
  on_lane([this, mb](int64_t& w) { do_s_pass(mb, w); }, wait_ns);
}

void VocabRun::post_allreduce(int mb) {
  int64_t unused = 0;
  on_lane([this, mb](int64_t&) { do_post_allreduce(mb); }, unused);
}

void VocabRun::post_reduce(int mb, int64_t& wait_ns) {
  on_lane([this, mb](int64_t& w) { do_post_reduce(mb, w); }, wait_ns);
}

void VocabRun::t_pass(int mb, int64_t& wait_ns) {
  on_lane([this, mb](int64_t& w) { do_t_pass(mb, w); }, wait_ns);
}

void VocabRun::await_input_grad(int mb, int64_t& wait_ns) {
  Slot& s = slot(mb);
  if (lane_) {  // the lane posted and completed it (do_post_reduce)
    const auto t0 = std::chrono::steady_clock::now();
    if (!lane_->wait_mark(mb, t0 + timeout_))
      throw PipelineError(detail::str("waiting for ", name(Kind::REDUCE_B, mb), " (the head's lane) failed (timeout ",
                                      timeout_.count() / 1000.0, " s; a peer may have died or diverged)"));
    wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    s.grad_ready = true;
    return;
  }
  wait(s.grad_batch, Kind::REDUCE_B, mb, wait_ns);  // on the stages' stream: the backward's
  if (stream_) record_on_stream(s.part, current_stream(p2p_.device()));
  s.grad_ready = true;
}

at::Tensor VocabRun::input_grad(int mb) const {
  const Slot& s = slots_.at(static_cast<size_t>(mb));
  ZB_CHECK(s.grad_ready, "the head's input gradient of microbatch ", mb, " was not awaited");
  return s.part.view(s.hidden_shape);
}

at::Tensor VocabRun::loss(int mb) {
  int64_t unused = 0;
  if (lane_) lane_->drain();  // the step's actions ran: the statistics are there
  {
    const OnHead head(stream_);
    statistics(mb, unused);
  }
  if (stream_) record_on_stream(slot(mb).loss, current_stream(p2p_.device()));
  return slot(mb).loss;
}

void VocabRun::finish() {
  if (lane_) lane_->drain();
  if (coll_ != &p2p_) coll_->settle(timeout_);
  if (!stream_) return;
  c10::Event joined(p2p_.device().type());
  joined.record(*stream_);
  joined.block(current_stream(p2p_.device()));
}

void VocabRun::end() {
  if (lane_) {  // a failure: the lane's waits were aborted with the communication
    try {
      lane_->drain();
    } catch (const std::exception&) {
    }
    lane_->clear();
  }
  for (Slot& s : slots_) s = Slot{};
  weight_ = bias_ = at::Tensor();
}

}  // namespace zbpipe::runtime
