"""
The paper's two analyses of a baseline-vs-LIMe comparison run, as figures plus the numbers behind them.

    python analyze.py out-compare                  # OUT/baseline + OUT/lime -> OUT/*.png, OUT/analysis.json
    python analyze.py out-compare other/lime ...   # extra run dirs join the value-entropy figure
    python analyze.py out-compare --layer=3        # per-head router detail for layer 3 (default: the last)

1. Router maps (LIMe run). How much layer l reads from each source layer m <= l: for head r of layer l,
   share[r, m] = sum_{j in layer m's heads} W_l[r, j]^2 / sum_j W_l[r, j]^2, then the mean over heads r.
   router_map.png: target layer x source layer (layer 0 has no router: all on itself);
   router_heads.png: heads x source layers for one layer.
2. Value entropy (every run). Matrix-based Renyi entropy (alpha = 0.5) of the values attention actually
   uses (hooked on attn.value_probe; with LIMe these are the MIXED values), per layer, on the fixed
   validation batches: value_entropy.png. How exactly: see value_entropy() and renyi_entropy().

train.py runs this script at the end of --compare, and for `python train.py --analyze OUT`.
"""

import argparse
import json
import math
import os
import sys

import matplotlib
matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt
import numpy as np
import torch

from prepare_data import load_rows, load_tokens
from common import fixed_val_batches, load_checkpoint, setup_device

MAX_BATCHES, MAX_SEQUENCES = 8, 64  # plenty for a stable mean (it varies little across sequences), and
                                    # seconds on a CPU: each sequence costs one eigendecomposition per layer

# -----------------------------------------------------------------------------
# router maps

def head_shares(W):
    """W_l: (H, (l+1)*H) -> (H, l+1): share of each source layer in every head's squared weights."""
    W = W.detach().double().cpu()
    H = W.shape[0]
    sq = (W ** 2).view(H, W.shape[1] // H, H).sum(-1)   # (H, l+1): sum over the source heads of each layer
    return (sq / sq.sum(-1, keepdim=True)).numpy()


def router_shares(model_or_routers):
    """(L, L) lower-triangular matrix: row l = mean over layer l's heads of head_shares(W_l); row 0 = [1, 0, ...].
    Takes a GPT or a list of routers indexed by layer (routers[0] is None or ignored)."""
    if isinstance(model_or_routers, torch.nn.Module):
        if not model_or_routers.config.lime:
            raise ValueError("no LIMe routers to map: this is a baseline model (lime=False)")
        routers = [block.attn.router for block in model_or_routers.transformer.h]
    else:
        routers = list(model_or_routers)
    if any(W is None for W in routers[1:]):
        raise ValueError("no LIMe routers to map: a layer >= 1 has no router (lime=False?)")
    L = len(routers)
    S = np.zeros((L, L))
    S[0, 0] = 1.0
    for l in range(1, L):
        H, n = routers[l].shape
        if n != (l + 1) * H:
            raise ValueError(f"router of layer {l} has shape {(H, n)}, expected (H, {l + 1}*H)")
        S[l, :l + 1] = head_shares(routers[l]).mean(0)
    return S

# -----------------------------------------------------------------------------
# value entropy

def _eigvalsh(G):
    """torch.linalg.eigvalsh, on one CPU thread: as fast for these small matrices, and MKL's multithreaded
    version slows down 100x+ when the cores are busy (16 x 128^2 took 11-22 s with 2 threads while a
    training run shared the 2 cores, 0.03 s with one)."""
    if G.device.type != "cpu":
        return torch.linalg.eigvalsh(G)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return torch.linalg.eigvalsh(G)
    finally:
        torch.set_num_threads(n)


def renyi_entropy(Z, alpha=0.5):
    """Matrix-based Renyi entropy of order alpha of the rows of Z: (..., T, d) -> float64 tensor (...)
    (0-dim for one matrix). Gram matrix G = Z Z^T, lambda = eigenvalues of G / trace(G) (they sum to 1),
    H = log(sum_i lambda_i^alpha) / (1 - alpha) in nats (alpha = 1: -sum lambda log lambda).
    0 for rank 1, log(n) for n orthonormal rows, unchanged by reordering rows. G's nonzero eigenvalues
    are those of Z^T Z, so we decompose whichever is smaller; eigenvalues below the numerical noise
    floor (n * eps * lambda_max, as in matrix_rank) count as exactly 0."""
    Z = torch.as_tensor(Z).detach()
    Z = Z.to("cpu" if Z.device.type == "mps" else Z.device, torch.float64)  # mps has no float64
    T, d = Z.shape[-2:]
    G = Z @ Z.mT if T <= d else Z.mT @ Z                            # (..., n, n), n = min(T, d)
    tr = G.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True)         # (..., 1)
    if (tr <= 0).any():
        raise ValueError("renyi_entropy: a matrix is all zeros, its entropy is undefined")
    lam = _eigvalsh(G) / tr                                         # (..., n), ascending, sum 1
    noise = lam[..., -1:] * lam.shape[-1] * torch.finfo(torch.float64).eps
    lam = torch.where(lam > noise, lam, torch.zeros_like(lam))
    if alpha == 1:
        return -torch.xlogy(lam, lam).sum(-1)
    return torch.log((lam ** alpha).sum(-1)) / (1 - alpha)


