#!/usr/bin/python3
"""keel vs PyTorch, side by side: the same GPT-2 / Llama configurations trained from the same initial
weights on the same token batches for the same steps, each side in its own process.

    /usr/bin/python3 bench/compare_pytorch/compare.py [--build build-perf] [--only NAME,...]
        [--steps 6] [--warmup 2] [--rounds 2] [--threads 2] [--scaling 1,2]
        [--wait-policy passive] [--work /tmp/keel-compare] [--torch-openblas-core Cooperlake]

Per configuration and precision it prints tokens/s of each side (median step time over the steps
after warm-up, medians over rounds) with the spread of the step times, their ratio, peak RSS of
each, the loss of both at every step (in 32-true they must agree within LOSS_RTOL, which shows the
same work is timed) and keel's model-FLOPs utilization against the matmul peak measured in keel's
process. Then thread scaling of GPT-2 124M B=4 T=64.

LoRA configurations (`adapter` in CONFIGS: the seed's recipe, r=32, alpha 64 on q, k, v, up, down)
train a Llama-3.2-1B-shaped checkpoint written by bench/write_random_hf.py: a frozen base (bf16
under bf16-mixed, f32 under 32-true) and f32 adapters on both sides. Debian has no peft, so the
PyTorch side's LoRA is written here as PEFT's tuners/lora/layer.py Linear computes it, and it loads
the adapter keel initialized (the PEFT directory compare_keel writes), so both start from the same
lora_A. The header names the OpenBLAS core PyTorch's
fp32 products run on, and warns when its kernels are narrower than the CPU's (SSE3 or AVX2 on an
AVX-512 CPU: a handicapped peer). Debian's torch 1.13 only works with /usr/bin/python3.

`--worker torch ...` is the PyTorch side (run by the driver in a child process).
"""
import argparse
import json
import math
import os
import resource
import statistics
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import write_random_hf  # noqa: E402  (bench/: the random HF checkpoints of the LoRA configurations)

# Relative agreement of the per-step 32-true losses (keel vs torch). Both sides accumulate f32 sums
# in different orders (oneDNN vs MKL-DNN blocking, softmax/cross-entropy reductions), and AdamW
# with lr 1e-4 turns those ulp-level gradient differences into weight differences of ~1e-7 per step,
# so the loss drifts apart by ~1e-6 relative per step at most; 1e-4 leaves room and still catches a
# real mismatch (a wrong eps, GELU variant, missing weight decay or tied head moves the loss by
# >1e-3 within two steps).
LOSS_RTOL = 1e-4

CONFIGS = {
    # name: family, layers, width, heads, vocab, batch, seq
    "gpt2-124m-b4t64": dict(family="gpt2", n_layer=12, n_embd=768, n_head=12, vocab=50257, B=4, T=64),
    "gpt2-124m-b8t256": dict(family="gpt2", n_layer=12, n_embd=768, n_head=12, vocab=50257, B=8, T=256),
    "gpt2-4l256-b8t256": dict(family="gpt2", n_layer=4, n_embd=256, n_head=8, vocab=50257, B=8, T=256),
    # Llama-style of GPT-2 124M's size: RMSNorm, RoPE, SwiGLU (intermediate 2048), untied head,
    # 32k vocabulary (Llama-2's).
    "llama-134m-b4t64": dict(family="llama", n_layer=12, n_embd=768, n_head=12, vocab=32000, ffn=2048,
                             B=4, T=64),
}

# The seed's adapter recipe (issue 25): LoRA r=32, alpha 64, dropout 0.05 on q, k, v, up, down.
SEED_LORA = dict(kind="lora", r=32, alpha=64.0, dropout=0.05,
                 targets=["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"])


def from_shape(shape, B, T, **extra):
    """A configuration whose checkpoint is write_random_hf.py's `shape` (its sizes from there)."""
    h = write_random_hf.SHAPES[shape]
    return dict(family="llama", shape=shape, n_layer=h["num_hidden_layers"],
                n_embd=h["hidden_size"], n_head=h["num_attention_heads"],
                n_kv_head=h["num_key_value_heads"], vocab=h["vocab_size"],
                ffn=h["intermediate_size"], B=B, T=T, **extra)


# Llama-3.2-1B shapes (16 layers, 2048 wide, 32/8 heads, MLP 8192, vocab 128,256, tied, llama3 rope
# scaling), the seed's micro-batch: a bf16 frozen base under bf16-mixed.
CONFIGS["llama-1b-lora-b2t512"] = from_shape("1b", 2, 512, adapter=SEED_LORA,
                                             precisions=["bf16-mixed"])
# A Mixtral-style mixture of experts (Llama's layers; 8 experts 1024 wide a layer, 2 a token; HF's
# MixtralSparseMoeBlock on the torch side): a LoRA on q, v and every expert's w1, w3, w2 (PEFT's
# names) over a bf16 frozen base. Not in the default list: --only mixtral-4l512-lora-b4t128.
MOE = {"mixtral-4l512-lora-b4t128": dict(
    family="mixtral", n_layer=4, n_embd=512, n_head=8, n_kv_head=2, vocab=32000, ffn=1024,
    experts=8, top_k=2, B=4, T=128, precisions=["bf16-mixed", "32-true"],
    adapter=dict(kind="lora", r=16, alpha=32.0, dropout=0.0,
                 targets=["q_proj", "v_proj", "w1", "w3", "w2"]))}
# Pythia-160M's shape (GPT-NeoX: the attention and a gelu MLP side by side, LayerNorms with
# biases, query_key_value fused head by head, RoPE on a quarter of each head, untied embed_out).
# Not in the default list: --only pythia-160m-b4t128.
NEOX = {"pythia-160m-b4t128": dict(family="gpt_neox", n_layer=12, n_embd=768, n_head=12,
                                   vocab=50304, ffn=3072, B=4, T=128),
        # Falcon-7B's layout at Pythia-160M's size (Falcon: multi_query, one key/value head cut
        # from the end of query_key_value; the attention and an exact-gelu MLP side by side on one
        # LayerNorm; no biases; the head tied to its 65,024-token embedding).
        # Not in the default list either: --only falcon-mq-12l768-b4t128.
        "falcon-mq-12l768-b4t128": dict(family="falcon", n_layer=12, n_embd=768, n_head=12,
                                        n_kv_head=1, vocab=65024, ffn=3072, B=4, T=128)}
