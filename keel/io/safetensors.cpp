#include "keel/io/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "keel/io/atomic_file.h"
#include "keel/numerics/input_file.h"
#include "keel/numerics/text.h"

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
  // No guess at the cause here: a caller whose file can lack the tensor looks it up with find()
  // and names its own fix ("was it written for another model?" misled a PEFT adapter's user).
  throw Error(path + ": tensor '" + name + "' is missing (the file has " +
              std::to_string(tensors.size()) + " tensors)");
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
  } catch (const json::exception& e) {
    throw bad("header JSON: " + json_error_detail(e.what()));
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
  std::sort(out.tensors.begin(), out.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    // An empty tensor before the one that starts where it does (else "overlap").
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < out.tensors.size(); ++i)
    if (out.tensors[i].begin < out.tensors[i - 1].end)
      throw bad("tensors '" + out.tensors[i - 1].name + "' and '" + out.tensors[i].name +
                "' overlap");
  // The data section holds the tensors back to back and nothing else, as the reference
  // implementation requires (its InvalidOffset and MetadataIncompleteBuffer): bytes no tensor
  // covers (a file with something appended, a header entry given twice, whose first bytes no
  // entry keeps) were accepted without a word.
  uint64_t at = 0;
  for (const TensorInfo& t : out.tensors) {
    if (t.begin != at)
      throw bad(
          "tensor '" + t.name + "' starts at data byte " + std::to_string(t.begin) + " but " +
          (at == 0 ? std::string("the data section starts at 0")
                   : "the tensor before it ends at " + std::to_string(at)) +
          ": bytes no tensor covers (a damaged file, or a tensor named twice in the header?)");
    at = t.end;
  }
  if (at != data_len)
    throw bad("the tensors end at data byte " + std::to_string(at) + " but the file holds " +
              std::to_string(data_len) + " data bytes: " + std::to_string(data_len - at) +
              " bytes after the last tensor (something appended to the file?)");
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

// A safetensors file is read by offset (mmap, pread): a directory, a device or a pipe cannot be.
Error not_a_regular_file(const std::string& path) {
  const std::string problem = input_file_problem(path);
  return Error("cannot read " + path + ": it " +
               (problem.empty()
                    ? std::string("is not a regular file (a pipe cannot be read by offset)")
                    : problem) +
               "; a safetensors file was expected");
}

// Closes a descriptor when its reader leaves, by return or by an Error.
struct FdCloser {
  int fd;
  ~FdCloser() { ::close(fd); }
};

}  // namespace

SafetensorsHeader read_safetensors_header(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) throw not_a_regular_file(path);
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
  // O_NONBLOCK: opening a FIFO would wait for a writer; it is refused by the check below instead.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw Error("cannot read " + path + ": " + std::strerror(errno));
  // Closed on every way out: a bad header length threw with the descriptor still open, and a
  // loop over damaged files (the fuzzer's) ran out of descriptors.
  const FdCloser closer{fd};
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) throw not_a_regular_file(path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  char prefix[8] = {};
  if (size >= 8 && ::pread(fd, prefix, 8, 0) != 8)
    throw Error("cannot read " + path + ": the header could not be read");
  const uint64_t hlen = header_length(path, prefix, size);
  map_ = std::make_shared<Mapping>();
  // Writable and private: pages written by keel (an adapter merged into a mapped base) are
  // copied on write; the file is opened read-only and never changes.
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  const int err = errno;
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

// ---- reading straight into memory

bool holds_exactly(const SafetensorsHeader& h,
                   const std::vector<std::pair<std::string, Tensor>>& tensors) {
  if (h.tensors.size() != tensors.size()) return false;
  std::unordered_map<std::string, const TensorInfo*> by_name;
  for (const TensorInfo& t : h.tensors) by_name.emplace(t.name, &t);
  for (const auto& [name, t] : tensors) {
    auto it = by_name.find(name);
    if (it == by_name.end() || it->second->dtype != t.dtype() || it->second->shape != t.shape())
      return false;
    by_name.erase(it);  // a name given twice does not match the file's one entry twice
  }
  return true;
}

bool holds_exactly(const std::vector<std::pair<std::string, Tensor>>& file,
                   const std::vector<std::pair<std::string, Tensor>>& tensors) {
  SafetensorsHeader h;
  for (const auto& [name, t] : file) h.tensors.push_back({name, t.dtype(), t.shape(), 0, 0});
  return holds_exactly(h, tensors);
}

size_t read_safetensors_into(const std::string& path,
                             const std::vector<std::pair<std::string, Tensor>>& into) {
  // O_NONBLOCK: opening a FIFO would wait for a writer; it is refused by the check below instead.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw Error("cannot read " + path + ": " + std::strerror(errno));
  const FdCloser closer{fd};
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) throw not_a_regular_file(path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  // Reads exactly n bytes at `at`, or throws naming what was being read.
  size_t calls = 0;
  auto read_at = [&](void* dst, size_t n, uint64_t at, const std::string& what) {
    char* p = static_cast<char*>(dst);
    while (n > 0) {
      const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(at));
      ++calls;
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        throw Error("cannot read " + path + ": " + what + ": " +
                    (r < 0 ? std::strerror(errno) : "the file ended early (truncated?)"));
      p += r, at += static_cast<uint64_t>(r), n -= static_cast<size_t>(r);
    }
  };
  char prefix[8] = {};
  if (size >= 8) read_at(prefix, 8, 0, "the header length");
  const uint64_t hlen = header_length(path, prefix, size);
  std::string text(hlen, '\0');
  read_at(text.data(), hlen, 8, "the header");
  const SafetensorsHeader h = parse_header(path, text, size - 8 - hlen);
  const uint64_t data_start = 8 + hlen;

  // Every destination is checked before anything is read.
  std::unordered_map<std::string, const TensorInfo*> by_name;
  for (const TensorInfo& t : h.tensors) by_name.emplace(t.name, &t);
  struct Piece {
    uint64_t begin, end;  // in the data section
    char* dst;
    std::string name;
  };
  std::vector<Piece> pieces;
  for (const auto& [name, t] : into) {
    auto it = by_name.find(name);
    if (it == by_name.end())
      // Callers list `into` from this very file (a checkpoint's names, read before): a tensor
      // gone since means the file changed, not that it belongs to another model.
      throw Error(path + ": tensor '" + name + "' is missing (the file has " +
                  std::to_string(h.tensors.size()) +
                  " tensors; was it replaced while it was read? read it again)");
    const TensorInfo& info = *it->second;
    if (info.dtype != t.dtype() || info.shape != t.shape())
      throw Error(path + ": tensor '" + name + "' is " + dtype_name(info.dtype) + " " +
                  shape_str(info.shape) + ", expected " + dtype_name(t.dtype()) + " " +
                  shape_str(t.shape()));
    KEEL_CHECK(t.device().is_cpu(), "read_safetensors_into: '" + name + "' is not on the CPU");
    if (info.end > info.begin)
      pieces.push_back({info.begin, info.end, static_cast<char*>(t.data()), name});
  }
  // A stretch that follows on in the file and in memory is one read.
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  const size_t header_calls = calls;
  for (size_t i = 0; i < pieces.size();) {
    size_t j = i + 1;
    while (j < pieces.size() && pieces[j].begin == pieces[j - 1].end &&
           pieces[j].dst == pieces[j - 1].dst + (pieces[j - 1].end - pieces[j - 1].begin))
      ++j;
    read_at(pieces[i].dst, pieces[j - 1].end - pieces[i].begin, data_start + pieces[i].begin,
            "tensor '" + pieces[i].name + "'" +
                (j - i > 1 ? " and the " + std::to_string(j - i - 1) + " after it" : ""));
    i = j;
  }
  return calls - header_calls;
}

