"""
What train.py, sample.py, analyze.py and bench.py share, so that no script imports another: flag parsing,
the device setup, the fixed evaluation batches, and checkpoints (written atomically, read with weights_only=True).
"""

import argparse
import glob
import os
from contextlib import nullcontext, suppress

import numpy as np
import torch

from lime import GPT, GPTConfig
from prepare_data import atomic_file, on_full_disk


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
        inside = [v for v in ("lime", "baseline") if os.path.exists(os.path.join(out_dir, v, "ckpt.pt"))]
        hint = (f"it looks like a --compare folder: use {os.path.join(out_dir, inside[0])}" if inside else
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
    field of the meta.json copy saved in the checkpoint but "source" (the same text may come from elsewhere)."""
    old = ckpt.get("meta")
    if not isinstance(old, dict):  # (a checkpoint without a copy: nothing to compare with)
        return
    diff = next((k for k in old if k != "source" and old[k] != meta.get(k)), None)
    if diff is not None:
        short = lambda v: repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
        raise ValueError(f"{data_dir} is no longer the dataset {path} was trained on ({diff}: {short(old[diff])} "
                         f"then, {short(meta.get(diff))} now; trained on {old.get('source')!r}, now holds "
                         f"{meta.get('source')!r}); prepare that data again, or train a new run on this one")
