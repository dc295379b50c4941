// Lays a V building block out over the microbatches (see v_blocks.h).
#include "v_blocks.h"

#include <cmath>
#include <deque>
#include <map>
#include <utility>

#include "list_scheduler.h"
#include "zbpipe/error.h"

namespace zbpipe::detail {

namespace {

constexpr int kSlotsPerMicrobatch = 6;  // F, F, I, I, W, W on each rank

// One rank's compute order: the block's passes at their slots, each free slot taking the oldest
// pending W (the paper's W placement), the W left over drained at the end.
std::vector<Action> lay_out_rank(const VBlock& blk, int s0, int s1, int m) {
  // Phase 1: F and I passes at slot + 6k.
  std::map<int, Action> slots;
  const std::pair<int, Action> passes[] = {{blk.f_chunk0, {s0, Kind::F, 0}},
                                           {blk.f_chunk1, {s1, Kind::F, 0}},
                                           {blk.i_chunk1, {s1, Kind::I, 0}},
                                           {blk.i_chunk0, {s0, Kind::I, 0}}};
  for (int k = 0; k < m; ++k)
    for (const auto& [slot, pass] : passes) {
      const int t = slot + kSlotsPerMicrobatch * k;
      ZB_CHECK(!slots.count(t), "V block puts two passes in slot ", t);
      slots[t] = Action(pass.stage, pass.kind, k);
    }
  // Phase 2: walk the slots; an empty one runs the oldest pending W.
  std::vector<Action> out;
  std::deque<Action> pending_w;
  const int last = slots.rbegin()->first;
  for (int t = 0; t <= last; ++t) {
    auto it = slots.find(t);
    if (it != slots.end()) {
      out.push_back(it->second);
      if (it->second.kind == Kind::I)
        pending_w.emplace_back(it->second.stage, Kind::W, it->second.microbatch);
    } else if (!pending_w.empty()) {
      out.push_back(pending_w.front());
      pending_w.pop_front();
    }
  }
  // Phase 3: the W still pending.
  out.insert(out.end(), pending_w.begin(), pending_w.end());
  return out;
}

}  // namespace

Program build_v_from_blocks(const std::string& name, const BuildArgs& a,
                            const std::vector<VBlock>& blocks, int cap_units) {
  check_basic_args(name, a);
  const int spr = resolve_stages_per_rank(name, a, 2, 2, 2);
  Program shell = make_program(name, a, spr, "v");
  a.costs.check(shell.num_stages);
  a.memory.check(shell.num_stages);
  // cap_units / 2 microbatches of both of a rank's stages, in mem_f's units.
  std::vector<double> cap(a.pp);
  for (int r = 0; r < a.pp; ++r) {
    cap[r] = cap_units / 2 * (a.memory.forward(r) + a.memory.forward(2 * a.pp - 1 - r));
    ZB_SCHEDULE_CHECK(a.memory_cap == 0.0 || std::abs(a.memory_cap - cap[r]) <= 1e-9 * cap[r],
                      name, " fixes its memory cap at ", cap[r], " per rank (", cap_units,
                      " (stage, microbatch) units of mem_f) for pp=", a.pp, ", got memory_cap=",
                      a.memory_cap, " (zb_auto takes any cap)");
  }
  ZB_CHECK(static_cast<int>(blocks.size()) == a.pp, "one V block per rank");
  Program laid_out = shell;
  for (int r = 0; r < a.pp; ++r)
    laid_out.ranks[r] = lay_out_rank(blocks[r], r, 2 * a.pp - 1 - r, a.microbatches);
  // The block's memory bound holds by construction when a rank's two stages hold the same
  // mem_f; the search's simulation confirms it.
  bool even = true;
  for (int r = 0; r < a.pp; ++r)
    even = even && a.memory.forward(r) == a.memory.forward(2 * a.pp - 1 - r);
  std::vector<Seed> seeds;
  seeds.push_back({std::move(laid_out), Seed::Role::kPrimary, /*must_fit=*/even});
  Program best = search_list_schedules(
      shell, a.costs, a.memory, cap, PolicyGrid::standard({std::vector<int>(a.pp, cap_units)}, true),
      seeds, {a.exhaustive_search, a.search_threads});
  best.schedule = name;
  return best;
}

}  // namespace zbpipe::detail
