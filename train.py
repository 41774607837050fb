"""
Train one GPT, with or without LIMe, and log its loss against training FLOPs. To train several variants on
identical data and compare them (seeds, depth sweeps, figures, analyses), use compare.py.

    python prepare_data.py                          # once: makes data/quickstart
    python train.py                                 # the baseline: ~2 min on 2 CPU cores -> out/
    python train.py --lime=True --out_dir=out-lime  # LIMe
    python train.py --hc_rate=4 --out_dir=out-hc    # Hyper-Connections, 4 streams (the paper's other baseline)
    python train.py --out_dir=out --resume=True     # continue a run exactly where it stopped
    python train.py --preset=gpu --out_dir=out-gpu  # bigger model for one GPU; --preset=deep: 24 narrow layers
    python train.py --preset=arithmetic --lime=True # the arithmetic task (prepare_data.py --task=arithmetic
                                                    # --operands=5 first): accuracy too
    torchrun --standalone --nproc_per_node=8 train.py --preset=gpu --batch_size=4 --gradient_accumulation_steps=8
                                                    # 8 GPUs (DistributedDataParallel), the gpu preset's batch

Flags are nanoGPT's, written --key=value. A preset (cpu, the default; see PRESETS) sets the model size and
schedule; flags given explicitly override it. Training FLOPs = 3 x model.flops_per_token(block_size) x tokens
seen (2 FLOPs per multiply-add, attention over the full T x T square, see lime.py; on a task, padding too). An
out_dir that holds a run is never overwritten: continue it with --resume=True, or delete it to start over.

Under torchrun the flags still describe the whole run: one optimizer step is gradient_accumulation_steps
micro-batches of batch_size sequences in total, split evenly over the processes (so it must be divisible by
their number), and every process trains on exactly the batches its share of a 1-process run would. Rank 0
alone evaluates, logs, checkpoints and prints.
"""

import argparse
import json
import math
import os
import shlex
import sys
import time
from contextlib import nullcontext, suppress
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (ArgParser, check_dataset, check_fits, ddp_rank_world, fixed_val_batches, from_rank0, kept_text,
                    load_weights, make_out_dir, read_checkpoint, read_log, run_files, run_main, sample_batch,
                    save_checkpoint, schedule_warnings, setup_ddp, setup_device, start_log, str2bool,
                    variant_name)
from lime import GPT, GPTConfig, LIME_KV, LIME_SOURCES
from prepare_data import load_meta, load_rows, load_tokens, on_full_disk, task_answer

# -----------------------------------------------------------------------------------------------------
# config: nanoGPT flag names; None = filled in by the preset or derived (see resolve)

