"""Greedy accuracy of a base model (an HF folder) on candidate GRPO tasks: which of them does it
solve some of the time, neither never (no reward signal) nor always (nothing to learn)?

Per task, ``--num-prompts`` prompts (seeded), the folder's chat template applied, one batched
transformers ``generate`` (greedy, ``--max-new-tokens``, stop at EOS). A completion is right when
the last integer in it equals the answer; ``math_answer`` is the project's reward
(stages/reward/math_answer.py, math-verify) on the same completions, for comparison.

  add2       What is 23 + 58?        two 2-digit numbers
  add21      What is 47 + 6?         2-digit plus 1-digit
  mul1       What is 7 * 8?          two 1-digit numbers (2..9)
  word       data/word_problems.jsonl, the first prompts, answered in \\boxed{}

    make model    # models/smollm2-135m-instruct
    .venv/bin/python benchmarks/base_accuracy.py [--model DIR] [--tasks add2 word] [--num-prompts 64]
        [--max-new-tokens 48] [--suffix " Answer with a number."] [--show 2] [--threads 2]
        [--temperature 0.6 --samples 4]   # sampled instead of greedy
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np
import torch

_INTEGER = re.compile(r"-?\d+(?:,\d{3})*")  # 1,234 counts as one integer


def arithmetic(op: str, a_range: tuple[int, int], b_range: tuple[int, int]):
    """A task of "What is a OP b?" prompts, a and b uniform in the closed ranges."""
    def make(num: int, seed: int) -> list[tuple[str, int]]:
        rng = np.random.default_rng(seed)
        a = rng.integers(a_range[0], a_range[1] + 1, num).tolist()
        b = rng.integers(b_range[0], b_range[1] + 1, num).tolist()
        return [(f"What is {x} {op} {y}?", x + y if op == "+" else x * y) for x, y in zip(a, b)]
    return make


def word_problems(num: int, seed: int) -> list[tuple[str, int]]:
    lines = Path("data/word_problems.jsonl").read_text().splitlines()[:num]
    return [(r["prompt"], int(r["answer"])) for r in map(json.loads, lines)]


TASKS = {"add2": arithmetic("+", (10, 99), (10, 99)), "add21": arithmetic("+", (10, 99), (1, 9)),
         "mul1": arithmetic("*", (2, 9), (2, 9)), "word": word_problems}


def last_integer(text: str) -> int | None:
    found = _INTEGER.findall(text)
    return int(found[-1].replace(",", "")) if found else None


def run_task(model, tokenizer, problems: list[tuple[str, int]], suffix: str, max_new_tokens: int,
             temperature: float = 0.0, samples: int = 1) -> dict:
    """Greedy (temperature 0) or ``samples`` sampled completions a prompt; results in prompt order,
    a prompt's samples together."""
    chats = [[{"role": "user", "content": prompt + suffix}] for prompt, _ in problems]
    batch = tokenizer.apply_chat_template(chats, add_generation_prompt=True, tokenize=True, padding=True,
                                          return_dict=True, return_tensors="pt")
    start = time.perf_counter()
    with torch.no_grad():
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                        num_return_sequences=samples) if temperature > 0 else dict(do_sample=False)
        out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, **sampling)
    seconds = time.perf_counter() - start
    new = out[:, batch["input_ids"].shape[1]:]  # [num_prompts, <= max_new_tokens]
    ended = new == tokenizer.eos_token_id
    # tokens before the first EOS (all of them where none came: cut at the cap)
    lengths = torch.where(ended.any(1), ended.int().argmax(1), new.shape[1])
    texts = [tokenizer.decode(row[:n]) for row, n in zip(new.tolist(), lengths.tolist())]
    problems = [p for p in problems for _ in range(samples if temperature > 0 else 1)]
    right = [last_integer(t) == answer for t, (_, answer) in zip(texts, problems)]
    return dict(texts=texts, right=right, problems=problems, lengths=lengths.tolist(), seconds=seconds,
                prompt_tokens=int(batch["attention_mask"].sum(1).float().mean()))


def math_answer_scores(texts: list[str], problems: list[tuple[str, int]]) -> list[float]:
    from stages.reward.math_answer import math_answer

    return [math_answer(prompt, text, str(answer)) for text, (prompt, answer) in zip(texts, problems)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/smollm2-135m-instruct", help="an HF model folder")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--suffix", default="", help="appended to every prompt, e.g. ' Answer with a number.'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled at this temperature")
    parser.add_argument("--samples", type=int, default=1, help="sampled completions a prompt (with --temperature)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--show", type=int, default=2, help="completions printed per task")
    args = parser.parse_args()
    import transformers

    torch.set_num_threads(args.threads)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rows = []
    for i, name in enumerate(args.tasks):
        problems = TASKS[name](args.num_prompts, args.seed * 1000 + i)
        torch.manual_seed(args.seed)
        res = run_task(model, tokenizer, problems, args.suffix, args.max_new_tokens, args.temperature, args.samples)
        problems = res["problems"]  # one per completion
        acc = float(np.mean(res["right"]))
        verified = float(np.mean(math_answer_scores(res["texts"], problems)))
        capped = float(np.mean([n == args.max_new_tokens for n in res["lengths"]]))
        rows.append((name, acc, np.sqrt(acc * (1 - acc) / len(problems)), verified, np.mean(res["lengths"]),
                     capped, res["prompt_tokens"], res["seconds"]))
        for (prompt, answer), text, ok in list(zip(problems, res["texts"], res["right"]))[: args.show]:
            print(f"[{name}] {prompt!r} -> {text!r} (answer {answer}: {'right' if ok else 'wrong'})")
    how = f"temperature {args.temperature} x {args.samples}" if args.temperature > 0 else "greedy"
    print(f"\n{args.model}, {how}, {args.num_prompts} prompts a task, <= {args.max_new_tokens} new tokens, "
          f"suffix {args.suffix!r}, {args.threads} threads")
    print("| task | last-integer accuracy | +- s.e. | math_answer | mean completion tokens | at the cap "
          "| mean prompt tokens | generate s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, acc, se, verified, length, capped, prompt, seconds in rows:
        print(f"| {name} | {acc:.3f} | {se:.3f} | {verified:.3f} | {length:.1f} | {capped:.2f} | {prompt} "
              f"| {seconds:.1f} |")


if __name__ == "__main__":
    main()
