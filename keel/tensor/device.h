// Device: where a tensor's storage lives. `cpu` today; `cuda:N` is part of the type from day one so
// that the CUDA backend slots in without changing any signature.
#pragma once
#include <string>
#include <string_view>

namespace keel {

struct Device {
  enum class Kind : uint8_t { CPU, CUDA };
  Kind kind = Kind::CPU;
  int index = 0;

  static Device cpu() { return {}; }
  static Device cuda(int i) { return {Kind::CUDA, i}; }
  bool is_cpu() const { return kind == Kind::CPU; }
  bool is_cuda() const { return kind == Kind::CUDA; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
};

// "cpu", "cuda", "cuda:1"; throws keel::Error naming the text otherwise.
Device device_from_string(std::string_view s);

}  // namespace keel
