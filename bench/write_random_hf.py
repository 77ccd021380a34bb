#!/usr/bin/python3
"""A random Llama checkpoint in Hugging Face's sharded layout, streamed to disk tensor by tensor.

    /usr/bin/python3 bench/write_random_hf.py --shape 8b|1b|tiny --out DIR [--seed 1234]
        [--shard-gb 5] [--std 0.02] [--check]

`keel init-model` builds the whole model in f32 first (32 GB for Llama-3.1-8B), so the benches that
need a checkpoint of that size write it here instead: config.json (the real model's, with its
grouped-query heads and llama3 rope_scaling), shards `model-0000k-of-0000n.safetensors` of at most
--shard-gb GB (HF's max_shard_size; a shard holds whole tensors) and model.safetensors.index.json,
or, as save_pretrained does when everything fits in one shard (Llama-3.2-1B), model.safetensors.
Values are bf16 N(0, std) (HF's _init_weights with initializer_range = std), norm weights 1: each
value is one of the 65536 quantiles of N(0, std) rounded to bf16, picked by 16 random bits: one
random pass and one table look-up per value (on this project's loaded VM, 4 s per 64M values where
numpy's normal sampler plus a bf16 conversion took 32 s; the 1B shape takes 15 s in all). Each
tensor is generated and written in chunks of CHUNK values, so the process holds a few hundred MB
(432 MB measured for the 1B shape) whatever the model's size.

Each weight file is renamed into place when complete and the index is written last: a directory
whose config.json and index match what this run would write and whose weight files have the right
sizes is kept as it is (`--check` only reports that), and a write interrupted half-way is redone.
Needs numpy (python3-numpy, /usr/bin/python3 on Debian).
"""
import argparse
import json
import os
import sys

from statistics import NormalDist

import numpy as np

CHUNK = 1 << 26  # elements generated at a time (128 MB of random bits, 128 MB of bf16)

# Real config.json files (transformers' LlamaConfig fields), minus the weights' dtype which the
# writer sets. "tiny" keeps every structural feature of the real ones (GQA, llama3 scaling, an
# untied head) at seconds-long sizes, for quick checks of the benches that read these files.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 128256,
}
LLAMA_32_1B = dict(LLAMA_31_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   head_dim=64, tie_word_embeddings=True,
                   rope_scaling=dict(LLAMA_31_8B["rope_scaling"], factor=32.0))
TINY = dict(LLAMA_31_8B, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=2048,
            rope_scaling=dict(LLAMA_31_8B["rope_scaling"], factor=32.0,
                              original_max_position_embeddings=64))
SHAPES = {"8b": LLAMA_31_8B, "1b": LLAMA_32_1B, "tiny": TINY}


def tensors(cfg):
    """(name, shape, init) in HF's order; init is 'normal' or 'ones'."""
    C, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim", C // H)
    out = [("model.embed_tokens.weight", (V, C), "normal")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (C,), "ones"),
                (p + "self_attn.q_proj.weight", (H * D, C), "normal"),
                (p + "self_attn.k_proj.weight", (Hkv * D, C), "normal"),
                (p + "self_attn.v_proj.weight", (Hkv * D, C), "normal"),
                (p + "self_attn.o_proj.weight", (C, H * D), "normal"),
                (p + "post_attention_layernorm.weight", (C,), "ones"),
                (p + "mlp.gate_proj.weight", (F, C), "normal"),
                (p + "mlp.up_proj.weight", (F, C), "normal"),
                (p + "mlp.down_proj.weight", (C, F), "normal")]
    out.append(("model.norm.weight", (C,), "ones"))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (V, C), "normal"))
    return out


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def plan_shards(items, max_bytes):
    """Whole tensors into shards of at most max_bytes (a larger tensor gets one of its own), in
    order, as transformers' shard_checkpoint does."""
    shards, cur, size = [], [], 0
    for it in items:
        b = numel(it[1]) * 2
        if cur and size + b > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += b
    if cur:
        shards.append(cur)
    return shards