def standardize(V):
    """V: (B, T, d) -> z-scores: each of the d features minus its mean, divided by its (population) std,
    both over all B*T (sequence, position) pairs of the batch; a feature constant over the batch becomes 0."""
    V = V.to("cpu" if V.device.type == "mps" else V.device, torch.float64)
    mu, sd = V.mean((0, 1)), V.std((0, 1), correction=0)            # (d,), (d,)
    return (V - mu) / sd.clamp_min(1e-12)


@torch.no_grad()
def value_entropy(model, batches, alpha=0.5):
    """Per layer: mean over all sequences of renyi_entropy(standardize(values of the batch)[b]), where the
    values are what attention uses, (T, d) per sequence with d = H*hd (heads concatenated in order)."""
    model.eval()
    L = model.config.n_layer
    captured = [None] * L
    hooks = [block.attn.value_probe.register_forward_hook(lambda m, i, out, l=l: captured.__setitem__(l, out))
             for l, block in enumerate(model.transformer.h)]
    sums, count = np.zeros(L), 0
    try:
        for x in batches:
            model(x.to(next(model.parameters()).device))
            for l, v in enumerate(captured):
                B, H, T, hd = v.shape
                V = v.transpose(1, 2).reshape(B, T, H * hd)            # (B, T, d)
                sums[l] += renyi_entropy(standardize(V), alpha).sum().item()
            count += x.shape[0]
    finally:
        for h in hooks:
            h.remove()
    return (sums / count).tolist()


def val_inputs(ckpt, max_sequences=MAX_SEQUENCES):
    """Inputs x of the first fixed validation batches of the checkpoint's dataset (train.py evaluates on
    the same ones): as many as eval uses, but at most MAX_BATCHES and just enough for max_sequences."""
    cfg = ckpt["config"]
    path = os.path.join(cfg["data_dir"], cfg["dataset"])
    n = min(cfg.get("eval_iters", MAX_BATCHES), MAX_BATCHES, math.ceil(max_sequences / cfg["batch_size"]))
    if ckpt.get("meta", {}).get("layout") == "rows":  # a task: the first val problems, whole rows, as train.py
        rows = load_rows(path, "val", ckpt["meta"])       # evaluates them (its inputs: all but a row's last token)
        B = cfg["batch_size"]
        return [torch.from_numpy(rows[i:i + B, :-1].astype(np.int64)) for i in range(0, min(len(rows), n * B), B)]
    data = load_tokens(path, "val")
    return [x for x, _ in fixed_val_batches(data, cfg["block_size"], cfg["batch_size"], n, seed=0)]

