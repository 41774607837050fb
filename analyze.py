"""
The paper's three analyses of a comparison (compare.py), as figures plus the numbers behind them.

    python analyze.py out-compare                  # every variant's run (first seed) -> OUT/*.png, OUT/analysis.json
    python analyze.py out-compare other/lime ...   # extra run dirs join the value-entropy figure
    python analyze.py out-compare --layer=3        # per-head router detail for layer 3 (default: the last)
    python analyze.py out-compare --words=the,and  # other words for the separability probe

1. Router maps (every LIMe run). How much layer l reads from each source layer m <= l: for head r of layer l,
   share[r, m] = sum_{j in layer m's heads} W_l[r, j]^2 / sum_j W_l[r, j]^2, then the mean over heads r.
   router_map.png: target layer x source layer (layer 0 has no router: all on itself);
   router_heads.png: heads x source layers for one layer. With lime_sources "first" or "previous" the routers
   are read as the model uses them (times their source mask) and the layers they may not read are left blank.
2. Value entropy (every run). Matrix-based Renyi entropy (alpha = 0.5) of the values attention actually
   uses (hooked on attn.value_probe; with LIMe the MIXED values, lime_kv="k": own), per layer, on the fixed
   validation batches: value_entropy.png. How exactly: see value_entropy() and renyi_entropy().
3. Token separability (every run). How well a linear classifier tells "is", "are", "was", "were" (--words)
   apart from one layer's representation of the word, per layer, for the values attention uses and for
   the hidden states (residual stream after each block): 5-fold CV accuracy, mean +- std, on the same
   number of occurrences of each word from the validation split: separability.png. See separability().

compare.py runs analyze_compare at the end of a comparison, and for `python compare.py --analyze=OUT`.
"""

import argparse
import json
import math
import os
import re
import sys
from contextlib import contextmanager

import matplotlib
matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt
import numpy as np
import torch

from prepare_data import CharTokenizer, atomic_file, get_tokenizer, load_meta, load_rows, load_tokens, on_full_disk
from common import check_dataset, find_runs, fixed_val_batches, load_checkpoint, run_main, setup_device
from lime import source_mask, source_routers

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


def router_shares(model_or_routers, sources="all"):
    """(L, L) lower-triangular matrix: row l = mean over layer l's heads of head_shares(W_l); row 0 = [1, 0, ...].
    Takes a GPT (its own lime_sources) or a list of routers indexed by layer (routers[0] is None or ignored)
    with their lime_sources. The routers count as the model uses them: a layer they may not read gets 0."""
    if isinstance(model_or_routers, torch.nn.Module):
        if not model_or_routers.config.lime:
            raise ValueError("no LIMe routers to map: this is a baseline model (lime=False)")
        routers = [block.attn.router for block in model_or_routers.transformer.h]
        sources = model_or_routers.config.lime_sources
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
    for l, W in enumerate(source_routers([W.detach() for W in routers[1:]], sources), start=1):
        S[l, :l + 1] = head_shares(W).mean(0)
    return S


def readable_sources(L, sources):
    """(L, L) bool: [l, m] is True where layer l may read layer m (lime_sources; m <= l, its own always)."""
    R = np.zeros((L, L), dtype=bool)
    for l in range(L):
        R[l, :l + 1] = source_mask(l, 1, sources).numpy() > 0
    return R

# -----------------------------------------------------------------------------
# value entropy

