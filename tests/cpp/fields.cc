// The op table's field visitor on a CPU, for tests/test_op_table.py, which builds this file
// into a program of its own: the launch functions' definitions are stubs it generates from
// ffi/launch.h (nothing here launches), so no kernel is compiled or linked.
//
// Reads one command per line from stdin and answers each with one line:
//   decode OP KEY=VALUE ...  the rank emulator's decoder (ffi/emu_decode.h) on that launch
//                            dict: "ok" and KEY=T:VALUE for every field it read (T: i an
//                            integer, pointer or dtype code, b a flag, f a float), or
//                            "KeyError KEY" (a float left out), or "ValueError MESSAGE";
//   fill OP KEY ...          the FFI handlers' fill check (ffi/ffi_util.h MarkFields,
//                            CheckFilled): marks OP's args as a handler does, writes the fields
//                            named by the keys as a handler fills them (its flags first, then
//                            the rest): "ok", or CheckFilled's message.
#include <cstdint>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "emu_decode.h"
#include "ffi_util.h"
#include "launch.h"

namespace {

using pk_ffi::emu::ArgsOf;

// A launch dict of text, KEY=VALUE.
class TextDict {
 public:
  explicit TextDict(std::map<std::string, std::string> d) : d_(std::move(d)) {}
  bool Has(const char* key) const { return d_.count(key) != 0; }
  int64_t Int(const char* key) const { return std::stoll(d_.at(key)); }
  double Float(const char* key) const {
    if (!Has(key)) throw std::out_of_range(key);
    return std::stod(d_.at(key));
  }

 private:
  std::map<std::string, std::string> d_;
};

// Writes "KEY=T:VALUE" of every field the decoder read.
class TextWriter {
 public:
  explicit TextWriter(std::ostringstream& out) : out_(out) {}
  bool When(bool cond) const { return cond; }
  template <class T>
  void operator()(const char* key, T& field, int64_t /*fallback*/ = 0) const {
    out_ << ' ' << key << '=';
    if constexpr (std::is_pointer_v<T>) {
      out_ << "i:" << reinterpret_cast<uintptr_t>(field);
    } else if constexpr (std::is_same_v<T, pk_ffi::DType>) {
      out_ << "i:" << static_cast<int>(field);
    } else if constexpr (std::is_same_v<T, bool>) {
      out_ << "b:" << (field ? 1 : 0);
    } else if constexpr (std::is_same_v<T, float>) {
      out_ << "f:" << field;
    } else {
      out_ << "i:" << field;
    }
  }

 private:
  std::ostringstream& out_;
};

// Writes the fields named in `keys` (only the flags with flags_only) with values no mark takes.
class KeyWriter {
 public:
  KeyWriter(const std::set<std::string>& keys, bool flags_only)
      : keys_(keys), flags_only_(flags_only) {}
  bool When(bool cond) const { return cond; }
  template <class T>
  void operator()(const char* key, T& field, int64_t /*fallback*/ = 0) const {
    if (keys_.count(key) == 0 || (flags_only_ && !std::is_same_v<T, bool>)) return;
    if constexpr (std::is_pointer_v<T>) {
      field = reinterpret_cast<T>(uintptr_t{256});
    } else if constexpr (std::is_same_v<T, pk_ffi::DType>) {
      field = pk_ffi::DType::kBF16;
    } else {
      field = static_cast<T>(1);  // int64_t, float, bool
    }
  }

 private:
  const std::set<std::string>& keys_;
  bool flags_only_;
};

std::string Decode(const std::string& op, const std::map<std::string, std::string>& kv) {
  const int id = pk_ffi::emu::EmuOp(op);
  std::ostringstream out;
  out << "ok";
  pk_ffi::WithLauncher(
      id,
      [&](auto launch) {
        using A = decltype(ArgsOf(launch));
        A a = pk_ffi::emu::Decode<A>(id, TextDict(kv));
        pk_ffi::VisitFields(TextWriter(out), id, a);
        if constexpr (std::is_same_v<A, pk_ffi::MoeDispatchArgs> ||
                      std::is_same_v<A, pk_ffi::MoeCombineArgs>) {
          out << " mode=i:" << a.mode;
        }
      },
      [] {});
  return out.str();
}

std::string Fill(const std::string& op, const std::set<std::string>& keys) {
  const int id = pk_ffi::emu::EmuOp(op);
  std::string out = "ok";
  pk_ffi::WithLauncher(
      id,
      [&](auto launch) {
        decltype(ArgsOf(launch)) a{};
        pk_ffi::VisitFields(KeyWriter(keys, true), id, a);
        pk_ffi::MarkFields(id, &a);
        pk_ffi::VisitFields(KeyWriter(keys, false), id, a);
        const xla::ffi::Error e = pk_ffi::CheckFilled(id, a);
        if (e.failure()) out = e.message();
      },
      [] {});
  return out;
}

std::string Answer(const std::string& line) {
  std::istringstream words(line);
  std::string command, op, word;
  words >> command >> op;
  std::map<std::string, std::string> kv;
  std::set<std::string> keys;
  while (words >> word) {
    const size_t eq = word.find('=');
    if (eq == std::string::npos) {
      keys.insert(word);
    } else {
      kv[word.substr(0, eq)] = word.substr(eq + 1);
    }
  }
  try {
    if (command == "decode") return Decode(op, kv);
    if (command == "fill") return Fill(op, keys);
    return "ValueError unknown command '" + command + "'";
  } catch (const std::out_of_range& e) {
    return std::string("KeyError ") + e.what();
  } catch (const std::invalid_argument& e) {
    return std::string("ValueError ") + e.what();
  }
}

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) std::cout << Answer(line) << std::endl;
  return 0;
}
