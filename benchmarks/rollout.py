"""Rollout throughput: the paged continuous-batching engine vs the static engine vs transformers.

One run measures side by side, interleaved per repetition (minimum time kept), on a random Llama of
hidden 512, 8 layers, 8 heads, MLP 1024, vocab 2560 (23.6M parameters), 16 prompts x G 8, <= 64 new
tokens, prompts of 16..48 tokens:

  paged     stages.rollout.generate (this engine)
  gather    the same engine with the previous decode attention, kept below: every step gathers each
            row's blocks out of the pool (index_select of whole blocks) and runs masked SDPA
  static    the previous engine, kept below: one static batch, prefix-shared flat KV cache,
            every row decoded until the last one finishes
  hf        transformers LlamaForCausalLM.generate with the same weights, do_sample, output_scores
            (behaviour log-probs gathered from the scores, as a rollout needs them)

Two workloads: ``skewed`` (the EOS logit is raised through a constant residual direction, so
completion lengths spread roughly geometrically with a tail at the cap) and ``fixed`` (no stop
token: every completion runs 64 tokens). For ``fixed`` the paged engine's model FLOP/s (2 FLOPs per
non-embedding parameter per token plus attention's 4 * L * q_dim * context, Kaplan et al. 2020
Sec. 2.1) is compared with a plain matmul of the decode shapes ([128, 512] x each weight matrix).
Speculative decoding (k = 2, 4; draft = first 2 layers + head) is timed on ``skewed``.

On the CPU the engines are compared by CPU seconds (what each used on a shared machine). With
``--device cuda`` (``--dtype`` auto: bfloat16) only ``paged`` and ``hf`` run, both on the GPU in that
dtype, timed by wall clock with the device synchronised, and the matmul reference is the same
decode shapes on the GPU. ``--prompts`` scales the batch (16 is the CPU workload; a GPU needs more
rows to fill). ``--max-num-seqs`` caps the engine's live sequences (rollout.max_num_seqs, 256 by
default; 0: every row at once, as ``generate`` runs them): past the cap the engine admits the rest in
later waves. ``--only ops`` counts the aten ops each dispatches per decode step (a GPU launches a
kernel or more for each; the count is the same on any device).

The engines behind the rollout contract on the real model (native, vLLM, transformers' generate on
SmolLM2-135M) are compared by benchmarks/engines.py.

    .venv/bin/python benchmarks/rollout.py [--threads 1] [--reps 1] [--only skewed|fixed|speculative|ops] [--no-hf]
    python3 benchmarks/rollout.py --device cuda --max-num-seqs 0 --reps 3 --prompts 16 --prompts 128   # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import time

import numpy as np
import torch
import torch.nn.functional as F

from stages.policy import DecoderConfig, build_stage, to_hf_name
from stages.rollout import EngineConfig, SamplingParams, generate
from stages.rollout import engine as engine_module
from stages.rollout.paged_kv import PagedKVCache
from stages.rollout.engine import engine_placement
from stages.rollout.speculative import draft_from_target, generate_speculative

_CFG = DecoderConfig(vocab_size=2560, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=8, head_dim=64, eos_token_id=1, pad_token_id=0)
_PROMPTS, _G, _MAX_NEW = 16, 8, 64
_DEVICE, _DTYPE = torch.device("cpu"), torch.float32  # main() sets them from --device / --dtype
_MAX_NUM_SEQS = EngineConfig.max_num_seqs  # main() sets it from --max-num-seqs (0: every row of the batch)
_EOS = 1
_EOS_LOGIT = 4.4  # vs 2,559 near-uniform logits (std ~0.45): p(EOS) ~ 3% a token, most completions far below 64


def make_model(seed: int = 0) -> torch.nn.Module:
    model = build_stage(_CFG)
    model.init_weights(torch.Generator().manual_seed(seed), std=0.02)
    with torch.no_grad():
        # Dimension 0 of every embedding is large, so after the final RMSNorm it is nearly constant;
        # lm_head[EOS, 0] scaled by its measured value then gives a nearly constant EOS logit.
        model.embed_tokens.weight[:, 0] = 20.0
        model.return_hidden = True
        normed0 = model(torch.tensor([make_prompts()[0]]))[0, :, 0].mean()
        model.return_hidden = False
        model.lm_head.weight[_EOS, 0] = _EOS_LOGIT / normed0
    return model.eval()


def make_prompts(seed: int = 0, num: int = _PROMPTS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, _CFG.vocab_size, rng.integers(16, 49)).tolist() for _ in range(num)]


def _engine(prompts, group_size: int = _G) -> EngineConfig:
    """The engine's limits for one batch: ``--max-num-seqs`` live sequences (0: all of its rows)."""
    return EngineConfig(max_num_seqs=_MAX_NUM_SEQS or len(prompts) * group_size)


