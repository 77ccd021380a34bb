#!/usr/bin/env python3
"""The PyTorch peer of bench/bench_gpu.cpp: GPT-2 124M training steps at the same B and T in
bf16 autocast (F.scaled_dot_product_attention with is_causal, fused AdamW, clipping at 1.0), eager
PyTorch without torch.compile.

    python3 bench/gpt2_torch.py [--steps 8] [--batch 16] [--seq 1024] [--layers 12] [--dump DIR]

--dump DIR starts from keel's initial parameters and tokens (written by bench_gpu --dump DIR), so
the step-0 loss is comparable. The last line is machine-readable:
    RESULT torch_tok_s=... step_ms=... loss0=...
"""
import argparse
import json
import os
import struct
import time

import torch
import torch.nn.functional as F

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
          "I32": torch.int32, "U8": torch.uint8}


def read_safetensors(path):
    """A minimal safetensors reader (the `safetensors` package may be missing)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        buf = bytearray(data[base + lo:base + hi])
        t = torch.frombuffer(buf, dtype=DTYPES[info["dtype"]]) if hi > lo else \
            torch.empty(0, dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"]).clone()
    return out


def init_params(layers, C=768, V=50257, T=1024, std=0.02, seed=1234):
    g = torch.Generator().manual_seed(seed)
    P = {"transformer.wte.weight": torch.randn(V, C, generator=g) * std,
         "transformer.wpe.weight": torch.randn(T, C, generator=g) * std,
         "transformer.ln_f.weight": torch.ones(C), "transformer.ln_f.bias": torch.zeros(C)}
    for i in range(layers):
        p = f"transformer.h.{i}."
        P[p + "ln_1.weight"], P[p + "ln_1.bias"] = torch.ones(C), torch.zeros(C)
        P[p + "ln_2.weight"], P[p + "ln_2.bias"] = torch.ones(C), torch.zeros(C)
        for name, (o, k) in {"attn.c_attn": (3 * C, C), "attn.c_proj": (C, C),
                             "mlp.c_fc": (4 * C, C), "mlp.c_proj": (C, 4 * C)}.items():
            P[p + name + ".weight"] = torch.randn(o, k, generator=g) * std
            P[p + name + ".bias"] = torch.zeros(o)
    return P


def forward(P, idx, layers, n_head=12):
    B, T = idx.shape
    C = P["transformer.wte.weight"].shape[1]
    x = P["transformer.wte.weight"][idx] + P["transformer.wpe.weight"][:T]
    for i in range(layers):
        p = f"transformer.h.{i}."
        h = F.layer_norm(x, (C,), P[p + "ln_1.weight"], P[p + "ln_1.bias"], 1e-5)
        qkv = F.linear(h, P[p + "attn.c_attn.weight"], P[p + "attn.c_attn.bias"])
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in qkv.split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + F.linear(y, P[p + "attn.c_proj.weight"], P[p + "attn.c_proj.bias"])
        h = F.layer_norm(x, (C,), P[p + "ln_2.weight"], P[p + "ln_2.bias"], 1e-5)
        h = F.gelu(F.linear(h, P[p + "mlp.c_fc.weight"], P[p + "mlp.c_fc.bias"]), approximate="tanh")
        x = x + F.linear(h, P[p + "mlp.c_proj.weight"], P[p + "mlp.c_proj.bias"])
    x = F.layer_norm(x, (C,), P["transformer.ln_f.weight"], P["transformer.ln_f.bias"], 1e-5)
    return F.linear(x, P["transformer.wte.weight"])  # tied lm_head


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dump", default="")
    ap.add_argument("--profile", type=int, default=0,
                    help="after the timed steps, profile one step and print this many kernels")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # as keel: f32 matmuls in f32
    if a.dump and os.path.exists(os.path.join(a.dump, "model.safetensors")):
        P = read_safetensors(os.path.join(a.dump, "model.safetensors"))
        batch = read_safetensors(os.path.join(a.dump, "batch.safetensors"))
        idx, labels = batch["input_ids"], batch["labels"]
        src = "keel's initial parameters and tokens"
    else:
        P = init_params(a.layers)
        g = torch.Generator().manual_seed(7)
        toks = torch.randint(0, 50257, (a.batch, a.seq + 1), generator=g)
        idx, labels = toks[:, :-1].contiguous(), toks[:, 1:].reshape(-1).contiguous()
        src = "its own random initialization"
    P = {k: v.to(dev).float().requires_grad_(True) for k, v in P.items()}
    idx, labels = idx.to(dev), labels.to(dev).reshape(-1)
    decay = [v for k, v in P.items() if v.dim() >= 2]
    no_decay = [v for k, v in P.items() if v.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=6e-4, fused=True)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}; starting from {src}")
    def train_step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = forward(P, idx, a.layers)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(P.values()), 1.0)
        opt.step()
        return loss.item(), norm

    times, losses = [], []
    for step in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lv, norm = train_step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(lv)
        print(f"step {step}: loss {lv:.4f}  grad_norm {norm.item():.3f}  {times[-1] * 1e3:.1f} ms")
    if a.profile > 0:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            train_step()
            torch.cuda.synchronize()
        for key in ("device_time_total", "cuda_time_total"):  # newer and older torch
            try:
                print(prof.key_averages().table(sort_by=key, row_limit=a.profile,
                                                max_name_column_width=70))
                break
            except Exception:  # noqa: BLE001 (an unknown sort key)
                continue
    timed = sorted(times[min(2, a.steps - 1):])
    step_s = timed[len(timed) // 2]
    tok_s = a.batch * a.seq / step_s
    print(f"RESULT torch_tok_s={tok_s:.1f} step_ms={step_s * 1e3:.2f} loss0={losses[0]:.6f}")


if __name__ == "__main__":
    main()
