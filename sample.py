"""
Sample from a trained model (baseline or LIMe, any tokenizer prepare_data.py writes).

    python sample.py --out_dir=out-compare/lime --start="ROMEO:" --num_samples=3 --max_new_tokens=300
    python sample.py --out_dir=out-compare/lime --start=FILE:prompt.txt --temperature=0.8 --top_k=200 --seed=1337
    python sample.py --out_dir=out-arithmetic/lime --start="(3+4)*5="   # a task checkpoint: solve an expression

stdout gets only the samples (prompt + continuation), separated by a line of dashes; notes and the
speed (tokens/second) go to stderr, so `python sample.py ... > samples.txt` keeps just the text.
The tokenizer is rebuilt from the dataset's meta.json stored in the checkpoint, nothing else is read.
"""

import argparse
import math
import os
import sys
import time
from contextlib import nullcontext

import torch

from prepare_data import (encode_problem, get_tokenizer, parse_expression, problem_tokens, problem_text, task_answer,
                          task_meta_problem)
from common import load_checkpoint, run_main, setup_device, variant_name

SEPARATOR = "---------------"


def read_prompt(start):
    """--start as given, or the contents of a file for --start=FILE:path."""
    if not start.startswith("FILE:"):
        return start
    path = start[len("FILE:"):]
    if not path:
        raise ValueError("--start=FILE: needs the prompt file's path after FILE:, e.g. --start=FILE:prompt.txt")
    if os.path.isdir(path):
        raise ValueError(f"prompt file {path} is a folder; give a text file: --start=FILE:path/to/prompt.txt")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"prompt file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path} is not valid UTF-8: {e.reason} at byte {e.start}") from None


def encode_prompt(tok, text, block_size, note=lambda msg: print(msg, file=sys.stderr)):
    """Token ids of the prompt, ready for generate(): never empty, at most block_size long."""
    if text == "":
        try:
            ids = tok.encode("\n")  # what nanoGPT starts from; char vocabularies may lack it
        except ValueError:
            ids = []
        if ids:
            note("empty prompt: starting from a newline")
        else:
            ids = [0]  # no newline token: fall back to the first token of the vocabulary
            note(f"empty prompt and no newline in the vocabulary: starting from token 0 {tok.decode(ids)!r}")
        return ids
    try:
        ids = tok.encode(text)
    except ValueError as e:  # char tokenizer: names the unknown characters
        raise ValueError(f"prompt: {e}") from None
    if len(ids) > block_size:
        note(f"prompt is {len(ids)} tokens, longer than block_size={block_size}: keeping the last {block_size}")
        ids = ids[-block_size:]
    return ids


def sample(model, tok, ids, num_samples=1, max_new_tokens=100, temperature=0.8, top_k=200, seed=1337,
           ctx=nullcontext()):
    """num_samples continuations of the prompt ids, decoded (prompt included), generated as one batch
    through the model's KV cache (inside ctx, e.g. a bf16 autocast). Returns (texts, seconds generating)."""
    device = next(model.parameters()).device
    torch.manual_seed(seed)  # seeds every device's generator, so the same seed gives the same text
    x = torch.tensor(ids, dtype=torch.long, device=device).repeat(num_samples, 1)  # (num_samples, T)
    t0 = time.perf_counter()
    with ctx:
        y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k)  # (num_samples, T + new)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    texts = []
    for row in y.tolist():
        # a model whose vocab was padded past the tokenizer's may (rarely) sample a padding id: drop it
        kept = [i for i in row if i < tok.vocab_size]
        if len(kept) < len(row):
            print(f"note: dropped {len(row) - len(kept)} sampled ids >= the tokenizer's vocab_size={tok.vocab_size}",
                  file=sys.stderr)
        texts.append(tok.decode(kept))
    return texts, dt


def solve_task(model, meta, text, ctx, temperature=0.0, top_k=None, seed=1337, num_samples=1):
    """A task checkpoint (prepare_data.py --task=arithmetic): the model's solutions of the expression in
    text (a trailing "=" optional), each up to its end token, and the true answer. -> (solutions, answer)."""
    p = meta["prime"]
    expr = parse_expression(text.strip().removesuffix("="), p)  # ValueError: not an expression mod p
    try:
        answer = problem_tokens(expr, p)[-2]
    except ZeroDivisionError:  # somewhere, not only at the end: (2/0)*0 is as undefined as 2/0
        raise ValueError(f"{text.strip()!r} divides by 0 (mod {p}), so it has no answer; the task never holds such "
                         f"a problem: give another expression") from None
    ids = encode_problem(expr + ["="], p)
    room = meta["row_length"] - len(ids)
    if room < 2:
        raise ValueError(f"the expression is {len(ids) - 1} tokens; this model's rows hold {meta['row_length']} "
                         f"tokens, too few for it and a solution")
    torch.manual_seed(seed)
    x = torch.tensor(ids, device=next(model.parameters()).device).repeat(num_samples, 1)  # (num_samples, P)
    with ctx:
        y = model.generate(x, room, temperature=temperature, top_k=top_k)                 # (num_samples, row_length)
    out = []
    for row in y.tolist():
        row = row[:row.index(meta["end_id"]) + 1] if meta["end_id"] in row[len(ids):] else row
        out.append((problem_text(row, p), task_answer(row[len(ids):], meta)))
    return out, answer


