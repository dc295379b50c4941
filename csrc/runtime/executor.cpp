// Executor: the step, read as DualPipe's step() reads -- begin, then for each entry of the
// dispatch table run it here or start it on the worker, then end -- and the compute verbs
// (forward, backward, weight) the entries name.
#include "runtime/executor.h"

#include <ATen/ops/full_like.h>
#include <ATen/ops/zeros_like.h>

#include "runtime/errors.h"
#include "runtime/graph_outputs.h"
#include "runtime/host_memory.h"
#include "runtime/replica_barrier.h"
#include "runtime/trace_scope.h"
#include "zbpipe/cancel.h"
#include "zbpipe/passes.h"
#include "zbpipe/vocab.h"

namespace zbpipe::runtime {

namespace {

std::string join_stages(const std::vector<int>& stages) {
  std::string out;
  for (int s : stages) out += (out.empty() ? "" : ", ") + std::to_string(s);
  return out;
}

// The stages given are exactly the ones the program places on `rank`.
void check_placement(const Program& p, int rank, const std::map<int, std::shared_ptr<StageHandle>>& stages) {
  const auto expected = p.stages_of(rank);
  std::vector<int> given;
  for (const auto& [s, h] : stages) {
    ZB_CHECK(h, "stage ", s, " has no handle");
    given.push_back(s);
  }
  if (given != expected)
    throw ScheduleError(detail::str("schedule '", p.schedule, "' places stages [", join_stages(expected),
                                    "] on rank ", rank, ", but this rank was given stages [",
                                    join_stages(given), "]"));
}

std::unique_ptr<P2P> checked(std::unique_ptr<P2P> p2p) {
  ZB_CHECK(p2p, "executor needs a P2P channel");
  return p2p;
}

}  // namespace

Executor::Executor(Program program, std::unique_ptr<P2P> p2p,
                   std::map<int, std::shared_ptr<StageHandle>> stages, ExecutorOptions options)
    : program_(std::move(program)),
      p2p_(checked(std::move(p2p))),
      options_(std::move(options)),
      failures_(program_, p2p_->rank(), options_.global_rank, options_.group_ranks),
      agreement_(program_, *p2p_, stages_, options_.static_shapes) {
  ZB_SCHEDULE_CHECK(p2p_->size() == program_.pp, "the process group has ", p2p_->size(),
                    " ranks but the program '", program_.schedule, "' needs pp=", program_.pp);
  ZB_SCHEDULE_CHECK(program_.has_comms() || program_.pp == 1,
                    "the executor runs lowered programs (with SEND/RECV); got a compute-only one");
  check_placement(program_, rank(), stages);
  const VocabParts parts = vocab_parts(program_);
  ZB_SCHEDULE_CHECK(parts.head == (options_.vocab != nullptr), "the program '", program_.schedule,
                    options_.vocab ? "' has no vocabulary actions but a vocabulary-parallel output was given"
                                   : "' has vocabulary actions but no vocabulary-parallel output was given");
  ZB_SCHEDULE_CHECK(parts.embedding == (options_.embedding != nullptr), "the program '", program_.schedule,
                    options_.embedding ? "' has no embedding actions but a vocabulary-parallel embedding was given"
                                       : "' has embedding actions but no vocabulary-parallel embedding was given");
  if (options_.embedding) {
    ZB_SCHEDULE_CHECK(!p2p_->stream_ordered(), "the vocabulary-parallel embedding runs on backends whose messages "
                      "complete on the host (Gloo) so far; this group (", p2p_->backend_name(), ") is stream-ordered");
    embed_ = std::make_unique<EmbedRun>(*p2p_, options_.embedding, program_);
  }
  // Stream-ordered backends: its collectives get a group of their own at the first step
  // (open_vocab_collectives).
  if (options_.vocab) vocab_ = std::make_unique<VocabRun>(*p2p_, options_.vocab, program_);
  // Stream-ordered backends: refuse a program whose posts would deadlock there (a send
  // completes only once its receive is posted), before any message.
  if (p2p_->stream_ordered() && program_.pp > 1) validate_rendezvous(program_);
  if (options_.prepost_receives.value_or(false) && p2p_->stream_ordered())
    throw ScheduleError(detail::str(
        "prepost_receives=True needs a backend whose messages complete on the host (Gloo); "
        "this group (", p2p_->backend_name(), ") is stream-ordered, where receives are posted "
        "at their RECV action: leave prepost_receives unset"));
  table_ = build_dispatch(program_, rank(), options_.overlap_f_b);
  if (!options_.group_ranks.empty()) {  // messages name the world's ranks
    ZB_CHECK(static_cast<int>(options_.group_ranks.size()) == program_.pp, "group_ranks has ",
             options_.group_ranks.size(), " entries for a group of ", program_.pp);
    for (Comm& k : table_.comms) {
      const bool send = k.kind == Kind::SEND_F || k.kind == Kind::SEND_B;
      k.desc = detail::str(to_string(program_.ranks[rank()][k.index]), send ? " to rank " : " from rank ",
                           failures_.global(k.peer));
    }
  }
  adopt_stages(std::move(stages));
  // CPU compute reallocates the same large blocks every action (host_memory.h).
  if (p2p_->device().is_cpu()) keep_freed_host_memory();
  for (const Entry& e : table_.entries)
    trace_.push_back(TraceRecord{e.label, rank(), e.index, static_cast<int>(trace_.size()), e.unit});
  timer_ = std::make_unique<DeviceTimer>(p2p_->device(), options_.device_timing, table_.entries.size());
  comms_ = std::make_unique<StepComms>(*p2p_, table_.comms, stages_);
}

void Executor::adopt_stages(std::map<int, std::shared_ptr<StageHandle>> stages) {
  std::vector<bool> syncs;
  for (auto& [s, h] : stages) {
    LocalStage st;
    st.stage = s;
    st.trains = table_.trains(static_cast<int>(stages_.size()));
    st.queues_weight = h->queues_weight_work();
    st.syncs_grads = h->syncs_gradients();
    if (auto g = options_.sync_groups.find(s); g != options_.sync_groups.end() && st.syncs_grads)
      st.sync_groups = g->second;
    st.handle = std::move(h);
    st.slots.resize(static_cast<size_t>(program_.microbatches));
    syncs.push_back(st.syncs_grads);
    stages_.push_back(std::move(st));
  }
  mark_gradient_sync(table_, syncs);
  std::vector<std::shared_ptr<c10d::ProcessGroup>> dp;
  for (const auto& st : stages_) dp.insert(dp.end(), st.sync_groups.begin(), st.sync_groups.end());
  sync_.gloo_groups = gloo_groups(dp);
}

Executor::~Executor() = default;

// ---- the step -----------------------------------------------------------------------------

StepResult Executor::run(const StepData& data, const Signature& first_inputs, double loss_scale) {
  failures_.start_step();
  StepResult result;
  if (program_.rank_of(program_.num_stages - 1) == rank()) {
    result.losses.resize(program_.microbatches);
    result.outputs.resize(program_.microbatches);
  }
  struct StepScope {  // the step's data and result are reachable from stage calls only during run
    Executor& ex;
    ~StepScope() {
      ex.step_.data = nullptr;
      ex.step_.result = nullptr;
      ex.failures_.disarm();  // polled stores: the watcher looks less often between steps
    }
  } scope{*this};
  step_.data = &data;
  step_.result = &result;
  GlooTimeoutBound bounded(sync_.gloo_groups, options_.timeout);  // restored when the step ends or fails
  begin_step(first_inputs, loss_scale);
  const auto& entries = table_.entries;
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    if (runs_custom(e)) {
      join_worker();  // an overlapped unit ends before a custom action, as before any other
      i = run_custom(i);
      continue;
    }
    trace_[i].wait_ns = 0;
    if (failures_.interrupted()) fail_step(e.index, Cancelled());
    if (!e.concurrent) join_worker();  // an overlapped unit ends before what follows it
    if (e.on_worker && may_overlap(e)) start_on_worker(i);
    else run_here(i);
    check_comms(e.index, false);
  }
  join_worker();
  if (vocab_ && !result.losses.empty())  // the root reports the head's losses
    or_fail_step(kStepEnd, [&] {
      for (int mb = 0; mb < program_.microbatches; ++mb) result.losses[mb] = vocab_->loss(mb);
    });
  end_step();
  return result;
}

