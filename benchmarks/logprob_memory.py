"""Peak memory of the last stage's log-prob + GRPO loss, forward and backward: full logits vs
chunked log-probs (stages/train/loss.py grpo_chunked_loss).

Measured with stages/train/live_bytes.LiveTensorBytes: the bytes of tensor storages created in the
loss's forward + backward and alive at the same time (logits, log-softmax, their gradients, the
head's weight gradient, hidden's gradient). Not counted: the hidden states and weights that exist
before (the same in both paths) and allocator overhead. Qwen2-0.5B's head: H = 896, V = 151,936.

    .venv/bin/python benchmarks/logprob_memory.py [--tokens 1024] [--shares 1.0 0.5] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from stages.train.live_bytes import LiveTensorBytes
from stages.train.loss import TARGET_FIELDS, LossConfig, grpo_chunked_loss, grpo_microbatch_loss

_LOSS = LossConfig(kl_beta=0.02)
_MIB = 2 ** 20


def make_target(tokens: int, vocab: int, completion_share: float, gen: torch.Generator) -> torch.Tensor:
    target = torch.zeros(1, tokens, len(TARGET_FIELDS))
    mask = (torch.rand(1, tokens, generator=gen) < completion_share).float()
    target[..., 0] = torch.randint(0, vocab, (1, tokens), generator=gen).float()
    target[..., 1] = mask
    target[..., 2] = torch.randn(1, tokens, generator=gen)
    target[..., 3] = target[..., 4] = -float(torch.log(torch.tensor(float(vocab))))
    target[..., 5] = mask / mask.sum().clamp(min=1)
    return target


def measure(fn) -> tuple[float, float]:
    with LiveTensorBytes() as mem:
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
    return mem.peak_bytes / _MIB, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.5],
                        help="fractions of the tokens that are completion tokens (scored)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    H, V, N = args.hidden, args.vocab, args.tokens
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(1, N, H, generator=gen, requires_grad=True)
    logits_mib = N * V * 4 / _MIB
    print(f"tokens {N}, hidden {H}, vocab {V}: fp32 logits alone = {logits_mib:.0f} MiB")
    print(f"{'path':<34} {'peak MiB':>9} {'/ logits':>9} {'fwd+bwd s':>10}")
    for share in args.shares:
        target = make_target(N, V, share, gen)
        runs = [("full logits", lambda: grpo_microbatch_loss(head(hidden), target, _LOSS)[0].backward())]
        for chunk in (1024, 256):
            runs.append((f"chunked, {chunk} tokens",
                         lambda c=chunk: grpo_chunked_loss(hidden, target, head, _LOSS, c)[0].backward()))
        for name, fn in runs:
            head.zero_grad(set_to_none=True)
            hidden.grad = None
            peak, seconds = measure(fn)
            print(f"{name + f' (scored {share:.0%})':<34} {peak:>9.0f} {peak / logits_mib:>9.2f} {seconds:>10.2f}")


if __name__ == "__main__":
    main()
