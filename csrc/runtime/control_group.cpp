// Control groups: the backend's own (loopback) or the factory's (Gloo) over a prefixed store.
#include "runtime/control_group.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "zbpipe/error.h"

namespace zbpipe::runtime {

std::shared_ptr<P2P> open_control(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const std::string& name,
                                  const ControlGroupFactory& factory, std::chrono::milliseconds timeout) {
  ZB_CHECK(group, "no group to open control messages on");
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = group->getBackend(c10::DeviceType::CPU);
  } catch (const std::exception&) {
    // No CPU backend (an NCCL-only group): the factory's.
  }
  c10::intrusive_ptr<c10d::ProcessGroup> control;
  if (auto* own = dynamic_cast<ProvidesControlGroups*>(backend.get())) {
    control = own->control_group(name);
  } else {
    ZB_CHECK(factory, "no control group for '", name, "': the group's backend provides none and no factory was given");
    ZB_CHECK(group->getStore(), "no control group for '", name, "': the group has no store");
    control = factory(c10::make_intrusive<c10d::PrefixStore>(name, group->getStore()), group->getRank(),
                      group->getSize(), timeout);
  }
  ZB_CHECK(control && control->getSize() == group->getSize() && control->getRank() == group->getRank(),
           "the control group for '", name, "' does not match its group (rank ", group->getRank(), " of ",
           group->getSize(), ")");
  P2POptions options;
  options.stream_ordered = false;  // tag-matched, completed on the host: the message is read there
  return std::make_shared<P2P>(control, c10::Device(c10::kCPU), options);
}

void ControlLinks::add(std::shared_ptr<P2P> p2p) {
  bool abort = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    links_.push_back(p2p);
    abort = aborted_;
  }
  if (abort) p2p->abort_all();
}

void ControlLinks::abort_all() {
  std::vector<std::shared_ptr<P2P>> links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    links = links_;
  }
  for (auto& l : links) l->abort_all();
}

void ControlLinks::abandon_all() {
  std::vector<std::shared_ptr<P2P>> links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    links = links_;
  }
  for (auto& l : links) l->abandon_watched();
}

}  // namespace zbpipe::runtime