@contextmanager
def one_thread():
    """Run torch's CPU ops on one thread inside: as fast for the small matrices of these analyses, and MKL's
    multithreaded kernels slow down 100x+ when the cores are busy (eigvalsh of 16 x 128^2 took 11-22 s with
    2 threads while a training run shared the 2 cores, 0.03 s with one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _eigvalsh(G):
    """torch.linalg.eigvalsh, on one CPU thread (see one_thread)."""
    if G.device.type != "cpu":
        return torch.linalg.eigvalsh(G)
    with one_thread():
        return torch.linalg.eigvalsh(G)


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


@contextmanager
def probes(model):
    """Inside `with probes(model) as got:`, every forward pass leaves, for each layer l,
    got["values"][l]: the values layer l's attention uses (B, T, d = H*hd, heads concatenated in order;
    with LIMe the MIXED values, hooked on attn.value_probe), and
    got["hidden"][l]: the residual stream at block l's output (B, T, C), i.e. after its attention and MLP
    have been added (the next block's input; for the last block, before the final norm). With
    Hyper-Connections, the sum of its n streams (B, T, n, C): what the final norm would read there."""
    L = model.config.n_layer
    got = dict(values=[None] * L, hidden=[None] * L)
    def keep_values(l, v):
        B, H, T, hd = v.shape
        got["values"][l] = v.transpose(1, 2).reshape(B, T, H * hd)  # (B, T, d)
    hooks = [h for l, block in enumerate(model.transformer.h) for h in (
        block.attn.value_probe.register_forward_hook(lambda m, i, out, l=l: keep_values(l, out)),
        block.register_forward_hook(lambda m, i, out, l=l: got["hidden"].__setitem__(
            l, out.sum(2) if out.dim() == 4 else out)))]                          # (B, T, C)
    try:
        yield got
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def value_entropy(model, batches, alpha=0.5):
    """Per layer: mean over all sequences of renyi_entropy(standardize(values of the batch)[b]), where the
    values are what attention uses, (T, d) per sequence with d = H*hd (heads concatenated in order)."""
    model.eval()
    sums, count = np.zeros(model.config.n_layer), 0
    with probes(model) as got:
        for x in batches:
            model(x.to(next(model.parameters()).device))
            for l, V in enumerate(got["values"]):
                sums[l] += renyi_entropy(standardize(V), alpha).sum().item()
            count += x.shape[0]
    return (sums / count).tolist()


def val_inputs(ckpt, max_sequences=MAX_SEQUENCES, path="ckpt.pt"):
    """Inputs x of the first fixed validation batches of the checkpoint's dataset (train.py evaluates on
    the same ones): as many as eval uses, but at most MAX_BATCHES and just enough for max_sequences.
    ValueError if that dataset was re-prepared from other data since (path: the checkpoint, for the message)."""
    cfg = ckpt["config"]
    data_dir = os.path.join(cfg["data_dir"], cfg["dataset"])
    meta = load_meta(data_dir)
    check_dataset(ckpt, meta, data_dir, path)
    n = min(cfg.get("eval_iters", MAX_BATCHES), MAX_BATCHES, math.ceil(max_sequences / cfg["batch_size"]))
    if meta.get("layout") == "rows":  # a task: the first val problems, whole rows, as train.py evaluates
        rows = load_rows(data_dir, "val", meta)  # them (the inputs: all but a row's last token)
        B = cfg["batch_size"]
        return [torch.from_numpy(rows[i:i + B, :-1].astype(np.int64)) for i in range(0, min(len(rows), n * B), B)]
    data = load_tokens(data_dir, "val", meta)
    return [x for x, _ in fixed_val_batches(data, cfg["block_size"], cfg["batch_size"], n, seed=0)]

# -----------------------------------------------------------------------------
# token separability (the paper's section 5.2, after Voita et al. 2019): can a linear classifier tell
# "is", "are", "was" and "were" apart from one layer's representation of the word?

WORDS = ("is", "are", "was", "were")  # the paper's four confusable words
MIN_PER_WORD = 25    # below this many occurrences of a word, no estimate: with 25 per word every test fold
                     # still holds 5 of each, and the CV mean rests on 25 predictions per word, 100 for four
                     # words, whose binomial standard error is at most 0.5 / sqrt(100) = 0.05
MAX_PER_WORD = 1668  # the paper's count per word; more would only cost time
FOLDS = 5
L2 = 1e-3            # penalty l2/2 * ||W||^2 on top of the MEAN cross-entropy; see logistic_regression()


class CantProbe(ValueError):
    """The data can't support the analysis for these words: too few occurrences, a word that isn't one BPE
    token, or a tokenizer that can't be loaded. Within a plain `analyze.py OUT` (what compare.py runs) the
    analysis is skipped with a note; with --words given explicitly it is an error."""


def word_positions(tokens, tok, word):
    """Token positions of the whole-word, case-sensitive occurrences of word in tokens (1-D ints, decoded
    by tok, a prepare_data tokenizer), as an int64 array.
    Char-level: the position of the word's LAST character, so the word must be recognised from its
    characters and left context; whole word = no letter, digit or _ right before or after it.
    BPE: the position of the token " word" (with its leading space: GPT-2 writes a word inside a sentence
    that way; "word" at the start of a line is another token, not counted), where the next token doesn't
    go on with letters (" is" + "land" is not "is")."""
    tokens = np.asarray(tokens)
    if isinstance(tok, CharTokenizer):
        text = tok.decode(tokens)  # one character per token, so text offsets are token positions
        return np.array([m.end() - 1 for m in re.finditer(rf"(?<!\w){re.escape(word)}(?!\w)", text)], dtype=np.int64)
    ids = tok.encode(" " + word)
    if len(ids) != 1:
        raise CantProbe(f"' {word}' is {len(ids)} BPE tokens, not one; pick words that are single tokens")
    hits = np.flatnonzero(tokens == ids[0])
    nxt = tokens[np.minimum(hits + 1, len(tokens) - 1)]
    goes_on = {t: bool(re.match(r"\w", tok.decode([t]))) for t in np.unique(nxt).tolist()}
    return np.array([p for p, t in zip(hits, nxt.tolist()) if p == len(tokens) - 1 or not goes_on[t]], dtype=np.int64)


def find_occurrences(tokens, tok, words, block_size):
    """{word: positions} of each word's occurrences that have a full window of block_size tokens ending at
    them (position >= block_size - 1), so every occurrence is seen with the same amount of left context."""
    found = {w: word_positions(tokens, tok, w) for w in words}
    return {w: p[p >= block_size - 1] for w, p in found.items()}


def balanced_sample(found, seed, max_per_word=MAX_PER_WORD):
    """found: {word: positions} -> (positions (N,), labels (N,), n): n = min(the rarest word's count,
    max_per_word) occurrences of every word, drawn without replacement with np.random.default_rng(seed),
    sorted within each word; labels index words in found's order. CantProbe below MIN_PER_WORD."""
    counts = {w: len(p) for w, p in found.items()}
    if min(counts.values()) < MIN_PER_WORD:
        raise CantProbe("too few occurrences for a stable estimate (" + ", ".join(f"{w!r}: {c}" for w, c in counts.items())
                      + f"; at least {MIN_PER_WORD} of each needed)")
    n = min(min(counts.values()), max_per_word)
    rng = np.random.default_rng(seed)
    pos = [np.sort(rng.choice(p, n, replace=False)) for p in found.values()]
    return np.concatenate(pos), np.repeat(np.arange(len(found)), n), n