FLAGS = [  # name, type, default, help
    ("out_dir", str, "out", "run folder"),
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
    ("gradient_accumulation_steps", int, 1, "micro-batches per step, over all processes (a multiple of their number)"),
    ("device", str, "auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps; under torchrun cuda or cpu"),
    ("dtype", str, "auto", "auto (bfloat16 on CUDA if supported, else float16; float32 elsewhere), "
                           "float32, bfloat16, float16"),
    ("compile", bool, False, "torch.compile the model"),
    ("seed", int, 1337, "seed of the initial weights and of the data order"),
    ("resume", bool, False, "continue the run in out_dir from its checkpoint"),
    ("preset", str, "cpu", "cpu | gpu | deep | bpe | arithmetic | arithmetic-gpu, see PRESETS"),
]
FLAG_NAMES = {name for name, _, _, _ in FLAGS}
PRESETS = {
    # quick start: about 2 min per run on 2 quiet CPU cores (measured: ~160 ms/iter baseline, ~210 LIMe)
    "cpu": dict(n_layer=6, n_head=4, n_embd=128, block_size=128, batch_size=16, max_iters=600,
                eval_interval=50, eval_iters=10, log_interval=10, warmup_iters=30, learning_rate=2e-3),
    # one modern GPU, bf16: 39M params (char vocab), 16k tokens/step, 2.2e16 training FLOPs per run (3.5e16 with
    # the GPT-2 vocab). Estimated, not measured: at 30% MFU ~4 min per run on an A100, ~1.5 min on an H100;
    # eager LIMe at lower MFU takes longer. The quickstart data is far too small for it (~200 epochs: it overfits).
    "gpu": dict(n_layer=12, n_head=8, n_embd=512, block_size=512, batch_size=32, max_iters=5000,
                eval_interval=250, eval_iters=40, log_interval=50, warmup_iters=200, learning_rate=1e-3),
    # deep and narrow, where the mix is the largest share of the work (the shape bench.py measures). 480 iters
    # of 4096 tokens: 1.96 passes over tiny Shakespeare's 1.0M training tokens (more would measure memorization)
    "deep": dict(n_layer=24, n_head=4, n_embd=64, block_size=128, batch_size=32, max_iters=480,
                 eval_interval=40, eval_iters=10, log_interval=20, warmup_iters=50, learning_rate=2e-3),
    # GPT-2 BPE on tiny Shakespeare (prepare_data.py --tokenizer=gpt2 --name=shakespeare_gpt2), deep and narrow so
    # the 50,257-token tied embedding is about half the model: 55.7% of the 5.78M params, 49% of the FLOPs (LIMe
    # 45%). 150 iters of 2048 tokens = 1.01 passes over the 304,223 training tokens; 1.21e13 training FLOPs per run
    "bpe": dict(dataset="shakespeare_gpt2", n_layer=48, n_head=4, n_embd=64, block_size=128, batch_size=16,
                max_iters=150, eval_interval=25, eval_iters=8, log_interval=10, warmup_iters=15, learning_rate=2e-3),
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
RUNTIME = {"out_dir", "device", "dtype", "compile", "fused_mix", "resume", "preset"}
# on --resume these must match the checkpoint if given explicitly: the run would no longer be the same run
RESUME_FIXED = ["dataset", "n_layer", "n_head", "n_embd", "block_size", "lime", "lime_kv", "lime_sources", "hc_rate",
                "hc_dynamic", "seed", "batch_size", "gradient_accumulation_steps"]
# LIMe's mix as in the paper and no HC: what checkpoints from before these flags used
BEFORE_SWITCHES = dict(lime_kv="kv", lime_sources="all", hc_rate=0, hc_dynamic=True)
# what a checkpoint must hold to be resumed from
RESUME_KEYS = ("model_args", "model", "optimizer", "iter_num", "best_val_loss", "config", "rng_cpu")
# train.py's flags before compare.py took them over: they now print where to go
MOVED_TO_COMPARE = ("compare", "seeds", "depths", "variants", "plot", "analyze")

MAX_PASSES = 2  # a run that sees its training tokens more often than this gets a warning (it would overfit)
MIN_VALUES = dict(batch_size=1, block_size=1, n_layer=1, n_head=1, n_embd=1, eval_interval=1, eval_iters=1,
                  log_interval=1, gradient_accumulation_steps=1, max_iters=0, warmup_iters=0,
                  lr_decay_iters=0, min_lr=0, grad_clip=0, weight_decay=0, router_lr=0, seed=0, hc_rate=0)


def get_config(argv=None, flags=FLAGS, presets=PRESETS, prog="train.py", description=__doc__):
    """-> (config dict with every flag, set of flags given explicitly). Preset values count as explicit
    when --preset itself is given. compare.py passes its own flags and presets (train.py's and more)."""
    parser = ArgParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, typ, default, help in flags:
        default = presets["cpu"].get(name, default)
        help += "" if default is None else f" [{default}]"
        if typ is bool:  # --resume alone means --resume=True
            parser.add_argument(f"--{name}", type=str2bool, nargs="?", const=True, help=help)
        else:
            parser.add_argument(f"--{name}", type=typ, help=help)
    args = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    empty = [k for k, v in args.items() if v == ""]  # (--out_dir= would write into the current folder)
    if empty:
        raise ValueError(f"--{empty[0]} is empty; give it a value (see python {prog} --help)")
    preset = args.get("preset", "cpu")
    if preset not in presets:
        raise ValueError(f"unknown --preset={preset}; choose one of {', '.join(presets)}")
    explicit = set(args) | (set(presets[preset]) if "preset" in args else set())
    return {**{name: default for name, _, default, _ in flags}, **presets[preset], **args}, explicit


def resolve(cfg):
    """Fill in the derived defaults and check the numbers; returns a new dict. Called once per run, before
    anything is read or written (on --resume the checkpoint's config, resolved when it was trained, joins it)."""
    cfg = dict(cfg)
    for name, typ, _, _ in FLAGS:  # nan and inf parse as floats, and compare False with everything
        if typ is float and cfg[name] is not None and not math.isfinite(cfg[name]):
            raise ValueError(f"--{name} must be a finite number, got {cfg[name]}")
    if not cfg["learning_rate"] > 0:  # before min_lr = learning_rate / 10 gets the blame
        raise ValueError(f"--learning_rate must be > 0, got {cfg['learning_rate']}")
    cfg["lr_decay_iters"] = cfg["max_iters"] if cfg["lr_decay_iters"] is None else cfg["lr_decay_iters"]
    cfg["min_lr"] = cfg["learning_rate"] / 10 if cfg["min_lr"] is None else cfg["min_lr"]
    for k, lo in MIN_VALUES.items():
        if k == "block_size" and cfg[k] is None:  # a row dataset's row length sets it (see row_config)
            continue
        if cfg[k] < lo:
            raise ValueError(f"--{k} must be at least {lo}, got {cfg[k]}")
    if cfg["lr_decay"] not in ("cosine", "linear"):
        raise ValueError(f"--lr_decay must be cosine or linear, got {cfg['lr_decay']!r}")
    for k in ("dropout", "beta1", "beta2"):
        if not 0 <= cfg[k] < 1:
            raise ValueError(f"need 0 <= --{k} < 1, got {cfg[k]}")
    if cfg["seed"] >= 2**63:  # (torch.manual_seed's limit)
        raise ValueError(f"--seed must be below 2**63, got {cfg['seed']}")
    for k, allowed in (("lime_kv", LIME_KV), ("lime_sources", LIME_SOURCES)):
        if cfg[k] not in allowed:
            raise ValueError(f"--{k} must be one of {', '.join(allowed)}, got {cfg[k]!r}")
        if cfg[k] != BEFORE_SWITCHES[k] and not (cfg["lime"] or cfg["resume"]):  # (resume: checked against ckpt)
            raise ValueError(f"--{k}={cfg[k]} changes LIMe's mix: add --lime=True")
    return cfg


# -----------------------------------------------------------------------------------------------------
# data: memmapped token files; batches are a pure function of (seed, iteration)

def train_batches(data, cfg, it):
    """The gradient_accumulation_steps micro-batches of step `it`. A function of (seed, it) alone, so every
    model trained with the same seed sees identical batches and a resumed run needs no data RNG state."""
    if isinstance(data, Rows):
        return row_batches(data, cfg, it)
    rng = np.random.default_rng([cfg["seed"], it])
    return [sample_batch(data, cfg["block_size"], cfg["batch_size"], rng)
            for _ in range(cfg["gradient_accumulation_steps"])]


@dataclass
class Data:
    """A dataset opened for training: its meta.json, the two splits, and the fixed validation batches."""
    meta: dict
    train: object        # the training split: a token memmap, or Rows for a task
    val: object          # the validation split, the same kind
    val_batches: list    # (x, y) pairs, the same at every evaluation and for every run on this data
    rows: bool           # a task of problems (prepare_data.py --task=...) rather than text


def load_data(cfg, explicit=()):
    """-> (cfg, Data), with errors that say how to fix them. On a task (a row dataset) cfg's block_size
    becomes the row length - 1 (see row_config)."""
    path = os.path.join(cfg["data_dir"], cfg["dataset"])
    meta = load_meta(path)  # FileNotFoundError with the prepare_data.py command that makes it
    if meta.get("layout") == "rows":
        cfg = row_config(cfg, meta, explicit)
        train, val = (Rows(load_rows(path, s, meta), meta) for s in ("train", "val"))
        return cfg, Data(meta, train, val, fixed_row_batches(val, cfg["batch_size"], cfg["eval_iters"]), True)
    if cfg["block_size"] is None:
        raise ValueError(f"{path} is a text dataset: give it a --block_size")
    splits = [load_tokens(path, s, meta) for s in ("train", "val")]
    for split, data in zip(("train", "val"), splits):
        if len(data) <= cfg["block_size"]:
            raise ValueError(f"block_size={cfg['block_size']} is too large for {path}: its {split} split has only "
                             f"{len(data)} tokens (needs block_size + 1); use a smaller --block_size or more text")
    val_batches = fixed_val_batches(splits[1], cfg["block_size"], cfg["batch_size"], cfg["eval_iters"])
    return cfg, Data(meta, *splits, val_batches, False)


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


def log_test_accuracy(model, cfg, meta, ctx, log_path, iter_num, done=False):
    """Accuracy on the whole test split, appended to the log as {"test_accuracy", "test_problems",
    "at_iter"} (no "iter" key: the curves skip it); printed, and returned. done (a finished run resumed):
    the log's record of iter_num if it has one, nothing written."""
    old = [r for r in read_log(log_path, key="test_accuracy") if r.get("at_iter") == iter_num] \
        if done and os.path.exists(log_path) else []
    if old:
        rec = old[-1]
    else:
        test = Rows(load_rows(os.path.join(cfg["data_dir"], cfg["dataset"]), "test", meta), meta)
        rec = dict(test_accuracy=answer_accuracy(model, test, ctx), test_problems=len(test), at_iter=iter_num)
        with on_full_disk(log_path, kept_text(os.path.join(cfg["out_dir"], "ckpt.pt"), iter_num, "the log's "
                                              "training records")), open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    print(f"test accuracy {rec['test_accuracy']:.1%} ({rec['test_problems']} problems, greedy, iter {iter_num})")
    return rec


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


class NonFiniteLoss(ValueError):
    pass


def fmt_time(s):
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def open_run(cfg, explicit, master):
    """-> (cfg, checkpoint to resume from or None). On --resume the checkpoint's config, with the runtime
    flags and the explicitly given ones from cfg (ValueError naming the field if an explicit flag contradicts
    the checkpoint); otherwise a refusal to replace a run that lives in out_dir."""
    out_dir = cfg["out_dir"]
    path = os.path.join(out_dir, "ckpt.pt")
    if not cfg["resume"]:
        if master and run_files(out_dir):  # never replace a run's checkpoint and log without being asked
            raise ValueError(f"{out_dir} already holds a run ({', '.join(run_files(out_dir))}); continue it with "
                             f"--resume=True, or train into a new --out_dir (to start over, delete {out_dir} first)")
        return cfg, None
    if not os.path.exists(path):
        hint = (f"its log.jsonl is of a run stopped before its first checkpoint: to start over, delete {out_dir}"
                if os.path.exists(os.path.join(out_dir, "log.jsonl")) else "drop --resume to start a new run")
        raise FileNotFoundError(f"--resume: no checkpoint at {path}; {hint}")
    ckpt = read_checkpoint(path, "cpu", RESUME_KEYS)
    old = {**BEFORE_SWITCHES, **ckpt["config"]} if isinstance(ckpt["config"], dict) else {}
    missing = [k for k in RESUME_FIXED if k not in old]
    if missing:
        raise ValueError(f"{path} is not a usable checkpoint: its config lacks {', '.join(missing)} (not written "
                         f"by train.py?); restore it, or train a new run into a fresh --out_dir")
    for k in RESUME_FIXED:
        if k in explicit and cfg[k] != old[k]:
            raise ValueError(f"can't resume from {path}: {k} differs (checkpoint has {old[k]!r}, "
                             f"--{k}={cfg[k]!r}); drop --{k}, or train into a new --out_dir")
    now = {k: v for k, v in cfg.items() if k in RUNTIME or k in explicit}
    return {**cfg, **{k: v for k, v in old.items() if k in FLAG_NAMES}, **now}, ckpt


def model_config(cfg, meta):
    """The GPTConfig of cfg's model on a dataset with this meta.json."""
    return GPTConfig(vocab_size=meta["vocab_size"], block_size=cfg["block_size"], n_layer=cfg["n_layer"],
                     n_head=cfg["n_head"], n_embd=cfg["n_embd"], dropout=cfg["dropout"], lime=cfg["lime"],
                     fused_mix=cfg["fused_mix"], lime_kv=cfg["lime_kv"], lime_sources=cfg["lime_sources"],
                     hc_rate=cfg["hc_rate"], hc_dynamic=cfg["hc_dynamic"])


def make_model(cfg, meta, ckpt, device, dtype):
    """-> (GPT on device, its model_args, optimizer, grad scaler). The init depends on the seed alone: the
    same weights, routers aside, with and without LIMe. On resume: the checkpoint's weights (if its model is
    this model), optimizer, scaler and RNG states; each parameter group's peak lr and weight decay stay
    those of the flags given now."""
    torch.manual_seed(cfg["seed"])  # right before the model: same non-router init with and without LIMe
    config = model_config(cfg, meta)
    model_args = asdict(config)
    path, device_type = os.path.join(cfg["out_dir"], "ckpt.pt"), torch.device(device).type
    for k, v in ({**BEFORE_SWITCHES, **ckpt["model_args"]} if ckpt is not None else {}).items():
        if k not in ("dropout", "fused_mix") and model_args.get(k) != v:  # e.g. the data was re-prepared
            raise ValueError(f"can't resume from {path}: model {k} differs (checkpoint has {v!r}, "
                             f"now {model_args.get(k)!r})")
    check_fits(config, device)  # (before anything is allocated)
    model = GPT(config).to(device)
    optimizer = model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"], (cfg["beta1"], cfg["beta2"]),
                                           cfg["router_lr"], device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")
    if ckpt is not None:
        load_weights(model, ckpt, path)
        peaks = [(g["peak_lr"], g["weight_decay"]) for g in optimizer.param_groups]
        optimizer.load_state_dict(ckpt["optimizer"])
        for g, (peak_lr, wd) in zip(optimizer.param_groups, peaks):
            g["peak_lr"], g["weight_decay"] = peak_lr, wd
        if "scaler" in ckpt:
            scaler.load_state_dict(ckpt["scaler"])
        torch.set_rng_state(ckpt["rng_cpu"])
        if device_type == "cuda" and ckpt["rng_cuda"]:
            torch.cuda.set_rng_state_all(ckpt["rng_cuda"])
    return model, model_args, optimizer, scaler


def train_step(ddp_model, optimizer, scaler, batches, cfg, it, ctx, device):
    """One optimizer step on this process's share of the step's micro-batches (all of them without torchrun):
    forward, backward, clip, update. Returns the step's mean loss as a tensor on the device (no sync)."""
    rank, world = ddp_rank_world()
    k = cfg["gradient_accumulation_steps"] // world  # micro-batches per step on this rank
    step_loss = 0.0
    for i, (x, y) in enumerate(batches[rank * k:(rank + 1) * k]):  # the whole step's, each rank its own share
        if device.startswith("cuda"):
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        if cfg["dropout"] > 0:  # masks, like the batches, a function of (seed, iter, micro-batch)
            torch.manual_seed(int(np.random.SeedSequence([cfg["seed"], it, rank * k + i]).generate_state(1)[0]))
        # all-reduce the gradients once per step, in the last micro-batch's backward
        with ddp_model.no_sync() if i < k - 1 and isinstance(ddp_model, DDP) else nullcontext():
            with ctx:
                _, loss = ddp_model(x.to(device), y.to(device))
            step_loss = step_loss + loss.detach().float() / k
            scaler.scale(loss / k).backward()  # / k here, / world in DDP's all-reduce: mean over accum
    if cfg["grad_clip"] > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), cfg["grad_clip"])  # (the model's, in its order)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return step_loss