void Executor::begin_step(const Signature& first_inputs, double loss_scale) {
  or_fail_step(kStepStart, [&] {
    ensure_watch();
    failures_.arm();
    const std::function<void()> stop = [this] { failures_.check_stop(); };
    const std::function<P2P&()> control = [this]() -> P2P& { return this->control(); };
    agreement_.before_step({.data = *step_.data,
                            .first_inputs = first_inputs,
                            .number = failures_.step(),
                            .timeout = options_.timeout,
                            .watch = failures_.watch(),
                            .id = failures_.id(),
                            .stage0_rank = failures_.global(program_.rank_of(0)),
                            .check_stop = stop,
                            .control = control});
    meet_replicas_at_start();
    open_vocab_collectives();
    if (vocab_) {  // the root checks that the last stage's agreed output is the head's input
      const std::vector<TensorSpec>* hidden = nullptr;
      for (const LocalStage& st : stages_)
        if (st.stage == program_.num_stages - 1) hidden = &st.shapes.sigs.outputs.specs;
      vocab_->begin(*step_.data, loss_scale, options_.timeout, hidden);
    }
    if (embed_) embed_->begin(*step_.data, options_.timeout);
  });
  step_.loss_scale = loss_scale;
  timer_->start_step();
  const bool prepost = options_.prepost_receives.value_or(true) && !p2p_->stream_ordered();
  or_fail_step(kStepStart, [&] { comms_->begin(prepost, options_.timeout); },
               "posting this step's receives failed: ");
}

