// check.h: the assertion kit every C++ test shares.
//
//   CHECK(cond)                      cond holds
//   CHECK_EQ(a, b)                   a == b; prints both values when not
//   CHECK_CONTAINS(text, needle)     the string text contains needle
//   CHECK_THROWS(Type, expr)         expr throws Type (or a subclass)
//   thrown_message<Type>(fn)         what() of the Type that fn throws, "" if none
//   return check_summary("name");    the last line of main()
//
// A failed check prints file:line and what differed, then ends the process
// with status 1 at once: later checks of a broken structure would only add
// noise (or crash). _Exit skips destructors, so a failure is never buried
// under a LeakSanitizer report of the state the test was holding. Checks may
// run on several threads; the counter is atomic.
#pragma once

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <type_traits>

namespace check {

inline std::atomic<long> g_checks{0};

[[noreturn]] inline void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", file, line, what.c_str());
  std::fflush(nullptr);
  std::_Exit(1);
}

// Prints a value for a failure message: enums as their number, anything
// streamable as itself, the rest as "?".
template <typename T, typename = void>
struct Streamable : std::false_type {};
template <typename T>
struct Streamable<T, std::void_t<decltype(std::declval<std::ostream&>() << std::declval<const T&>())>>
    : std::true_type {};

template <typename T>
std::string show(const T& value) {
  std::ostringstream out;
  if constexpr (std::is_enum_v<T>) {
    out << static_cast<long long>(value);
  } else if constexpr (std::is_same_v<T, unsigned char> || std::is_same_v<T, signed char>) {
    out << static_cast<int>(value);
  } else if constexpr (Streamable<T>::value) {
    out << value;
  } else {
    out << "?";
  }
  return out.str();
}

template <typename Exception>
std::string thrown_message(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Exception& error) {
    return error.what();
  }
  return "";
}

inline int check_summary(const char* name) {
  std::printf("%s: %ld checks passed\n", name, g_checks.load());
  std::fflush(stdout);
  return 0;
}

}  // namespace check

using check::check_summary;
using check::thrown_message;

#define CHECK(cond)                                                     \
  do {                                                                  \
    ++check::g_checks;                                                  \
    if (!(cond)) check::fail(__FILE__, __LINE__, #cond);                \
  } while (0)

#define CHECK_EQ(a, b)                                                  \
  do {                                                                  \
    ++check::g_checks;                                                  \
    const auto check_a_ = (a); /* copies: (a) may be a dangling ref */  \
    const auto check_b_ = (b); /* such as std::min(n, 14) */            \
    if (!(check_a_ == check_b_))                                        \
      check::fail(__FILE__, __LINE__,                                   \
                  std::string(#a " == " #b ": ") + check::show(check_a_) + \
                      " != " + check::show(check_b_));                  \
  } while (0)

#define CHECK_CONTAINS(text, needle)                                    \
  do {                                                                  \
    ++check::g_checks;                                                  \
    const std::string check_text_ = (text);                             \
    if (check_text_.find(needle) == std::string::npos)                  \
      check::fail(__FILE__, __LINE__,                                   \
                  "\"" + check_text_ + "\" lacks \"" + (needle) + "\""); \
  } while (0)

#define CHECK_THROWS(Type, expr)                                        \
  do {                                                                  \
    ++check::g_checks;                                                  \
    bool check_threw_ = false;                                          \
    try {                                                               \
      (void)(expr);                                                     \
    } catch (const Type&) {                                             \
      check_threw_ = true;                                              \
    }                                                                   \
    if (!check_threw_)                                                  \
      check::fail(__FILE__, __LINE__, #expr " did not throw " #Type);   \
  } while (0)
