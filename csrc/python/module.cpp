// The one binding file: zbpipe._C. Each subsystem registers itself from here.
// torch's pybind.h first: it brings torch's type casters (Tensor, Device, dtype) and the
// c10::intrusive_ptr holder, with the pybind11 torch bundles (so c10d types cross).
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fstream>
#include <optional>
#include <sstream>

#include "zbpipe/builders.h"
#include "zbpipe/compile.h"
#include "zbpipe/csv_format.h"
#include "zbpipe/error.h"
#include "zbpipe/passes.h"
#include "zbpipe/simulator.h"
#include "runtime/checkpoint_once.h"
#include "runtime/errors.h"
#include "runtime/executor.h"
#include "runtime/loopback.h"
#include "runtime/p2p.h"
#include "runtime/stage_backward.h"
#include "runtime/trace.h"

namespace py = pybind11;
using namespace zbpipe;

namespace {

CostModel make_costs(std::vector<double> f, std::vector<double> b, std::vector<double> w,
                     std::vector<double> b_full, double comm) {
  CostModel c;
  c.f = std::move(f);
  c.b = std::move(b);
  c.w = std::move(w);
  c.b_full = std::move(b_full);
  c.comm = comm;
  return c;
}

std::vector<std::string> action_strings(const Program& p, int rank, bool compute_only) {
  ZB_SCHEDULE_CHECK(rank >= 0 && rank < p.pp, "rank must be in [0, ", p.pp, "), got rank=", rank);
  std::vector<std::string> out;
  out.reserve(p.ranks[rank].size());
  for (const auto& a : p.ranks[rank])
    if (!compute_only || is_compute(a.kind)) out.push_back(to_string(a));
  return out;
}

Program program_from_lists(const std::vector<std::vector<std::string>>& ranks,
                           const std::vector<int>& stage_to_rank, int microbatches,
                           const std::string& name, bool rendezvous) {
  Program p;
  p.schedule = name;
  p.pp = static_cast<int>(ranks.size());
  p.stage_to_rank = stage_to_rank;
  p.num_stages = static_cast<int>(stage_to_rank.size());
  p.microbatches = microbatches;
  for (const auto& row : ranks) {
    std::vector<Action> acts;
    for (const auto& s : row) acts.push_back(parse_action(s));
    p.ranks.push_back(std::move(acts));
  }
  if (p.has_comms()) validate(p);
  else p = lower(p);
  if (rendezvous) validate_rendezvous(p);
  return p;
}

void register_errors(py::module_& m) {
  py::register_exception<ScheduleError>(m, "ScheduleError", PyExc_ValueError);
}

void register_core(py::module_& m) {
  py::enum_<Kind>(m, "Kind")
      .value("F", Kind::F).value("B", Kind::B).value("I", Kind::I).value("W", Kind::W)
      .value("SEND_F", Kind::SEND_F).value("RECV_F", Kind::RECV_F)
      .value("SEND_B", Kind::SEND_B).value("RECV_B", Kind::RECV_B)
      .value("OVERLAP_F_B", Kind::OVERLAP_F_B);

  py::class_<Action>(m, "Action", "One schedule action; str() is PyTorch's canonical form.")
      .def_static("parse", [](const std::string& s) { return parse_action(s); })
      .def_readonly("stage", &Action::stage)
      .def_readonly("kind", &Action::kind)
      .def_readonly("microbatch", &Action::microbatch)
      .def_readonly("sub_actions", &Action::sub)
      // torch's _Action names, so callbacks written for torch read zbpipe actions unchanged.
      .def_readonly("stage_index", &Action::stage)
      .def_readonly("computation_type", &Action::kind)
      .def_readonly("microbatch_index", &Action::microbatch)
      .def_property_readonly("is_compute", [](const Action& a) { return is_compute(a.kind); })
      .def("__str__", [](const Action& a) { return to_string(a); })
      .def("__repr__", [](const Action& a) { return to_string(a); })
      .def("__eq__", [](const Action& a, const Action& b) { return a == b; })
      .def("__hash__", [](const Action& a) { return std::hash<std::string>()(to_string(a)); });

  py::class_<Program>(m, "Program", "A compiled pipeline program: topology + per-rank actions.")
      .def_readonly("schedule", &Program::schedule)
      .def_readonly("pp", &Program::pp)
      .def_readonly("num_stages", &Program::num_stages)
      .def_readonly("microbatches", &Program::microbatches)
      .def_readonly("stage_to_rank", &Program::stage_to_rank)
      .def("stages_of", &Program::stages_of, py::arg("rank"))
      .def("actions", [](const Program& p, int r) { return action_strings(p, r, false); }, py::arg("rank"),
           "Actions of `rank` with communication, as canonical strings.")
      .def("compute_actions", [](const Program& p, int r) { return action_strings(p, r, true); },
           py::arg("rank"), "Compute actions of `rank` only.")
      .def("rank_actions", [](const Program& p, int r) {
             ZB_SCHEDULE_CHECK(r >= 0 && r < p.pp, "rank must be in [0, ", p.pp, "), got rank=", r);
             return p.ranks[r];
           }, py::arg("rank"), "Actions of `rank` as Action values.")
      .def("format", [](const Program& p, int mark_rank, int mark_index) {
             return format_program(p, mark_rank, mark_index);
           }, py::arg("mark_rank") = -1, py::arg("mark_index") = -1)
      .def("csv", [](const Program& p) { return to_csv(p); }, "The program in PyTorch's CSV layout.")
      .def("to_csv", [](const Program& p, const std::string& path) {
             std::ofstream f(path, std::ios::binary);
             ZB_CHECK(f.good(), "cannot open '", path, "' for writing");
             f << to_csv(p);
           }, py::arg("path"), "Writes the program in PyTorch's CSV layout (one row per rank).")
      .def_static("from_csv", [](const std::string& path, bool rendezvous) {
             std::ifstream f(path, std::ios::binary);
             ZB_SCHEDULE_CHECK(f.good(), "cannot open CSV schedule '", path, "'");
             std::stringstream ss;
             ss << f.rdbuf();
             Program p = from_csv(ss.str());
             if (rendezvous) validate_rendezvous(p);
             return p;
           }, py::arg("path"), py::arg("rendezvous") = false,
           "Loads a PyTorch CSV schedule (compute-only is lowered), validated; rendezvous=True "
           "also checks it with NCCL's rendezvous sends (see zbpipe._C.validate).")
      .def_static("from_csv_text", [](const std::string& text, bool rendezvous) {
             Program p = from_csv(text);
             if (rendezvous) validate_rendezvous(p);
             return p;
           }, py::arg("text"), py::arg("rendezvous") = false)
      .def_static("from_actions", &program_from_lists, py::arg("ranks"), py::arg("stage_to_rank"),
                  py::arg("microbatches"), py::arg("name") = "custom", py::arg("rendezvous") = false,
                  "Builds a program from per-rank action strings (lowered if compute-only), "
                  "validated; rendezvous=True also with NCCL's rendezvous sends.")
      .def("compute_only", &strip_comms)
      .def("__repr__", [](const Program& p) {
        return zbpipe::detail::str("Program(schedule='", p.schedule, "', pp=", p.pp, ", num_stages=",
                           p.num_stages, ", microbatches=", p.microbatches, ")");
      });

  m.def("schedule_names", &schedule_names, "Every schedule the core can build.");
  m.def("schedule_summaries", [] {
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& info : schedule_registry()) out.emplace_back(info.name, info.summary);
    return out;
  });
  m.def("compile", [](const std::string& name, int pp, int microbatches, int stages_per_rank,
                      std::optional<std::vector<double>> f, std::optional<std::vector<double>> b,
                      std::optional<std::vector<double>> w,
                      std::optional<std::vector<double>> b_full, std::optional<double> comm,
                      std::optional<int> memory_cap, bool exhaustive_search,
                      std::optional<int> search_threads) {
          // An option left at None is not given: the schedule's default applies and no schedule
          // refuses it (see check_options).
          BuildArgs args;
          args.pp = pp;
          args.microbatches = microbatches;
          args.stages_per_rank = stages_per_rank;
          auto take = [&](const char* option, auto& from, auto& to) {
            if (!from) return;
            to = std::move(*from);
            args.given.emplace_back(option);
          };
          take("f", f, args.costs.f);
          take("b", b, args.costs.b);
          take("w", w, args.costs.w);
          take("b_full", b_full, args.costs.b_full);
          take("comm", comm, args.costs.comm);
          take("memory_cap", memory_cap, args.memory_cap);
          if (exhaustive_search) {
            args.exhaustive_search = true;
            args.given.emplace_back("exhaustive_search");
          }
          take("search_threads", search_threads, args.search_threads);
          py::gil_scoped_release nogil;
          return compile(name, args);
        }, py::arg("name"), py::arg("pp"), py::arg("microbatches"), py::arg("stages_per_rank") = 0,
        py::arg("f") = py::none(), py::arg("b") = py::none(), py::arg("w") = py::none(),
        py::arg("b_full") = py::none(), py::arg("comm") = py::none(),
        py::arg("memory_cap") = py::none(), py::arg("exhaustive_search") = false,
        py::arg("search_threads") = py::none());
  m.def("search_thread_count", &search_thread_count, py::arg("search_threads") = 0,
        "The threads zb_auto / v_half / v_min search on for a search_threads value (0 = the "
        "default: the CPUs this process may run on, at most 8).");
  m.def("schedule_options", [](const std::string& name) { return find_schedule(name).options; },
        py::arg("name"), "The compile options (costs, memory_cap) the schedule's builder uses.");
  m.def("build", [](const std::string& name, int pp, int microbatches, int stages_per_rank) {
          BuildArgs args;
          args.pp = pp;
          args.microbatches = microbatches;
          args.stages_per_rank = stages_per_rank;
          return find_schedule(name).build(args);
        }, py::arg("name"), py::arg("pp"), py::arg("microbatches"), py::arg("stages_per_rank") = 0,
        "Runs only the builder: the compute-only program, not lowered or validated.");
  m.def("validate", [](const Program& p, bool rendezvous) {
          validate(p);
          if (rendezvous) validate_rendezvous(p);
        }, py::arg("program"), py::arg("rendezvous") = false,
        "Checks the program (ScheduleError on a violation). rendezvous=True also runs it with "
        "sends that complete only once their receive is posted, as on NCCL.");
  m.def("comm_batches", [](const Program& p, int rank, bool split_overlap) {
          ZB_SCHEDULE_CHECK(rank >= 0 && rank < p.pp, "rank must be in [0, ", p.pp, "), got rank=", rank);
          std::vector<std::tuple<int, int, bool>> out;
          for (const auto& b : comm_batches(p.ranks[rank], split_overlap)) out.emplace_back(b.begin, b.end, b.after_f_half);
          return out;
        }, py::arg("program"), py::arg("rank"), py::arg("split_overlap") = true,
        "The runtime's batches of `rank`: (begin, end, after_f_half) action index ranges.");
  m.def("insert_send_recv", &insert_send_recv, py::arg("program"));
  m.def("lower", &lower, py::arg("compute_only"), "insert_send_recv, then validate.");
  m.def("strip_backward", &strip_backward, py::arg("compute_only"),
        "The forwards of a compute-only program, same order and topology.");