size_t Executor::run_custom(size_t first) {
  const int index = table_.entries[first].index;
  size_t last = first;
  or_fail_step(index, [&] { last = custom_.run(program_.ranks[rank()][index], table_.entries, first); });
  return last;
}

void Executor::run_part(const Action& part) {
  custom_.run_part(part, [this](size_t j) {
    TraceRecord& rec = trace_[j];
    rec.wait_ns = 0;
    TraceScope timed(rec, *timer_, j);
    run_synced(table_.entries[j], rec);  // a stage's last backward syncs its gradients here too
  });
}

void Executor::run_here(size_t i) {
  const Entry& e = table_.entries[i];
  TraceRecord& rec = trace_[i];
  or_fail_step(e.index, [&] {
    TraceScope timed(rec, *timer_, i);
    run_synced(e, rec);
  });
}

void Executor::run_synced(const Entry& e, TraceRecord& rec) {
  if (e.sync_grads) {
    meet_replicas(e);
    static const std::vector<at::Tensor> kNoRoots;
    sync_.running = e.local;  // a failure from here to the sync's end leaves its collective unfinished
    stages_[e.local].handle->begin_gradient_sync(e.kind == Kind::B ? slot(e.local, e.mb).roots : kNoRoots);
  }
  run_entry(e, rec);
  if (e.sync_grads) {
    stages_[e.local].handle->end_gradient_sync();
    sync_.running = -1;
  }
}

bool Executor::may_overlap(const Entry& e) {
  // A reentrant checkpoint recomputes inside its backward, under torch's fork of the global
  // RNG: on the worker, concurrently with this thread's forward, the two would draw from one
  // generator. Such a unit runs its halves in sequence.
  return !runs_own_backward(slot(e.local, e.mb).roots, slot(e.local, e.mb).saved_in);
}

void Executor::start_on_worker(size_t i) {
  const Entry& e = table_.entries[i];
  or_fail_step(e.index, [&] {
    // What must not run concurrently with the forward half runs here first (the stage's
    // checkpoint recomputations: StageHandle::before_backward_on_worker).
    stages_[e.local].handle->before_backward_on_worker(*step_.data, e.mb);
    // The receive is waited here: P2P is not thread-safe.
    if (e.needs_recv) comms_->wait(slot(e.local, e.mb).grad_in, trace_[i].wait_ns);
    if (e.needs_vocab_grad) vocab_->await_input_grad(e.mb, trace_[i].wait_ns);
    if (!overlap_.worker) overlap_.worker = std::make_unique<OverlapWorker>(p2p_->device());
    overlap_.index = e.index;
    const c10::Device device = p2p_->device();
    std::optional<c10::Stream> consumer;
    if (device_has_events(device)) consumer = current_stream(device);
    overlap_.worker->start([this, i, consumer] {
      TraceRecord& rec = trace_[i];
      rec.worker = true;
      TraceScope timed(rec, *timer_, i);  // the backward itself, as it overlaps the forward half
      backward(table_.entries[i], consumer ? &*consumer : nullptr);
    });
  });
}

void Executor::join_worker() {
  if (!overlap_.worker || !overlap_.worker->busy()) return;
  const int index = overlap_.index;
  overlap_.index = -1;
  or_fail_step(index, [&] { overlap_.worker->join(); });  // rethrows what the backward half threw
}

