// What the ranks agree on before a step: the program (once), the step's shapes (every step
// unless static_shapes), and the store keys through which a failure reaches every rank.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <thread>

#include "runtime/errors.h"
#include "runtime/executor.h"
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

}  // namespace

void Executor::ensure_watch() {
  if (watch_) return;
  const bool data_parallel =
      std::any_of(stages_.begin(), stages_.end(), [](const LocalStage& st) { return !st.sync_groups.empty(); });
  if (program_.pp < 2 && !data_parallel) return;
  auto store = p2p_->store();
  if (!store) return;  // a group without a store: no propagation, no program agreement
  id_ = next_executor_id(*store, rank_);
  std::vector<FailureChannel> channels{{store, failure_key(id_)}};
  // One executor id per data-parallel group (the replicas build their schedules in the same
  // order, so the ids match), in the stages' order: its failure channel and its barriers.
  std::map<const c10d::ProcessGroup*, int64_t> ids;
  std::vector<std::shared_ptr<c10d::ProcessGroup>> groups;
  for (auto& st : stages_) {
    st.replicas.clear();
    for (const auto& g : st.sync_groups) {
      auto [it, fresh] = ids.emplace(g.get(), 0);
      if (fresh) {
        it->second = next_executor_id(*g->getStore(), g->getRank());
        channels.push_back({g->getStore(), failure_key(it->second)});
        groups.push_back(g);
      }
      st.replicas.emplace_back(g, detail::str("zbpipe/x", it->second, "/stage", st.stage, "/replicas"));
    }
  }
  P2P* p2p = p2p_.get();
  const bool host = p2p_->device().is_cpu();
  watch_ = std::make_unique<FailureWatch>(std::move(channels), global(rank_), [p2p, groups, host] {
    p2p->abort_all();
    // Accelerators: a data-parallel collective in flight ends only with its communicator.
    // (Gloo cannot abort one: the replicas' barrier keeps them out of it instead.)
    if (!host)
      for (const auto& g : groups) {
        try {
          g->abort();
        } catch (const std::exception&) {
        }
      }
  }, std::chrono::milliseconds(50), /*group_rank=*/rank_);
}

void Executor::meet_replicas(const Entry& e) {
  LocalStage& st = stages_[e.local];
  for (auto& r : st.replicas)
    r.arrive_and_wait(options_.timeout, [this] { check_stop(); },
                      detail::str("the data-parallel replicas of stage ", st.stage, " to reach its gradient sync"));
}

void Executor::report_setup_failure(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                    const std::vector<std::shared_ptr<c10d::ProcessGroup>>& sync_groups,
                                    int global_rank, const std::string& what) {
  // The same numbering as ensure_watch: the pipeline group's id, then one per distinct group.
  std::vector<const c10d::ProcessGroup*> seen;
  auto publish = [&](const c10d::ProcessGroup* g) {
    if (!g || std::find(seen.begin(), seen.end(), g) != seen.end()) return;
    seen.push_back(g);
    try {
      auto store = g->getStore();
      if (!store) return;
      const int64_t id = next_executor_id(*store, g->getRank());  // the number the peers' executor has
      publish_failure(*store, failure_key(id),
                      StepFailure{global_rank >= 0 ? global_rank : group->getRank(), false,
                                  "while building its executor", 1, what});
    } catch (const std::exception&) {
    }
  };
  if (!group) return;
  if (group->getSize() >= 2 || !sync_groups.empty()) publish(group.get());
  for (const auto& g : sync_groups) publish(g.get());
}

void Executor::agree_before_step(const Signature& first_inputs) {
  if (!agreed_ && watch_) {
    agree_on_program(*p2p_->store(), detail::str("zbpipe/x", id_, "/"), rank_, program_.pp,
                     program_fingerprint(program_, options_.static_shapes), options_.timeout, *watch_,
                     [this] { check_stop(); });
  }
  agreed_ = true;
  negotiate_shapes(first_inputs);
}