def mean_losses(losses, iter_num):
    """The steps' losses since the last record (device tensors) as floats, each the mean over every rank's
    micro-batches: the one host-device sync per record. NonFiniteLoss naming the first bad step."""
    values = torch.stack(losses)
    if dist.is_initialized():  # (gloo has no AVG)
        dist.all_reduce(values)
        values /= dist.get_world_size()
    values = values.tolist()
    for i, v in enumerate(values):
        if not math.isfinite(v):  # values[i]: the loss of the step that made iteration iter_num - len(values) + i + 1
            raise NonFiniteLoss(f"training loss is {v} at iteration {iter_num - len(values) + i + 1}")
    return values


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


def run_eval(model, raw_model, data, ctx, device, iter_num):
    """{"val_loss"} of the model now, and on a task its "accuracy" (greedy solutions of the first
    ACCURACY_PROBLEMS val problems). Rank 0 evaluates; every rank gets its numbers."""
    master = ddp_rank_world()[0] == 0
    out = dict(val_loss=from_rank0(evaluate(model, data.val_batches, ctx, device) if master else 0.0, device))
    if not math.isfinite(out["val_loss"]):
        raise NonFiniteLoss(f"val loss is {out['val_loss']} at iteration {iter_num}")
    if data.rows:
        out["accuracy"] = from_rank0(answer_accuracy(raw_model, data.val, ctx, ACCURACY_PROBLEMS) if master else 0.0,
                                     device)
    return out


