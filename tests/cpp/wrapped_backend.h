// WrappedBackend: a test backend that hands every call to another one (a
// virtual backend by default), so that a test's stand-in overrides only the
// calls it changes (a device shared with other memory, a driver that holds
// freed segments, ...).
#pragma once

#include <memory>
#include <utility>

#include "backend.h"

namespace dtralloc {

class WrappedBackend : public Backend {
 public:
  explicit WrappedBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  void* allocate(std::size_t bytes, Stream stream) override { return inner_->allocate(bytes, stream); }
  void release(void* ptr, std::size_t bytes, Stream stream) override { inner_->release(ptr, bytes, stream); }
  std::size_t total_bytes() override { return inner_->total_bytes(); }
  std::size_t free_bytes() override { return inner_->free_bytes(); }
  EventHandle create_event() override { return inner_->create_event(); }
  void record_event(EventHandle e, Stream s) override { inner_->record_event(e, s); }
  bool event_completed(EventHandle e) override { return inner_->event_completed(e); }
  void synchronize_event(EventHandle e) override { inner_->synchronize_event(e); }
  void destroy_event(EventHandle e) override { inner_->destroy_event(e); }
  void synchronize_device() override { inner_->synchronize_device(); }
  void complete_events() override { inner_->complete_events(); }

 protected:
  Backend& inner() { return *inner_; }

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace dtralloc