def stratified_folds(labels, k=FOLDS, seed=0):
    """Fold id 0..k-1 of every sample: each class's samples are shuffled (np.random.default_rng(seed)) and
    dealt round-robin to the folds, so every fold holds floor(n_c / k) or ceil(n_c / k) of class c."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    fold = np.empty(len(labels), dtype=np.int64)
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        fold[idx] = np.arange(len(idx)) % k
    return fold


def logistic_regression(X, y, train, n_classes, l2=L2, tol=1e-6):
    """G independent multinomial logistic regressions at once: X (G, N, d) float64, y (N,) class ids, train
    (G, N) bool: the samples problem g learns from -> (W (G, d, C), b (G, C)). Problem g minimises the mean
    cross-entropy over its training samples + l2/2 * ||W_g||^2 (b unpenalised). One full-batch L-BFGS on the
    sum of the G objectives (same minimiser: they share no parameters; one set of kernels per step instead
    of G) until every gradient entry is below tol; each problem is strictly convex, so that is its minimum.
    Why a penalty at all: with d >= n, as here (128 features, ~100 training samples), the classes are almost
    always perfectly separable on the training part, and without one the weights grow forever and
    "converged" means nothing. 1e-3 on standardized features is small next to the loss (a weight vector of
    norm 10 costs 0.05 nats)."""
    G, N, d = X.shape
    w = train.double() / train.sum(1, keepdim=True)                   # (G, N): 1/n_g on problem g's samples
    W = torch.zeros(G, d, n_classes, dtype=X.dtype, requires_grad=True)
    b = torch.zeros(G, 1, n_classes, dtype=X.dtype, requires_grad=True)
    opt = torch.optim.LBFGS([W, b], max_iter=5000, tolerance_grad=tol, tolerance_change=0, history_size=20,
                            line_search_fn="strong_wolfe")
    def objective():
        opt.zero_grad()
        logp = torch.log_softmax(X @ W + b, -1)                       # (G, N, C)
        nll = -logp.gather(-1, y.expand(G, N)[..., None])[..., 0]     # (G, N)
        loss = (w * nll).sum() + 0.5 * l2 * (W ** 2).sum()
        loss.backward()
        return loss
    opt.step(objective)
    objective()
    grad = max(W.grad.abs().max(), b.grad.abs().max())
    if grad > 10 * tol:
        print(f"note: logistic regression stopped before converging (max gradient {grad:.1e})", file=sys.stderr)
    return W.detach(), b.detach()[:, 0]


def cv_accuracy(X, y, folds, l2=L2):
    """X (N, d), y (N,) class ids, folds (N,) fold ids -> test accuracy of every fold (list): fit on the
    other folds, features standardized with the mean and std of those training samples only."""
    X, y, folds = torch.as_tensor(X, dtype=torch.float64), torch.as_tensor(y), torch.as_tensor(folds)
    k = int(folds.max()) + 1
    train = folds != torch.arange(k)[:, None]                         # (k, N): fold f trains on the others
    with one_thread():
        Z = []
        for t in train:
            mu, sd = X[t].mean(0), X[t].std(0, correction=0).clamp_min(1e-12)  # (d,), (d,)
            Z.append((X - mu) / sd)
        Z = torch.stack(Z)                                            # (k, N, d)
        W, b = logistic_regression(Z, y, train, int(y.max()) + 1, l2)
        right = ((Z @ W + b[:, None]).argmax(-1) == y) & ~train      # (k, N): right on the held-out fold
    return (right.sum(1).double() / (~train).sum(1)).tolist()


@torch.no_grad()
def word_features(model, tokens, positions, batch_size=64):
    """For every position p: run the window tokens[p - T + 1 : p + 1] (T = block_size) and keep, per layer,
    the values and the hidden state (see probes()) at its last position -> {"values": [(N, d)] * L,
    "hidden": [(N, C)] * L}, float64 CPU tensors."""
    model.eval()
    T, device = model.config.block_size, next(model.parameters()).device
    windows = np.asarray(positions)[:, None] + np.arange(1 - T, 1)              # (N, T) token positions
    feats = dict(values=[[] for _ in model.transformer.h], hidden=[[] for _ in model.transformer.h])
    with probes(model) as got, one_thread():  # 3x faster on the quick-start model when the cores are busy
        for i in range(0, len(windows), batch_size):
            x = torch.from_numpy(np.asarray(tokens)[windows[i:i + batch_size]].astype(np.int64))  # (B, T)
            model(x.to(device))
            for kind in feats:
                for l, h in enumerate(got[kind]):
                    feats[kind][l].append(h[:, -1].cpu().double())              # (B, d)
    return {kind: [torch.cat(f) for f in per_layer] for kind, per_layer in feats.items()}


def separability(model, tokens, tok, words, seed=0, l2=L2):
    """Per-layer 5-fold CV accuracy (mean, std over folds) of telling words apart from the values and from
    the hidden states at their occurrences in tokens (see word_positions, find_occurrences, balanced_sample,
    stratified_folds, cv_accuracy). CantProbe when the data can't support it."""
    found = find_occurrences(tokens, tok, words, model.config.block_size)
    positions, labels, n = balanced_sample(found, seed)
    folds = stratified_folds(labels, FOLDS, seed)
    result = dict(found={w: len(p) for w, p in found.items()}, per_word=n)
    for kind, per_layer in word_features(model, tokens, positions).items():
        accs = [cv_accuracy(X, labels, folds, l2) for X in per_layer]
        result[kind] = dict(mean=[float(np.mean(a)) for a in accs], std=[float(np.std(a)) for a in accs])
    return result