def _on_gpu() -> bool:
    return _DEVICE.type == "cuda"


# -- the previous engine: one static batch over a prefix-shared flat cache ---------------------------------
class _PrefixSharedKVCache:
    def __init__(self, L, P, G, width, N, kvh, d, prompt_mask):
        self.k_prefix, self.v_prefix = torch.zeros(L, P, kvh, width, d), torch.zeros(L, P, kvh, width, d)
        self.k_decode, self.v_decode = torch.zeros(L, P * G, kvh, N, d), torch.zeros(L, P * G, kvh, N, d)
        self.prompt_mask, self.group_size, self.num_decoded, self.prefilling = prompt_mask, G, 0, True

    def attend(self, layer, q, k, v):
        if self.prefilling:
            T = q.shape[2]
            self.k_prefix[layer], self.v_prefix[layer] = k, v
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & self.prompt_mask[:, None, None, :]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask | torch.eye(T, dtype=torch.bool))
        n = self.num_decoded
        self.k_decode[layer, :, :, n], self.v_decode[layer, :, :, n] = k[:, :, 0], v[:, :, 0]
        PG, h, _, d = q.shape
        G, kvh = self.group_size, k.shape[1]
        P, rep = PG // G, h // kvh
        qg = q.view(P, G, kvh, rep, d)
        kp, vp = self.k_prefix[layer], self.v_prefix[layer]
        kd = self.k_decode[layer, :, :, : n + 1].view(P, G, kvh, n + 1, d)
        vd = self.v_decode[layer, :, :, : n + 1].view(P, G, kvh, n + 1, d)
        s_prefix = torch.einsum("pgkrd,pkld->pgkrl", qg, kp) * d ** -0.5
        s_prefix = s_prefix.masked_fill(~self.prompt_mask[:, None, None, None, :], float("-inf"))
        s_decode = torch.einsum("pgkrd,pgknd->pgkrn", qg, kd) * d ** -0.5
        probs = torch.softmax(torch.cat([s_prefix, s_decode], dim=-1), dim=-1)
        Lp = kp.shape[2]
        out = (torch.einsum("pgkrl,pkld->pgkrd", probs[..., :Lp], vp)
               + torch.einsum("pgkrn,pgknd->pgkrd", probs[..., Lp:], vd))
        return out.reshape(PG, h, 1, d)


