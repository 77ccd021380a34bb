#include "keel/io/safetensors.h"

#include <cstring>
#include <nlohmann/json.hpp>

#include "keel/io/atomic_file.h"

namespace keel::io {

using json = nlohmann::json;

const char* safetensors_dtype(DType dt) {
  switch (dt) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
  }
  return "?";
}

static std::optional<DType> parse_dtype(const std::string& s) {
  for (DType d : {DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8})
    if (s == safetensors_dtype(d)) return d;
  if (s == "BOOL") return DType::U8;
  return std::nullopt;
}

const Tensor* Safetensors::find(const std::string& name) const {
  for (auto& [n, t] : tensors)
    if (n == name) return &t;
  return nullptr;
}

const Tensor& Safetensors::at(const std::string& name) const {
  if (const Tensor* t = find(name)) return *t;
  throw Error(path + ": tensor '" + name + "' is missing (the file has " +
              std::to_string(tensors.size()) + " tensors; was it written for another model?)");
}

Safetensors read_safetensors(const std::string& path) {
  const std::string bytes = read_file(path);
  auto bad = [&](const std::string& what) {
    return Error(path + ": not a valid safetensors file: " + what);
  };
  if (bytes.size() < 8) throw bad("shorter than the 8-byte header length (truncated?)");
  uint64_t hlen = 0;
  std::memcpy(&hlen, bytes.data(), 8);
  if (hlen > bytes.size() - 8)
    throw bad("header length " + std::to_string(hlen) + " exceeds the file size " +
              std::to_string(bytes.size()) + " (truncated?)");
  json header;
  try {
    header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<int64_t>(hlen));
  } catch (const json::parse_error& e) {
    throw bad(std::string("header JSON: ") + e.what());
  }
  if (!header.is_object()) throw bad("header is not a JSON object");
  const size_t data_start = 8 + hlen, data_len = bytes.size() - data_start;
  Safetensors out;
  out.path = path;
  std::vector<std::tuple<uint64_t, uint64_t, std::string>> spans;
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (v.is_object())
        for (auto& [k, mv] : v.items())
          out.metadata[k] = mv.is_string() ? mv.get<std::string>() : mv.dump();
      continue;
    }
    auto tbad = [&](const std::string& what) { return bad("tensor '" + name + "': " + what); };
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets"))
      throw tbad("entry needs dtype, shape and data_offsets");
    auto dt = parse_dtype(v["dtype"].is_string() ? v["dtype"].get<std::string>() : "");
    if (!dt) throw tbad("unsupported dtype " + v["dtype"].dump() + " (keel reads F32, BF16, F16, I32, I64, U8)");
    Shape shape;
    for (auto& d : v["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) throw tbad("bad shape " + v["shape"].dump());
      shape.push_back(d.get<int64_t>());
    }
    auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned())
      throw tbad("data_offsets must be [begin, end]");
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    const uint64_t want = static_cast<uint64_t>(shape_numel(shape)) * dtype_size(*dt);
    if (e < b || e - b != want)
      throw tbad("data_offsets [" + std::to_string(b) + ", " + std::to_string(e) + ") hold " +
                 std::to_string(e - b) + " bytes but shape " + shape_str(shape) + " of " +
                 dtype_name(*dt) + " needs " + std::to_string(want));
    if (e > data_len)
      throw tbad("data ends at byte " + std::to_string(e) + " but the file has only " +
                 std::to_string(data_len) + " data bytes (truncated file?)");
    spans.emplace_back(b, e, name);
    Tensor t = Tensor::empty(shape, *dt);
    std::memcpy(t.data(), bytes.data() + data_start + b, want);
    t.set_name(name);
    out.tensors.emplace_back(name, t);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    if (std::get<0>(spans[i]) < std::get<1>(spans[i - 1]))
      throw bad("tensors '" + std::get<2>(spans[i - 1]) + "' and '" + std::get<2>(spans[i]) +
                "' overlap");
  std::sort(out.tensors.begin(), out.tensors.end(), [&](auto& x, auto& y) {
    return header[x.first]["data_offsets"][0].template get<uint64_t>() <
           header[y.first]["data_offsets"][0].template get<uint64_t>();
  });
  return out;
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::vector<const void*> chunks;
  std::vector<size_t> sizes;
  std::vector<Tensor> host;  // device tensors copied to the host, in order
  host.reserve(tensors.size());
  for (auto& [name, t] : tensors) {
    host.push_back(t.device().is_cpu() ? t : t.to(Device::cpu()));
    const uint64_t n = t.nbytes();
    header[name] = {{"dtype", safetensors_dtype(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8) h.push_back(' ');  // align the data section to 8 bytes
  uint64_t hlen = h.size();
  std::string prefix(8, '\0');
  std::memcpy(prefix.data(), &hlen, 8);
  prefix += h;
  chunks.insert(chunks.begin(), prefix.data());
  sizes.insert(sizes.begin(), prefix.size());
  for (const Tensor& t : host) {
    chunks.push_back(t.data());
    sizes.push_back(t.nbytes());
  }
  write_file_atomic(path, chunks.data(), sizes.data(), chunks.size());
}

}  // namespace keel::io