def val_text(ckpt, path="ckpt.pt"):
    """(val tokens, tokenizer) of the checkpoint's dataset: where the word occurrences come from.
    ValueError if that dataset was re-prepared from other data since (path: the checkpoint, for the message)."""
    cfg = ckpt["config"]
    data_dir = os.path.join(cfg["data_dir"], cfg["dataset"])
    meta = load_meta(data_dir)
    check_dataset(ckpt, meta, data_dir, path)
    if meta.get("layout") == "rows":
        raise CantProbe(f"{data_dir} is a task of problems, not text: it has no words to probe")
    try:
        tok = get_tokenizer(meta)
    except ValueError as e:  # e.g. GPT-2's BPE files can't be downloaded
        raise CantProbe(str(e)) from None
    return load_tokens(data_dir, "val", meta), tok


def parse_words(words):
    """'is,are,was,were' -> ['is', 'are', 'was', 'were']; ValueError unless >= 2 distinct words without spaces."""
    ws = words.split(",") if isinstance(words, str) else list(words)
    if len(ws) < 2 or len(set(ws)) < len(ws) or not all(w and not re.search(r"\s", w) for w in ws):
        raise ValueError(f"--words={','.join(ws)}: give at least two distinct words, comma-separated, no spaces")
    return ws

# -----------------------------------------------------------------------------
# figures