# A seconds-long run of the whole script (not in the default list): --only smoke --scaling 1,2.
# lora-tiny: the LoRA path at write_random_hf's tiny shape (GQA, llama3 scaling, untied head); no
# adapter dropout, so that the 32-true losses of every step must agree (dropout masks differ).
SMOKE = {"smoke": dict(family="gpt2", n_layer=2, n_embd=64, n_head=4, vocab=512, B=2, T=16),
         "lora-tiny": from_shape("tiny", 2, 64, adapter=dict(SEED_LORA, r=8, dropout=0.0))}
# The seed's run at its real size, for a GPU (issue 26 item 3; --device cuda): Llama-3.1-8B's
# shapes, the seed's LoRA and micro-batch over a bf16 frozen base. Not in the default list:
# --device cuda --only llama-8b-lora-b2t512 (llama-1b-lora-b2t512 is its quick variant).
GPU = {"llama-8b-lora-b2t512": from_shape("8b", 2, 512, adapter=SEED_LORA,
                                          precisions=["bf16-mixed"])}


# ---------------------------------------------------------------------------------------------
# PyTorch side
# ---------------------------------------------------------------------------------------------
def safetensors_files(model_dir):
    """model.safetensors, or the shards model.safetensors.index.json names."""
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(model_dir, s) for s in shards]


def load_safetensors_into(params, files, rename=lambda k: k):
    """Copies every tensor of `files` into params[rename(name)] (converting the dtype), one tensor
    in memory at a time: the side's peak RSS is its model, not a file's copy of it. A name that
    renames to None is skipped. Returns the parameter names that got no tensor."""
    import torch
    dt = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    unexpected, seen = [], set()
    for path in files:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            for name, info in header.items():
                key = None if name == "__metadata__" else rename(name)
                if key is None:
                    continue
                if key not in params:
                    unexpected.append(name)
                    continue
                a, b = info["data_offsets"]
                f.seek(8 + n + a)
                t = torch.frombuffer(bytearray(f.read(b - a)), dtype=dt[info["dtype"]])
                with torch.no_grad():
                    params[key].copy_(t.reshape(info["shape"]))
                seen.add(key)
    if unexpected:
        raise SystemExit(f"{files[0]}: unexpected tensors {unexpected[:5]}")
    return sorted(set(params) - seen)


def llama3_inv_freq(inv, rs):
    """HF's _compute_llama3_parameters (the same rule as keel/ops/rope.cpp): long wavelengths
    stretched by `factor`, short ones kept, the band between blended."""
    import torch
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    stretched = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * stretched / factor + smooth * stretched
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, blended, stretched)


def lora_linear_class():
    import torch.nn as nn

    class LoraLinear(nn.Module):
        """PEFT's lora.Linear (tuners/lora/layer.py): result = base_layer(x); x cast to the
        adapter's dtype (f32); result + lora_B(lora_A(dropout(x))) * alpha / r, cast back to the
        base result's dtype. lora_A and lora_B are loaded from keel's initial adapter."""

        def __init__(self, base, r, alpha, dropout):
            super().__init__()
            self.base_layer = base
            self.lora_A = nn.Linear(base.in_features, r, bias=False, device="meta")
            self.lora_B = nn.Linear(r, base.out_features, bias=False, device="meta")
            self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
            self.scaling = alpha / r

        def forward(self, x):
            result = self.base_layer(x)
            result_dtype = result.dtype
            h = x.to(self.lora_A.weight.dtype)
            result = result + self.lora_B(self.lora_A(self.lora_dropout(h))) * self.scaling
            return result.to(result_dtype)

    return LoraLinear


