// What the dispatcher tap reads of an op's arguments and results, boxed or not.
//
// The tap's typed kernels receive an aten op's arguments as C++ values, its boxed kernel as a
// stack of IValues. Both are read through `Arg`: a view that borrows a tensor (no refcount
// touched) or copies a number, so one reader serves both and neither path boxes anything.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/SymInt.h>

#include <array>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace fadiag {

struct Arg {
  enum Kind : uint8_t { kNone, kTensor, kBool, kInt, kDouble };
  Kind kind = kNone;
  const at::Tensor* tensor = nullptr;  // borrowed: valid while the call's arguments are
  int64_t integer = 0;                 // kBool, kInt
  double number = 0.0;                 // kDouble

  bool is_tensor() const { return kind == kTensor && tensor->defined(); }
  const at::Tensor& t() const { return *tensor; }
};

inline Arg view(const at::Tensor& t) {
  Arg a;
  a.kind = Arg::kTensor;
  a.tensor = &t;
  return a;
}
inline Arg view(const std::optional<at::Tensor>& t) { return t.has_value() ? view(*t) : Arg{}; }
inline Arg view(bool b) {
  Arg a;
  a.kind = Arg::kBool;
  a.integer = b;
  return a;
}
inline Arg view(int64_t i) {
  Arg a;
  a.kind = Arg::kInt;
  a.integer = i;
  return a;
}
inline Arg view(double d) {
  Arg a;
  a.kind = Arg::kDouble;
  a.number = d;
  return a;
}
// A symbolic size (tracing, never a real call) reads as nothing.
inline Arg view(const c10::SymInt& s) {
  const auto i = s.maybe_as_int();
  return i.has_value() ? view(static_cast<int64_t>(*i)) : Arg{};
}
inline Arg view(const std::optional<double>& d) { return d.has_value() ? view(*d) : Arg{}; }
inline Arg view(const std::optional<int64_t>& i) { return i.has_value() ? view(*i) : Arg{}; }
inline Arg view(const std::optional<c10::SymInt>& s) { return s.has_value() ? view(*s) : Arg{}; }
template <class T>
Arg view(const T& /*other*/) {  // masks, lists, strings: nothing the tap reads
  return Arg{};
}

inline Arg view(const c10::IValue& v) {
  if (v.isTensor()) return view(v.toTensor());
  if (v.isBool()) return view(v.toBool());
  if (v.isInt()) return view(v.toInt());
  if (v.isDouble()) return view(v.toDouble());
  return Arg{};
}

// Views of a typed call's arguments, in schema order.
template <class... A>
std::array<Arg, sizeof...(A)> views(const A&... args) {
  return {view(args)...};
}

// Views of a typed op's results (a tuple, or one value).
template <class... R>
std::array<Arg, sizeof...(R)> views_of(const std::tuple<R...>& results) {
  return std::apply([](const R&... r) { return std::array<Arg, sizeof...(R)>{view(r)...}; },
                    results);
}
template <class R>
std::array<Arg, 1> views_of(const R& result) {
  return {view(result)};
}

// Views of a stack's last `n` IValues (a boxed call's arguments, or its results).
inline std::vector<Arg> views_of_stack(const std::vector<c10::IValue>& stack, size_t n) {
  std::vector<Arg> out;
  out.reserve(n);
  for (size_t i = stack.size() - n; i < stack.size(); ++i) out.push_back(view(stack[i]));
  return out;
}

}  // namespace fadiag
