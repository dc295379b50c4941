// PyTorch's CSV schedule layout: one row per rank, one action string per cell, empty cells for
// idle slots. Works for compute-only and lowered programs alike.
#pragma once

#include <string>

#include "zbpipe/program.h"

namespace zbpipe {

std::string to_csv(const Program& p);
// Infers pp (rows), stages (max stage + 1), microbatches (max mb + 1) and stage_to_rank (from
// where each stage's actions appear), then validates; throws ScheduleError on bad input.
Program from_csv(const std::string& text);

}  // namespace zbpipe