def build_torch_model(model_dir, base_dtype="f32", adapter=None, adapter_init=None):
    """The model of `model_dir` in plain torch.nn with its weights, parameters in f32 (or, under an
    adapter, the frozen base in `base_dtype`, as PEFT on a model loaded in that dtype). The modules
    are built on the meta device and allocated once, so no random init is paid for or held."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    pdt = torch.bfloat16 if adapter and base_dtype == "bf16" else torch.float32
    dd = dict(device="meta", dtype=pdt)

    def causal_attention(q, k, v):  # [B, H, T, D] each
        if q.is_cuda:  # on a GPU, PyTorch's own fused attention (flash where it applies)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        T, D = q.shape[-2], q.shape[-1]
        s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
        return p @ v

    class Conv1D(nn.Module):  # HF GPT-2: weight [in, out]
        def __init__(self, nin, nout):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(nin, nout, **dd))
            self.bias = nn.Parameter(torch.empty(nout, **dd))

        def forward(self, x):
            return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
                *x.shape[:-1], -1)

    if cfg["model_type"] == "gpt2":
        C, H, L, V = cfg["n_embd"], cfg["n_head"], cfg["n_layer"], cfg["vocab_size"]
        eps = cfg.get("layer_norm_epsilon", 1e-5)

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln_1 = nn.LayerNorm(C, eps=eps, **dd)
                self.attn = nn.Module()
                self.attn.c_attn = Conv1D(C, 3 * C)
                self.attn.c_proj = Conv1D(C, C)
                self.ln_2 = nn.LayerNorm(C, eps=eps, **dd)
                self.mlp = nn.Module()
                self.mlp.c_fc = Conv1D(C, 4 * C)
                self.mlp.c_proj = Conv1D(4 * C, C)

            def forward(self, x):
                B, T, _ = x.shape
                q, k, v = self.attn.c_attn(self.ln_1(x)).split(C, dim=-1)
                q, k, v = (t.reshape(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
                y = causal_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
                x = x + self.attn.c_proj(y)
                h = F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh")
                return x + self.mlp.c_proj(h)

        class GPT2(nn.Module):
            def __init__(self):
                super().__init__()
                self.transformer = nn.Module()
                self.transformer.wte = nn.Embedding(V, C, **dd)
                self.transformer.wpe = nn.Embedding(cfg["n_positions"], C, **dd)
                self.transformer.h = nn.ModuleList(Block() for _ in range(L))
                self.transformer.ln_f = nn.LayerNorm(C, eps=eps, **dd)

            def forward(self, ids):
                tr = self.transformer
                pos = torch.arange(ids.shape[1], device=ids.device)
                x = tr.wte(ids) + tr.wpe(pos)
                for b in tr.h:
                    x = b(x)
                return F.linear(tr.ln_f(x), tr.wte.weight)  # tied head

        model, prefix = GPT2(), "transformer."
    elif cfg["model_type"] == "gpt_neox":  # HF's GPTNeoXForCausalLM, parallel residual
        C, H, L, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"], cfg[
            "vocab_size"]
        D, Fd, eps = C // H, cfg["intermediate_size"], cfg.get("layer_norm_eps", 1e-5)
        R, theta = int(D * cfg.get("rotary_pct", 0.25)), cfg.get("rotary_emb_base", 10000)
        if not cfg.get("use_parallel_residual", True) or cfg.get("hidden_act", "gelu") != "gelu":
            raise SystemExit(f"{model_dir}: only the parallel, exact-gelu GPT-NeoX is implemented here")

        def rope(x, cos, sin):  # the first R channels of each head, HF's rotate_half
            r, rest = x[..., :R], x[..., R:]
            r1, r2 = r[..., : R // 2], r[..., R // 2:]
            return torch.cat((r * cos + torch.cat((-r2, r1), dim=-1) * sin, rest), dim=-1)

        class NeoxLayer(nn.Module):
            def __init__(self):
                super().__init__()
                self.input_layernorm = nn.LayerNorm(C, eps=eps, **dd)
                self.post_attention_layernorm = nn.LayerNorm(C, eps=eps, **dd)
                self.attention = nn.Module()
                self.attention.query_key_value = nn.Linear(C, 3 * C, **dd)
                self.attention.dense = nn.Linear(C, C, **dd)
                self.mlp = nn.Module()
                self.mlp.dense_h_to_4h = nn.Linear(C, Fd, **dd)
                self.mlp.dense_4h_to_h = nn.Linear(Fd, C, **dd)

            def forward(self, x, cos, sin):
                B, T, _ = x.shape
                a = self.attention
                qkv = a.query_key_value(self.input_layernorm(x)).view(B, T, H, 3 * D).transpose(1, 2)
                q, k, v = qkv.chunk(3, dim=-1)
                y = causal_attention(rope(q, cos, sin), rope(k, cos, sin), v)
                attn = a.dense(y.transpose(1, 2).reshape(B, T, C))
                m = self.mlp
                mlp = m.dense_4h_to_h(F.gelu(m.dense_h_to_4h(self.post_attention_layernorm(x))))
                return mlp + attn + x

        class Neox(nn.Module):
            def __init__(self):
                super().__init__()
                self.gpt_neox = nn.Module()
                self.gpt_neox.embed_in = nn.Embedding(V, C, **dd)
                self.gpt_neox.layers = nn.ModuleList(NeoxLayer() for _ in range(L))
                self.gpt_neox.final_layer_norm = nn.LayerNorm(C, eps=eps, **dd)
                self.embed_out = nn.Linear(C, V, bias=False, **dd)

            def forward(self, ids):
                T = ids.shape[1]
                inv = 1.0 / (theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R))
                f = torch.outer(torch.arange(T, dtype=torch.float64), inv).float()
                cos, sin = (torch.cat((g, g), -1).to(ids.device) for g in (f.cos(), f.sin()))
                x = self.gpt_neox.embed_in(ids)
                for layer in self.gpt_neox.layers:
                    x = layer(x, cos, sin)
                return self.embed_out(self.gpt_neox.final_layer_norm(x))

        model, prefix = Neox(), ""
    elif cfg["model_type"] == "falcon":  # HF's FalconForCausalLM, parallel_attn on one norm
        C, H, L, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"], cfg[
            "vocab_size"]
        D, Fd, eps = C // H, cfg["ffn_hidden_size"], cfg.get("layer_norm_epsilon", 1e-5)
        new = cfg.get("new_decoder_architecture", False)
        G = cfg["num_kv_heads"] if new else 1 if cfg.get("multi_query", True) else H
        if (not cfg.get("parallel_attn", True) or cfg.get("activation", "gelu") != "gelu" or
                (new and cfg.get("num_ln_in_parallel_attn") != 1) or cfg.get("bias") or
                not cfg.get("tie_word_embeddings", True)):
            raise SystemExit(f"{model_dir}: only a tied, one-norm parallel Falcon is implemented here")

        def rope(x, cos, sin):  # HF's rotate_half over the whole head
            x1, x2 = x[..., : D // 2], x[..., D // 2:]
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin

        class FalconLayer(nn.Module):
            def __init__(self):
                super().__init__()
                self.input_layernorm = nn.LayerNorm(C, eps=eps, **dd)
                self.self_attention = nn.Module()
                self.self_attention.query_key_value = nn.Linear(C, (H + 2 * G) * D, bias=False, **dd)
                self.self_attention.dense = nn.Linear(C, C, bias=False, **dd)
                self.mlp = nn.Module()
                self.mlp.dense_h_to_4h = nn.Linear(C, Fd, bias=False, **dd)
                self.mlp.dense_4h_to_h = nn.Linear(Fd, C, bias=False, **dd)

            def forward(self, x, cos, sin):
                B, T, _ = x.shape
                h = self.input_layernorm(x)
                a = self.self_attention
                g = a.query_key_value(h).view(B, T, G, H // G + 2, D)  # each group: queries, k, v
                q = g[:, :, :, :-2].reshape(B, T, H, D).transpose(1, 2)
                k = g[:, :, :, -2].transpose(1, 2).repeat_interleave(H // G, dim=1)
                v = g[:, :, :, -1].transpose(1, 2).repeat_interleave(H // G, dim=1)
                y = causal_attention(rope(q, cos, sin), rope(k, cos, sin), v)
                attn = a.dense(y.transpose(1, 2).reshape(B, T, C))
                m = self.mlp
                return m.dense_4h_to_h(F.gelu(m.dense_h_to_4h(h))) + attn + x

        class Falcon(nn.Module):
            def __init__(self):
                super().__init__()
                self.transformer = nn.Module()
                self.transformer.word_embeddings = nn.Embedding(V, C, **dd)
                self.transformer.h = nn.ModuleList(FalconLayer() for _ in range(L))
                self.transformer.ln_f = nn.LayerNorm(C, eps=eps, **dd)

            def forward(self, ids):
                T, tr = ids.shape[1], self.transformer
                theta = cfg.get("rope_theta", 10000.0)
                inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
                f = torch.outer(torch.arange(T, dtype=torch.float64), inv).float()
                cos, sin = (torch.cat((g, g), -1).to(ids.device) for g in (f.cos(), f.sin()))
                x = tr.word_embeddings(ids)
                for layer in tr.h:
                    x = layer(x, cos, sin)
                return F.linear(tr.ln_f(x), tr.word_embeddings.weight)  # tied head

        model, prefix = Falcon(), ""
    else:
        C, H, L, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"], cfg[
            "vocab_size"]
        Hkv = cfg.get("num_key_value_heads", H)
        D, Fd = cfg.get("head_dim", C // H), cfg["intermediate_size"]
        eps, theta = cfg.get("rms_norm_eps", 1e-6), cfg.get("rope_theta", 10000.0)
        tied = cfg.get("tie_word_embeddings", False)
        rs = cfg.get("rope_scaling")
        if rs and rs.get("rope_type", rs.get("type")) not in ("llama3", "default"):
            raise SystemExit(f"{model_dir}: rope_scaling {rs} is not implemented here")
        # Mixtral: each MLP a sparse block of E experts (w1 gate, w3 up, w2 down), k a token.
        E, K = cfg.get("num_local_experts", 0), cfg.get("num_experts_per_tok", 0)
        if cfg["model_type"] not in ("llama", "mixtral"):
            raise SystemExit(f"{model_dir}: model_type {cfg['model_type']} is not implemented here")

        class RMSNorm(nn.Module):  # HF LlamaRMSNorm
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.empty(C, **dd))

            def forward(self, x):
                xf = x.float()
                xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
                return self.weight * xf.to(x.dtype)

        class Expert(nn.Module):
            def __init__(self):
                super().__init__()
                self.w1 = nn.Linear(C, Fd, bias=False, **dd)
                self.w3 = nn.Linear(C, Fd, bias=False, **dd)
                self.w2 = nn.Linear(Fd, C, bias=False, **dd)

        class SparseMoe(nn.Module):  # HF's MixtralSparseMoeBlock (no router noise)
            def __init__(self):
                super().__init__()
                self.gate = nn.Linear(C, E, bias=False, **dd)
                self.experts = nn.ModuleList(Expert() for _ in range(E))

            def forward(self, h):
                B, T, _ = h.shape
                flat = h.reshape(-1, C)
                probs = torch.softmax(self.gate(flat), dim=-1, dtype=torch.float)
                w, sel = torch.topk(probs, K, dim=-1)
                w = (w / w.sum(dim=-1, keepdim=True)).to(flat.dtype)
                out = torch.zeros_like(flat)
                for e, ex in enumerate(self.experts):
                    tok, slot = torch.where(sel == e)
                    if tok.numel() == 0:
                        continue
                    x = flat[tok]
                    y = ex.w2(F.silu(ex.w1(x)) * ex.w3(x)) * w[tok, slot, None]
                    out.index_add_(0, tok, y.to(flat.dtype))
                return out.view(B, T, C)

        def rope(x, cos, sin):  # [B, H, T, D], HF rotate_half
            x1, x2 = x[..., : D // 2], x[..., D // 2:]
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.input_layernorm = RMSNorm()
                self.post_attention_layernorm = RMSNorm()
                self.self_attn = nn.Module()
                for n, o in (("q_proj", H * D), ("k_proj", Hkv * D), ("v_proj", Hkv * D)):
                    setattr(self.self_attn, n, nn.Linear(C, o, bias=False, **dd))
                self.self_attn.o_proj = nn.Linear(H * D, C, bias=False, **dd)
                if E:
                    self.block_sparse_moe = SparseMoe()
                    return
                self.mlp = nn.Module()
                self.mlp.gate_proj = nn.Linear(C, Fd, bias=False, **dd)
                self.mlp.up_proj = nn.Linear(C, Fd, bias=False, **dd)
                self.mlp.down_proj = nn.Linear(Fd, C, bias=False, **dd)

            def forward(self, x, cos, sin):
                B, T, _ = x.shape
                a, h = self.self_attn, self.input_layernorm(x)
                q = rope(a.q_proj(h).view(B, T, H, D).transpose(1, 2), cos, sin)
                k = rope(a.k_proj(h).view(B, T, Hkv, D).transpose(1, 2), cos, sin)
                v = a.v_proj(h).view(B, T, Hkv, D).transpose(1, 2)
                if Hkv != H:
                    k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
                x = x + a.o_proj(causal_attention(q, k, v).transpose(1, 2).reshape(B, T, H * D))
                h = self.post_attention_layernorm(x)
                if E:
                    return x + self.block_sparse_moe(h)
                m = self.mlp
                return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))

        class Llama(nn.Module):
            def __init__(self):
                super().__init__()
                self.model = nn.Module()
                self.model.embed_tokens = nn.Embedding(V, C, **dd)
                self.model.layers = nn.ModuleList(Layer() for _ in range(L))
                self.model.norm = RMSNorm()
                if not tied:
                    self.lm_head = nn.Linear(C, V, bias=False, **dd)

            def forward(self, ids):
                T = ids.shape[1]
                inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
                if rs and rs.get("rope_type", rs.get("type")) == "llama3":
                    inv = llama3_inv_freq(inv, rs)
                f = torch.outer(torch.arange(T, dtype=torch.float64), inv).float()
                cos, sin = (torch.cat((g, g), -1).to(ids.device) for g in (f.cos(), f.sin()))
                x = self.model.embed_tokens(ids)
                for layer in self.model.layers:
                    x = layer(x, cos, sin)
                x = self.model.norm(x)
                return F.linear(x, self.model.embed_tokens.weight if tied else self.lm_head.weight)

        model, prefix = Llama(), ""

    def rename(k):  # HF file names -> this model's (GPT-2: the prefix, its tied lm_head)
        if cfg["model_type"] == "gpt2" and k == "lm_head.weight":
            return None
        return prefix + k if prefix and not k.startswith(prefix) else k

    model.to_empty(device="cpu")
    missing = load_safetensors_into(dict(model.named_parameters()), safetensors_files(model_dir),
                                    rename)
    if missing:
        raise SystemExit(f"{model_dir}: missing {missing}")
    if adapter:
        # Freeze the base, wrap the targets (PEFT's rule: the module's name ends with an entry),
        # then load keel's initial lora_A / lora_B by their PEFT names.
        model.requires_grad_(False)
        LoraLinear = lora_linear_class()
        targets = [(n, m) for n, m in model.named_modules()
                   if isinstance(m, nn.Linear) and n.split(".")[-1] in adapter["targets"]]
        for n, m in targets:
            parent, child = n.rsplit(".", 1)
            lora = LoraLinear(m, adapter["r"], adapter["alpha"], adapter["dropout"])
            lora.lora_A.to_empty(device="cpu")
            lora.lora_B.to_empty(device="cpu")
            setattr(model.get_submodule(parent), child, lora)
        lora_params = {n: p for n, p in model.named_parameters() if ".lora_" in n}
        peft = "base_model.model."  # PEFT's adapter-file prefix before the module path
        missing = load_safetensors_into(
            lora_params, [os.path.join(adapter_init, "adapter_model.safetensors")],
            lambda k: k[len(peft):] if k.startswith(peft) else k)
        if missing:
            raise SystemExit(f"{adapter_init}: missing {missing[:5]}")
    return model


def current_rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


# The widest vector kernels each OpenBLAS core runs (OpenBLAS's own core names, lower case); a
# core not listed counts as generic. PyTorch's fp32 products on a core below what the CPU has are a
# handicapped peer: SSE3 (Prescott, what OpenBLAS 0.3.21 picks on an Emerald Rapids it does not
# know) ran a 1024^3 product 5x slower than Cooperlake on this project's VM, and AVX2 (Haswell,
# what the project's machines set OPENBLAS_CORETYPE to: shared/reference/cpu-dependencies.md)
# costs 36-47%.
BLAS_CORE_ISA = {
    **dict.fromkeys(["sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"], "avx"),
    **dict.fromkeys(["haswell", "zen"], "avx2"),
    **dict.fromkeys(["skylakex", "cooperlake", "sapphirerapids"], "avx512"),
}
ISA_RANK = {"generic": 0, "avx": 1, "avx2": 2, "avx512": 3}


def blas_handicap(core, isa):
    """'' when PyTorch's OpenBLAS core runs the widest kernels this CPU (whose best is `isa`) has,
    else what it runs instead ('SSE kernels', 'avx2 kernels')."""
    core_isa = BLAS_CORE_ISA.get(core.lower(), "generic")
    if not core or ISA_RANK[core_isa] >= ISA_RANK[isa]:
        return ""
    return "SSE kernels" if core_isa == "generic" else f"{core_isa} kernels"


def cpu_isa():
    """The widest vector instructions of this CPU that OpenBLAS has kernels for."""
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    for isa, flag in (("avx512", "avx512f"), ("avx2", "avx2"), ("avx", "avx")):
        if flag in flags:
            return isa
    return "generic"


def torch_blas():
    """Which BLAS PyTorch's fp32 products run on: Debian's torch calls libblas.so.3, which is
    OpenBLAS when installed. OpenBLAS 0.3.21 (Debian 12) does not recognize Sapphire/Emerald Rapids
    and falls back to its Prescott (SSE3) kernels unless OPENBLAS_CORETYPE names a core."""
    import ctypes
    try:
        lib = ctypes.CDLL("libblas.so.3")
        lib.openblas_get_corename.restype = ctypes.c_char_p
        lib.openblas_get_config.restype = ctypes.c_char_p
        return {"core": lib.openblas_get_corename().decode(),
                "config": " ".join(lib.openblas_get_config().decode().split()[:2])}
    except (OSError, AttributeError):
        return {"core": "", "config": "not OpenBLAS"}


def torch_matmul_probe(dtype, seconds=0.3, n=1024, device="cpu"):
    """The same probe as keel's (bench/matmul_peak.h) through PyTorch: best GFLOP/s of an n^3 NT
    product over `seconds` of back-to-back calls (OpenBLAS in f32, oneDNN/AMX in bf16; cuBLAS on a
    GPU, each call waited for). Printed beside keel's, it shows whether the two sides ran in the
    same state of the shared host."""
    import torch
    x = torch.full((n, n), 0.5, dtype=dtype, device=device)
    w = torch.full((n, n), 0.25, dtype=dtype, device=device)

    def call():
        torch.matmul(x, w.t())
        if device != "cpu":
            torch.cuda.synchronize()
    call()
    best, start, calls = 1e30, time.perf_counter(), 0
    while calls < 5 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return 2.0 * n ** 3 / best / 1e9


def probe_rates(runs):
    """Every matmul probe of a side's rounds (before and after its steps), in GFLOP/s."""
    return [r[key] for r in runs for key in ("peak_gflops_before", "peak_gflops_after")]


