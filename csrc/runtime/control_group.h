// The CPU side group a group's control messages travel on: each step's input signature along
// the pipeline and the data-parallel replicas' meetings. They are a few bytes the host reads at
// once, whatever the data's device, so they never go through the job's shared store (steady
// steps ask nothing of it), cost no device-to-host copy on NCCL and stay out of the data
// communicators' issue order. One per executor and group, opened collectively after a meeting
// through the store has shown every rank of the group present: its rendezvous then never waits
// for a rank that will not come.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/p2p.h"

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace zbpipe::runtime {

// Makes a CPU group of `size` ranks (this one `rank`) whose rendezvous goes through `store`
// (already prefixed for it), each wait bounded by `timeout`: a Gloo group from Python
// (zbpipe/control_plane.py). Called on the executor's thread.
using ControlGroupFactory = std::function<c10::intrusive_ptr<c10d::ProcessGroup>(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout)>;

// A capability of a backend that brings control groups of its own (the loopback world's, in
// memory), declared by deriving from it besides c10d::Backend.
class ProvidesControlGroups {
 public:
  virtual ~ProvidesControlGroups() = default;
  // This rank's group of the control world `name` (the same name on every rank of the group).
  virtual c10::intrusive_ptr<c10d::ProcessGroup> control_group(const std::string& name) = 0;
};

// Opens the control messages of `group` as a P2P over its control group named `name` (unique
// to the executor on the group, equal on its ranks): the backend's own where it provides
// control groups, else `factory`'s over the group's store under prefix `name`. Blocks until
// every rank of the group opened it (at most `timeout`). Throws zbpipe::Error with neither,
// what the factory throws.
std::shared_ptr<P2P> open_control(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const std::string& name,
                                  const ControlGroupFactory& factory, std::chrono::milliseconds timeout);

// The control P2Ps an executor opened, aborted with its communication (a peer's failure seen by
// the watcher, Ctrl-C). Thread-safe; one added after abort_all() is aborted at once.
class ControlLinks {
 public:
  void add(std::shared_ptr<P2P> p2p);
  void abort_all();
  // After a failure (the executor's thread): each link's unfinished batches kept (P2P::abandon).
  void abandon_all();

 private:
  std::mutex mu_;
  std::vector<std::shared_ptr<P2P>> links_;
  bool aborted_ = false;
};

}  // namespace zbpipe::runtime