@torch.no_grad()
def static_generate(model, prompts, params: SamplingParams, gen: torch.Generator) -> np.ndarray:
    """The previous engine's algorithm; returns completion lengths."""
    P, G, N = len(prompts), params.group_size, params.max_new_tokens
    width = max(len(p) for p in prompts)
    ids, mask = torch.zeros((P, width), dtype=torch.long), torch.zeros((P, width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), True
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    cfg = model.cfg
    cache = _PrefixSharedKVCache(cfg.num_hidden_layers, P, G, width, N, cfg.num_key_value_heads, cfg.head_dim, mask)
    logits = model(ids, positions, cache)[:, -1].repeat_interleave(G, dim=0)
    cache.prefilling = False
    next_pos = positions[:, -1].repeat_interleave(G) + 1
    done, length = torch.zeros(P * G, dtype=torch.bool), torch.zeros(P * G, dtype=torch.long)
    stop = torch.tensor(params.stop_ids, dtype=torch.long)
    for n in range(N):
        logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
        _ = logp.gather(-1, tok[:, None])
        tok = torch.where(done, params.pad_id, tok)
        length += (~done).long()
        done = done | torch.isin(tok, stop)
        if bool(done.all()) or n == N - 1:
            break
        logits = model(tok[:, None], (next_pos + n)[:, None], cache)[:, -1]
        cache.num_decoded += 1
    return length.numpy()


# -- the previous decode attention: each row's blocks gathered from the pool every step ------------------
class _GatherKVCache(PagedKVCache):
    def prepare_decode(self, seqs, positions):
        P = self.page_size
        nb = max(len(self.tables[s]) for s in seqs)
        table = torch.tensor([self.tables[s] + [0] * (nb - len(self.tables[s])) for s in seqs])  # (B, nb)
        write = (table.gather(1, positions // P) * P + positions % P).reshape(-1)  # (B*T,)
        mask = torch.arange(nb * P)[None, None, :] <= positions[:, :, None]  # (B, T, S)
        shape = (table.numel(), self.k[0].view(self.num_blocks, -1).shape[1])
        if getattr(self, "_gather_k", torch.empty(0)).shape[0] < shape[0]:  # buffers reused across steps
            self._gather_k, self._gather_v = torch.empty(shape, dtype=self.k.dtype), torch.empty(shape, dtype=self.k.dtype)
        self._step = ("decode", table.reshape(-1), write, mask)

    def _attend_decode(self, layer, q, k, v):
        _, blocks, write, mask = self._step
        B, h, T, d = q.shape
        kvh, S, n = k.shape[1], mask.shape[-1], blocks.numel()
        self.k[layer].index_copy_(0, write, k.transpose(1, 2).reshape(B * T, kvh, d))
        self.v[layer].index_copy_(0, write, v.transpose(1, 2).reshape(B * T, kvh, d))
        keys = torch.index_select(self.k[layer].view(self.num_blocks, -1), 0, blocks, out=self._gather_k[:n])
        values = torch.index_select(self.v[layer].view(self.num_blocks, -1), 0, blocks, out=self._gather_v[:n])
        keys, values = keys.view(B, S, kvh, d).transpose(1, 2), values.view(B, S, kvh, d).transpose(1, 2)
        qg = q.reshape(B, kvh, h // kvh * T, d)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask.repeat(1, h // kvh, 1)[:, None])
        return out.reshape(B, h, T, d)


@contextlib.contextmanager
def _gather_attention():
    """generate() with _GatherKVCache as its cache class."""
    engine_module.PagedKVCache = _GatherKVCache
    try:
        yield
    finally:
        engine_module.PagedKVCache = PagedKVCache


def gather_generate(model, prompts, params: SamplingParams, gen: torch.Generator) -> np.ndarray:
    with _gather_attention():
        return generate(model, prompts, params, gen, _engine(prompts)).length


# -- transformers ---------------------------------------------------------------------------------------
def hf_model(model) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**_CFG.to_hf())).eval()
    hf.load_state_dict({to_hf_name(k): v.float().cpu() for k, v in model.state_dict().items()})
    return hf.to(device=_DEVICE, dtype=_DTYPE)


@torch.no_grad()
def hf_generate(hf, prompts, params: SamplingParams, seed: int) -> np.ndarray:
    """LlamaForCausalLM.generate on the G-fold repeated, left-padded prompts; returns completion lengths."""
    torch.manual_seed(seed)
    rows = [p for p in prompts for _ in range(params.group_size)]
    width = max(len(p) for p in rows)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in rows], device=_DEVICE)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=_DEVICE)
    stop = list(params.stop_ids) or None
    out = hf.generate(ids, attention_mask=attn, do_sample=True, max_new_tokens=params.max_new_tokens,
                      temperature=params.temperature, top_k=0, top_p=1.0, eos_token_id=stop, pad_token_id=0,
                      output_scores=True, return_dict_in_generate=True, min_new_tokens=0)
    new = out.sequences[:, width:]
    logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1).gather(-1, new[..., None])
    assert logp.shape[:2] == new.shape
    if stop is None:
        return np.full(len(rows), new.shape[1])
    new = new.cpu()
    is_stop = torch.isin(new, torch.tensor(stop))
    first = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, torch.tensor(new.shape[1]))
    return first.numpy()


# -- FLOPs and the matmul reference ----------------------------------------------------------------------
def _weights(model) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n]


def model_flops(model, prompts, lengths: np.ndarray) -> float:
    """2 FLOPs per non-embedding weight per token (prefill once per prompt, decode per fed token) + attention."""
    per_token = 2 * sum(w.numel() for w in _weights(model))
    L, qd = _CFG.num_hidden_layers, _CFG.num_attention_heads * _CFG.head_dim
    flops = 0.0
    for i, p in enumerate(prompts):
        n = len(p)
        flops += n * per_token + 4 * L * qd * n * (n + 1) / 2
        for m in lengths[i * _G:(i + 1) * _G]:
            fed = int(m) - 1  # the last token is never fed
            flops += fed * per_token + 4 * L * qd * sum(n + j + 1 for j in range(fed))
    return flops


