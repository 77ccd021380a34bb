#include "keel/monitor/tracer.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <unordered_map>

#include "keel/autograd/node.h"
#include "keel/backend/monitor.h"
#include "keel/nn/adapters/adapter.h"
#include "keel/numerics/format_info.h"

namespace keel::monitor {

namespace {

// HF's frame layout: 17 spaces before a frame's "path Type" header, "%8.2e %8.2e ctx" per line.
constexpr const char* kPrefix = "                 ";
constexpr int kLabelWidth = 16;  // metadata column, padded so that keel's extra columns line up

std::string column_header() {
  char buf[128];
  std::snprintf(buf, sizeof buf, "%-8s %-8s %-*s %7s %8s %8s", "abs min", "abs max", kLabelWidth,
                "metadata", "zeros%", "subnorm%", "nearmax%");
  return buf;
}

// One line of a frame: a tensor's statistics, or a placeholder (undefined, integer, not on CPU).
struct Entry {
  enum Kind { kFloat, kInt, kNone };
  Kind kind = kNone;
  std::string label;
  TensorStats s;               // kFloat
  int64_t imin = 0, imax = 0;  // kInt: abs min / abs max of the integers
  DType dtype = DType::F32;

  bool finite() const { return kind != kFloat || s.all_finite(); }
};

// `part` of `whole` as a percentage with two decimals, never rounded to a claim the counts deny:
// 3 subnormals of a 2.4M-element weight printed "0.00" (none), 1 zero short of all "100.00".
std::string percent(int64_t part, int64_t whole) {
  if (part > 0 && 20000 * part < whole) return "<0.01";  // below 0.005%
  if (part < whole && 20000 * (whole - part) < whole) return ">99.99";
  char buf[16];
  std::snprintf(buf, sizeof buf, "%.2f", whole > 0 ? 100.0 * part / whole : 0.0);
  return buf;
}

std::string format_entry(const Entry& e) {
  char buf[256];
  switch (e.kind) {
    case Entry::kNone:
      std::snprintf(buf, sizeof buf, "%17s %s", "None", e.label.c_str());
      return buf;
    case Entry::kInt:
      std::snprintf(buf, sizeof buf, "%8.2e %8.2e %s", static_cast<double>(e.imin),
                    static_cast<double>(e.imax), e.label.c_str());
      return buf;
    case Entry::kFloat:
      break;
  }
  const TensorStats& s = e.s;
  // As torch's abs().min()/max() would print: NaN wins, then inf; stats hold the finite range.
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t finite = s.count - s.nan - s.inf;
  double amin = s.abs_min, amax = s.abs_max;
  if (s.nan > 0) {
    amin = amax = std::numeric_limits<double>::quiet_NaN();
  } else if (s.inf > 0) {
    amax = inf;
    if (finite == 0) amin = inf;
  }
  std::snprintf(buf, sizeof buf, "%8.2e %8.2e %-*s %7s %8s %8s", amin, amax, kLabelWidth,
                e.label.c_str(), percent(s.zero, s.count).c_str(),
                percent(s.subnormal, s.count).c_str(), percent(s.near_max, s.count).c_str());
  return buf;
}

struct Frame {
  const nn::Module* module = nullptr;  // null: a node created outside the traced model
  const std::string* scope = nullptr;  // path when module is null
  const char* node = nullptr;          // backward frames: the node's name
  int64_t batch_start = -1;            // first frame of a batch: HF's "Starting batch" lines
  std::vector<Entry> entries;
};

std::string frame_path(const Frame& f) {
  if (f.module) return f.module->path();
  return f.scope ? *f.scope : std::string();
}
std::string frame_type(const Frame& f) {
  return f.module ? f.module->type() : std::string("(outside the model)");
}
// The finding's type. A Linear with an unmerged adapter runs the adapter's forward too (DoRA's
// weight norm, LoRA's product), and an adapter's own lora_A/lora_B are Linears as well: plain
// "Linear" (the log keeps PEFT's class names) hid that the adapter may be what produced the value.
std::string finding_type(const Frame& f, nn::Module& root) {
  const std::string type = frame_type(f);
  if (!f.module) return type;
  auto adapter_name = [](const nn::Linear* lin) -> std::string {
    if (!lin || !lin->adapter || lin->adapter->merged) return "";
    const std::string kind = lin->adapter->kind();
    return kind == "lora" ? "LoRA" : kind == "dora" ? "DoRA" : kind == "lokr" ? "LoKr" : kind;
  };
  if (const std::string a = adapter_name(dynamic_cast<const nn::Linear*>(f.module)); !a.empty())
    return a + "-adapted " + type;
  const std::string& path = f.module->path();
  const size_t dot = path.rfind('.');
  if (dot == std::string::npos) return type;
  for (nn::Module* m : root.modules())
    if (m->path() == path.substr(0, dot)) {
      const std::string a = adapter_name(dynamic_cast<const nn::Linear*>(m));
      return a.empty() ? type : a + " adapter's " + type;  // the path names its layer
    }
  return type;
}

// `batch_header`: HF's "Starting batch" lines before the first frame of a batch (a traced batch
// writes them once, at begin_batch).
std::string format_frame(const Frame& f, bool batch_header = true) {
  std::string out;
  if (batch_header && f.batch_start >= 0) {
    out += "\n\n" + std::string(kPrefix) +
           " *** Starting batch number=" + std::to_string(f.batch_start) + " ***\n" +
           column_header() + "\n";
  }
  out += std::string(kPrefix) + " " + frame_path(f) + " " + frame_type(f);
  if (f.node) out += std::string(" (backward: ") + f.node + ")";
  for (const Entry& e : f.entries) out += "\n" + format_entry(e);
  return out;
}

std::string short_num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string describe(const Entry& e) {
  const TensorStats& s = e.s;
  std::string d;
  if (s.nan) d += std::to_string(s.nan) + " nan";
  if (s.inf) d += std::string(d.empty() ? "" : ", ") + std::to_string(s.inf) + " inf";
  d += " of " + std::to_string(s.count);
  return d;
}

}  // namespace

struct UnderflowOverflowTracer::Impl {
  nn::Module& root;
  TracerOptions opt;
  std::string log_path;
  bool stop_on_finding = true;
  TracerFinding finding;
  int64_t batch = 0;
  bool batch_header_pending = false;
  bool tracing = false;  // this batch is in trace_batch_nums
  std::FILE* log = nullptr;

