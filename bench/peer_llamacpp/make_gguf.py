"""GGUF files of this project's model presets with seeded random weights, for llama.cpp (docs/PEERS.md).

The same shapes as bench/bench_engine.py's presets (gpu_worker/checkpoint/presets.py): ``qwen3-30b-a3b`` as
llama.cpp's ``qwen3moe`` architecture and ``gpt-oss-120b`` as ``gpt-oss``. Only the experts' type varies between
files of one model: every dense weight is BF16 (the router ``ffn_gate_inp``, norms, biases and sinks F32, as
llama.cpp's converter writes them), as this project's engine keeps its dense weights in bf16.

Expert types (bytes per expert below; ``--list`` prints them for a model):
  bf16   BF16, 2 bytes a weight                               (ours: bf16, the same bytes)
  q8_0   Q8_0: blocks of 32 int8 + an f16 scale, 34/32 bytes    (ours: fp8, 1 byte a weight + 128x128 scales)
  q4_0   Q4_0: blocks of 32 4-bit + an f16 scale, 18/32 bytes    (ours: nvfp4, the same 18/32 bytes a weight)
  mxfp4  MXFP4: blocks of 32 E2M1 + an E8M0 scale, 17/32 bytes  (ours: mxfp4, the same bytes and format)
  nvfp4  NVFP4: blocks of 64 E2M1 + 4 E4M3 scales, 36/64 bytes  (ours: nvfp4, the same format; ggml adds one
         f32 scale per expert and matrix, written as 1.0)

The weights are random bits in a safe range, not Gaussian: a weight's value does not change the time of a
matrix product, and no value is NaN, infinite or subnormal. BF16 weights have a random sign and mantissa and a
magnitude in [2**-7, 2**-5) (rms about 0.018, like the presets' 0.02); quantized blocks have random codes and a
scale in a fixed small range. Bytes are drawn in 16 MiB chunks, each from its own generator seeded by (seed,
tensor, chunk): the file is the same for the same seed whatever the number of threads.

The file is written tensor by tensor (``gguf.GGUFWriter``'s header, key-values and tensor infos first, then
each tensor's data), so memory holds one tensor (at most ~600 MB) and its successor while the former is written.

The tokenizer is a synthetic byte-level BPE vocabulary of the model's size (``gpt2`` model, the model's
pre-tokenizer name): the 256 byte symbols, then two- and three-symbol tokens, one merge each, and the
special tokens at the preset's ids. llama-bench feeds random token ids; nothing decodes text.

Usage:
  python bench/peer_llamacpp/make_gguf.py --model qwen3-30b-a3b --experts q4_0 --out /tmp/q.gguf [--layers N]
  python bench/peer_llamacpp/make_gguf.py --model gpt-oss-120b --experts mxfp4 --out /tmp/g.gguf
  python bench/peer_llamacpp/make_gguf.py --model qwen3-30b-a3b --list      (bytes per expert of each type)
  --tiny: small dimensions (tests); --layers N: the first N layers of the shape (the sizes stay the model's)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T

CHUNK = 16 << 20                 # bytes a generator draws (one chunk of a tensor)
SEED_SALT = 0x9E37               # the random stream of a file: (seed, salt, tensor index, chunk index)

EXPERT_TYPES = {                 # --experts -> (ggml type, llama file type)
    "bf16": (T.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (T.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (T.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "mxfp4": (T.MXFP4, gguf.LlamaFileType.MOSTLY_MXFP4_MOE),
    "nvfp4": (T.NVFP4, gguf.LlamaFileType.MOSTLY_NVFP4),
}
OURS = {"bf16": "bf16", "q8_0": "fp8", "q4_0": "nvfp4", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}
ARCH_OF_PRESET = {"qwen3-30b-a3b": "qwen3moe", "gpt-oss-120b": "gpt-oss"}
PRE_TOKENIZER = {"qwen3moe": "qwen2", "gpt-oss": "gpt-4o"}


@dataclasses.dataclass(frozen=True)
class Shape:
    arch: str                    # llama.cpp architecture name: qwen3moe or gpt-oss
    name: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff: int                    # feed_forward_length (llama.cpp reads it; no dense FFN in these models)
    n_ctx_train: int
    rope_freq_base: float
    rms_eps: float
    specials: dict[int, str]     # token id -> text (CONTROL tokens)
    bos_id: int | None
    eos_id: int
    pad_id: int | None
    sliding_window: int = 0      # gpt-oss
    yarn: tuple[float, int] | None = None   # gpt-oss: (factor, original context length)

    def with_layers(self, n: int) -> "Shape":
        if not 1 <= n <= self.n_layer:
            raise SystemExit(f"--layers {n}: give 1 to {self.n_layer}")
        return dataclasses.replace(self, n_layer=n)


def preset_shape(model: str) -> Shape:
    """The shape of one of this project's presets (the numbers of its config.json)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from ftexpert.gpu_worker.checkpoint.presets import preset_config
    if model not in ARCH_OF_PRESET:
        raise SystemExit(f"--model {model!r}: give one of {', '.join(ARCH_OF_PRESET)}")
    c = preset_config(model)
    arch = ARCH_OF_PRESET[model]
    if arch == "qwen3moe":
        specials = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
        return Shape(arch, model, c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                     c.num_experts, c.top_k, c.expert_intermediate_size, int(c.extra["intermediate_size"]),
                     c.max_position_embeddings, c.rope_theta, c.rms_norm_eps, specials, bos_id=c.bos_token_id,
                     eos_id=c.eos_token_ids[0], pad_id=c.bos_token_id)
    g = c.extra["gpt_oss"]
    specials = {199999: "<|endoftext|>", 200002: "<|return|>", 200012: "<|call|>"}
    return Shape(arch, model, c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                 c.num_experts, c.top_k, c.expert_intermediate_size, c.expert_intermediate_size,
                 c.max_position_embeddings, c.rope_theta, c.rms_norm_eps, specials, bos_id=None,
                 eos_id=c.eos_token_ids[1], pad_id=c.pad_token_id, sliding_window=int(g["window"]),
                 yarn=(float(g["rope"]["factor"]), int(g["rope"]["original_max_position_embeddings"])))