  py::class_<TimelineEvent>(m, "TimelineEvent")
      .def_readonly("rank", &TimelineEvent::rank)
      .def_readonly("action", &TimelineEvent::action)
      .def_readonly("start", &TimelineEvent::start)
      .def_readonly("end", &TimelineEvent::end)
      .def("__repr__", [](const TimelineEvent& e) {
        return zbpipe::detail::str("TimelineEvent(rank=", e.rank, ", action=", to_string(e.action),
                           ", start=", e.start, ", end=", e.end, ")");
      });
  py::class_<SimResult>(m, "SimResult")
      .def_readonly("makespan", &SimResult::makespan)
      .def_readonly("bubble_rate", &SimResult::bubble_rate)
      .def_readonly("idle_rate", &SimResult::idle_rate)
      .def_readonly("busy", &SimResult::busy)
      .def_readonly("span", &SimResult::span)
      .def_readonly("peak_activations", &SimResult::peak_activations)
      .def_readonly("timeline", &SimResult::timeline)
      .def("__repr__", [](const SimResult& r) {
        return zbpipe::detail::str("SimResult(makespan=", r.makespan, ", bubble_rate=", r.bubble_rate, ")");
      });
  m.def("simulate", [](const Program& p, std::vector<double> f, std::vector<double> b,
                       std::vector<double> w, std::vector<double> b_full, double comm) {
          return simulate(p, make_costs(std::move(f), std::move(b), std::move(w), std::move(b_full), comm));
        }, py::arg("program"), py::arg("f"), py::arg("b"), py::arg("w"),
        py::arg("b_full") = std::vector<double>{}, py::arg("comm") = 0.0);
}