  // Hooks to remove on destruction.
  std::vector<std::pair<nn::Module*, int>> module_hooks;
  int node_hook = 0;

  // Lookups built once: the module of a node's scope, the owner of a parameter.
  std::unordered_map<const std::string*, const nn::Module*> module_of_scope;
  struct ParamOwner {
    const nn::Module* module;
    const std::string* name;
  };
  std::unordered_map<const TensorImpl*, ParamOwner> param_owner;

  // Ring buffer of frames (slots are reused so their vectors keep their capacity).
  std::vector<Frame> ring;
  size_t head = 0, count = 0;

  // Modules whose forward is running, innermost last, with the stats of their inputs.
  struct Active {
    nn::Module* module;
    std::vector<Entry> inputs;
  };
  std::vector<Active> stack;
  size_t depth = 0;

  // Stats per tensor for the current batch: an output that is the next module's input, a grad
  // that is both one node's grad_input and the next node's grad_output, are measured once.
  struct Cached {
    std::weak_ptr<TensorImpl> owner;
    uint64_t version;
    TensorStats s;
  };
  std::unordered_map<const TensorImpl*, Cached> cache;

  Impl(nn::Module& r, TracerOptions o, std::string path)
      : root(r), opt(std::move(o)), log_path(std::move(path)) {
    if (opt.max_frames_to_save < 1)
      throw Error("debug.underflow_overflow.max_frames_to_save = " +
                      std::to_string(opt.max_frames_to_save) + ": keep at least 1 frame",
                  Error::kUsage);
    ring.resize(static_cast<size_t>(opt.max_frames_to_save));
    for (nn::Module* m : root.modules()) {
      module_of_scope[&m->path()] = m;
      for (auto& [name, p] : m->local_parameters()) param_owner[p.impl()] = {m, &name};
    }
  }

  ~Impl() {
    if (log) std::fclose(log);
  }

  bool done() const { return finding.found; }

