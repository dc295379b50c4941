// MemoryModel: per-kind memory deltas, one value per stage or one for all (see memory_model.h).
#include "zbpipe/memory_model.h"

#include "zbpipe/error.h"

namespace zbpipe {

namespace {
double pick(const std::vector<double>& v, int stage) { return v.size() == 1 ? v[0] : v.at(stage); }

void check_size(const char* name, const std::vector<double>& v, int num_stages) {
  ZB_SCHEDULE_CHECK(v.size() == 1 || static_cast<int>(v.size()) == num_stages, "memory '", name,
                    "' needs 1 value or one per stage (", num_stages, "), got ", v.size());
}
}  // namespace

double MemoryModel::forward(int stage) const { return pick(mem_f, stage); }
double MemoryModel::weight(int stage) const {
  return mem_w.empty() ? forward(stage) : pick(mem_w, stage);
}

double MemoryModel::added_at_start(const Action& part) const {
  return part.kind == Kind::F ? forward(part.stage) : 0.0;
}

double MemoryModel::freed_at_end(const Action& part) const {
  switch (part.kind) {
    case Kind::B: return forward(part.stage);
    case Kind::I: return forward(part.stage) - weight(part.stage);
    case Kind::W: return weight(part.stage);
    case Kind::F:
    case Kind::SEND_F:
    case Kind::RECV_F:
    case Kind::SEND_B:
    case Kind::RECV_B:
    case Kind::OVERLAP_F_B:
    case Kind::S:  // the vocabulary passes' memory is vocab.h's (VocabModel::mem_s)
    case Kind::T:
    case Kind::BCAST_F:
    case Kind::ALLREDUCE_S:
    case Kind::REDUCE_B: return 0.0;
  }
  return 0.0;
}

void MemoryModel::check(int num_stages) const {
  check_size("mem_f", mem_f, num_stages);
  for (double x : mem_f) ZB_SCHEDULE_CHECK(x > 0.0, "memory 'mem_f' must be positive, got ", x);
  if (mem_w.empty()) return;
  check_size("mem_w", mem_w, num_stages);
  for (int s = 0; s < num_stages; ++s)
    ZB_SCHEDULE_CHECK(weight(s) >= 0.0 && weight(s) <= forward(s),
                      "memory 'mem_w' must lie in [0, mem_f] on every stage, got mem_w=",
                      weight(s), " against mem_f=", forward(s), " on stage ", s);
}

}  // namespace zbpipe
