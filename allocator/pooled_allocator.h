// PooledAllocator: a std allocator that recycles single nodes through a free
// list owned by one BlockPool (NodeCache). The free sets are std::sets whose
// nodes come and go on every malloc/free; recycling them saves a
// general-purpose malloc+free per operation on the hot path. The pool's
// mutex already serializes every use, so the cache needs no lock of its own.
#pragma once

#include <algorithm>
#include <cstddef>
#include <new>

namespace dtralloc {

class NodeCache {
 public:
  NodeCache() = default;
  NodeCache(const NodeCache&) = delete;
  NodeCache& operator=(const NodeCache&) = delete;
  ~NodeCache() {
    while (head_) {
      FreeNode* next = head_->next;
      ::operator delete(static_cast<void*>(head_));
      head_ = next;
    }
  }
  // Every node this cache serves has the same size (one container type).
  void* take(std::size_t bytes) {
    if (FreeNode* node = head_) {
      head_ = node->next;
      return node;
    }
    return ::operator new(std::max(bytes, sizeof(FreeNode)));
  }
  void give(void* p) {
    auto* node = static_cast<FreeNode*>(p);
    node->next = head_;
    head_ = node;
  }

 private:
  struct FreeNode {
    FreeNode* next;
  };
  FreeNode* head_ = nullptr;
};

template <typename T>
class PooledAllocator {
 public:
  using value_type = T;

  explicit PooledAllocator(NodeCache* cache) noexcept : cache_(cache) {}
  template <typename U>
  PooledAllocator(const PooledAllocator<U>& other) noexcept : cache_(other.cache()) {}

  T* allocate(std::size_t n) {
    if (n != 1) return static_cast<T*>(::operator new(n * sizeof(T)));
    return static_cast<T*>(cache_->take(sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (n != 1) {
      ::operator delete(p);
      return;
    }
    cache_->give(p);
  }

  NodeCache* cache() const noexcept { return cache_; }
  template <typename U>
  bool operator==(const PooledAllocator<U>& o) const noexcept { return cache_ == o.cache(); }
  template <typename U>
  bool operator!=(const PooledAllocator<U>& o) const noexcept { return cache_ != o.cache(); }

 private:
  NodeCache* cache_;
};

}  // namespace dtralloc
