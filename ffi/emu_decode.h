// The rank emulator's decoder: a launch dict into an op's args struct, reading each field the
// op's visitor names (launch.h VisitFields) by its key. module.cc decodes Python dicts with it
// (emu_launch, workspace_need); tests/cpp/fields.cc decodes text with it, for the CPU tests.
//
// `Source` is the dict: Has(key), Int(key) -> int64_t and Float(key) -> double, which raises
// the source's missing-key error for a key it lacks. A missing integer, flag or pointer reads
// as its fallback (0 unless the visitor gives one); a missing float (scale) raises, unless
// floats are optional (workspace_need: no need reads one), when it reads 0. Keys the visitor
// does not name are ignored (tests/test_op_table.py checks that pk_jax/testing passes exactly
// the named ones).
//
// Plain C++17 on the host (launch.h, no XLA or Python headers).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "launch.h"
#include "op_table.h"

namespace pk_ffi::emu {

template <class Source>
class FieldReader {
 public:
  FieldReader(const Source& d, bool floats_required) : d_(d), floats_required_(floats_required) {}

  bool When(bool cond) const { return cond; }

  template <class T>
  void operator()(const char* key, T& field) const {
    if constexpr (std::is_same_v<T, float>) {
      field = floats_required_ || d_.Has(key) ? static_cast<float>(d_.Float(key)) : 0.0f;
    } else {
      (*this)(key, field, 0);
    }
  }

  template <class T>
  void operator()(const char* key, T& field, int64_t fallback) const {
    static_assert(!std::is_same_v<T, float>, "a float field has no fallback");
    const int64_t value = d_.Has(key) ? d_.Int(key) : fallback;
    if constexpr (std::is_pointer_v<T>) {
      field = reinterpret_cast<T>(static_cast<uintptr_t>(value));
    } else if constexpr (std::is_same_v<T, bool>) {
      field = value != 0;
    } else {
      field = static_cast<T>(value);  // int64_t, DType
    }
  }

 private:
  const Source& d_;
  bool floats_required_;
};

// moe_scatter and moe_gather are moe_dispatch's and moe_combine's mode 1: the op says which, no
// field of the call does.
inline void SetMode(int op, MoeDispatchArgs* a) { a->mode = op == kOpMoeScatter; }
inline void SetMode(int op, MoeCombineArgs* a) { a->mode = op == kOpMoeGather; }
template <class A>
void SetMode(int, A*) {}

// Op `op`'s args decoded from a launch dict.
template <class A, class Source>
A Decode(int op, const Source& d, bool floats_required = true) {
  A a{};
  VisitFields(FieldReader<Source>(d, floats_required), op, a);
  SetMode(op, &a);
  return a;
}

// The args struct of a launch function (its parameter), for WithLauncher's callers.
template <class A>
A ArgsOf(Status (*)(const Where&, const A&));
template <class A>
A ArgsOf(Status (*)(const Where&, const A&, const CommView&));

// The id of emulator op `op`; std::invalid_argument (ValueError) for any other name.
inline int EmuOp(const std::string& op) {
  const op_table::Op* entry = op_table::Find(op.c_str());
  if (entry == nullptr || !entry->emu) {
    throw std::invalid_argument("pk_jax emulator: unknown op '" + op + "'");
  }
  return entry->id;
}

}  // namespace pk_ffi::emu