# -----------------------------------------------------------------------------
# figures

def plot_shares(M, path, title, xlabel, ylabel, clabel, mask=None):
    """Heat map of shares in [0, 1], each cell labelled when there are few enough; mask: cells left blank."""
    rows, cols = M.shape
    fig, ax = plt.subplots(figsize=(2.5 + 0.5 * cols, 1.5 + 0.45 * rows))
    im = ax.imshow(M if mask is None else np.ma.masked_where(mask, M), cmap="viridis", vmin=0, vmax=1, aspect="auto")
    for (i, j), v in np.ndenumerate(M):
        if rows * cols <= 400 and (mask is None or not mask[i, j]):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if v < 0.6 else "black")
    ax.set_xticks(range(cols)), ax.set_yticks(range(rows))
    ax.set_xlabel(xlabel), ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label=clabel)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_entropy(curves, path, title):
    """curves: {label: per-layer entropies}."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, ent in curves.items():
        ax.plot(range(len(ent)), ent, marker="o", label=label)
    ax.set_xlabel("layer")
    ax.set_ylabel("Rényi entropy $H_{0.5}$ of the values (nats)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

# -----------------------------------------------------------------------------
# the comparison run

def find_runs(out_dir, extra=()):
    """{name: run dir}: OUT/baseline and OUT/lime (with several seeds, train.py puts the first seed there),
    or OUT itself if it is a single run; then the extra run dirs, named by their path."""
    runs = {name: os.path.join(out_dir, name) for name in ("baseline", "lime")
            if os.path.exists(os.path.join(out_dir, name, "ckpt.pt"))}
    if len(runs) == 1:
        print(f"note: {out_dir}/{({'baseline', 'lime'} - runs.keys()).pop()}/ckpt.pt not found, analysing "
              f"{out_dir}/{next(iter(runs))} alone", file=sys.stderr)
    if not runs and os.path.exists(os.path.join(out_dir, "ckpt.pt")):
        runs[os.path.normpath(out_dir)] = out_dir
    runs.update({os.path.normpath(d): d for d in extra})
    if not runs:
        raise FileNotFoundError(f"no runs in {out_dir} (expected {out_dir}/baseline/ckpt.pt and "
                                f"{out_dir}/lime/ckpt.pt); make them with: python train.py --compare --out_dir={out_dir}")
    return runs


def router_figures(model, ckpt, run_dir, out_dir, layer=None):
    """router_map.png and router_heads.png for one LIMe model; returns their numbers."""
    c = model.config
    l = c.n_layer - 1 if layer is None else layer
    if not 0 <= l < c.n_layer:
        raise ValueError(f"--layer={l} is not a layer of {run_dir} (0..{c.n_layer - 1})")
    S = router_shares(model)
    HS = np.ones((c.n_head, 1)) if l == 0 else head_shares(model.transformer.h[l].attn.router)  # (H, l+1)
    tag = f"{run_dir} (iter {ckpt.get('iter_num', '?')})"
    plot_shares(S, os.path.join(out_dir, "router_map.png"), f"LIMe: where each layer's keys/values come from\n{tag}",
                "source layer m (whose keys/values are read)", "target layer l (the layer reading them)",
                "share of squared router weight\n(mean over heads)", mask=np.triu(np.ones_like(S, dtype=bool), 1))
    plot_shares(HS, os.path.join(out_dir, "router_heads.png"), f"LIMe layer {l}: per-head source layers\n{tag}",
                "source layer m", f"head of layer {l}", "share of squared router weight")
    own = np.diag(S)[1:].mean() if c.n_layer > 1 else 1.0
    print(f"wrote {out_dir}/router_map.png: layers >= 1 put {own:.0%} of their router weight on their own heads")
    print(f"wrote {out_dir}/router_heads.png: layer {l}, {c.n_head} heads x {l + 1} source layers")
    return dict(run=run_dir, shares=S.tolist(), heads_layer=l, head_shares=HS.tolist())


def analyze_compare(out_dir, device="cpu", extra=(), layer=None, max_sequences=MAX_SEQUENCES):
    """Router maps of the LIMe run and value entropy of every run (OUT/baseline, OUT/lime, extra dirs):
    writes OUT/{router_map,router_heads,value_entropy}.png and OUT/analysis.json, returns the numbers."""
    runs = find_runs(out_dir, extra)
    result = dict(runs={}, value_entropy=dict(alpha=0.5, how=(
        "per layer: the values attention uses, (B, T, d=H*hd) per batch, z-scored per feature over the batch's "
        "sequences and positions; per sequence G = Z Z^T, eigenvalues / trace, H = log(sum lambda^0.5) / 0.5 "
        "(nats); mean over sequences"), per_layer={}, mean={}))
    curves, ceilings = {}, set()
    for name, d in runs.items():
        model, ckpt = load_checkpoint(d, device)
        if model.config.lime and "router" not in result:
            result["router"] = router_figures(model, ckpt, d, out_dir, layer)
        batches = val_inputs(ckpt, max_sequences)
        ent = value_entropy(model, batches)
        loss = ckpt.get("best_val_loss")
        label = f"{'LIMe' if name == 'lime' else name}, iter {ckpt.get('iter_num', '?')}"
        curves[label if loss is None else f"{label} (best val loss {loss:.3f})"] = ent
        ceilings.add(math.log(min(batches[0].shape[1], model.config.n_embd)))
        result["runs"][name] = dict(out_dir=d, lime=model.config.lime, iter_num=ckpt.get("iter_num"),
                                     best_val_loss=loss, sequences=sum(x.shape[0] for x in batches))
        result["value_entropy"]["per_layer"][name] = ent
        result["value_entropy"]["mean"][name] = float(np.mean(ent))
    if "router" not in result:
        print("note: no LIMe run, so no router maps", file=sys.stderr)
    if len({r["iter_num"] for r in result["runs"].values()}) > 1:  # e.g. one of them is still training
        print("note: the runs are at different iterations: " + ", ".join(f"{k} {r['iter_num']}" for k, r in
                                                                       result["runs"].items()), file=sys.stderr)
    n = sorted({r["sequences"] for r in result["runs"].values()})
    plot_entropy(curves, os.path.join(out_dir, "value_entropy.png"),
                 f"Matrix Rényi entropy (α = 0.5) of the values attention uses\n{out_dir}, "
                 f"{'/'.join(map(str, n))} validation sequences, max possible log(min(T, d)) = "
                 f"{'/'.join(f'{c:.2f}' for c in sorted(ceilings))}")
    means = ", ".join(f"{k} {v:.2f}" for k, v in result["value_entropy"]["mean"].items())
    print(f"wrote {out_dir}/value_entropy.png: mean over layers {means} nats")
    with open(os.path.join(out_dir, "analysis.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description="router maps and value entropy of a comparison run")
    p.add_argument("out_dir", help="the --compare output folder, holding baseline/ and lime/")
    p.add_argument("extra", nargs="*", help="more run dirs (each with ckpt.pt) for the value-entropy figure")
    p.add_argument("--layer", type=int, default=None, help="layer for the per-head router figure (default: last)")
    p.add_argument("--max_sequences", type=int, default=MAX_SEQUENCES,
                   help=f"validation sequences to use (whole batches, at most {MAX_BATCHES})")
    p.add_argument("--device", default="cpu", help="cpu, auto (cuda > mps > cpu), cuda, cuda:1, mps")
    args = p.parse_args(argv)
    device = setup_device(args.device, "float32")[0]  # ValueError if the device isn't there
    analyze_compare(args.out_dir, device, args.extra, args.layer, args.max_sequences)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
