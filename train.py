"""
Train a GPT with or without LIMe, or both on identical data, and compare loss against training FLOPs.

    python prepare_data.py                         # once: makes data/quickstart
    python train.py --compare                      # baseline, then LIMe: ~4 min on 2 CPU cores -> out-compare/
    python train.py --lime=True --out_dir=out-lime # one variant
    python train.py --hc_rate=4 --out_dir=out-hc   # Hyper-Connections, 4 streams (the paper's other baseline)
    python train.py --compare --seeds=3 --out_dir=out-seeds   # 3 seeds per variant: mean curves, min-max bands
    python train.py --compare --preset=gpu --out_dir=out-gpu  # bigger model for one GPU; --preset=deep: 24 narrow layers
    python train.py --plot out-compare             # redraw the figure and summary from the logs
    python train.py --out_dir=out --resume=True    # continue a run exactly where it stopped
    python train.py --compare --preset=arithmetic  # the arithmetic task (prepare_data.py --task=arithmetic
                                                   # --operands=5 first): accuracy vs FLOPs too
    torchrun --standalone --nproc_per_node=8 train.py --preset=gpu --batch_size=4 --gradient_accumulation_steps=8
                                                   # 8 GPUs (DistributedDataParallel), the gpu preset's batch

Flags are nanoGPT's, written --key=value. A preset (cpu, the default; see PRESETS) sets the model size and
schedule; flags given explicitly override it. Training FLOPs = 3 x model.flops_per_token(block_size) x tokens
seen (2 FLOPs per multiply-add, attention over the full T x T square, see lime.py; on a task, padding too). An
out_dir that holds a run is never overwritten: continue it with --resume=True, or delete it to start over.

Under torchrun the flags still describe the whole run: one optimizer step is gradient_accumulation_steps
micro-batches of batch_size sequences in total, split evenly over the processes (so it must be divisible by
their number), and every process trains on exactly the batches its share of a 1-process run would. Rank 0
alone evaluates, logs, checkpoints, plots and prints.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (check_dataset, fixed_val_batches, load_weights, read_checkpoint, sample_batch, save_checkpoint,
                    setup_device, variant_name)
from lime import GPT, GPTConfig, LIME_KV, LIME_SOURCES
from prepare_data import atomic_file, load_meta, load_rows, load_tokens, task_answer

# -----------------------------------------------------------------------------------------------------
# config: nanoGPT flag names; None = filled in by the preset or derived (see resolve)

FLAGS = [  # name, type, default, help
    ("out_dir", str, None, "run folder (default: out, or out-compare with --compare)"),
    ("data_dir", str, "data", "folder holding the datasets"),
    ("dataset", str, "quickstart", "dataset folder under data_dir, made by prepare_data.py"),
    ("batch_size", int, None, "sequences per micro-batch"),
    ("block_size", int, None, "tokens per sequence"),
    ("n_layer", int, None, "transformer blocks"),
    ("n_head", int, None, "attention heads per layer"),
    ("n_embd", int, None, "model width"),
    ("dropout", float, 0.0, "dropout rate"),
    ("lime", bool, False, "True: LIMe (mix keys/values of all earlier layers); False: baseline"),
    ("lime_kv", str, "kv", "with --lime: what the routers mix: kv (keys and values, the paper), k (keys; values "
                           "the layer's own), v (values; keys the layer's own)"),
    ("lime_sources", str, "all", "with --lime: the layers each layer mixes with its own: all (every earlier layer, "
                                 "the paper), first (layer 0), previous (the one before)"),
    ("fused_mix", bool, True, "LIMe's mix: True the fast shared-buffer path; False the plain formula, layer "
                              "by layer (same numbers; slower, O(n_layer^2) memory: for reading and checking)"),
    ("hc_rate", int, 0, "Hyper-Connections (the paper's other baseline): 0 = off; n = n residual streams (paper: 4)"),
    ("hc_dynamic", bool, True, "HC's mixing weights: True static + input-dependent (the paper's); False static only"),
    ("max_iters", int, None, "optimizer steps"),
    ("eval_interval", int, None, "evaluate (and checkpoint) every this many steps, and at the end"),
    ("eval_iters", int, None, "fixed validation batches per evaluation"),
    ("log_interval", int, None, "one log line every this many steps"),
    ("learning_rate", float, None, "peak learning rate"),
    ("router_lr", float, 1e-2, "peak learning rate of the LIMe routers (no weight decay on them)"),
    ("weight_decay", float, 0.1, "AdamW weight decay of the matrices"),
    ("beta1", float, 0.9, "AdamW beta1"),
    ("beta2", float, 0.95, "AdamW beta2"),
    ("warmup_iters", int, None, "linear warmup steps"),
    ("lr_decay_iters", int, None, "the decay ends here (default: max_iters)"),
    ("lr_decay", str, "cosine", "cosine | linear: the shape of the decay from learning_rate to min_lr"),
    ("min_lr", float, None, "lr at the end of the decay (default: learning_rate / 10)"),
    ("grad_clip", float, 1.0, "clip the gradient norm to this (0 = off)"),
    ("gradient_accumulation_steps", int, 1, "micro-batches per optimizer step, over all processes (under "
                                            "torchrun: a multiple of their number, each takes its share)"),
    ("device", str, "auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps; under torchrun cuda (each process "
                            "on GPU LOCAL_RANK) or cpu"),
    ("dtype", str, "auto", "auto (bfloat16 on CUDA if supported, else float16; float32 elsewhere), "
                           "float32, bfloat16, float16"),
    ("compile", bool, False, "torch.compile the model"),
    ("seed", int, 1337, "seed of the initial weights and of the data order"),
    ("resume", bool, False, "continue the run in out_dir from its checkpoint"),
    ("compare", bool, False, "train baseline and LIMe into out_dir/{baseline,lime}, then plot and summarize"),
    ("seeds", int, 1, "with --compare: train each variant with seeds seed, seed+1, ..."),
    ("depths", str, None, "with --compare: a depth sweep, e.g. 4,8,16: a --compare per n_layer into "
                          "out_dir/depthL, then out_dir/loss_vs_depth.png"),
    ("plot", str, None, "DIR: redraw DIR/loss_vs_flops.png and DIR/summary.json from the logs, no training"),
    ("analyze", str, None, "DIR: run analyze.analyze_compare on a --compare folder, no training"),
    ("preset", str, "cpu", "cpu | gpu | deep | depth | depth-gpu | arithmetic | arithmetic-gpu, see PRESETS"),
]
PRESETS = {
    # quick start: both variants in about 4 min on 2 quiet CPU cores (measured: ~160 ms/iter baseline, ~210 LIMe)
    "cpu": dict(n_layer=6, n_head=4, n_embd=128, block_size=128, batch_size=16, max_iters=600,
                eval_interval=50, eval_iters=10, log_interval=10, warmup_iters=30, learning_rate=2e-3),
    # one modern GPU, bf16: 39M params (char vocab), 16k tokens/step, 2.2e16 training FLOPs per variant (3.5e16 with
    # the GPT-2 vocab). Estimated, not measured: at 30% MFU ~4 min per variant on an A100, ~1.5 min on an H100;
    # eager LIMe at lower MFU takes longer. The quickstart data is far too small for it (~200 epochs: it overfits).
    "gpu": dict(n_layer=12, n_head=8, n_embd=512, block_size=512, batch_size=32, max_iters=5000,
                eval_interval=250, eval_iters=40, log_interval=50, warmup_iters=200, learning_rate=1e-3),
    # deep and narrow, where the mix is the largest share of the work (the shape bench.py measures). 480 iters
    # of 4096 tokens: 1.96 passes over tiny Shakespeare's 1.0M training tokens (more would measure memorization)
    "deep": dict(n_layer=24, n_head=4, n_embd=64, block_size=128, batch_size=32, max_iters=480,
                 eval_interval=40, eval_iters=10, log_interval=20, warmup_iters=50, learning_rate=2e-3),
    # depth sweep on a CPU (--compare runs it): the deep preset's width, schedule and tokens at 4, 8 and 16 layers
    "depth": dict(depths="4,8,16", n_head=4, n_embd=64, block_size=128, batch_size=32, max_iters=480,
                  eval_interval=40, eval_iters=10, log_interval=20, warmup_iters=50, learning_rate=2e-3),
    # the paper's deep shape (width 256, 8 heads) at 32, 64 and 128 layers, for one GPU: 65.5M tokens per run, so
    # it needs a corpus of >= 33M tokens (2 passes). 2.35e17 training FLOPs per seed for all six runs (GPT-2
    # vocab; the 128-layer LIMe alone 7.2e16). Estimated, not measured: ~15 min per seed on an H100 at 30% MFU
    "depth-gpu": dict(depths="32,64,128", n_head=8, n_embd=256, block_size=512, batch_size=32, max_iters=4000,
                      eval_interval=250, eval_iters=40, log_interval=50, warmup_iters=200, learning_rate=1e-3),
    # the arithmetic task (prepare_data.py --task=arithmetic), the paper's model shape: 4 layers, 4 heads, width 32.
    # block_size comes from the dataset (its row length - 1). CPU: see the README for the measured times
    "arithmetic": dict(dataset="arithmetic5", n_layer=4, n_head=4, n_embd=32, batch_size=64, max_iters=2000,
                       eval_interval=250, eval_iters=8, log_interval=50, warmup_iters=100, learning_rate=3e-3),
    # the paper's schedule: 200 epochs of the 50,000 training problems, lr 1e-3 decaying linearly (to 0). Batch
    # size 256 is our choice (195.3 steps per epoch, 39,063 steps). Not run here
    "arithmetic-gpu": dict(dataset="arithmetic6", n_layer=4, n_head=4, n_embd=32, batch_size=256, max_iters=39063,
                           eval_interval=1000, eval_iters=8, log_interval=100, warmup_iters=0, learning_rate=1e-3,
                           lr_decay="linear", min_lr=0.0),
}
# taken from the command line even on --resume (how to run, not what to train)
RUNTIME = {"out_dir", "device", "dtype", "compile", "fused_mix", "resume", "compare", "seeds", "plot", "analyze",
           "preset", "depths"}
# on --resume these must match the checkpoint if given explicitly: the run would no longer be the same run
RESUME_FIXED = ["dataset", "n_layer", "n_head", "n_embd", "block_size", "lime", "lime_kv", "lime_sources", "hc_rate",
                "hc_dynamic", "seed", "batch_size", "gradient_accumulation_steps"]
# LIMe's mix as in the paper and no HC: what a baseline passes to the model, and what checkpoints from before
# these flags used
LIME_PAPER = dict(lime_kv="kv", lime_sources="all")
BEFORE_SWITCHES = dict(LIME_PAPER, hc_rate=0, hc_dynamic=True)
# what a checkpoint must hold to be resumed from
RESUME_KEYS = ("model_args", "model", "optimizer", "iter_num", "best_val_loss", "config", "rng_cpu")


MAX_PASSES = 2  # a run that sees its training tokens more often than this gets a warning (overfitting, not depth)
MIN_VALUES = dict(batch_size=1, block_size=1, n_layer=1, n_head=1, n_embd=1, eval_interval=1, eval_iters=1,
                  log_interval=1, gradient_accumulation_steps=1, seeds=1, max_iters=0, warmup_iters=0,
                  lr_decay_iters=0, min_lr=0, grad_clip=0, weight_decay=0, router_lr=0, seed=0, hc_rate=0)


def str2bool(s):
    if s.lower() in ("true", "1", "yes"):
        return True
    if s.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {s!r}")


class ArgParser(argparse.ArgumentParser):
    def error(self, message):  # one line "error: ..." from __main__ instead of usage + exit 2
        raise ValueError(f"{message} (see python train.py --help)")


def get_config(argv=None):
    """-> (config dict with every flag, set of flags given explicitly). Preset values count as explicit
    when --preset itself is given."""
    parser = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)
    for name, typ, default, help in FLAGS:
        default = PRESETS["cpu"].get(name, default)
        help += "" if default is None else f" [{default}]"
        if typ is bool:  # --compare alone means --compare=True
            parser.add_argument(f"--{name}", type=str2bool, nargs="?", const=True, help=help)
        else:
            parser.add_argument(f"--{name}", type=typ, help=help)
    args = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    preset = args.get("preset", "cpu")
    if preset not in PRESETS:
        raise ValueError(f"unknown --preset={preset}; choose one of {', '.join(PRESETS)}")
    explicit = set(args) | (set(PRESETS[preset]) if "preset" in args else set())
    return {**{name: default for name, _, default, _ in FLAGS}, **PRESETS[preset], **args}, explicit


def resolve(cfg):
    """Fill in the derived defaults and check the numbers; returns a new dict."""
    cfg = dict(cfg)
    for name, typ, _, _ in FLAGS:  # nan and inf parse as floats, and compare False with everything
        if typ is float and cfg[name] is not None and not math.isfinite(cfg[name]):
            raise ValueError(f"--{name} must be a finite number, got {cfg[name]}")
    if not cfg["learning_rate"] > 0:  # before min_lr = learning_rate / 10 gets the blame
        raise ValueError(f"--learning_rate must be > 0, got {cfg['learning_rate']}")
    cfg["out_dir"] = cfg["out_dir"] or ("out-compare" if cfg["compare"] else "out")
    cfg["lr_decay_iters"] = cfg["max_iters"] if cfg["lr_decay_iters"] is None else cfg["lr_decay_iters"]
    cfg["min_lr"] = cfg["learning_rate"] / 10 if cfg["min_lr"] is None else cfg["min_lr"]
    for k, lo in MIN_VALUES.items():
        if k == "block_size" and cfg[k] is None:  # a row dataset's row length sets it (see row_config)
            continue
        if cfg[k] < lo:
            raise ValueError(f"--{k} must be at least {lo}, got {cfg[k]}")
    if cfg["lr_decay"] not in ("cosine", "linear"):
        raise ValueError(f"--lr_decay must be cosine or linear, got {cfg['lr_decay']!r}")
    if not 0 <= cfg["dropout"] < 1:
        raise ValueError(f"need 0 <= --dropout < 1, got {cfg['dropout']}")
    for k, allowed in (("lime_kv", LIME_KV), ("lime_sources", LIME_SOURCES)):
        if cfg[k] not in allowed:
            raise ValueError(f"--{k} must be one of {', '.join(allowed)}, got {cfg[k]!r}")
        # (a --compare gives them to its LIMe runs alone; on --resume resume_config checks them against the checkpoint)
        if cfg[k] != LIME_PAPER[k] and not (cfg["lime"] or cfg["compare"] or cfg["resume"]):
            raise ValueError(f"--{k}={cfg[k]} changes LIMe's mix: add --lime=True")
    return cfg


# -----------------------------------------------------------------------------------------------------
# data: memmapped token files; batches are a pure function of (seed, iteration)

def train_batches(data, cfg, it):
    """The gradient_accumulation_steps micro-batches of step `it`. A function of (seed, it) alone, so the
    baseline and LIMe see identical batches and a resumed run needs no data RNG state."""
    if isinstance(data, Rows):
        return row_batches(data, cfg, it)
    rng = np.random.default_rng([cfg["seed"], it])
    return [sample_batch(data, cfg["block_size"], cfg["batch_size"], rng)
            for _ in range(cfg["gradient_accumulation_steps"])]


def open_dataset(cfg):
    """-> (meta, train memmap, val memmap), with errors that say how to fix them. For a row dataset
    (prepare_data.py --task=...) the splits are Rows."""
    path = os.path.join(cfg["data_dir"], cfg["dataset"])
    meta = load_meta(path)  # FileNotFoundError with the prepare_data.py command that makes it
    if meta.get("layout") == "rows":
        return meta, *[Rows(load_rows(path, s, meta), meta) for s in ("train", "val")]
    if cfg["block_size"] is None:
        raise ValueError(f"{path} is a text dataset: give it a --block_size")
    splits = [load_tokens(path, s, meta) for s in ("train", "val")]
    for split, data in zip(("train", "val"), splits):
        if len(data) <= cfg["block_size"]:
            raise ValueError(f"block_size={cfg['block_size']} is too large for {path}: its {split} split has only "
                             f"{len(data)} tokens (needs block_size + 1); use a smaller --block_size or more text")
    return meta, *splits


# -----------------------------------------------------------------------------------------------------
# row datasets (synthetic tasks, prepare_data.py --task=arithmetic): one problem per row, padded to
# meta["row_length"]. The model reads a row's first row_length - 1 tokens (so block_size = row_length - 1)
# and learns the solution only: targets are -1 (ignored by the loss) on the prompt and on the padding.
# FLOPs are counted as for text, over all block_size positions, padding included (the model computes them).

ACCURACY_PROBLEMS = 500  # accuracy at every evaluation: greedy solutions of the first this many val problems


class Rows:
    """One split of a row dataset: rows, a (n_rows, row_length) array, and the dataset's meta."""

    def __init__(self, rows, meta):
        self.rows, self.meta = rows, meta

    def __len__(self):
        return len(self.rows)