def tiny_shape(arch: str, layers: int = 2) -> Shape:
    """Small dimensions of the same architecture (tests): every size a multiple of 64 (the NVFP4 block), the
    experts' intermediate size unlike the hidden size (a swapped shape shows)."""
    specials = {510: "<|endoftext|>", 511: "<|im_end|>"}
    if arch == "qwen3moe":
        return Shape(arch, "tiny-qwen3moe", 512, 64, layers, 4, 2, 32, 8, 2, 128, 256, 4096, 1e6, 1e-6, specials,
                     bos_id=510, eos_id=511, pad_id=510)
    if arch == "gpt-oss":
        return Shape(arch, "tiny-gpt-oss", 512, 64, layers, 4, 2, 16, 8, 2, 128, 128, 4096, 150000.0, 1e-5, specials,
                     bos_id=None, eos_id=511, pad_id=510, sliding_window=128, yarn=(32.0, 4096))
    raise SystemExit(f"unknown architecture {arch!r}")


# -- the tensors ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]          # ggml order: ne[0] is the innermost (contiguous) dimension
    type: T
    fill: str                    # bf16 | ones | small (f32 random in +-2**-6) | expert

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.type]
        n = int(np.prod(self.ne))
        if self.ne[0] % block:
            raise ValueError(f"{self.name}: ne[0]={self.ne[0]} is not a multiple of {self.type.name}'s block {block}")
        return n // block * size

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """numpy shape of the data as uint8 (outermost first), the shape GGUFWriter.add_tensor_info takes."""
        block, size = gguf.GGML_QUANT_SIZES[self.type]
        return (*reversed(self.ne[1:]), self.ne[0] // block * size)


def tensor_specs(s: Shape, expert_type: T) -> list[TensorSpec]:
    """Every tensor llama.cpp's loader of ``s.arch`` asks for (src/models/qwen3moe.cpp, openai-moe.cpp), with the
    shapes it checks, in a converter's order."""
    E, F, D, V = s.n_expert, s.n_ff_exp, s.n_embd, s.n_vocab
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    out = [TensorSpec("token_embd.weight", (D, V), T.BF16, "bf16")]
    for i in range(s.n_layer):
        b = f"blk.{i}."
        layer = [TensorSpec(b + "attn_norm.weight", (D,), T.F32, "ones")]
        if s.arch == "gpt-oss":
            layer.append(TensorSpec(b + "post_attention_norm.weight", (D,), T.F32, "ones"))
        layer += [TensorSpec(b + "attn_q.weight", (D, q), T.BF16, "bf16"),
                  TensorSpec(b + "attn_k.weight", (D, kv), T.BF16, "bf16"),
                  TensorSpec(b + "attn_v.weight", (D, kv), T.BF16, "bf16"),
                  TensorSpec(b + "attn_output.weight", (q, D), T.BF16, "bf16")]
        if s.arch == "qwen3moe":
            layer += [TensorSpec(b + "attn_k_norm.weight", (s.head_dim,), T.F32, "ones"),
                      TensorSpec(b + "attn_q_norm.weight", (s.head_dim,), T.F32, "ones"),
                      TensorSpec(b + "ffn_norm.weight", (D,), T.F32, "ones")]
        else:
            layer += [TensorSpec(b + "attn_q.bias", (q,), T.F32, "small"),
                      TensorSpec(b + "attn_k.bias", (kv,), T.F32, "small"),
                      TensorSpec(b + "attn_v.bias", (kv,), T.F32, "small"),
                      TensorSpec(b + "attn_output.bias", (D,), T.F32, "small"),
                      TensorSpec(b + "attn_sinks.weight", (s.n_head,), T.F32, "small")]
        layer.append(TensorSpec(b + "ffn_gate_inp.weight", (D, E), T.F32, "small"))
        if s.arch == "gpt-oss":
            layer.append(TensorSpec(b + "ffn_gate_inp.bias", (E,), T.F32, "small"))
        layer += [TensorSpec(b + "ffn_gate_exps.weight", (D, F, E), expert_type, "expert"),
                  TensorSpec(b + "ffn_up_exps.weight", (D, F, E), expert_type, "expert"),
                  TensorSpec(b + "ffn_down_exps.weight", (F, D, E), expert_type, "expert")]
        if s.arch == "gpt-oss":
            layer += [TensorSpec(b + "ffn_gate_exps.bias", (F, E), T.F32, "small"),
                      TensorSpec(b + "ffn_up_exps.bias", (F, E), T.F32, "small"),
                      TensorSpec(b + "ffn_down_exps.bias", (D, E), T.F32, "small")]
        if expert_type == T.NVFP4:              # ggml's per-expert scale of NVFP4 experts (optional to its loader)
            layer += [TensorSpec(b + f"ffn_{m}_exps.scale", (E,), T.F32, "ones") for m in ("gate", "up", "down")]
        out += layer
    out += [TensorSpec("output_norm.weight", (D,), T.F32, "ones"),
            TensorSpec("output.weight", (D, V), T.BF16, "bf16")]
    return out


def expert_bytes(s: Shape, expert_type: T) -> int:
    """Bytes of one expert (gate, up and down) in ``expert_type``."""
    block, size = gguf.GGML_QUANT_SIZES[expert_type]
    return 3 * s.n_embd * s.n_ff_exp // block * size


# -- the vocabulary --------------------------------------------------------------------------------------------

def byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode table: the symbol of each byte 0..255 in byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cps, n = [], 0
    for b in range(256):
        if b in keep:
            cps.append(b)
        else:
            cps.append(256 + n)
            n += 1
    return [chr(c) for c in cps]


def vocabulary(s: Shape) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a synthetic byte-level BPE vocabulary of ``s.n_vocab`` tokens."""
    sym = byte_symbols()
    tokens: list[str] = [""] * s.n_vocab
    types = [int(gguf.TokenType.NORMAL)] * s.n_vocab
    merges: list[str] = []
    for tid, text in s.specials.items():
        tokens[tid] = text
        types[tid] = int(gguf.TokenType.CONTROL)
    free = [i for i in range(s.n_vocab) if i not in s.specials]
    if len(free) < 256:
        raise ValueError("the vocabulary holds fewer than 256 ordinary tokens")
    for i, c in zip(free, sym):                 # the byte symbols first
        tokens[i] = c

    def pairs():
        for a in sym:
            for b in sym:
                yield a, b
    gen_pairs = pairs()
    made_pairs: list[str] = []
    rest = free[256:]
    k = 0
    while k < len(rest):                        # two-symbol tokens, then pair + symbol
        if len(made_pairs) < 256 * 256:
            a, b = next(gen_pairs)
            tokens[rest[k]] = a + b
            merges.append(f"{a} {b}")
            made_pairs.append(a + b)
        else:
            j = k - 256 * 256
            p, c = made_pairs[j // 256], sym[j % 256]
            tokens[rest[k]] = p + c
            merges.append(f"{p} {c}")
        k += 1
    return tokens, types, merges


# -- the random data -------------------------------------------------------------------------------------------

def _raw(seed: int, tensor_index: int, nbytes: int, pool: ThreadPoolExecutor) -> np.ndarray:
    """nbytes random bytes, CHUNK at a time, each chunk from its own seeded generator (in the pool's threads)."""
    out = np.empty(nbytes + (-nbytes) % 8, dtype=np.uint8)
    words = out.view(np.uint64)

    def fill(c: int) -> None:
        lo, hi = c * CHUNK // 8, min((c + 1) * CHUNK, out.size) // 8
        bg = np.random.PCG64(np.random.SeedSequence([seed, SEED_SALT, tensor_index, c]))
        words[lo:hi] = bg.random_raw(hi - lo)
    list(pool.map(fill, range(-(-out.size // CHUNK))))
    return out[:nbytes]


def _slices(n: int, parts: int) -> list[slice]:
    step = -(-n // parts)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def fill_bytes(spec: TensorSpec, seed: int, tensor_index: int, pool: ThreadPoolExecutor, threads: int) -> np.ndarray:
    """The tensor's data as uint8 [byte_shape]: seeded random bytes made valid for its type."""
    if spec.fill == "ones":
        return np.ones(spec.ne[::-1], dtype=np.float32).view(np.uint8).reshape(spec.byte_shape)
    raw = _raw(seed, tensor_index, spec.nbytes, pool)
    if spec.type in (T.BF16, T.F32):
        if spec.type == T.BF16:
            w = raw.view(np.uint16)                       # sign and 7 mantissa bits random; exponent 120 or 121
            keep, base, one = np.uint16(0x807F), np.uint16(120 << 7), np.uint16(1 << 7)
        else:
            w = raw.view(np.uint32)                       # |x| in [2**-8, 2**-6)
            keep, base, one = np.uint32(0x807FFFFF), np.uint32(119 << 23), np.uint32(1 << 23)

        def fix(sl: slice) -> None:
            v = w[sl]
            bit = (v >> np.asarray(8, v.dtype)) & np.asarray(1, v.dtype)    # a random bit for the exponent
            v &= keep
            v |= base
            v += bit * one
        list(pool.map(fix, _slices(w.size, threads)))
        return raw.reshape(spec.byte_shape)
    block, size = gguf.GGML_QUANT_SIZES[spec.type]
    blocks = raw.reshape(-1, size)                         # one row per block

    def fix_q(sl: slice) -> None:
        b = blocks[sl]
        if spec.type in (T.Q8_0, T.Q4_0):                 # f16 scale d: exponent field 2 (Q8_0) or 6 (Q4_0)
            d = b[:, 0:2].copy().view(np.uint16)
            d &= np.uint16(0x03FF)
            d |= np.uint16((2 if spec.type == T.Q8_0 else 6) << 10)
            b[:, 0:2] = d.view(np.uint8)
        elif spec.type == T.MXFP4:                        # E8M0 exponent 118..121
            b[:, 0] = np.uint8(118) + (b[:, 0] & np.uint8(3))
        elif spec.type == T.NVFP4:                        # 4 UE4M3 scales: exponent field 1 or 2, any mantissa
            s = b[:, 0:4]
            s &= np.uint8(0x0F)
            s += np.uint8(0x08)
    list(pool.map(fix_q, _slices(blocks.shape[0], threads)))
    return raw.reshape(spec.byte_shape)


# -- the file --------------------------------------------------------------------------------------------------

def add_metadata(w: gguf.GGUFWriter, s: Shape, expert_name: str) -> None:
    ftype = EXPERT_TYPES[expert_name][1]
    w.add_name(f"{s.name} (seeded random weights, {expert_name} experts)")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(int(ftype))
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_freq_base)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_expert_feed_forward_length(s.n_ff_exp)
    if s.arch == "gpt-oss":
        w.add_sliding_window(s.sliding_window)
        assert s.yarn is not None
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.yarn[0])
        w.add_rope_scaling_orig_ctx_len(s.yarn[1])
    tokens, types, merges = vocabulary(s)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE_TOKENIZER[s.arch])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if s.bos_id is not None:
        w.add_bos_token_id(s.bos_id)
    w.add_eos_token_id(s.eos_id)
    if s.pad_id is not None:
        w.add_pad_token_id(s.pad_id)
    w.add_add_bos_token(False)


def write_gguf(path: str | os.PathLike, s: Shape, expert_name: str, seed: int = 0, threads: int | None = None,
               log=print) -> dict:
    """Writes the file; returns {bytes, seconds, tensors, expert_bytes}."""
    expert_type = EXPERT_TYPES[expert_name][0]
    specs = tensor_specs(s, expert_type)
    threads = threads or min(16, os.cpu_count() or 1)
    t0 = time.perf_counter()
    w = gguf.GGUFWriter(path, s.arch)
    add_metadata(w, s, expert_name)
    for spec in specs:
        w.add_tensor_info(spec.name, spec.byte_shape, np.dtype(np.uint8), spec.nbytes, raw_dtype=spec.type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(sp.nbytes for sp in specs)
    done = 0
    last = t0
    with ThreadPoolExecutor(threads) as pool, ThreadPoolExecutor(1) as ahead:
        nxt = ahead.submit(fill_bytes, specs[0], seed, 0, pool, threads)
        for i, spec in enumerate(specs):
            data = nxt.result()
            if i + 1 < len(specs):                  # the next tensor is drawn while this one is written
                nxt = ahead.submit(fill_bytes, specs[i + 1], seed, i + 1, pool, threads)
            w.write_tensor_data(data)
            done += spec.nbytes
            del data
            if time.perf_counter() - last > 10:
                last = time.perf_counter()
                log(f"make_gguf: {done / 1e9:.1f} / {total / 1e9:.1f} GB, {done / 1e9 / (last - t0):.2f} GB/s")
    w.close()
    dt = time.perf_counter() - t0
    return {"bytes": os.path.getsize(path), "seconds": dt, "tensors": len(specs),
            "expert_bytes": expert_bytes(s, expert_type), "data_bytes": total}


def list_types(s: Shape) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from ftexpert.proto.expert_format import ExpertFormat, QuantLayout
    print(f"{s.name}: {s.n_layer} layers x {s.n_expert} experts, hidden {s.n_embd}, expert intermediate {s.n_ff_exp}")
    print(f"{'llama.cpp':<10} {'bytes/expert':>13} {'experts GB':>11}   {'ours':<7} {'bytes/expert':>13}")
    for name, (t, _) in EXPERT_TYPES.items():
        theirs = expert_bytes(s, t)
        ours_name = OURS[name]
        ours = (3 * s.n_embd * s.n_ff_exp * 2 if ours_name == "bf16"
                else QuantLayout(s.n_embd, s.n_ff_exp, ExpertFormat.parse(ours_name)).expert_nbytes)
        print(f"{name:<10} {theirs:>13,} {theirs * s.n_layer * s.n_expert / 1e9:>11.2f}   {ours_name:<7} {ours:>13,}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help=f"one of {', '.join(ARCH_OF_PRESET)}")
    p.add_argument("--tiny", action="store_true", help="small dimensions of the model's architecture (tests)")
    p.add_argument("--experts", default="bf16", choices=list(EXPERT_TYPES))
    p.add_argument("--out", help="the .gguf file to write")
    p.add_argument("--layers", type=int, default=0, help="only the first N layers (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="threads drawing the bytes (default: cores, at most 16)")
    p.add_argument("--list", action="store_true", help="print the bytes per expert of each type and exit")
    a = p.parse_args()
    s = tiny_shape(ARCH_OF_PRESET.get(a.model, a.model)) if a.tiny else preset_shape(a.model)
    if a.layers:
        s = s.with_layers(a.layers)
    if a.list:
        list_types(s)
        return 0
    if not a.out:
        p.error("--out is required")
    r = write_gguf(a.out, s, a.experts, seed=a.seed, threads=a.threads or None)
    print(f"make_gguf: {a.out}: {s.arch} {s.n_layer} layers, {a.experts} experts ({r['expert_bytes']:,} bytes an "
          f"expert), {r['tensors']} tensors, {r['bytes'] / 1e9:.2f} GB in {r['seconds']:.1f} s "
          f"({r['bytes'] / 1e9 / r['seconds']:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
