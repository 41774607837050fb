"""
What train.py, compare.py, sample.py, analyze.py and bench.py share, so that those scripts never import one
another: flag parsing, the device setup, the fixed evaluation batches, checkpoints (written atomically, read
with weights_only=True), training logs, where the runs of a comparison folder are, and torchrun's processes.
"""

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import sys
import tempfile
from contextlib import nullcontext, suppress
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from lime import GPT, GPTConfig
from prepare_data import atomic_file, on_full_disk, same_encoding


def str2bool(s):
    """argparse type of the boolean flags: --lime=True / --lime=False (also 1/0, yes/no, any case)."""
    if s.lower() in ("true", "1", "yes"):
        return True
    if s.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {s!r}")


class ArgParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a ValueError (one "error: ..." line from the script's __main__) instead
    of the usage text and exit 2; no abbreviated flags (--depth would silently mean --depths)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        raise ValueError(f"{message} (see python {self.prog} --help)")


def sample_batch(data, block_size, batch_size, rng):
    """(x, y): int64 CPU tensors of shape (batch_size, block_size) at random offsets; y is x shifted by one."""
    ix = rng.integers(0, len(data) - block_size, size=batch_size)
    chunk = torch.from_numpy(data[ix[:, None] + np.arange(block_size + 1)].astype(np.int64))  # (B, T+1)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def fixed_val_batches(data, block_size, batch_size, n_batches, seed=0):
    """n_batches (x, y) pairs of int64 CPU tensors, each (batch_size, block_size), drawn from data (the val
    memmap or any 1-D int array) with np.random.default_rng(seed). Independent of the training seed, so
    every run on the same data, block size and batch size is evaluated on exactly the same tokens (and the
    first n batches are the same whatever n_batches is)."""
    rng = np.random.default_rng(seed)
    return [sample_batch(data, block_size, batch_size, rng) for _ in range(n_batches)]


GPU_PEAK_FLOPS = [  # dense bf16 tensor-core peak by device name, first match wins (for MFU; none for CPUs)
    ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("L40S", 362e12),
    ("L4", 121e12), ("4090", 165e12)]


def setup_device(device, dtype):
    """-> (device, device_type, dtype name, autocast context, peak FLOP/s or None)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        device_type = torch.device(device).type
    except (RuntimeError, ValueError):
        device_type = None
    if device_type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unknown --device={device}; use auto, cpu, cuda, cuda:N or mps")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device={device} but torch sees no CUDA GPU; use --device=cpu")
    if device_type == "cuda" and (torch.device(device).index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device={device} but torch sees {torch.cuda.device_count()} CUDA GPU(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if device_type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device={device} but MPS is not available; use --device=cpu")
    if dtype == "auto":
        dtype = "float32" if device_type != "cuda" else "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unknown --dtype={dtype}; use float32, bfloat16 or float16")
    peak = None
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        name = torch.cuda.get_device_name(device)
        peak = next((p for key, p in GPU_PEAK_FLOPS if key in name), None) if dtype != "float32" else None
    ctx = nullcontext() if dtype == "float32" else torch.autocast(device_type, dtype=getattr(torch, dtype))
    return device, device_type, dtype, ctx, peak


def schedule_warnings(cfg):
    """Warnings for a schedule that can't be what was meant (cfg: train.py's config, resolved)."""
    lr, decay, warmup = cfg["learning_rate"], cfg["lr_decay_iters"], cfg["warmup_iters"]
    return [f"--min_lr={cfg['min_lr']:g} is above --learning_rate={lr:g}: the lr rises after the warmup instead of "
            f"decaying"] * (cfg["min_lr"] > lr) + [
        f"lr_decay_iters={decay} is below --warmup_iters={warmup}" + (" (it is max_iters unless given)" if decay ==
        cfg["max_iters"] else "") + f": the lr warms up for {warmup} iters, then drops to min_lr with no decay"
    ] * (decay < warmup)


def variant_name(config):
    """A model's variant in words, from its GPTConfig (or a model_args dict): baseline, LIMe, LIMe lime_kv=k,
    HC-4 (dynamic HC with 4 streams), HC-2-static, LIMe + HC-4."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    n = get("hc_rate", 0)
    hc = f"HC-{n}" + ("" if get("hc_dynamic", True) else "-static") if n else None
    lime = "LIMe" + "".join(f" {k}={get(k)}" for k, paper in (("lime_kv", "kv"), ("lime_sources", "all"))
                            if get(k, paper) != paper) if get("lime") else None  # e.g. "LIMe lime_kv=k"
    return " + ".join([v for v in (lime, hc) if v]) or "baseline"


