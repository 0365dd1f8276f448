#pragma once
/// Tables indexed by ids that are handed out in order (buffers): each new id is one past
/// the table's end.

#include <algorithm>
#include <cstddef>

namespace ferry::sim {

/// Makes `table[index]` exist, value-initialized where new. Ids come in order, so the table
/// grows to twice its size at once rather than one entry per id: a run of thousands of buffers
/// resizes its tables a dozen times, not at every allocation.
template <class Table>
void cover(Table& table, std::size_t index) {
  if (index >= table.size()) table.resize(std::max(index + 1, 2 * table.size()));
}

}  // namespace ferry::sim
