// AddressMap: address -> Block* for allocated blocks, on the malloc/free hot
// path. Open addressing with linear probing and backward-shift deletion: no
// allocation per insert (std::unordered_map allocates a node each time, about
// a fifth of a cache-hit malloc+free pair), no tombstones to clean up.
// Not thread-safe: the Allocator's mutex guards it.
#pragma once

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dtralloc {

struct Block;

class AddressMap {
 public:
  AddressMap() : slots_(kInitialSlots) {}

  Block* find(std::uintptr_t addr) const {
    for (std::size_t i = home(addr);; i = (i + 1) & mask()) {
      const Slot& s = slots_[i];
      if (s.addr == addr) return s.block;
      if (s.addr == 0) return nullptr;
    }
  }

  // `addr` must not be present and must not be 0.
  void insert(std::uintptr_t addr, Block* block) {
    assert(addr != 0 && find(addr) == nullptr);
    if ((size_ + 1) * 4 > slots_.size() * 3) grow();  // keep load <= 3/4
    place(addr, block);
    ++size_;
  }

  // Returns false when `addr` is absent.
  bool erase(std::uintptr_t addr) {
    std::size_t i = home(addr);
    while (slots_[i].addr != addr) {
      if (slots_[i].addr == 0) return false;
      i = (i + 1) & mask();
    }
    // Backward-shift: pull later entries of the probe run into the hole so
    // that every entry stays reachable from its home slot.
    for (std::size_t j = (i + 1) & mask();; j = (j + 1) & mask()) {
      if (slots_[j].addr == 0) break;
      std::size_t h = home(slots_[j].addr);
      // Move j into i unless j's home lies cyclically in (i, j].
      bool stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
      if (!stays) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = Slot{};
    --size_;
    return true;
  }

  std::size_t size() const { return size_; }

 private:
  struct Slot {
    std::uintptr_t addr = 0;  // 0 = empty (no block lives at address 0)
    Block* block = nullptr;
  };
  static constexpr std::size_t kInitialSlots = 1024;  // power of two

  std::size_t mask() const { return slots_.size() - 1; }
  std::size_t home(std::uintptr_t addr) const {
    // Blocks are 512-aligned: drop those bits, then a Fibonacci hash.
    return static_cast<std::size_t>(((addr >> 9) * 0x9E3779B97F4A7C15ull) >> 20) & mask();
  }
  void place(std::uintptr_t addr, Block* block) {
    std::size_t i = home(addr);
    while (slots_[i].addr != 0) i = (i + 1) & mask();
    slots_[i] = Slot{addr, block};
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Slot& s : old)
      if (s.addr != 0) place(s.addr, s.block);
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0;
};

}  // namespace dtralloc
