// The handshake messages: a fixed-size byte buffer holding a status, the failing stage, the
// specs and a text (the signature's structure, or on failure the error message).
#include "runtime/handshake.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <cstring>

#include "runtime/errors.h"
#include "zbpipe/cancel.h"

namespace zbpipe::runtime {

namespace {

constexpr int64_t kMessageBytes = 16384;
constexpr int kHandshakeTagBase = 1 << 29;

struct Message {
  int32_t status = 0;       // 0 ok, 1 a stage failed
  int32_t failed_stage = -1;
  int32_t failed_rank = -1;
  Signature sig;            // what the stage passes on (empty on failure)
  std::string error;        // on failure: the rejecting stage's message
};

template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

template <typename T>
T get(const uint8_t* data, size_t& pos) {
  T v;
  ZB_CHECK(pos + sizeof(T) <= static_cast<size_t>(kMessageBytes), "truncated handshake message");
  std::memcpy(&v, data + pos, sizeof(T));
  pos += sizeof(T);
  return v;
}

at::Tensor encode(const Message& m, const c10::Device& device) {
  std::vector<uint8_t> out;
  put<int32_t>(out, m.status);
  put<int32_t>(out, m.failed_stage);
  put<int32_t>(out, m.failed_rank);
  put<int32_t>(out, static_cast<int32_t>(m.sig.specs.size()));
  for (const auto& s : m.sig.specs) {
    put<int32_t>(out, static_cast<int32_t>(s.dtype));
    put<int32_t>(out, static_cast<int32_t>(s.shape.size()));
    for (auto d : s.shape) put<int64_t>(out, d);
  }
  std::string text = m.status == 0 ? m.sig.structure : m.error;  // one text slot on the wire
  const size_t room = kMessageBytes - out.size() - sizeof(int32_t);
  ZB_CHECK(m.status != 0 || text.size() <= room, "stage output structure too large for the "
           "handshake (", text.size(), " bytes, room for ", room, ")");
  if (text.size() > room) text.resize(room);  // an error text may be cut
  put<int32_t>(out, static_cast<int32_t>(text.size()));
  out.insert(out.end(), text.begin(), text.end());
  out.resize(kMessageBytes, 0);
  auto cpu = at::empty({kMessageBytes}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(cpu.data_ptr(), out.data(), out.size());
  return device.is_cpu() ? cpu : cpu.to(device);
}

Message decode(const at::Tensor& t) {
  auto cpu = t.cpu();
  const auto* d = cpu.data_ptr<uint8_t>();
  size_t pos = 0;
  Message m;
  m.status = get<int32_t>(d, pos);
  m.failed_stage = get<int32_t>(d, pos);
  m.failed_rank = get<int32_t>(d, pos);
  const int32_t n = get<int32_t>(d, pos);
  ZB_CHECK(n >= 0 && n < 4096, "corrupt handshake message (", n, " specs)");
  for (int32_t i = 0; i < n; ++i) {
    TensorSpec s;
    s.dtype = static_cast<at::ScalarType>(get<int32_t>(d, pos));
    const int32_t nd = get<int32_t>(d, pos);
    ZB_CHECK(nd >= 0 && nd < 64, "corrupt handshake message (ndim ", nd, ")");
    for (int32_t k = 0; k < nd; ++k) s.shape.push_back(get<int64_t>(d, pos));
    m.sig.specs.push_back(std::move(s));
  }
  const int32_t len = get<int32_t>(d, pos);
  ZB_CHECK(len >= 0 && pos + len <= static_cast<size_t>(kMessageBytes), "corrupt handshake message");
  (m.status == 0 ? m.sig.structure : m.error).assign(reinterpret_cast<const char*>(d + pos), len);
  return m;
}

}  // namespace

int handshake_tag(int stage, bool backward) { return kHandshakeTagBase + stage * 2 + (backward ? 1 : 0); }
int step_signature_tag() { return kHandshakeTagBase + (1 << 28); }

std::map<int, StageSignatures> exchange_signatures(const Program& p, P2P& p2p,
                                                   const std::map<int, StageHandle*>& stages,
                                                   const StepData& step,
                                                   std::chrono::milliseconds timeout) {
  const int me = p2p.rank();
  const int last = p.num_stages - 1;
  std::map<int, StageSignatures> out;
  std::map<int, Message> forward_result;  // per local stage: what it passes on
  std::vector<std::shared_ptr<Batch>> sends;
  std::string my_traceback;  // a local stage's traceback: shown on this rank only

  auto recv = [&](int stage, bool backward, int peer) {
    auto buf = at::empty({kMessageBytes}, at::TensorOptions().dtype(at::kByte).device(p2p.device()));
    auto batch = p2p.post({P2POp{false, peer, handshake_tag(stage, backward), buf}});
    try {
      p2p.wait(batch, timeout,
               detail::str("handshake: receiving stage ", stage,
                           backward ? "'s outcome" : "'s input signature", " from rank ", peer),
               /*host_complete=*/true);  // decoded on the host next
    } catch (...) {
      P2P::abandon(batch);
      for (auto& b : sends) P2P::abandon(b);
      p2p.abandon_watched();
      throw;
    }
    return decode(buf);
  };
  auto send = [&](const Message& m, int stage, bool backward, int peer) {
    sends.push_back(p2p.post({P2POp{true, peer, handshake_tag(stage, backward), encode(m, p2p.device())}}));
  };

  // Down the pipeline: signatures (or the first failure) in stage order.
  for (const auto& [s, handle] : stages) {
    Message in;
    if (s > 0) in = p.rank_of(s - 1) == me ? forward_result.at(s - 1) : recv(s, false, p.rank_of(s - 1));
    Message res;
    if (in.status != 0) {
      res = in;
    } else {
      try {
        res.sig = handle->infer_outputs(step, in.sig);
        out[s] = StageSignatures{in.sig, res.sig};
      } catch (const Cancelled&) {  // Ctrl-C: the executor tells the peers
        for (auto& b : sends) P2P::abandon(b);
        throw;
      } catch (const std::exception& e) {
        res.status = 1;
        res.failed_stage = s;
        res.failed_rank = me;
        const auto* stage_error = dynamic_cast<const StageError*>(&e);
        res.error = stage_error ? stage_error->summary() : e.what();
        if (stage_error) my_traceback = stage_error->traceback();
      }
    }
    forward_result[s] = res;
    if (s < last && p.rank_of(s + 1) != me) send(res, s + 1, false, p.rank_of(s + 1));
  }
  // Up the pipeline: the outcome at the last stage reaches every rank.
  Message outcome;
  std::map<int, Message> backward_result;
  for (auto it = stages.rbegin(); it != stages.rend(); ++it) {
    const int s = it->first;
    Message m = s == last ? forward_result.at(s)
                          : (p.rank_of(s + 1) == me ? backward_result.at(s + 1)
                                                    : recv(s, true, p.rank_of(s + 1)));
    backward_result[s] = m;
    outcome = m;
    if (s > 0 && p.rank_of(s - 1) != me) send(m, s - 1, true, p.rank_of(s - 1));
  }
  try {
    for (auto& b : sends) p2p.wait(b, timeout, "handshake: completing a send");
    p2p.settle();
  } catch (...) {
    for (auto& b : sends) P2P::abandon(b);
    p2p.abandon_watched();
    throw;
  }
  if (outcome.status != 0)
    throw HandshakeFailed(outcome.failed_rank, outcome.failed_stage, outcome.error,
                          outcome.failed_rank == me ? my_traceback : "");
  return out;
}

}  // namespace zbpipe::runtime

namespace zbpipe::runtime {

std::string to_string(const TensorSpec& s) {
  std::string out = std::string(c10::getDtypeNames(s.dtype).first) + "[";  // "float32", as Python
  for (size_t i = 0; i < s.shape.size(); ++i) out += (i ? ", " : "") + std::to_string(s.shape[i]);
  return out + "]";
}

std::string to_string(const std::vector<TensorSpec>& specs) {
  std::string out = "(";
  for (size_t i = 0; i < specs.size(); ++i) out += (i ? ", " : "") + to_string(specs[i]);
  return out + ")";
}

}  // namespace zbpipe::runtime
