// Whether a program is forward-only (inference): no backward action at all, F once per
// (stage, microbatch). One definition for the passes that branch on it.
#pragma once

#include "action_table.h"
#include "zbpipe/program.h"

namespace zbpipe::detail {

inline bool is_forward_only(const Program& p) {
  for (const auto& acts : p.ranks)
    for (const Action& a : acts)
      for (const Action* s = parts_begin(a); s != parts_end(a); ++s)
        if (s->kind == Kind::B || s->kind == Kind::I || s->kind == Kind::W) return false;
  return true;
}

}  // namespace zbpipe::detail