// ---- runtime: the Python PipelineStage behind the C++ StageHandle interface ---------------

using runtime::Signature;
using runtime::TensorSpec;

py::list specs_to_py(const std::vector<TensorSpec>& specs) {
  py::list out;
  for (const auto& s : specs) out.append(py::make_tuple(py::tuple(py::cast(s.shape)), s.dtype));
  return out;
}

std::vector<TensorSpec> specs_from_py(const py::handle& obj) {
  std::vector<TensorSpec> out;
  for (auto item : obj) {
    auto pair = item.cast<py::tuple>();
    out.push_back(TensorSpec{pair[0].cast<std::vector<int64_t>>(), pair[1].cast<at::ScalarType>()});
  }
  return out;
}

// Runs f() (with the GIL held) and turns a Python exception into a StageError carrying its
// formatted traceback; `where` names the Python code that raised.
template <typename F>
auto guarded(F&& f, const char* where = "the stage") -> decltype(f()) {
  try {
    return f();
  } catch (py::error_already_set& e) {
    std::string text;
    try {
      auto lines = py::module_::import("traceback").attr("format_exception")(e.type(), e.value(), e.trace());
      text = py::str("").attr("join")(lines).cast<std::string>();
    } catch (...) {
      text = e.what();
    }
    throw runtime::StageError(std::string("exception in ") + where + ":\n" + text);
  } catch (py::cast_error& e) {
    throw runtime::StageError(std::string(where) + " returned a value of the wrong type: " + e.what());
  }
}

