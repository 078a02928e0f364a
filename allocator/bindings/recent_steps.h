// What the steps before on a device did, for the step now running: the
// notes a live session hands to the next (what outlived the step, for
// long_lived placement; the GPU's op costs, Note [carried costs]).
//
// Note [recent steps]
// ~~~~~~~~~~~~~~~~~~~
// A training step runs the same ops in the same order every time, so a step
// learns from the step before by ordinal: its n-th recorded op is the step
// before's n-th if the OpOverload is the same, and from the first op that
// differs the steps have diverged. But the step before is not always the
// same kind of step: a GAN alternates the discriminator's and the
// generator's, a loop may evaluate between training steps, a model may
// train two heads in turn. Learning from the one step before, each of those
// would start from nothing at every switch. So each device keeps the notes
// of its last kRecentSteps *kinds* of step, newest first: a step that ran
// the same ops as one of them replaces its notes, any other is a new kind
// (and the oldest goes). A session follows every kind while its ops match
// that kind's, and learns from the newest still matching.
//
// Under the GIL, as everything of a live session.
#pragma once

#include <Python.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <vector>

namespace dtralloc {

constexpr std::size_t kRecentSteps = 4;

// Whether a step's op at `ordinal` was `func` (`funcs`: its recorded ops'
// OpOverloads by ordinal, identity only).
inline bool ran_before(const std::vector<PyObject*>& funcs, std::size_t ordinal, PyObject* func) {
  return ordinal < funcs.size() && funcs[ordinal] == func;
}

// Notes of the last kRecentSteps kinds of step on a device, newest first.
// Notes: any struct with `std::vector<PyObject*> funcs`.
template <class Notes>
class RecentSteps {
 public:
  using Ptr = std::shared_ptr<const Notes>;

  // A step's notes: they replace those of a step that ran the same ops.
  void remember(Ptr notes) {
    auto same = std::find_if(newest_first_.begin(), newest_first_.end(),
                             [&](const Ptr& r) { return r->funcs == notes->funcs; });
    if (same != newest_first_.end()) newest_first_.erase(same);
    newest_first_.insert(newest_first_.begin(), std::move(notes));
    if (newest_first_.size() > kRecentSteps) newest_first_.pop_back();
  }
  const std::vector<Ptr>& newest_first() const { return newest_first_; }

 private:
  std::vector<Ptr> newest_first_;
};

// A session's view of the steps before: those whose ops so far were its own.
template <class Notes>
class StepsBefore {
 public:
  using Ptr = std::shared_ptr<const Notes>;

  void reset(const RecentSteps<Notes>& recent) { matching_ = recent.newest_first(); }
  void clear() { matching_.clear(); }
  // This step's op at `ordinal` is `func`; called for each ordinal in turn.
  // The steps that ran another op there stop matching.
  void follow(std::size_t ordinal, PyObject* func) {
    if (matching_.empty()) return;
    matching_.erase(std::remove_if(matching_.begin(), matching_.end(),
                                   [&](const Ptr& r) { return !ran_before(r->funcs, ordinal, func); }),
                    matching_.end());
  }
  // The steps still matching, newest first, whose op at `ordinal` is `func`
  // too: before that op is followed (long_lived announces before it runs).
  template <class Each>
  void each_at(std::size_t ordinal, PyObject* func, Each&& each) const {
    for (const Ptr& r : matching_)
      if (ran_before(r->funcs, ordinal, func) && each(*r)) return;
  }
  bool empty() const { return matching_.empty(); }

 private:
  std::vector<Ptr> matching_;
};

}  // namespace dtralloc