def torch_worker(a):
    import torch
    torch.set_num_threads(a.threads)
    gpu = a.device == "cuda"
    blas = torch_blas()
    base_rss = current_rss_mb()  # interpreter + torch's libraries, before the model exists
    probe_dtype = torch.bfloat16 if a.precision == "bf16-mixed" else torch.float32
    probe_n = 8192 if gpu else 1024  # as keel's (bench/compare_keel.cpp)
    probe_before = torch_matmul_probe(probe_dtype, n=probe_n, device=a.device)
    adapter = json.loads(a.adapter) if a.adapter else None
    model = build_torch_model(a.model, a.base_dtype, adapter, a.adapter_init)
    if gpu:
        model.to("cuda")
    model.train()
    # keel's param groups (optim/optimizer.cpp make_param_groups): no decay on biases, norms, 1-D;
    # only what trains (under an adapter, the adapter).
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        ln = n.lower()
        (no_decay if ("bias" in ln or "norm" in ln or "ln_" in ln or p.dim() < 2) else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    B, T, S = a.batch, a.seq, a.steps
    ids = torch.from_numpy(__import__("numpy").fromfile(a.ids, dtype="<i8").reshape(S, B, T + 1))
    ids = ids.to(a.device)
    params = [p for p in model.parameters() if p.requires_grad]
    losses, seconds = [], []
    for s in range(S):
        x, y = ids[s, :, :T].contiguous(), ids[s, :, 1:].contiguous()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.precision == "bf16-mixed"):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                     y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
        opt.step()
        if gpu:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        losses.append(loss.item())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    probe_after = torch_matmul_probe(probe_dtype, n=probe_n, device=a.device)
    extra = {"peak_gpu_mb": torch.cuda.max_memory_allocated() / 1048576.0} if gpu else {}
    print(json.dumps({"side": "torch", "precision": a.precision, "threads": torch.get_num_threads(),
                      "blas": blas, "peak_gflops_before": probe_before,
                      "peak_gflops_after": probe_after, "peak_rss_mb": rss, "base_rss_mb": base_rss,
                      "params": sum(p.numel() for p in model.parameters()),
                      "trainable": sum(p.numel() for p in params), "loss": losses,
                      "seconds": seconds, **extra}))


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------
def adapter_weights(c):
    """Weights of the adapter (LoRA/DoRA A and B: r x (in + out) per target) of a Llama `c` that a
    token runs through (a mixture: its top_k experts' adapters, not every expert's)."""
    ad = c.get("adapter")
    if not ad:
        return 0
    C, F = c["n_embd"], c["ffn"]
    kv = C // c["n_head"] * c.get("n_kv_head", c["n_head"])
    dims = {"q_proj": (C, C), "k_proj": (C, kv), "v_proj": (C, kv), "o_proj": (C, C),
            "gate_proj": (C, F), "up_proj": (C, F), "down_proj": (F, C)}
    # A mixture's experts (Mixtral's names): the top_k a token runs, each with its adapter.
    dims.update({"w1": (C, F), "w3": (C, F), "w2": (F, C)})
    each = {t: c.get("top_k", 1) if t in ("w1", "w3", "w2") else 1 for t in ad["targets"]}
    return c["n_layer"] * sum(each[t] * ad["r"] * sum(dims[t]) for t in ad["targets"])


