// The catalogue YAML files, embedded at build time by cmake/EmbedCatalog.cmake (the generated
// embedded_catalog.cpp defines EmbeddedCatalog()). Private to ctxplan_models.
#pragma once

#include <span>
#include <string_view>

namespace ctxplan::detail {

struct EmbeddedFile {
  std::string_view path;  // relative to models/: "llm/qwen2.5-7b.yaml"
  std::string_view text;  // the file's bytes
};

// Every file, sorted by path.
std::span<const EmbeddedFile> EmbeddedCatalog();

}  // namespace ctxplan::detail