def header_bytes(items):
    """The safetensors header of a shard (u64 length + JSON, padded with spaces to 8 bytes)."""
    h, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in items:
        n = numel(shape) * 2
        h[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    text = json.dumps(h, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, off


def to_bf16(x):
    """f32 -> bf16 bits, rounded to nearest even (finite inputs)."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype("<u2")


def normal_table(std):
    """bf16 bits of the 65536 quantiles (i + 0.5) / 65536 of N(0, std)."""
    nd = NormalDist(0.0, std)
    return to_bf16(np.array([nd.inv_cdf((i + 0.5) / 65536) for i in range(65536)]))


def write_tensor(f, rng, shape, init, table):
    n = numel(shape)
    if init == "ones":
        f.write(np.full(n, 0x3F80, dtype="<u2").tobytes())  # bf16 1.0
        return
    for start in range(0, n, CHUNK):
        bits = np.frombuffer(rng.bytes(2 * min(CHUNK, n - start)), dtype="<u2")
        f.write(table[bits].tobytes())


def expected(cfg, std, max_bytes):
    items = tensors(cfg)
    shards = plan_shards(items, max_bytes)
    n = len(shards)
    names = (["model.safetensors"] if n == 1 else
             [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)])
    sizes = [len(header_bytes(s)[0]) + header_bytes(s)[1] for s in shards]
    index = {"metadata": {"total_size": sum(numel(t[1]) * 2 for t in items)},
             "weight_map": {t[0]: names[k] for k, s in enumerate(shards) for t in s}}
    config = dict(cfg, initializer_range=std, torch_dtype="bfloat16")
    return items, shards, names, sizes, index, config


def up_to_date(out, index, config, names, sizes):
    try:
        if len(names) > 1:
            with open(os.path.join(out, "model.safetensors.index.json")) as f:
                if json.load(f) != index:
                    return False
        with open(os.path.join(out, "config.json")) as f:
            if json.load(f) != config:
                return False
        return all(os.path.getsize(os.path.join(out, n)) == s for n, s in zip(names, sizes))
    except (OSError, ValueError):
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--std", type=float, default=0.02, help="init std (initializer_range)")
    p.add_argument("--shard-gb", type=float, default=5.0, help="max shard size in GB (1e9 bytes)")
    p.add_argument("--check", action="store_true", help="only say whether DIR is up to date "
                   "(exit 0) or not (exit 1)")
    a = p.parse_args()
    cfg = SHAPES[a.shape]
    items, shards, names, sizes, index, config = expected(cfg, a.std, int(a.shard_gb * 1e9))
    params = sum(numel(t[1]) for t in items)
    what = (f"Llama {a.shape}: {params / 1e9:.3f}B params, bf16, {len(shards)} shard(s), "
            f"{sum(sizes) / 1e9:.2f} GB")
    if up_to_date(a.out, index, config, names, sizes):
        print(f"{a.out}: up to date ({what})")
        return 0
    if a.check:
        print(f"{a.out}: missing or different ({what} expected)")
        return 1
    os.makedirs(a.out, exist_ok=True)
    # Weight files of another layout go first, so that a reader never sees two (the index last).
    for f in os.listdir(a.out):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(a.out, f))
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    rng, table = np.random.default_rng(a.seed), normal_table(a.std)
    for shard, name, size in zip(shards, names, sizes):
        path = os.path.join(a.out, name)
        with open(path + ".tmp", "wb") as f:
            f.write(header_bytes(shard)[0])
            for _, shape, init in shard:
                write_tensor(f, rng, shape, init, table)
        if os.path.getsize(path + ".tmp") != size:
            raise SystemExit(f"{path}: wrote {os.path.getsize(path + '.tmp')} bytes, "
                             f"expected {size}")
        os.replace(path + ".tmp", path)
        print(f"  {name}: {len(shard)} tensors, {size / 1e9:.2f} GB", flush=True)
    if len(names) > 1:
        with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    print(f"wrote {a.out}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
