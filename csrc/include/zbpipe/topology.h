// Stage -> rank mappings.
#pragma once

#include <string>
#include <vector>

namespace zbpipe {

// "loop": stage s on rank s % pp (interleaved / looped schedules).
// "v": stages go down the ranks and back up: rank r holds r and 2*pp-1-r (and so on per pair).
std::vector<int> make_topology(const std::string& style, int pp, int num_stages);

}  // namespace zbpipe
