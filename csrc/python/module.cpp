// The one binding file of zbpipe._C: it only registers. Logic lives in the topic files beside
// it: arguments (the door for argument checks), py_core (compile options, costs, reprs),
// py_stage (the PipelineStage trampoline), py_executor (building and running an Executor,
// trace conversion), py_backward (the split).
// torch's pybind.h first: it brings torch's type casters (Tensor, Device, dtype) and the
// c10::intrusive_ptr holder, with the pybind11 torch bundles (so c10d types cross).
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "python/arguments.h"
#include "python/py_backward.h"
#include "python/py_core.h"
#include "python/py_executor.h"
#include "python/py_partition.h"
#include "zbpipe/builders.h"
#include "zbpipe/compile.h"
#include "zbpipe/csv_format.h"
#include "zbpipe/error.h"
#include "zbpipe/passes.h"
#include "zbpipe/program_io.h"
#include "runtime/checkpoint_once.h"
#include "runtime/control_plane_rank.h"
#include "runtime/errors.h"

namespace py = pybind11;
using namespace zbpipe;
using namespace zbpipe::python;

namespace {

void register_arguments(py::module_& m) {
  // zbpipe/_door.py's checks of compile, simulate and refine, written by the bindings' door.
  m.def("_wrong_type_message", &wrong_type_message_arg, py::arg("function"), py::arg("name"),
        py::arg("takes"), py::arg("value"),
        "The one-line TypeError message for a value of the wrong type (arguments.h).");
  m.def("_check_text", &check_text_arg, py::arg("function"), py::arg("name"), py::arg("value"),
        "TypeError unless a str; ScheduleError if UTF-8 cannot encode it (a lone surrogate).");
}

void register_actions(py::module_& m) {
  py::register_exception<ScheduleError>(m, "ScheduleError", PyExc_ValueError);

  py::enum_<Kind>(m, "Kind")
      .value("F", Kind::F).value("B", Kind::B).value("I", Kind::I).value("W", Kind::W)
      .value("SEND_F", Kind::SEND_F).value("RECV_F", Kind::RECV_F)
      .value("SEND_B", Kind::SEND_B).value("RECV_B", Kind::RECV_B)
      .value("OVERLAP_F_B", Kind::OVERLAP_F_B)
      .value("S", Kind::S).value("T", Kind::T).value("BCAST_F", Kind::BCAST_F)
      .value("ALLREDUCE_S", Kind::ALLREDUCE_S).value("REDUCE_B", Kind::REDUCE_B).value("E", Kind::E)
      .value("EW", Kind::EW).value("REDUCE_E", Kind::REDUCE_E).value("BCAST_E", Kind::BCAST_E);

  py::class_<Action>(m, "Action", "One schedule action; str() is PyTorch's canonical form.")
      .def_static("parse", &parse_action_arg, py::arg("text"), "The action of a canonical string (ScheduleError otherwise).")
      .def_readonly("stage", &Action::stage)
      .def_readonly("kind", &Action::kind)
      .def_readonly("microbatch", &Action::microbatch)
      .def_readonly("sub_actions", &Action::sub)
      // torch's _Action names, so callbacks written for torch read zbpipe actions unchanged.
      .def_readonly("stage_index", &Action::stage)
      .def_readonly("computation_type", &Action::kind)
      .def_readonly("microbatch_index", &Action::microbatch)
      .def_property_readonly("is_compute", &action_is_compute)
      .def("__str__", py::overload_cast<const Action&>(&zbpipe::to_string))
      .def("__repr__", py::overload_cast<const Action&>(&zbpipe::to_string))
      .def(py::self == py::self)
      .def("__hash__", &action_hash);
}

void register_program(py::module_& m) {
  // Names: actions are canonical strings unless the name says values (action_values); CSV is
  // a file path unless the name says text (to_csv_text / from_csv_text).
  py::class_<Program>(m, "Program", "A compiled pipeline program: topology + per-rank actions.")
      .def_readonly("schedule", &Program::schedule)
      .def_readonly("pp", &Program::pp)
      .def_readonly("num_stages", &Program::num_stages)
      .def_readonly("microbatches", &Program::microbatches)
      .def_readonly("stage_to_rank", &Program::stage_to_rank)
      .def("stages_of", &Program::stages_of, py::arg("rank"))
      .def("actions", &actions_with_comms, py::arg("rank"), "Actions of `rank` with communication, as canonical strings.")
      .def("compute_actions", &compute_actions, py::arg("rank"), "Compute actions of `rank` only, as canonical strings.")
      .def("action_values", &rank_actions, py::arg("rank"), "Actions of `rank` with communication, as Action values.")
      .def("format", &format_program, py::arg("mark_rank") = -1, py::arg("mark_index") = -1,
           "The per-rank grid; the action at (mark_rank, mark_index) is marked >> <<.")
      .def("to_csv", &write_csv_file, py::arg("path"), "Writes the program in PyTorch's CSV layout (one row per rank).")
      .def("to_csv_text", py::overload_cast<const Program&>(&zbpipe::to_csv), "The program in PyTorch's CSV layout, as text.")
      .def_static("from_csv", &program_from_csv_arg, py::arg("path"), py::arg("rendezvous") = false,
                  "Loads a PyTorch CSV schedule file (compute-only is lowered), validated; rendezvous=True "
                  "also checks it with NCCL's rendezvous sends (see zbpipe._C.validate).")
      .def_static("from_csv_text", &program_from_csv_text_arg, py::arg("text"), py::arg("rendezvous") = false,
                  "from_csv on CSV text instead of a file.")
      .def_static("from_actions", &program_from_actions_arg, py::arg("ranks"), py::arg("stage_to_rank"),
                  py::arg("microbatches"), py::arg("name") = "custom", py::arg("rendezvous") = false,
                  "Builds a program from per-rank action strings (lowered if compute-only), "
                  "validated; rendezvous=True also with NCCL's rendezvous sends.")
      .def("compute_only", &strip_comms, "The program without its SEND/RECV actions.")
      .def_property_readonly("fingerprint", &fingerprint,
                             "What the program does, as text: topology, microbatches and a hash of the action lists "
                             "(the name aside); the runtime's program agreement compares it with the name added.")
      .def("__eq__", &same_program, py::is_operator(),
           "Equal topology, microbatches and action lists (the name aside: zb_auto may build zb_h1's program).")
      .def("__hash__", &program_hash)
      .def("__repr__", &program_repr);
}

void register_compile(py::module_& m) {
  m.def("schedule_names", &schedule_names, "Every schedule the core can build.");
  m.def("schedule_summaries", &schedule_summaries, "(name, one-line summary) of every schedule.");
  m.def("compile", &compile_program, py::arg("name"), py::arg("pp"), py::arg("microbatches"),
        py::arg("stages_per_rank") = 0, py::arg("f") = py::none(), py::arg("b") = py::none(),
        py::arg("w") = py::none(), py::arg("b_full") = py::none(), py::arg("comm") = py::none(),
        py::arg("mem_f") = py::none(), py::arg("mem_w") = py::none(),
        py::arg("memory_cap") = py::none(), py::arg("exhaustive_search") = false,
        py::arg("search_threads") = py::none(), py::arg("refine") = py::none(),
        py::arg("vocab_parallel") = false, py::arg("s") = py::none(), py::arg("t") = py::none(),
        py::arg("collective") = py::none(), py::arg("mem_s") = py::none(), py::arg("backlog") = py::none(),
        py::arg("lookahead") = py::none(), py::arg("vocab_embedding") = false, py::arg("e") = py::none(),
        py::arg("ew") = py::none(),
        "Builds, lowers and validates a schedule (vocab_parallel: with the vocabulary head's S and T "
        "passes and collectives placed; vocab_embedding: with the input embedding's E and EW passes "
        "and collectives, vocab.h); options left at None are not given.");
  m.def("insert_embedding", &insert_embedding_program, py::arg("program"), py::arg("f") = std::vector<double>{1.0},
        py::arg("b") = std::vector<double>{1.0}, py::arg("w") = std::vector<double>{1.0}, py::arg("comm") = 0.0,
        py::arg("e") = std::vector<double>{0.1}, py::arg("ew") = std::vector<double>{0.1},
        py::arg("collective") = 0.0,
        "The embedding pass (vocab.h) on a lowered program without embedding actions, then validate.");
  m.def("insert_vocab", &insert_vocab_program, py::arg("program"), py::arg("f") = std::vector<double>{1.0},
        py::arg("b") = std::vector<double>{1.0}, py::arg("w") = std::vector<double>{1.0}, py::arg("comm") = 0.0,
        py::arg("s") = std::vector<double>{1.0}, py::arg("t") = std::vector<double>{1.0},
        py::arg("collective") = 0.0, py::arg("mem_s") = std::vector<double>{}, py::arg("backlog") = 2,
        "The vocabulary pass (vocab.h) on a lowered program without vocabulary actions, then validate.");
  m.def("size_limits", &size_limits,
        "The largest program zbpipe accepts (see csrc/include/zbpipe/limits.h); larger requests "
        "raise ScheduleError before allocating.");
  m.def("search_thread_count", &search_thread_count, py::arg("search_threads") = 0,
        "The threads zb_auto / v_half / v_min search on for a search_threads value (0 = the "
        "default: the CPUs this process may run on, at most 8).");
  m.def("schedule_options", &schedule_option_names, py::arg("name"),
        "The compile options (costs, memory_cap) the schedule's builder uses.");
  m.def("build", &build_program, py::arg("name"), py::arg("pp"), py::arg("microbatches"),
        py::arg("stages_per_rank") = 0, "Runs only the builder: the compute-only program, not lowered or validated.");
  m.def("validate", &validate_program, py::arg("program"), py::arg("rendezvous") = false,
        "Checks the program (ScheduleError on a violation). rendezvous=True also runs it with "
        "sends that complete only once their receive is posted, as on NCCL.");
  m.def("comm_batches", &comm_batch_ranges, py::arg("program"), py::arg("rank"), py::arg("split_overlap") = true,
        "The runtime's batches of `rank`: (begin, end, after_f_half) action index ranges.");
  m.def("insert_send_recv", &insert_send_recv_program, py::arg("program"));
  m.def("lower", &lower_program, py::arg("compute_only"), "insert_send_recv, then validate.");
  m.def("strip_backward", &strip_backward, py::arg("compute_only"),
        "The forwards of a compute-only program, same order and topology.");
}

void register_simulator(py::module_& m) {
  py::class_<TimelineEvent>(m, "TimelineEvent")
      .def_readonly("rank", &TimelineEvent::rank)
      .def_readonly("action", &TimelineEvent::action)
      .def_readonly("start", &TimelineEvent::start)
      .def_readonly("end", &TimelineEvent::end)
      .def("__repr__", &timeline_event_repr);
  py::class_<SimResult>(m, "SimResult")
      .def_readonly("makespan", &SimResult::makespan)
      .def_readonly("bubble_rate", &SimResult::bubble_rate)
      .def_readonly("idle_rate", &SimResult::idle_rate)
      .def_readonly("busy", &SimResult::busy)
      .def_readonly("span", &SimResult::span)
      .def_readonly("peak_activations", &SimResult::peak_activations)
      .def_readonly("peak_memory", &SimResult::peak_memory)
      .def_readonly("timeline", &SimResult::timeline)
      .def_readonly("collectives", &SimResult::collectives)
      .def("__repr__", &sim_result_repr);
  py::class_<SpanBound>(m, "SpanBound", "Lower bounds of every rank's span (span_bound.h).")
      .def_readonly("span", &SpanBound::span)
      .def_readonly("max_span", &SpanBound::max_span)
      .def_readonly("bubble_rate", &SpanBound::bubble_rate)
      .def("__repr__", &span_bound_repr);
  m.def("span_lower_bound", &span_lower_bound_program, py::arg("program"), py::arg("f"), py::arg("b"),
        py::arg("w"), py::arg("comm") = 0.0, py::arg("mem_f") = std::vector<double>{1.0},
        py::arg("mem_w") = std::vector<double>{}, py::arg("memory_cap") = std::vector<double>{},
        "Lower bounds of every rank's span over all valid orders (zbpipe.lower_bound).");
  m.def("refine", &refine_program, py::arg("program"), py::arg("f"), py::arg("b"), py::arg("w"),
        py::arg("comm") = 0.0, py::arg("mem_f") = std::vector<double>{1.0},
        py::arg("mem_w") = std::vector<double>{}, py::arg("memory_cap") = std::vector<double>{},
        py::arg("objective") = "span", py::arg("budget") = int64_t{3'000'000},
        "The refinement pass on a program (zbpipe.refine).");
  m.def("simulate", &simulate_program, py::arg("program"), py::arg("f"), py::arg("b"), py::arg("w"),
        py::arg("b_full") = std::vector<double>{}, py::arg("comm") = 0.0,
        py::arg("mem_f") = std::vector<double>{1.0}, py::arg("mem_w") = std::vector<double>{},
        py::arg("s") = std::vector<double>{1.0}, py::arg("t") = std::vector<double>{1.0},
        py::arg("collective") = 0.0, py::arg("mem_s") = std::vector<double>{},
        py::arg("e") = std::vector<double>{0.1}, py::arg("ew") = std::vector<double>{0.1},
        "Runs the program under per-stage costs (zbpipe.simulate takes scalars too); s, t, collective, "
        "mem_s, e and ew (per rank) cost its vocabulary actions.");
}

void register_executor_options(py::module_& m) {
  // One line each: a schedule's keyword parameters and their docs come from here
  // (zbpipe/executor_options.py), the defaults from the C++ structs.
  using runtime::ExecutorOptions;
  ExecutorOptionsClass(m, "The options a schedule passes whole to every executor it builds; "
                          "ExecutorOptions(**fields) sets any of them by name.")
      .seconds("timeout_s", &ExecutorOptions::timeout,
               "seconds any single wait may take before the step fails on this rank.")
      .field("device_timing", &ExecutorOptions::device_timing,
             "record per-action device times (accelerators) and each action's thread CPU time (cpu_ns) "
             "in trace().")
      .field("prepost_receives", &ExecutorOptions::prepost_receives,
             "post every receive of a step when it starts (a send then finds its receive waiting), where "
             "messages complete on the host (Gloo). None: on there, off on stream-ordered backends; False "
             "posts each at its RECV action, holding fewer receive buffers at a time; True on a "
             "stream-ordered group (NCCL, or stream_ordered=True) raises zbpipe.ScheduleError when the first "
             "step builds the executor.")
      .field("static_shapes", &ExecutorOptions::static_shapes,
             "keep the first step's shapes for every step, saving the one small message per step and rank "
             "through which the first stage's rank names the step's input signature (by default a new "
             "signature renegotiates the shapes). Every rank must pass the same value.")
      .field("stream_ordered", &runtime::P2POptions::stream_ordered,
             "post and wait as on NCCL (every batch coalesced where the backend can, receives at their RECV "
             "action, waits polled against the timeout). None: from the device (True off the CPU); True on "
             "a CPU group runs NCCL's discipline over Gloo.")
      .field("overlap_f_b", &ExecutorOptions::overlap_f_b,
             "run the two halves of each OVERLAP_F_B unit (DualPipeV) at the same time: the backward (C++ "
             "autograd) on a worker thread, with its own stream on accelerators, while this thread runs the "
             "forward; the forward's SEND goes out as soon as it finishes. False runs them in sequence. Only "
             "the executor's own halves overlap: a function registered for OVERLAP_F_B "
             "(register_custom_function) runs the halves itself through ctx.run, one after the other, with "
             "its own work between.");
}

void register_runtime(py::module_& m) {
  py::register_exception<runtime::PipelineError>(m, "PipelineError", PyExc_RuntimeError);

  py::class_<runtime::Executor>(m, "Executor",
      "Runs one rank's lowered program over a c10d process group (see csrc/runtime/executor.h).")
      .def(py::init(&make_executor), py::arg("program"), py::arg("process_group"), py::arg("stages"),
           py::arg("device"), py::kw_only(), py::arg("options") = py::none(), py::arg("global_rank") = -1,
           py::arg("group_ranks") = std::vector<int>{}, py::arg("sync_groups") = py::dict(),
           py::arg("vocab") = py::none(), py::arg("embedding") = py::none(), py::arg("control_group") = py::none(),
           "`stages`: global stage index -> PipelineStage; `options`: an ExecutorOptions (None: the "
           "defaults), any of its fields also by name; `vocab`: the schedule's VocabParallelOutput, or None; "
           "`embedding`: its VocabParallelEmbedding, or None; `control_group`: a callable (store, rank, size, "
           "timeout_s) -> ProcessGroup making the CPU control groups (zbpipe/control_plane.py), or None.")
      .def("run", &run_step, py::arg("step"), py::arg("first_inputs") = py::none(), py::arg("loss_scale") = 1.0,
           "Runs one step on `step` (handed to every stage call); returns (outputs, losses) of the "
           "last stage per microbatch on its rank, else ([], []). The GIL is released; stage calls "
           "re-acquire it.")
      .def("set_custom_actions", &set_custom_actions, py::arg("fn"), py::arg("kinds"),
           "Actions of `kinds` run through fn(action) from the next step on (see CustomActions).")
      .def("run_part", &runtime::Executor::run_part, py::arg("part"), py::call_guard<py::gil_scoped_release>(),
           "Inside a custom function: runs a part of the current action with the built-in computation.")
      .def_static("report_setup_failure", &report_setup_failure, py::arg("process_group"), py::arg("sync_groups"),
                  py::arg("global_rank"), py::arg("what"),
                  "Tells the peers' executor of the same number (on the group and the data-parallel "
                  "groups) that this rank's could not be built; touches the stores only.")
      .def("report_failure", &runtime::Executor::report_failure, py::arg("what"),
           py::call_guard<py::gil_scoped_release>(),
           "Tells every peer that this rank's step failed before it ran (e.g. a bad batch); the "
           "executor is unusable afterwards.")
      .def_property_readonly("handshakes", &runtime::Executor::handshakes,
                             "Shape handshakes run so far (one per distinct input signature).")
      .def_property_readonly("rank", &runtime::Executor::rank)
      .def_property_readonly("program", &runtime::Executor::program)
      .def("set_timeout", &set_timeout, py::arg("timeout_s"))
      .def("set_step_number", &runtime::Executor::set_step_number, py::arg("n"),
           "The step number failure messages give the next step (the schedule's count of its calls).")
      .def("set_memory_probe", &runtime::Executor::set_memory_probe, py::arg("on"),
           "From the next step on, call each stage's _zb_backward_input_done after every I.")
      .def("signatures", &signatures_to_py, py::arg("stage"),
           "((input specs, structure), (output specs, structure)) of a local stage.")
      .def("trace", &trace_to_py, "Per-action timing of the last step: list of dicts (host ns, device us).")
      .def("chrome_trace", &chrome_trace)
      .def("export_chrome_trace", &export_chrome_trace, py::arg("path"));

  py::class_<runtime::ControlPlaneRank>(m, "_ControlPlaneRank",
      "One rank's store-facing control plane without an executor (csrc/runtime/control_plane_rank.h): "
      "for the control-plane benchmark.")
      .def(py::init<c10::intrusive_ptr<c10d::Store>, int, int, c10::intrusive_ptr<c10d::Store>, int, int, int>(),
           py::arg("pp_store"), py::arg("pp_rank"), py::arg("pp"), py::arg("dp_store"), py::arg("dp_rank"),
           py::arg("dp"), py::arg("rank"), py::call_guard<py::gil_scoped_release>())
      .def("agree", [](runtime::ControlPlaneRank& r, const std::string& fp, double timeout_s) {
             r.agree(fp, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
           }, py::arg("fingerprint"), py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def("meet", [](runtime::ControlPlaneRank& r, double timeout_s) {
             r.meet(std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
           }, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def("fail", &runtime::ControlPlaneRank::fail, py::arg("message"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("seen_at_ns", &runtime::ControlPlaneRank::seen_at_ns,
                             "When a peer's failure was first heard of (steady clock ns), or -1.")
      .def_property_readonly("seen", &runtime::ControlPlaneRank::seen);
  m.def("_steady_clock_ns", [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }, "The steady clock the control plane's times use, in ns (CLOCK_MONOTONIC: one per machine).");

  m.def("_store_polled", &store_polled, py::arg("group"),
        "Whether the group's store lacks blocking waits (FileStore, custom stores): zbpipe then polls it.");

  m.def("_dispatch_table", &runtime::dispatch_rows, py::arg("program"), py::arg("rank"), py::arg("overlap_f_b") = true,
        "The executor's dispatch table of `rank` as (entries, comms) tuples (csrc/runtime/dispatch.h).");

  py::class_<runtime::LoopbackWorld>(m, "_LoopbackWorld",
      "In-process process groups that record every post and wait (tests, the NCCL model; see "
      "csrc/runtime/loopback.h).")
      .def(py::init<int, bool, bool, int>(), py::arg("size"), py::arg("stream_waits") = false,
           py::arg("store") = false, py::arg("lagging_polls") = 0)
      .def_property_readonly("size", &runtime::LoopbackWorld::size)
      .def("group", &runtime::LoopbackWorld::group, py::arg("rank"))
      .def("clear_events", &runtime::LoopbackWorld::clear_events)
      .def("return_no_work", &runtime::LoopbackWorld::return_no_work, py::arg("on"),
           "From now on posts get no work back (a broken backend, for tests).")
      .def("host_waits", &runtime::LoopbackWorld::host_waits, py::arg("rank"),
           "Times `rank`'s host blocked on a work (its 'sync' events) since clear_events.")
      .def("aborts", &runtime::LoopbackWorld::aborts, py::arg("rank"),
           "How often the group of `rank` was aborted (ProcessGroup::abort).")
      .def("work_aborts", &runtime::LoopbackWorld::work_aborts, py::arg("rank"),
           "How often a work of `rank` was aborted (Work::abort).")
      .def("aborts_in_coalescing", &runtime::LoopbackWorld::aborts_in_coalescing, py::arg("rank"),
           "How often the group of `rank` was aborted inside one of its coalesced posts.")
      .def("in_coalescing", &runtime::LoopbackWorld::in_coalescing, py::arg("rank"),
           "Whether `rank` is inside a coalesced post now.")
      .def("hold_coalesced_posts", &runtime::LoopbackWorld::hold_coalesced_posts, py::arg("rank"), py::arg("seconds"),
           "From now on the coalesced posts of `rank` stay open `seconds` before they end.")
      .def("slow_aborts", &runtime::LoopbackWorld::slow_aborts, py::arg("rank"), py::arg("seconds"),
           "From now on an abort of the group of `rank` takes `seconds`.")
      .def("store_requests", &runtime::LoopbackWorld::store_requests,
           "Requests made to the world's store so far (store=True), by operation.")
      .def("settles", &runtime::LoopbackWorld::settles, py::arg("rank"),
           "Positions in events(rank) where P2P began to settle (a step's end), since clear_events.")
      .def("events", &loopback_events, py::arg("rank"),
           "Recorded calls of `rank`: (type, work, coalesced, ops) with type 'post', 'wait' or "
           "'sync' and ops [(\"send\"|\"recv\", peer, wire tag, bytes)] on posts.");
}

void register_backward(py::module_& m) {
  py::class_<runtime::WeightWork>(m, "WeightWork", "What backward_weight needs, captured by backward_input.")
      .def("__len__", &weight_work_roots,
           "Number of W's roots (boundary node inputs and values sent into the weight region).")
      .def_property_readonly("captured_bytes", &runtime::WeightWork::captured_bytes,
                             "Bytes of the captured gradients W holds (beyond the graph's saved tensors).")
      .def_property_readonly("rerun", &weight_work_rerun, "Names of the boundary nodes W runs again for their weight side.")
      .def_property_readonly("fused", &weight_work_fused,
                             "Why I ran the whole backward (the split could not take the graph), or None.");
  py::class_<runtime::SplitPlanCache>(m, "SplitPlanCache",
      "The I/W split's graph analysis, kept per graph shape (one per stage; the executor keeps its own).")
      .def(py::init<>())
      .def_property_readonly("hits", &runtime::SplitPlanCache::hits)
      .def_property_readonly("misses", &runtime::SplitPlanCache::misses);
  m.def("backward_full", &runtime::backward_full, py::arg("roots"), py::arg("root_grads"), py::arg("inputs"),
        py::call_guard<py::gil_scoped_release>(),
        "B: backpropagates into every leaf's .grad; returns the gradients of `inputs` (None where none).");
  m.def("backward_input", &python::backward_input, py::arg("roots"), py::arg("root_grads"), py::arg("inputs"),
        py::arg("cache") = nullptr,
        "I: (gradients of `inputs`, WeightWork); no parameter .grad is touched. `cache`: a "
        "SplitPlanCache reused across microbatches of one stage (None analyses every call).");
  m.def("backward_weight", &runtime::backward_weight, py::arg("work"), py::call_guard<py::gil_scoped_release>(),
        "W: accumulates the parameter gradients captured by backward_input.");
  m.def("_joint_backward_nodes", &joint_backward_nodes,
        "torch's generated nodes the split runs whole in I: their weight side needs their input side.");
  m.def("_checkpoint_keeps_unpacked", &runtime::checkpoint_once::keeps_unpacked,
        "True while a boundary node runs its input side in I on this thread: a checkpoint "
        "unpack keeps the recomputed tensor for the node's re-run in W (zbpipe/checkpointing.py).");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "zbpipe compiled core (schedule IR, builders, passes, simulator) and runtime";
  register_actions(m);
  register_arguments(m);
  register_program(m);
  register_compile(m);
  register_simulator(m);
  register_executor_options(m);
  register_runtime(m);
  register_backward(m);
  register_partition(m);
}
