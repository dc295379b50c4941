// Bindings of the partition planner (csrc/include/zbpipe/partition.h). The search runs without
// the GIL and stops on Ctrl-C (interrupt.h).
#include "python/py_partition.h"

#include <pybind11/stl.h>

#include <optional>
#include <utility>
#include <vector>

#include "python/interrupt.h"
#include "zbpipe/partition.h"

namespace zbpipe::python {

namespace py = pybind11;

namespace {

UnitProfile make_units(std::vector<double> f, std::vector<double> i, std::vector<double> w, std::vector<double> b,
                       std::vector<double> mem_f, std::vector<double> mem_w, std::vector<double> static_bytes) {
  return UnitProfile{std::move(f), std::move(i), std::move(w), std::move(b),
                     std::move(mem_f), std::move(mem_w), std::move(static_bytes)};
}

// vocab: None, or a dict with the head's per-rank s, t, mem_s, static_bytes (lists) and
// collective (seconds): partition.h's VocabPlan.
std::optional<VocabPlan> vocab_plan(const py::object& vocab) {
  if (vocab.is_none()) return std::nullopt;
  const auto d = vocab.cast<py::dict>();
  VocabPlan v;
  v.model.s = d["s"].cast<std::vector<double>>();
  v.model.t = d["t"].cast<std::vector<double>>();
  v.model.mem_s = d["mem_s"].cast<std::vector<double>>();
  v.model.collective = d["collective"].cast<double>();
  v.static_bytes = d["static_bytes"].cast<std::vector<double>>();
  return v;
}

PartitionResult plan(const std::vector<Program>& programs, const UnitProfile& units, double comm,
                     double memory_budget, int64_t exhaustive_limit, int64_t local_search_evals,
                     const py::object& vocab) {
  PartitionOptions o;
  o.comm = comm;
  o.memory_budget = memory_budget;
  o.exhaustive_limit = exhaustive_limit;
  o.local_search_evals = local_search_evals;
  const std::optional<VocabPlan> v = vocab_plan(vocab);
  if (v) o.vocab = &*v;
  return interruptible([&] { return plan_partition(programs, units, o); });
}

SplitScore score(const Program& program, const UnitProfile& units, const std::vector<int>& bounds, double comm,
                 double memory_budget, const py::object& vocab) {
  const std::optional<VocabPlan> v = vocab_plan(vocab);
  return score_split(program, units, bounds, comm, memory_budget, v ? &*v : nullptr);
}

}  // namespace

void register_partition(py::module_& m) {
  py::class_<UnitProfile>(m, "UnitProfile", "Per-unit costs (s) and bytes the partition planner splits.")
      .def(py::init(&make_units), py::arg("f"), py::arg("i"), py::arg("w"), py::arg("b"), py::arg("mem_f"),
           py::arg("mem_w"), py::arg("static_bytes"))
      .def_readonly("f", &UnitProfile::f)
      .def_readonly("i", &UnitProfile::i)
      .def_readonly("w", &UnitProfile::w)
      .def_readonly("b", &UnitProfile::b)
      .def_readonly("mem_f", &UnitProfile::mem_f)
      .def_readonly("mem_w", &UnitProfile::mem_w)
      .def_readonly("static_bytes", &UnitProfile::static_bytes);
  py::class_<SplitScore>(m, "SplitScore", "One split scored on one program.")
      .def_readonly("bounds", &SplitScore::bounds)
      .def_readonly("makespan", &SplitScore::makespan)
      .def_readonly("peak_bytes", &SplitScore::peak_bytes)
      .def_readonly("fits", &SplitScore::fits);
  py::class_<PartitionResult>(m, "PartitionResult", "What plan_partition found (partition.h).")
      .def_readonly("program", &PartitionResult::program)
      .def_readonly("best", &PartitionResult::best)
      .def_readonly("exact", &PartitionResult::exact)
      .def_readonly("simulated", &PartitionResult::simulated)
      .def_readonly("least_peak_program", &PartitionResult::least_peak_program)
      .def_readonly("least_peak", &PartitionResult::least_peak)
      .def_readonly("per_program", &PartitionResult::per_program);
  m.def("plan_partition", &plan, py::arg("programs"), py::arg("units"), py::arg("comm") = 0.0,
        py::arg("memory_budget") = 0.0, py::arg("exhaustive_limit") = int64_t{50'000},
        py::arg("local_search_evals") = int64_t{200}, py::arg("vocab") = py::none(),
        "The least simulated step over the programs and contiguous splits of the units within the "
        "budget (bytes per rank, <= 0: none); exhaustive where a program has <= exhaustive_limit splits.");
  m.def("score_split", &score, py::arg("program"), py::arg("units"), py::arg("bounds"),
        py::arg("comm") = 0.0, py::arg("memory_budget") = 0.0, py::arg("vocab") = py::none(),
        "One split (num_stages + 1 unit bounds) simulated on one program (vocab: the head split over "
        "the ranks, a dict of per-rank s, t, mem_s, static_bytes and collective).");
  m.def("even_bounds", &even_bounds, py::arg("units"), py::arg("num_stages"),
        "Bounds of the even split (the first stages one unit more where it does not divide).");
}

}  // namespace zbpipe::python