def flops_per_token(c, T):
    """Model FLOPs per trained token (PaLM): 6 x the matmul weights + 12 L T C for attention.
    Under an adapter the frozen base needs no weight gradients: 4 x its matmul weights (forward
    and input gradients) + 6 x the adapter's weights + attention. Model FLOPs: the recomputation
    of activation checkpointing and DoRA's per-step weight norms are not counted."""
    C, L, V = c["n_embd"], c["n_layer"], c["vocab"]
    if c["family"] == "gpt2":
        mm = L * 12 * C * C + V * C  # c_attn 3C², c_proj C², c_fc 4C², mlp.c_proj 4C²; tied head
    elif c["family"] == "gpt_neox":
        mm = L * (4 * C * C + 2 * C * c["ffn"]) + V * C  # query_key_value, dense, the MLP; embed_out
    elif c["family"] == "falcon":  # query_key_value (H + 2 kv heads), dense, the MLP; tied head
        D = C // c["n_head"]
        mm = L * (C * (c["n_head"] + 2 * c["n_kv_head"]) * D + C * C + 2 * C * c["ffn"]) + V * C
    else:
        kv = C // c["n_head"] * c.get("n_kv_head", c["n_head"])  # grouped-query k, v widths
        # q o, k v, the MLP (a mixture: its top_k experts and the router); head
        mlp = c.get("top_k", 1) * 3 * C * c["ffn"] + C * c.get("experts", 0)
        mm = L * (2 * C * C + 2 * C * kv + mlp) + V * C
    if c.get("adapter"):
        return 4 * mm + 6 * adapter_weights(c) + 12 * L * T * C
    return 6 * mm + 12 * L * T * C


