// The process-wide allocators behind the C ABI: one Allocator per CUDA
// device, created on first use with the cuda backend and the configuration
// from DTRALLOC_CONF (or from configure(), which dtralloc.install() calls).
// The Python module reaches the very same objects through these functions.
#pragma once

#include <string>
#include <vector>

#include "allocator.h"
#include "config.h"

namespace dtralloc::global {

constexpr int kMaxDevices = 64;

// Sets the configuration from `text` (DTRALLOC_CONF syntax). Throws
// ConfigError for bad text, and std::logic_error if an allocator already
// exists with a different configuration (it cannot change under live memory).
void configure(const std::string& text);
// The configuration in force: configure()'s, else DTRALLOC_CONF, parsed once.
Config config();
// The text the configuration came from.
std::string config_text();

// The allocator of `device`, created on first use. Throws std::out_of_range
// for a bad index, ConfigError for a bad DTRALLOC_CONF, std::runtime_error
// when the CUDA runtime cannot be loaded.
Allocator& allocator(int device);
// Existing allocators only (nullptr where none was created yet).
Allocator* existing(int device);
std::vector<Allocator*> all_existing();

// True in a process forked after an allocator existed: the inherited
// allocators are abandoned (their memory belongs to the parent's CUDA
// context), existing() reports none, and allocator() throws, naming fork().
// Frees of inherited pointers are then dropped quietly (c_api.cpp).
bool forked_child();

// Tests only: destroys every allocator (releasing its cached memory) and
// forgets the configuration, so the next use starts from scratch.
void reset_for_tests();

}  // namespace dtralloc::global
