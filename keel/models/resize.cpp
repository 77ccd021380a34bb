#include "keel/models/resize.h"

#include <cstring>
#include <vector>

#include "keel/models/gpt2.h"
#include "keel/models/llama.h"

namespace keel::models {

namespace {

// Rewrites `w` [V, D] in place as [new_v, D]: rows kept, added rows = the mean of the old rows
// (accumulated in f64 over rows in order, then rounded once into w's dtype).
void resize_rows(Tensor& w, int64_t new_v) {
  const int64_t V = w.size(0), D = w.size(1);
  if (new_v == V) return;
  Tensor out = Tensor::empty({new_v, D}, w.dtype());
  const int64_t keep = std::min(V, new_v);
  std::memcpy(out.data(), w.data(), static_cast<size_t>(keep * D) * dtype_size(w.dtype()));
  if (new_v > V) {
    const std::vector<float> old = w.to_floats();
    std::vector<double> mean(static_cast<size_t>(D), 0.0);
    for (int64_t r = 0; r < V; ++r)
      for (int64_t d = 0; d < D; ++d) mean[d] += old[static_cast<size_t>(r * D + d)];
    std::vector<float> row(static_cast<size_t>(D));
    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(mean[d] / static_cast<double>(V));
    Tensor mean_row = Tensor::from_floats(row, {1, D}, w.dtype());
    for (int64_t r = V; r < new_v; ++r) out.slice_rows(r, r + 1).copy_from(mean_row);
  }
  TensorImpl* impl = w.impl();
  impl->storage = out.impl()->storage;
  impl->offset = out.impl()->offset;
  impl->shape = out.shape();
  impl->grad = Tensor();
  ++impl->version;
}

}  // namespace

void resize_token_embeddings(CausalLM& model, int64_t new_vocab) {
  if (new_vocab < 1)
    throw Error("resize_token_embeddings: new vocabulary size " + std::to_string(new_vocab) +
                " must be >= 1");
  if (auto* g = dynamic_cast<GPT2LMHeadModel*>(&model)) {
    resize_rows(g->transformer->wte->weight, new_vocab);  // lm_head is tied to wte
  } else if (auto* l = dynamic_cast<LlamaForCausalLM*>(&model)) {
    resize_rows(l->model->embed_tokens->weight, new_vocab);
    if (l->lm_head) {
      resize_rows(l->lm_head->weight, new_vocab);
      l->lm_head->out_features = new_vocab;
    }
  } else {
    throw Error("resize_token_embeddings: unsupported model type " + model.type());
  }
  model.spec_.vocab_size = new_vocab;
}

bool is_vocabulary_parameter(const std::string& name) {
  return name == "transformer.wte.weight" || name == "model.embed_tokens.weight" ||
         name == "lm_head.weight";
}

}  // namespace keel::models
