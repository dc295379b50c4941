// Pipeline handshake (the first step, and every step with a new input signature of the first
// stage): each stage's output signature (shapes, dtypes, structure) flows down the pipeline so
// every receiver knows its buffer shapes, then the outcome flows back up, so a mismatch found
// at any stage fails every rank with the same message instead of a hang.
#pragma once

#include <chrono>
#include <map>

#include "runtime/p2p.h"
#include "runtime/stage_handle.h"
#include "zbpipe/program.h"

namespace zbpipe::runtime {

struct StageSignatures {
  Signature inputs;   // what arrives from stage - 1 (empty on stage 0)
  Signature outputs;  // what this stage produces
};

// Runs on every rank of `p` together; returns the signatures of this rank's stages (keyed by
// global stage). `step`: the data of the step it runs in (StageHandle::infer_outputs reads it).
// Throws HandshakeFailed (naming the rejecting stage and its rank) on every rank when any stage
// rejected its inputs; Cancelled when a local stage call was interrupted (Ctrl-C).
std::map<int, StageSignatures> exchange_signatures(const Program& p, P2P& p2p,
                                                   const std::map<int, StageHandle*>& stages,
                                                   const StepData& step,
                                                   std::chrono::milliseconds timeout);

// Tags of the handshake messages, disjoint from the per-microbatch data tags.
int handshake_tag(int stage, bool backward);
// Tag of the per-step message naming the step's input signature (step_agreement.cpp).
int step_signature_tag();

}  // namespace zbpipe::runtime
