// The FFI handlers' fill check (ffi/ffi_util.h MarkFields, CheckFilled) on a CPU, for
// tests/test_op_table.py, which builds this file into a program of its own: the launch
// functions' definitions are stubs it generates from ffi/launch.h (nothing here launches), so
// no kernel is compiled or linked.
//
// Reads lines "op key key ..." from stdin. For each, it marks op's args as a handler does,
// writes the fields named by the keys as a handler fills them (its flags first, then the
// rest), and prints one line: "ok", or CheckFilled's error message.
#include <cstdint>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>

#include "ffi_util.h"
#include "launch.h"
#include "op_table.h"

namespace {

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

template <class A>
A ArgsOf(pk_ffi::Status (*)(const pk_ffi::Where&, const A&));
template <class A>
A ArgsOf(pk_ffi::Status (*)(const pk_ffi::Where&, const A&, const pk_ffi::CommView&));

std::string Check(const std::string& op, const std::set<std::string>& keys) {
  const pk_ffi::op_table::Op* entry = pk_ffi::op_table::Find(op.c_str());
  if (entry == nullptr || !entry->emu) return "unknown op '" + op + "'";
  const int id = entry->id;
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

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream words(line);
    std::string op, key;
    words >> op;
    std::set<std::string> keys;
    while (words >> key) keys.insert(key);
    std::cout << Check(op, keys) << std::endl;
  }
  return 0;
}