def main(argv=None):
    p = argparse.ArgumentParser(description="sample text from a checkpoint (out_dir/ckpt.pt)")
    p.add_argument("--out_dir", default="out", help="folder holding ckpt.pt")
    p.add_argument("--start", default="\n", help='prompt, or FILE:path to read it from a file ("" = empty)')
    p.add_argument("--num_samples", type=int, default=None, help="[3; 1 for a task checkpoint]")
    p.add_argument("--max_new_tokens", type=int, default=300, help="(a task checkpoint: the rest of a row)")
    p.add_argument("--temperature", type=float, default=None,
                   help="1.0 = as trained, < 1 = safer, 0 = greedy [0.8; 0 for a task checkpoint]")
    p.add_argument("--top_k", type=int, default=200, help="keep only the top_k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on cuda if supported, else float32), "
                                                   "float32, bfloat16, float16")
    args = p.parse_args(argv)
    if (args.num_samples is not None and args.num_samples < 1) or args.max_new_tokens < 0 or args.top_k < 0 \
            or (args.temperature is not None and not 0 <= args.temperature < math.inf):
        raise ValueError(f"need --num_samples >= 1, --max_new_tokens >= 0, --top_k >= 0 and a finite --temperature "
                         f">= 0, got {args.num_samples}, {args.max_new_tokens}, {args.top_k} and {args.temperature}")
    if not 0 <= args.seed < 2**64:  # torch.manual_seed's range
        raise ValueError(f"--seed must be from 0 to 2**64 - 1, got {args.seed}")

    device, _, dtype, ctx, _ = setup_device(args.device, args.dtype)  # ValueError if the device isn't there
    model, ckpt = load_checkpoint(args.out_dir, device)
    if "meta" not in ckpt:
        raise ValueError(f"{args.out_dir}/ckpt.pt has no 'meta' (the dataset's meta.json), so it can't be decoded")
    if ckpt["meta"].get("layout") == "rows":  # a task: the prompt is an expression, the output its solution
        why = task_meta_problem(ckpt["meta"])
        if why:
            raise ValueError(f"{args.out_dir}/ckpt.pt: its copy of the dataset's meta.json doesn't describe the task "
                             f"({why}), so its problems can't be read")
        return main_task(args, model, ckpt, ctx)
    args.num_samples = 3 if args.num_samples is None else args.num_samples
    args.temperature = 0.8 if args.temperature is None else args.temperature
    tok = get_tokenizer(ckpt["meta"])
    prompt = read_prompt(args.start)
    ids = encode_prompt(tok, prompt, model.config.block_size)
    variant = variant_name(model.config)
    print(f"{args.out_dir}: {variant}, iter {ckpt.get('iter_num', '?')}, {model.get_num_params():,} params, "
          f"{ckpt['meta']['tokenizer']} tokenizer, prompt {len(ids)} tokens, on {device} ({dtype})", file=sys.stderr)

    texts, dt = sample(model, tok, ids, args.num_samples, args.max_new_tokens, args.temperature,
                       args.top_k or None, args.seed, ctx)
    for text in texts:
        print(text)
        print(SEPARATOR)
    n = args.num_samples * args.max_new_tokens
    print(f"{n} tokens in {dt:.2f} s: {n / max(dt, 1e-9):,.0f} tokens/s "
          f"(batch of {args.num_samples}, KV cache, {device})", file=sys.stderr)


def main_task(args, model, ckpt, ctx):
    """sample.py on a task checkpoint: stdout gets the solution(s), stderr whether the answer is right."""
    temperature = 0.0 if args.temperature is None else args.temperature
    solutions, answer = solve_task(model, ckpt["meta"], read_prompt(args.start), ctx, temperature,
                                   args.top_k or None, args.seed, args.num_samples or 1)
    for text, got in solutions:
        print(text)
        print(SEPARATOR, flush=True)  # before the stderr line below
        symbols = ckpt["meta"]["chars"]
        print(f"answer {'(none: no end token, or not one number)' if got is None else symbols[got]}, true answer "
              f"{symbols[answer]}: {'right' if got == answer else 'wrong'}", file=sys.stderr)
    return solutions


if __name__ == "__main__":
    run_main(main, interrupted="interrupted")
