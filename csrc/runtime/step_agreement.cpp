// StepAgreement: the program's fingerprint once, then every step's shape set (step_agreement.h).
#include "runtime/step_agreement.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include <algorithm>
#include <map>

#include "runtime/errors.h"
#include "runtime/handshake.h"
#include "runtime/program_agreement.h"

namespace zbpipe::runtime {

namespace {

std::vector<TensorSpec> differentiable(const std::vector<TensorSpec>& specs) {
  std::vector<TensorSpec> out;
  for (const auto& s : specs)
    if (s.differentiable()) out.push_back(s);
  return out;
}

bool same(const Signature& a, const Signature& b) { return a.specs == b.specs && a.structure == b.structure; }

// [Note: the step's signature over the control group] Stage 0's rank names the step's input
// signature (an index into the negotiated sets) in a message of two int64s, (step number,
// index), to every other rank over the pipeline's control group: a CPU group of its own
// (control_group.h), so no device-to-host copy (a received index read with .item() would wait,
// on a GPU, for everything queued on the compute stream, the optimizer step included), nothing
// in the data communicators' issue order and no request to the shared store. Stage 0's rank
// posts its messages and goes on with its first actions; every other rank reads the message
// before its own, which costs nothing: its first action needs data that stage 0's rank sends
// after this message anyway. Messages of one pair and tag arrive in order; the step number in
// the message checks it. The sends of a step are completed at the next step's start, when
// every rank has read them (each step's messages chain the ranks: the previous step could not
// end before every rank had started it).
constexpr int kSignatureTag = 1;

}  // namespace

void StepAgreement::before_step(const Step& step) {
  if (!agreed_ && step.watch) {
    agree_on_program(*step.watch, p2p_.rank(), program_.pp, program_fingerprint(program_, static_shapes_),
                     step.timeout, step.check_stop);
  }
  agreed_ = true;
  negotiate_shapes(step);
}

const StageSignatures& StepAgreement::signatures(int stage) const {
  for (const auto& st : stages_)
    if (st.stage == stage && ready()) return st.shapes.sigs;
  throw Error(detail::str("no signatures for stage ", stage, " on rank ", p2p_.rank(),
                          " (not local, or no step has run yet)"));
}

void StepAgreement::negotiate_shapes(const Step& step) {
  if (static_shapes_ && ready()) return;
  Signature key;
  const int64_t index = static_shapes_ ? 0 : exchange_signature_index(step, key);  // static: the only set
  ZB_CHECK(index >= 0 && index <= static_cast<int64_t>(shape_sets_.size()), "rank ", program_.rank_of(0),
           " named input signature ", index, " but ", shape_sets_.size(), " are known here");
  if (index < static_cast<int64_t>(shape_sets_.size())) {
    if (index != current_set_) adopt_shapes(static_cast<int>(index));
    return;
  }
  // A signature no step had: every rank runs the handshake for it.
  std::map<int, StageHandle*> handles;
  for (const auto& st : stages_) handles[st.stage] = st.handle.get();
  auto sigs = exchange_signatures(program_, p2p_, handles, step.data, step.timeout);
  ++handshakes_;
  ShapeSet set;
  set.key = std::move(key);
  for (const auto& st : stages_) {
    StageShapes shapes;
    shapes.sigs = sigs.at(st.stage);
    shapes.grad_specs = differentiable(shapes.sigs.outputs.specs);
    shapes.in_grad_specs = differentiable(shapes.sigs.inputs.specs);
    set.stages.push_back(std::move(shapes));
  }
  shape_sets_.push_back(std::move(set));
  current_set_ = -1;  // infer_outputs already left the stages on these inputs
  adopt_shapes(static_cast<int>(shape_sets_.size()) - 1);
}

int64_t StepAgreement::exchange_signature_index(const Step& step, Signature& key) {
  const int r0 = program_.rank_of(0);
  int64_t index = -1;
  if (p2p_.rank() == r0) {
    key = step.first_inputs;
    index = static_cast<int64_t>(shape_sets_.size());
    for (size_t i = 0; i < shape_sets_.size(); ++i)
      if (same(shape_sets_[i].key, key)) index = static_cast<int64_t>(i);
  }
  if (program_.pp < 2) return index;
  if (step.watch) return exchange_over_control(step, index);
  // No watch (a group without store): the index travels as a message on the group itself,
  // read on the host.
  if (p2p_.rank() == r0) {
    auto opts = at::TensorOptions().dtype(at::kLong).device(p2p_.device());
    for (int r = 0; r < program_.pp; ++r)
      if (r != r0)  // completed by the step's end, with the step's other sends (P2P::settle)
        p2p_.post({P2POp{true, r, step_signature_tag(), at::full({1}, index, opts)}});
    return index;
  }
  auto buf = at::empty({1}, at::TensorOptions().dtype(at::kLong).device(p2p_.device()));
  auto batch = p2p_.post({P2POp{false, r0, step_signature_tag(), buf}});
  try {
    p2p_.wait(batch, step.timeout, detail::str("the step's input signature from rank ", r0),
              /*host_complete=*/true);  // read on the host below
  } catch (...) {
    P2P::abandon(batch);
    throw;
  }
  return buf.cpu().item<int64_t>();  // a device backend: the host waits for it here
}

int64_t StepAgreement::exchange_over_control(const Step& step, int64_t index) {
  P2P& control = step.control();
  const int r0 = program_.rank_of(0);
  if (p2p_.rank() == r0) {
    for (auto& b : signature_sends_) control.wait(b, step.timeout, "a step's input signature (its send)");
    control.drop_done();
    signature_sends_.clear();
    auto message = at::empty({2}, at::kLong);
    message.data_ptr<int64_t>()[0] = step.number;
    message.data_ptr<int64_t>()[1] = index;
    for (int r = 0; r < program_.pp; ++r)
      if (r != r0) signature_sends_.push_back(control.post({P2POp{true, r, kSignatureTag, message}}));
    return index;
  }
  auto got = at::empty({2}, at::kLong);
  auto batch = control.post({P2POp{false, r0, kSignatureTag, got}});
  try {
    control.wait(batch, step.timeout,
                 detail::str("the input signature of step ", step.number, " from rank ", step.stage0_rank,
                             " (stage 0's rank names it when it starts the step)"));
  } catch (...) {
    P2P::abandon(batch);
    throw;
  }
  const int64_t at = got.data_ptr<int64_t>()[0];  // a host tensor: read with no dispatch
  ZB_CHECK(at == step.number, "rank ", step.stage0_rank, " named the input signature of its step ", at,
           " while this rank starts step ", step.number, ": the ranks ran different numbers of steps");
  return got.data_ptr<int64_t>()[1];
}

void StepAgreement::adopt_shapes(int set) {
  const ShapeSet& s = shape_sets_[set];
  if (current_set_ >= 0)  // switching back to an earlier set: restore the stages' input structure
    for (size_t l = 0; l < stages_.size(); ++l)
      if (stages_[l].stage > 0) stages_[l].handle->use_inputs(s.stages[l].sigs.inputs);
  for (size_t l = 0; l < stages_.size(); ++l) stages_[l].shapes = s.stages[l];
  current_set_ = set;
}

}  // namespace zbpipe::runtime