def save_checkpoint(ckpt, out_dir):
    """Write ckpt (a dict of plain types and tensors) to out_dir/ckpt.pt atomically: temp file + rename,
    so a crash mid-write never replaces a good checkpoint with a broken one. Temp files that a process killed
    mid-write left behind (.ckpt.pt.*.tmp, never read) are deleted first. A full disk: one DiskFullError
    (an OSError) that says the previous checkpoint is unchanged."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "ckpt.pt")
    for tmp in glob.glob(os.path.join(glob.escape(out_dir), ".ckpt.pt.*.tmp")):  # (one process writes a run)
        with suppress(OSError):
            os.remove(tmp)
    kept = (f"{path} still holds the previous checkpoint, unchanged; free some space, then continue with "
            f"--resume=True" if os.path.exists(path) else "no checkpoint was written; free some space and start again")
    with on_full_disk(path, kept), atomic_file(path, "wb") as f:
        torch.save(ckpt, f)


def read_checkpoint(path, device="cpu", keys=("model_args", "model")):
    """The dict saved at path, loaded with weights_only=True (no pickle code runs). ValueError naming the
    file when it is not a checkpoint train.py wrote (empty, truncated, a folder, another program's) or
    lacks one of keys; FileNotFoundError when there is none."""
    bad = f"{path} is not a usable checkpoint"
    fix = "restore it, or train a new run into a fresh --out_dir"
    if os.path.isdir(path):
        raise ValueError(f"{bad}: it is a folder; {fix}")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except (FileNotFoundError, PermissionError):  # the system's message says it best
        raise
    except Exception as e:  # a truncated zip, an empty file, a foreign pickle: all the same to a user
        raise ValueError(f"{bad}: torch.load can't read it ({type(e).__name__}; is it empty, truncated, or not "
                         f"written by train.py?); {fix}") from None
    missing = [k for k in keys if k not in ckpt] if isinstance(ckpt, dict) else list(keys)
    if missing:
        raise ValueError(f"{bad}: it has no {', '.join(map(repr, missing))} (not written by train.py?); {fix}")
    return ckpt


def check_fits(config, device):
    """ValueError if GPT refuses config or training it can't fit in the memory of device (its parameters counted
    on the meta device, LIMe's few router weights left out: nothing is allocated)."""
    with torch.device("meta"):
        n = GPT(dataclasses.replace(config, lime=False, lime_kv="kv", lime_sources="all")).get_num_params()
    kind = torch.device(device).type
    memory = (torch.cuda.get_device_properties(torch.device(device)).total_memory if kind == "cuda" else
              os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if kind == "cpu" else math.inf)
    if 16 * n > memory:  # float32 weights, gradients and AdamW's two moments
        raise ValueError(f"the model has {n:.3g} parameters: training it needs at least {16 * n / 1e9:,.0f} GB (16 "
                         f"bytes per parameter: weights, gradients, AdamW's two moments), more than the "
                         f"{memory / 1e9:,.0f} GB " + (f"of {device}" if kind == "cuda" else "this machine has") +
                         "; use a smaller --n_embd or --n_layer")


def load_weights(model, ckpt, path):
    """model.load_state_dict(ckpt["model"]), with a ValueError naming path when they don't fit."""
    try:
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, TypeError, AttributeError) as e:
        why = " ".join(str(e).split())[:100]
        raise ValueError(f"{path}: its weights don't fit its model_args ({why}); it is damaged or not "
                         f"written by train.py") from None