void Executor::check_comms(int index, bool finish) {
  try {
    if (finish) comms_->finish();
    else comms_->progress();
  } catch (const LateBatch& ex) {  // the receive's action failed, not the one running now
    fail_step(ex.owner >= 0 ? table_.comms[ex.owner].index : index, ex);
  } catch (const std::exception& ex) {
    fail_step(index, ex);
  }
}

void Executor::end_step() {
  check_comms(kStepEnd, true);
  if (vocab_) or_fail_step(kStepEnd, [&] { vocab_->finish(); });
  // A peer's failure published before this step's end fails it, on a polled store too.
  or_fail_step(kStepEnd, [&] { failures_.check_before_success(); });
  clear_slots();  // every batch completed: drop the step's tensors
  timer_->collect(trace_);
  for (auto& st : stages_) {
    if (st.fused.empty() || st.fused_told) continue;
    st.fused_told = true;
    or_fail_step(kStepEnd, [&] { st.handle->split_fell_back(st.fused); });
  }
}

// ---- the verbs ----------------------------------------------------------------------------

void Executor::run_entry(const Entry& e, TraceRecord& rec) {
  switch (e.kind) {
    case Kind::F:
      forward(e, rec);
      return;
    case Kind::B:
    case Kind::I:
      if (e.needs_recv) await_input(slot(e.local, e.mb).grad_in, rec);
      if (e.needs_vocab_grad) vocab_->await_input_grad(e.mb, rec.wait_ns);
      backward(e, nullptr);
      return;
    case Kind::W:
      weight(e);
      return;
    case Kind::SEND_F:
    case Kind::RECV_F:
    case Kind::SEND_B:
    case Kind::RECV_B:
      comms_->post(e);
      return;
    case Kind::S:
      vocab_->s_pass(e.mb, rec.wait_ns);
      return;
    case Kind::T:
      vocab_->t_pass(e.mb, rec.wait_ns);
      return;
    case Kind::BCAST_F:
      vocab_->post_broadcast(e.mb);
      return;
    case Kind::ALLREDUCE_S:
      vocab_->post_allreduce(e.mb);
      return;
    case Kind::REDUCE_B:
      vocab_->post_reduce(e.mb, rec.wait_ns);
      return;
    case Kind::E:
      embed_->e_pass(e.mb);
      return;
    case Kind::EW:
      embed_->ew_pass(e.mb, rec.wait_ns);
      return;
    case Kind::REDUCE_E:
      embed_->post_reduce(e.mb);
      return;
    case Kind::BCAST_E:
      embed_->post_broadcast(e.mb);
      return;
    case Kind::OVERLAP_F_B:
      break;
  }
  ZB_CHECK(false, "a dispatch entry holds '", kind_name(e.kind), "'");
}

void Executor::await_input(Inbox& in, TraceRecord& rec) {
  comms_->wait(in, rec.wait_ns);
  timer_->mark(rec.entry, false);  // after the stream's wait for the receive
}

void Executor::forward(const Entry& e, TraceRecord& rec) {
  LocalStage& st = stages_[e.local];
  Slot& sl = st.slot(e.mb);
  if (e.needs_recv) await_input(sl.fwd_in, rec);
  if (e.from_embedding) sl.fwd_in.tensors = {embed_->output(e.mb, rec.wait_ns)};  // the reduced lookups
  auto inputs = std::move(sl.fwd_in.tensors);
  sl.fwd_in.tensors.clear();
  const auto& in_specs = st.shapes.sigs.inputs.specs;
  if (st.trains)
    for (size_t i = 0; i < inputs.size() && i < in_specs.size(); ++i)
      if (in_specs[i].differentiable()) inputs[i].set_requires_grad(true);
  // Stage 0 has no agreed input signature (its inputs are the step's); the embedding's output,
  // whose gradient BCAST_E sends, is differentiable.
  if (e.from_embedding && st.trains) inputs.at(0).set_requires_grad(true);
  ForwardResult res = st.handle->forward(*step_.data, e.mb, inputs);
  auto& outs = res.tensors;
  if (e.stage == program_.num_stages - 1 && !e.to_vocab) {  // the loss: the root of the backward
    step_.result->losses[e.mb] = std::move(res.loss);
    step_.result->outputs[e.mb] = std::move(res.output);
    if (st.trains) sl.roots = std::move(outs);
  } else {
    const auto& out_specs = st.shapes.sigs.outputs.specs;
    check_outputs(outs, out_specs, "outputs", e.stage, e.mb);
    std::vector<at::Tensor> detached;
    detached.reserve(outs.size());
    for (size_t i = 0; i < outs.size(); ++i) {
      if (e.handoff < 0) refuse_cuda_graph_output(outs[i], e.stage, false, i);  // sent: see graph_outputs.h
      detached.push_back(outs[i].detach());  // the next stage starts its own graph
      if (st.trains && out_specs[i].differentiable()) sl.roots.push_back(std::move(outs[i]));
    }
    if (e.to_vocab) {  // the vocabulary head's input; the stage's output is kept as the last's
      vocab_->set_input(e.mb, detached.at(0));
      step_.result->outputs[e.mb] = std::move(res.output);
    } else if (e.handoff >= 0) {
      slot(e.handoff, e.mb).fwd_in.tensors = std::move(detached);
    } else {
      sl.fwd_out = std::move(detached);
    }
  }
  if (st.trains) sl.saved_in = std::move(inputs);
}

