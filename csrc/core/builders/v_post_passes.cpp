// The controllable-memory V paper's post-passes (see v_post_passes.h), in unit slots.
#include "v_post_passes.h"

#include <algorithm>
#include <array>

#include "zbpipe/cancel.h"
#include "zbpipe/error.h"

namespace zbpipe::detail {

namespace {

// A rank's passes. The four of the block come first; kW is, with W unsplit, the rank's k-th W
// (whichever I it follows: only the count matters for memory), split, chunk 1's W of
// microbatch k and kW0 chunk 0's.
enum Pass : int { kF0, kF1, kI1, kI0, kW, kW0 };
constexpr int kBlockPasses = 4;

bool is_forward(int pass) { return pass == kF0 || pass == kF1; }
bool is_input_grad(int pass) { return pass == kI1 || pass == kI0; }

// A slot's content: one pass of one microbatch, packed into an int, or kIdle.
constexpr int kIdle = -1;
int cell(int pass, int k) { return k << 3 | pass; }
int pass_of(int c) { return c < 0 ? kIdle : c & 7; }
int mb_of(int c) { return c >> 3; }

// One rank's layout: slot[pass][k] is the slot of that pass of microbatch k (ascending in k).
struct RankSlots {
  std::vector<std::vector<int>> slot;
  int end() const {  // one past the last used slot
    int e = 0;
    for (const auto& s : slot)
      if (!s.empty()) e = std::max(e, s.back() + 1);
    return e;
  }
  // What runs at each slot: cell(pass, k), or kIdle.
  std::vector<int> occupancy(int size) const {
    std::vector<int> occ(size, kIdle);
    for (int pass = 0; pass < static_cast<int>(slot.size()); ++pass)
      for (int k = 0; k < static_cast<int>(slot[pass].size()); ++k) occ[slot[pass][k]] = cell(pass, k);
    return occ;
  }
};
using Layout = std::vector<RankSlots>;

// Step 1 / 5: every idle slot runs a pending W, if any; the rest follow the last slot. Split:
// chunk 1's pending W go first. Replaces any W the rank had.
// [Note: W in idle slots never raises the peak] Given the F and I in their slots, this runs
// each W as early as any placement can (one W per idle slot, none before its I): at every
// slot at least as many W have run as under any other placement, so the units held are at
// most theirs. Which W runs (split or not) does not change the count. Hence taking W out and
// placing them again, as steps 4 and 5 do after a squeeze, keeps every rank within the peak
// the previous step checked.
void place_w(RankSlots& r, bool split) {
  r.slot.resize(kBlockPasses);
  const std::vector<int> occ = r.occupancy(r.end());
  std::array<int, 2> pending{0, 0};
  std::array<std::vector<int>, 2> w;
  for (int t = 0; t < static_cast<int>(occ.size()); ++t) {
    if (t % 256 == 0) poll_cancel();
    const int pass = pass_of(occ[t]);
    if (pass == kI1) ++pending[0];
    else if (pass == kI0) ++pending[split ? 1 : 0];
    else if (pass == kIdle)
      for (int c = 0; c < 2; ++c)
        if (pending[c] > 0) {
          w[c].push_back(t);
          --pending[c];
          break;
        }
  }
  int t = static_cast<int>(occ.size()) - 1;
  for (int c = 0; c < 2; ++c)
    for (; pending[c] > 0; --pending[c]) w[c].push_back(++t);
  r.slot.push_back(std::move(w[0]));
  if (split) r.slot.push_back(std::move(w[1]));
}

// A rank's units slot by slot, as the simulator counts them (F adds one, W frees one); with W
// implied (`implied_w`), each idle slot frees one if an I still waits for its W (place_w's
// rule). Keeps the state entering every slot, so a move is checked by walking from its target
// slot only until the state meets the stored one again past its source slot.
class SlotUnits {
 public:
  SlotUnits(std::vector<int>& occ, bool implied_w) : occ_(occ), implied_w_(implied_w) {
    before_.resize(occ.size() + 1);
    for (size_t t = 0; t < occ.size(); ++t) before_[t + 1] = step(before_[t], occ[t]);
  }
  int peak() const {
    int peak = 0;
    for (const State& s : before_) peak = std::max(peak, s.units);
    return peak;
  }
  // Runs slot `from`'s pass at the idle slot `to` (< from) instead, if that keeps every slot at
  // or below `limit`; returns whether it did.
  bool move(int to, int from, int limit) {
    std::swap(occ_[to], occ_[from]);
    // New states from `to` on, until they meet the stored ones again past `from`.
    scratch_.clear();
    State s = before_[to];
    for (size_t t = to; t < occ_.size(); ++t) {
      if (t % 256 == 0) poll_cancel();  // a hot loop: every 256th slot
      s = step(s, occ_[t]);
      if (s.units > limit) {
        std::swap(occ_[to], occ_[from]);
        return false;
      }
      if (static_cast<int>(t) >= from && s == before_[t + 1]) break;
      scratch_.push_back(s);
    }
    std::copy(scratch_.begin(), scratch_.end(), before_.begin() + to + 1);
    return true;
  }