// Trampoline: each call re-acquires the GIL (the executor runs without it); Python exceptions
// become StageErrors (guarded).
class PyStage final : public runtime::StageHandle {
 public:
  explicit PyStage(py::object stage)
      : stage_(std::move(stage)),
        forward_(stage_.attr("_zb_forward")),
        weight_work_(stage_.attr("_zb_weight_work")),
        weight_queued_(stage_.attr("_zb_weight_work_queued")),
        infer_(stage_.attr("_zb_infer_outputs")),
        queues_weight_(stage_.attr("_zb_queues_weight_work").cast<bool>()),
        syncs_grads_(stage_.attr("_zb_syncs_gradients").cast<bool>()) {}

  ~PyStage() override {
    py::gil_scoped_acquire gil;
    stage_ = forward_ = weight_work_ = weight_queued_ = infer_ = py::object();
  }

  bool syncs_gradients() const override { return syncs_grads_; }
  void begin_gradient_sync(const std::vector<at::Tensor>& roots) override {
    py::gil_scoped_acquire gil;
    guarded([&] {
      stage_.attr("_zb_grad_sync_begin")(roots);
      return 0;
    });
  }
  void end_gradient_sync() override {
    py::gil_scoped_acquire gil;
    guarded([&] {
      stage_.attr("_zb_grad_sync_end")();
      return 0;
    });
  }
  Signature step_inputs() override {
    py::gil_scoped_acquire gil;
    return guarded([&] {
      py::tuple res = stage_.attr("_zb_step_inputs")();
      return Signature{specs_from_py(res[0]), res[1].cast<std::string>()};
    });
  }
  void use_inputs(const Signature& in) override {
    py::gil_scoped_acquire gil;
    guarded([&] {
      stage_.attr("_zb_use_inputs")(in.structure);
      return 0;
    });
  }