def run(cmd, env):
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def prepare(name, c, a, keel_cli):
    import numpy as np
    d = os.path.join(a.work, name)
    model = os.path.join(d, "model")
    if c.get("shape"):  # streamed, bf16 (skipped when up to date)
        subprocess.run([sys.executable, write_random_hf.__file__, "--shape", c["shape"], "--out",
                        model], check=True, capture_output=True)
    elif not os.path.exists(os.path.join(model, "model.safetensors")):
        cmd = [keel_cli, "init-model", "--family", c["family"], "--out", model,
               "--n-layer", str(c["n_layer"]), "--n-embd", str(c["n_embd"]), "--n-head",
               str(c["n_head"]), "--vocab-size", str(c["vocab"]), "--max-seq-len",
               str(max(c["T"], 64)), "--seed", "1234"]
        if c["family"] in ("llama", "gpt_neox"):
            cmd += ["--untied", "--intermediate-size", str(c["ffn"])]
        if c["family"] == "falcon":  # (its head tied, as Falcon's files)
            cmd += ["--intermediate-size", str(c["ffn"])]
        if c.get("experts"):  # a mixture (Mixtral's head untied, as published)
            cmd += ["--untied", "--num-experts", str(c["experts"]), "--experts-per-token", str(c["top_k"]),
                    "--expert-size", str(c["ffn"])]
        if c.get("n_kv_head"):
            cmd += ["--n-kv-head", str(c["n_kv_head"])]
        subprocess.run(cmd, check=True, capture_output=True)
    ids = os.path.join(d, f"ids-{a.steps}x{c['B']}x{c['T'] + 1}.bin")
    if not os.path.exists(ids):
        rng = np.random.default_rng(4321)
        rng.integers(0, c["vocab"], size=(a.steps, c["B"], c["T"] + 1), dtype=np.int64).tofile(ids)
    return model, ids


def side_cmds(a, model, ids, c, precision, threads, keel_bin):
    common = ["--model", model, "--ids", ids, "--batch", str(c["B"]), "--seq", str(c["T"]),
              "--steps", str(a.steps), "--precision", precision, "--threads", str(threads),
              "--lr", str(a.lr), "--weight-decay", str(a.weight_decay), "--max-grad-norm",
              str(a.max_grad_norm), "--device", a.device]
    keel, torch = [], []
    ad = c.get("adapter")
    if ad:
        # A bf16 frozen base under bf16-mixed (the seed's run), f32 under 32-true; the adapter
        # keel initializes is written beside the checkpoint for the torch side to load.
        base = "bf16" if precision == "bf16-mixed" else "f32"
        init = os.path.join(os.path.dirname(model), f"adapter-init-{ad['kind']}-r{ad['r']}")
        common += ["--base-dtype", base, "--adapter-init", init]
        keel = ["--adapter", ad["kind"], "--r", str(ad["r"]), "--alpha", str(ad["alpha"]),
                "--adapter-dropout", str(ad["dropout"]), "--targets", ",".join(ad["targets"])]
        torch = ["--adapter", json.dumps(ad)]
    return {"keel": [keel_bin] + common + keel,
            "torch": [a.python, os.path.abspath(__file__), "--worker", "torch"] + common + torch}