def load_checkpoint(out_dir, device="cpu"):
    """-> (model in eval mode on device, ckpt dict). Loaded with weights_only=True (no pickle code runs)."""
    path = os.path.join(out_dir, "ckpt.pt")
    if os.path.isfile(out_dir):  # e.g. the checkpoint's own path
        raise ValueError(f"{out_dir} is a file; give the run's folder, the one that holds ckpt.pt"
                         + (f": {os.path.dirname(out_dir) or '.'}" if os.path.basename(out_dir) == "ckpt.pt" else ""))
    if not os.path.exists(path):
        inside = [d for v in find_runs(out_dir) for _, d in v["runs"][:1] if os.path.exists(os.path.join(d, "ckpt.pt"))]
        hint = (f"it is a comparison folder (compare.py): use one of its runs, e.g. {inside[-1]}" if inside else
                f"train one with: python train.py --out_dir={out_dir}")
        raise FileNotFoundError(f"no checkpoint at {path}; {hint}")
    ckpt = read_checkpoint(path, device)
    try:
        model = GPT(GPTConfig(**ckpt["model_args"]))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: its model_args don't make a model ({e}); it is damaged or not written by "
                         f"train.py") from None
    load_weights(model, ckpt, path)
    return model.to(device).eval(), ckpt


def check_dataset(ckpt, meta, data_dir, path):
    """ValueError if the dataset at data_dir (its meta.json: meta) is no longer the one the checkpoint at
    path was trained on, i.e. it was re-prepared from another corpus or tokenizer since. Compares every
    field of the meta.json copy saved in the checkpoint but "source" (the same text may come from elsewhere);
    encodings that tokenize alike (tiktoken's gpt2 and r50k_base) count as the same."""
    old = ckpt.get("meta")
    if not isinstance(old, dict):  # (a checkpoint without a copy: nothing to compare with)
        return
    same = lambda k: old[k] == meta.get(k) or (k == "encoding" and same_encoding(old[k], meta.get(k)))  # gpt2 = r50k_base
    diff = next((k for k in old if k != "source" and not same(k)), None)
    if diff is not None:
        short = lambda v: repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
        raise ValueError(f"{data_dir} is no longer the dataset {path} was trained on ({diff}: {short(old[diff])} "
                         f"then, {short(meta.get(diff))} now; trained on {old.get('source')!r}, now holds "
                         f"{meta.get('source')!r}); prepare that data again, or train a new run on this one")


# -----------------------------------------------------------------------------
# run folders (out_dir/ckpt.pt, out_dir/log.jsonl), and the runs of a comparison folder

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