  DType judge_format(DType dt) const { return dt == DType::F32 ? opt.format : dt; }

  // The backend's statistics pass where the tensor lives (CPU: one vectorized pass over the bit
  // patterns; CUDA: on the device, a few numbers come back).
  TensorStats compute(const Tensor& t) const {
    return monitor_kernels(t.device())
        .stats(t.data(), t.dtype(), t.numel(), judge_format(t.dtype()));
  }

  void measure(Entry& e, const Tensor& t, bool cacheable) {
    e.dtype = t.defined() ? t.dtype() : DType::F32;
    if (!t.defined()) {
      e.kind = Entry::kNone;
      return;
    }
    if (!dtype_is_floating(t.dtype())) {
      // Token ids and masks: small, and read where they are (one copy for a device tensor).
      e.kind = Entry::kInt;
      int_range(e, t.device().is_cpu() ? t : t.to(Device::cpu()));
      return;
    }
    e.kind = Entry::kFloat;
    if (!cacheable) {
      e.s = compute(t);
      return;
    }
    const TensorImpl* key = t.impl();
    auto it = cache.find(key);
    if (it != cache.end() && !it->second.owner.expired() && it->second.version == t.version()) {
      e.s = it->second.s;
      return;
    }
    e.s = compute(t);
    if (cache.size() > 65536) cache.clear();  // a pathological batch: keep memory bounded
    cache[key] = Cached{t.impl_ptr(), t.version(), e.s};
  }

