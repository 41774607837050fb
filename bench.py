"""
What does LIMe cost (and Hyper-Connections, with --hc_rate)? Times a full training step and counts activation
memory, baseline vs LIMe (vs HC).

    python bench.py                                   # 8 and 32 layers at width 256, plus deep-narrow
    python bench.py --depths=4,16 --repeats=3 --rounds=1 --deep=False
    python bench.py --device=cuda                     # bf16 autocast on CUDA (or cuda:1, ...)
    python bench.py --fused_mix=False                 # LIMe through the plain formula (PlainMix) instead
    python bench.py --hc_rate=4                       # also Hyper-Connections (4 streams, dynamic): HC columns

Each configuration runs in a fresh process (so peak memory is its own), and baseline and LIMe alternate
for --rounds rounds, so that a machine whose speed drifts slows both alike. Per configuration we measure:
  step ms    median wall time of forward + backward + AdamW step, after warm-up steps
  act mem    bytes autograd keeps for backward in one forward pass (saved_tensors_hooks, unique storages,
             parameters excluded): deterministic, the same on every machine; the primary memory figure
  peak       peak RSS of the process on CPU (includes the interpreter and torch itself, and the
             allocator's habits), torch.cuda.max_memory_allocated on CUDA: secondary
and print one table of LIMe / baseline ratios, next to the FLOP ratio from flops_per_token. The time
ratio is the median over rounds of each round's ratio, with its range over rounds in brackets. With
--hc_rate=n, every round also runs Hyper-Connections with n streams, and HC / baseline ratios follow.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import torch

from lime import GPT, GPTConfig
from common import ArgParser, setup_device, str2bool


def saved_activation_bytes(fn, exclude=()):
    """Bytes autograd saves for backward while running fn(), over unique storages, skipping storages of
    the tensors in `exclude` (e.g. parameters: they exist anyway)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def measure(n_layer, n_embd, n_head, block_size, batch_size, vocab_size, lime, device="cpu",
            warmup=2, repeats=5, seed=0, fused_mix=True, hc_rate=0, hc_dynamic=True):
    """Build one model and measure it. Returns a dict of plain numbers."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd, lime=lime, fused_mix=fused_mix, hc_rate=hc_rate, hc_dynamic=hc_dynamic)
    cuda = torch.device(device).type == "cuda"  # (cuda:1 too)
    model = GPT(cfg).to(device)
    opt = model.configure_optimizers(0.1, 1e-3, device_type=torch.device(device).type)
    x = torch.randint(0, vocab_size, (batch_size, block_size), device=device)
    autocast = torch.autocast("cuda", torch.bfloat16) if cuda else nullcontext()
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    def step():
        with autocast:
            _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for i in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    with autocast:
        act, (_, loss) = saved_activation_bytes(lambda: model(x, x), exclude=list(model.parameters()))
    del loss
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    step_s = statistics.median(times)
    flops = 3 * model.flops_per_token(block_size) * batch_size * block_size
    return dict(step_ms=step_s * 1e3, act_bytes=act, peak_bytes=peak, flops=flops,
                gflops_per_s=flops / step_s / 1e9)


class WorkerFailed(RuntimeError):
    """A benchmark's worker process failed (e.g. out of memory); the message says how, in one line."""