void Executor::backward(const Entry& e, const c10::Stream* consumer) {
  LocalStage& st = stages_[e.local];
  Slot& sl = st.slot(e.mb);
  std::vector<at::Tensor> root_grads = std::move(sl.grad_in.tensors);
  sl.grad_in.tensors.clear();
  auto roots = std::move(sl.roots);
  auto inputs = std::move(sl.saved_in);
  sl.roots.clear();
  sl.saved_in.clear();
  if (e.needs_vocab_grad) {  // the head's input gradient, reduced over every shard
    root_grads = {vocab_->input_grad(e.mb)};
    if (consumer)
      for (const auto& g : root_grads) record_on_stream(g, *consumer);
  } else if (e.stage == program_.num_stages - 1) {
    root_grads.clear();
    for (const auto& r : roots) root_grads.push_back(at::full_like(r, step_.loss_scale));
    // Made on the worker's stream, read by autograd on the streams of the forward.
    if (consumer)
      for (const auto& g : root_grads) record_on_stream(g, *consumer);
  }
  std::vector<at::Tensor> in_grads;
  if (e.kind == Kind::B || st.queues_weight) {
    in_grads = described(st, [&] { return backward_full(roots, root_grads, inputs); });
    if (st.queues_weight) st.handle->weight_work_queued(*step_.data, e.mb);
    if (e.kind == Kind::B && st.queues_weight) st.handle->run_weight_work(*step_.data, e.mb);
  } else {
    in_grads = described(st, [&] { return backward_input(roots, root_grads, inputs, sl.weight, &st.split_plans); });
    if (!sl.weight.fused.empty()) {
      // A data-parallel stage reduces its gradients during its last backward action, a W here,
      // which a fused stage leaves empty: DDP's reducer would wait for hooks that never fire.
      if (st.syncs_grads)
        throw PipelineError(detail::str(
            "stage ", e.stage, " is data-parallel (DDP/FSDP) and its backward cannot be split under this "
            "schedule, so it would run fused with an empty W, where its gradients are reduced: ",
            sl.weight.fused, "; or use a schedule without I/W (gpipe, 1f1b, interleaved_1f1b)"));
      if (st.fused.empty()) st.fused = sl.weight.fused;
    }
  }
  roots.clear();  // frees the input closure of the graph now, not at the end of the step
  if (e.handoff >= 0 || e.to_send) hand_on_input_grads(e, inputs, in_grads, consumer);
  if (e.to_embedding)  // stage 0's input gradient, for BCAST_E (zeros where the stage did not use it)
    embed_->set_grad(e.mb, !in_grads.empty() && in_grads[0].defined() ? in_grads[0] : at::zeros_like(inputs.at(0)));
  if (options_.memory_probe && e.kind == Kind::I) {
    inputs.clear();  // what the graph keeps of the stage inputs for W, not this frame's refs
    st.handle->backward_input_done(*step_.data, e.mb);
  }
}