void Executor::negotiate_shapes(const Signature& first_inputs) {
  if (options_.static_shapes && ready_) return;
  Signature key;
  const int64_t index = options_.static_shapes ? 0 : exchange_signature_index(first_inputs, key);  // static: the only set
  ZB_CHECK(index >= 0 && index <= static_cast<int64_t>(shape_sets_.size()), "rank ", program_.rank_of(0),
           " named input signature ", index, " but ", shape_sets_.size(), " are known here");
  if (index < static_cast<int64_t>(shape_sets_.size())) {
    if (index != current_set_) adopt_shapes(static_cast<int>(index));
    return;
  }
  // A signature no step had: every rank runs the handshake for it.
  std::map<int, StageHandle*> handles;
  for (const auto& st : stages_) handles[st.stage] = st.handle.get();
  auto sigs = exchange_signatures(program_, *p2p_, handles, *step_, options_.timeout);
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

namespace {

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

int64_t Executor::exchange_signature_index(const Signature& first_inputs, Signature& key) {
  const int r0 = program_.rank_of(0);
  if (rank_ == r0) {
    key = first_inputs;
    int64_t index = static_cast<int64_t>(shape_sets_.size());
    for (size_t i = 0; i < shape_sets_.size(); ++i)
      if (same(shape_sets_[i].key, key)) index = static_cast<int64_t>(i);
    if (program_.pp > 1) {
      if (watch_) {  // a group with a store (every group but a storeless loopback world)
        const std::string v = detail::str(steps_, ":", index);
        p2p_->store()->set(signature_key(id_, steps_, program_.pp), std::vector<uint8_t>(v.begin(), v.end()));
      } else {
        auto opts = at::TensorOptions().dtype(at::kLong).device(p2p_->device());
        for (int r = 0; r < program_.pp; ++r)
          if (r != rank_)  // completed by the step's end, with the step's other sends (P2P::settle)
            p2p_->post({P2POp{true, r, step_signature_tag(), at::full({1}, index, opts)}});
      }
    }
    return index;
  }
  if (watch_) return read_signature_index(r0);
  // No store: the index travels as a message, read on the host.
  auto buf = at::empty({1}, at::TensorOptions().dtype(at::kLong).device(p2p_->device()));
  auto batch = p2p_->post({P2POp{false, r0, step_signature_tag(), buf}});
  try {
    p2p_->wait(batch, options_.timeout, detail::str("the step's input signature from rank ", r0),
               /*host_complete=*/true);  // read on the host below
  } catch (...) {
    P2P::abandon(batch);
    throw;
  }
  return buf.cpu().item<int64_t>();  // a device backend: the host waits for it here
}

int64_t Executor::read_signature_index(int r0) {
  auto store = p2p_->store();
  const std::string key = signature_key(id_, steps_, program_.pp);
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  auto pause = std::chrono::microseconds(20);
  while (true) {
    check_stop();
    if (store->check({key})) {
      const auto raw = store->get(key);
      const std::string v(raw.begin(), raw.end());
      const auto colon = v.find(':');
      ZB_CHECK(colon != std::string::npos, "bad step signature '", v, "' under ", key);
      const int64_t step = std::stoll(v.substr(0, colon));
      if (step == steps_) return std::stoll(v.substr(colon + 1));
      ZB_CHECK(step < steps_, "rank ", global(r0), " is at step ", step, " while this rank starts step ", steps_,
               ": it ran too far ahead (see [Note: the step's signature through the store])");
    }
    if (std::chrono::steady_clock::now() > deadline)
      throw PipelineError(detail::str("no input signature for step ", steps_, " from rank ", global(r0), " within ",
                                      options_.timeout.count() / 1000.0,
                                      " s (stage 0's rank names it when it starts the step; it failed or stopped before)"));
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

void Executor::adopt_shapes(int set) {
  const ShapeSet& s = shape_sets_[set];
  if (current_set_ >= 0)  // switching back to an earlier set: restore the stages' input structure
    for (size_t l = 0; l < stages_.size(); ++l)
      if (stages_[l].stage > 0) stages_[l].handle->use_inputs(s.stages[l].sigs.inputs);
  for (size_t l = 0; l < stages_.size(); ++l) stages_[l].shapes = s.stages[l];
  current_set_ = set;
  ready_ = true;
}

}  // namespace zbpipe::runtime