  static void int_range(Entry& e, const Tensor& t) {
    const int64_t n = t.numel();
    int64_t lo = 0, hi = 0;
    auto scan = [&](auto* p) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t v = static_cast<int64_t>(p[i]);
        const int64_t a = v < 0 ? -v : v;
        if (i == 0 || a < lo) lo = a;
        if (i == 0 || a > hi) hi = a;
      }
    };
    switch (t.dtype()) {
      case DType::I32:
        scan(t.data_as<int32_t>());
        break;
      case DType::I64:
        scan(t.data_as<int64_t>());
        break;
      case DType::U8:
        scan(t.data_as<uint8_t>());
        break;
      default:
        break;
    }
    e.imin = lo;
    e.imax = hi;
  }

  Frame& new_frame() {
    Frame& f = ring[head];
    head = (head + 1) % ring.size();
    count = std::min(count + 1, ring.size());
    f.module = nullptr;
    f.scope = nullptr;
    f.node = nullptr;
    f.entries.clear();
    f.batch_start = -1;
    if (batch_header_pending) {
      f.batch_start = batch;
      batch_header_pending = false;
    }
    return f;
  }

  // A frame is complete: in a traced batch it goes to the log at once.
  void commit(const Frame& f) {
    if (tracing) write(format_frame(f, /*batch_header=*/false) + "\n");
  }

  std::vector<const Frame*> saved() const {
    std::vector<const Frame*> out;
    const size_t cap = ring.size();
    for (size_t i = 0; i < count; ++i) out.push_back(&ring[(head + cap - count + i) % cap]);
    return out;
  }

  void open_log() {
    if (log) return;
    std::error_code ec;
    const std::filesystem::path p(log_path);
    if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
    log = std::fopen(log_path.c_str(), "a");
    if (!log)
      throw Error("underflow/overflow tracer: cannot open " + log_path +
                  " for appending: " + write_failure(errno));
  }

  void write(const std::string& text) {
    open_log();
    if (std::fwrite(text.data(), 1, text.size(), log) != text.size())
      throw Error("underflow/overflow tracer: cannot write " + log_path + ": " +
                  write_failure(errno));
  }

  void flush() {
    if (log) std::fflush(log);
  }

  // Records the finding, writes the last frames to the log (HF's dump, then keel's verdict) and
  // stops when asked to.
  void report(const Frame& f, const std::string& phase, const std::string& tensor,
              const std::string& why) {
    finding.found = true;
    finding.module = frame_path(f);
    finding.module_type = f.module ? finding_type(f, root) : std::string();
    finding.phase = phase;
    finding.tensor = tensor;
    finding.batch = batch;
    finding.log_path = log_path;
    const std::string who =
        f.module || f.scope
            ? "'" + finding.module + "' (" + finding_type(f, root) + ")"
            : std::string("code outside any module (the loss or the training loop)");
    finding.message = "underflow/overflow tracer: the first non-finite value was produced by " +
                      who + " in " + phase + ", " + tensor + " (" + why + ") at batch " +
                      std::to_string(batch) + "; the last frames are in " + log_path;

    std::string text;
    for (const Entry& e : f.entries) {
      if (e.kind != Entry::kFloat) continue;
      if (e.s.nan) text += e.label + " has nans\n";
      if (e.s.inf) text += e.label + " has infs\n";
    }
    auto frames = saved();
    bool any_backward = false;
    for (const Frame* fr : frames) any_backward |= fr->node != nullptr;
    text += "\nDetected inf/nan during batch_number=" + std::to_string(batch) + "\n";
    text += "Last " + std::to_string(frames.size()) +
            (any_backward ? " forward and backward frames:\n" : " forward frames:\n");
    text += column_header() + "\n";
    for (const Frame* fr : frames) text += format_frame(*fr) + "\n";
    const FormatInfo& fi = format_info(opt.format);
    text += "\nkeel: the first non-finite value was produced by " + who + " in " + phase +
            ", tensor " + tensor + ": " + why + ".\n";
    text +=
        "keel: zeros%, subnorm% and nearmax% are shares of the elements; subnormal and near-max "
        "(within 2x of the max) are judged against " +
        std::string(dtype_name(opt.format)) + " (max " + short_num(fi.max) + ", min normal " +
        short_num(fi.min_normal) +
        ") for f32 tensors and against their own format otherwise.\n\n\n";
    write(text);
    flush();
    if (stop_on_finding) throw TracerStop(finding);
  }

  // ---- forward ----------------------------------------------------------------------------

  void weights_into(Frame& f, const nn::Module& m) {
    for (auto& [name, p] : m.local_parameters()) {
      f.entries.emplace_back();
      f.entries.back().label = name;
      measure(f.entries.back(), p, true);
    }
  }

  void pre(nn::Module& m, const std::vector<Tensor>& inputs) {
    // A checkpointed segment's recompute repeats a forward already traced: not a new call.
    if (done() || nn::Module::recomputing()) return;
    if (stack.size() <= depth) stack.resize(depth + 1);
    Active& a = stack[depth];
    const Active* parent = depth > 0 ? &stack[depth - 1] : nullptr;
    ++depth;
    a.module = &m;
    a.inputs.resize(inputs.size());
    bool inputs_finite = true;
    size_t bad = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      a.inputs[i].label = inputs.size() == 1 ? "input[0]" : "input[" + std::to_string(i) + "]";
      measure(a.inputs[i], inputs[i], true);
      if (inputs_finite && !a.inputs[i].finite()) {
        inputs_finite = false;
        bad = i;
      }
    }
    // A non-finite local weight: it was there before this call (the previous update, a
    // checkpoint, an initialization); this module holds it.
    for (auto& [name, p] : m.local_parameters()) {
      Entry e;
      measure(e, p, true);
      if (!e.finite()) {
        Frame& f = new_frame();
        f.module = &m;
        weights_into(f, m);
        f.entries.insert(f.entries.end(), a.inputs.begin(), a.inputs.end());
        commit(f);
        report(f, "forward", name, "the weight itself holds " + describe(e) + " before the call");
        return;
      }
    }
    if (inputs_finite) return;
    // Nothing hooked produced this input (a child's output would have been caught by its post
    // hook): the module still running above made it in its own code, or it came in from outside.
    Frame& f = new_frame();
    f.module = &m;
    weights_into(f, m);
    f.entries.insert(f.entries.end(), a.inputs.begin(), a.inputs.end());
    commit(f);
    const std::string label = a.inputs[bad].label;
    if (parent) {
      // Report the parent as the producer; the frame shows the child's non-finite input.
      Frame pf = f;  // same lines, attributed to the parent
      pf.module = parent->module;
      pf.batch_start = -1;
      report(pf, "forward", label + " of " + (m.path().empty() ? m.type() : m.path()),
             "made in its own code between its children, from finite inputs; " +
                 describe(a.inputs[bad]));
    } else {
      report(f, "forward", label,
             "the value came in from outside the model through its " + label + ", " +
                 describe(a.inputs[bad]) + ": check the input data");
    }
  }

  void post(nn::Module& m, const std::vector<Tensor>&, Tensor& out) {
    if (done() || nn::Module::recomputing()) return;
    // Find this module's entry (an exception may have left deeper entries behind).
    size_t d = depth;
    while (d > 0 && stack[d - 1].module != &m) --d;
    if (d == 0) return;  // its pre hook ran before the tracer was attached
    depth = d - 1;
    Active& a = stack[depth];
    Frame& f = new_frame();
    f.module = &m;
    weights_into(f, m);
    f.entries.insert(f.entries.end(), a.inputs.begin(), a.inputs.end());
    f.entries.emplace_back();
    Entry& o = f.entries.back();
    o.label = "output";
    measure(o, out, true);
    commit(f);
    if (!o.finite()) {
      const Entry copy = o;
      const std::string beyond = beyond_format(f);
      report(f, "forward", "output",
             beyond.empty() ? "its inputs and weights are finite, its output has " + describe(copy)
                            : "its inputs and weights are finite as stored, but " + beyond +
                                  "; its output has " + describe(copy) +
                                  " (fix that tensor, or train in bf16-mixed, whose range is "
                                  "f32's)");
    }
  }

  // A finite f32 weight or input beyond the compute format's range (a weight of 1e5 under
  // 16-mixed): finite as stored, but the op computes on it rounded to that format, where it is
  // inf. The frame's nearmax% column counted it as near the max; the finding said "its inputs and
  // weights are finite" and nothing more.
  std::string beyond_format(const Frame& f) const {
    if (opt.format == DType::F32) return "";
    const FormatInfo& fi = format_info(opt.format);
    const Entry* worst = nullptr;
    for (const Entry& e : f.entries)
      if (e.kind == Entry::kFloat && e.dtype == DType::F32 && e.label != "output" &&
          e.s.abs_max > fi.max && (!worst || e.s.abs_max > worst->s.abs_max))
        worst = &e;
    if (!worst) return "";
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3g", worst->s.abs_max);
    const std::string fmt = dtype_name(opt.format);
    const std::string name = worst->label.rfind("input", 0) == 0 || frame_path(f).empty()
                                 ? worst->label
                                 : worst->label + " " + frame_path(f) + "." + worst->label;
    return "its " + name + " holds |values| up to " + buf + ", beyond " + fmt + "'s max " +
           short_num(fi.max) + ": rounded to " + fmt + " for the computation they are inf";
  }

  // ---- backward ---------------------------------------------------------------------------

  void node_post(const Node& n, const Tensor& gout, const std::vector<Tensor>& gins) {
    if (done()) return;
    if (const auto* acc = dynamic_cast<const AccumulateGrad*>(&n)) {
      accumulated(*acc, gout);
      return;
    }
    Frame& f = new_frame();
    f.node = n.name();
    f.scope = n.scope;
    if (n.scope) {
      auto it = module_of_scope.find(n.scope);
      if (it != module_of_scope.end()) f.module = it->second;
    }
    f.entries.emplace_back();
    f.entries.back().label = "grad_output";
    measure(f.entries.back(), gout, true);
    const bool out_finite = f.entries.back().finite();
    size_t bad = SIZE_MAX;
    for (size_t i = 0; i < gins.size(); ++i) {
      f.entries.emplace_back();
      Entry& e = f.entries.back();
      e.label = "grad_input[" + std::to_string(i) + "]";
      measure(e, gins[i], true);
      if (bad == SIZE_MAX && !e.finite()) bad = i;
    }
    commit(f);
    if (opt.scaler_handles_backward) return;
    const std::string node = n.name();
    if (!out_finite) {
      report(f, "backward", "grad_output",
             "the gradient reaching its '" + node +
                 "' node was summed from finite contributions "
                 "and overflowed: " +
                 describe(f.entries.front()));
    } else if (bad != SIZE_MAX) {
      const Entry& e = f.entries[bad + 1];
      report(f, "backward", e.label,
             "its '" + node + "' backward turned a finite grad_output into " + describe(e));
    }
  }

  void accumulated(const AccumulateGrad& acc, const Tensor& contribution) {
    auto impl = acc.leaf.lock();
    if (!impl || !impl->grad.defined()) return;
    Frame& f = new_frame();
    f.node = acc.name();
    std::string pname = impl->name;
    auto it = param_owner.find(impl.get());
    if (it != param_owner.end()) {
      f.module = it->second.module;
      pname = *it->second.name;
    }
    f.entries.emplace_back();
    f.entries.back().label = "grad_output";
    measure(f.entries.back(), contribution, true);
    const bool in_finite = f.entries.back().finite();
    f.entries.emplace_back();
    Entry& g = f.entries.back();
    g.label = pname + ".grad";
    measure(g, impl->grad, /*cacheable=*/false);  // accumulated in place: never cached
    commit(f);
    if (opt.scaler_handles_backward || !in_finite || g.finite()) return;
    const Entry copy = g;
    report(f, "backward", copy.label,
           "finite per-micro-batch gradients overflowed when accumulated into the parameter's "
           ".grad: " +
               describe(copy));
  }
};

