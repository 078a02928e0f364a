// The allocations of a backend whose release() takes ranges of them
// (Backend::releases_ranges, unmap_pages): each allocation stays until every
// byte of it has been released. The host backend frees its memory then, the
// cuda backend's VMM segments their address reservation. Not thread-safe:
// backends are called under the Allocator's mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>

namespace dtralloc {

class RangeLedger {
 public:
  struct Allocation {
    std::uintptr_t addr = 0;
    std::size_t size = 0;
  };

  void add(std::uintptr_t addr, std::size_t size) { live_.emplace(addr, Entry{size, size}); }

  // The allocation that holds all of [addr, addr + bytes); throws
  // std::logic_error, naming `backend`, when none does.
  Allocation holding(std::uintptr_t addr, std::size_t bytes, const char* backend) const {
    auto it = live_.upper_bound(addr);
    if (it == live_.begin() || bytes == 0 || addr + bytes > std::prev(it)->first + std::prev(it)->second.size)
      throw std::logic_error(std::string("dtralloc: the ") + backend + " backend was asked to release " +
                             std::to_string(bytes) + " bytes at " + std::to_string(addr) +
                             ", which no allocation of its holds");
    --it;
    return Allocation{it->first, it->second.size};
  }

  // Counts [addr, addr + bytes) released (it must lie in one allocation and
  // not have been released before). Returns the allocation when this was
  // the last of its bytes, and forgets it; else {0, 0}.
  Allocation release(std::uintptr_t addr, std::size_t bytes, const char* backend) {
    const Allocation whole = holding(addr, bytes, backend);
    Entry& entry = live_.at(whole.addr);
    if (bytes > entry.unreleased)
      throw std::logic_error(std::string("dtralloc: the ") + backend +
                             " backend was asked to release more of an allocation than it still holds");
    entry.unreleased -= bytes;
    if (entry.unreleased > 0) return {};
    live_.erase(whole.addr);
    return whole;
  }

 private:
  struct Entry {
    std::size_t size;
    std::size_t unreleased;
  };
  std::map<std::uintptr_t, Entry> live_;  // by address
};

}  // namespace dtralloc