def run_fresh(args):
    """measure(**args) in a fresh Python process; returns its result dict."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker=" + json.dumps(args)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        lines = res.stderr.strip().splitlines()
        why = lines[-1].removeprefix("error: ") if lines else f"it exited with {res.returncode} and said nothing"
        if res.returncode < 0:  # e.g. SIGKILL from the kernel's out-of-memory killer
            why = f"killed by signal {-res.returncode}" + (" (out of memory?)" if res.returncode == -9 else "")
        shape = ", ".join(f"{k}={args[k]}" for k in ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "lime"))
        raise WorkerFailed(f"the benchmark process for {shape} failed: {why}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def parse_depths(s):
    """--depths=8,32 -> [8, 32]; ValueError unless they are whole numbers >= 1."""
    try:
        depths = [int(d) for d in s.split(",")]
    except ValueError:
        depths = []
    if not depths or min(depths) < 1:
        raise ValueError(f"--depths must be comma-separated whole numbers of layers >= 1, e.g. --depths=8,32; got {s!r}")
    return depths


def get_args(argv=None):
    """The flags, checked: every mistake is a ValueError naming the flag, before anything runs."""
    p = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", default="8,32", help="comma-separated n_layer values at the main width")
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--n_head", type=int, default=8)
    p.add_argument("--block_size", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--vocab_size", type=int, default=256)
    p.add_argument("--deep", type=str2bool, nargs="?", const=True, default=True, help="also the deep-narrow config: "
                   "24 layers, width 64, 4 heads, block 128, batch 32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--fused_mix", type=str2bool, nargs="?", const=True, default=True,
                   help="False: time LIMe's plain formula (PlainMix), not the fast path")
    p.add_argument("--hc_rate", type=int, default=0, help="n >= 1: also time Hyper-Connections with n streams")
    p.add_argument("--hc_dynamic", type=str2bool, nargs="?", const=True, default=True,
                   help="False: static Hyper-Connections (with --hc_rate)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="timed steps per process (median taken)")
    p.add_argument("--rounds", type=int, default=3, help="fresh baseline + LIMe processes per config")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._worker:
        return a, []
    for k in ("n_embd", "n_head", "block_size", "batch_size", "vocab_size", "repeats", "rounds"):
        if getattr(a, k) < 1:
            raise ValueError(f"--{k} must be at least 1, got {getattr(a, k)}")
    for k in ("warmup", "hc_rate"):
        if getattr(a, k) < 0:
            raise ValueError(f"--{k} must be at least 0, got {getattr(a, k)}")
    a.device, device_type = setup_device(a.device, "float32")[:2]  # ValueError if unknown or not there
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"bench.py times cpu and cuda only, not --device={a.device}")
    rows = [(f"{d} layers, width {a.n_embd}",
             dict(n_layer=d, n_embd=a.n_embd, n_head=a.n_head, block_size=a.block_size,
                  batch_size=a.batch_size, vocab_size=a.vocab_size)) for d in parse_depths(a.depths)]
    if a.deep:
        rows.append(("24 layers, width 64 (deep)",
                     dict(n_layer=24, n_embd=64, n_head=4, block_size=128, batch_size=32,
                          vocab_size=a.vocab_size)))
    try:  # the model's own checks (e.g. an even head dim), on the meta device: no memory, no time
        with torch.device("meta"):
            GPT(GPTConfig(vocab_size=a.vocab_size, block_size=a.block_size, n_layer=1, n_head=a.n_head,
                          n_embd=a.n_embd, lime=True))
    except ValueError as e:
        raise ValueError(f"--n_embd={a.n_embd} --n_head={a.n_head}: {e}") from None
    return a, rows


def main(argv=None):
    a, rows = get_args(argv)
    if a._worker:
        print(json.dumps(measure(**json.loads(a._worker))))
        return
    common = dict(device=a.device, warmup=a.warmup, repeats=a.repeats)
    hc = dict(lime=False, hc_rate=a.hc_rate, hc_dynamic=a.hc_dynamic)
    print(f"device={a.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {a.repeats} steps after {a.warmup} warm-up, {a.rounds} rounds, "
          f"LIMe mix: {'fused (FusedMix)' if a.fused_mix else 'plain formula (PlainMix)'}"
          + (f", HC: {a.hc_rate} streams, {'dynamic' if a.hc_dynamic else 'static'}" if a.hc_rate else ""))
    head = (f"{'config':<28} {'base ms':>8} {'lime ms':>8} {'time x (range)':>20} {'FLOP x':>7} {'act x':>6} "
            f"{'peak x':>7} {'act MiB b/l':>13} {'GFLOP/s b/l':>12}")
    if a.hc_rate:  # HC / baseline, the same measures
        head += f" {'hc ms':>8} {'hc time x (range)':>20} {'hc FLOP x':>9} {'hc act x':>8} {'hc peak x':>9}"
    print(head)
    print("-" * len(head))
    for name, cfg in rows:
        runs = [(run_fresh(dict(cfg, lime=False, **common)), run_fresh(dict(cfg, lime=True, fused_mix=a.fused_mix, **common)))
                + ((run_fresh(dict(cfg, **hc, **common)),) if a.hc_rate else ()) for _ in range(a.rounds)]
        med = [{k: statistics.median(r[i][k] for r in runs) for k in runs[0][i]} for i in range(len(runs[0]))]
        b, l = med[0], med[1]

        def spread(i):  # variant i's step time / the baseline's, median over rounds (range)
            ratios = [r[i]["step_ms"] / r[0]["step_ms"] for r in runs]
            return f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"
        line = (f"{name:<28} {b['step_ms']:8.0f} {l['step_ms']:8.0f} {spread(1):>20} "
                f"{l['flops'] / b['flops']:7.3f} {l['act_bytes'] / b['act_bytes']:6.3f} "
                f"{l['peak_bytes'] / b['peak_bytes']:7.3f} "
                f"{b['act_bytes'] / 2**20:6.0f}/{l['act_bytes'] / 2**20:<6.0f} "
                f"{b['gflops_per_s']:5.0f}/{l['gflops_per_s']:<5.0f}")
        if a.hc_rate:
            h = med[2]
            line += (f" {h['step_ms']:8.0f} {spread(2):>20} {h['flops'] / b['flops']:9.3f} "
                     f"{h['act_bytes'] / b['act_bytes']:8.3f} {h['peak_bytes'] / b['peak_bytes']:9.3f}")
        print(line, flush=True)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError, WorkerFailed) as e:  # bad flags, or a failed worker: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)  # (in a worker, main's try reads this line back)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