def write_file(path, write, mode="wb"):
    """write(f) into path atomically (see atomic_file); on a full disk one error that says what was kept."""
    kept = (f"it is unchanged, the files written before it are complete; free some space and run "
            f"analyze.py again")
    with on_full_disk(path, kept), atomic_file(path, mode) as f:
        write(f)


def save_figure(fig, path):
    try:
        write_file(path, lambda f: fig.savefig(f, format="png", dpi=120))
    finally:
        plt.close(fig)


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
    save_figure(fig, path)


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
    save_figure(fig, path)

def plot_separability(curves, path, title, chance):
    """curves: {label: separability() result}; two panels, values and hidden states, mean +- std per layer."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, kind, name in zip(axes, ("values", "hidden"), ("values attention uses (LIMe: mixed)",
                                                            "hidden states (residual stream after block l)")):
        for label, r in curves.items():
            m, sd = np.array(r[kind]["mean"]), np.array(r[kind]["std"])
            ax.errorbar(range(len(m)), m, yerr=sd, marker="o", capsize=3, label=label)
        ax.axhline(chance, color="gray", ls=":", lw=1, label=f"chance {chance:.2f}")
        ax.set_xlabel("layer")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"{FOLDS}-fold CV accuracy (mean ± std)")
    axes[0].set_ylim(0, 1.02)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)

# -----------------------------------------------------------------------------
# the comparison run

def runs_to_analyze(out_dir, extra=()):
    """{name: run dir}: the first seed's run of every variant of a comparison folder (common.find_runs)
    that has a checkpoint, or OUT itself if it is a single run; then the extra run dirs, named by their path."""
    if os.path.isfile(out_dir):
        raise ValueError(f"{out_dir} is a file; give the comparison's folder (the one holding baseline/ and lime/) "
                         f"or a run's folder")
    for d in extra:  # found now, not after the other runs were analysed
        if not os.path.exists(os.path.join(d, "ckpt.pt")):
            raise FileNotFoundError(f"no checkpoint at {os.path.join(d, 'ckpt.pt')} (an extra run dir given to "
                                    f"analyze.py); give run folders that hold a ckpt.pt")
    runs = {}
    for v in find_runs(out_dir):
        d = v["runs"][0][1]
        if os.path.exists(os.path.join(d, "ckpt.pt")):
            runs[v["name"]] = d
        else:
            print(f"note: {d}/ckpt.pt not found, leaving {v['name']} out", file=sys.stderr)
    if not runs and os.path.exists(os.path.join(out_dir, "ckpt.pt")):
        runs[os.path.normpath(out_dir)] = out_dir
    runs.update({os.path.normpath(d): d for d in extra})
    if not runs:
        raise FileNotFoundError(f"no runs in {out_dir} (expected a comparison's run folders, e.g. {out_dir}/baseline/"
                                f"ckpt.pt); make them with: python compare.py --out_dir={out_dir}")
    return runs


def router_figures(model, ckpt, run_dir, out_dir, layer=None, suffix=""):
    """router_map{suffix}.png and router_heads{suffix}.png for one LIMe model; returns their numbers."""
    c = model.config
    l = c.n_layer - 1 if layer is None else layer
    if not 0 <= l < c.n_layer:
        raise ValueError(f"--layer={l} is not a layer of {run_dir} (0..{c.n_layer - 1})")
    S = router_shares(model)
    HS = np.ones((c.n_head, 1)) if l == 0 else head_shares(  # (H, l+1), the router as the model uses it
        source_routers([b.attn.router.detach() for b in model.transformer.h[1:]], c.lime_sources)[l - 1])
    readable = readable_sources(c.n_layer, c.lime_sources)   # blank cells: layers not read (m > l, lime_sources)
    variant = "".join(f", {k}={getattr(c, k)}" for k, paper in (("lime_kv", "kv"), ("lime_sources", "all"))
                      if getattr(c, k) != paper)
    tag = f"{run_dir} (iter {ckpt.get('iter_num', '?')}{variant})"
    mixed = {"kv": "keys/values", "k": "keys", "v": "values"}[c.lime_kv]
    names = [f"router_map{suffix}.png", f"router_heads{suffix}.png"]
    plot_shares(S, os.path.join(out_dir, names[0]), f"LIMe: where each layer's {mixed} come from\n{tag}",
                "source layer m (whose keys/values are read)", "target layer l (the layer reading them)",
                "share of squared router weight\n(mean over heads)", mask=~readable)
    plot_shares(HS, os.path.join(out_dir, names[1]), f"LIMe layer {l}: per-head source layers\n{tag}",
                "source layer m", f"head of layer {l}", "share of squared router weight",
                mask=np.broadcast_to(~readable[l, :l + 1], HS.shape))
    own = np.diag(S)[1:].mean() if c.n_layer > 1 else 1.0
    print(f"wrote {out_dir}/{names[0]}: layers >= 1 put {own:.0%} of their router weight on their own heads")
    print(f"wrote {out_dir}/{names[1]}: layer {l}, {c.n_head} heads x {l + 1} source layers")
    return dict(run=run_dir, lime_kv=c.lime_kv, lime_sources=c.lime_sources, shares=S.tolist(), heads_layer=l,
                head_shares=HS.tolist(), readable=readable.tolist())


def analyze_compare(out_dir, device="cpu", extra=(), layer=None, max_sequences=MAX_SEQUENCES, words=None, seed=0):
    """Router maps of every LIMe run, value entropy and token separability of every run (each variant's first
    seed in a comparison folder, extra dirs): writes OUT/{router_map,router_heads,value_entropy,separability}.png
    and OUT/analysis.json, returns the numbers. The first LIMe run's router figures are router_map.png and
    router_heads.png, a later one's router_map_<its folder>.png and router_heads_<its folder>.png.
    words=None: the paper's WORDS, and if the data can't support them the separability is skipped with a
    note; words given: that is an error (CantProbe)."""
    runs = runs_to_analyze(out_dir, extra)
    explicit, words = words is not None, parse_words(WORDS if words is None else words)
    result = dict(runs={}, routers={}, value_entropy=dict(alpha=0.5, how=(
        "per layer: the values attention uses, (B, T, d=H*hd) per batch, z-scored per feature over the batch's "
        "sequences and positions; per sequence G = Z Z^T, eigenvalues / trace, H = log(sum lambda^0.5) / 0.5 "
        "(nats); mean over sequences"), per_layer={}, mean={}), separability=dict(
        words=words, folds=FOLDS, seed=seed, l2=L2, min_per_word=MIN_PER_WORD, max_per_word=MAX_PER_WORD, how=(
        "occurrences of each word in the validation split (whole words, case-sensitive; char-level: the word's "
        "last character, BPE: its ' word' token), each with the block_size-token window that ends at it; "
        "the same number per word (per_word, drawn with the seed); per layer, the features at the word: "
        "'values' = the values that layer's attention uses (LIMe: mixed), 'hidden' = the residual stream "
        "at the block's output (HC: the sum of its streams); multinomial logistic regression (L-BFGS to "
        "convergence, mean cross-entropy + l2/2 ||W||^2, features standardized on the training folds), stratified seeded k-fold CV, "
        "mean and std (ddof=0) of the fold accuracies"), per_run={}, skipped={}))
    curves, ceilings, sep_curves = {}, set(), {}
    for name, d in runs.items():
        model, ckpt = load_checkpoint(d, device)
        if model.config.lime:
            suffix = f"_{os.path.basename(os.path.normpath(d))}" if result["routers"] else ""
            result["routers"][name] = router_figures(model, ckpt, d, out_dir, layer, suffix)
        batches = val_inputs(ckpt, max_sequences, os.path.join(d, "ckpt.pt"))
        ent = value_entropy(model, batches)
        loss = ckpt.get("best_val_loss")
        label = f"{name}, iter {ckpt.get('iter_num', '?')}"
        curves[label if loss is None else f"{label} (best val loss {loss:.3f})"] = ent
        ceilings.add(math.log(min(batches[0].shape[1], model.config.n_embd)))
        result["runs"][name] = dict(out_dir=d, lime=model.config.lime, iter_num=ckpt.get("iter_num"),
                                     best_val_loss=loss, sequences=sum(x.shape[0] for x in batches))
        result["value_entropy"]["per_layer"][name] = ent
        result["value_entropy"]["mean"][name] = float(np.mean(ent))
        try:
            sep = separability(model, *val_text(ckpt, os.path.join(d, "ckpt.pt")), words, seed)
        except CantProbe as e:
            if explicit:
                raise CantProbe(f"token separability of {d}: {e}") from None
            result["separability"]["skipped"][name] = str(e)
            print(f"note: no token separability for {d}: {e}", file=sys.stderr)
            continue
        result["separability"]["per_run"][name] = sep
        sep_curves[f"{label} ({sep['per_word']} per word)"] = sep
    if not result["routers"]:
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
    if sep_curves:
        plot_separability(sep_curves, os.path.join(out_dir, "separability.png"),
                          f"Telling {', '.join(map(repr, words))} apart from one layer's representation of the word\n"
                          f"{out_dir}, validation split, linear probe, {FOLDS}-fold CV, seed {seed}", 1 / len(words))
        last = {kind: ", ".join(f"{k} {r[kind]['mean'][-1]:.2f}" for k, r in result["separability"]["per_run"].items())
                for kind in ("values", "hidden")}
        print(f"wrote {out_dir}/separability.png: last layer accuracy, values: {last['values']}; "
              f"hidden states: {last['hidden']}")
    write_file(os.path.join(out_dir, "analysis.json"), lambda f: json.dump(result, f, indent=1), "w")
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description="router maps, value entropy and token separability of a comparison run")
    p.add_argument("out_dir", help="a comparison folder (compare.py), or one run's folder")
    p.add_argument("extra", nargs="*", default=[], help="more run dirs (each with ckpt.pt) for the value-entropy "
                   "figure (optional)")  # (the default keeps argparse from calling it required)
    p.add_argument("--layer", type=int, default=None, help="layer for the per-head router figure (default: last)")
    p.add_argument("--max_sequences", type=int, default=MAX_SEQUENCES,
                   help=f"validation sequences to use (whole batches, at most {MAX_BATCHES})")
    p.add_argument("--words", default=None, help=f"comma-separated words for the separability probe (default: "
                   f"{','.join(WORDS)}; given explicitly, too few occurrences is an error instead of a note)")
    p.add_argument("--seed", type=int, default=0, help="seed of the separability probe's sampling and folds")
    p.add_argument("--device", default="cpu", help="cpu, auto (cuda > mps > cpu), cuda, cuda:1, mps")
    args = p.parse_args(argv)
    if args.max_sequences < 1:
        raise ValueError(f"--max_sequences must be at least 1, got {args.max_sequences}")
    if args.seed < 0:  # (numpy's own message, "expected non-negative integer", names no flag)
        raise ValueError(f"--seed must be at least 0, got {args.seed}")
    device = setup_device(args.device, "float32")[0]  # ValueError if the device isn't there
    analyze_compare(args.out_dir, device, args.extra, args.layer, args.max_sequences, args.words, args.seed)


if __name__ == "__main__":
    run_main(main, interrupted="interrupted")
