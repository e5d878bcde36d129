// Run options as the string key/values that traces carry, and back: a trace names the plan it
// followed, so replay can rebuild exactly that plan.
#pragma once

#include <map>
#include <string>

#include "ctxplan/runtime/run_options.h"

namespace ctxplan {

using RunMetadata = std::map<std::string, std::string>;

// Adds the options' keys (context_tokens, chunk_tokens, ..., selection) and plan_version.
void AddRunOptions(const RunOptions& options, RunMetadata& metadata);
// Reads them back; a missing or malformed key throws InputError naming `source` and the key.
RunOptions RunOptionsFromMetadata(const RunMetadata& metadata, const std::string& source);

}  // namespace ctxplan
