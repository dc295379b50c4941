// Executor: dispatch table built once per program, then a tight loop per step.
#include "runtime/executor.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>

#include "runtime/errors.h"
#include "zbpipe/dependencies.h"
#include "zbpipe/passes.h"

namespace zbpipe::runtime {

int data_tag(int boundary_stage, bool grad, int mb, int microbatches) {
  return ((boundary_stage * 2 + (grad ? 1 : 0)) * microbatches + mb) * kMaxTensorsPerMessage;
}

Executor::Executor(Program program, std::unique_ptr<P2P> p2p,
                   std::map<int, std::shared_ptr<StageHandle>> stages, ExecutorOptions options)
    : program_(std::move(program)), p2p_(std::move(p2p)), options_(options) {
  ZB_CHECK(p2p_, "executor needs a P2P channel");
  rank_ = p2p_->rank();
  ZB_SCHEDULE_CHECK(p2p_->size() == program_.pp, "the process group has ", p2p_->size(),
                    " ranks but the program '", program_.schedule, "' needs pp=", program_.pp);
  ZB_SCHEDULE_CHECK(program_.has_comms() || program_.pp == 1,
                    "the executor runs lowered programs (with SEND/RECV); got a compute-only one");
  const auto expected = program_.stages_of(rank_);
  std::vector<int> given;
  for (const auto& [s, h] : stages) {
    ZB_CHECK(h, "stage ", s, " has no handle");
    given.push_back(s);
    stage_ids_.push_back(s);
    stages_.push_back(h);
  }
  if (given != expected) {
    std::string want, got;
    for (int s : expected) want += (want.empty() ? "" : ", ") + std::to_string(s);
    for (int s : given) got += (got.empty() ? "" : ", ") + std::to_string(s);
    throw ScheduleError(detail::str("schedule '", program_.schedule, "' places stages [", want,
                                    "] on rank ", rank_, ", but this rank was given stages [",
                                    got, "]"));
  }
  // Stream-ordered backends: refuse a program whose posts would deadlock there (a send
  // completes only once its receive is posted), before any message.
  if (p2p_->stream_ordered() && program_.pp > 1) validate_rendezvous(program_);
  if (options_.prepost_receives.value_or(false) && p2p_->stream_ordered())
    throw ScheduleError(detail::str(
        "prepost_receives=True needs a backend whose messages complete on the host (Gloo); "
        "this group (", p2p_->backend_name(), ") is stream-ordered, where receives are posted "
        "at their RECV action: leave prepost_receives unset"));
  build_dispatch();
  for (const auto& h : stages_) queues_weight_.push_back(h->queues_weight_work() ? 1 : 0);
  for (const auto& h : stages_) syncs_grads_.push_back(h->syncs_gradients() ? 1 : 0);
  mark_gradient_sync();
  split_plans_.resize(stages_.size());
  timer_ = std::make_unique<DeviceTimer>(p2p_->device(), options_.device_timing, entries_.size());
}

Executor::~Executor() = default;

void Executor::mark_gradient_sync() {
  std::vector<int> last(stages_.size(), -1);
  for (size_t i = 0; i < entries_.size(); ++i)
    if (entries_[i].op == Op::BackwardFull || entries_[i].op == Op::BackwardWeight)
      last[entries_[i].local] = static_cast<int>(i);
  for (size_t l = 0; l < stages_.size(); ++l)
    if (syncs_grads_[l] && last[l] >= 0) {
      entries_[last[l]].sync_grads = true;
      entries_[last[l]].on_worker = false;  // the sync hooks (Python, DDP/FSDP) run on this thread
    }
}

const StageSignatures& Executor::signatures(int stage) const {
  for (size_t i = 0; i < stage_ids_.size(); ++i)
    if (stage_ids_[i] == stage && ready_) return sigs_[i];
  throw Error(detail::str("no signatures for stage ", stage, " on rank ", rank_,
                          " (not local, or no step has run yet)"));
}

void Executor::build_dispatch() {
  const auto& acts = program_.ranks[rank_];
  const int m = program_.microbatches;
  std::vector<int> local_of(program_.num_stages, -1);
  for (size_t i = 0; i < stage_ids_.size(); ++i) local_of[stage_ids_[i]] = static_cast<int>(i);
  ZB_CHECK(static_cast<int64_t>(program_.num_stages) * 2 * m * kMaxTensorsPerMessage < (1 << 29),
           "too many stages x microbatches for the message tags (stages=", program_.num_stages,
           ", microbatches=", m, ")");

  auto local = [&](int stage, const Action& a) {
    ZB_CHECK(stage >= 0 && stage < program_.num_stages && local_of[stage] >= 0, "action '",
             to_string(a), "' on rank ", rank_, " names a stage this rank does not hold");
    return local_of[stage];
  };
  auto same_rank = [&](int stage) { return program_.rank_of(stage) == rank_; };
  trains_.assign(stage_ids_.size(), 0);

  auto add_compute = [&](const Action& a, int index) {
    Entry e{};
    e.index = index;
    e.stage = a.stage;
    e.local = local(a.stage, a);
    e.mb = a.microbatch;
    e.kind = a.kind;
    ZB_CHECK(e.mb >= 0 && e.mb < m, "action '", to_string(a), "' has microbatch out of range");
    switch (a.kind) {
      case Kind::F: e.op = Op::Forward; break;
      case Kind::B: e.op = Op::BackwardFull; break;
      case Kind::I: e.op = Op::BackwardInput; break;
      case Kind::W: e.op = Op::BackwardWeight; break;
      case Kind::SEND_F:
      case Kind::RECV_F:
      case Kind::SEND_B:
      case Kind::RECV_B:
      case Kind::OVERLAP_F_B: ZB_CHECK(false, "unexpected action '", to_string(a), "'");
    }
    if (is_backward(a.kind)) trains_[e.local] = 1;
    // What it receives and where its result goes: the core's one definition of producers.
    for (const Producer& d : producers_of(a, program_.num_stages))
      if (d.data && !same_rank(d.stage)) e.needs_recv = true;
    const int to = data_consumer(a, program_.num_stages);
    if (to >= 0) {
      if (same_rank(to)) e.handoff = local_of[to];
      else e.to_send = true;
    }
    entries_.push_back(e);
    TraceRecord rec{to_string(a), rank_, index, static_cast<int>(trace_.size())};
    if (acts[index].kind == Kind::OVERLAP_F_B) rec.unit = to_string(acts[index]);
    trace_.push_back(std::move(rec));
  };

  // Batches as the core's comm_batches defines them (the rendezvous check models the same).
  const auto batches = comm_batches(acts, options_.overlap_f_b);
  size_t next_batch = 0;
  auto add_batch = [&](size_t& i) {
    ZB_CHECK(next_batch < batches.size() && batches[next_batch].begin == static_cast<int>(i),
             "comm action '", to_string(acts[i]), "' outside a batch");
    const CommBatch& batch = batches[next_batch++];
    Entry e{};
    e.op = Op::Comm;
    e.index = static_cast<int>(i);
    e.comm_begin = static_cast<int>(comms_.size());
    std::string name;
    for (; static_cast<int>(i) < batch.end; ++i) {
      const Action& c = acts[i];
      Comm k{c.kind, c.stage, local(c.stage, c), c.microbatch, -1, 0, static_cast<int>(i), {}};
      ZB_CHECK(c.microbatch >= 0 && c.microbatch < m, "action '", to_string(c),
               "' has microbatch out of range");
      // Peer and tag from the core's definition: a message is named by the boundary's lower
      // stage and its direction.
      const int peer_stage = comm_peer_stage(c);
      k.peer = program_.rank_of(peer_stage);
      k.tag = data_tag(std::min<int>(c.stage, peer_stage), comm_payload(c).either_backward(), c.microbatch, m);
      k.desc = detail::str(to_string(c), c.kind == Kind::SEND_F || c.kind == Kind::SEND_B ? " to rank " : " from rank ", k.peer);
      comms_.push_back(std::move(k));
      name += (name.empty() ? "" : "+") + to_string(c);
    }
    e.comm_end = static_cast<int>(comms_.size());
    entries_.push_back(e);
    trace_.push_back(TraceRecord{name, rank_, e.index, static_cast<int>(trace_.size())});
  };
  for (size_t i = 0; i < acts.size();) {
    const Action& a = acts[i];
    if (is_comm(a.kind)) {
      add_batch(i);
      continue;
    }
    ZB_CHECK(is_compute(a.kind), "unexpected action '", to_string(a), "'");
    const Action* f = nullptr;
    const Action* b = nullptr;
    if (a.kind == Kind::OVERLAP_F_B && a.sub.size() == 2) {
      for (const auto& part : a.sub) {
        if (part.kind == Kind::F) f = &part;
        else if (is_backward(part.kind)) b = &part;
      }
    }
    if (options_.overlap_f_b && f && b && f->stage != b->stage) {
      // The backward half on the worker, the forward half here at the same time, then F's
      // SEND (the batch comm_batches split off) while the backward half may still run.
      add_compute(*b, static_cast<int>(i));
      entries_.back().on_worker = true;
      add_compute(*f, static_cast<int>(i));
      entries_.back().concurrent = true;
      ++i;
      if (next_batch < batches.size() && batches[next_batch].after_f_half &&
          batches[next_batch].begin == static_cast<int>(i)) {
        add_batch(i);
        entries_.back().concurrent = true;
      }
      continue;
    }
    if (a.kind == Kind::OVERLAP_F_B) {
      for (const auto& sub : a.sub) add_compute(sub, static_cast<int>(i));  // in sequence
    } else {
      add_compute(a, static_cast<int>(i));
    }
    ++i;
  }
  slots_.assign(stage_ids_.size() * static_cast<size_t>(m), Slot{});
}

void Executor::join_worker() {
  if (!worker_ || !worker_->busy()) return;
  const int index = worker_index_;
  worker_index_ = -1;
  try {
    worker_->join();  // rethrows what the backward half threw
  } catch (const std::exception& ex) {
    abandon_in_flight();
    fail(index, ex.what());
  }
}

void Executor::start_on_worker(size_t i) {
  const Entry& e = entries_[i];
  TraceRecord& rec = trace_[i];
  rec.host_start_ns = now_ns();
  if (e.needs_recv) {  // on this thread: P2P is not thread-safe
    Slot& sl = slot(e.local, e.mb);
    wait_recv(sl.grad_recv, sl.grad_recv_comm, rec);
  }
  if (!worker_) worker_ = std::make_unique<OverlapWorker>(p2p_->device());
  worker_index_ = e.index;
  const c10::Device device = p2p_->device();
  std::optional<c10::Stream> consumer;
  if (device_has_events(device)) consumer = current_stream(device);
  worker_->start([this, i, consumer] {
    const Entry& e = entries_[i];
    TraceRecord& rec = trace_[i];
    rec.host_start_ns = now_ns();  // the backward itself, as it overlaps the forward half
    rec.worker = true;
    timer_->mark(i, false);
    run_backward(e, consumer ? &*consumer : nullptr);
    timer_->mark(i, true);
    rec.host_end_ns = now_ns();
  });
}

void Executor::abandon_in_flight() {
  if (worker_ && worker_->busy()) {  // it uses the step's slots: let it finish first
    try {
      worker_->join();
    } catch (...) {
    }
  }
  worker_index_ = -1;
  p2p_->abandon_watched();
  for (auto& b : pending_sends_) P2P::abandon(std::move(b));
  pending_sends_.clear();
  for (auto& sl : slots_) {
    P2P::abandon(std::move(sl.fwd_recv));
    P2P::abandon(std::move(sl.grad_recv));
  }
  slots_.assign(slots_.size(), Slot{});
}

void Executor::fail(int index, const std::string& what) {
  broken_ = true;
  const auto& acts = program_.ranks[rank_];
  std::string action = index >= 0 && index < static_cast<int>(acts.size()) ? to_string(acts[index])
                       : index == kStepStart                                 ? "(start of step)"
                                                                             : "(end of step)";
  // A peer's failure seen first is the cause: name it (and what it did here); otherwise this
  // rank's failure is the one every peer is told about.
  std::optional<StepFailure> cause = watch_ ? watch_->seen() : std::nullopt;
  if (!cause && watch_) {
    StepFailure stands = watch_->report(StepFailure{rank_, action, steps_, what});
    if (stands.rank != rank_) cause = stands;
  }
  std::string why = what;
  if (cause) {
    why = cause->describe();
    if (what.find(why) == std::string::npos) why += detail::str("\n  (on this rank: ", what, ")");
  }
  throw PipelineError(detail::str(
      "zbpipe: rank ", rank_, " failed at action ", action, " (index ", index, ") of schedule '",
      program_.schedule, "' (pp=", program_.pp, ", stages=", program_.num_stages,
      ", microbatches=", program_.microbatches, "):\n  ", why,
      "\nprogram (failing action marked >> <<):\n", format_program(program_, rank_, index)));
}

void Executor::report_failure(const std::string& what) {
  if (broken_) return;
  try {
    ensure_watch();
  } catch (const std::exception&) {
  }
  broken_ = true;
  if (watch_) watch_->report(StepFailure{rank_, "(before the step)", steps_ + 1, what});
}

void Executor::check_outputs(const std::vector<at::Tensor>& outs, const std::vector<TensorSpec>& want,
                             const char* what, int stage, int mb) const {
  bool ok = outs.size() == want.size();
  for (size_t i = 0; ok && i < outs.size(); ++i)
    ok = outs[i].defined() && outs[i].scalar_type() == want[i].dtype &&
         outs[i].sizes().vec() == want[i].shape;
  if (ok) return;
  std::vector<TensorSpec> got;
  for (const auto& t : outs)
    got.push_back(t.defined() ? TensorSpec{t.sizes().vec(), t.scalar_type()} : TensorSpec{});
  throw PipelineError(detail::str(
      "stage ", stage, " microbatch ", mb, " produced ", what, " ", to_string(got),
      " but the pipeline agreed on ", to_string(want),
      options_.static_shapes
          ? " at the first step (static_shapes=True: every step and microbatch keeps the first step's shapes)"
          : " for this step's input signature (every microbatch of a step must have the same "
            "shapes; shapes may change between steps, following the first stage's inputs)"));
}

void Executor::wait_recv(std::shared_ptr<Batch>& batch, int comm, TraceRecord& rec) {
  if (!batch) return;  // an empty message (nothing differentiable crossed)
  const int64_t t0 = now_ns();
  p2p_->wait(batch, options_.timeout, comms_[comm].desc);
  rec.wait_ns += now_ns() - t0;
  batch.reset();
}

void Executor::add_recv_ops(const Comm& k, std::vector<P2POp>& ops) {
  Slot& sl = slot(k.local, k.mb);
  const bool fwd = k.kind == Kind::RECV_F;
  const auto& specs = fwd ? sigs_[k.local].inputs.specs : grad_specs_[k.local];
  auto& bufs = fwd ? sl.fwd_in : sl.grad_in;
  bufs.clear();
  auto opts = at::TensorOptions().device(p2p_->device());
  for (size_t i = 0; i < specs.size(); ++i) {
    bufs.push_back(at::empty(specs[i].shape, opts.dtype(specs[i].dtype)));
    ops.push_back(P2POp{false, k.peer, k.tag + static_cast<int>(i), bufs.back()});
  }
}

void Executor::prepost_receives() {
  for (int c = 0; c < static_cast<int>(comms_.size()); ++c) {
    const Comm& k = comms_[c];
    if (k.kind != Kind::RECV_F && k.kind != Kind::RECV_B) continue;
    std::vector<P2POp> ops;
    add_recv_ops(k, ops);
    if (ops.empty()) continue;  // nothing differentiable crosses: no message
    track_recv(c, p2p_->post(std::move(ops)));
  }
}

void Executor::track_recv(int c, std::shared_ptr<Batch> batch) {
  const Comm& k = comms_[c];
  Slot& sl = slot(k.local, k.mb);
  (k.kind == Kind::RECV_F ? sl.fwd_recv : sl.grad_recv) = std::move(batch);
  (k.kind == Kind::RECV_F ? sl.fwd_recv_comm : sl.grad_recv_comm) = c;
}

void Executor::post_comm(const Entry& e) {
  std::vector<P2POp> ops;
  bool has_send = false;
  for (int c = e.comm_begin; c < e.comm_end; ++c) {
    const Comm& k = comms_[c];
    Slot& sl = slot(k.local, k.mb);
    switch (k.kind) {
      case Kind::RECV_F:
      case Kind::RECV_B:
        if (!prepost_) add_recv_ops(k, ops);
        break;
      case Kind::SEND_F:
      case Kind::SEND_B: {
        auto& outs = k.kind == Kind::SEND_F ? sl.fwd_out : sl.grad_out;
        for (size_t i = 0; i < outs.size(); ++i)
          ops.push_back(P2POp{true, k.peer, k.tag + static_cast<int>(i), outs[i].contiguous()});
        outs.clear();
        has_send = true;
        break;
      }
      case Kind::F:
      case Kind::B:
      case Kind::I:
      case Kind::W:
      case Kind::OVERLAP_F_B:
        ZB_CHECK(false, "a comm entry holds '", kind_name(k.kind), "'");
    }
  }
  if (ops.empty()) return;
  auto batch = p2p_->post(std::move(ops));
  if (!prepost_)
    for (int c = e.comm_begin; c < e.comm_end; ++c)
      if (comms_[c].kind == Kind::RECV_F || comms_[c].kind == Kind::RECV_B) track_recv(c, batch);
  if (has_send) pending_sends_.push_back(std::move(batch));
}

void Executor::run_backward(const Entry& e, const c10::Stream* consumer) {
  Slot& sl = slot(e.local, e.mb);
  StageHandle& stage = *stages_[e.local];
  const bool last = e.stage == program_.num_stages - 1;
  std::vector<at::Tensor> root_grads = std::move(sl.grad_in);
  sl.grad_in.clear();
  auto roots = std::move(sl.roots);
  auto inputs = std::move(sl.saved_in);
  sl.roots.clear();
  sl.saved_in.clear();
  if (last) {
    root_grads.clear();
    for (const auto& r : roots) root_grads.push_back(at::full_like(r, loss_scale_));
    // Made on the worker's stream, read by autograd on the streams of the forward.
    if (consumer)
      for (const auto& g : root_grads) record_on_stream(g, *consumer);
  }
  std::vector<at::Tensor> in_grads;
  if (e.op == Op::BackwardFull || queues_weight_[e.local]) {
    in_grads = backward_full(roots, root_grads, inputs);
    if (queues_weight_[e.local]) stage.weight_work_queued(*step_, e.mb);
    if (e.op == Op::BackwardFull && queues_weight_[e.local]) stage.run_weight_work(*step_, e.mb);
  } else {
    in_grads = backward_input(roots, root_grads, inputs, sl.weight, &split_plans_[e.local]);
  }
  roots.clear();  // frees the input closure of the graph now, not at the end of the step
  if (e.handoff >= 0 || e.to_send) {
    // One gradient per differentiable input; zeros where the stage did not use it.
    std::vector<at::Tensor> out;
    const auto& in_specs = sigs_[e.local].inputs.specs;
    for (size_t i = 0; i < inputs.size() && i < in_specs.size(); ++i)
      if (in_specs[i].differentiable())
        out.push_back(in_grads[i].defined() ? std::move(in_grads[i]) : at::zeros_like(inputs[i]));
    check_outputs(out, in_grad_specs_[e.local], "input gradients", e.stage, e.mb);
    if (consumer)  // used (and freed) on the caller's stream after the join
      for (const auto& g : out) record_on_stream(g, *consumer);
    if (e.handoff >= 0) slot(e.handoff, e.mb).grad_in = std::move(out);
    else sl.grad_out = std::move(out);
  }
}

void Executor::run_entry(const Entry& e, TraceRecord& rec) {
  if (e.op == Op::Comm) {
    post_comm(e);
    return;
  }
  Slot& sl = slot(e.local, e.mb);
  StageHandle& stage = *stages_[e.local];
  const bool last = e.stage == program_.num_stages - 1;
  switch (e.op) {
    case Op::Forward: {
      if (e.needs_recv) wait_recv(sl.fwd_recv, sl.fwd_recv_comm, rec);
      auto inputs = std::move(sl.fwd_in);
      sl.fwd_in.clear();
      const auto& in_specs = sigs_[e.local].inputs.specs;
      if (trains_[e.local])
        for (size_t i = 0; i < inputs.size() && i < in_specs.size(); ++i)
          if (in_specs[i].differentiable()) inputs[i].set_requires_grad(true);
      ForwardResult res = stage.forward(*step_, e.mb, inputs);
      auto& outs = res.tensors;
      if (last) {
        result_->losses[e.mb] = std::move(res.loss);
        result_->outputs[e.mb] = std::move(res.output);
        if (trains_[e.local]) sl.roots = std::move(outs);
      } else {
        const auto& out_specs = sigs_[e.local].outputs.specs;
        check_outputs(outs, out_specs, "outputs", e.stage, e.mb);
        std::vector<at::Tensor> detached;
        detached.reserve(outs.size());
        for (size_t i = 0; i < outs.size(); ++i) {
          detached.push_back(outs[i].detach());  // the next stage starts its own graph
          if (trains_[e.local] && out_specs[i].differentiable()) sl.roots.push_back(std::move(outs[i]));
        }
        if (e.handoff >= 0) slot(e.handoff, e.mb).fwd_in = std::move(detached);
        else sl.fwd_out = std::move(detached);
      }
      if (trains_[e.local]) sl.saved_in = std::move(inputs);
      break;
    }
    case Op::BackwardInput:
    case Op::BackwardFull:
      if (e.needs_recv) wait_recv(sl.grad_recv, sl.grad_recv_comm, rec);
      run_backward(e, nullptr);
      break;
    case Op::BackwardWeight:
      if (queues_weight_[e.local]) stage.run_weight_work(*step_, e.mb);
      else backward_weight(sl.weight);
      break;
    case Op::Comm:
      break;
  }
}

StepResult Executor::run(const StepData& data, const Signature& first_inputs, double loss_scale) {
  if (broken_)
    throw PipelineError(detail::str(
        "zbpipe: rank ", rank_, ": this schedule failed in an earlier step; its process group "
        "may hold unmatched messages. Create a new process group and schedule."));
  ++steps_;
  StepResult result;
  if (program_.rank_of(program_.num_stages - 1) == rank_) {
    result.losses.resize(program_.microbatches);
    result.outputs.resize(program_.microbatches);
  }
  struct StepScope {  // the step's data and result are reachable from stage calls only during run
    Executor& ex;
    ~StepScope() { ex.step_ = nullptr; ex.result_ = nullptr; }
  } scope{*this};
  step_ = &data;
  result_ = &result;
  struct Disarm {  // the watcher polls only while a step runs
    FailureWatch* w = nullptr;
    ~Disarm() { if (w) w->disarm(); }
  } disarm;
  try {
    ensure_watch();
    if (watch_) {
      watch_->arm();
      disarm.w = watch_.get();
    }
    agree_before_step(first_inputs);
  } catch (const std::exception& ex) {
    abandon_in_flight();
    fail(kStepStart, ex.what());
  }
  loss_scale_ = loss_scale;
  timer_->start_step();
  prepost_ = options_.prepost_receives.value_or(true) && p2p_->host_completes();
  if (prepost_) {
    try {
      prepost_receives();
    } catch (const std::exception& ex) {
      abandon_in_flight();
      fail(kStepStart, detail::str("posting this step's receives failed: ", ex.what()));
    }
  }
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (e.op != Op::Comm && is_custom(program_.ranks[rank_][e.index].kind)) {
      i = run_custom(i);
      continue;
    }
    TraceRecord& rec = trace_[i];
    rec.wait_ns = 0;
    if (!e.concurrent) join_worker();
    try {
      if (e.on_worker) {
        start_on_worker(i);
        continue;
      }
      rec.host_start_ns = now_ns();
      timer_->mark(i, false);
      if (e.sync_grads) {
        static const std::vector<at::Tensor> kNoRoots;
        stages_[e.local]->begin_gradient_sync(e.op == Op::BackwardFull ? slot(e.local, e.mb).roots : kNoRoots);
      }
      run_entry(e, rec);
      if (e.sync_grads) stages_[e.local]->end_gradient_sync();
    } catch (const std::exception& ex) {
      abandon_in_flight();
      fail(e.index, ex.what());
    }
    timer_->mark(i, true);
    rec.host_end_ns = now_ns();
  }
  join_worker();
  try {
    for (auto& b : pending_sends_) p2p_->wait(b, options_.timeout, "a send of this step");
    p2p_->settle();  // stream-ordered: every wait of the step seen complete, each by its deadline
  } catch (const std::exception& ex) {
    abandon_in_flight();
    fail(-1, ex.what());
  }
  pending_sends_.clear();
  slots_.assign(slots_.size(), Slot{});  // every batch completed: drop the step's tensors
  timer_->collect(trace_);
  return result;
}