def row_config(cfg, meta, explicit=()):
    """cfg with block_size = row_length - 1; an explicit --block_size that differs is an error."""
    T = meta["row_length"] - 1
    if "block_size" in explicit and cfg["block_size"] != T:
        raise ValueError(f"--block_size={cfg['block_size']}, but {cfg['dataset']} has rows of {T + 1} tokens, "
                         f"so block_size is {T}: drop --block_size")
    return dict(cfg, block_size=T)


def row_xy(rows, meta):
    """rows (B, row_length) -> (x, y) int64 tensors of shape (B, row_length - 1): y is x shifted by one,
    with -1 where y is part of the prompt (up to and including the first "=") or padding."""
    r = torch.from_numpy(np.asarray(rows, dtype=np.int64))      # (B, L)
    x, y = r[:, :-1].clone(), r[:, 1:].clone()                   # (B, L-1) each
    eq = (r == meta["eq_id"]).int().argmax(1)                    # (B,) position of the first "="
    prompt = torch.arange(y.shape[1])[None, :] < eq[:, None]     # y[:, j] is token j+1: prompt if j+1 <= eq
    y[prompt | (y == meta["pad_id"])] = -1
    return x, y


def row_stream(n_rows, seed, start, count):
    """Indices start .. start+count-1 of the training stream: epoch after epoch through the rows, each
    epoch in its own order (a permutation drawn from (seed, epoch)). A pure function, like train_batches."""
    k = np.arange(start, start + count)
    epoch, out = k // n_rows, np.empty(count, dtype=np.int64)
    for e in np.unique(epoch):
        out[epoch == e] = np.random.default_rng([seed, int(e)]).permutation(n_rows)[k[epoch == e] % n_rows]
    return out