  std::vector<at::Tensor> forward(int mb, const std::vector<at::Tensor>& inputs) override {
    py::gil_scoped_acquire gil;
    return guarded([&] { return forward_(mb, inputs).cast<std::vector<at::Tensor>>(); });
  }
  bool queues_weight_work() const override { return queues_weight_; }
  void run_weight_work(int mb) override {
    py::gil_scoped_acquire gil;
    guarded([&] {
      weight_work_(mb);
      return 0;
    });
  }
  void weight_work_queued(int mb) override {
    py::gil_scoped_acquire gil;
    guarded([&] {
      weight_queued_(mb);
      return 0;
    });
  }
  Signature infer_outputs(const Signature& in) override {
    py::gil_scoped_acquire gil;
    return guarded([&] {
      py::tuple res = infer_(specs_to_py(in.specs), in.structure);
      return Signature{specs_from_py(res[0]), res[1].cast<std::string>()};
    });
  }

 private:
  py::object stage_, forward_, weight_work_, weight_queued_, infer_;
  bool queues_weight_;
  bool syncs_grads_;
};

// register_custom_function's handler: a Python callable fn(action), called with the GIL.
class PyCustomActions final : public runtime::CustomActions {
 public:
  explicit PyCustomActions(py::object fn) : fn_(std::move(fn)) {}
  ~PyCustomActions() override {
    py::gil_scoped_acquire gil;
    fn_ = py::object();
  }
  void run(const Action& action) override {
    py::gil_scoped_acquire gil;
    guarded([&] {
      fn_(action);
      return 0;
    }, "the custom function");
  }

 private:
  py::object fn_;
};

py::dict trace_record_to_py(const runtime::TraceRecord& r) {
  py::dict d;
  d["action"] = r.action;
  d["rank"] = r.rank;
  d["index"] = r.index;
  d["entry"] = r.entry;
  d["unit"] = r.unit;
  d["host_start_ns"] = r.host_start_ns;
  d["host_end_ns"] = r.host_end_ns;
  d["wait_ns"] = r.wait_ns;
  d["worker"] = r.worker;
  d["device_start_us"] = r.device_start_us;
  d["device_end_us"] = r.device_end_us;
  return d;
}