UnderflowOverflowTracer::UnderflowOverflowTracer(nn::Module& root, TracerOptions opt,
                                                 std::string log_path)
    : impl_(std::make_unique<Impl>(root, std::move(opt), std::move(log_path))) {
  Impl* im = impl_.get();
  try {
    for (nn::Module* m : root.modules()) {
      im->module_hooks.emplace_back(
          m, m->add_forward_pre_hook(
                 [im](nn::Module& mod, const std::vector<Tensor>& in) { im->pre(mod, in); }));
      im->module_hooks.emplace_back(
          m, m->add_forward_post_hook([im](nn::Module& mod, const std::vector<Tensor>& in,
                                           Tensor& out) { im->post(mod, in, out); }));
    }
    im->node_hook =
        add_node_post_hook([im](const Node& n, const Tensor& gout,
                                const std::vector<Tensor>& gins) { im->node_post(n, gout, gins); });
  } catch (...) {
    for (auto& [m, h] : im->module_hooks) m->remove_hook(h);
    throw;
  }
}

UnderflowOverflowTracer::~UnderflowOverflowTracer() {
  for (auto& [m, h] : impl_->module_hooks) m->remove_hook(h);
  if (impl_->node_hook) remove_node_post_hook(impl_->node_hook);
  impl_->flush();
}

