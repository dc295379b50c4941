// The host allocator's policy on a rank whose stages compute on the CPU.
//
// glibc malloc gives memory back to the kernel as soon as a free leaves enough at the top of
// its heap (M_TRIM_THRESHOLD) and serves blocks above a size (M_MMAP_THRESHOLD) with a fresh
// mapping each time; either way the next allocation of that size faults in and zeroes new
// pages. A pipeline rank allocates the same large blocks over and over: every W and B makes
// each weight gradient (dW) in a new buffer before adding it to .grad. Whether that buffer
// faults depends on how much else is live at that moment, so it differs by schedule and, most,
// under activation checkpointing, which keeps less alive: measured on the CPU, a split
// stage's W paid several ms of page faults per microbatch under AC (docs/split_backward.md).
// Keeping freed memory in the process removes that cost whatever the schedule; a rank then
// holds its peak, as a GPU's caching allocator does.
#pragma once

namespace zbpipe::runtime {

// Once per process, on glibc: heap blocks up to 1 GiB and no trimming below 1 GiB of free heap
// top. ZBPIPE_KEEP_HOST_MEMORY=0 leaves malloc as it is. Does nothing elsewhere (not glibc).
// Returns whether the policy is in force.
bool keep_freed_host_memory();

}  // namespace zbpipe::runtime