void Executor::set_custom_actions(std::shared_ptr<CustomActions> handler, const std::vector<Kind>& kinds) {
  uint32_t mask = 0;
  for (Kind k : kinds) {
    ZB_CHECK(is_compute(k), "custom functions replace compute actions only, got kind ",
             static_cast<int>(k));
    mask |= 1u << static_cast<int>(k);
  }
  custom_ = mask ? std::move(handler) : nullptr;
  custom_kinds_ = custom_ ? mask : 0;
}

size_t Executor::run_custom(size_t first) {
  const int index = entries_[first].index;
  size_t end = first;
  while (end < entries_.size() && entries_[end].op != Op::Comm && entries_[end].index == index) ++end;
  const Action& action = program_.ranks[rank_][index];
  part_begin_ = first;
  part_end_ = end;
  part_done_.assign(end - first, 0);
  try {
    custom_->run(action);
    for (size_t j = first; j < end; ++j) {
      if (part_done_[j - first]) continue;
      const Entry& e = entries_[j];
      throw Error(detail::str("the custom function for '", to_string(action),
                              "' returned without running its part '",
                              to_string(Action(e.stage, e.kind, e.mb)),
                              "' (it must call ctx.run(part) once for every part)"));
    }
  } catch (const std::exception& ex) {
    part_begin_ = part_end_ = 0;
    abandon_in_flight();
    fail(index, ex.what());
  }
  part_begin_ = part_end_ = 0;
  return end - 1;
}

void Executor::run_part(const Action& part) {
  ZB_CHECK(part_end_ > part_begin_, "run_part('", to_string(part),
           "') called outside a custom function of a running step");
  for (size_t j = part_begin_; j < part_end_; ++j) {
    const Entry& e = entries_[j];
    if (e.kind != part.kind || e.stage != part.stage || e.mb != part.microbatch) continue;
    ZB_CHECK(!part_done_[j - part_begin_], "'", to_string(part),
             "' already ran in this custom function");
    TraceRecord& rec = trace_[j];
    rec.wait_ns = 0;
    rec.host_start_ns = now_ns();
    timer_->mark(j, false);
    run_entry(e, rec);
    timer_->mark(j, true);
    rec.host_end_ns = now_ns();
    part_done_[j - part_begin_] = 1;
    return;
  }
  throw Error(detail::str("'", to_string(part), "' is not a part of the action '",
                          to_string(program_.ranks[rank_][entries_[part_begin_].index]),
                          "' this custom function runs"));
}

}  // namespace zbpipe::runtime
