// The partition planner's Python face (zbpipe._C.plan_partition, score_split, even_bounds;
// zbpipe/partition.py measures the units and builds the plan around them).
#pragma once

#include <pybind11/pybind11.h>

namespace zbpipe::python {

void register_partition(pybind11::module_& m);

}  // namespace zbpipe::python