 private:
  struct State {
    int units = 0, waiting = 0;  // waiting: I whose implied W has not run
    bool operator==(const State& o) const { return units == o.units && waiting == o.waiting; }
  };
  State step(State s, int c) const {
    const int pass = pass_of(c);
    if (is_forward(pass)) ++s.units;
    else if (pass == kW) --s.units;
    else if (implied_w_ && is_input_grad(pass)) ++s.waiting;
    else if (implied_w_ && pass == kIdle && s.waiting > 0) {
      --s.units;
      --s.waiting;
    }
    return s;
  }
  std::vector<int>& occ_;
  const bool implied_w_;
  std::vector<State> before_;  // before_[t]: entering slot t
  std::vector<State> scratch_;
};

// The k-th earliest (0-based) of two ascending lists with no value in common: the slot of the
// rank's k-th I. Binary search on how many of the first k+1 come from `a`.
int kth_of_two(const std::vector<int>& a, const std::vector<int>& b, int k) {
  const int na = static_cast<int>(a.size()), nb = static_cast<int>(b.size());
  int lo = std::max(0, k + 1 - nb), hi = std::min(k + 1, na);
  for (;;) {
    const int i = (lo + hi) / 2, j = k + 1 - i;
    if (i < na && j > 0 && b[j - 1] > a[i]) lo = i + 1;       // takes too few from a
    else if (i > 0 && j < nb && a[i - 1] > b[j]) hi = i - 1;  // takes too many from a
    else return std::max(i > 0 ? a[i - 1] : -1, j > 0 ? b[j - 1] : -1);
  }
}

// A pass's own inputs in the V: chunk 0's forward and chunk 1's backward come from rank r-1,
// the other two from rank r+1; on a rank, each of the block's passes follows the one before it
// (F1 after F0, I1 after F1, I0 after I1: only at the V's turns is this a real dependency, and
// elsewhere it is implied), and every pass follows its previous microbatch. Calls
// `dep(rank, pass, k)` for each; W (which follows its I on the rank) is left to the caller.
template <class Fn>
void for_each_input(int rank, int pass, int k, int p, Fn&& dep) {
  if ((pass == kF0 || pass == kI1) && rank > 0) dep(rank - 1, pass, k);
  if ((pass == kF1 || pass == kI0) && rank + 1 < p) dep(rank + 1, pass, k);
  if (pass > kF0 && pass < kBlockPasses) dep(rank, pass - 1, k);
  if (k > 0) dep(rank, pass, k - 1);
}

// Calls fn(slot, rank, cell) for every pass of the ranks' occupancies in slot order, ties by
// rank (a rank runs one pass per slot). `fn` may move the pass it is given to an earlier slot.
template <class Fn>
void in_slot_order(const std::vector<std::vector<int>>& occ, Fn&& fn) {
  size_t end = 0;
  for (const auto& o : occ) end = std::max(end, o.size());
  for (size_t t = 0; t < end; ++t)
    for (size_t r = 0; r < occ.size(); ++r, poll_cancel())
      if (t < occ[r].size() && occ[r][t] != kIdle)
        fn(static_cast<int>(t), static_cast<int>(r), occ[r][t]);
}

std::vector<std::vector<int>> occupancies(const Layout& L) {
  std::vector<std::vector<int>> occ;
  for (const RankSlots& r : L) occ.push_back(r.occupancy(r.end()));
  return occ;
}

// Steps 3 and 4's squeeze: each pass, in slot order (`occ`: where L's passes are now), starts
// when its inputs and its rank's previous pass have ended (one slot each, no communication).
void squeeze(Layout& L, const std::vector<std::vector<int>>& occ) {
  const int p = static_cast<int>(L.size());
  std::vector<int> rank_free(p, 0);
  // Slot order puts every input first, so its slot is already the squeezed one.
  in_slot_order(occ, [&](int, int rank, int c) {
    const int pass = pass_of(c), k = mb_of(c);
    int start = rank_free[rank];
    for_each_input(rank, pass, k, p,
                   [&](int r, int ps, int kk) { start = std::max(start, L[r].slot[ps][kk] + 1); });
    L[rank].slot[pass][k] = start;
    rank_free[rank] = start + 1;
  });
}

// Step 2 (with_w) or step 4's reorder (without): see v_post_passes.h. Warm-up runs until rank
// 0's first chunk-0 backward, cool-down from the last microbatch's first forward; warm-up
// moves only with W present. Ends squeezed, with W placed.
void reorder_ramps(Layout& L, int m, bool with_w) {
  const int p = static_cast<int>(L.size());
  if (with_w)
    for (RankSlots& r : L) place_w(r, /*split=*/false);
  std::vector<std::vector<int>> occ = occupancies(L);
  std::vector<SlotUnits> units;
  units.reserve(p);
  int limit = 0;  // the highest peak of any rank
  for (int r = 0; r < p; ++r) {
    units.emplace_back(occ[r], !with_w);
    limit = std::max(limit, units[r].peak());
  }
  enum class Phase { kWarmup, kSteady, kCooldown } phase = Phase::kWarmup;
  // A pass moves only to an earlier slot, which the walk has passed: each is seen once.
  in_slot_order(occ, [&](int slot, int rank, int c) {
    const int pass = pass_of(c), k = mb_of(c);
    if (phase == Phase::kWarmup && pass == kI0 && rank == 0) phase = Phase::kSteady;
    if (phase == Phase::kSteady) {
      if (pass == kF0 && k == m - 1) phase = Phase::kCooldown;
      return;
    }
    if (phase == Phase::kWarmup && !with_w) return;
    RankSlots& rs = L[rank];
    int ready = -1;  // the last slot an input of the pass takes
    if (pass == kW) {
      ready = kth_of_two(rs.slot[kI1], rs.slot[kI0], k);
      if (k > 0) ready = std::max(ready, rs.slot[kW][k - 1]);
    } else {
      for_each_input(rank, pass, k, p,
                     [&](int r, int ps, int kk) { ready = std::max(ready, L[r].slot[ps][kk]); });
    }
    ZB_CHECK(ready < slot, "V reorder: pass ", pass, " of microbatch ", k, " on rank ", rank,
             " at slot ", slot, " is not after its input at ", ready);
    for (int t = ready + 1; t < slot; ++t) {
      if (occ[rank][t] != kIdle || !units[rank].move(t, slot, limit)) continue;
      rs.slot[pass][k] = t;
      break;
    }
  });
  if (!with_w)
    for (RankSlots& r : L) place_w(r, /*split=*/false);
  squeeze(L, with_w ? occ : occupancies(L));  // (the squeeze keeps each rank's order)
}

}  // namespace

std::vector<std::vector<Action>> reorder_v_block(const std::vector<VBlock>& blocks, int m) {
  const int p = static_cast<int>(blocks.size());
  Layout L(p);
  for (int r = 0; r < p; ++r) {
    const VBlock& b = blocks[r];
    for (int first : {b.f_chunk0, b.f_chunk1, b.i_chunk1, b.i_chunk0}) {
      std::vector<int> slots;
      for (int k = 0; k < m; ++k) slots.push_back(first + kSlotsPerMicrobatch * k);
      L[r].slot.push_back(std::move(slots));
    }
  }
  // Peaks stay within the first step's limit throughout: [Note: W in idle slots never raises
  // the peak].
  reorder_ramps(L, m, /*with_w=*/true);
  for (RankSlots& r : L) r.slot.resize(kBlockPasses);
  reorder_ramps(L, m, /*with_w=*/false);
  std::vector<std::vector<Action>> out(p);
  for (int r = 0; r < p; ++r) {
    out[r].reserve(static_cast<size_t>(kSlotsPerMicrobatch) * m);
    place_w(L[r], /*split=*/true);
    const int up = 2 * p - 1 - r;  // chunk 1's stage
    const std::array<Action, 6> as = {Action(r, Kind::F, 0), Action(up, Kind::F, 0),
                                      Action(up, Kind::I, 0), Action(r, Kind::I, 0),
                                      Action(up, Kind::W, 0), Action(r, Kind::W, 0)};
    for (int c : L[r].occupancy(L[r].end()))
      if (c != kIdle) out[r].emplace_back(as[pass_of(c)].stage, as[pass_of(c)].kind, mb_of(c));
  }
  return out;
}

}  // namespace zbpipe::detail