def summarize(runs, warmup, tokens):
    """runs: worker results of one side over rounds -> (tok/s of the median step, spread, rss)."""
    per_round = [statistics.median(r["seconds"][warmup:]) for r in runs]
    all_steps = [s for r in runs for s in r["seconds"][warmup:]]
    med = statistics.median(per_round)
    # On a GPU the memory that counts is the device's (each side's allocator peak).
    mem_key = "peak_gpu_mb" if "peak_gpu_mb" in runs[0] else "peak_rss_mb"
    return dict(tps=tokens / med, med=med, lo=min(all_steps), hi=max(all_steps),
                rss=max(r[mem_key] for r in runs),
                base=max(r.get("base_rss_mb", 0) for r in runs), runs=runs)


def measure(a, name, c, precision, threads, bins, envs):
    model, ids = prepare(name, c, a, bins["cli"])
    cmds = side_cmds(a, model, ids, c, precision, threads, bins["bench"])
    got = {"keel": [], "torch": []}
    for r in range(a.rounds):  # interleaved, alternating which side goes first
        order = ["keel", "torch"] if r % 2 == 0 else ["torch", "keel"]
        for side in order:
            got[side].append(run(cmds[side], envs[side]))
    tokens = c["B"] * c["T"]
    return {s: summarize(got[s], a.warmup, tokens) for s in got}