def train(cfg, explicit=(), warn=True):
    """Train one model as cfg (get_config's dict, after resolve) says, logging to out_dir/log.jsonl and
    checkpointing to out_dir/ckpt.pt at every evaluation. explicit: the flags given explicitly (on --resume
    they win over the checkpoint's). Returns {"out_dir", "iter", "val_loss", "flops"} of the end, and on a
    task "accuracy" and "test_accuracy". warn: print schedule_warnings (compare.py prints them once itself)."""
    rank, world = ddp_rank_world()
    master = rank == 0  # rank 0 alone checks and writes out_dir, evaluates, logs and checkpoints
    cfg, ckpt = open_run(cfg, explicit, master)
    for w in schedule_warnings(cfg) if warn else []:
        print(f"warning: {w}")
    out_dir = cfg["out_dir"]
    ckpt_path, log_path = os.path.join(out_dir, "ckpt.pt"), os.path.join(out_dir, "log.jsonl")
    if cfg["gradient_accumulation_steps"] % world:
        raise ValueError(f"--gradient_accumulation_steps={cfg['gradient_accumulation_steps']} is not divisible by "
                         f"the {world} processes: it counts the micro-batches of one step over all of them "
                         f"(same global batch: multiply it by k and divide --batch_size by k)")
    cfg, data = load_data(cfg, explicit)
    if ckpt is not None:  # the data must be the data it was trained on
        check_dataset(ckpt, data.meta, os.path.join(cfg["data_dir"], cfg["dataset"]), ckpt_path)
    device, device_type, dtype, ctx, peak = setup_device(cfg["device"], cfg["dtype"])
    raw_model, model_args, optimizer, scaler = make_model(cfg, data.meta, ckpt, device, dtype)
    if master:  # (after every check: a refusal leaves no folder behind)
        make_out_dir(out_dir)
    iter_num, best_val, last_saved, last = 0, math.inf, None, {}  # last: the latest evaluation
    if ckpt is not None:
        iter_num, best_val, last_saved = ckpt["iter_num"], ckpt["best_val_loss"], ckpt["iter_num"]
        last = dict(val_loss=ckpt.get("val_loss"), **({"accuracy": ckpt.get("accuracy")} if data.rows else {}))
    model = torch.compile(raw_model) if cfg["compile"] else raw_model
    # DDP all-reduces (averages) the gradients during backward. No find_unused_parameters: every parameter
    # gets a gradient in every backward (LIMe's routers last, in layer 0's mix), and DDP's hooks fire per
    # parameter as each is ready
    ddp_model = DDP(model, device_ids=[torch.device(device).index] if device_type == "cuda" else None) \
        if dist.is_initialized() else model

    T, B, accum, max_iters = cfg["block_size"], cfg["batch_size"], cfg["gradient_accumulation_steps"], cfg["max_iters"]
    tokens_per_iter = B * T * accum  # all ranks together, as are the logged tokens and FLOPs
    flops_per_iter = 3 * raw_model.flops_per_token(T) * tokens_per_iter  # training = 3 x forward
    # passes: how often the run sees each training token (on a task: each problem, i.e. epochs)
    passes = max_iters * (B * accum if data.rows else tokens_per_iter) / len(data.train)
    name = variant_name(model_args)
    print(f"{name}: {raw_model.get_num_params() / 1e6:.2f}M params | {flops_per_iter / tokens_per_iter / 1e6:.2f} "
          f"MFLOPs/token (train) | {tokens_per_iter:,} tokens/iter | {device} {dtype} | "
          f"{cfg['data_dir']}/{cfg['dataset']} -> {out_dir}" + (f" | {world} processes" if world > 1 else "")
          + (f" | resuming at iter {iter_num}" if ckpt else "")
          + f"\n{name}: {max_iters} iters = {passes:.2f} passes over the {len(data.train):,} training "
          + ("problems" if data.rows else "tokens"))
    if passes > MAX_PASSES and not data.rows:  # (a task is scored on held-out problems; the paper trains 200 epochs)
        print(f"warning: {passes:.1f} passes over the training data (more than {MAX_PASSES}): late val losses then "
              f"measure memorization as much as learning; lower --max_iters or prepare more data")

    log, done = None, ckpt is not None and iter_num >= max_iters  # done: nothing to do, nothing to write
    if master and not done:
        start_log(log_path, {"config": cfg, "model_args": model_args, "n_params": raw_model.get_num_params(),
                             "flops_per_iter": flops_per_iter, "tokens_per_iter": tokens_per_iter, "passes": passes,
                             "world_size": world, **({"val_problems": min(ACCURACY_PROBLEMS, len(data.val))}
                                                     if data.rows else {})}, iter_num if ckpt is not None else None)
        log = open(log_path, "a")
    logged = ckpt["iter_num"] if ckpt is not None else -1  # a resumed run's last iteration is in the log already
    lr = get_lr(iter_num, cfg)
    t_start = t_last = time.time()
    losses = []  # each step's loss since the last record, kept on the device (no sync per step)
    recent = []  # ms/iter of the last few records: the ETA uses their median, so one slow step can't swing it
    try:
        while True:
            do_eval = iter_num % cfg["eval_interval"] == 0 or iter_num == max_iters
            if (iter_num % cfg["log_interval"] == 0 or do_eval) and iter_num > logged:
                rec = dict(iter=iter_num, tokens=iter_num * tokens_per_iter, flops=iter_num * flops_per_iter, lr=lr)
                if losses:  # (none at iter 0)
                    values = mean_losses(losses, iter_num)
                    dt = (time.time() - t_last) / len(values)
                    recent = recent[-4:] + [dt]
                    rec.update(train_loss=sum(values) / len(values), ms_per_iter=1000 * dt)
                    mfu = f", MFU {flops_per_iter / dt / (peak * world):.1%}" if peak else ""
                    print(f"iter {iter_num}/{max_iters} | loss {rec['train_loss']:.4f} | lr {lr:.2e} | {1000 * dt:.0f} "
                          f"ms/iter | {tokens_per_iter / dt / 1e3:.1f}k tok/s | {rec['flops']:.2e} FLOPs, "
                          f"{flops_per_iter / dt / 1e9:.1f} GFLOP/s{mfu} | ETA "
                          f"{fmt_time((max_iters - iter_num) * float(np.median(recent)))}")
                if do_eval:
                    last = run_eval(model, raw_model, data, ctx, device, iter_num)
                    rec.update(last)
                if master:
                    with on_full_disk(log_path, kept_text(ckpt_path, last_saved, f"{log_path} holds the records "
                                                                                  f"before iter {iter_num}")):
                        log.write(json.dumps(rec) + "\n")
                        log.flush()
                if do_eval:
                    best_val = min(best_val, last["val_loss"])
                    if iter_num > 0:  # (iter 0 is the initial state: nothing to save)
                        save_run(raw_model, optimizer, scaler, model_args, cfg, data.meta, iter_num, best_val, last)
                        last_saved = iter_num
                    print(f"iter {iter_num}: val loss {last['val_loss']:.4f} (best {best_val:.4f})"
                          + (f" | accuracy {last['accuracy']:.1%}" if data.rows else "")
                          + (" | checkpoint saved" if iter_num > 0 else ""))
                losses, t_last = [], time.time()
            if iter_num >= max_iters:
                break
            lr = get_lr(iter_num, cfg)
            for g in optimizer.param_groups:  # routers follow the same schedule, scaled to their own peak
                g["lr"] = g["peak_lr"] * lr / cfg["learning_rate"]
            losses.append(train_step(ddp_model, optimizer, scaler, train_batches(data.train, cfg, iter_num), cfg,
                                     iter_num, ctx, device))
            iter_num += 1
    except NonFiniteLoss as e:
        good = (f"the last good checkpoint, iter {last_saved}, is in {ckpt_path}" if last_saved is not None
                else "no checkpoint was saved")
        raise NonFiniteLoss(f"{e}; stopped ({good}). Try a lower --learning_rate") from None
    finally:
        if log is not None:
            with suppress(OSError):  # (a full disk: already said)
                log.close()
    if world > 1:
        dist.barrier()  # rank 0's last log record and checkpoint are written: every rank may read them now
    if not done:
        print(f"{name} done: val loss {last['val_loss']:.4f} after {iter_num} iters, "
              f"{iter_num * flops_per_iter:.2e} FLOPs, {fmt_time(time.time() - t_start)}")
    else:
        print(f"{name}: already trained to iter {iter_num} (max_iters={max_iters}); nothing to do")
    result = dict(out_dir=out_dir, iter=iter_num, val_loss=last.get("val_loss"), flops=iter_num * flops_per_iter)
    if data.rows:  # the task's final score, on the whole test split
        test = log_test_accuracy(raw_model, cfg, data.meta, ctx, log_path, iter_num, done) if master else {}
        result.update(accuracy=last.get("accuracy"), test_accuracy=test.get("test_accuracy"))
    return result