def matmul_flops_per_s(model, batch: int, reps: int = 20) -> float:
    """FLOP per CPU-second (on a GPU: per second, synchronised) of F.linear over [batch, in] x every
    decode weight, back to back (best of reps)."""
    ws = _weights(model)
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], device=w.device, dtype=w.dtype) for w in ws}
    best = float("inf")
    for _ in range(reps):
        wall, cpu, _ = _timed(lambda: [F.linear(xs[w.shape[1]], w) for w in ws])
        best = min(best, wall if _on_gpu() else cpu)
    return 2 * batch * sum(w.numel() for w in ws) / best


def _sync() -> None:
    if _on_gpu():
        torch.cuda.synchronize(_DEVICE)


def _timed(fn):
    """(wall seconds, CPU seconds of this process, result): CPU time is what the run itself used on a
    shared machine, wall time also counts waiting for a core (on a GPU, the device's work is waited
    for before the clock stops)."""
    _sync()
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    _sync()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def _compare(model, hf, prompts, name: str, stop: tuple[int, ...], reps: int) -> None:
    params = SamplingParams(_G, _MAX_NEW, 1.0, 1.0, stop, 0)
    clock = 0 if _on_gpu() else 1  # which of (wall, cpu) decides "best" and the ratios
    unit = "s" if _on_gpu() else "cpu-s"
    best: dict[str, tuple[float, float, np.ndarray]] = {}
    if _on_gpu():  # cuBLAS handles, lazily loaded kernels: once, untimed
        generate(model, prompts, params, torch.Generator().manual_seed(0), _engine(prompts))
        if hf is not None:
            hf_generate(hf, prompts, params, 0)
    for rep in range(reps):
        runs = {"paged": lambda: generate(model, prompts, params, torch.Generator().manual_seed(rep),
                                          _engine(prompts)).length}
        if not _on_gpu():  # the earlier engines, kept for the CPU comparison only
            runs["gather"] = lambda: gather_generate(model, prompts, params, torch.Generator().manual_seed(rep))
            runs["static"] = lambda: static_generate(model, prompts, params, torch.Generator().manual_seed(rep))
        if hf is not None:
            runs["hf"] = lambda: hf_generate(hf, prompts, params, rep)
        for key, fn in runs.items():
            timed = _timed(fn)
            if key not in best or timed[clock] < best[key][clock]:
                best[key] = timed
    lengths = best["paged"][2]
    print(f"\n[{name}, {len(prompts)} prompts x G {_G}] completion length mean {lengths.mean():.1f}, "
          f"p50 {np.median(lengths):.0f}, max {lengths.max()}, at cap {np.mean(lengths == _MAX_NEW):.0%}")
    base = lengths.sum() / best["paged"][clock]
    for key, (wall, cpu, n) in best.items():
        rate = n.sum() / (wall, cpu)[clock]
        print(f"  {key:7s} wall {wall:6.2f} s  cpu {cpu:6.2f} s  {n.sum() / cpu:6.0f} tok/cpu-s  "
              f"{n.sum() / wall:6.0f} tok/s  paged / {key} = {base / rate:.2f}x ({unit})")
    if name == "fixed":
        rows = len(prompts) * _G
        mm = matmul_flops_per_s(model, rows)
        fl = model_flops(model, prompts, lengths)
        print(f"  matmul [{rows}, *] x weights: {mm / 1e9:.1f} GFLOP per {unit}")
        for key, (wall, cpu, n) in best.items():  # every engine generates the same rows x 64 tokens here
            t = (wall, cpu)[clock]
            print(f"  {key:7s} model FLOP/s: {fl / t / 1e9:.1f} GFLOP per {unit} = {fl / t / mm:.0%} of matmul "
                  f"({fl / wall / 1e9:.1f} GFLOP/s wall)")