def row_batches(data, cfg, it):
    """Step it's micro-batches of a row dataset: the next batch_size x gradient_accumulation_steps rows."""
    B, accum = cfg["batch_size"], cfg["gradient_accumulation_steps"]
    idx = row_stream(len(data), cfg["seed"], it * B * accum, B * accum).reshape(accum, B)  # (accum, B)
    return [row_xy(data.rows[i], data.meta) for i in idx]


def fixed_row_batches(data, batch_size, n_batches):
    """The val loss batches of a row dataset: its first n_batches x batch_size rows (all if fewer), in order.
    evaluate() averages the batches' mean losses (their numbers of solution tokens differ a little)."""
    n = min(len(data), n_batches * batch_size)
    return [row_xy(data.rows[i:min(i + batch_size, n)], data.meta) for i in range(0, n, batch_size)]


@torch.no_grad()
def answer_accuracy(model, data, ctx, n=None, batch_size=512):
    """Share of the first n problems of data (all if None) that the model solves: greedy generation from
    the prompt (up to the first "="), scored by prepare_data.task_answer (the single number between the
    last "=" and the end token) against the true answer. The model has no left-padding, so prompts are
    generated in groups of equal length, each for up to the rest of a row."""
    meta = data.meta
    rows = np.asarray(data.rows[:n], dtype=np.int64)             # (n, L)
    P = (rows == meta["eq_id"]).argmax(1) + 1                    # (n,) prompt lengths
    answers = rows[np.arange(len(rows)), (rows == meta["end_id"]).argmax(1) - 1]  # the token before the end
    device, was_training = next(model.parameters()).device, model.training
    model.eval()
    correct = 0
    for p in np.unique(P):
        group = np.flatnonzero(P == p)
        for i in range(0, len(group), batch_size):
            idx = group[i:i + batch_size]
            x = torch.from_numpy(rows[idx, :p]).to(device)       # (b, p)
            with ctx:
                out = model.generate(x, meta["row_length"] - p, temperature=0)  # (b, row_length)
            correct += sum(task_answer(o[p:], meta) == a for o, a in zip(out.tolist(), answers[idx].tolist()))
    model.train(was_training)
    return correct / len(rows)


def log_test_accuracy(model, cfg, meta, ctx, log_path, iter_num):
    """Accuracy on the whole test split, appended to the log as {"test_accuracy", "test_problems",
    "at_iter"} (no "iter" key: the curves skip it); printed, and returned."""
    test = Rows(load_rows(os.path.join(cfg["data_dir"], cfg["dataset"]), "test", meta), meta)
    acc = answer_accuracy(model, test, ctx)
    with open(log_path, "a") as f:
        f.write(json.dumps(dict(test_accuracy=acc, test_problems=len(test), at_iter=iter_num)) + "\n")
    print(f"test accuracy {acc:.1%} ({len(test)} problems, greedy, iter {iter_num})")
    return acc


def read_test_accuracy(path, at_iter=None):
    """The last {"test_accuracy", ...} record of a log.jsonl (if at_iter is given: only one made at that
    iteration), or None."""
    with open(path) as f:
        recs = [json.loads(line) for line in f if '"test_accuracy"' in line]
    recs = [r for r in recs if at_iter is None or r["at_iter"] == at_iter]
    return recs[-1] if recs else None


# -----------------------------------------------------------------------------------------------------
# several processes: `torchrun --nproc_per_node=N train.py ...` starts N copies of this script and tells each
# who it is through RANK (0..N-1), LOCAL_RANK (its GPU on this machine) and WORLD_SIZE (N)

def setup_ddp(device):
    """Under torchrun: join the process group (NCCL on CUDA, gloo on CPU) and silence stdout on ranks > 0.
    Returns the device this process trains on (cuda:LOCAL_RANK on GPUs). Without torchrun: device, unchanged."""
    if "RANK" not in os.environ:
        return device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")
    if cuda:  # each process its own GPU, whatever --device said
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise ValueError(f"process {local_rank} needs GPU cuda:{local_rank}, but torch sees {n} GPU(s); "
                             f"use torchrun --nproc_per_node={n} or fewer")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    elif device != "cpu":
        raise ValueError(f"--device={device} under torchrun: several processes need --device=cuda or --device=cpu")
    # the timeout is a backstop (a collective waits at most this long): torchrun already stops every process
    # as soon as one exits with an error, so a failing rank fails the job with its own message
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=30),
                            device_id=torch.device(device) if cuda else None)
    if rank > 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 alone prints; errors (stderr) still show from every rank
    return device


def ddp_rank_world():
    """(this process's rank, number of processes): (0, 1) without torchrun."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def from_rank0(x, device):
    """The float x of rank 0, on every rank (the others wait here for it)."""
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.broadcast(t, 0)
    return t.item()


# -----------------------------------------------------------------------------------------------------
# training

def get_lr(it, cfg):
    """Linear warmup to learning_rate, cosine (or, with lr_decay=linear, linear) decay to min_lr at
    lr_decay_iters, then min_lr."""
    lr, min_lr, warmup, decay = cfg["learning_rate"], cfg["min_lr"], cfg["warmup_iters"], cfg["lr_decay_iters"]
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it >= decay:
        return min_lr
    ratio = (it - warmup) / (decay - warmup)
    if cfg.get("lr_decay", "cosine") == "linear":  # (.get: checkpoints from before the flag existed)
        return lr - ratio * (lr - min_lr)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


@torch.no_grad()
def evaluate(model, batches, ctx, device):
    """Mean loss over the fixed validation batches (all the same size, so this is the per-token mean)."""
    model.eval()
    losses = []
    for x, y in batches:
        with ctx:
            losses.append(model(x.to(device), y.to(device))[1].float())
    model.train()
    return torch.stack(losses).mean().item()


def resume_config(ckpt, cfg, explicit, path):
    """The checkpoint's config, with runtime flags and explicitly given flags from cfg. Raises ValueError
    naming the field if an explicit flag contradicts the checkpoint."""
    saved = {**BEFORE_SWITCHES, **ckpt["config"]} if isinstance(ckpt["config"], dict) else {}
    missing = [k for k in RESUME_FIXED if k not in saved]
    if missing:
        raise ValueError(f"{path} is not a usable checkpoint: its config lacks {', '.join(missing)} (not written "
                         f"by train.py?); restore it, or train a new run into a fresh --out_dir")
    for k in RESUME_FIXED:
        if k in explicit and cfg[k] != saved[k]:
            raise ValueError(f"can't resume from {path}: {k} differs (checkpoint has {saved[k]!r}, "
                             f"--{k}={cfg[k]!r}); drop --{k}, or train into a new --out_dir")
    return {**cfg, **saved, **{k: v for k, v in cfg.items() if k in RUNTIME or k in explicit}}


class NonFiniteLoss(ValueError):
    pass


def fmt_time(s):
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def run_files(out_dir):
    """Which of ckpt.pt and log.jsonl out_dir holds: a run lives there if any."""
    return [f for f in ("ckpt.pt", "log.jsonl") if os.path.exists(os.path.join(out_dir, f))]


def make_out_dir(out_dir):
    """Create out_dir and check that we can write in it, before any work is done (ValueError if not)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--out_dir={out_dir} is a file, not a folder; choose another --out_dir")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:
        raise ValueError(f"can't write to --out_dir={out_dir} ({e.strerror or e}); choose a folder you can "
                         f"write to") from None