namespace {

// The order of `tensors` in the file: the views of one storage (a flat buffer's slots) back to
// back in the buffer's order, each storage where its first tensor comes in `tensors`; tensors of
// their own storage stay where they are. Deterministic (it depends on offsets, not addresses), so
// the same state always gives the same file.
std::vector<size_t> file_order(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::unordered_map<const Storage*, size_t> group_of;
  std::vector<std::vector<size_t>> groups;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Storage* s = tensors[i].second.impl()->storage.get();
    auto [it, fresh] = group_of.emplace(s, groups.size());
    if (fresh) groups.emplace_back();
    groups[it->second].push_back(i);
  }
  std::vector<size_t> order;
  order.reserve(tensors.size());
  for (std::vector<size_t>& g : groups) {
    std::stable_sort(g.begin(), g.end(), [&](size_t a, size_t b) {
      return tensors[a].second.impl()->offset < tensors[b].second.impl()->offset;
    });
    order.insert(order.end(), g.begin(), g.end());
  }
  return order;
}

// `bytes` bytes of `first`'s storage from `first` on, as one tensor (a run of views).
Tensor storage_run(const Tensor& first, size_t bytes) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = first.impl()->storage;
  impl->offset = first.impl()->offset;
  impl->shape = {static_cast<int64_t>(bytes)};
  impl->dtype = DType::U8;
  return Tensor(std::move(impl));
}

}  // namespace

SafetensorsWrite write_safetensors(const std::string& path,
                                   const std::vector<std::pair<std::string, Tensor>>& tensors,
                                   const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  // A run: tensors that follow each other both in the file and in one storage, written at once.
  struct Run {
    Tensor first;
    size_t bytes = 0;
  };
  std::vector<Run> runs;
  uint64_t offset = 0;
  for (size_t i : file_order(tensors)) {
    const auto& [name, t] = tensors[i];
    const uint64_t n = t.nbytes();
    header[name] = {{"dtype", safetensors_dtype(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
    if (n == 0) continue;
    // A gap between two slots (the optimizer's 64-byte alignment) or an overlap ends the run: a
    // safetensors data section has no holes.
    Run* last = runs.empty() ? nullptr : &runs.back();
    if (last && last->first.shares_storage(t) &&
        static_cast<const char*>(last->first.data()) + last->bytes == t.data())
      last->bytes += n;
    else
      runs.push_back({t, n});
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8) h.push_back(' ');  // align the data section to 8 bytes
  uint64_t hlen = h.size();
  std::string prefix(8, '\0');
  std::memcpy(prefix.data(), &hlen, 8);
  prefix += h;
  std::vector<const void*> chunks{prefix.data()};
  std::vector<size_t> sizes{prefix.size()};
  std::vector<Tensor> host;  // device runs copied to the host, one copy per run
  host.reserve(runs.size());
  for (const Run& r : runs) {
    const Tensor bytes = storage_run(r.first, r.bytes);
    host.push_back(bytes.device().is_cpu() ? bytes : bytes.to(Device::cpu()));
    chunks.push_back(host.back().data());
    sizes.push_back(r.bytes);
  }
  SafetensorsWrite out;
  out.runs = runs.size();
  out.write_calls = write_file_atomic(path, chunks.data(), sizes.data(), chunks.size());
  return out;
}

}  // namespace keel::io
