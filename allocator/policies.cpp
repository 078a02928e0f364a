// The DTRALLOC_POLICIES table as data (policies.h).
#include "policies.h"

#include "config.h"

namespace dtralloc {

const std::vector<PolicyInfo>& policy_table() {
  static const std::vector<PolicyInfo> table = {
#define DTRALLOC_POLICY_ROW(e, name, traits, doc) {Policy::e, #name, traits, doc},
      DTRALLOC_POLICIES(DTRALLOC_POLICY_ROW)
#undef DTRALLOC_POLICY_ROW
  };
  return table;
}

const PolicyTraits& policy_traits(Policy policy) {
  return policy_table()[static_cast<std::size_t>(policy)].traits;
}

const char* policy_name(Policy policy) { return policy_table()[static_cast<std::size_t>(policy)].name; }

const std::string& policy_names() {
  static const std::string names = [] {
    std::string out;
    for (const PolicyInfo& p : policy_table()) out += (out.empty() ? "" : ", ") + std::string(p.name);
    return out;
  }();
  return names;
}

Policy parse_policy(const std::string& name) {
  for (const PolicyInfo& p : policy_table())
    if (name == p.name) return p.policy;
  throw ConfigError("dtralloc: unknown eviction policy '" + name + "'; use one of: " + policy_names());
}

}  // namespace dtralloc