def train(cfg, explicit=()):
    """Train one model as cfg (get_config's dict) says, logging to out_dir/log.jsonl and checkpointing to
    out_dir/ckpt.pt at every evaluation. Returns {"out_dir", "iter", "val_loss", "flops"} of the end."""
    cfg = resolve(cfg)
    out_dir, ckpt = cfg["out_dir"], None
    ckpt_path, log_path = os.path.join(out_dir, "ckpt.pt"), os.path.join(out_dir, "log.jsonl")
    rank, world = ddp_rank_world()
    master = rank == 0  # rank 0 alone checks and writes out_dir, evaluates, logs and checkpoints
    if cfg["resume"]:
        if not os.path.exists(ckpt_path):
            hint = (f"for a comparison: python train.py --compare --resume=True --out_dir={out_dir}"
                    if os.path.isdir(os.path.join(out_dir, "baseline")) else
                    f"its log.jsonl is of a run stopped before its first checkpoint: to start over, delete {out_dir}"
                    if os.path.exists(log_path) else "drop --resume to start a new run")
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}; {hint}")
        ckpt = read_checkpoint(ckpt_path, "cpu", RESUME_KEYS)
        cfg = resolve(resume_config(ckpt, cfg, explicit, ckpt_path))
    elif master and run_files(out_dir):  # never replace a run's checkpoint and log without being asked
        raise ValueError(f"{out_dir} already holds a run ({', '.join(run_files(out_dir))}); continue it with "
                         f"--resume=True, or train into a new --out_dir (to start over, delete {out_dir} first)")
    if cfg["gradient_accumulation_steps"] % world:
        raise ValueError(f"--gradient_accumulation_steps={cfg['gradient_accumulation_steps']} is not divisible by "
                         f"the {world} processes: it counts the micro-batches of one step over all of them "
                         f"(same global batch: multiply it by k and divide --batch_size by k)")
    meta, train_data, val_data = open_dataset(cfg)
    rows = isinstance(train_data, Rows)
    if rows:
        cfg = row_config(cfg, meta, explicit)
    if ckpt is not None:  # the data must be the data it was trained on
        check_dataset(ckpt, meta, os.path.join(cfg["data_dir"], cfg["dataset"]), ckpt_path)
    device, device_type, dtype, ctx, peak = setup_device(cfg["device"], cfg["dtype"])
    if master:
        make_out_dir(out_dir)

    torch.manual_seed(cfg["seed"])  # right before the model: same non-router init with and without LIMe
    model_args = asdict(GPTConfig(vocab_size=meta["vocab_size"], block_size=cfg["block_size"],
                                  n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"],
                                  dropout=cfg["dropout"], lime=cfg["lime"], fused_mix=cfg["fused_mix"],
                                  lime_kv=cfg["lime_kv"], lime_sources=cfg["lime_sources"],
                                  hc_rate=cfg["hc_rate"], hc_dynamic=cfg["hc_dynamic"]))
    if ckpt is not None:
        for k, v in {**BEFORE_SWITCHES, **ckpt["model_args"]}.items():
            if k not in ("dropout", "fused_mix") and model_args.get(k) != v:  # e.g. the data was re-prepared
                raise ValueError(f"can't resume from {ckpt_path}: model {k} differs (checkpoint has {v!r}, "
                                 f"now {model_args.get(k)!r})")
    raw_model = GPT(GPTConfig(**model_args)).to(device)
    optimizer = raw_model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"],
                                               (cfg["beta1"], cfg["beta2"]), cfg["router_lr"], device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")
    iter_num, best_val, last_saved = 0, math.inf, None
    if ckpt is not None:
        load_weights(raw_model, ckpt, ckpt_path)
        peaks = [(g["peak_lr"], g["weight_decay"]) for g in optimizer.param_groups]
        optimizer.load_state_dict(ckpt["optimizer"])
        for g, (peak_lr, wd) in zip(optimizer.param_groups, peaks):  # flags given now win
            g["peak_lr"], g["weight_decay"] = peak_lr, wd
        if "scaler" in ckpt:
            scaler.load_state_dict(ckpt["scaler"])
        torch.set_rng_state(ckpt["rng_cpu"])
        if device_type == "cuda" and ckpt["rng_cuda"]:
            torch.cuda.set_rng_state_all(ckpt["rng_cuda"])
        iter_num, best_val, last_saved = ckpt["iter_num"], ckpt["best_val_loss"], ckpt["iter_num"]
    model = torch.compile(raw_model) if cfg["compile"] else raw_model
    # DDP all-reduces (averages) the gradients during backward. No find_unused_parameters: every parameter
    # gets a gradient in every backward (LIMe's routers last, in layer 0's mix), and DDP's hooks fire per
    # parameter as each is ready
    ddp_model = DDP(model, device_ids=[torch.device(device).index] if device_type == "cuda" else None) \
        if dist.is_initialized() else model

    T, B, accum, max_iters = cfg["block_size"], cfg["batch_size"], cfg["gradient_accumulation_steps"], cfg["max_iters"]
    k = accum // world  # micro-batches per step on this rank
    tokens_per_iter = B * T * accum  # all ranks together, as are the logged tokens and FLOPs
    flops_per_iter = 3 * raw_model.flops_per_token(T) * tokens_per_iter  # training = 3 x forward
    if rows:  # passes = epochs: how often the run sees each training problem
        passes = max_iters * B * accum / len(train_data)
        val_batches = fixed_row_batches(val_data, B, cfg["eval_iters"])
    else:
        passes = max_iters * tokens_per_iter / len(train_data)  # how often the run sees each training token
        val_batches = fixed_val_batches(val_data, T, B, cfg["eval_iters"])
    name = variant_name(model_args)
    print(f"{name}: {raw_model.get_num_params() / 1e6:.2f}M params | {flops_per_iter / tokens_per_iter / 1e6:.2f} "
          f"MFLOPs/token (train) | {tokens_per_iter:,} tokens/iter | {device} {dtype} | "
          f"{cfg['data_dir']}/{cfg['dataset']} -> {out_dir}" + (f" | {world} processes" if world > 1 else "")
          + (f" | resuming at iter {iter_num}" if ckpt else "")
          + f"\n{name}: {max_iters} iters = {passes:.2f} passes over the {len(train_data):,} training "
          + ("problems" if rows else "tokens"))
    if passes > MAX_PASSES and not rows:  # (a task is scored on held-out problems; the paper trains 200 epochs)
        print(f"warning: {passes:.1f} passes over the training data (more than {MAX_PASSES}): late val losses then "
              f"measure memorization as much as learning; lower --max_iters or prepare more data")

    log = None
    if master:
        start_log(log_path, {"config": cfg, "model_args": model_args, "n_params": raw_model.get_num_params(),
                             "flops_per_iter": flops_per_iter, "tokens_per_iter": tokens_per_iter, "passes": passes,
                             "world_size": world}, keep_until=iter_num if ckpt is not None else None)
        log = open(log_path, "a")

    def record(rec, do_eval):
        """Evaluate if asked, append rec to the log, checkpoint after an evaluation (finite states only)."""
        nonlocal best_val, last_saved
        if do_eval:
            rec["val_loss"] = from_rank0(evaluate(model, val_batches, ctx, device) if master else 0.0, device)
            if not math.isfinite(rec["val_loss"]):
                raise NonFiniteLoss(f"val loss is {rec['val_loss']} at iteration {iter_num}")
            if rows:  # the task's score: greedy solutions of the first ACCURACY_PROBLEMS val problems
                rec["accuracy"] = from_rank0(answer_accuracy(raw_model, val_data, ctx, ACCURACY_PROBLEMS)
                                             if master else 0.0, device)
        if master:
            log.write(json.dumps(rec) + "\n")
            log.flush()
        if do_eval:
            best_val = min(best_val, rec["val_loss"])
            if iter_num > 0:  # (iter 0 is the initial state: nothing to save)
                if not all(torch.isfinite(p).all() for p in raw_model.parameters()):
                    raise NonFiniteLoss(f"the weights are not finite at iteration {iter_num}")
                if master:
                    save_checkpoint(dict(model_args=model_args, model=raw_model.state_dict(),
                                         optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
                                         iter_num=iter_num, best_val_loss=best_val, config=cfg, meta=meta,
                                         rng_cpu=torch.get_rng_state(),
                                         rng_cuda=torch.cuda.get_rng_state_all() if device_type == "cuda" else []),
                                    out_dir)
                last_saved = iter_num
            print(f"iter {iter_num}: val loss {rec['val_loss']:.4f} (best {best_val:.4f})"
                  + (f" | accuracy {rec['accuracy']:.1%}" if rows else "")
                  + (" | checkpoint saved" if iter_num > 0 else ""))

    try:
        if iter_num == 0:
            record(dict(iter=0, tokens=0, flops=0, lr=get_lr(0, cfg)), do_eval=True)
        t_start = t_last = time.time()
        losses = []  # each step's loss since the last record, kept on the device (no sync per step)
        recent = []  # ms/iter of the last few records: the ETA uses their median, so one slow step can't swing it
        while iter_num < max_iters:
            lr = get_lr(iter_num, cfg)
            for g in optimizer.param_groups:  # routers follow the same schedule, scaled to their own peak
                g["lr"] = g["peak_lr"] * lr / cfg["learning_rate"]
            step_loss = 0.0
            batches = train_batches(train_data, cfg, iter_num)  # the whole step's, on every rank...
            for i, (x, y) in enumerate(batches[rank * k:(rank + 1) * k]):  # ...each takes its own share
                if device_type == "cuda":
                    x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
                if cfg["dropout"] > 0:  # masks, like the batches, a function of (seed, iter, micro-batch)
                    torch.manual_seed(int(np.random.SeedSequence([cfg["seed"], iter_num, rank * k + i])
                                          .generate_state(1)[0]))
                # all-reduce the gradients once per step, in the last micro-batch's backward
                with ddp_model.no_sync() if i < k - 1 and ddp_model is not model else nullcontext():
                    with ctx:
                        _, loss = ddp_model(x.to(device), y.to(device))
                    step_loss = step_loss + loss.detach().float() / k
                    scaler.scale(loss / k).backward()  # / k here, / world in DDP's all-reduce: mean over accum
            if cfg["grad_clip"] > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg["grad_clip"])
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            losses.append(step_loss)
            iter_num += 1
            do_eval = iter_num % cfg["eval_interval"] == 0 or iter_num == max_iters
            if iter_num % cfg["log_interval"] == 0 or do_eval:
                values = torch.stack(losses)
                if world > 1:  # the mean over every rank's micro-batches (gloo has no AVG)
                    dist.all_reduce(values)
                    values /= world
                values = values.tolist()  # the one host-device sync per record
                for i, v in enumerate(values):
                    if not math.isfinite(v):
                        # values[i] is the loss of the step that made iteration iter_num - len(values) + i + 1
                        raise NonFiniteLoss(f"training loss is {v} at iteration {iter_num - len(values) + i + 1}")
                dt = (time.time() - t_last) / len(values)
                recent = recent[-4:] + [dt]
                flops = iter_num * flops_per_iter
                rec = dict(iter=iter_num, tokens=iter_num * tokens_per_iter, flops=flops,
                           train_loss=sum(values) / len(values), lr=lr, ms_per_iter=1000 * dt)
                print(f"iter {iter_num}/{max_iters} | loss {rec['train_loss']:.4f} | lr {lr:.2e} | "
                      f"{1000 * dt:.0f} ms/iter | {tokens_per_iter / dt / 1e3:.1f}k tok/s | {flops:.2e} FLOPs, "
                      f"{flops_per_iter / dt / 1e9:.1f} GFLOP/s" + (f", MFU {flops_per_iter / dt / (peak * world):.1%}"
                      if peak else "") + f" | ETA {fmt_time((max_iters - iter_num) * float(np.median(recent)))}")
                record(rec, do_eval)
                losses, t_last = [], time.time()
    except NonFiniteLoss as e:
        good = (f"the last good checkpoint, iter {last_saved}, is in {ckpt_path}" if last_saved is not None
                else "no checkpoint was saved")
        raise NonFiniteLoss(f"{e}; stopped ({good}). Try a lower --learning_rate") from None
    finally:
        if log is not None:
            log.close()
    if world > 1:
        dist.barrier()  # rank 0's last log record and checkpoint are written: every rank may read them now
    last = read_log(log_path)[-1]
    test_acc = log_test_accuracy(raw_model, cfg, meta, ctx, log_path, iter_num) if rows and master else None
    if ckpt is None or iter_num > ckpt["iter_num"]:
        print(f"{name} done: val loss {last['val_loss']:.4f} after {iter_num} iters, "
              f"{iter_num * flops_per_iter:.2e} FLOPs, {fmt_time(time.time() - t_start)}")
    else:
        print(f"{name}: already trained to iter {iter_num} (max_iters={max_iters}); nothing to do")
    return dict(out_dir=out_dir, iter=iter_num, val_loss=last.get("val_loss"), flops=iter_num * flops_per_iter,
                **(dict(accuracy=last.get("accuracy"), test_accuracy=test_acc) if rows else {}))


