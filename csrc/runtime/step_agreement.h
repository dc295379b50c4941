// What the ranks agree on before a step: the program (its fingerprint, at the first step, see
// program_agreement.h) and the step's shapes, every step unless static_shapes. Stage 0's rank
// names the step's input signature (an index into the known shape sets) in a message to every
// other rank over the pipeline's control group (control_group.h), never through the shared
// store; a signature no step had runs the pipeline handshake (handshake.h) and becomes a known
// shape set, a known one is adopted with no other message.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "runtime/local_stage.h"
#include "runtime/p2p.h"
#include "zbpipe/program.h"

namespace zbpipe::runtime {

class FailureWatch;

// Not thread-safe: the executor's thread only.
class StepAgreement {
 public:
  // What one step start brings.
  struct Step {
    const StepData& data;            // the step's data (the handshake's stage calls read it)
    const Signature& first_inputs;   // the step's microbatch inputs on stage 0's rank (read there only)
    int64_t number;                  // the step's number (the signature message carries it)
    std::chrono::milliseconds timeout;  // bounds every wait
    FailureWatch* watch;             // the executor's; null where the group has no store
    int64_t id;                      // the executor's id on the group: the prefix of its store keys
    int stage0_rank;                 // the global rank of stage 0's rank (messages name it)
    const std::function<void()>& check_stop;  // throws to end a wait (a peer failed, Ctrl-C)
    // The pipeline's control messages, opened on first use (where there is a watch); throws
    // what opening them throws.
    const std::function<P2P&()>& control;
  };

  // `program`, `p2p` and `stages` outlive this object (the executor owns them); each step
  // sets the stages' LocalStage::shapes.
  StepAgreement(const Program& program, P2P& p2p, std::vector<LocalStage>& stages, bool static_shapes)
      : program_(program), p2p_(p2p), stages_(stages), static_shapes_(static_shapes) {}

  // Compares program fingerprints (the first call, where there is a watch), then agrees on
  // the step's shapes: stage 0's rank names the step's input signature (an index into the
  // known sets), a new one runs the handshake on every rank; the step's set becomes every
  // local stage's shapes. With static_shapes only the first call agrees. Blocks on the
  // program agreement or on messages, each wait at most the step's timeout; throws
  // PipelineError (a mismatch, a timeout), HandshakeFailed, CommAborted when a peer failed,
  // what check_stop throws.
  void before_step(const Step& step);

  // Whether the stages hold agreed shapes (a step agreed on them).
  bool ready() const { return current_set_ >= 0; }
  // Shape handshakes run so far (one per distinct input signature).
  int handshakes() const { return handshakes_; }
  // Agreed signatures of local stage `stage` for the last step's inputs. Throws zbpipe::Error
  // before the first step or for a stage this rank does not hold.
  const StageSignatures& signatures(int stage) const;

 private:
  // One negotiated signature set: the key (the first stage's step inputs) and what follows.
  struct ShapeSet {
    Signature key;
    std::vector<StageShapes> stages;  // by local index
  };

  // The step's set: a known one adopted, a new one negotiated by the handshake.
  void negotiate_shapes(const Step& step);
  // The index of the step's input signature among shape_sets_ (its size: a new one), named by
  // stage 0's rank (which also sets `key` to the step's first inputs) over the control group,
  // or as a message on the group itself where there is no watch (a group without store).
  // Blocks on it (at most the timeout); throws PipelineError, CommAborted when aborted.
  int64_t exchange_signature_index(const Step& step, Signature& key);
  // Over the control group (see the note in step_agreement.cpp).
  int64_t exchange_over_control(const Step& step, int64_t index);
  void adopt_shapes(int set);  // make shape set `set` the current one

  const Program& program_;
  P2P& p2p_;
  std::vector<LocalStage>& stages_;  // by local index
  bool static_shapes_;
  std::vector<ShapeSet> shape_sets_;  // in negotiation order (equal on every rank)
  int current_set_ = -1;              // the stages' set; -1 before the first step
  int handshakes_ = 0;
  bool agreed_ = false;  // program fingerprints compared
  // Stage 0's rank: the last step's signature messages, completed at the next step.
  std::vector<std::shared_ptr<Batch>> signature_sends_;
};

}  // namespace zbpipe::runtime