void register_runtime(py::module_& m) {
  py::register_exception<runtime::PipelineError>(m, "PipelineError", PyExc_RuntimeError);

  py::class_<runtime::Executor>(m, "Executor",
      "Runs one rank's lowered program over a c10d process group (see csrc/runtime/executor.h).")
      .def(py::init([](const Program& program, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                       const py::dict& stages, const at::Device& device, double timeout_s,
                       bool device_timing, std::optional<bool> prepost_receives, bool static_shapes,
                       std::optional<bool> stream_ordered, bool overlap_f_b) {
             std::map<int, std::shared_ptr<runtime::StageHandle>> handles;
             for (auto [k, v] : stages)
               handles[k.cast<int>()] = std::make_shared<PyStage>(py::reinterpret_borrow<py::object>(v));
             runtime::ExecutorOptions opts;
             opts.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
             opts.device_timing = device_timing;
             opts.prepost_receives = prepost_receives;
             opts.static_shapes = static_shapes;
             opts.overlap_f_b = overlap_f_b;
             runtime::P2POptions p2p_opts;
             p2p_opts.stream_ordered = stream_ordered;
             return std::make_unique<runtime::Executor>(
                 program, std::make_unique<runtime::P2P>(pg, device, p2p_opts), std::move(handles), opts);
           }),
           py::arg("program"), py::arg("process_group"), py::arg("stages"), py::arg("device"),
           py::arg("timeout_s") = 300.0, py::arg("device_timing") = false,
           py::arg("prepost_receives") = py::none(), py::arg("static_shapes") = false,
           py::arg("stream_ordered") = py::none(), py::arg("overlap_f_b") = true)
      .def("run", &runtime::Executor::run, py::arg("loss_scale") = 1.0,
           py::call_guard<py::gil_scoped_release>(),
           "Runs one step of the program; each microbatch loss backpropagates `loss_scale` (the GIL "
           "is released; stage calls re-acquire it).")
      .def("set_custom_actions", [](runtime::Executor& e, py::object fn, const std::vector<Kind>& kinds) {
             e.set_custom_actions(fn.is_none() ? nullptr : std::make_shared<PyCustomActions>(std::move(fn)), kinds);
           }, py::arg("fn"), py::arg("kinds"),
           "Actions of `kinds` run through fn(action) from the next step on (see CustomActions).")
      .def("run_part", &runtime::Executor::run_part, py::arg("part"),
           py::call_guard<py::gil_scoped_release>(),
           "Inside a custom function: runs a part of the current action with the built-in computation.")
      .def_static("report_setup_failure",
                  [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const at::Device& device,
                     const std::string& what) {
                    runtime::P2P p2p(pg, device);
                    runtime::Executor::report_setup_failure(p2p, what);
                  },
                  py::arg("process_group"), py::arg("device"), py::arg("what"),
                  py::call_guard<py::gil_scoped_release>(),
                  "Tells the peers' executor of the same number that this rank's could not be built.")
      .def("report_failure", &runtime::Executor::report_failure, py::arg("what"),
           py::call_guard<py::gil_scoped_release>(),
           "Tells every peer that this rank's step failed before it ran (e.g. a bad batch); the "
           "executor is unusable afterwards.")
      .def_property_readonly("handshakes", &runtime::Executor::handshakes,
                             "Shape handshakes run so far (one per distinct input signature).")
      .def_property_readonly("rank", &runtime::Executor::rank)
      .def_property_readonly("program", &runtime::Executor::program)
      .def("set_timeout", [](runtime::Executor& e, double s) {
             e.set_timeout(std::chrono::milliseconds(static_cast<int64_t>(s * 1000.0)));
           }, py::arg("timeout_s"))
      .def("signatures", [](const runtime::Executor& e, int stage) {
             const auto& s = e.signatures(stage);
             return py::make_tuple(py::make_tuple(specs_to_py(s.inputs.specs), s.inputs.structure),
                                   py::make_tuple(specs_to_py(s.outputs.specs), s.outputs.structure));
           }, py::arg("stage"))
      .def("trace", [](const runtime::Executor& e) {
             py::list out;
             for (const auto& r : e.trace()) out.append(trace_record_to_py(r));
             return out;
           }, "Per-action timing of the last step: list of dicts (host ns, device us).")
      .def("chrome_trace", [](const runtime::Executor& e) { return runtime::chrome_trace_json(e.trace()); })
      .def("export_chrome_trace", [](const runtime::Executor& e, const std::string& path) {
             runtime::write_chrome_trace(path, e.trace());
           }, py::arg("path"));

  py::class_<runtime::LoopbackWorld>(m, "_LoopbackWorld",
      "In-process process groups that record every post and wait (tests, the NCCL model; see "
      "csrc/runtime/loopback.h).")
      .def(py::init<int, bool>(), py::arg("size"), py::arg("stream_waits") = false)
      .def_property_readonly("size", &runtime::LoopbackWorld::size)
      .def("group", &runtime::LoopbackWorld::group, py::arg("rank"))
      .def("clear_events", &runtime::LoopbackWorld::clear_events)
      .def("events", [](const runtime::LoopbackWorld& w, int rank) {
             py::list out;
             for (const auto& e : w.events(rank)) {
               const char* type = e.type == runtime::LoopbackEvent::Type::Post   ? "post"
                                  : e.type == runtime::LoopbackEvent::Type::Wait ? "wait"
                                                                                 : "sync";
               py::list ops;
               for (const auto& o : e.ops)
                 ops.append(py::make_tuple(o.is_send ? "send" : "recv", o.peer, o.tag, o.bytes));
               out.append(py::make_tuple(type, e.work, e.coalesced, ops));
             }
             return out;
           }, py::arg("rank"),
           "Recorded calls of `rank`: (type, work, coalesced, ops) with type 'post', 'wait' or "
           "'sync' and ops [(\"send\"|\"recv\", peer, wire tag, bytes)] on posts.");
}