# -----------------------------------------------------------------------------------------------------
# checkpoints and logs

def read_log(path, header=False):
    """The records of a log.jsonl (those with "iter"), or with header=True its {"config": ...} header (or
    None). Lines that don't parse (a run killed mid-write) are skipped."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    if header:
        return next((r for r in records if "config" in r), None)
    return [r for r in records if "iter" in r]


def start_log(path, header, keep_until=None):
    """Start out_dir/log.jsonl with its header; on resume keep the old records up to keep_until (the
    checkpoint's iter: later ones are redone). Atomic, so a crash here loses nothing."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    keep = [r for r in read_log(path) if r["iter"] <= keep_until] if keep_until is not None \
        and os.path.exists(path) else []
    with atomic_file(path) as f:
        f.writelines(json.dumps(r) + "\n" for r in [header] + keep)


# -----------------------------------------------------------------------------------------------------
# comparing: small pure functions on log records (lists of dicts), then the figure and the summary.
# A --compare folder OUT holds OUT/baseline and OUT/lime (first seed; what sample.py and analyze.py read),
# OUT/baseline_seedS and OUT/lime_seedS (further seeds), OUT/loss_vs_flops.png and OUT/summary.json.

def run_dir(out_dir, variant, i, seed):
    return os.path.join(out_dir, variant if i == 0 else f"{variant}_seed{seed}")


def mean_band(runs, key):
    """Seeds' logs -> (flops, mean, min, max) arrays of key over the iterations where every run has it
    (all seeds share the schedule). One run gives its own curve."""
    iters = sorted(set.intersection(*[{r["iter"] for r in recs if r.get(key) is not None} for recs in runs]))
    at = [{r["iter"]: r for r in recs} for recs in runs]
    flops = np.array([np.mean([a[i]["flops"] for a in at]) for i in iters], dtype=float)
    ys = np.array([[a[i][key] for i in iters] for a in at], dtype=float).reshape(len(runs), len(iters))
    return flops, ys.mean(0), ys.min(0), ys.max(0)


def flops_to_reach(flops, losses, target):
    """FLOPs at which a val curve first gets down to target, interpolating linearly between eval points;
    None if it never does."""
    for i in range(len(losses)):
        if losses[i] <= target:
            if i == 0:
                return float(flops[0])
            f0, l0 = flops[i - 1], losses[i - 1]
            return float(f0 + (flops[i] - f0) * (l0 - target) / (l0 - losses[i]))
    return None


def summarize(seeds, baseline_runs, lime_runs):
    """Per seed: final val losses and the FLOPs at which LIMe first reaches the baseline's final val loss,
    as a ratio to the baseline's total FLOPs (None: never). Then mean and std (ddof=1; 0 for one seed) of
    the final val losses, and the same crossing for the mean curves."""
    out = dict(seeds=list(seeds), interpolation="linear between eval points", per_seed=[])
    for seed, b, l in zip(seeds, baseline_runs, lime_runs):
        (bf, bl, _, _), (lf, ll, _, _) = mean_band([b], "val_loss"), mean_band([l], "val_loss")
        if not len(bl) or not len(ll):
            raise ValueError(f"seed {seed}: a run has no val loss logged yet, nothing to compare")
        match = flops_to_reach(lf, ll, bl[-1])
        out["per_seed"].append(dict(seed=seed, baseline_val_loss=bl[-1], lime_val_loss=ll[-1], baseline_flops=bf[-1],
                                    lime_flops=lf[-1], lime_flops_to_match=match,
                                    ratio=None if match is None else match / bf[-1]))
    for v in ("baseline", "lime"):
        finals = np.array([p[f"{v}_val_loss"] for p in out["per_seed"]])
        out[v] = dict(val_loss_mean=finals.mean(), val_loss_std=finals.std(ddof=1) if len(finals) > 1 else 0.0,
                      flops=np.mean([p[f"{v}_flops"] for p in out["per_seed"]]))
    (bf, bm, _, _), (lf, lm, _, _) = mean_band(baseline_runs, "val_loss"), mean_band(lime_runs, "val_loss")
    match = flops_to_reach(lf, lm, bm[-1])
    out["mean_curve"] = dict(lime_flops_to_match=match, ratio=None if match is None else match / bf[-1])
    return json.loads(json.dumps(out, default=float))  # numpy numbers -> plain floats


def format_summary(s):
    """The summary as printed lines."""
    n, ratio = len(s["seeds"]), lambda r: "never" if r is None else f"{r:.2f}x"
    pm = lambda v: f"{s[v]['val_loss_mean']:.4f}" + (f" ± {s[v]['val_loss_std']:.4f}" if n > 1 else "")
    passes = f", {s['passes']:.2f} passes over the training data" if s.get("passes") else ""
    lines = [f"final val loss, {n} seed{'s' if n > 1 else ''} ({', '.join(map(str, s['seeds']))}){passes}"
             + (", mean ± std:" if n > 1 else ":"),
             f"  baseline  {pm('baseline')}  after {s['baseline']['flops']:.3e} FLOPs",
             f"  LIMe      {pm('lime')}  after {s['lime']['flops']:.3e} FLOPs"]
    if n == 1:
        p = s["per_seed"][0]
        lines.append(f"LIMe reaches the baseline's final val loss {p['baseline_val_loss']:.4f} " + (
            "never" if p["ratio"] is None else
            f"at {p['lime_flops_to_match']:.3e} FLOPs = {p['ratio']:.2f}x the baseline's total FLOPs"))
    else:
        lines.append("LIMe's FLOPs to reach the baseline's final val loss / baseline's total FLOPs, per seed: "
                     + ", ".join(f"{p['seed']}: {ratio(p['ratio'])}" for p in s["per_seed"])
                     + f"; mean curves: {ratio(s['mean_curve']['ratio'])}")
    return lines + ["  (linear interpolation between eval points)"]


def read_summary(out_dir):
    """OUT/summary.json as a dict (None if there is none); ValueError if it is not one train.py wrote."""
    path = os.path.join(out_dir, "summary.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            s = json.load(f)
        ok = isinstance(s, dict) and isinstance(s.get("seeds"), list) and all(type(x) is int for x in s["seeds"])
    except (ValueError, UnicodeDecodeError):  # (json's decode error is a ValueError)
        ok = False
    if not ok:
        raise ValueError(f"{path} is not a summary written by train.py; delete it (python train.py --plot "
                         f"{out_dir} writes a new one from the logs)")
    return s


def find_runs(out_dir):
    """[(seed, baseline dir, lime dir)] of a --compare folder, limited to the seeds of its summary.json
    (if any; so leftovers of an older comparison with more seeds are not mixed in)."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    seeds = (read_summary(out_dir) or {}).get("seeds")
    runs = []
    if "baseline" in names:  # the first seed: its log's header says which (if damaged: the summary's first)
        path = os.path.join(out_dir, "baseline", "log.jsonl")
        h = read_log(path, header=True) if os.path.exists(path) else None
        runs.append((h["config"]["seed"] if h else seeds[0] if seeds else None, "baseline", "lime"))
    runs += sorted((int(d[13:]), d, "lime" + d[8:]) for d in names
                   if d.startswith("baseline_seed") and d[13:].isdigit())  # d[13:]: S of baseline_seedS
    if seeds is not None:
        if runs and not any(r[0] in seeds for r in runs):
            raise ValueError(f"{out_dir}/summary.json lists seeds {', '.join(map(str, seeds))}, but the runs in "
                             f"{out_dir} are of seeds {', '.join(str(r[0]) for r in runs)}: it belongs to another "
                             f"comparison; delete it to plot these runs")
        runs = [r for r in runs if r[0] in seeds]
    runs = [(seed, os.path.join(out_dir, b), os.path.join(out_dir, l)) for seed, b, l in runs]
    missing = [d for r in runs for d in r[1:] if not os.path.exists(os.path.join(d, "log.jsonl"))]
    if not runs or missing:
        raise FileNotFoundError(f"no log at {missing[0] if missing else os.path.join(out_dir, 'baseline')}"
                                f"/log.jsonl; make the runs with: python train.py --compare --out_dir={out_dir}")
    return runs


def common_end(logs):
    """logs: {run dir: records} -> (the last iteration evaluated in every run, each run's last evaluated
    iteration as text). Runs cut short (still training, killed, a truncated log) are compared there."""
    evals = {d: {r["iter"] for r in recs if r.get("val_loss") is not None} for d, recs in logs.items()}
    ends = ", ".join(f"{os.path.basename(d)} at iter {max(e, default='none')}" for d, e in evals.items())
    at = max(set.intersection(*evals.values()), default=0)
    if at == 0:  # (iter 0 is the initial state: the same loss, no FLOPs spent)
        raise ValueError(f"the runs have no evaluation in common past iter 0 yet ({ends}): nothing to compare")
    return at, ends


def smooth(y, k=5):
    """Running mean over the last k points (for the noisy train loss)."""
    c = np.cumsum(np.insert(y, 0, 0.0))
    lo = np.maximum(np.arange(1, len(y) + 1) - k, 0)
    return (c[1:] - c[lo]) / (np.arange(1, len(y) + 1) - lo)


def plot_compare(path, baseline_runs, lime_runs, summary, title=""):
    """Val loss (bold, markers; min-max band over seeds) and smoothed train loss (faint) against training
    FLOPs: whole run on the left, second half zoomed on the right. Written atomically to path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    bands = []
    for runs, color, label in ((baseline_runs, "tab:blue", "baseline"), (lime_runs, "tab:red", "LIMe")):
        (vf, vm, vlo, vhi), (tf, tm, _, _) = mean_band(runs, "val_loss"), mean_band(runs, "train_loss")
        bands.append((vf, vlo, vhi))
        for ax in axes:
            ax.plot(tf, smooth(tm), color=color, alpha=0.35, lw=1, label=f"{label} train (smoothed)")
            ax.plot(vf, vm, color=color, lw=2.2, marker="o", ms=4, label=f"{label} val")
            if len(runs) > 1:
                ax.fill_between(vf, vlo, vhi, color=color, alpha=0.2, lw=0, label=f"{label} val, min-max over seeds")
    match, ratio = summary["mean_curve"]["lime_flops_to_match"], summary["mean_curve"]["ratio"]
    for ax in axes:
        ax.axhline(summary["baseline"]["val_loss_mean"], color="gray", ls=":", lw=1.2,
                   label="baseline's final val loss")
        if match is not None:
            ax.axvline(match, color="tab:red", ls=":", lw=1.2, label=f"LIMe reaches it: {ratio:.2f}x the FLOPs")
        ax.set(xlabel="cumulative training FLOPs", ylabel="loss (nats/token)")
        ax.grid(alpha=0.3)
    x1 = max(f[-1] for f, _, _ in bands)  # zoom: the second half, y range from the val curves there
    ys = np.concatenate([np.r_[lo[f >= x1 / 2], hi[f >= x1 / 2]] for f, lo, hi in bands])
    if len(ys):
        pad = 0.15 * (ys.max() - ys.min()) + 1e-3
        axes[1].set(xlim=(x1 / 2, x1 * 1.02), ylim=(ys.min() - pad, ys.max() + 2 * pad))
    n, k = len(baseline_runs), 1 + (match is not None)  # k: the reference lines' legend entries
    axes[0].set_title("loss vs training FLOPs" + (f" (mean of {n} seeds)" if n > 1 else ""))
    axes[1].set_title("second half of training, zoomed" + ("" if match is not None else
                      "\n(LIMe never reaches the baseline's final val loss)"), fontsize=11)
    handles, labels = axes[1].get_legend_handles_labels()
    axes[0].legend(handles[:-k], labels[:-k], fontsize=8, loc="upper right")
    axes[1].legend(handles[-k:], labels[-k:], fontsize=9, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def report(out_dir):
    """Draw OUT/loss_vs_flops.png, write OUT/summary.json and print the summary, from the logs alone. Runs
    that end at different iterations are all compared at the last one they all reached, and a summary that
    compares them further than that is never replaced (ValueError)."""
    runs = find_runs(out_dir)
    logs = {d: read_log(os.path.join(d, "log.jsonl")) for r in runs for d in r[1:]}
    at, ends = common_end(logs)
    cut = any(max(r["iter"] for r in recs) > at for recs in logs.values())
    if cut:
        print(f"note: the runs end at different iterations ({ends}); comparing them all at iter {at}, "
              f"the last one they all reached")
        logs = {d: [r for r in recs if r["iter"] <= at] for d, recs in logs.items()}
    baseline_runs, lime_runs = [[logs[r[i]] for r in runs] for i in (1, 2)]
    summary = dict(summarize([r[0] for r in runs], baseline_runs, lime_runs), iter=at)
    old = read_summary(out_dir) or {}
    prev = old["baseline"].get("flops") if isinstance(old.get("baseline"), dict) else None
    if isinstance(prev, (int, float)) and summary["baseline"]["flops"] < prev:  # never a worse-informed figure
        where = f"iter {old['iter']}" if "iter" in old else f"{prev:.3e} baseline FLOPs"
        raise ValueError(f"not replacing {out_dir}/summary.json and loss_vs_flops.png: they compare the runs at "
                         f"{where}, further than the logs now reach ({ends}). Let the runs finish (python train.py "
                         f"--compare --resume=True --out_dir={out_dir}), or delete summary.json to plot them as "
                         f"they are")
    h, title = read_log(os.path.join(runs[0][1], "log.jsonl"), header=True), ""
    if h:
        c, summary["passes"] = h["config"], h.get("passes")
        title = (f"{c['dataset']}: n_layer={c['n_layer']}, n_embd={c['n_embd']}, n_head={c['n_head']}, block_size="
                 f"{c['block_size']}, batch_size={c['batch_size']}, {c['max_iters']} iters, lr={c['learning_rate']:g}, "
                 f"router_lr={c['router_lr']:g}; val loss on {c['eval_iters']} fixed batches")
    if cut:
        title += f"\ncompared at iter {at}, the last one all runs reached ({ends})"
    path = os.path.join(out_dir, "loss_vs_flops.png")
    plot_compare(path, baseline_runs, lime_runs, summary, title)
    lines = format_summary(summary)
    if any("accuracy" in r for r in baseline_runs[0]):  # a task: accuracy too (see plot_accuracy)
        tests = {(v, seed): read_test_accuracy(os.path.join(d, "log.jsonl"), at)
                 for seed, b, l in runs for v, d in (("baseline", b), ("lime", l))}
        summary["accuracy"] = summarize_accuracy([r[0] for r in runs], baseline_runs, lime_runs, tests)
        path += " and " + os.path.join(out_dir, "accuracy_vs_flops.png")
        plot_accuracy(os.path.join(out_dir, "accuracy_vs_flops.png"), baseline_runs, lime_runs, summary, title)
        lines += format_accuracy(summary["accuracy"], len(runs))
    with atomic_file(os.path.join(out_dir, "summary.json")) as f:
        json.dump(summary, f, indent=1)
    print("\n".join(lines) + f"\nwrote {path} and {os.path.join(out_dir, 'summary.json')}")
    return summary


# comparing on a task (row datasets): the accuracy logged at every evaluation and the test accuracy at the end

def summarize_accuracy(seeds, baseline_runs, lime_runs, tests):
    """Per seed: final val accuracy (ACCURACY_PROBLEMS problems), test accuracy (tests: {(variant, seed):
    log record or None}) and the FLOPs at which LIMe's accuracy first reaches the baseline's final one
    (ratio to the baseline's total FLOPs; None: never). Then mean and std (ddof=1) over seeds."""
    out = dict(per_seed=[])
    for seed, b, l in zip(seeds, baseline_runs, lime_runs):
        (bf, ba, _, _), (lf, la, _, _) = mean_band([b], "accuracy"), mean_band([l], "accuracy")
        match = flops_to_reach(lf, -la, -ba[-1])  # first reaching an accuracy = first getting down to its negative
        t = {v: tests.get((v, seed)) for v in ("baseline", "lime")}
        out["per_seed"].append(dict(seed=seed, baseline_accuracy=ba[-1], lime_accuracy=la[-1],
                                    baseline_test_accuracy=t["baseline"] and t["baseline"]["test_accuracy"],
                                    lime_test_accuracy=t["lime"] and t["lime"]["test_accuracy"],
                                    lime_flops_to_match=match, ratio=None if match is None else match / bf[-1]))
    for v in ("baseline", "lime"):
        for key in ("accuracy", "test_accuracy"):
            vals = [p[f"{v}_{key}"] for p in out["per_seed"]]
            if None not in vals:
                out[f"{v}_{key}_mean"] = float(np.mean(vals))
                out[f"{v}_{key}_std"] = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
    (bf, bm, _, _), (lf, lm, _, _) = mean_band(baseline_runs, "accuracy"), mean_band(lime_runs, "accuracy")
    match = flops_to_reach(lf, -lm, -bm[-1])
    out["mean_curve"] = dict(lime_flops_to_match=match, ratio=None if match is None else match / bf[-1])
    return json.loads(json.dumps(out, default=float))


def format_accuracy(a, n):
    """The accuracy part of the summary as printed lines."""
    ratio = lambda r: "never" if r is None else f"{r:.2f}x"
    pm = lambda key: "?" if f"{key}_mean" not in a else f"{a[f'{key}_mean']:.1%}" + (
        f" ± {a[f'{key}_std']:.1%}" if n > 1 else "")
    lines = [f"accuracy (greedy, final answer correct){', mean ± std' if n > 1 else ''}: "
             f"val = first {ACCURACY_PROBLEMS} val problems at the end, test = the whole test split",
             f"  baseline  val {pm('baseline_accuracy')}  test {pm('baseline_test_accuracy')}",
             f"  LIMe      val {pm('lime_accuracy')}  test {pm('lime_test_accuracy')}"]
    per_seed = ", ".join(f"{p['seed']}: {ratio(p['ratio'])}" for p in a["per_seed"])
    lines.append("LIMe's FLOPs to first reach the baseline's final val accuracy / baseline's total FLOPs"
                 + (f": {ratio(a['per_seed'][0]['ratio'])}" if n == 1 else
                    f", per seed: {per_seed}; mean curves: {ratio(a['mean_curve']['ratio'])}"))
    return lines


def plot_accuracy(path, baseline_runs, lime_runs, summary, title=""):
    """Val loss (and smoothed train loss) against training FLOPs on the left, val accuracy on the right;
    mean over seeds with min-max bands. Written atomically to path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for runs, color, label in ((baseline_runs, "tab:blue", "baseline"), (lime_runs, "tab:red", "LIMe")):
        (vf, vm, vlo, vhi), (tf, tm, _, _) = mean_band(runs, "val_loss"), mean_band(runs, "train_loss")
        af, am, alo, ahi = mean_band(runs, "accuracy")
        axes[0].plot(tf, smooth(tm), color=color, alpha=0.35, lw=1, label=f"{label} train (smoothed)")
        axes[0].plot(vf, vm, color=color, lw=2.2, marker="o", ms=4, label=f"{label} val")
        axes[1].plot(af, 100 * am, color=color, lw=2.2, marker="o", ms=4, label=label)
        if len(runs) > 1:
            axes[0].fill_between(vf, vlo, vhi, color=color, alpha=0.2, lw=0)
            axes[1].fill_between(af, 100 * alo, 100 * ahi, color=color, alpha=0.2, lw=0, label=f"{label}, min-max over seeds")
    a = summary["accuracy"]
    axes[1].axhline(100 * a["baseline_accuracy_mean"], color="gray", ls=":", lw=1.2, label="baseline's final accuracy")
    if a["mean_curve"]["lime_flops_to_match"] is not None:
        axes[1].axvline(a["mean_curve"]["lime_flops_to_match"], color="tab:red", ls=":", lw=1.2,
                        label=f"LIMe reaches it: {a['mean_curve']['ratio']:.2f}x the FLOPs")
    n = len(baseline_runs)
    axes[0].set(xlabel="cumulative training FLOPs", ylabel="loss on the solution tokens (nats/token)", yscale="log",
                title="loss vs training FLOPs" + (f" (mean of {n} seeds, log scale)" if n > 1 else " (log scale)"))
    axes[1].set(xlabel="cumulative training FLOPs", ylabel="accuracy (%)", title=f"accuracy vs training FLOPs: "
                f"greedy solutions of {ACCURACY_PROBLEMS} val problems, final answer correct")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].title.set_fontsize(10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110)
    os.replace(path + ".tmp.png", path)
    plt.close(fig)


def compare(cfg, explicit=()):
    """Baseline then LIMe, per seed, with identical data order, init, eval batches and schedule; then the
    figure, the summary and the analysis. With --resume, runs with a checkpoint continue (finished ones
    are kept as they are) and the others start."""
    cfg = resolve(cfg)
    out_dir, seeds = cfg["out_dir"], [cfg["seed"] + i for i in range(cfg["seeds"])]
    if "lime" in explicit:
        print("note: --compare trains both variants; --lime is ignored")
    master = ddp_rank_world()[0] == 0
    if master:  # under torchrun rank 0 alone looks and writes here (the others might see its writes, and refuse)
        dirs = [run_dir(out_dir, v, i, s) for i, s in enumerate(seeds) for v in ("baseline", "lime")]
        found = [f for f in ("summary.json", "loss_vs_flops.png") if os.path.exists(os.path.join(out_dir, f))] + \
            [os.path.basename(d) for d in dirs if run_files(d)]
        if found and not cfg["resume"]:  # never replace a comparison's runs and results without being asked
            raise ValueError(f"{out_dir} already holds a comparison ({', '.join(found)}); continue it with --compare "
                             f"--resume=True, or use a new --out_dir (to start over, delete {out_dir} first)")
        make_out_dir(out_dir)
        if (read_summary(out_dir) or {}).get("seeds") != seeds:  # marks which seeds belong to this comparison
            with atomic_file(os.path.join(out_dir, "summary.json")) as f:
                json.dump(dict(seeds=seeds, status="training"), f)
    for i, seed in enumerate(seeds):
        for variant in ("baseline", "lime"):
            d = run_dir(out_dir, variant, i, seed)
            print(f"\n=== {variant}, seed {seed} ({i + 1}/{len(seeds)}) -> {d}")
            resume = cfg["resume"] and os.path.exists(os.path.join(d, "ckpt.pt"))
            if cfg["resume"] and not resume and os.path.exists(os.path.join(d, "log.jsonl")):
                print(f"note: {d} stopped before its first checkpoint; starting it over")
                if master:
                    os.remove(os.path.join(d, "log.jsonl"))
            mix = {} if variant == "lime" else LIME_PAPER  # --lime_kv, --lime_sources: for LIMe, not the baseline
            train(dict(cfg, lime=variant == "lime", seed=seed, out_dir=d, resume=resume, compare=False, seeds=1,
                       **mix), set(explicit) | {"lime", "seed"})
    if not master:
        return None  # rank 0 alone plots, summarizes and analyzes
    print()
    summary = report(out_dir)
    run_analyze(out_dir, cfg["device"])
    return summary


# -----------------------------------------------------------------------------------------------------
# depth sweep: a --compare per depth into OUT/depthL, then final val loss against depth and FLOPs

def parse_depths(s):
    try:
        depths = sorted({int(d) for d in s.split(",")})
    except ValueError:
        depths = []
    if not depths or depths[0] < 1:
        raise ValueError(f"--depths={s} is not a comma-separated list of layer counts >= 1, e.g. --depths=4,8,16")
    return depths


def sweep(cfg, explicit=()):
    """--compare at every depth of --depths (same width, heads, tokens, schedule and seeds), into
    OUT/depthL; then sweep_report(OUT). With --resume, finished runs are kept and the others continue."""
    out_dir = cfg["out_dir"] or "out-depth"
    for L in parse_depths(cfg["depths"]):
        print(f"\n##### depth {L}")
        compare(dict(cfg, n_layer=L, out_dir=os.path.join(out_dir, f"depth{L}"), depths=None),
                set(explicit) | {"n_layer"})
    if ddp_rank_world()[0] > 0:
        return None  # rank 0 alone summarizes
    return sweep_report(out_dir)


def final_val(recs):
    """(iter, val loss, FLOPs) of a log's last evaluation."""
    r = [r for r in recs if r.get("val_loss") is not None][-1]
    return r["iter"], r["val_loss"], r["flops"]


def sweep_report(out_dir):
    """OUT/sweep.json, OUT/loss_vs_depth.png and a printed summary, from the logs of OUT/depthL alone: per
    depth and variant, every seed's final val loss, their mean, min and max, and the training FLOPs."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    depths = sorted(int(d[5:]) for d in names if d.startswith("depth") and d[5:].isdigit())
    if not depths:
        raise FileNotFoundError(f"no depth runs in {out_dir} (expected {out_dir}/depthL); make them with: "
                                f"python train.py --compare --depths=4,8,16 --out_dir={out_dir}")
    rows = []
    for L in depths:
        runs = find_runs(os.path.join(out_dir, f"depth{L}"))
        row = dict(n_layer=L, seeds=[r[0] for r in runs])
        for i, v in ((1, "baseline"), (2, "lime")):
            ends = [final_val(read_log(os.path.join(r[i], "log.jsonl"))) for r in runs]
            losses = [e[1] for e in ends]
            row[v] = dict(iters=[e[0] for e in ends], val_loss=losses, mean=float(np.mean(losses)),
                          min=min(losses), max=max(losses), flops=float(np.mean([e[2] for e in ends])))
        rows.append(row)
    lines = [f"final val loss by depth, mean over seeds (min-max); {out_dir}"]
    for r in rows:
        b, l = r["baseline"], r["lime"]
        lines.append(f"  {r['n_layer']:>3} layers, {len(r['seeds'])} seed{'s' if len(r['seeds']) > 1 else ''}: "
                     f"baseline {b['mean']:.4f} ({b['min']:.4f}-{b['max']:.4f}) {b['flops']:.2e} FLOPs | "
                     f"LIMe {l['mean']:.4f} ({l['min']:.4f}-{l['max']:.4f}) {l['flops']:.2e} FLOPs | "
                     f"LIMe - baseline {l['mean'] - b['mean']:+.4f}")
    by_depth = {r["n_layer"]: r for r in rows}
    for L in depths:  # the paper's question: LIMe at depth L against the baseline at 2L
        if 2 * L in by_depth:
            l, b = by_depth[L]["lime"], by_depth[2 * L]["baseline"]
            lines.append(f"  LIMe at {L} layers {l['mean']:.4f} with {l['flops'] / b['flops']:.2f}x the FLOPs of the "
                         f"baseline at {2 * L} layers {b['mean']:.4f}")
    summary = dict(depths=depths, per_depth=rows)
    with atomic_file(os.path.join(out_dir, "sweep.json")) as f:
        json.dump(summary, f, indent=1)
    path = os.path.join(out_dir, "loss_vs_depth.png")
    plot_depths(path, rows)
    print("\n".join(lines) + f"\nwrote {path} and {os.path.join(out_dir, 'sweep.json')}")
    return summary


def plot_depths(path, rows):
    """Final val loss against depth (left) and against training FLOPs (right), both variants, mean with a
    min-max band over seeds; written atomically to path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for v, color, label in (("baseline", "tab:blue", "baseline"), ("lime", "tab:red", "LIMe")):
        depth = [r["n_layer"] for r in rows]
        mean, lo, hi, flops = ([r[v][k] for r in rows] for k in ("mean", "min", "max", "flops"))
        for ax, x in zip(axes, (depth, flops)):
            ax.plot(x, mean, color=color, marker="o", lw=2, label=label)
            if any(len(r["seeds"]) > 1 for r in rows):
                ax.fill_between(x, lo, hi, color=color, alpha=0.2, lw=0, label=f"{label}, min-max over seeds")
        for L, f, m in zip(depth, flops, mean):
            axes[1].annotate(f"{L}", (f, m), textcoords="offset points", xytext=(4, 4), fontsize=8, color=color)
    axes[0].set(xscale="log", xlabel="layers", ylabel="final val loss (nats/token)", title="final val loss vs depth")
    axes[0].set_xticks(depth, [str(d) for d in depth])
    axes[0].minorticks_off()  # (log axis: only the depths are labelled)
    axes[1].set(xscale="log", xlabel="training FLOPs", ylabel="final val loss (nats/token)",
                title="final val loss vs training FLOPs (labels: layers)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def run_analyze(out_dir, device="auto"):
    """`python analyze.py OUT`: the paper's analyses of a --compare folder. A separate process, so the
    scripts never import each other (analyze.py takes what it shares with this file from common.py)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "analyze.py")
    if subprocess.run([sys.executable, script, out_dir, f"--device={device}"]).returncode != 0:
        raise ValueError(f"the analysis failed (see above); retry with: python analyze.py {out_dir}")


def main(argv=None):
    cfg, explicit = get_config(argv)
    if (cfg["plot"] or cfg["analyze"]) and int(os.environ.get("RANK", 0)) > 0:
        return None  # under torchrun, rank 0 alone redraws or analyzes
    if cfg["plot"]:  # a depth sweep's folder, or a comparison's
        is_sweep = os.path.isdir(cfg["plot"]) and any(d.startswith("depth") for d in os.listdir(cfg["plot"]))
        return sweep_report(cfg["plot"]) if is_sweep else report(cfg["plot"])
    if cfg["analyze"]:
        return run_analyze(cfg["analyze"], cfg["device"])
    if cfg["depths"] and not cfg["compare"]:
        raise ValueError("--depths is for --compare: python train.py --compare --depths=4,8,16")
    if cfg["compare"] and cfg["hc_rate"]:
        raise ValueError("--compare trains the baseline and LIMe only; train Hyper-Connections as a single run: "
                         "python train.py --hc_rate=4 --out_dir=out-hc")
    if cfg["seeds"] != 1 and not cfg["compare"]:
        raise ValueError("--seeds is for --compare; a single run uses --seed")
    cfg["device"] = setup_ddp(cfg["device"])  # under torchrun: join the other processes, take our own GPU
    if cfg["compare"]:
        result = sweep(cfg, explicit) if cfg["depths"] else compare(cfg, explicit)
    else:
        result = train(cfg, explicit)
    if dist.is_initialized():  # (after an error, don't: torchrun stops the other processes)
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # progress reaches `python train.py ... > log` as it happens
    try:
        main()
    except (ValueError, OSError) as e:  # bad input, or a file we can't read or write: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\ninterrupted; continue with the same command plus --resume=True", file=sys.stderr)
        sys.exit(130)
    if "RANK" in os.environ:
        # under torchrun, done: skip the interpreter's teardown. DDP leaves gloo's threads running past
        # destroy_process_group, and tearing them down at exit aborts the process now and then (torch 2.13 CPU:
        # "terminate called without an active exception", 7 in 25 runs of a 10-line DDP script; 0 in 25 with
        # this exit), which makes torchrun fail a finished job
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
