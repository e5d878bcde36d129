// A small JSON builder for the CLI's --json output: keys in insertion order, numbers and strings
// escaped by the trace writer's helpers. Built in memory (outputs are small) and written at once.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ctxplan/traces/chrome_trace_writer.h"

namespace ctxplan::cli {

class JsonOut {
 public:
  JsonOut& BeginObject(std::string_view key = {}) { return Open(key, '{'); }
  JsonOut& EndObject() { return Close('}'); }
  JsonOut& BeginArray(std::string_view key = {}) { return Open(key, '['); }
  JsonOut& EndArray() { return Close(']'); }

  JsonOut& Field(std::string_view key, std::string_view value) {
    Key(key);
    AppendJsonString(text_, value);
    return *this;
  }
  JsonOut& Field(std::string_view key, const char* value) {
    return Field(key, std::string_view(value));
  }
  JsonOut& Field(std::string_view key, const std::string& value) {
    return Field(key, std::string_view(value));
  }
  JsonOut& Field(std::string_view key, double value) {
    Key(key);
    AppendJsonNumber(text_, value);
    return *this;
  }
  JsonOut& Field(std::string_view key, int64_t value) {
    Key(key);
    AppendJsonInt(text_, value);
    return *this;
  }
  JsonOut& Field(std::string_view key, int value) {
    return Field(key, static_cast<int64_t>(value));
  }
  JsonOut& Field(std::string_view key, bool value) {
    Key(key);
    text_ += value ? "true" : "false";
    return *this;
  }

  // The finished document with a trailing newline.
  std::string Text() const { return text_ + "\n"; }

 private:
  void Key(std::string_view key) {
    if (!first_.empty()) {
      if (!first_.back()) text_ += ',';
      first_.back() = false;
    }
    if (!key.empty()) {
      AppendJsonString(text_, key);
      text_ += ':';
    }
  }
  JsonOut& Open(std::string_view key, char bracket) {
    Key(key);
    text_ += bracket;
    first_.push_back(true);
    return *this;
  }
  JsonOut& Close(char bracket) {
    text_ += bracket;
    first_.pop_back();
    return *this;
  }

  std::string text_;
  std::vector<bool> first_;
};

}  // namespace ctxplan::cli
