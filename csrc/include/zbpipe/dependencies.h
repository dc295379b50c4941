// The one definition of what an action needs: every pass, the simulator, the list scheduler and
// the executor derive their readiness checks and their message routing from these functions.
// (tests/program_checker.py restates the rule on purpose, as an independent second opinion.)
//
// The rule: F of stage s needs F of s-1 (its input); B or I of s needs its own F (the saved
// activations) and B or I of s+1 (its output gradient); W of s needs I of s. A RECV needs its
// SEND. OVERLAP_F_B needs what each of its parts needs. The vocabulary kinds (S, T and their
// collectives) need nothing here: vocab.h states their rule.
#pragma once

#include <cstdint>

#include "zbpipe/action.h"

namespace zbpipe {

// One thing a compute needs, on some stage and the same microbatch.
struct Producer {
  int32_t stage = -1;
  // F, W's I, or the backward of a neighbour stage: written Kind::B, met by B or I.
  Kind kind = Kind::F;
  // The producer's result travels to the consumer (a tensor handed over or sent), as opposed
  // to state the stage keeps (its own F's activations, its own I's captures).
  bool data = false;
  bool either_backward() const { return kind == Kind::B; }
};

// At most two producers per compute.
struct Producers {
  Producer item[2];
  int count = 0;
  const Producer* begin() const { return item; }
  const Producer* end() const { return item + count; }
};

// What compute `part` (F, B, I or W; not OVERLAP_F_B: take its parts) needs, in a program of
// `num_stages` stages.
inline Producers producers_of(const Action& part, int num_stages) {
  Producers p;
  auto add = [&](int32_t stage, Kind kind, bool data) { p.item[p.count++] = {stage, kind, data}; };
  switch (part.kind) {
    case Kind::F:
      if (part.stage > 0) add(part.stage - 1, Kind::F, true);
      break;
    case Kind::B:
    case Kind::I:
      add(part.stage, Kind::F, false);
      if (part.stage + 1 < num_stages) add(part.stage + 1, Kind::B, true);
      break;
    case Kind::W:
      add(part.stage, Kind::I, false);
      break;
    case Kind::SEND_F:
    case Kind::RECV_F:
    case Kind::SEND_B:
    case Kind::RECV_B:
    case Kind::OVERLAP_F_B:
    case Kind::S:  // the vocabulary kinds' needs are vocab.h's
    case Kind::T:
    case Kind::BCAST_F:
    case Kind::ALLREDUCE_S:
    case Kind::REDUCE_B:
      break;
  }
  return p;
}

// The stage that consumes the data a compute produces (-1: none). The inverse of the `data`
// producers above: F of s feeds s+1, B or I of s feeds s-1.
inline int32_t data_consumer(const Action& part, int num_stages) {
  switch (part.kind) {
    case Kind::F: return part.stage + 1 < num_stages ? part.stage + 1 : -1;
    case Kind::B:
    case Kind::I: return part.stage > 0 ? part.stage - 1 : -1;
    case Kind::W:
    case Kind::SEND_F:
    case Kind::RECV_F:
    case Kind::SEND_B:
    case Kind::RECV_B:
    case Kind::OVERLAP_F_B:
    case Kind::S:
    case Kind::T:
    case Kind::BCAST_F:
    case Kind::ALLREDUCE_S:
    case Kind::REDUCE_B: return -1;
  }
  return -1;
}

// The stage at the other end of a communication action (its SEND's or RECV's neighbour).
inline int32_t comm_peer_stage(const Action& comm) {
  switch (comm.kind) {
    case Kind::SEND_F:
    case Kind::RECV_B: return comm.stage + 1;
    case Kind::RECV_F:
    case Kind::SEND_B: return comm.stage - 1;
    case Kind::F:
    case Kind::B:
    case Kind::I:
    case Kind::W:
    case Kind::OVERLAP_F_B:
    case Kind::S:
    case Kind::T:
    case Kind::BCAST_F:
    case Kind::ALLREDUCE_S:
    case Kind::REDUCE_B: return -1;
  }
  return -1;
}

// The compute whose result a communication action carries: SEND_F / RECV_F carry an F, SEND_B /
// RECV_B a backward (B or I, written Kind::B), named by the producing stage.
inline Producer comm_payload(const Action& comm) {
  const bool forward = comm.kind == Kind::SEND_F || comm.kind == Kind::RECV_F;
  const bool sends = comm.kind == Kind::SEND_F || comm.kind == Kind::SEND_B;
  return {sends ? comm.stage : comm_peer_stage(comm), forward ? Kind::F : Kind::B, true};
}

// The SEND a RECV waits for (a SEND needs nothing but its producer, placed before it locally).
inline Action matching_send(const Action& recv) {
  return Action(comm_peer_stage(recv), recv.kind == Kind::RECV_F ? Kind::SEND_F : Kind::SEND_B,
                recv.microbatch);
}

// The RECV a SEND's message lands in, and the RECV that brings a compute the data of one of its
// producers (on the consumer's stage).
inline Action matching_recv(const Action& send) {
  return Action(comm_peer_stage(send), send.kind == Kind::SEND_F ? Kind::RECV_F : Kind::RECV_B,
                send.microbatch);
}
inline Action recv_for(const Action& part, const Producer& d) {
  return Action(part.stage, d.kind == Kind::F ? Kind::RECV_F : Kind::RECV_B, part.microbatch);
}

}  // namespace zbpipe