def read_log(path, header=False, key="iter"):
    """The records of a log.jsonl (those with key: "iter"), or with header=True its {"config": ...} header (or
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
    return [r for r in records if key in r]


def old_records(path, header, until):
    """-> (the records of a run's log.jsonl up to iter until, notes on what is missing or dropped), for a resume
    from the checkpoint of iter until (later records are redone). header: the log header the resumed run
    writes. ValueError if the log is another run's: its header or its records' FLOPs per iteration differ."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        gone = "missing" if not os.path.exists(path) else "empty"
        return [], [f"{path} is {gone}: the records of iters 0..{until} are lost; the log goes on from iter {until}"]
    recs, bad, heads = [], 0, []
    with open(path, errors="replace") as f:
        for line in filter(str.strip, f):
            try:
                r = json.loads(line)
            except ValueError:
                r = None
            if isinstance(r, dict) and isinstance(r.get("config"), dict):
                heads.append(r)
            elif isinstance(r, dict) and type(r.get("iter")) is int and isinstance(r.get("flops"), (int, float)):
                recs.append(r)
            elif not (isinstance(r, dict) and "test_accuracy" in r):  # (a task's test score: redone at the end)
                bad += 1
    per_iter, cfg = header["flops_per_iter"], header["config"]
    diff = [f"{k}={h['config'][k]!r} there, {cfg[k]!r} here" for h in heads[:1] for k in sorted(cfg)
            if k in ("dataset", "n_layer", "n_head", "n_embd", "block_size", "lime", "lime_kv", "lime_sources",
                     "hc_rate", "hc_dynamic", "seed", "batch_size") and k in h["config"] and h["config"][k] != cfg[k]]
    wrong = [r for r in recs if r["iter"] <= until and not np.isclose(r["flops"], r["iter"] * per_iter, rtol=1e-6)]
    if wrong and not diff:
        diff = [f"its records count {wrong[0]['flops'] / max(wrong[0]['iter'], 1):.4g} FLOPs per iter, this run "
                f"{per_iter:.4g}"]
    if diff:
        raise ValueError(f"can't resume: {path} is another run's log ({diff[0]}); put this run's log back, or move "
                         f"that one away to resume without the old records")
    keep = [r for r in recs if r["iter"] <= until]
    notes = [f"dropped {bad} line(s) of {path} that are not log records (cut short, or not written by train.py)"
             ] * (bad > 0)
    last = max((r["iter"] for r in keep), default=None)
    if last is None:
        notes.append(f"{path} holds no records: those of iters 0..{until} are lost; the log goes on from iter {until}")
    elif last < until:
        notes.append(f"{path} ends at iter {last}, the checkpoint at iter {until}: the records in between are lost "
                     f"(a gap in the curves)")
    return keep, notes


def run_dir(out_dir, folder, i, seed):
    """Where a comparison puts seed number i (0, 1, ...) of a variant: OUT/<folder> for the first seed
    (what sample.py and analyze.py read), OUT/<folder>_seed<S> for the others."""
    return os.path.join(out_dir, folder if i == 0 else f"{folder}_seed{seed}")


def read_json(path, ok, what, fix):
    """The JSON at path if ok(it) says it is `what`, else a ValueError saying so and how to fix it; None if
    there is no file."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            d = json.load(f)
        good = ok(d)
    except (ValueError, UnicodeDecodeError, LookupError, TypeError):  # (json's decode error is a ValueError)
        good = False
    if not good:
        raise ValueError(f"{path} is not {what}; {fix}")
    return d


def read_summary(out_dir):
    """OUT/summary.json as a dict (None if there is none); ValueError if it is not a comparison's summary."""
    return read_json(os.path.join(out_dir, "summary.json"), lambda s: isinstance(s, dict) and isinstance(
        s.get("seeds"), list) and all(type(x) is int for x in s["seeds"]), "a summary written by compare.py",
        f"delete it (python compare.py --plot {out_dir} writes a new one from the logs)")


def read_experiment(out_dir):
    """OUT/experiment.json, the plan compare.py writes when a comparison starts: {"variants": [{"name",
    "dir", "flags"}, ...] (the reference first), "seeds": [...]}; None if there is none."""
    safe = lambda d: isinstance(d, str) and re.fullmatch(r"[\w.=+-]+", d) and d not in (".", "..")
    return read_json(os.path.join(out_dir, "experiment.json"), lambda e: e["seeds"] and all(
        type(s) is int for s in e["seeds"]) and e["variants"] and all(
        isinstance(v["name"], str) and safe(v["dir"]) for v in e["variants"]), "a plan written by compare.py",
        "restore it, or run the comparison again into a new --out_dir")


def find_runs(out_dir):
    """The runs of a comparison folder OUT: [{"name": variant, "dir": its folder, "runs": [(seed, run dir),
    ...]}], the reference variant first, the same seeds for every variant (see run_dir). Run dirs that
    don't exist (yet) are listed too: callers look for the files they need. From OUT/experiment.json; a
    folder of `train.py --compare` (before compare.py) has none: its variants are baseline and lime, its
    first seed is in their logs' headers, the others in their folder names, and its summary.json (then
    written at the start) says which seeds belong to it. [] if OUT is not a comparison folder."""
    exp = read_experiment(out_dir)
    if exp is not None:
        return [dict(name=v["name"], dir=v["dir"], runs=[(s, run_dir(out_dir, v["dir"], i, s))
                                                       for i, s in enumerate(exp["seeds"])]) for v in exp["variants"]]
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    summary_seeds = (read_summary(out_dir) or {}).get("seeds")
    heads = [read_log(p, header=True) for p in (os.path.join(out_dir, v, "log.jsonl") for v in ("baseline", "lime"))
             if os.path.exists(p)]
    first = next((h["config"]["seed"] for h in heads if h), summary_seeds[0] if summary_seeds else None)
    seeds = [first] if {"baseline", "lime"} & set(names) else []
    seeds += sorted({int(m[2]) for d in names if (m := re.fullmatch(r"(baseline|lime)_seed(\d+)", d))} - {first})
    if summary_seeds is not None:
        if seeds and not set(seeds) & set(summary_seeds):
            raise ValueError(f"{out_dir}/summary.json lists seeds {', '.join(map(str, summary_seeds))}, but the runs "
                             f"in {out_dir} are of seeds {', '.join(map(str, seeds))}: it belongs to another "
                             f"comparison; delete it to plot these runs")
        seeds = [s for s in seeds if s in summary_seeds]
    return [dict(name=v, dir=v, runs=[(s, os.path.join(out_dir, v if s == first else f"{v}_seed{s}")) for s in seeds])
            for v in ("baseline", "lime")] if seeds else []


def start_log(path, header, keep_until=None):
    """Start out_dir/log.jsonl with its header; on resume keep the old records up to keep_until (the
    checkpoint's iter: later ones are redone) if they are this run's (see common.old_records), with a note
    saying what is missing or dropped. Atomic, so a crash here loses nothing."""
    keep, notes = old_records(path, header, keep_until) if keep_until is not None else ([], [])
    print("".join(f"note: {n}\n" for n in notes), end="")
    with on_full_disk(path, "it is unchanged; free some space and run this again"), atomic_file(path) as f:
        f.writelines(json.dumps(r) + "\n" for r in [header] + keep)


def kept_text(ckpt_path, saved, what):
    """What a run keeps when the disk fills up (see prepare_data.on_full_disk): what, and its checkpoint."""
    return (f"{what}, {ckpt_path} the checkpoint of iter {saved}; free some space, then continue with --resume=True"
            if saved is not None else f"{what}, and no checkpoint was saved; free some space, delete "
            f"{os.path.dirname(ckpt_path)} and start again")


# -----------------------------------------------------------------------------
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


def run_main(main, interrupted="interrupted; continue with the same command plus --resume=True"):
    """`if __name__ == "__main__": run_main(main)` in train.py, compare.py, sample.py and analyze.py: main() with
    errors as one line and exit 1, Ctrl-C as one line (`interrupted`, exit 130), and a clean exit under torchrun."""
    sys.stdout.reconfigure(line_buffering=True)  # progress reaches `python train.py ... > log` as it happens
    try:
        main()
    except (ValueError, OSError) as e:  # bad input, or a file we can't read or write: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\n" + interrupted, file=sys.stderr)
        sys.exit(130)
    if "RANK" in os.environ:
        # under torchrun, done: skip the interpreter's teardown. DDP leaves gloo's threads running past
        # destroy_process_group, and tearing them down at exit aborts the process now and then (torch 2.13 CPU:
        # "terminate called without an active exception", 7 in 25 runs of a 10-line DDP script; 0 in 25 with
        # this exit), which makes torchrun fail a finished job
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