def save_run(raw_model, optimizer, scaler, model_args, cfg, meta, iter_num, best_val, last):
    """Checkpoint out_dir/ckpt.pt after an evaluation (last: its numbers), written by rank 0 alone: plain
    types and tensors, everything an exact resume needs. NonFiniteLoss if the weights are not finite."""
    if not all(torch.isfinite(p).all() for p in raw_model.parameters()):
        raise NonFiniteLoss(f"the weights are not finite at iteration {iter_num}")
    if ddp_rank_world()[0] == 0:
        cuda = next(raw_model.parameters()).device.type == "cuda"
        save_checkpoint(dict(model_args=model_args, model=raw_model.state_dict(), optimizer=optimizer.state_dict(),
                             scaler=scaler.state_dict(), iter_num=iter_num, best_val_loss=best_val, config=cfg,
                             meta=meta, rng_cpu=torch.get_rng_state(),
                             rng_cuda=torch.cuda.get_rng_state_all() if cuda else [], **last), cfg["out_dir"])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    moved = [a.split("=")[0] for a in argv if a.split("=")[0] in [f"--{m}" for m in MOVED_TO_COMPARE]]
    if moved:  # a command from before compare.py: say where it went, don't do something else instead
        rest = [a for a in argv if a.split("=")[0] != "--compare"]
        raise ValueError(f"{moved[0]} is compare.py's now (train.py trains one model); run: python compare.py "
                         f"{shlex.join(rest)}".rstrip())
    cfg, explicit = get_config(argv)
    cfg = resolve(cfg)
    cfg["device"] = setup_ddp(cfg["device"])  # under torchrun: join the other processes, take our own GPU
    result = train(cfg, explicit)
    if dist.is_initialized():  # (after an error, don't: torchrun stops the other processes)
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    run_main(main)
