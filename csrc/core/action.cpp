// Action kinds, canonical strings and their exact parser.
#include "zbpipe/action.h"

#include <charconv>

#include "zbpipe/error.h"

namespace zbpipe {

namespace {
struct KindName {
  Kind kind;
  std::string_view name;
};
// A name that is a prefix of another comes after it, so that prefix matching picks e.g.
// "SEND_F" over "S" and "BCAST_F" over "B".
constexpr KindName kKindNames[] = {
    {Kind::OVERLAP_F_B, "OVERLAP_F_B"}, {Kind::ALLREDUCE_S, "ALLREDUCE_S"}, {Kind::BCAST_F, "BCAST_F"},
    {Kind::REDUCE_B, "REDUCE_B"},       {Kind::SEND_F, "SEND_F"},           {Kind::RECV_F, "RECV_F"},
    {Kind::SEND_B, "SEND_B"},           {Kind::RECV_B, "RECV_B"},           {Kind::F, "F"},
    {Kind::B, "B"},                     {Kind::I, "I"},                     {Kind::W, "W"},
    {Kind::S, "S"},                     {Kind::T, "T"},
};
static_assert(sizeof(kKindNames) / sizeof(kKindNames[0]) == kNumKinds,
              "every Kind needs a name here, and Kind::kLast must name the last kind");

bool parse_int(std::string_view s, int32_t& out) {
  if (s.empty() || s.size() > 9) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  auto res = std::from_chars(s.data(), s.data() + s.size(), out);
  return res.ec == std::errc() && res.ptr == s.data() + s.size();
}

[[noreturn]] void bad(std::string_view text, const char* why) {
  throw ScheduleError(detail::str("invalid action string '", text, "': ", why,
                                  " (expected [stage][kind][microbatch], e.g. 2F0, 3SEND_F1, "
                                  "(1F1;2B0)OVERLAP_F_B)"));
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}
}  // namespace

const char* kind_name(Kind kind) {
  for (const auto& kn : kKindNames)
    if (kn.kind == kind) return kn.name.data();
  return "?";
}

bool is_compute(Kind k) {
  switch (k) {
    case Kind::F:
    case Kind::B:
    case Kind::I:
    case Kind::W:
    case Kind::OVERLAP_F_B:
    case Kind::S:
    case Kind::T: return true;
    case Kind::SEND_F:
    case Kind::RECV_F:
    case Kind::SEND_B:
    case Kind::RECV_B:
    case Kind::BCAST_F:
    case Kind::ALLREDUCE_S:
    case Kind::REDUCE_B: return false;
  }
  return false;
}
bool is_comm(Kind k) {
  switch (k) {
    case Kind::SEND_F:
    case Kind::RECV_F:
    case Kind::SEND_B:
    case Kind::RECV_B: return true;
    case Kind::F:
    case Kind::B:
    case Kind::I:
    case Kind::W:
    case Kind::OVERLAP_F_B:
    case Kind::S:
    case Kind::T:
    case Kind::BCAST_F:
    case Kind::ALLREDUCE_S:
    case Kind::REDUCE_B: return false;
  }
  return false;
}
bool is_backward(Kind k) { return k == Kind::B || k == Kind::I; }
bool is_collective(Kind k) {
  switch (k) {
    case Kind::BCAST_F:
    case Kind::ALLREDUCE_S:
    case Kind::REDUCE_B: return true;
    case Kind::F:
    case Kind::B:
    case Kind::I:
    case Kind::W:
    case Kind::SEND_F:
    case Kind::RECV_F:
    case Kind::SEND_B:
    case Kind::RECV_B:
    case Kind::OVERLAP_F_B:
    case Kind::S:
    case Kind::T: return false;
  }
  return false;
}
bool is_vocab(Kind k) { return k == Kind::S || k == Kind::T || is_collective(k); }

Action Action::overlap(std::vector<Action> parts) {
  Action a;
  a.kind = Kind::OVERLAP_F_B;
  a.sub = std::move(parts);
  return a;
}

void append_string(std::string& out, const Action& a) {
  if (a.kind == Kind::OVERLAP_F_B) {
    out += '(';
    for (size_t i = 0; i < a.sub.size(); ++i) {
      if (i) out += ';';
      append_string(out, a.sub[i]);
    }
    out += ')';
    out += kind_name(a.kind);
    return;
  }
  out += std::to_string(a.stage);
  out += kind_name(a.kind);
  if (a.microbatch >= 0) out += std::to_string(a.microbatch);
}

std::string to_string(const Action& a) {
  std::string s;
  append_string(s, a);
  return s;
}

Action parse_action(std::string_view text) {
  std::string_view s = trim(text);
  if (s.empty()) bad(text, "empty");
  if (s.front() == '(') {
    auto close = s.find(')');
    if (close == std::string_view::npos) bad(text, "unbalanced '('");
    if (s.substr(close + 1) != "OVERLAP_F_B") bad(text, "a '(...)' group must end in OVERLAP_F_B");
    std::vector<Action> parts;
    std::string_view inner = s.substr(1, close - 1);
    while (!inner.empty()) {
      auto semi = inner.find(';');
      Action part = parse_action(inner.substr(0, semi));
      if (!is_compute(part.kind) || part.kind == Kind::OVERLAP_F_B || is_vocab(part.kind))
        bad(text, "OVERLAP_F_B may only group F/B/I/W actions");
      parts.push_back(std::move(part));
      if (semi == std::string_view::npos) break;
      inner.remove_prefix(semi + 1);
    }
    if (parts.empty()) bad(text, "OVERLAP_F_B needs sub-actions");
    return Action::overlap(std::move(parts));
  }
  size_t i = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
  int32_t stage = 0;
  if (!parse_int(s.substr(0, i), stage)) bad(text, "missing stage index");
  std::string_view rest = s.substr(i);
  for (const auto& kn : kKindNames) {
    if (kn.kind == Kind::OVERLAP_F_B) continue;
    if (rest.substr(0, kn.name.size()) != kn.name) continue;
    std::string_view mb_text = rest.substr(kn.name.size());
    int32_t mb = -1;
    if (!mb_text.empty() && !parse_int(mb_text, mb)) bad(text, "bad microbatch index");
    if (mb < 0) bad(text, "missing microbatch index");
    return Action(stage, kn.kind, mb);
  }
  bad(text, "unknown action kind");
}

}  // namespace zbpipe
