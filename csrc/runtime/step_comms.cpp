// Posting and tracking a step's messages; see step_comms.h.
#include "runtime/step_comms.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "runtime/trace.h"
#include "zbpipe/error.h"

namespace zbpipe::runtime {

namespace {
bool is_recv(Kind k) { return k == Kind::RECV_F || k == Kind::RECV_B; }
}  // namespace

Inbox& StepComms::inbox(const Comm& k) {
  Slot& sl = stages_[k.local].slot(k.mb);
  return k.kind == Kind::RECV_F ? sl.fwd_in : sl.grad_in;
}

void StepComms::add_recv_ops(int c, std::vector<P2POp>& ops) {
  const Comm& k = comms_[c];
  const StageShapes& shapes = stages_[k.local].shapes;
  const auto& specs = k.kind == Kind::RECV_F ? shapes.sigs.inputs.specs : shapes.grad_specs;
  auto& bufs = inbox(k).tensors;
  bufs.clear();
  auto opts = at::TensorOptions().device(p2p_.device());
  for (size_t i = 0; i < specs.size(); ++i) {
    // Integral buffers (ids, indices) start zeroed: after an abort, kernels queued behind a
    // receive that never came still run, and an embedding or gather reading garbage ids would
    // raise a device assert, a sticky CUDA error that rules out the in-process recovery. Their
    // bytes are few; floating buffers (the large ones) stay uninitialised.
    const bool integral = at::isIntegralType(specs[i].dtype, /*includeBool=*/true);
    bufs.push_back(integral ? at::zeros(specs[i].shape, opts.dtype(specs[i].dtype))
                            : at::empty(specs[i].shape, opts.dtype(specs[i].dtype)));
    ops.push_back(P2POp{false, k.peer, k.tag + static_cast<int>(i), bufs.back()});
  }
}

void StepComms::begin(bool prepost, std::chrono::milliseconds timeout) {
  preposted_ = prepost;
  timeout_ = timeout;
  if (!prepost) return;
  for (int c = 0; c < static_cast<int>(comms_.size()); ++c) {
    if (!is_recv(comms_[c].kind)) continue;
    std::vector<P2POp> ops;
    add_recv_ops(c, ops);
    if (ops.empty()) continue;  // nothing differentiable crosses: no message
    Inbox& in = inbox(comms_[c]);
    in.pending = p2p_.post(std::move(ops));
    in.comm = c;
  }
}

void StepComms::post(const Entry& e) {
  std::vector<P2POp> ops;
  for (int c = e.comm_begin; c < e.comm_end; ++c) {
    const Comm& k = comms_[c];
    if (is_recv(k.kind)) {
      if (!preposted_) add_recv_ops(c, ops);
      continue;
    }
    ZB_CHECK(k.kind == Kind::SEND_F || k.kind == Kind::SEND_B, "a comm entry holds '", kind_name(k.kind), "'");
    Slot& sl = stages_[k.local].slot(k.mb);
    auto& outs = k.kind == Kind::SEND_F ? sl.fwd_out : sl.grad_out;
    for (size_t i = 0; i < outs.size(); ++i)
      ops.push_back(P2POp{true, k.peer, k.tag + static_cast<int>(i), outs[i].contiguous()});
    outs.clear();  // the batch alone holds them now, and only as long as P2P::post says
  }
  if (ops.empty()) return;
  auto batch = p2p_.post(std::move(ops));
  if (!preposted_)  // every receive of the batch completes with it
    for (int c = e.comm_begin; c < e.comm_end; ++c)
      if (is_recv(comms_[c].kind)) {
        Inbox& in = inbox(comms_[c]);
        in.pending = batch;
        in.comm = c;
      }
}

void StepComms::wait(Inbox& in, int64_t& wait_ns) {
  if (!in.pending) return;  // an empty message (nothing differentiable crossed)
  const int64_t t0 = now_ns();
  p2p_.wait(in.pending, timeout_, comms_[in.comm].desc, /*host_complete=*/false, in.comm);
  wait_ns += now_ns() - t0;
  in.pending.reset();
}

void StepComms::finish() {
  p2p_.settle(timeout_);  // every send and stream wait of the step seen complete, by its deadline
}

void StepComms::abandon() {
  p2p_.abandon_watched();  // the sends too
  for (auto& stage : stages_)
    for (auto& sl : stage.slots) {
      P2P::abandon(std::move(sl.fwd_in.pending));
      P2P::abandon(std::move(sl.grad_in.pending));
    }
}

}  // namespace zbpipe::runtime
