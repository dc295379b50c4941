// Programs in and out of the core as text: per-rank action strings (to and from), PyTorch's CSV
// text and CSV files. Every program made here is lowered where compute-only and validated.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zbpipe/program.h"

namespace zbpipe {

// The actions of `rank` as canonical strings, with communication or (compute_only) without.
// Throws ScheduleError for a rank outside [0, pp).
std::vector<std::string> action_strings(const Program& p, int rank, bool compute_only);
// The actions of `rank` as values; throws ScheduleError for a rank outside [0, pp).
const std::vector<Action>& rank_actions(const Program& p, int rank);

// A program from one list of action strings per rank and a stage placement: lowered when
// compute-only, then validated. `rendezvous`: also checked with NCCL's rendezvous sends
// (validate_rendezvous). Throws ScheduleError on a malformed action, a violated rule or a
// size past limits.h (checked before anything is allocated); polls cancel.h.
Program program_from_actions(const std::vector<std::vector<std::string>>& ranks,
                             const std::vector<int>& stage_to_rank, int64_t microbatches,
                             const std::string& name = "custom", bool rendezvous = false);

// PyTorch's CSV layout (csv_format.h) from text or from a file, validated as from_csv does;
// `rendezvous` as above. read_csv_file reads regular files of at most kMaxCsvBytes (limits.h) and
// throws ScheduleError for a missing file, a directory, a FIFO or other special file, a larger
// file (before reading it) and bytes that are not UTF-8 (naming the byte offset and line).
Program program_from_csv_text(const std::string& text, bool rendezvous = false);
Program read_csv_file(const std::string& path, bool rendezvous = false);
// Writes to_csv(p) to `path`; throws zbpipe::Error when it cannot be written.
void write_csv_file(const Program& p, const std::string& path);

}  // namespace zbpipe
