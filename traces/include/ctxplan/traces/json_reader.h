// A small strict JSON reader (RFC 8259) for the files the project reads: safetensors headers and
// indexes, and trace metadata. Whole documents in memory, bounded depth and value count so that
// a hostile file cannot exhaust memory; every error is an InputError naming where and the byte.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "ctxplan/models/errors.h"

namespace ctxplan {

// A name read from a file, quoted for a one-line error message: 'name', with control characters
// escaped (a newline in a tensor name must not split the message) and very long names cut.
inline std::string QuoteName(std::string_view text) {
  constexpr size_t kMax = 160;
  std::string out = "'";
  for (size_t i = 0; i < text.size() && i < kMax; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 || c == 0x7f) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (text.size() > kMax) out += "...";
  return out + "'";
}

// Deeper is no file of ours; bounds the recursion.
inline constexpr size_t kMaxJsonDepth = 64;
// A parsed value costs ~100 bytes, so a hostile 100 MB header of "[0,0,0,..." could expand to
// gigabytes; real headers hold ~10 values per tensor and at most ~10^5 tensors.
inline constexpr size_t kMaxJsonValues = size_t{2} << 20;

struct JsonMember;

struct JsonValue {
  enum class Kind : uint8_t { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  std::string text;  // a string's value, or a number's literal text
  std::vector<JsonValue> items;
  std::vector<JsonMember> members;  // in file order, keys unique
  size_t offset = 0;                // where the value starts in the JSON text
};

// An object's key and value (a struct, not std::pair: a pair may not hold the incomplete
// JsonValue, and libc++ / clang refuse it where libstdc++ / GCC let it pass).
struct JsonMember {
  std::string first;
  JsonValue second;
};

inline const char* KindName(JsonValue::Kind kind) {
  switch (kind) {
    case JsonValue::Kind::kNull:
      return "null";
    case JsonValue::Kind::kBool:
      return "a boolean";
    case JsonValue::Kind::kNumber:
      return "a number";
    case JsonValue::Kind::kString:
      return "a string";
    case JsonValue::Kind::kArray:
      return "an array";
    case JsonValue::Kind::kObject:
      return "an object";
  }
  return "?";
}

class JsonParser {
 public:
  // `where` prefixes every error ("<file>: malformed safetensors header"); `base` is the file
  // offset of the text, so errors can name the byte in the file.
  JsonParser(std::string_view text, std::string where, uint64_t base)
      : text_(text), where_(std::move(where)), base_(base) {}

  JsonValue ParseDocument() {
    SkipSpace();
    JsonValue value = ParseValue(0);
    SkipSpace();
    if (pos_ != text_.size()) Error("unexpected " + Describe() + " after the JSON value");
    return value;
  }

 private:
  [[noreturn]] void Error(const std::string& what) const {
    throw InputError(where_ + " at byte " + std::to_string(base_ + pos_) + ": " + what);
  }

  std::string Describe() const {
    if (pos_ >= text_.size()) return "end of text";
    const unsigned char c = static_cast<unsigned char>(text_[pos_]);
    if (c >= 0x20 && c < 0x7f) return std::string("'") + static_cast<char>(c) + "'";
    return "byte 0x" + std::string{"0123456789abcdef"[c >> 4], "0123456789abcdef"[c & 15]};
  }

  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r'))
      ++pos_;
  }

  void Expect(char c) {
    if (pos_ >= text_.size() || text_[pos_] != c)
      Error(std::string("expected '") + c + "', found " + Describe());
    ++pos_;
  }

  JsonValue ParseValue(size_t depth) {
    if (depth > kMaxJsonDepth) Error("nesting deeper than " + std::to_string(kMaxJsonDepth));
    if (++values_ > kMaxJsonValues)
      Error("more than " + std::to_string(kMaxJsonValues) + " JSON values");
    if (pos_ >= text_.size()) Error("expected a value, found end of text");
    JsonValue value;
    value.offset = pos_;
    const char c = text_[pos_];
    if (c == '{') {
      value.kind = JsonValue::Kind::kObject;
      ++pos_;
      SkipSpace();
      if (pos_ < text_.size() && text_[pos_] == '}') {
        ++pos_;
        return value;
      }
      std::set<std::string, std::less<>> keys;
      while (true) {
        SkipSpace();
        if (pos_ >= text_.size() || text_[pos_] != '"')
          Error("expected a string key, found " + Describe());
        const size_t key_at = pos_;
        std::string key = ParseString();
        if (!keys.insert(key).second) {
          pos_ = key_at;
          Error("duplicate key " + QuoteName(key));
        }
        SkipSpace();
        Expect(':');
        SkipSpace();
        JsonValue member = ParseValue(depth + 1);
        value.members.push_back({std::move(key), std::move(member)});
        SkipSpace();
        if (pos_ < text_.size() && text_[pos_] == ',') {
          ++pos_;
          continue;
        }
        if (pos_ < text_.size() && text_[pos_] == '}') {
          ++pos_;
          return value;
        }
        Error("expected ',' or '}', found " + Describe());
      }
    }
    if (c == '[') {
      value.kind = JsonValue::Kind::kArray;
      ++pos_;
      SkipSpace();
      if (pos_ < text_.size() && text_[pos_] == ']') {
        ++pos_;
        return value;
      }
      while (true) {
        SkipSpace();
        value.items.push_back(ParseValue(depth + 1));
        SkipSpace();
        if (pos_ < text_.size() && text_[pos_] == ',') {
          ++pos_;
          continue;
        }
        if (pos_ < text_.size() && text_[pos_] == ']') {
          ++pos_;
          return value;
        }
        Error("expected ',' or ']', found " + Describe());
      }
    }
    if (c == '"') {
      value.kind = JsonValue::Kind::kString;
      value.text = ParseString();
      return value;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      value.kind = JsonValue::Kind::kNumber;
      value.text = ParseNumber();
      return value;
    }
    for (const auto& [word, kind, boolean] : {std::tuple{"true", JsonValue::Kind::kBool, true},
                                              std::tuple{"false", JsonValue::Kind::kBool, false},
                                              std::tuple{"null", JsonValue::Kind::kNull, false}}) {
      const std::string_view w(word);
      if (text_.substr(pos_, w.size()) == w) {
        pos_ += w.size();
        value.kind = kind;
        value.boolean = boolean;
        return value;
      }
    }
    Error("expected a value, found " + Describe());
  }