// The stage backward on its own (single process), for tests and for trainers that split a
// backward themselves: the same code the executor runs for B, I and W.
void register_backward(py::module_& m) {
  py::class_<runtime::WeightWork>(m, "WeightWork", "What backward_weight needs, captured by backward_input.")
      .def("__len__", [](const runtime::WeightWork& w) { return w.roots.size(); },
           "Number of W's roots (boundary node inputs and values sent into the weight region).")
      .def_property_readonly("captured_bytes", &runtime::WeightWork::captured_bytes,
                             "Bytes of the captured gradients W holds (beyond the graph's saved tensors).")
      .def_property_readonly("rerun", [](const runtime::WeightWork& w) {
             py::list names;
             for (const auto& n : w.rerun) names.append(n->name());
             return names;
           }, "Names of the boundary nodes W runs again for their weight side.");
  py::class_<runtime::SplitPlanCache>(m, "SplitPlanCache",
      "The I/W split's graph analysis, kept per graph shape (one per stage; the executor keeps its own).")
      .def(py::init<>())
      .def_property_readonly("hits", &runtime::SplitPlanCache::hits)
      .def_property_readonly("misses", &runtime::SplitPlanCache::misses);
  m.def("backward_full", &runtime::backward_full, py::arg("roots"), py::arg("root_grads"), py::arg("inputs"),
        py::call_guard<py::gil_scoped_release>(),
        "B: backpropagates into every leaf's .grad; returns the gradients of `inputs` (None where none).");
  m.def("backward_input", [](const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& root_grads,
                             const std::vector<at::Tensor>& inputs, runtime::SplitPlanCache* cache) {
          auto work = std::make_unique<runtime::WeightWork>();
          std::vector<at::Tensor> grads;
          {
            py::gil_scoped_release nogil;
            grads = runtime::backward_input(roots, root_grads, inputs, *work, cache);
          }
          return py::make_tuple(grads, std::move(work));
        }, py::arg("roots"), py::arg("root_grads"), py::arg("inputs"), py::arg("cache") = nullptr,
        "I: (gradients of `inputs`, WeightWork); no parameter .grad is touched. `cache`: a "
        "SplitPlanCache reused across microbatches of one stage (None analyses every call).");
  m.def("backward_weight", &runtime::backward_weight, py::arg("work"),
        py::call_guard<py::gil_scoped_release>(),
        "W: accumulates the parameter gradients captured by backward_input.");
  m.def("_checkpoint_keeps_unpacked", &runtime::checkpoint_once::keeps_unpacked,
        "True while a boundary node runs its input side in I on this thread: a checkpoint "
        "unpack keeps the recomputed tensor for the node's re-run in W (zbpipe/checkpointing.py).");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "zbpipe compiled core (schedule IR, builders, passes, simulator) and runtime";
  register_errors(m);
  register_core(m);
  register_runtime(m);
  register_backward(m);
}
