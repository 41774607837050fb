"""
What train.py, sample.py and analyze.py share, so that no script imports another: the device setup,
the fixed evaluation batches, and checkpoints (written atomically, read with weights_only=True).
"""

import os
from contextlib import nullcontext

import numpy as np
import torch

from lime import GPT, GPTConfig


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
    device_type = device.split(":")[0]
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device={device} but torch sees no CUDA GPU; use --device=cpu")
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
    so a crash mid-write never replaces a good checkpoint with a broken one."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "ckpt.pt")
    tmp = path + ".tmp"
    torch.save(ckpt, tmp)
    os.replace(tmp, path)


def load_checkpoint(out_dir, device="cpu"):
    """-> (model in eval mode on device, ckpt dict). Loaded with weights_only=True (no pickle code runs)."""
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.exists(path):
        inside = [v for v in ("lime", "baseline") if os.path.exists(os.path.join(out_dir, v, "ckpt.pt"))]
        hint = (f"it looks like a --compare folder: use {os.path.join(out_dir, inside[0])}" if inside else
                f"train one with: python train.py --out_dir={out_dir}")
        raise FileNotFoundError(f"no checkpoint at {path}; {hint}")
    ckpt = torch.load(path, map_location=device, weights_only=True)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), ckpt
