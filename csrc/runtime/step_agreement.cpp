// StepAgreement: the program's fingerprint once, then every step's shape set (step_agreement.h).
#include "runtime/step_agreement.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <map>
#include <thread>

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

// [Note: the step's signature through the store] Stage 0's rank names the step's input
// signature (an index into the negotiated sets) under key "sig<step mod ring>" of its
// executor's prefix as "<step>:<index>", and every other rank reads it there: no message on
// the group, so no device-to-host copy (a received index would be read with .item(), which
// on a GPU waits for everything queued on the compute stream, the optimizer step included)
// and no one-element message per peer. A rank j steps ahead of stage 0's rank's writes only
// once rank j has started every step up to its own, and stage 0's rank starts step s + pp
// only after every rank has started step s (each step's messages chain the ranks: with
// rendezvous sends, as on NCCL and Gloo, a step ends once its receivers reached it), so a ring
// of 2 pp + 2 keys is never overwritten before it is read; a reader that finds a later step
// there says so. A rank that reads blocks (on the store, never on the device) until stage 0's
// rank has started the step, which costs nothing: its first action needs that rank's data.
std::string signature_key(int64_t id, int64_t step, int pp) {
  return detail::str("zbpipe/x", id, "/sig", step % (2 * pp + 2));
}

}  // namespace

void StepAgreement::before_step(const Step& step) {
  if (!agreed_ && step.watch) {
    agree_on_program(*p2p_.store(), detail::str("zbpipe/x", step.id, "/"), p2p_.rank(), program_.pp,
                     program_fingerprint(program_, static_shapes_), step.timeout, *step.watch, step.check_stop);
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
  if (p2p_.rank() == r0) {
    key = step.first_inputs;
    int64_t index = static_cast<int64_t>(shape_sets_.size());
    for (size_t i = 0; i < shape_sets_.size(); ++i)
      if (same(shape_sets_[i].key, key)) index = static_cast<int64_t>(i);
    if (program_.pp > 1) {
      if (step.watch) {  // a group with a store (every group but a storeless loopback world)
        const std::string v = detail::str(step.number, ":", index);
        p2p_.store()->set(signature_key(step.id, step.number, program_.pp), std::vector<uint8_t>(v.begin(), v.end()));
      } else {
        auto opts = at::TensorOptions().dtype(at::kLong).device(p2p_.device());
        for (int r = 0; r < program_.pp; ++r)
          if (r != r0)  // completed by the step's end, with the step's other sends (P2P::settle)
            p2p_.post({P2POp{true, r, step_signature_tag(), at::full({1}, index, opts)}});
      }
    }
    return index;
  }
  if (step.watch) return read_signature_index(step);
  // No store: the index travels as a message, read on the host.
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

int64_t StepAgreement::read_signature_index(const Step& step) {
  auto store = p2p_.store();
  const std::string key = signature_key(step.id, step.number, program_.pp);
  const auto deadline = std::chrono::steady_clock::now() + step.timeout;
  auto pause = std::chrono::microseconds(20);
  while (true) {
    step.check_stop();
    if (store->check({key})) {
      const auto raw = store->get(key);
      const std::string v(raw.begin(), raw.end());
      const auto colon = v.find(':');
      ZB_CHECK(colon != std::string::npos, "bad step signature '", v, "' under ", key);
      const int64_t at = std::stoll(v.substr(0, colon));
      if (at == step.number) return std::stoll(v.substr(colon + 1));
      ZB_CHECK(at < step.number, "rank ", step.stage0_rank, " is at step ", at, " while this rank starts step ",
               step.number, ": it ran too far ahead (see [Note: the step's signature through the store])");
    }
    if (std::chrono::steady_clock::now() > deadline)
      throw PipelineError(detail::str("no input signature for step ", step.number, " from rank ", step.stage0_rank,
                                      " within ", step.timeout.count() / 1000.0,
                                      " s (stage 0's rank names it when it starts the step; it failed or stopped before)"));
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
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