def _speculative(model, prompts, rows: int) -> None:
    """Plain vs speculative (k = 2, 4) on ``rows`` sequences of fixed length (no stop token)."""
    G = min(_G, rows)
    prompts = prompts[: max(1, rows // G)]
    params = SamplingParams(G, _MAX_NEW, 1.0, 1.0, (), 0)
    draft = draft_from_target(model, 2)
    clock, unit = (0, "wall") if _on_gpu() else (1, "cpu")
    if _on_gpu():  # warm-up, untimed: the first calls pay for kernel loading
        generate(model, prompts, params, torch.Generator().manual_seed(0), _engine(prompts, G))
        generate_speculative(model, draft, prompts, params, torch.Generator().manual_seed(0), 2,
                             engine=_engine(prompts, G))
    plain = _timed(lambda: generate(model, prompts, params, torch.Generator().manual_seed(0),
                                    _engine(prompts, G)))[clock]
    print(f"\n[speculative, {len(prompts) * G} rows x {_MAX_NEW} tokens, draft = 2 of 8 layers] plain {unit} {plain:.2f} s")
    for k in (2, 4):
        timed = _timed(lambda: generate_speculative(model, draft, prompts, params, torch.Generator().manual_seed(0), k,
                                                    engine=_engine(prompts, G)))
        t, st = timed[clock], timed[2][1]
        a = st.acceptance
        print(f"  k={k}: {unit} {t:.2f} s, acceptance {a:.2f}, tokens per target forward {st.tokens_per_verify:.2f} "
              f"(Leviathan Eq. 1: {(1 - a ** (k + 1)) / (1 - a):.2f}), speed-up {plain / t:.2f}x")


def _count_ops(model, hf, prompts) -> None:
    """Aten ops dispatched per decode step (no stop token, 64 tokens) by the engine and by
    ``generate``: on a GPU each is a kernel launch or more, and a small model's step is bound by them."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    params = SamplingParams(_G, _MAX_NEW, 1.0, 1.0, (), 0)
    runs = {"paged": lambda: generate(model, prompts, params, torch.Generator().manual_seed(0), _engine(prompts))}
    if hf is not None:
        runs["hf"] = lambda: hf_generate(hf, prompts, params, 0)
    print(f"\n[ops, {len(prompts)} prompts x G {_G}, {_MAX_NEW} tokens]")
    for key, fn in runs.items():
        with _Count() as counted:
            fn()
        print(f"  {key:7s} {sum(counted.ops.values()) / _MAX_NEW:7.0f} aten ops per decode step")


def main() -> None:
    global _DEVICE, _DTYPE, _MAX_NUM_SEQS
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--only", choices=["skewed", "fixed", "speculative", "ops"])
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (rollout.device's spellings)")
    ap.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (bfloat16 on CUDA)")
    ap.add_argument("--prompts", type=int, action="append",
                    help=f"prompts per batch (G {_G} rows each), repeatable; default {_PROMPTS}")
    ap.add_argument("--max-num-seqs", type=int, default=_MAX_NUM_SEQS,
                    help="live sequences the engine holds (rollout.max_num_seqs; default the engine's); 0: every row "
                         "of the batch at once, as transformers' generate runs it")
    args = ap.parse_args()
    _MAX_NUM_SEQS = args.max_num_seqs
    _DEVICE, _DTYPE = engine_placement(args.device, args.dtype)
    torch.set_num_threads(args.threads)
    model = make_model().to(device=_DEVICE, dtype=_DTYPE)
    hf = None if args.no_hf else hf_model(model)
    params_n = sum(p.numel() for p in model.parameters())
    where = torch.cuda.get_device_name(_DEVICE) if _on_gpu() else f"cpu, threads {args.threads}"
    print(f"model {params_n / 1e6:.1f}M params, G {_G}, <= {_MAX_NEW} new, {where}, {_DTYPE}, torch {torch.__version__}, "
          f"engine max_num_seqs {_MAX_NUM_SEQS or 'all rows'}")
    for num in args.prompts or [_PROMPTS]:
        prompts = make_prompts(num=num)
        if args.only in (None, "skewed"):
            _compare(model, hf, prompts, "skewed", (_EOS,), args.reps)
        if args.only in (None, "fixed"):
            _compare(model, hf, prompts, "fixed", (), args.reps)
        if args.only in (None, "speculative"):
            _speculative(model, prompts, 4)
            _speculative(model, prompts, num * _G)
        if args.only == "ops":
            _count_ops(model, hf, prompts)


if __name__ == "__main__":
    main()