void Executor::hand_on_input_grads(const Entry& e, const std::vector<at::Tensor>& inputs,
                                   std::vector<at::Tensor>& in_grads, const c10::Stream* consumer) {
  const LocalStage& st = stages_[e.local];
  // One gradient per differentiable input; zeros where the stage did not use it.
  std::vector<at::Tensor> out;
  const auto& in_specs = st.shapes.sigs.inputs.specs;
  for (size_t i = 0; i < inputs.size() && i < in_specs.size(); ++i)
    if (in_specs[i].differentiable())
      out.push_back(in_grads[i].defined() ? std::move(in_grads[i]) : at::zeros_like(inputs[i]));
  check_outputs(out, st.shapes.in_grad_specs, "input gradients", e.stage, e.mb);
  if (e.handoff < 0)
    for (size_t i = 0; i < out.size(); ++i) refuse_cuda_graph_output(out[i], e.stage, true, i);
  if (consumer)  // used (and freed) on the caller's stream after the join
    for (const auto& g : out) record_on_stream(g, *consumer);
  if (e.handoff >= 0) slot(e.handoff, e.mb).grad_in.tensors = std::move(out);
  else slot(e.local, e.mb).grad_out = std::move(out);
}

void Executor::weight(const Entry& e) {
  LocalStage& st = stages_[e.local];
  if (st.queues_weight) st.handle->run_weight_work(*step_.data, e.mb);
  else described(st, [&] { backward_weight(st.slot(e.mb).weight); });
}

namespace {

// "bfloat16 where the pipeline agreed on float32 (tensor 0 of 2), ..." where `outs` have the
// agreed count and shapes and only dtypes differ; "" otherwise.
std::string dtype_mismatch(const std::vector<at::Tensor>& outs, const std::vector<TensorSpec>& want) {
  if (outs.size() != want.size()) return "";
  std::string out;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!outs[i].defined() || outs[i].sizes().vec() != want[i].shape) return "";
    if (outs[i].scalar_type() == want[i].dtype) continue;
    out += detail::str(out.empty() ? "" : ", ", c10::getDtypeNames(outs[i].scalar_type()).first,
                       " where the pipeline agreed on ", c10::getDtypeNames(want[i].dtype).first, " (tensor ", i,
                       " of ", outs.size(), ")");
  }
  return out;
}

}  // namespace

void Executor::check_outputs(const std::vector<at::Tensor>& outs, const std::vector<TensorSpec>& want,
                             const char* what, int stage, int mb) const {
  bool ok = outs.size() == want.size();
  for (size_t i = 0; ok && i < outs.size(); ++i)
    ok = outs[i].defined() && outs[i].scalar_type() == want[i].dtype &&
         outs[i].sizes().vec() == want[i].shape;
  if (ok) {
    // Sent, or handed to the next local stage, as they are: on the rank's device, compared as
    // torch places tensors (zbpipe/devices.py): CPU is one device, whatever index it was named
    // with (a CPU tensor reports none), and a device named without an index takes any.
    const c10::Device& device = p2p_->device();
    for (size_t i = 0; i < outs.size(); ++i) {
      const c10::Device d = outs[i].device();
      if (d.type() == device.type() && (d.is_cpu() || !device.has_index() || d.index() == device.index())) continue;
      throw PipelineError(detail::str("stage ", stage, " microbatch ", mb, " produced ", what, " on device ",
                                      d.str(), " (tensor ", i, " of ", outs.size(), ") but the pipeline runs on ",
                                      device.str(), ": move them to the stage's device"));
    }
    return;
  }
  std::vector<TensorSpec> got;
  for (const auto& t : outs)
    got.push_back(t.defined() ? TensorSpec{t.sizes().vec(), t.scalar_type()} : TensorSpec{});
  if (const std::string dtypes = dtype_mismatch(outs, want); !dtypes.empty())
    throw PipelineError(detail::str(
        "stage ", stage, " microbatch ", mb, " produced ", what, " of dtype ", dtypes,
        " (the shapes match: ", to_string(got), " against ", to_string(want),
        "): a dtype that changes within a step, e.g. autocast entered, left or given another dtype "
        "in a stage or between microbatches (the ranks agree on dtypes per step, under the autocast "
        "state the step starts with)"));
  throw PipelineError(detail::str(
      "stage ", stage, " microbatch ", mb, " produced ", what, " ", to_string(got),
      " but the pipeline agreed on ", to_string(want),
      options_.static_shapes
          ? " at the first step (static_shapes=True: every step and microbatch keeps the first step's shapes)"
          : " for this step's input signature (every microbatch of a step must have the same "
            "shapes; shapes may change between steps, following the first stage's inputs)"));
}

}  // namespace zbpipe::runtime
