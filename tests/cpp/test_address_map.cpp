// Tests AddressMap (address_map.h): the open-addressing address -> Block*
// table on the malloc/free hot path.
//
// Backward-shift deletion is the part that breaks quietly: a wrong "may this
// entry move into the hole" test leaves entries unreachable from their home
// slot, and find() then misses a live block (a free() that reports a double
// free) long after the erase that caused it. So besides the basics, these
// tests build long probe runs on purpose (keys that share a home slot, runs
// that wrap around the end of the table), erase from their middle, grow the
// table under them, and compare 100k random operations with std::unordered_map.
#include <algorithm>
#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

#include "address_map.h"
#include "check.h"

namespace {

using dtralloc::AddressMap;
using dtralloc::Block;

// Values are opaque to the map; a distinct fake pointer per key is enough.
Block* token(std::uintptr_t addr) { return reinterpret_cast<Block*>(addr ^ 0x5A5A5A5A50ull); }

// Keys that collide in every table of up to 2^24 slots: the map hashes
// (addr >> 9) * odd_constant and takes bits 20 and up, so keys differing only
// at bit 53 and above (bit 44 and above after the shift) share a home slot.
std::uintptr_t colliding_key(std::uintptr_t i) { return 512 + (i << 53); }

// The home slot of `addr` in a table of `slots` slots, mirroring the map's
// hash. Only used to pick keys that land at the end of the table (wrap-around
// runs); if the hash changes, the test still checks correctness, it just
// builds a different run.
std::size_t home_slot(std::uintptr_t addr, std::size_t slots) {
  return static_cast<std::size_t>(((addr >> 9) * 0x9E3779B97F4A7C15ull) >> 20) & (slots - 1);
}

// Everything in `expect` is found with its value, and size() agrees.
void check_contents(const AddressMap& map, const std::unordered_map<std::uintptr_t, Block*>& expect) {
  CHECK_EQ(map.size(), expect.size());
  for (const auto& [addr, block] : expect) {
    if (map.find(addr) != block) CHECK_EQ(map.find(addr), block);
  }
}

void test_empty_and_basics() {
  AddressMap map;
  CHECK_EQ(map.size(), 0u);
  CHECK(map.find(512) == nullptr);
  CHECK(!map.erase(512));
  map.insert(512, token(512));
  map.insert(1024, token(1024));
  CHECK_EQ(map.size(), 2u);
  CHECK(map.find(512) == token(512));
  CHECK(map.find(1024) == token(1024));
  CHECK(map.find(1536) == nullptr);
  CHECK(!map.erase(1536));  // absent: nothing changes
  CHECK_EQ(map.size(), 2u);
  CHECK(map.erase(512));
  CHECK(!map.erase(512));  // second erase of the same key
  CHECK(map.find(512) == nullptr);
  CHECK(map.find(1024) == token(1024));
  CHECK_EQ(map.size(), 1u);
  map.insert(512, token(4096));  // a key can come back with a new value
  CHECK(map.find(512) == token(4096));
  CHECK(map.erase(512));
  CHECK(map.erase(1024));
  CHECK_EQ(map.size(), 0u);
}

// Real allocator addresses: high bits set, 512-aligned, dense.
void test_dense_heap_addresses() {
  AddressMap map;
  std::unordered_map<std::uintptr_t, Block*> expect;
  const std::uintptr_t base = 0x7f3a00000000ull;
  for (std::uintptr_t i = 0; i < 5000; ++i) {  // grows 1024 -> 8192 slots
    std::uintptr_t a = base + i * 512;
    map.insert(a, token(a));
    expect[a] = token(a);
  }
  check_contents(map, expect);
  for (std::uintptr_t i = 0; i < 5000; i += 3) {
    std::uintptr_t a = base + i * 512;
    CHECK(map.erase(a));
    expect.erase(a);
  }
  check_contents(map, expect);
  for (std::uintptr_t i = 0; i < 5000; i += 3) CHECK(map.find(base + i * 512) == nullptr);
}

// One probe run of 2000 keys with the same home, grown through three
// doublings while it is built, then erased from the middle, front and back.
void test_heavy_collisions_and_growth() {
  AddressMap map;
  std::unordered_map<std::uintptr_t, Block*> expect;
  const std::uintptr_t n = 2000;  // past 3/4 of 1024 and 2048: two grows
  for (std::uintptr_t i = 0; i < n; ++i) {
    std::uintptr_t a = colliding_key(i);
    map.insert(a, token(a));
    expect[a] = token(a);
    // Interleave ordinary keys so the run is not only colliding keys.
    if (i % 4 == 0) {
      std::uintptr_t b = 0x10000000ull + i * 512;
      map.insert(b, token(b));
      expect[b] = token(b);
    }
  }
  check_contents(map, expect);
  // Erase in an order that opens holes everywhere in the run: every key
  // after a hole must still be found (the backward shift moved it).
  std::vector<std::uintptr_t> order;
  for (std::uintptr_t i = 0; i < n; ++i) order.push_back(colliding_key(i));
  std::mt19937_64 rng(7);
  std::shuffle(order.begin(), order.end(), rng);
  for (std::size_t k = 0; k < order.size(); ++k) {
    CHECK(map.erase(order[k]));
    expect.erase(order[k]);
    CHECK(map.find(order[k]) == nullptr);
    if (k % 97 == 0) check_contents(map, expect);
  }
  check_contents(map, expect);
  for (std::uintptr_t i = 0; i < n; i += 4) {
    std::uintptr_t b = 0x10000000ull + i * 512;
    CHECK(map.erase(b));
  }
  CHECK_EQ(map.size(), 0u);
}

// Runs that wrap past the last slot: the cyclic "is the home in (hole, j]"
// test is the subtle case of backward-shift deletion.
void test_wrap_around_runs() {
  const std::size_t slots = 1024;  // the initial table; we stay below 3/4
  // Keys whose home is one of the last 4 slots, 40 of them: their run
  // starts at the end of the table and continues at slot 0.
  std::vector<std::uintptr_t> tail_keys, head_keys;
  for (std::uintptr_t a = 512; tail_keys.size() < 40 || head_keys.size() < 40; a += 512) {
    std::size_t h = home_slot(a, slots);
    if (h >= slots - 4 && tail_keys.size() < 40) tail_keys.push_back(a);
    if (h <= 3 && head_keys.size() < 40) head_keys.push_back(a);
  }
  for (int pass = 0; pass < 3; ++pass) {
    AddressMap map;
    std::unordered_map<std::uintptr_t, Block*> expect;
    // Interleave keys homed at the end with keys homed at the start, so
    // entries of both homes sit mixed in the wrapped part of the run.
    for (std::size_t i = 0; i < 40; ++i) {
      for (std::uintptr_t a : {tail_keys[i], head_keys[i]}) {
        map.insert(a, token(a));
        expect[a] = token(a);
      }
    }
    check_contents(map, expect);
    std::vector<std::uintptr_t> order = tail_keys;
    order.insert(order.end(), head_keys.begin(), head_keys.end());
    if (pass == 1) std::reverse(order.begin(), order.end());
    if (pass == 2) std::shuffle(order.begin(), order.end(), std::mt19937_64(11));
    for (std::uintptr_t a : order) {
      CHECK(map.erase(a));
      expect.erase(a);
      check_contents(map, expect);  // after every erase: small map, cheap
    }
    CHECK_EQ(map.size(), 0u);
  }
}

// 100k random inserts, erases and finds against std::unordered_map, over a
// key universe small enough that most erases and finds hit, mixing dense
// heap-like keys and colliding keys.
void test_random_against_unordered_map() {
  AddressMap map;
  std::unordered_map<std::uintptr_t, Block*> expect;
  std::mt19937_64 rng(12345);
  std::vector<std::uintptr_t> universe;
  for (std::uintptr_t i = 0; i < 3000; ++i) universe.push_back(0x7f0000000000ull + i * 512);
  for (std::uintptr_t i = 0; i < 1000; ++i) universe.push_back(colliding_key(i) + 1024);
  std::uniform_int_distribution<std::size_t> pick(0, universe.size() - 1);
  std::uniform_int_distribution<int> op(0, 99);
  long mismatches = 0;
  for (int step = 0; step < 100000; ++step) {
    std::uintptr_t a = universe[pick(rng)];
    int o = op(rng);
    // Phases: inserts dominate, then erases dominate, so the map grows
    // and drains repeatedly and probe runs form and dissolve.
    bool insert_phase = (step / 10000) % 2 == 0;
    int insert_share = insert_phase ? 60 : 25;
    if (o < insert_share) {
      if (expect.count(a) == 0) {
        Block* v = token(a + static_cast<std::uintptr_t>(step) * 4096);
        map.insert(a, v);
        expect[a] = v;
      }
    } else if (o < 80) {
      bool had = expect.erase(a) == 1;
      if (map.erase(a) != had) ++mismatches;
    } else {
      auto it = expect.find(a);
      Block* want = it == expect.end() ? nullptr : it->second;
      if (map.find(a) != want) ++mismatches;
    }
    if (map.size() != expect.size()) ++mismatches;
    if (step % 5000 == 0) check_contents(map, expect);
  }
  CHECK_EQ(mismatches, 0);
  check_contents(map, expect);
  for (std::uintptr_t a : universe) {
    if (map.find(a) != nullptr) CHECK(map.erase(a));
  }
  CHECK_EQ(map.size(), 0u);
}

}  // namespace

int main() {
  test_empty_and_basics();
  test_dense_heap_addresses();
  test_heavy_collisions_and_growth();
  test_wrap_around_runs();
  test_random_against_unordered_map();
  return check_summary("test_address_map");
}