def fmt_spread(s):
    return f"{s['med'] * 1e3:.0f} ms [{s['lo'] * 1e3:.0f}..{s['hi'] * 1e3:.0f}]"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worker", choices=["torch"])
    p.add_argument("--model"), p.add_argument("--ids")
    p.add_argument("--batch", type=int), p.add_argument("--seq", type=int)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--adapter", default="", help=argparse.SUPPRESS)  # worker: JSON of `adapter`
    p.add_argument("--base-dtype", default="f32", help=argparse.SUPPRESS)
    p.add_argument("--adapter-init", default="", help=argparse.SUPPRESS)
    p.add_argument("--build", default="build-perf")
    p.add_argument("--only", default="", help="comma-separated configuration names")
    p.add_argument("--precisions", default="32-true,bf16-mixed")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--scaling", default="", help="thread counts for the scaling table "
                   "(default 1,2 and the core count when larger); 'none' skips it")
    p.add_argument("--wait-policy", default="passive", help="OMP_WAIT_POLICY for both sides")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--work", default="/tmp/keel-compare")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: both sides train on the GPU (PyTorch with its own fused attention); "
                   "memory is each side's GPU allocator peak, the MFU peak an 8192^3 product")
    p.add_argument("--python", default="",
                   help="the PyTorch side's interpreter (default: Debian's /usr/bin/python3 on the "
                   "CPU, this interpreter with --device cuda)")
    p.add_argument("--torch-openblas-core", default="",
                   help="OPENBLAS_CORETYPE for the PyTorch side only (e.g. Cooperlake, for a CPU "
                   "that Debian's OpenBLAS does not recognize; OPENBLAS_L2_SIZE is dropped with it), "
                   "or 'auto' to drop both and let OpenBLAS detect the CPU; by default the "
                   "environment's are kept")
    a = p.parse_args()
    if a.worker == "torch":
        return torch_worker(a)
    a.python = a.python or ("/usr/bin/python3" if a.device == "cpu" else sys.executable)
    gpu = a.device == "cuda"
    if gpu:
        a.scaling = "none"  # thread scaling is a CPU table

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    build = a.build if os.path.isabs(a.build) else os.path.join(root, a.build)
    bins = {"bench": os.path.join(build, "bench", "compare_keel"),
            "cli": os.path.join(build, "keel")}
    for b in bins.values():
        if not os.path.exists(b):
            raise SystemExit(f"{b} is missing: ninja -C {a.build} compare_keel keel")
    env = dict(os.environ, OMP_WAIT_POLICY=a.wait_policy)
    env.pop("OMP_NUM_THREADS", None)  # each side sets its own thread count
    envs = {"keel": env, "torch": dict(env)}
    if a.torch_openblas_core:
        # The core and the cache size it is tuned for go together (the machine's environment may
        # set both for another core): naming a core drops OPENBLAS_L2_SIZE, 'auto' both.
        envs["torch"].pop("OPENBLAS_L2_SIZE", None)
        envs["torch"].pop("OPENBLAS_CORETYPE", None)
        if a.torch_openblas_core != "auto":
            envs["torch"]["OPENBLAS_CORETYPE"] = a.torch_openblas_core
    isa = cpu_isa()
    blas_reported = False
    names = [n for n in a.only.split(",") if n] or list(CONFIGS)
    CONFIGS.update(SMOKE)
    CONFIGS.update(MOE)
    CONFIGS.update(NEOX)
    CONFIGS.update(GPU)
    for n in names:
        if n not in CONFIGS:
            raise SystemExit(f"--only {n}: unknown configuration; use one of {', '.join(CONFIGS)}")
    precisions = [x for x in a.precisions.split(",") if x]
    print(f"# steps {a.steps} (first {a.warmup} = warm-up), {a.rounds} rounds interleaved, "
          f"{a.threads} threads, OMP_WAIT_POLICY={a.wait_policy}, load average "
          f"{os.getloadavg()[0]:.1f} at start, {os.cpu_count()} CPUs")
    print(f"# step time: median [min..max of all post-warm-up steps of all rounds]; "
          f"32-true losses must agree within {LOSS_RTOL:g} relative")
    ok = True
    results = {}
    for name in names:
        c = CONFIGS[name]
        ad = c.get("adapter")
        for prec in [x for x in precisions if x in c.get("precisions", precisions)]:
            m = measure(a, name, c, prec, a.threads, bins, envs)
            k, t = m["keel"], m["torch"]
            results[(name, prec)] = m
            kl, tl = k["runs"][0]["loss"], t["runs"][0]["loss"]
            # Adapter dropout draws different masks on the two sides: only the first step (whose
            # update is zero, lora_B starting at 0) computes the same loss.
            compared = 1 if ad and ad["dropout"] > 0 else len(kl)
            rel = max(abs(x - y) / abs(y) for x, y in zip(kl[:compared], tl[:compared]))
            # The highest matmul rate any of keel's probes saw (before and after its steps, every
            # round): on a shared VM the rate moves by up to 3x (bench/matmul_peak.h).
            probes, torch_probes = probe_rates(k["runs"]), probe_rates(t["runs"])
            peak = max(probes)
            mfu = k["tps"] * flops_per_token(c, c["T"]) / (peak * 1e9)
            agree = rel <= LOSS_RTOL
            if prec == "32-true" and not agree:
                ok = False
            blas = t["runs"][0].get("blas", {})
            handicap = blas_handicap(blas.get("core", ""), isa)
            if not blas_reported:
                blas_reported = True
                print(f"# PyTorch's fp32 products: {blas.get('config', '?')} core "
                      f"{blas.get('core') or '-'} (OPENBLAS_CORETYPE "
                      f"{envs['torch'].get('OPENBLAS_CORETYPE', 'unset')}, OPENBLAS_L2_SIZE "
                      f"{envs['torch'].get('OPENBLAS_L2_SIZE', 'unset')})")
                if handicap:
                    best = "Cooperlake" if isa == "avx512" else "Haswell"
                    print(f"# WARNING: that core runs {handicap} on a CPU with {isa}: PyTorch's "
                          f"32-true steps are handicapped and keel/torch 32-true ratios overstate "
                          f"keel (SSE3 Prescott: 5x slower products on Emerald Rapids; AVX2: 36-47% slower); "
                          f"rerun with --torch-openblas-core {best} (or auto, when this OpenBLAS "
                          f"knows the CPU)")
            trains = ""
            if ad:
                trains = (f", {k['runs'][0]['trainable'] / 1e6:.2f}M trainable: {ad['kind']} r={ad['r']} "
                          f"alpha {ad['alpha']:g} dropout {ad['dropout']:g} on "
                          f"{','.join(ad['targets'])}, {'bf16' if prec == 'bf16-mixed' else 'f32'} "
                          f"frozen base")
                if k["runs"][0]["trainable"] != t["runs"][0]["trainable"]:
                    ok = False
                    print(f"  DIFFERENT trainable counts: keel {k['runs'][0]['trainable']}, "
                          f"torch {t['runs'][0]['trainable']}")
            print(f"\n{name} ({k['runs'][0]['params'] / 1e6:.1f}M params{trains}, B={c['B']} "
                  f"T={c['T']}) {prec}")
            mem = "peak GPU memory" if gpu else "peak RSS"
            before = "" if gpu else " ({:.0f} before the model)"
            print(f"  keel  {k['tps']:9.0f} tok/s  step {fmt_spread(k)}  {mem} {k['rss']:.0f} MB"
                  + before.format(k['base']))
            print(f"  torch {t['tps']:9.0f} tok/s  step {fmt_spread(t)}  {mem} {t['rss']:.0f} MB"
                  + before.format(t['base']))
            mark = f" [PyTorch on {handicap}]" if handicap and prec == "32-true" else ""
            n3 = "8192^3" if gpu else "1024^3"
            print(f"  keel/torch tokens/s {k['tps'] / t['tps']:.2f}x{mark} (fastest steps: "
                  f"{t['lo'] / k['lo']:.2f}x)   {'GPU memory' if gpu else 'RSS'} keel/torch "
                  f"{k['rss'] / t['rss']:.2f}   keel MFU {100 * mfu:.1f}% of the "
                  f"{'f32' if prec == '32-true' else 'bf16'} matmul peak ({peak:.0f} GFLOP/s, "
                  f"{n3} in keel's process; probes {min(probes):.0f}..{peak:.0f})")
            print(f"  the same {n3} product through PyTorch, probed beside its steps: "
                  f"{min(torch_probes):.0f}..{max(torch_probes):.0f} GFLOP/s")
            print("  loss keel : " + " ".join(f"{x:.6f}" for x in kl))
            print("  loss torch: " + " ".join(f"{x:.6f}" for x in tl))
            verdict = ("agree" if agree else "DISAGREE") if prec == "32-true" else "(informative)"
            which = "" if compared == len(kl) else " (first step only: adapter dropout masks differ)"
            print(f"  max relative loss difference {rel:.2e}{which} {verdict}")
            if ad:
                tmfu = t["tps"] * flops_per_token(c, c["T"]) / (peak * 1e9)
                speed, mem = k["tps"] / t["tps"], k["rss"] / t["rss"]
                print(f"  MFU (adapter step FLOPs, of keel's {peak:.0f} GFLOP/s peak): keel "
                      f"{100 * mfu:.1f}%, torch {100 * tmfu:.1f}%")
                if gpu:
                    met = "met" if speed >= 1 else "NOT met"
                    print(f"  goal (issue 26): keel at least as fast as torch with a hand-written "
                          f"LoRA: {speed:.2f}x: {met} (GPU memory {mem:.2f}x)")
                else:
                    met = "met" if speed >= 2 and mem <= 0.7 else "NOT met"
                    print(f"  goal (issue 25): keel >= 2x torch tokens/s at <= 0.7x its peak RSS: "
                          f"{speed:.2f}x at {mem:.2f}x: {met}")
        if (name, "32-true") in results and (name, "bf16-mixed") in results:
            k32, k16 = results[(name, "32-true")]["keel"], results[(name, "bf16-mixed")]["keel"]
            t16 = results[(name, "bf16-mixed")]["torch"]
            print(f"  keel bf16-mixed / keel 32-true {k16['tps'] / k32['tps']:.2f}x; "
                  f"keel bf16-mixed / torch bf16 autocast {k16['tps'] / t16['tps']:.2f}x")

    scaling = a.scaling or ",".join(str(n) for n in sorted({1, 2, os.cpu_count() or 1}))
    if scaling != "none":
        name = "smoke" if names == ["smoke"] else "gpt2-124m-b4t64"
        c = CONFIGS[name]
        print(f"\nthread scaling, {name}, 32-true (tokens/s; x = speed-up over 1 thread)")
        base = {}
        for n in [int(x) for x in scaling.split(",")]:
            m = measure(a, name, c, "32-true", n, bins, envs)
            for s in ("keel", "torch"):
                base.setdefault(s, m[s]["tps"])
            print(f"  {n:2d} threads: keel {m['keel']['tps']:7.0f} ({m['keel']['tps'] / base['keel']:.2f}x)"
                  f"  torch {m['torch']['tps']:7.0f} ({m['torch']['tps'] / base['torch']:.2f}x)"
                  f"  keel/torch {m['keel']['tps'] / m['torch']['tps']:.2f}x")
    print(f"\n# load average {os.getloadavg()[0]:.1f} at the end")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