  std::string ParseNumber() {
    const size_t start = pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      return pos_ - from;
    };
    if (text_[pos_] == '-') ++pos_;
    if (pos_ < text_.size() && text_[pos_] == '0') {
      ++pos_;
      if (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9')
        Error("a number may not have a leading zero");
    } else if (digits() == 0) {
      Error("expected a digit, found " + Describe());
    }
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      if (digits() == 0) Error("expected a digit after '.', found " + Describe());
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      if (digits() == 0) Error("expected a digit in the exponent, found " + Describe());
    }
    return std::string(text_.substr(start, pos_ - start));
  }

  void AppendUtf8(std::string& out, uint32_t code) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xc0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3f));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xe0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (code & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (code & 0x3f));
    }
  }

  uint32_t ParseHex4() {
    uint32_t code = 0;
    for (int i = 0; i < 4; ++i, ++pos_) {
      if (pos_ >= text_.size()) Error("unterminated \\u escape");
      const char h = text_[pos_];
      code <<= 4;
      if (h >= '0' && h <= '9')
        code |= static_cast<uint32_t>(h - '0');
      else if (h >= 'a' && h <= 'f')
        code |= static_cast<uint32_t>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F')
        code |= static_cast<uint32_t>(h - 'A' + 10);
      else
        Error("expected a hex digit in a \\u escape, found " + Describe());
    }
    return code;
  }

  // Checks one UTF-8 sequence starting at pos_ (RFC 3629: no overlongs, no surrogates).
  void CopyUtf8(std::string& out) {
    const unsigned char lead = static_cast<unsigned char>(text_[pos_]);
    size_t length = 0;
    uint32_t code = 0;
    uint32_t min = 0;
    if (lead >= 0xc2 && lead <= 0xdf)
      length = 2, code = lead & 0x1f, min = 0x80;
    else if (lead >= 0xe0 && lead <= 0xef)
      length = 3, code = lead & 0x0f, min = 0x800;
    else if (lead >= 0xf0 && lead <= 0xf4)
      length = 4, code = lead & 0x07, min = 0x10000;
    else
      Error("invalid UTF-8 in a string");
    if (pos_ + length > text_.size()) Error("invalid UTF-8 in a string");
    for (size_t i = 1; i < length; ++i) {
      const unsigned char c = static_cast<unsigned char>(text_[pos_ + i]);
      if ((c & 0xc0) != 0x80) Error("invalid UTF-8 in a string");
      code = (code << 6) | (c & 0x3f);
    }
    if (code < min || code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff))
      Error("invalid UTF-8 in a string");
    out.append(text_.substr(pos_, length));
    pos_ += length;
  }

  std::string ParseString() {
    ++pos_;  // the opening quote
    std::string out;
    while (true) {
      if (pos_ >= text_.size()) Error("unterminated string");
      const unsigned char c = static_cast<unsigned char>(text_[pos_]);
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) Error("control character in a string (escape it)");
      if (c >= 0x80) {
        CopyUtf8(out);
        continue;
      }
      if (c != '\\') {
        out += static_cast<char>(c);
        ++pos_;
        continue;
      }
      ++pos_;
      if (pos_ >= text_.size()) Error("unterminated string");
      const char e = text_[pos_++];
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          uint32_t code = ParseHex4();
          if (code >= 0xdc00 && code <= 0xdfff) Error("unpaired low surrogate in a \\u escape");
          if (code >= 0xd800 && code <= 0xdbff) {
            if (text_.substr(pos_, 2) != "\\u") Error("unpaired high surrogate in a \\u escape");
            pos_ += 2;
            const uint32_t low = ParseHex4();
            if (low < 0xdc00 || low > 0xdfff) Error("unpaired high surrogate in a \\u escape");
            code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
          }
          AppendUtf8(out, code);
          break;
        }
        default:
          --pos_;
          Error("invalid escape '\\" + std::string(1, e) + "'");
      }
    }
  }

  std::string_view text_;
  std::string where_;
  uint64_t base_;
  size_t pos_ = 0;
  size_t values_ = 0;
};

}  // namespace ctxplan
