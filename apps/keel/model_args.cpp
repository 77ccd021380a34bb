#include "apps/keel/model_args.h"

#include <filesystem>

#include "keel/backend/cuda_api.h"
#include "keel/io/hf_config.h"
#include "keel/monitor/memory_estimate.h"
#include "keel/nn/adapters/adapter.h"
#include "keel/nn/module.h"
#include "keel/numerics/input_file.h"
#include "keel/tensor/host_memory.h"

namespace keel::cli {

void add_model_options(CLI::App* sub, ModelArgs& a) {
  sub->add_option("MODEL", a.model,
                  "HF model directory, checkpoint directory (OUT_DIR/checkpoints/last) or OUT_DIR")
      ->required();
  sub->add_option("--adapter", a.adapter, "a PEFT adapter directory to apply to MODEL");
  sub->add_option("--base", a.base,
                  "where the frozen base of an adapter run's checkpoint is now, if it moved");
  sub->add_option("--tokenizer", a.tokenizer,
                  "byte | gpt2:DIR | hf:PATH (default: the run's or MODEL's own)");
  sub->add_option(
      "--precision", a.precision,
      "32-true | bf16-mixed | 16-mixed | bf16-true | 16-true (default: the run's "
      "train.precision for a run's checkpoint or adapter; bf16-true for an HF directory "
      "stored in bf16; else 32-true)");
  sub->add_option("--attention", a.attention, "eager | math | flash")->capture_default_str();
  sub->add_option("--device", a.device, "cpu | cuda")->capture_default_str();
  sub->add_flag("--allow-nonfinite-weights", a.allow_nonfinite_weights,
                "load weights that hold nan/inf (by default an error naming the tensor)");
}

std::string nonfinite_advice(const ModelArgs& a, const PrecisionPolicy& policy) {
  if (const std::string wider = wider_precisions(policy.name()); !wider.empty())
    return "activations beyond " + std::string(dtype_name(policy.compute_dtype)) +
           "'s range are the usual cause under --precision " + policy.name() +
           ": try --precision " + wider;
  if (a.allow_nonfinite_weights)
    return "the weights hold NaN/inf (--allow-nonfinite-weights loaded them): the model is "
           "broken, not its precision; go back to a checkpoint from before they appeared";
  return "under --precision 32-true the weights themselves produce them (values large enough to "
         "overflow f32 in a product): they are not a model to use; keel train's NaN capture and "
         "keel replay find where such weights come from";
}

void hold_weights_checked(const std::string& what, const std::function<size_t()>& attach,
                          const std::function<std::string()>& fix,
                          const std::function<void()>& hold) {
  try {
    const size_t need = attach();
    const int64_t available = monitor::available_memory_bytes();
    if (available >= 0 && need > static_cast<size_t>(available))
      throw Error(what + " needs " + monitor::format_bytes(static_cast<int64_t>(need)) +
                      " more memory to hold its weights, but only " +
                      monitor::format_bytes(available) + " are available (" +
                      monitor::available_memory_source() + "); " + fix(),
                  Error::kUsage);
    hold();
  } catch (const host_memory::OutOfMemory& e) {  // its message names training's keys
    throw Error(what + ": out of memory allocating " +
                monitor::format_bytes(static_cast<int64_t>(e.bytes)) +
                " while loading its weights; " + fix());
  }
}

io::WeightCheck weight_check_of_flag(bool allow) {
  io::WeightCheck c;
  c.allow_nonfinite = allow;
  c.override_hint = "--allow-nonfinite-weights";
  return c;
}

// --tokenizer, else the run's or the model directory's own; an Error (kUsage) saying what the
// directory holds instead when there is none.
std::string tokenizer_spec_of(const ModelArgs& a, const io::TrainedModel& t) {
  if (!a.tokenizer.empty()) return a.tokenizer;
  if (!t.tokenizer.empty()) return t.tokenizer;
  // What the directory does hold: Llama-2's tokenizer.model alone, or half of GPT-2's pair, was
  // met with the same "no tokenizer.json" as nothing at all.
  auto has = [&](const char* f) { return std::filesystem::exists(t.dir + "/" + f); };
  std::string why =
      "no tokenizer.json or vocab.bpe beside it); give --tokenizer byte | gpt2:DIR | hf:PATH";
  if (has("tokenizer.model"))
    why =
        "its tokenizer.model is a SentencePiece model, which keel does not read); save the "
        "tokenizer as tokenizer.json beside it (a transformers fast tokenizer's save_pretrained "
        "writes one) or give --tokenizer hf:PATH";
  else if (has("vocab.json") || has("encoder.json"))
    why = std::string("it holds ") + (has("vocab.json") ? "vocab.json" : "encoder.json") +
          " but not the BPE merges that go with it); add merges.txt (or vocab.bpe) beside it, or "
          "give --tokenizer byte | gpt2:DIR | hf:PATH";
  throw Error(a.model + " names no tokenizer (" + why, Error::kUsage);
}

namespace {

// Whether MODEL is a Hugging Face directory (not a keel checkpoint) whose config.json says its
// weights are bf16. A directory that cannot be read is left to the loader's errors.
bool hf_directory_in_bf16(const std::string& model) {
  if (!path_exists(model + "/config.json") || io::is_keel_checkpoint(model)) return false;
  try {
    return io::read_hf_config(model).dtype == DType::BF16;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace

ModelForUse load_model_for_use(const ModelArgs& args) {
  ModelForUse m;
  // A run's model computes as it trained unless asked otherwise: `keel eval OUT` under 32-true
  // gave the seed's bf16-mixed run 11.889515 against its eval_loss 11.888892, and generate's
  // greedy tokens parted from the run's own at the 8th.
  ModelArgs a = args;
  // An HF directory stored in bf16 computes in bf16 from its files as they are (bf16-true), as
  // transformers' dtype="auto" loads it. Under 32-true by default an 8B model was held in f32,
  // 32 GB, and refused on the 24 GB machine its adapter trained on. Its loss is the step-0 loss of
  // a bf16-mixed fine-tune with model.base_dtype = bf16 (whose frozen base computes in bf16, as
  // PEFT's does): before and after compare under one rounding.
  // Read once: eval compares it with the precision it runs under.
  m.run_precision = io::run_precision(a.model, a.adapter, &m.run_precision_recorded_in);
  if (a.precision.empty()) {
    a.precision = m.run_precision;
    if (!a.precision.empty()) {
      // A copied adapter's run is not at hand: its record is what said so.
      const std::string from =
          m.run_precision_recorded_in.empty()
              ? "the run's train.precision"
              : "the train.precision recorded in " + m.run_precision_recorded_in;
      std::fprintf(stderr, "note: --precision %s, %s\n", a.precision.c_str(), from.c_str());
    } else if (hf_directory_in_bf16(a.model)) {
      a.precision = "bf16-true";
      std::fprintf(stderr,
                   "note: --precision bf16-true, %s's weights as stored (config.json torch_dtype "
                   "bfloat16); --precision 32-true computes in f32\n",
                   a.model.c_str());
    } else {
      a.precision = "32-true";
    }
  }
  m.device = device_from_string(a.device);
  if (m.device.is_cuda() && !cuda::status().usable)
    throw Error("--device " + a.device + ": no usable CUDA device (" + cuda::status().reason +
                    "); use --device cpu",
                Error::kUsage);
  m.policy = resolve_precision(a.precision, m.device, /*allow_cpu_bf16=*/true);
  // A base the run held in bf16 under f32 parameters computes its products in bf16 (PEFT's way):
  // held so here (hold_base), eval and generate run the model that trained (its eval_loss, bit
  // for bit), in the memory it trained in.
  const std::string what = a.model + " under --precision " + a.precision;
  hold_weights_checked(
      what,
      [&] {
        m.trained = io::attach_trained_model(
            a.model, a.adapter, m.policy.param_dtype, ops::attention_backend_from_name(a.attention),
            weight_check_of_flag(a.allow_nonfinite_weights), a.base);
        // Before the weights are held: a model with no tokenizer was converted whole first (4.9 GB
        // and seconds for a 1B bf16 base under 32-true, minutes for an 8B) to be refused.
        m.tokenizer_spec = tokenizer_spec_of(a, m.trained);
        return io::bytes_to_hold(m.trained, m.policy.param_dtype, /*hold_base=*/true);
      },
      [&]() -> std::string {
        if (m.policy.param_dtype != DType::F32) return "use a machine with more memory";
        const size_t bf16 = io::bytes_to_hold(m.trained, DType::BF16, /*hold_base=*/true);
        if (bf16 == 0)
          return "--precision bf16-true uses its bf16 weights from the files as they are, without "
                 "a copy";
        return "--precision bf16-true holds them in bf16 (" +
               monitor::format_bytes(static_cast<int64_t>(bf16)) + ")";
      },
      [&] { io::hold_parameters(m.trained, m.policy.param_dtype, /*hold_base=*/true); });
  // Where the spec came from, for its errors: a tokenizer file the adapter's run trained with
  // and then lost was called "MODEL's tokenizer", as if the base directory lacked one.
  const std::string source =
      !a.tokenizer.empty() ? "--tokenizer"
      : m.trained.tokenizer_of_adapter_run
          ? "the data.tokenizer of the --adapter's run " + m.trained.adapter_run
      : !m.trained.tokenizer_recorded_in.empty()
          ? "the data.tokenizer recorded in " + m.trained.tokenizer_recorded_in
      : m.trained.checkpoint ? "the data.tokenizer of the run that wrote " + a.model
                             : a.model + "'s tokenizer";
  try {
    m.tokenizer = data::load_tokenizer(m.tokenizer_spec, source);
  } catch (const Error& e) {
    if (!a.tokenizer.empty()) throw;
    throw Error(std::string(e.what()) + "; or give --tokenizer to use another", e.kind);
  }
  const int64_t vocab = m.trained.model->spec().vocab_size;
  if (m.tokenizer->vocab_size() > vocab)
    throw Error("the tokenizer (" + m.tokenizer_spec + ") has " +
                    std::to_string(m.tokenizer->vocab_size()) + " ids but " + a.model +
                    " has a vocabulary of " + std::to_string(vocab) +
                    "; give the model's own --tokenizer",
                Error::kUsage);
  if (m.device.is_cuda()) nn::move_to_device(*m.trained.model, m.device);
  return m;
}

}  // namespace keel::cli
