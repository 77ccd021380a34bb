#include "keel/io/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "keel/io/atomic_file.h"

namespace keel::io {

using json = nlohmann::json;

const char* safetensors_dtype(DType dt) {
  switch (dt) {
    case DType::F32:
      return "F32";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
    case DType::U8:
      return "U8";
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

namespace {

// The tensors a header describes, validated against the data section's length `data_len`
// (sizes with checked arithmetic: a header's shape must not wrap the byte count), in file order.
SafetensorsHeader parse_header(const std::string& path, std::string_view text, uint64_t data_len) {
  auto bad = [&](const std::string& what) {
    return Error(path + ": not a valid safetensors file: " + what);
  };
  json header;
  try {
    header = json::parse(text);
  } catch (const json::parse_error& e) {
    throw bad(std::string("header JSON: ") + e.what());
  }
  if (!header.is_object()) throw bad("header is not a JSON object");
  SafetensorsHeader out;
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (v.is_object())
        for (auto& [k, mv] : v.items())
          out.metadata[k] = mv.is_string() ? mv.get<std::string>() : mv.dump();
      continue;
    }
    const std::string& tname = name;  // clang 14 cannot capture a structured binding
    auto tbad = [&](const std::string& what) { return bad("tensor '" + tname + "': " + what); };
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets"))
      throw tbad("entry needs dtype, shape and data_offsets");
    auto dt = parse_dtype(v["dtype"].is_string() ? v["dtype"].get<std::string>() : "");
    if (!dt)
      throw tbad("unsupported dtype " + v["dtype"].dump() +
                 " (keel reads F32, BF16, F16, I32, I64, U8)");
    TensorInfo t{name, *dt, {}, 0, 0};
    if (!v["shape"].is_array()) throw tbad("shape must be an array, got " + v["shape"].dump());
    uint64_t want = dtype_size(*dt);
    for (auto& d : v["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        throw tbad("bad shape " + v["shape"].dump());
      t.shape.push_back(d.get<int64_t>());
      if (__builtin_mul_overflow(want, static_cast<uint64_t>(t.shape.back()), &want))
        throw tbad("shape " + v["shape"].dump() + " of " + dtype_name(*dt) +
                   " needs more than 2^64 bytes");
    }
    auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned())
      throw tbad("data_offsets must be [begin, end]");
    t.begin = off[0].get<uint64_t>(), t.end = off[1].get<uint64_t>();
    if (t.end < t.begin || t.end - t.begin != want)
      throw tbad("data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                 ") hold " + std::to_string(t.end - t.begin) + " bytes but shape " +
                 shape_str(t.shape) + " of " + dtype_name(*dt) + " needs " + std::to_string(want));
    if (t.end > data_len)
      throw tbad("data ends at byte " + std::to_string(t.end) + " but the file has only " +
                 std::to_string(data_len) + " data bytes (truncated file?)");
    out.tensors.push_back(std::move(t));
  }
  std::sort(out.tensors.begin(), out.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < out.tensors.size(); ++i)
    if (out.tensors[i].begin < out.tensors[i - 1].end)
      throw bad("tensors '" + out.tensors[i - 1].name + "' and '" + out.tensors[i].name +
                "' overlap");
  return out;
}

// The header length of a file of `file_size` bytes whose first 8 bytes are `prefix`.
uint64_t header_length(const std::string& path, const char* prefix, uint64_t file_size) {
  if (file_size < 8)
    throw Error(path +
                ": not a valid safetensors file: shorter than the 8-byte header length "
                "(truncated?)");
  uint64_t hlen = 0;
  std::memcpy(&hlen, prefix, 8);
  if (hlen > file_size - 8)
    throw Error(path + ": not a valid safetensors file: header length " + std::to_string(hlen) +
                " exceeds the file size " + std::to_string(file_size) + " (truncated?)");
  return hlen;
}

}  // namespace

SafetensorsHeader read_safetensors_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw Error("cannot read " + path + ": " + std::strerror(errno));
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  char prefix[8] = {};
  in.seekg(0);
  in.read(prefix, size < 8 ? static_cast<std::streamsize>(size) : 8);
  const uint64_t hlen = header_length(path, prefix, size);
  std::string text(hlen, '\0');
  in.read(text.data(), static_cast<std::streamsize>(hlen));
  if (!in) throw Error("cannot read " + path + ": the header could not be read");
  return parse_header(path, text, size - 8 - hlen);
}

struct MappedSafetensors::Mapping {
  void* base = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (base) munmap(base, size);
  }
};

MappedSafetensors::MappedSafetensors(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("cannot read " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(fd);
    throw Error("cannot read " + path + ": " +
                (S_ISDIR(st.st_mode) ? std::string("it is a directory") : std::strerror(err)));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  char prefix[8] = {};
  if (size >= 8 && ::pread(fd, prefix, 8, 0) != 8) {
    ::close(fd);
    throw Error("cannot read " + path + ": the header could not be read");
  }
  const uint64_t hlen = header_length(path, prefix, size);
  map_ = std::make_shared<Mapping>();
  // Writable and private: pages written by keel (an adapter merged into a mapped base) are
  // copied on write; the file is opened read-only and never changes.
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  if (base == MAP_FAILED) throw Error("cannot map " + path + ": " + std::strerror(err));
  map_->base = base;
  map_->size = size;
  data_start_ = 8 + hlen;
  const char* bytes = static_cast<const char*>(base);
  header_ = parse_header(path, std::string_view(bytes + 8, hlen), size - data_start_);
}

const TensorInfo* MappedSafetensors::find(const std::string& name) const {
  for (const TensorInfo& t : header_.tensors)
    if (t.name == name) return &t;
  return nullptr;
}

const void* MappedSafetensors::raw(const TensorInfo& t) const {
  return static_cast<const char*>(map_->base) + data_start_ + t.begin;
}

bool MappedSafetensors::aligned(const TensorInfo& t) const {
  return reinterpret_cast<uintptr_t>(raw(t)) % dtype_size(t.dtype) == 0;
}

Tensor MappedSafetensors::tensor(const TensorInfo& t) const {
  void* p = const_cast<void*>(raw(t));
  const size_t n = t.end - t.begin;
  Tensor out;
  if (!aligned(t) || n == 0) {
    out = Tensor::empty(t.shape, t.dtype);
    if (n) std::memcpy(out.data(), p, n);
  } else {
    // Dropped when the view dies: the pages wholly inside [p, p + n) (a page shared with a
    // neighbouring tensor stays).
    static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page,
                    hi = (reinterpret_cast<uintptr_t>(p) + n) / page * page;
    std::shared_ptr<Mapping> map = map_;
    std::shared_ptr<void> keep(p, [map, lo, hi](void*) {
      if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
    });
    out = Tensor::from_external(p, t.shape, t.dtype, std::move(keep));
  }
  out.set_name(t.name);
  return out;
}

Safetensors read_safetensors(const std::string& path) {
  MappedSafetensors m(path);
  Safetensors out;
  out.path = path;
  out.metadata = m.header().metadata;
  for (const TensorInfo& i : m.header().tensors) out.tensors.emplace_back(i.name, m.tensor(i));
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