void UnderflowOverflowTracer::begin_batch(int64_t batch_num) {
  Impl& im = *impl_;
  im.flush();
  im.batch = batch_num;
  im.depth = 0;
  im.cache.clear();
  im.batch_header_pending = true;
  if (im.opt.abort_after_batch_num >= 0 && batch_num > im.opt.abort_after_batch_num) {
    TracerFinding f;
    f.batch = batch_num;
    f.log_path = im.log_path;
    f.message = "underflow/overflow tracer: stopping after batch " +
                std::to_string(im.opt.abort_after_batch_num) +
                " as debug.underflow_overflow.abort_after_batch_num asks" +
                (im.finding.found ? "" : " (no non-finite value was found)");
    if (im.log) {
      im.write("\n" + f.message + "\n");
      im.flush();
    }
    throw TracerStop(f);
  }
  const auto& t = im.opt.trace_batch_nums;
  im.tracing = std::find(t.begin(), t.end(), batch_num) != t.end();
  if (im.tracing) {
    im.write("\n\n" + std::string(kPrefix) + " *** Starting batch number=" +
             std::to_string(batch_num) + " (traced) ***\n" + column_header() + "\n");
  }
}

const TracerFinding& UnderflowOverflowTracer::finding() const { return impl_->finding; }
void UnderflowOverflowTracer::set_stop_on_finding(bool stop) { impl_->stop_on_finding = stop; }
int64_t UnderflowOverflowTracer::batch() const { return impl_->batch; }
const std::string& UnderflowOverflowTracer::log_path() const { return impl_->log_path; }

std::vector<std::string> UnderflowOverflowTracer::frames() const {
  std::vector<std::string> out;
  for (const Frame* f : impl_->saved()) out.push_back(format_frame(*f));
  return out;
}

}  // namespace keel::monitor
