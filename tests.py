"""
The test suite: CPU, offline, a couple of minutes on 2 cores.

    python -m pytest tests.py -q
"""

import contextlib
import errno
import json
import math
import os
import re
import shutil
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import asdict

import matplotlib.figure
import numpy as np
import pytest
import tiktoken
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

torch.set_num_threads(1)  # tiny models: one thread is as fast, and immune to a busy machine's other work

import analyze
import common
import compare
import prepare_data
import sample
import train
from analyze import head_shares, renyi_entropy, router_shares, standardize
from lime import GPT, GPTConfig, FusedMix, PlainMix, lime_mix, source_routers
from prepare_data import get_tokenizer, load_meta, load_tokens, prepare
from common import save_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))


def tiny_config(lime, **kw):
    cfg = dict(vocab_size=61, block_size=16, n_layer=4, n_head=4, n_embd=32, lime=lime)
    cfg.update(kw)
    return GPTConfig(**cfg)


def make(lime, seed=0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    return GPT(tiny_config(lime, **kw)).to(dtype)


def routers(model):
    return [b.attn.router for b in model.transformer.h if b.attn.router is not None]


def randomize_routers(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for W in routers(model):
            W.copy_(torch.randn(W.shape, generator=g, dtype=W.dtype) * 0.5)


def with_random_routers(config):
    """GPT(config) with randomize_routers in place of GPT._init_routers, for the tests that never read the init:
    on a course handout (exercises/) they then grade their own exercise, whether or not exercise 2 is done."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GPT, "_init_routers", lambda self: None)
        model = GPT(config)
    randomize_routers(model)
    return model


def counted_flops(model, idx):
    """FlopCounterMode's count for one forward pass and for one forward + backward pass of model(idx, idx), with
    attention through the math SDPA kernel (the fused CPU kernel reports 0 FLOPs to FlopCounterMode)."""
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd:
            model(idx, idx)
        with FlopCounterMode(display=False) as both:
            model(idx, idx)[1].backward()
    return fwd.get_total_flops(), both.get_total_flops()


# ----------------------------------------------------------------------------- lime.py: the method

SWITCHES = [dict(lime_kv=kv, lime_sources=src) for kv in ("kv", "k", "v") for src in ("all", "first", "previous")]


def switch_id(s):
    return "-".join(map(str, s.values())) if isinstance(s, dict) else None


@pytest.mark.parametrize("switches", SWITCHES, ids=switch_id)
def test_identity_routers_equal_baseline(switches):
    base, lime = make(False, dtype=torch.float64), make(True, dtype=torch.float64, **switches)
    H = lime.config.n_head
    with torch.no_grad():
        for W in routers(lime):
            W.zero_()
            W[:, -H:] = torch.eye(H, dtype=W.dtype)
    # same seed: every non-router weight is already identical; check rather than assume
    missing, unexpected = lime.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(k.endswith("attn.router") for k in missing)
    idx = torch.randint(0, 61, (3, 16))
    diff = (lime(idx)[0] - base(idx)[0]).abs().max().item()
    assert diff <= 1e-6


@pytest.mark.ex2
def test_same_seed_gives_same_non_router_weights():
    base, lime = make(False), make(True)
    sd = lime.state_dict()
    for k, v in base.state_dict().items():
        assert torch.equal(v, sd[k]), k


@pytest.mark.parametrize("lime", [False, True])
def test_causality(lime):
    model = make(lime, dtype=torch.float64)
    randomize_routers(model)
    idx = torch.randint(0, 61, (2, 16))
    logits = model(idx)[0]
    for t in (0, 5, 15):
        idx2 = idx.clone()
        idx2[:, t] = (idx2[:, t] + 1) % 61
        logits2 = model(idx2)[0]
        assert torch.equal(logits[:, :t], logits2[:, :t])
        assert not torch.allclose(logits[:, t], logits2[:, t])


@pytest.mark.ex2
def test_router_init():
    model = make(True, n_layer=6, n_head=3, n_embd=24)
    H = 3
    assert model.transformer.h[0].attn.router is None
    for l, block in enumerate(model.transformer.h[1:], start=1):
        W = block.attn.router.detach()
        assert W.shape == (H, (l + 1) * H)
        assert torch.equal(W[:, -H:], torch.eye(H))
        other = W[:, :-H]
        assert other.abs().max() <= math.sqrt(3 / ((l + 1) * H))
        assert (other != 0).any()


@pytest.mark.ex2
@pytest.mark.parametrize("sources", ["first", "previous"])
def test_router_init_restricted_sources(sources):
    """W_l keeps its (H, (l+1)*H) shape; the columns of the layers not read are exactly +0.0, the own block is I,
    the other layer read is U(-sqrt(3/fan_in), +sqrt(3/fan_in)) with fan_in = the 2*H heads it reads."""
    L, H = 6, 3
    model = make(True, n_layer=L, n_head=H, n_embd=24, lime_sources=sources)
    for l, W in enumerate(routers(model), start=1):
        W = W.detach().view(H, l + 1, H)                                       # (head, source layer, source head)
        other = 0 if sources == "first" else l - 1
        assert torch.equal(W[:, l], torch.eye(H))
        if other < l:
            assert 0 < W[:, other].abs().max() <= math.sqrt(3 / (2 * H)) and (W[:, other] != 0).all()
        unread = [m for m in range(l) if m != other]
        assert torch.equal(W[:, unread].view(-1).view(torch.int32), torch.zeros(H * len(unread) * H, dtype=torch.int32))


def test_default_switches_are_the_paper():
    """lime_kv="kv", lime_sources="all" by default; the switches' code paths leave it untouched: explicit defaults
    give bit-identical logits and gradients, and with 2 layers (where "first" and "previous" read every layer)
    every lime_sources gives bit-identical ones too (the mask multiplies by ones)."""
    assert (GPTConfig.lime_kv, GPTConfig.lime_sources) == ("kv", "all")
    idx = torch.randint(0, 61, (2, 16))

    def run(**kw):
        model = make(True, **kw)
        logits, loss = model(idx, idx)
        loss.backward()
        return [logits] + [p.grad for p in model.parameters()]

    for n_layer, variants in ((4, [dict(lime_kv="kv", lime_sources="all")]),
                              (2, [dict(lime_sources="first"), dict(lime_sources="previous")])):
        for fused in (True, False):
            ref = run(n_layer=n_layer, fused_mix=fused)
            for kw in variants:
                assert all(torch.equal(a, b) for a, b in zip(ref, run(n_layer=n_layer, fused_mix=fused, **kw)))


@pytest.mark.parametrize("switches", [dict(lime_sources="first"), dict(lime_kv="v", lime_sources="previous")],
                         ids=switch_id)
def test_restricted_routers_stay_zero_in_training(switches):
    """With lime_sources "first"/"previous", AdamW steps (routers: no weight decay) leave the unread columns at
    exactly 0 while the read ones learn; a nonzero unread entry does not change the model's output."""
    model = make(True, n_layer=4, **switches)
    before = [W.detach().clone() for W in routers(model)]
    x = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(0))
    train_steps(model, [x] * 3)
    H = model.config.n_head
    for l, (W, W0) in enumerate(zip(routers(model), before), start=1):
        read = [0 if switches["lime_sources"] == "first" else l - 1, l]
        for m in range(l + 1):
            block, block0 = W[:, m * H:(m + 1) * H], W0[:, m * H:(m + 1) * H]
            assert torch.equal(block, block0) != (m in read), (l, m)
            assert (m in read) or (block == 0).all()
    with torch.no_grad():
        logits = model(x)[0]
        m = 1 if switches["lime_sources"] == "first" else 0                    # a layer the last one doesn't read
        routers(model)[-1][:, m * H:(m + 1) * H] += 5.0
        assert torch.equal(model(x)[0], logits)


def test_parameter_count():
    L, H = 5, 4
    base, lime = make(False, n_layer=L, n_head=H), make(True, n_layer=L, n_head=H)
    extra = sum(H * (l + 1) * H for l in range(1, L))
    assert lime.get_num_params() - base.get_num_params() == extra
    assert not any("router" in n for n, _ in base.named_parameters())


def test_router_gradients_and_optimizer_groups():
    model = make(True)
    idx = torch.randint(0, 61, (2, 16))
    model(idx, idx)[1].backward()
    for W in routers(model):
        assert W.grad is not None and W.grad.abs().sum() > 0
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, router_lr=1e-2)
    rgroup = [g for g in opt.param_groups if any(p is routers(model)[0] for p in g["params"])]
    assert len(rgroup) == 1
    g = rgroup[0]
    assert g["lr"] == g["peak_lr"] == 1e-2 and g["weight_decay"] == 0.0
    assert {id(p) for p in g["params"]} == {id(W) for W in routers(model)}
    others = [g for g in opt.param_groups if g is not rgroup[0]]
    assert all(g["lr"] == 1e-3 for g in others)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def check_mix_against_formula(L, group, lime_kv="kv", sources="all"):
    """The buffer-based mix and the plain one (values and gradients of inputs and routers) against the formula,
    written out here once more with explicit loops over heads and the source layers each setting reads, so the
    test trusts neither lime_mix nor the source masks."""
    torch.manual_seed(0)
    B, T, H, hd = 2, 5, 3, 4
    kvs = [torch.randn(B, T, 2, H, hd, dtype=torch.float64, requires_grad=True) for _ in range(L)]
    Ws = [None] + [torch.randn(H, (l + 1) * H, dtype=torch.float64, requires_grad=True)
                   for l in range(1, L)]
    used = source_routers(Ws[1:], sources)                                       # as GPT.forward passes them
    stack = FusedMix(used, {}, lime_kv, group=group)
    plain = PlainMix(used, lime_kv)
    fast, via_plain = [], []
    for l, kv in enumerate(kvs):
        for mix, out in ((stack, fast), (plain, via_plain)):
            k, v = mix(l, kv)                                                   # (B, H, T, hd) each
            out.append(torch.stack([k, v], dim=2).transpose(1, 3))              # (B, T, 2, H, hd)
    heads = [kv[:, :, :, h] for kv in kvs for h in range(H)]                    # layer-major, (B, T, 2, hd)
    ref = [kvs[0]]
    for l in range(1, L):
        read = {"all": range(l + 1), "first": [0, l], "previous": [l - 1, l]}[sources]
        mixed = torch.stack([sum(Ws[l][r, m * H + h] * heads[m * H + h] for m in read for h in range(H))
                             for r in range(H)], dim=3)                         # (B, T, 2, H, hd)
        own = kvs[l]
        ref.append(torch.stack([(mixed if "k" in lime_kv else own)[:, :, 0],
                                (mixed if "v" in lime_kv else own)[:, :, 1]], dim=2))  # (B, T, 2, H, hd)
    coef = [torch.randn_like(r) for r in ref]
    leaves = kvs + Ws[1:]
    g_ref = torch.autograd.grad(sum((r * c).sum() for r, c in zip(ref, coef)), leaves, allow_unused=True)
    for out in (fast, via_plain):
        for o, r in zip(out, ref):
            assert torch.allclose(o, r, atol=1e-12, rtol=0)
        g = torch.autograd.grad(sum((o * c).sum() for o, c in zip(out, coef)), leaves, retain_graph=True)
        for a, b in zip(g, g_ref):
            assert torch.allclose(a, torch.zeros_like(a) if b is None else b, atol=1e-12, rtol=0)
    return g


@pytest.mark.ex1
def test_lime_mix_by_hand():
    """lime_mix on numbers worked out by hand (H = 2, hd = 2, layer l = 1): source heads layer-major, any leading
    dims, the same W at every position."""
    k0, k1 = torch.tensor([[1., 2.], [3., 4.]]), torch.tensor([[5., 6.], [7., 8.]])  # layers 0, 1: (H, hd)
    W = torch.tensor([[1., 0., 0., 1.],    # head 0 = layer 0 head 0 + layer 1 head 1 = [8, 10]
                      [0., 2., -1., 0.]])  # head 1 = 2 * layer 0 head 1 - layer 1 head 0 = [1, 2]
    mixed = torch.tensor([[8., 10.], [1., 2.]])
    assert torch.equal(lime_mix([k0, k1], W), mixed)
    t = torch.arange(1., 4.).view(3, 1, 1, 1)                                    # 3 positions: (3, 1, H, hd)
    assert torch.equal(lime_mix([k0 * t, k1 * t], W), mixed * t)


@pytest.mark.parametrize("L,group", [(1, 8)] + [pytest.param(L, g, marks=pytest.mark.ex1)  # (1 layer: no mix)
                                     for L, g in [(2, 8), (4, 8), (7, 2), (7, 3), (9, 4)]])
def test_fast_mix_matches_reference_formula(L, group):
    check_mix_against_formula(L, group)


@pytest.mark.ex1
@pytest.mark.parametrize("lime_kv", ["kv", "k", "v"])
@pytest.mark.parametrize("sources", ["all", "first", "previous"])
def test_mix_switches_match_reference_formula(lime_kv, sources):
    """Every lime_kv x lime_sources setting, plain and fused, against the formula head by head (float64); the
    router columns of layers not read get exactly zero gradient."""
    L, H = 7, 3
    g = check_mix_against_formula(L, 3, lime_kv, sources)
    for l, dW in enumerate(g[L:], start=1):                                     # (H, (l+1)*H) each
        read = {"all": range(l + 1), "first": [0, l], "previous": [l - 1, l]}[sources]
        for m in range(l + 1):
            assert (dW[:, m * H:(m + 1) * H] == 0).all() != (m in read)


def test_reused_gradient_buffer_and_bf16_autocast():
    """Backward reuses its scratch gradient buffer from the previous step (model.kv_scratch): gradients must
    not depend on it, also when the batch shape changes. Under bf16 autocast (the CUDA training path)
    the router gradients stay fp32 and close to the fp32 ones."""
    model = make(True, n_layer=9)
    randomize_routers(model)

    def grads(idx):
        model.zero_grad()
        model(idx, idx)[1].backward()
        return [W.grad.clone() for W in routers(model)]

    a, b = torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (3, 16))
    fresh = grads(a)
    assert model.kv_scratch["grad"].shape[0] == 2
    model.kv_scratch["grad"].fill_(float("nan"))     # poison the buffer the next backward reuses
    assert all(torch.equal(x, y) for x, y in zip(grads(a), fresh))
    grads(b)                                         # another shape: a new buffer
    assert model.kv_scratch["grad"].shape[0] == 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(a, a)[1]
    model.zero_grad()
    loss.backward()
    for W, g in zip(routers(model), fresh):
        assert W.grad.dtype == torch.float32
        assert (W.grad - g).norm() < 0.05 * g.norm()


def test_plain_and_fused_paths_agree():
    """GPTConfig.fused_mix=False runs the plain formula (PlainMix): same logits and gradients as the fused
    path in float64, and the same short training curve in float32 (to rounding: the two sum in other orders)."""
    idx = torch.randint(0, 61, (3, 16))
    outs = []
    for fused in (True, False):
        model = make(True, dtype=torch.float64, n_layer=7, fused_mix=fused)
        randomize_routers(model)
        logits, loss = model(idx, idx)
        loss.backward()
        outs.append((logits, [p.grad for p in model.parameters()]))
    (l1, g1), (l2, g2) = outs
    assert torch.allclose(l1, l2, atol=1e-12, rtol=0)
    assert all(torch.allclose(a, b, atol=1e-12, rtol=0) for a, b in zip(g1, g2))
    x = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(0))
    curves = []
    for fused in (True, False):
        model = make(True, n_layer=5, fused_mix=fused)
        curves.append(train_steps(model, [x] * 8))
    assert curves[0][-1] < curves[0][0] - 0.5                   # it does learn (one batch, overfit)
    assert np.allclose(curves[0], curves[1], atol=1e-5, rtol=0)


def train_steps(model, batches, lr=3e-3):
    """AdamW steps on next-token targets of the given batches; returns the losses. The optimizer lives on
    the model (made on first use), so steps of one model can be interleaved with another's."""
    if not hasattr(model, "_test_opt"):
        model._test_opt = model.configure_optimizers(0.1, lr)
    losses = []
    for x in batches:
        loss = model(x, x.roll(-1, 1))[1]
        model._test_opt.zero_grad()
        loss.backward()
        model._test_opt.step()
        losses.append(loss.item())
    return losses


def test_two_models_interleaved_train_as_alone():
    """No state is shared between models: two LIMe models of different shapes (so different scratch
    buffers) stepping in turn end bit-identical to each trained alone on the same batches."""
    shapes = [dict(n_layer=7), dict(n_layer=3, n_head=2)]
    data = [[torch.randint(0, 61, (2 + i, 16), generator=torch.Generator().manual_seed(10 * i + s))
             for s in range(3)] for i in range(2)]
    alone = [make(True, **s) for s in shapes]
    for m, batches in zip(alone, data):
        train_steps(m, batches)
    together = [make(True, **s) for s in shapes]
    for s in range(3):
        for m, batches in zip(together, data):
            train_steps(m, [batches[s]])
    for a, b in zip(alone, together):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(routers(together[0])[0], routers(make(True, **shapes[0]))[0])  # they did train
    for m, s, B in zip(together, shapes, (2, 3)):  # each keeps its own buffer: (B, 2, L, H, T, hd)
        assert m.kv_scratch["grad"].shape[:4] == (B, 2, s["n_layer"], s.get("n_head", 4))


def test_lime_model_gradcheck():
    """Whole-model gradients through the fast path agree with finite differences (float64)."""
    model = make(True, dtype=torch.float64, n_layer=3, n_head=2, n_embd=8, block_size=6, vocab_size=11)
    randomize_routers(model)
    idx = torch.randint(0, 11, (2, 6))
    W = routers(model)[-1]

    def f(w):
        with torch.no_grad():
            W.copy_(w)
        return model(idx, idx)[1]

    w0 = W.detach().clone()
    model.zero_grad()
    model(idx, idx)[1].backward()
    grad = W.grad.clone()
    eps = 1e-6
    for i, j in [(0, 0), (1, 3), (0, 5)]:
        e = torch.zeros_like(w0)
        e[i, j] = eps
        num = (f(w0 + e) - f(w0 - e)) / (2 * eps)
        assert abs(num.item() - grad[i, j].item()) < 1e-7
    f(w0)


def test_activation_memory_linear_in_depth():
    """LIMe keeps each layer's raw K/V once: its extra saved bytes grow linearly with depth, at most
    one raw K/V buffer (2 * B * T * C floats) per layer. The plain formula (fused_mix=False) keeps every
    concatenation of layers 0..l instead: its extra grows with depth squared."""
    from bench import saved_activation_bytes
    B, T, C = 2, 16, 32
    extra, plain = [], []
    for L in (2, 4, 8):
        act = []
        for lime, fused in ((False, True), (True, True), (True, False)):
            model = make(lime, n_layer=L, fused_mix=fused)
            idx = torch.randint(0, 61, (B, T))
            act.append(saved_activation_bytes(lambda: model(idx, idx), list(model.parameters()))[0])
        extra.append(act[1] - act[0])
        plain.append(act[2] - act[0])
        assert 0 < act[1] - act[0] <= L * 2 * B * T * C * 4
    assert extra[2] - extra[1] == 2 * (extra[1] - extra[0])  # exactly linear in L
    assert plain[2] - plain[1] > 3 * (plain[1] - plain[0])    # quadratic: L=2,4,8 -> differences grow ~4x
    assert plain[2] > 2 * extra[2]


def test_bench_saved_bytes_known_case():
    """A bias-free linear layer saves its input and its weight for backward, nothing else."""
    from bench import saved_activation_bytes
    lin = torch.nn.Linear(4, 3, bias=False)
    x = torch.randn(5, 4, requires_grad=True)
    n, y = saved_activation_bytes(lambda: lin(x), exclude=[lin.weight])
    assert n == 5 * 4 * 4 and y.shape == (5, 3)
    assert saved_activation_bytes(lambda: lin(x))[0] == (5 * 4 + 3 * 4) * 4
    assert saved_activation_bytes(lambda: lin(x).exp().sum(), exclude=[lin.weight])[0] == (20 + 15) * 4


def test_bench_measure_and_table_tiny(capsys):
    """bench.py's measuring function on both variants, and its table from fresh worker processes."""
    import bench
    shape = dict(n_layer=2, n_embd=16, n_head=2, block_size=8, batch_size=2, vocab_size=11)
    base, lime = (bench.measure(**shape, lime=v, warmup=1, repeats=2) for v in (False, True))
    for r, v in ((base, False), (lime, True)):
        assert r["step_ms"] > 0 and r["peak_bytes"] > 0 and r["gflops_per_s"] > 0
        cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16, lime=v)
        assert r["flops"] == 3 * GPT(cfg).flops_per_token(8) * 2 * 8
    assert 0 < lime["act_bytes"] - base["act_bytes"] <= 2 * 2 * 8 * 16 * 4 * 2  # one raw K/V per layer
    hc = bench.measure(**shape, lime=False, hc_rate=2, warmup=1, repeats=2)
    assert hc["flops"] == 3 * GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16,
                                            hc_rate=2)).flops_per_token(8) * 2 * 8
    bench.main(["--depths=2", "--n_embd=16", "--n_head=2", "--block_size=8", "--batch_size=2",
                "--vocab_size=11", "--deep=False", "--warmup=0", "--repeats=1", "--rounds=1", "--hc_rate=2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("2 layers")]
    assert len(rows) == 1
    assert float(rows[0][8]) == pytest.approx(lime["flops"] / base["flops"], abs=1e-3)  # FLOP x column
    assert float(rows[0][9]) == pytest.approx(lime["act_bytes"] / base["act_bytes"], abs=1e-3)
    assert float(rows[0][-3]) == pytest.approx(hc["flops"] / base["flops"], abs=1e-3)  # HC's FLOP x, act x
    assert float(rows[0][-2]) == pytest.approx(hc["act_bytes"] / base["act_bytes"], abs=1e-3)
    assert hc["act_bytes"] > base["act_bytes"]


BENCH_TINY = ["--depths=2", "--n_embd=16", "--n_head=2", "--block_size=8", "--batch_size=2", "--vocab_size=11",
              "--warmup=0", "--repeats=1", "--rounds=1"]


@pytest.mark.parametrize("flags, match", [
    (["--fused_mix=nope"], "argument --fused_mix: expected True or False, got 'nope'"),  # was: the plain formula
    (["--deep=maybe"], "argument --deep: expected True or False, got 'maybe'"),          # was: False
    (["--depths=abc"], "--depths must be comma-separated whole numbers of layers >= 1, e.g. --depths=8,32; got 'abc'"),
    (["--depths=0"], "--depths must be comma-separated whole numbers of layers >= 1"),   # was: timed 0 layers
    (["--depths=-2"], "--depths must be comma-separated whole numbers of layers >= 1"),
    (["--depths=4,,8"], "got '4,,8'"),
    (["--depths=2.5"], "got '2.5'"),
    (["--depths="], "got ''"),
    (["--n_embd=0"], "--n_embd must be at least 1, got 0"),
    (["--n_head=0"], "--n_head must be at least 1, got 0"),
    (["--block_size=0"], "--block_size must be at least 1, got 0"),
    (["--batch_size=-1"], "--batch_size must be at least 1, got -1"),
    (["--vocab_size=0"], "--vocab_size must be at least 1, got 0"),
    (["--repeats=0"], "--repeats must be at least 1, got 0"),
    (["--warmup=-1"], "--warmup must be at least 0, got -1"),
    (["--n_embd=30", "--n_head=4"], "--n_embd=30 --n_head=4: n_embd=30 is not divisible by n_head=4"),
    (["--n_embd=36", "--n_head=4"], "--n_embd=36 --n_head=4: head dim n_embd/n_head=9 is odd"),
    (["--device=tpu"], "unknown --device=tpu"),
    (["--device=cuda:99"], "--device=cuda:99 but torch sees"),
    (["--depth=4"], "unrecognized arguments: --depth=4"),  # was: read as --depths=4
    (["--rounds=abc"], "argument --rounds: invalid int value: 'abc'"),
])
def test_bench_bad_flags_refused_before_anything_runs(flags, match, monkeypatch, capsys):
    import bench
    monkeypatch.setattr(bench, "run_fresh", lambda args: pytest.fail("should be refused before any benchmark"))
    with pytest.raises(ValueError, match=re.escape(match)):
        bench.main(flags)
    assert capsys.readouterr().out == ""  # not even the header


def test_bench_booleans_reach_the_workers(monkeypatch, capsys):
    """--fused_mix=False (or bare --fused_mix, as in train.py) is what the LIMe worker gets; --deep=False drops a row."""
    import bench
    got = []
    def fake_run(args):
        got.append(args)
        return dict(step_ms=1.0, act_bytes=1, peak_bytes=1, flops=1, gflops_per_s=1.0)
    monkeypatch.setattr(bench, "run_fresh", fake_run)
    for flag, fused in (["--fused_mix=False", False], ["--fused_mix", True], ["--fused_mix=no", False]):
        got.clear()
        bench.main(BENCH_TINY + [flag, "--deep=False"])
        assert [a.get("fused_mix") for a in got] == [None, fused]  # baseline, then LIMe
    assert "plain formula (PlainMix)" in capsys.readouterr().out
    got.clear()
    bench.main(BENCH_TINY + ["--deep"])
    assert [a["n_layer"] for a in got] == [2, 2, 24, 24]


def test_bench_cli_errors_are_one_line(tmp_path):
    """A refused flag, and a worker process that fails: one "error:" line, exit 1, no traceback."""
    import bench
    r = subprocess.run([sys.executable, os.path.join(HERE, "bench.py"), "--deep=maybe"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: argument --deep: expected True or False") and r.stderr.count("\n") == 1
    with pytest.raises(bench.WorkerFailed, match=r"^the benchmark process for n_layer=2, n_embd=30, n_head=4, "
                                                 r".*failed: n_embd=30 is not divisible by n_head=4"):
        bench.run_fresh(dict(n_layer=2, n_embd=30, n_head=4, block_size=8, batch_size=2, vocab_size=11, lime=True))


@pytest.mark.ex3
@pytest.mark.parametrize("lime, switches", [(False, {}), (True, {})] + [(True, s) for s in SWITCHES[1:]] +
                         [(False, dict(hc_rate=4)), (True, dict(hc_rate=2, hc_dynamic=False))], ids=switch_id)
def test_kv_cache_generation_matches_uncached(lime, switches):
    """Greedy generation through the KV cache equals the uncached argmax, past block_size too, for every LIMe
    switch (HC: the cache is attention's alone, the streams are recomputed for the new tokens)."""
    torch.manual_seed(0)
    model = with_random_routers(tiny_config(lime, **switches)).eval()
    if switches.get("hc_rate"):
        port_reference_hc(model, reference_hc_weights(model))
    bs = model.config.block_size
    idx = torch.randint(0, 61, (2, 5))
    out = model.generate(idx, max_new_tokens=2 * bs, temperature=0)
    ref = idx
    with torch.no_grad():
        for _ in range(2 * bs):
            logits = model(ref[:, -bs:])[0]
            ref = torch.cat([ref, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out.shape == (2, 5 + 2 * bs)
    assert torch.equal(out, ref)


@pytest.mark.ex3
def test_kv_cache_is_baseline_sized():
    from lime import KVCache
    for lime in (False, True):
        model = with_random_routers(tiny_config(lime)).eval()
        cache = KVCache(model.config.n_layer)
        with torch.no_grad():
            model(torch.randint(0, 61, (2, 7)), cache=cache)
            model(torch.randint(0, 61, (2, 1)), cache=cache)
        assert len(cache) == 8
        assert all(k.shape == v.shape == (2, 4, 8, 8) for k, v in zip(cache.k, cache.v))


@pytest.mark.ex4
@pytest.mark.parametrize("lime", [False, True])
@pytest.mark.parametrize("shape", [dict(n_layer=3, n_head=4, n_embd=32, block_size=32, vocab_size=64),
                                   dict(n_layer=5, n_head=2, n_embd=48, block_size=24, vocab_size=100)])
def test_flops_match_flop_counter(lime, shape):
    """flops_per_token counts attention over the full T x T square, as the math SDPA kernel computes it
    (the fused CPU kernel reports 0 FLOPs to FlopCounterMode, so route attention through math)."""
    torch.manual_seed(0)
    model = with_random_routers(GPTConfig(lime=lime, **shape))
    B, T = 2, shape["block_size"]
    idx = torch.randint(0, shape["vocab_size"], (B, T))
    expected = model.flops_per_token(T) * B * T
    fwd, both = counted_flops(model, idx)
    assert abs(fwd / expected - 1) < 0.01
    assert abs(both / (3 * expected) - 1) < 0.01


@pytest.mark.ex4
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("switches", SWITCHES, ids=switch_id)
def test_flops_match_flop_counter_every_switch(switches, fused):
    """Each lime_kv x lime_sources setting, fused and plain: flops_per_token against FlopCounterMode. "k" or "v"
    mixes one of the two; a restricted lime_sources pays for the full mix (its masked entries are zeros)."""
    torch.manual_seed(0)
    shape = dict(n_layer=5, n_head=2, n_embd=16, block_size=8, vocab_size=50)
    model = with_random_routers(GPTConfig(lime=True, fused_mix=fused, **shape, **switches))
    idx = torch.randint(0, 50, (2, 8))
    expected = model.flops_per_token(8) * 2 * 8
    fwd, both = counted_flops(model, idx)
    assert abs(fwd / expected - 1) < 0.01
    assert abs(both / (3 * expected) - 1) < 0.01
    mix = sum(2 * (l + 1) * 2 * 2 * 8 for l in range(1, 5))                  # one of keys/values, all columns
    base = GPT(GPTConfig(lime=False, **shape)).flops_per_token(8)
    assert model.flops_per_token(8) - base == mix * len(switches["lime_kv"])


@pytest.mark.parametrize("lime", [False, True])
def test_overfits_one_batch(lime):
    model = make(lime)
    idx = torch.randint(0, 61, (4, 16))
    opt = model.configure_optimizers(weight_decay=0.0, learning_rate=3e-3, router_lr=1e-2)
    first = model(idx, idx)[1].item()
    for _ in range(150):
        loss = model(idx, idx)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 3.5 and loss.item() < 0.3


def test_bad_config_and_inputs():
    with pytest.raises(ValueError, match="divisible"):
        GPT(tiny_config(False, n_embd=30, n_head=4))
    with pytest.raises(ValueError, match="even"):
        GPT(tiny_config(False, n_embd=12, n_head=4))
    with pytest.raises(ValueError, match=re.escape("lime_kv='q' is not one of kv, k, v")):
        GPT(tiny_config(True, lime_kv="q"))
    with pytest.raises(ValueError, match=re.escape("lime_sources='last' is not one of all, first, previous")):
        GPT(tiny_config(True, lime_sources="last"))
    with pytest.raises(ValueError, match=re.escape("lime_sources='first' changes LIMe's mix, but lime=False")):
        GPT(tiny_config(False, lime_sources="first"))
    model = make(True)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="batch, time"):
        model(torch.zeros(8, dtype=torch.long))


def markdown_link_errors(root, files):
    """Broken intra-repo links in the given markdown files (paths relative to root): each link target (a file,
    relative to the linking file) must exist, and each #anchor must be a heading of its target, slugged as
    GitHub does. Links inside fenced code blocks and to other sites are not checked."""
    def slug(heading):
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    def scan(path):  # -> (heading slugs, link targets) outside code fences
        slugs, links, fenced = set(), [], False
        for line in open(path, encoding="utf-8"):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced:
                if re.match(r"#{1,6} ", line):
                    s = slug(line.lstrip("#"))
                    n = sum(1 for x in slugs if re.fullmatch(re.escape(s) + r"(-\d+)?", x))
                    slugs.add(s if n == 0 else f"{s}-{n}")  # GitHub numbers repeated headings
                links += re.findall(r"\]\(([^)\s]+)\)", line)
        return slugs, links

    errors = []
    for f in files:
        _, links = scan(os.path.join(root, f))
        for link in links:
            if re.match(r"[a-z]+:", link):
                continue
            target, _, anchor = link.partition("#")
            path = os.path.normpath(os.path.join(root, os.path.dirname(f), target)) if target else os.path.join(root, f)
            if not os.path.exists(path):
                errors.append(f"{f}: {link}: no such file")
            elif anchor and (not path.endswith(".md") or anchor not in scan(path)[0]):
                errors.append(f"{f}: {link}: no heading #{anchor}")
    return errors


def test_markdown_links_resolve(tmp_path):
    """Every image and intra-repo link in README.md and docs/ points to a file that exists, and every #anchor to
    a heading of its target; the checker itself catches a missing file and a missing anchor."""
    docs = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(HERE, "docs"))
                                  if f.endswith(".md"))
    assert len(docs) >= 5
    assert markdown_link_errors(HERE, docs) == []
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Top\n\n## Same `name`, again!\n\n## Same name again\n")
    (tmp_path / "README.md").write_text("[ok](docs/a.md#top) [ok](docs/a.md#same-name-again) "
                                        "[ok](docs/a.md#same-name-again-1) [web](https://x.org/y.md#z)\n"
                                        "```\n[in code](nothing.md)\n```\n"
                                        "![gone](assets/gone.png) [bad anchor](docs/a.md#bottom)\n")
    assert markdown_link_errors(str(tmp_path), ["README.md", "docs/a.md"]) == [
        "README.md: assets/gone.png: no such file", "README.md: docs/a.md#bottom: no heading #bottom"]


# ----------------------------------------------------------------------------- lime.py: Hyper-Connections

HC_NAMES = ("static_alpha", "static_beta", "dynamic_alpha_fn", "dynamic_alpha_scale", "dynamic_beta_fn",
            "dynamic_beta_scale")


def hc_modules(model):
    """[(layer, "hc_attn" | "hc_mlp", HyperConnection)] of an HC model."""
    return [(l, name, getattr(b, name)) for l, b in enumerate(model.transformer.h) for name in ("hc_attn", "hc_mlp")]


def reference_hc_weights(model, seed=2):
    """Random HC weights for model's shape under the reference code's names (model.layers.{l}.hc_attn.static_alpha,
    ...; src/lm/hc.py in corl-team/lime) and shapes, far from init so every term matters."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{l}.{name}.{k}": torch.randn(getattr(hc, k).shape, generator=g, dtype=torch.float64) * 0.5
            for l, name, hc in hc_modules(model) for k in HC_NAMES if hasattr(hc, k)}


def port_reference_hc(model, ref):
    """Load the reference-named HC weights into model: model.layers.{l}.X -> transformer.h.{l}.X."""
    missing, unexpected = model.load_state_dict({"transformer.h." + k[len("model.layers."):]: v
                                                 for k, v in ref.items()}, strict=False)
    assert not unexpected and not any(".hc_" in k for k in missing)


def reference_hc_forward(model, ref, idx, n, dynamic):
    """The HC model's logits written out from DESIGN.md § Hyper-Connections, independently of lime.py's HC code:
    the n streams as a Python list, every mix a loop over streams, LayerNorm by hand. It borrows the model's
    embedding, attention, MLP, final norm and head (with a plain LIMe mix if the model has LIMe)."""
    T = idx.shape[1]
    cos, sin = model.rope_cos[:T].double(), model.rope_sin[:T].double()
    mixer = PlainMix(routers(model)) if model.config.lime else None

    def layer_norm(x):  # over the last dim, no weight, eps 1e-5
        mu = x.mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + 1e-5)

    h = [model.transformer.wte(idx)] * n                                   # n streams, each (B, T, D)
    for l, block in enumerate(model.transformer.h):
        for name, f in (("hc_attn", lambda u: block.attn(u, cos, sin, mixer)), ("hc_mlp", block.mlp)):
            w = {k: ref.get(f"model.layers.{l}.{name}.{k}") for k in HC_NAMES}
            alpha = [[w["static_alpha"][i, j] for j in range(n + 1)] for i in range(n)]
            beta = [w["static_beta"][i] for i in range(n)]
            if dynamic:  # alpha[i][j], beta[i] become (B, T, 1): per token
                hn = [layer_norm(s) for s in h]
                alpha = [[alpha[i][j] + w["dynamic_alpha_scale"] * torch.tanh(hn[i] @ w["dynamic_alpha_fn"][:, j:j + 1])
                          for j in range(n + 1)] for i in range(n)]
                beta = [beta[i] + w["dynamic_beta_scale"] * torch.tanh(hn[i] @ w["dynamic_beta_fn"][:, None])
                        for i in range(n)]
            mix = [sum(alpha[i][j] * h[i] for i in range(n)) for j in range(n + 1)]  # width: mix_j = sum_i a_ij h_i
            out = f(layer_norm(mix[0]))
            h = [beta[i] * out + mix[1 + i] for i in range(n)]                     # depth
    return model.lm_head(model.transformer.ln_f(sum(h)))


@pytest.mark.parametrize("n,dynamic,lime", [(1, False, False), (2, False, False), (4, True, False), (3, True, True)])
def test_hc_port_of_reference_weights_gives_reference_logits(n, dynamic, lime):
    """Reference-named HC weights ported into lime.py's HC model give the logits of the formula (float64)."""
    model = make(lime, dtype=torch.float64, n_layer=3, hc_rate=n, hc_dynamic=dynamic)
    randomize_routers(model)
    ref = reference_hc_weights(model)
    port_reference_hc(model, ref)
    idx = torch.randint(0, 61, (2, 16))
    logits = model(idx)[0]
    expected = reference_hc_forward(model, ref, idx, n, dynamic)
    assert torch.allclose(logits, expected, atol=1e-10, rtol=0)
    assert not torch.allclose(logits, make(lime, dtype=torch.float64, n_layer=3)(idx)[0], atol=1e-3)


def test_hc_init_and_parameters():
    """alpha = [e_{l mod n} | I], beta = 1; dynamic: zero projections, scales 0.01, as the reference code. The
    blocks' norms have no weights; every other weight is the baseline's (same seed)."""
    n, D, L = 3, 32, 5
    static, dynamic, base = make(False, n_layer=L, hc_rate=n, hc_dynamic=False), \
        make(False, n_layer=L, hc_rate=n), make(False, n_layer=L)
    for model in (static, dynamic):
        for l, _, hc in hc_modules(model):
            expected = torch.cat([torch.zeros(n, 1), torch.eye(n)], dim=1)
            expected[l % n, 0] = 1
            assert torch.equal(hc.static_alpha, expected) and torch.equal(hc.static_beta, torch.ones(n))
            if model is dynamic:
                assert torch.equal(hc.dynamic_alpha_fn, torch.zeros(D, n + 1))
                assert torch.equal(hc.dynamic_beta_fn, torch.zeros(D))
                assert hc.dynamic_alpha_scale.tolist() == hc.dynamic_beta_scale.tolist() == [pytest.approx(0.01)]
        sd = model.state_dict()
        for k, v in base.state_dict().items():
            assert k.endswith(("ln_1.weight", "ln_2.weight")) or torch.equal(v, sd[k]), k
    per_hc = n * (n + 1) + n
    assert static.get_num_params() - base.get_num_params() == L * 2 * (per_hc - D)   # (minus the 2 RMSNorms)
    assert dynamic.get_num_params() - base.get_num_params() == L * 2 * (per_hc + D * (n + 1) + D + 2 - D)


def test_hc_rate_1_static_is_baseline_with_layernorms():
    """At rate 1, static, at init (alpha = [1 | 1], beta = 1): h + f(LayerNorm(h)), i.e. the baseline with
    each block's two RMSNorms replaced by weight-free LayerNorms (eps 1e-5)."""
    base, hc = make(False, dtype=torch.float64), make(False, dtype=torch.float64, hc_rate=1, hc_dynamic=False)
    for b in base.transformer.h:
        b.ln_1, b.ln_2 = (torch.nn.LayerNorm(32, eps=1e-5, elementwise_affine=False) for _ in range(2))
    idx = torch.randint(0, 61, (3, 16))
    assert (hc(idx)[0] - base(idx)[0]).abs().max().item() <= 1e-12
    assert not torch.allclose(hc(idx)[0], make(False, dtype=torch.float64)(idx)[0], atol=1e-4)  # RMSNorm differs


def test_hc_streams_in_and_out():
    """The embedding enters every stream; the final norm reads the sum of the streams the last block wrote."""
    model = make(False, hc_rate=3, n_layer=2)
    port_reference_hc(model, {k: v.float() for k, v in reference_hc_weights(model).items()})
    seen = {}
    model.transformer.h[0].register_forward_pre_hook(lambda m, args: seen.update(first=args[0]))
    model.transformer.h[-1].register_forward_hook(lambda m, args, out: seen.update(last=out))
    model.transformer.ln_f.register_forward_pre_hook(lambda m, args: seen.update(final=args[0]))
    idx = torch.randint(0, 61, (2, 16))
    model(idx)
    emb = model.transformer.wte(idx)
    assert seen["first"].shape == seen["last"].shape == (2, 16, 3, 32)
    assert all(torch.equal(seen["first"][:, :, i], emb) for i in range(3))
    assert torch.equal(seen["final"], seen["last"].sum(2))
    assert not torch.allclose(seen["last"][:, :, 0], seen["last"][:, :, 1])  # the streams differ


def test_hc_streams_stay_float32_under_bf16_autocast():
    """The streams are the residual: under bf16 autocast (the CUDA training path) the width connection mixes them
    in float32 (as the baseline's residual adds stay float32), not through a bf16 matmul; the loss stays close."""
    from lime import width_connection
    for dynamic in (True, False):
        model = make(False, hc_rate=4, hc_dynamic=dynamic)
        port_reference_hc(model, reference_hc_weights(model))
        hc, h = model.transformer.h[1].hc_attn, torch.randn(2, 16, 4, 32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            u, carry, beta = width_connection(hc, h)
        assert u.dtype == carry.dtype == beta.dtype == torch.float32
        if not dynamic:  # (dynamic: alpha itself comes from a bf16 projection under autocast)
            assert torch.equal(carry, width_connection(hc, h)[1])
        idx = torch.randint(0, 61, (2, 16))
        with torch.no_grad():
            full = model(idx, idx)[1]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                half = model(idx, idx)[1]
        assert abs(half.item() - full.item()) < 0.02


@pytest.mark.parametrize("dynamic", [True, False])
def test_hc_gradcheck(dynamic):
    """torch.autograd.gradcheck (float64) of the loss w.r.t. every HC weight of a block and the embedding."""
    model = make(True, dtype=torch.float64, n_layer=2, n_head=2, n_embd=8, block_size=5, vocab_size=11,
                 hc_rate=3, hc_dynamic=dynamic)
    port_reference_hc(model, reference_hc_weights(model))
    idx = torch.randint(0, 11, (2, 5))
    names = [n for n, _ in model.named_parameters() if n.startswith("transformer.h.1.hc_")] + ["transformer.wte.weight"]
    params = dict(model.named_parameters())

    def loss(*ws):
        return torch.func.functional_call(model, {**params, **dict(zip(names, ws))}, (idx, idx))[1]

    inputs = [params[n].detach().clone().requires_grad_() for n in names]
    assert len(names) == (13 if dynamic else 5)
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("n,dynamic,lime", [(1, False, False), (2, True, False), (4, False, False), (4, True, True)])
def test_hc_flops_match_flop_counter(n, dynamic, lime):
    """flops_per_token counts HC's matmuls exactly (alpha^T @ h; if dynamic the two projections of LayerNorm(h)):
    forward and backward (= 2x forward) against FlopCounterMode, attention through the math SDPA backend."""
    shape = dict(n_layer=3, n_head=4, n_embd=32, block_size=24, vocab_size=64)
    torch.manual_seed(0)
    model = GPT(GPTConfig(lime=lime, hc_rate=n, hc_dynamic=dynamic, **shape))
    idx = torch.randint(0, 64, (2, 24))
    expected = model.flops_per_token(24) * 2 * 24
    fwd, both = counted_flops(model, idx)
    assert fwd == expected and both == 3 * expected
    D = 32
    extra = 2 * (n + 1) * n * D + (2 * n * D * (n + 1) + 2 * n * D if dynamic else 0)  # per hyper-connection
    plain = GPT(GPTConfig(lime=lime, **shape)).flops_per_token(24)
    assert model.flops_per_token(24) - plain == 3 * 2 * extra


def test_hc_optimizer_groups():
    """HC's static weights: no weight decay; its dynamic weights and scales (1-D and 1-element too): decayed;
    all at the base learning rate."""
    model = make(True, hc_rate=2)
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, router_lr=1e-2)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    assert len(group_of) == sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    hc = [(n, p) for n, p in model.named_parameters() if ".hc_" in n]
    assert len(hc) == model.config.n_layer * 2 * 6
    for n, p in hc:
        g = group_of[id(p)]
        assert g["lr"] == g["peak_lr"] == 1e-3, n
        assert g["weight_decay"] == (0.1 if ".dynamic_" in n else 0.0), n


@pytest.mark.parametrize("n,dynamic", [(1, False), (4, False), (4, True)])
def test_hc_activation_memory(n, dynamic):
    """What HC keeps for backward, per token and layer, beyond the baseline (float32, bench.py's measure): the
    n streams for the mix (n*D floats per hyper-connection, 2 per layer), LayerNorm's mean and rstd in place of
    RMSNorm's one rsqrt (+1); dynamic also LayerNorm(h) (n*D) and the per-token weights: alpha^T and tanh(.)
    for alpha (2*n*(n+1)), beta and tanh(.) for beta (2n), the streams' LayerNorm mean and rstd (2n)."""
    from bench import saved_activation_bytes
    B, T, D = 2, 16, 32
    per_hc = n * D + 1 + ((n * D + 2 * n * (n + 1) + 4 * n) if dynamic else 0)
    act = {}
    for hc in (0, n):
        for L in (2, 3):
            model = make(False, n_layer=L, hc_rate=hc, hc_dynamic=dynamic)
            idx = torch.randint(0, 61, (B, T))
            act[hc, L] = saved_activation_bytes(lambda: model(idx, idx), list(model.parameters()))[0]
    assert (act[n, 3] - act[n, 2]) - (act[0, 3] - act[0, 2]) == B * T * 2 * per_hc * 4


def test_scripts_import_one_way():
    """Scripts share lime.py, prepare_data.py and common.py, never import each other (no cycles), except
    compare.py, the one orchestrator: it imports train.py and analyze.py, and nothing imports it. common.py
    builds on lime.py and prepare_data.py (atomic_file, same_encoding) alone, and lime.py imports no script and no I/O
    or argument-parsing module."""
    import ast
    scripts = {"train", "compare", "sample", "analyze", "bench", "prepare_data", "common", "lime"}
    for name in scripts:
        allowed = {"lime", "prepare_data", "common"} | ({"train", "analyze"} if name == "compare" else set())
        tree = ast.parse(open(os.path.join(HERE, f"{name}.py")).read())
        imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        own = imported & scripts
        assert own <= allowed - {name}, f"{name}.py imports {own - allowed}"
        assert "compare" not in own  # (nothing imports compare.py)
        if name == "compare":
            assert {"train", "analyze"} <= own
        if name == "lime":
            assert own == set() and not imported & {"argparse", "os", "json", "pickle"}
        if name == "common":
            assert own <= {"lime", "prepare_data"}
        if name == "prepare_data":  # the base of the others: no model, so no torch needed to prepare data
            assert own == set()


# ----------------------------------------------------------------------------- prepare_data.py: corpora, tokenizers, dataset files

DATA_TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20

def _tiny_encoding(special_tokens=None, name="tiny"):
    # a byte-level BPE made up here: the 256 single bytes plus two merges, no download
    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"sp"], ranks[b"spe"] = 256, 257
    return tiktoken.Encoding(name=name, pat_str=r"""\S+|\s+""", mergeable_ranks=ranks,
                             special_tokens=special_tokens or {})

def _tokens(d):
    return np.concatenate([load_tokens(d, "train"), load_tokens(d, "val")]).tolist()

def test_data_char_round_trip(tmp_path):
    d = str(tmp_path / "shake")
    meta = prepare(DATA_TEXT, d)
    assert meta["chars"] == sorted(set(DATA_TEXT)) and meta["vocab_size"] == len(set(DATA_TEXT))
    tok = get_tokenizer(load_meta(d))  # rebuilt from meta.json alone
    assert tok.decode(tok.encode(DATA_TEXT)) == DATA_TEXT
    assert tok.decode(_tokens(d)) == DATA_TEXT  # what's on disk is the whole text, train then val
    with pytest.raises(ValueError, match="not in the vocabulary: 'é', '€'"):
        tok.encode("Speak é€é")

def test_data_split_and_meta(tmp_path):
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    d = str(tmp_path / "abc")
    meta = prepare(text, d, val_fraction=0.1, source="unit test")
    with open(os.path.join(d, "meta.json")) as f:
        assert json.load(f) == meta == load_meta(d)
    assert meta["tokenizer"] == "char" and meta["dtype"] == "uint16" and meta["source"] == "unit test"
    assert meta["n_chars"] == 1000 and meta["train_tokens"] == 900 and meta["val_tokens"] == 100
    assert os.path.getsize(os.path.join(d, "train.bin")) == 900 * 2
    tok = get_tokenizer(meta)
    assert tok.decode(load_tokens(d, "val")) == text[-100:]  # val = the tail, deterministic
    assert load_tokens(d, "train").dtype == np.dtype("<u2")

def test_data_tiktoken_small_encoding(tmp_path):
    enc = _tiny_encoding()
    text = "speak, speak! spectre spelled special é\n" * 10
    d = str(tmp_path / "bpe")
    meta = prepare(text, d, tokenizer="gpt2", encoding=enc)
    assert meta["tokenizer"] == "tiktoken" and meta["encoding"] == "tiny"
    assert meta["vocab_size"] == 258 and meta["dtype"] == "uint16"
    assert _tokens(d) == enc.encode_ordinary(text)
    assert 257 in _tokens(d)  # the merges were used
    tok = get_tokenizer(load_meta(d), encoding=enc)
    assert tok.vocab_size == 258 and tok.decode(tok.encode(text)) == text
    with pytest.raises(ValueError, match="encoding="):
        get_tokenizer(meta)  # a made-up encoding can't be rebuilt from its name

def test_data_gpt2_is_r50k_base(tmp_path, monkeypatch):
    # --tokenizer=gpt2 loads tiktoken's r50k_base (GPT-2's BPE in one file), meta.json names it, and readers
    # load it by that name. A tiny encoding called "r50k_base" stands in for the real one: no download
    enc = _tiny_encoding(name="r50k_base")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / prepare_data.GPT2_CACHE_NAME).write_bytes(b"")  # as if tiktoken had cached it: no network probe
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    monkeypatch.setattr(prepare_data.socket, "create_connection", lambda *a, **k: pytest.fail("it is cached"))
    asked = []
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: asked.append(name) or enc)
    (tmp_path / "shake.txt").write_text(DATA_TEXT)
    meta = prepare_data.main([f"--input={tmp_path / 'shake.txt'}", f"--data_dir={tmp_path}", "--tokenizer=gpt2"])
    d = str(tmp_path / "shake")
    assert asked == ["r50k_base"] and meta == load_meta(d)
    assert meta["tokenizer"] == "gpt2" and meta["encoding"] == "r50k_base" and meta["vocab_size"] == 258
    assert _tokens(d) == enc.encode_ordinary(DATA_TEXT) and 257 in _tokens(d)
    assert get_tokenizer(load_meta(d)).decode(_tokens(d)) == DATA_TEXT  # the reader loads it from meta alone
    assert asked == ["r50k_base"] * 2
    # datasets made before: meta says tiktoken's "gpt2" (the same BPE from two files), or names no encoding
    old = {k: v for k, v in meta.items() if k != "encoding"}
    for m in (dict(old, encoding="gpt2"), old):
        assert get_tokenizer(m).decode(_tokens(d)) == DATA_TEXT
        common.check_dataset({"meta": m}, meta, d, "ckpt.pt")  # re-preparing it is no change of data
    assert asked == ["r50k_base"] * 4
    with pytest.raises(ValueError, match="encoding: 'tiny' then, 'r50k_base' now"):
        common.check_dataset({"meta": dict(meta, encoding="tiny")}, meta, d, "ckpt.pt")
    with pytest.raises(ValueError, match="encoding 'cl100k_base'"):
        get_tokenizer(dict(meta, encoding="cl100k_base"))
    assert asked == ["r50k_base"] * 4

def test_data_uint32_when_vocab_too_big(tmp_path):
    # a tiktoken vocab of 70001 (one special token with id 70000) must not be stored as uint16
    enc = _tiny_encoding({"<|big|>": 70000})
    d = str(tmp_path / "big")
    meta = prepare("speak " * 50, d, tokenizer="gpt2", encoding=enc)
    assert meta["vocab_size"] == 70001 and meta["dtype"] == "uint32"
    assert os.path.getsize(os.path.join(d, "train.bin")) == meta["train_tokens"] * 4
    assert _tokens(d) == enc.encode_ordinary("speak " * 50)
    # char-level at the boundary: 65536 distinct characters still fit uint16, 65537 don't
    cps = [c for c in range(0x20, 0x20 + 65537 + 2048) if not 0xD800 <= c < 0xE000][:65537]
    for n, dtype in [(65536, "uint16"), (65537, "uint32")]:
        text = "".join(map(chr, cps[:n])) * 2
        d = str(tmp_path / f"chars{n}")
        meta = prepare(text, d, val_fraction=0.5)
        assert meta["vocab_size"] == n and meta["dtype"] == dtype
        assert _tokens(d) == list(range(n)) * 2
        assert get_tokenizer(load_meta(d)).decode(load_tokens(d, "val")) == text[n:]

def test_data_download_failure_falls_back(tmp_path, monkeypatch, capsys):
    def offline(url, timeout=5):
        raise OSError("no network in tests")
    monkeypatch.setattr(prepare_data, "download", offline)
    meta = prepare_data.main([f"--data_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert "could not download tiny Shakespeare" in out and "pydoc_data.topics" in out and "--input=" in out
    import pydoc_data.topics
    assert meta["source"].startswith("pydoc_data.topics") and meta["n_chars"] == sum(map(len, pydoc_data.topics.topics.values()))
    assert load_meta(str(tmp_path / "quickstart")) == meta
    assert "quickstart" in out.splitlines()[-1] and f"{meta['val_tokens']:,}" in out.splitlines()[-1]

def test_data_download_success_is_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prepare_data, "download", lambda url, timeout=5: DATA_TEXT)
    meta = prepare_data.main([f"--data_dir={tmp_path}", "--val_fraction=0.2"])
    assert meta["source"].startswith("tiny Shakespeare") and meta["n_chars"] == len(DATA_TEXT)
    assert sorted(os.listdir(tmp_path)) == ["quickstart", "tinyshakespeare.txt"]
    monkeypatch.setattr(prepare_data, "download", lambda url, timeout=5: 1 / 0)  # 2nd run: from the cache
    assert prepare_data.main([f"--data_dir={tmp_path}", "--val_fraction=0.2"]) == meta
    assert "could not download" not in capsys.readouterr().out

def test_data_interrupted_write_leaves_no_dataset(tmp_path, monkeypatch):
    good = str(tmp_path / "good")
    meta = prepare(DATA_TEXT, good, source="old")
    write_bin = prepare_data._write_bin
    def crash_after_train(path, ids, dtype):
        if path.endswith("val.bin"):
            raise KeyboardInterrupt  # e.g. ctrl-c mid-write, after train.bin is on disk
        write_bin(path, ids, dtype)
    monkeypatch.setattr(prepare_data, "_write_bin", crash_after_train)
    with pytest.raises(KeyboardInterrupt):
        prepare(DATA_TEXT * 2, good, source="new")
    with pytest.raises(KeyboardInterrupt):
        prepare(DATA_TEXT, str(tmp_path / "fresh"))
    assert load_meta(good) == meta  # old dataset untouched
    with pytest.raises(FileNotFoundError):
        load_meta(str(tmp_path / "fresh"))
    assert sorted(os.listdir(tmp_path)) == ["good"]  # temp folders cleaned up
    # the swap itself failing puts the old dataset back
    monkeypatch.setattr(prepare_data, "_write_bin", write_bin)
    rename = os.rename
    def failing_rename(src, dst):
        if ".tmp-" in src:
            raise OSError("disk on fire")
        rename(src, dst)
    monkeypatch.setattr(prepare_data.os, "rename", failing_rename)
    with pytest.raises(OSError):
        prepare(DATA_TEXT * 2, good, source="new")
    monkeypatch.undo()
    assert load_meta(good) == meta and sorted(os.listdir(tmp_path)) == ["good"]
    assert prepare(DATA_TEXT * 2, good, source="new")["source"] == "new"  # re-running replaces it
    assert load_meta(good)["n_chars"] == 2 * len(DATA_TEXT) and sorted(os.listdir(tmp_path)) == ["good"]

def test_data_load_meta_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"prepare it with: python prepare_data.py$"):
        load_meta("data/quickstart")
    with pytest.raises(FileNotFoundError, match=r"prepare it with: python prepare_data.py --tokenizer=gpt2 "
                                                r"--name=shakespeare_gpt2$"):  # the quick start's text in GPT-2 BPE
        load_meta("data/shakespeare_gpt2")
    with pytest.raises(FileNotFoundError, match=r"python prepare_data.py --input=YOUR_TEXT.txt --name=mine$"):
        load_meta("data/mine")
    with pytest.raises(FileNotFoundError, match=r"--name=mine --data_dir=elsewhere$"):
        load_meta("elsewhere/mine")
    prepare(DATA_TEXT, "data/mine")
    with open("data/mine/train.bin", "ab") as f:
        f.write(b"\0")  # one byte too many
    with pytest.raises(ValueError, match="train.bin has"):
        load_meta("data/mine")
    prepare(DATA_TEXT, "data/mine")
    with open("data/mine/meta.json", "w") as f:
        f.write('{"tokenizer": "char"')
    with pytest.raises(ValueError, match="malformed"):
        load_meta("data/mine")
    os.remove("data/mine/meta.json")
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        load_meta("data/mine")

def test_data_bad_inputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="input file not found: missing.txt"):
        prepare_data.main(["--input=missing.txt"])
    open("empty.txt", "w").close()
    with pytest.raises(ValueError, match="empty"):
        prepare_data.main(["--input=empty.txt"])
    with open("bad.txt", "wb") as f:
        f.write("héllo".encode() + b"\xff rest")
    with pytest.raises(ValueError, match=r"bad.txt is not valid UTF-8: .* at byte offset 6"):
        prepare_data.main(["--input", "empty.txt", "bad.txt"])
    with open("tiny.txt", "w") as f:
        f.write("abcdefghi")
    with pytest.raises(ValueError, match="too small"):
        prepare_data.main(["--input=tiny.txt"])  # 9 tokens -> 1 val token
    with pytest.raises(ValueError, match="bad dataset name"):
        prepare_data.main(["--input=tiny.txt", "--name=../x"])
    assert not os.path.exists("data/tiny") and not os.path.exists("data/empty")

@pytest.mark.parametrize("args, error, match", [
    (["--input=folder"], ValueError, "--input=folder is a folder; give the text file"),  # was "not found"
    (["--input=tiny.txt", "--name="], ValueError, "bad dataset name ''"),                 # was silently ignored
])
def test_data_cli_misleading_inputs(tmp_path, monkeypatch, args, error, match):
    monkeypatch.chdir(tmp_path)
    os.makedirs("folder")
    with open("tiny.txt", "w") as f:
        f.write(DATA_TEXT)
    with pytest.raises(error, match=re.escape(match)):
        prepare_data.main(args)
    assert sorted(os.listdir()) == ["folder", "tiny.txt"]  # nothing written


def test_data_replacing_other_data_says_so(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(DATA_TEXT)
    (tmp_path / "b.txt").write_text(DATA_TEXT * 2)
    prepare_data.main([f"--input={tmp_path / 'a.txt'}", "--name=x", f"--data_dir={tmp_path}"])
    prepare_data.main([f"--input={tmp_path / 'a.txt'}", "--name=x", f"--data_dir={tmp_path}"])
    assert "note" not in capsys.readouterr().out  # the same data again: nothing to say
    prepare_data.main([f"--input={tmp_path / 'b.txt'}", "--name=x", f"--data_dir={tmp_path}"])
    assert re.search(rf"note: replaced .*x, which held other data \(source='files: .*a.txt', "
                     rf"n_chars={len(DATA_TEXT)}\)", capsys.readouterr().out)


def test_data_read_only_folder_changes_nothing(tmp_path, monkeypatch, capsys):
    good = str(tmp_path / "good")
    meta = prepare(DATA_TEXT, good, source="old")
    # a read-only folder, as a normal user sees it (the tests may run as root, who may write anywhere): it can
    # be moved aside (its parent is writable) but not emptied
    access, rmtree = os.access, shutil.rmtree
    monkeypatch.setattr(prepare_data.os, "access", lambda p, mode: os.path.normpath(p) != good and access(p, mode))
    def rmtree_read_only(path, *a, **k):
        if ".good.old-" in str(path):
            raise PermissionError(13, "Permission denied")
        rmtree(path, *a, **k)
    monkeypatch.setattr(prepare_data.shutil, "rmtree", rmtree_read_only)
    with pytest.raises(PermissionError, match="good is read-only.*nothing was changed"):
        prepare(DATA_TEXT * 2, good, source="new")
    assert load_meta(good) == meta and sorted(os.listdir(tmp_path)) == ["good"]  # no install, no hidden folders
    # cleaning up after the swap fails some other way: the new dataset is in place, so no error, but a note
    monkeypatch.setattr(prepare_data.os, "access", access)
    assert prepare(DATA_TEXT * 2, good, source="new")["source"] == "new" and load_meta(good)["source"] == "new"
    old = [d for d in os.listdir(tmp_path) if d.startswith(".good.old-")]
    assert len(old) == 1 and f"could not delete the old copy {tmp_path / old[0]}" in capsys.readouterr().out


def test_data_vocab_size_below_token_ids(tmp_path):
    d = str(tmp_path / "x")
    prepare(DATA_TEXT, d)
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    n = meta["vocab_size"] - 3
    with open(os.path.join(d, "meta.json"), "w") as f:  # consistent in itself, but the data has larger ids
        json.dump(dict(meta, vocab_size=n, chars=meta["chars"][:n]), f)
    with pytest.raises(ValueError, match=rf"train.bin holds token id {n + 2}, but meta.json says vocab_size={n}"):
        load_tokens(d, "train")


def test_data_gpt2_offline_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))
    def no_network(*a, **k):
        raise OSError("no network in tests")
    monkeypatch.setattr(prepare_data.socket, "create_connection", no_network)
    monkeypatch.setattr(prepare_data, "download", lambda *a, **k: pytest.fail("should fail before downloading"))
    with pytest.raises(ValueError, match="--tokenizer=char.*TIKTOKEN_CACHE_DIR") as e:
        prepare_data.main([f"--data_dir={tmp_path}", "--tokenizer=gpt2"])
    assert "r50k_base.tiktoken saved as 0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4" in str(e.value)  # tiktoken's name
    assert "\n" not in str(e.value) and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match=r"\(r50k_base\).*\. Set TIKTOKEN_CACHE_DIR"):  # a reader's: no --tokenizer
        get_tokenizer({"tokenizer": "gpt2", "encoding": "r50k_base"})

def test_data_cli_error_is_one_line(tmp_path):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prepare_data.py")
    r = subprocess.run([sys.executable, script, "--input=missing.txt"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []


def run_script_patched(script, patch, *args, cwd=HERE):
    """python <script> <args> as a user runs it, after the Python lines in patch ran in the same process (e.g. a
    full disk simulated by patching builtins.open). -> CompletedProcess."""
    code = (f"import runpy, sys\nsys.path.insert(0, {HERE!r})\n{patch}\nsys.argv = {[script, *args]!r}\n"
            f"runpy.run_path({os.path.join(HERE, script)!r}, run_name='__main__')")  # as `python script` runs it
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


FULL_DISK_OPEN = """import builtins, errno
_open = builtins.open
def _full(f, mode="r", *a, **k):
    if "w" in mode and str(f).endswith(SUFFIX):
        raise OSError(errno.ENOSPC, "No space left on device")
    return _open(f, mode, *a, **k)
builtins.open = _full"""


def _full_disk_write_bin(path, ids, dtype):
    """prepare_data._write_bin on a disk that fills up halfway through."""
    with open(path, "wb") as f:
        f.write(b"\0" * 10)
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("task", [False, True])
@pytest.mark.parametrize("old", [False, True])
def test_data_full_disk_says_so_and_keeps_the_old_dataset(tmp_path, monkeypatch, task, old):
    d = str(tmp_path / "x")
    make = (lambda: prepare_data.prepare_arithmetic(d, operands=3, train_size=50, val_size=5, test_size=5)) if task \
        else (lambda: prepare(DATA_TEXT, d))
    before = prepare(DATA_TEXT * 2, d) if old else None
    monkeypatch.setattr(prepare_data, "_write_bin", _full_disk_write_bin)
    kept = f"{d} is unchanged (it still holds the old dataset)" if old else "no dataset was written"
    with pytest.raises(prepare_data.DiskFullError) as e:
        make()
    assert str(e.value) == (f"the disk is full (No space left on device) while writing {d}; {kept}; free some space "
                            f"and run this again")  # was: [Errno 28] No space left on device
    assert os.listdir(tmp_path) == (["x"] if old else [])  # no temp folder left behind
    if old:
        assert load_meta(d) == before


def test_data_full_disk_cli_is_one_line(tmp_path):
    (tmp_path / "t.txt").write_text(DATA_TEXT)
    r = run_script_patched("prepare_data.py", FULL_DISK_OPEN.replace("SUFFIX", "'.bin'"), "--input=t.txt", cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: the disk is full (No space left on device) while writing data/t; no dataset "
                               "was written")
    assert sorted(os.listdir(tmp_path)) == ["data", "t.txt"] and os.listdir(tmp_path / "data") == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_data_real_full_disk_is_recognised():
    """What a full disk really raises: _write_bin's error has an errno (ndarray.tofile's: "N requested and 0
    written", none), and torch.save's is a RuntimeError raised while handling one; disk_full finds both."""
    with pytest.raises(OSError) as e:
        prepare_data._write_bin("/dev/full", np.arange(100000), "uint32")
    assert prepare_data.disk_full(e.value) is e.value
    with pytest.raises(Exception) as e, open("/dev/full", "wb") as f:
        torch.save({"x": torch.zeros(100000)}, f)
    assert prepare_data.disk_full(e.value).errno == errno.ENOSPC
    assert prepare_data.disk_full(RuntimeError("enforce fail")) is None
    assert prepare_data.disk_full(OSError(errno.EACCES, "Permission denied")) is None
    assert prepare_data.disk_full(OSError(errno.EDQUOT, "Disk quota exceeded")).errno == errno.EDQUOT


def test_data_one_character_vocabulary_refused(tmp_path):
    with pytest.raises(ValueError, match="only one distinct character, 'a': there is nothing to predict"):
        prepare("a" * 1000, str(tmp_path / "a"))
    assert os.listdir(tmp_path) == []
    d = tmp_path / "b"  # one made by hand (or by an older prepare_data.py)
    d.mkdir()
    np.zeros(100, dtype="<u2").tofile(d / "train.bin")
    np.zeros(10, dtype="<u2").tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps(dict(tokenizer="char", chars=["a"], vocab_size=1, dtype="uint16",
                                                 source="a", train_tokens=100, val_tokens=10)))
    with pytest.raises(ValueError, match=f"{re.escape(str(d))} has a vocabulary of one token \\('a'\\): there is "
                                         f"nothing to predict"):
        load_meta(str(d))


@pytest.mark.parametrize("args, match", [
    (["--operands=5"], "--operands is for --task=arithmetic: add --task=arithmetic, or drop it"),  # was: Shakespeare
    (["--train_size=10", "--seed=3"], "--train_size and --seed are for --task=arithmetic"),
    (["--task=arithmetic", "--tokenizer=gpt2"], "--task makes its own vocabulary and splits: drop --tokenizer"),
    (["--task=arithmetic", "--val_fraction=0.2"], "drop --val_fraction"),
    (["--task=arithmetic", "--seed=-1"], "--seed must be at least 0, got -1"),  # was: expected non-negative integer
    (["--data_dir=afile"], "--data_dir=afile is a file, not a folder"),          # was: [Errno 17] File exists
    (["--task=arithmetic", "--data_dir=afile"], "--data_dir=afile is a file, not a folder"),
])
def test_data_cli_flags_that_cannot_apply(tmp_path, monkeypatch, args, match):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=re.escape(match)):
        prepare_data.main(args)
    assert os.listdir(tmp_path) == ["afile"]  # nothing written


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
def test_data_input_that_is_not_a_regular_file(tmp_path):
    """A device or a pipe (--input=<(zcat text.gz)) is read like a file; was: "input file not found: /dev/null"."""
    with pytest.raises(ValueError, match="no text in /dev/null"):
        prepare_data.main(["--input=/dev/null", f"--data_dir={tmp_path}"])


def test_data_task_replacing_a_text_dataset_says_so(tmp_path, capsys):
    prepare(DATA_TEXT, str(tmp_path / "x"))
    prepare_data.main(["--task=arithmetic", "--operands=3", "--train_size=50", "--val_size=5", "--test_size=5",
                       "--name=x", f"--data_dir={tmp_path}"])
    assert re.search(r"note: replaced .*x, which held other data \(source='text', n_chars=", capsys.readouterr().out)


# prepare_data.py --task=arithmetic

def _field_value(toks, p):
    """Value mod p of an expression (a step of a solution), computed independently of the generator: Python
    evaluates it over the rationals (Fractions, usual precedence), then maps the result into the field. Valid
    because no divisor is 0 mod p, so no denominator is ever divisible by p."""
    from fractions import Fraction
    src = "".join(f"Fraction({t})" if isinstance(t, int) else t for t in toks)
    v = eval(src, {"Fraction": Fraction})
    return v.numerator * pow(v.denominator, p - 2, p) % p

def _one_operation_apart(a, b):
    """b is a with one 'x op y' replaced by a number (and the parentheses around it dropped if it's alone)."""
    for k in range(1, len(a) - 1):
        if a[k] in ("+", "-", "*", "/") and isinstance(a[k - 1], int) and isinstance(a[k + 1], int):
            if b == a[:k - 1] + b[k - 1:k] + a[k + 2:] and isinstance(b[k - 1], int):
                return True
            if 0 < k - 1 and a[k - 2] == "(" and a[k + 2:k + 3] == [")"] and \
                    b == a[:k - 2] + b[k - 2:k - 1] + a[k + 3:] and isinstance(b[k - 2], int):
                return True
    return False

@pytest.mark.parametrize("operands, p", [(2, 11), (4, 11), (6, 11), (6, 7), (8, 13)])
def test_task_every_step_is_a_correct_rewrite(operands, p):
    rng = np.random.default_rng(operands)
    for expr in prepare_data.make_problems(200, operands, p, rng):
        toks = prepare_data.problem_tokens(expr, p)
        assert toks[-1] == "." and "." not in toks[:-1]
        steps, cur = [], []
        for t in toks[:-1]:  # split at "="
            if t == "=":
                steps.append(cur)
                cur = []
            else:
                cur.append(t)
        steps.append(cur)
        assert steps[0] == expr and len(steps) == operands  # the expression, then one step per operation
        answer = _field_value(expr, p)
        assert steps[-1] == [answer]
        for a, b in zip(steps, steps[1:]):
            assert _one_operation_apart(a, b), (a, b)
            assert _field_value(b, p) == answer, (a, b)  # every step keeps the value
        ids = prepare_data.encode_problem(toks, p)
        assert ids[-2] == answer and prepare_data.task_answer(ids[len(expr) + 1:], dict(
            end_id=p + 7, eq_id=p + 6, prime=p)) == answer

def test_task_rewrite_rule_by_hand():
    p = 11
    text = lambda toks: prepare_data.problem_text(prepare_data.encode_problem(toks, p), p)
    expr = prepare_data.parse_expression("(7+5)/(6+4*3-2*7)", p)
    assert text(prepare_data.problem_tokens(expr, p)) == "(7+5)/(6+4*3-2*7)=1/(6+4*3-2*7)=1/(6+1-2*7)=1/(6+1-3)=1/(7-3)=1/4=3."
    assert text(prepare_data.problem_tokens(prepare_data.parse_expression("8-3-2", p), p)) == "8-3-2=5-2=3."
    assert text(prepare_data.problem_tokens(prepare_data.parse_expression("A/5*3", p), p)) == "A/5*3=2*3=6."
    assert prepare_data.render(("-", 1, ("+", 2, 3))) == [1, "-", "(", 2, "+", 3, ")"]
    for bad in ["3+", "(3+4", "3+4)", "34+1", "3+B", "", "3=4"]:
        with pytest.raises(ValueError):
            prepare_data.parse_expression(bad, p)

def test_task_dataset_disjoint_deterministic(tmp_path):
    kw = dict(operands=4, prime=11, train_size=300, val_size=40, test_size=50)
    m1 = prepare_data.prepare_arithmetic(str(tmp_path / "a"), seed=3, **kw)
    prepare_data.prepare_arithmetic(str(tmp_path / "b"), seed=3, **kw)
    prepare_data.prepare_arithmetic(str(tmp_path / "c"), seed=4, **kw)
    files = lambda d: {f: open(tmp_path / d / f, "rb").read() for f in sorted(os.listdir(tmp_path / d))}
    assert files("a") == files("b") and files("a") != files("c")  # same seed, same bytes
    assert sorted(files("a")) == ["meta.json", "test.bin", "train.bin", "val.bin"]
    meta = load_meta(str(tmp_path / "a"))
    assert meta == m1 and meta["layout"] == "rows" and meta["vocab_size"] == 20 and meta["chars"][:11] == list("0123456789A")
    prompts = {}
    for split, n in (("train", 300), ("val", 40), ("test", 50)):
        rows = prepare_data.load_rows(str(tmp_path / "a"), split, meta)
        assert rows.shape == (n, meta["row_length"]) and meta[f"{split}_rows"] == n
        end = (rows == meta["end_id"]).argmax(1)
        assert (rows == meta["end_id"]).sum(1).tolist() == [1] * n and (end == meta["row_length"] - 1).any()
        for r, e in zip(rows, end):  # padding after the end token, and only there
            assert (r[e + 1:] == meta["pad_id"]).all() and (r[:e] != meta["pad_id"]).all()
        prompts[split] = {tuple(r[:list(r).index(meta["eq_id"])]) for r in rows}
        assert len(prompts[split]) == n  # no repeats within a split
    assert not prompts["test"] & prompts["train"] and not prompts["val"] & prompts["train"] and not prompts["test"] & prompts["val"]
    with pytest.raises(ValueError, match="found only 33 distinct expressions"):  # 2 operands mod 3: 33 exist
        prepare_data.prepare_arithmetic(str(tmp_path / "d"), operands=2, prime=3, train_size=32, val_size=1, test_size=1)
    with pytest.raises(ValueError, match="at most 36 different expressions with 2 operands mod 3, and 42 were"):
        prepare_data.prepare_arithmetic(str(tmp_path / "d"), operands=2, prime=3, train_size=40, val_size=1, test_size=1)
    with pytest.raises(ValueError, match="prime"):
        prepare_data.main([f"--data_dir={tmp_path}", "--task=arithmetic", "--prime=12"])
    assert not os.path.exists(tmp_path / "d") and not os.path.exists(tmp_path / "arithmetic6")

def test_task_answer_metric_by_hand():
    p, meta = 11, dict(end_id=18, eq_id=17, prime=11)
    enc = lambda text: [prepare_data.task_chars(p).index(c) for c in text]
    assert prepare_data.task_answer(enc("2*3=6.__"), meta) == 6            # right (whatever the steps)
    assert prepare_data.task_answer(enc("6.____"), meta) == 6              # an answer straight away
    assert prepare_data.task_answer(enc("2*3=7.__"), meta) == 7            # a wrong answer is still an answer
    for unparseable in ["2*3=6", "2*3=6_", "2*3=.", "2*3=6+1.", "2*3=(6).", "2*3=67.", "."]:
        assert prepare_data.task_answer(enc(unparseable), meta) is None, unparseable
    assert prepare_data.task_answer(enc("2*3=6.=5."), meta) == 6           # the first end token ends it


@pytest.fixture
def small_task(tmp_path):
    """A small arithmetic dataset in tmp_path/arith (3 operands mod 7): (its path, meta)."""
    d = str(tmp_path / "arith")
    return d, prepare_data.prepare_arithmetic(d, operands=3, train_size=60, val_size=10, test_size=10)


def _edit_meta(d, **kw):
    path = os.path.join(d, "meta.json")
    meta = json.load(open(path))
    meta.update({k: v(meta) if callable(v) else v for k, v in kw.items()})
    json.dump(meta, open(path, "w"))


@pytest.mark.parametrize("edit, match", [
    (dict(prime=11), "its chars are not the 20 symbols of the task mod 11"),  # was: trained, misread mod 11
    (dict(prime=8), "prime=8 is not a prime from 2 to 36"),
    (dict(chars=lambda m: [m["chars"][1], m["chars"][0]] + m["chars"][2:]), "its chars are not the 16 symbols"),
    (dict(chars=lambda m: m["chars"][:-1] + ["#"]), "its chars are not the 16 symbols"),
    (dict(eq_id=14), "eq_id=14, but '=' is token 13"),  # was: val loss nan, "try a lower learning rate"
    (dict(pad_id=0), "pad_id=0, but '_' is token 15"),
    (dict(task="sorting"), "task='sorting', but the only task is 'arithmetic'"),
    (dict(operands=2, row_length=5), "operands=2 and row_length=5 can't be"),
])
def test_task_edited_meta_is_refused(small_task, edit, match):
    d, _ = small_task
    _edit_meta(d, **edit)
    with pytest.raises(ValueError, match=re.escape(f"{d}/meta.json doesn't match the task data it describes ({match}")
                       + ".*was it edited\\?\\); re-run: python prepare_data.py --task=arithmetic --operands=3 --name=arith "):
        load_meta(d)


@pytest.mark.parametrize("damage, error, match", [
    ("delete", FileNotFoundError, "is incomplete (no test.bin)"),
    ("truncate", ValueError, "test.bin has 80 bytes, meta.json says"),
])
def test_task_missing_or_truncated_test_split_found_by_load_meta(small_task, damage, error, match):
    """train.py opens the dataset with load_meta: a broken test.bin stops it before training, not after it."""
    d, _ = small_task
    path = os.path.join(d, "test.bin")
    if damage == "delete":
        os.remove(path)
    else:
        os.truncate(path, 80)
    with pytest.raises(error, match=re.escape(match)):
        load_meta(d)


def test_task_val_split_without_solutions_found_at_load_time(small_task):
    d, meta = small_task
    rows = np.array(prepare_data.load_rows(d, "val", meta))
    assert prepare_data.has_solution(rows, meta).all()
    rows[3, list(rows[3]).index(meta["eq_id"]) + 1:] = meta["pad_id"]  # nothing but padding after the "="
    rows[5] = meta["pad_id"]                                           # no "=" at all
    assert prepare_data.has_solution(rows, meta).tolist() == [i not in (3, 5) for i in range(10)]
    rows.astype("<u2").tofile(os.path.join(d, "val.bin"))
    with pytest.raises(ValueError, match=re.escape(f"{d}/val.bin: 2 of its 10 rows have no solution tokens")):
        prepare_data.load_rows(d, "val", meta)  # was: "val loss is nan ... try a lower --learning_rate" after training


@pytest.mark.parametrize("kw, match", [
    (dict(operands=1000), "--operands must be from 2 to 32, got 1000"),      # was: ran for minutes, silently
    (dict(operands=33), "--operands must be from 2 to 32, got 33"),
    (dict(train_size=100_000_000), "--train_size + --val_size + --test_size is 100,002,000, more than 1,000,000"),
    (dict(seed=-1), "--seed must be at least 0, got -1"),
])
def test_task_sizes_have_upper_bounds(tmp_path, kw, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        prepare_data.prepare_arithmetic(str(tmp_path / "x"), **kw)
    assert os.listdir(tmp_path) == []


def test_task_prints_progress_when_slow(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prepare_data, "PROGRESS_WORK", 0)  # (the default size stays quiet: see the data tests)
    prepare_data.prepare_arithmetic(str(tmp_path / "x"), operands=3, train_size=80, val_size=10, test_size=10)
    out = capsys.readouterr().out.splitlines()
    assert out == [f"drawing problems: {k}0% ({k * 10} of 100)" for k in range(1, 11)] + \
                  [f"solving them: {k}0% ({k * 10} of 100)" for k in range(1, 11)]


def test_task_too_many_operands_advises_fewer():
    """Long expressions mod a small prime nearly always divide by 0 somewhere: fewer operands help, more don't."""
    with pytest.raises(ValueError, match=r"found only \d+ distinct expressions with 32 operands mod 2 .*: 9\d% of the "
                                         r"draws divide by 0 somewhere .*: use fewer --operands or a larger --prime"):
        prepare_data.make_problems(50, 32, 2, np.random.default_rng(0))  # was: "use more --operands"


def test_task_division_by_zero_has_no_answer():
    assert prepare_data.apply_op("/", 3, 5, 7) == 2  # 5 * 2 = 10 = 3 mod 7
    with pytest.raises(ZeroDivisionError, match="division by 0 mod 7"):
        prepare_data.apply_op("/", 3, 0, 7)  # was: 0
    with pytest.raises(ZeroDivisionError):
        prepare_data.problem_tokens(prepare_data.parse_expression("(2/(3-3))*0", 7), 7)


# ----------------------------------------------------------------------------- train.py: training, resume, logs, comparison

TRAIN_TEXT = "".join(f"{i}: The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs!\n"
               for i in range(80))  # ~7 KB


@pytest.fixture
def tiny_data(tmp_path):
    """Flags for a tiny_data model on a tiny_data char dataset in tmp_path; tiny_data(...) adds flags."""
    prepare_data.prepare(TRAIN_TEXT, str(tmp_path / "data" / "tiny_data"), val_fraction=0.1)
    base = [f"--data_dir={tmp_path / 'data'}", "--dataset=tiny_data", "--n_layer=2", "--n_embd=32", "--n_head=2",
            "--block_size=16", "--batch_size=4", "--eval_iters=2", "--eval_interval=4", "--log_interval=2",
            "--warmup_iters=2", "--device=cpu"]
    return lambda *flags: base + list(flags)


def records(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        lines = [json.loads(line) for line in f]  # every line parses
    assert "config" in lines[0]
    return [r for r in lines if "iter" in r]


def test_train_end_to_end_both_variants(tiny_data, tmp_path):
    for lime in (False, True):
        out = str(tmp_path / f"run_{lime}")
        res = train.main(tiny_data(f"--lime={lime}", "--max_iters=6", f"--out_dir={out}", "--router_lr=5e-3"))
        assert res["iter"] == 6 and math.isfinite(res["val_loss"])
        model, ckpt = common.load_checkpoint(out)
        assert {"model_args", "model", "optimizer", "iter_num", "best_val_loss", "config", "meta",
                "rng_cpu"} <= set(ckpt)
        assert ckpt["iter_num"] == 6 and ckpt["model_args"]["lime"] == lime and ckpt["meta"]["tokenizer"] == "char"
        recs = records(out)
        assert [r["iter"] for r in recs] == [0, 2, 4, 6]
        assert [r["iter"] for r in recs if "val_loss" in r] == [0, 4, 6]
        fpt = model.flops_per_token(16)
        for r in recs:
            assert r["tokens"] == r["iter"] * 4 * 16
            assert r["flops"] == 3 * fpt * r["tokens"]
        groups = ckpt["optimizer"]["param_groups"]
        assert len(groups) == (3 if lime else 2)
        if lime:  # routers follow the schedule scaled to their own peak
            assert groups[2]["lr"] == pytest.approx(groups[0]["lr"] * 5e-3 / train.PRESETS["cpu"]["learning_rate"])


def same_records(dir_a, dir_b, iters):
    """The logs of two runs hold records at the same iters with the same losses, lr and FLOPs (to 1e-6)."""
    a, b = records(dir_a), records(dir_b)
    assert [r["iter"] for r in a] == [r["iter"] for r in b] == iters
    for ra, rb in zip(a, b):
        for k in ("train_loss", "val_loss", "lr", "flops"):
            assert (k in ra) == (k in rb)
            if k in ra:
                assert abs(ra[k] - rb[k]) <= 1e-6, (ra, rb)
    return a, b


def test_train_resume_is_exact(tiny_data, tmp_path):
    flags = tiny_data("--lime=True", "--dropout=0.1", "--gradient_accumulation_steps=2", "--lr_decay_iters=8")
    train.main(flags + ["--max_iters=8", f"--out_dir={tmp_path / 'a'}"])
    train.main(flags + ["--max_iters=4", f"--out_dir={tmp_path / 'b'}"])
    with open(tmp_path / "b" / "log.jsonl", "a") as f:  # a record past the checkpoint must be dropped
        f.write(json.dumps(dict(iter=5, tokens=0, flops=0, train_loss=9.0)) + "\n")
    train.main([f"--out_dir={tmp_path / 'b'}", "--resume=True", "--max_iters=8", "--device=cpu"])
    a, b = same_records(tmp_path / "a", tmp_path / "b", [0, 2, 4, 6, 8])


def test_train_lime_switches_checkpoint_round_trip(tiny_data, tmp_path, capsys):
    """--lime_kv/--lime_sources reach the model, its checkpoint and the log; loading the checkpoint gives the same
    model (same logits); they are fixed on --resume; without --lime they are an error; a checkpoint from before
    the flags existed resumes as the paper's mix."""
    out = tmp_path / "v"
    train.main(tiny_data("--lime=True", "--lime_kv=v", "--lime_sources=previous", "--n_layer=3", "--max_iters=4",
                         f"--out_dir={out}"))
    assert "LIMe lime_kv=v lime_sources=previous:" in capsys.readouterr().out
    model, ckpt = common.load_checkpoint(str(out))
    assert (model.config.lime_kv, model.config.lime_sources) == ("v", "previous")
    assert ckpt["config"]["lime_kv"] == "v" and train.read_log(str(out / "log.jsonl"), header=True)[
        "model_args"]["lime_sources"] == "previous"
    assert ckpt["model"]["transformer.h.2.attn.router"].shape == (2, 6)
    assert (ckpt["model"]["transformer.h.2.attn.router"][:, :2] == 0).all()   # layer 2 doesn't read layer 0
    fresh = GPT(GPTConfig(**ckpt["model_args"]))
    fresh.load_state_dict(torch.load(out / "ckpt.pt", weights_only=True)["model"])
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    assert torch.equal(fresh(idx)[0], model(idx)[0])
    with pytest.raises(ValueError, match="lime_kv differs"):
        train.main([f"--out_dir={out}", "--resume=True", "--lime_kv=k", "--device=cpu", "--max_iters=6"])
    with pytest.raises(ValueError, match="lime_sources differs"):
        train.main([f"--out_dir={out}", "--resume=True", "--lime_sources=all", "--device=cpu", "--max_iters=6"])
    assert train.main([f"--out_dir={out}", "--resume=True", "--device=cpu", "--max_iters=6"])["iter"] == 6
    assert common.load_checkpoint(str(out))[0].config.lime_kv == "v"
    old = tmp_path / "old"                                                        # a run from before the flags
    train.main(tiny_data("--lime=True", "--max_iters=2", f"--out_dir={old}"))
    ckpt = torch.load(old / "ckpt.pt", weights_only=True)
    for d in (ckpt["config"], ckpt["model_args"]):
        del d["lime_kv"], d["lime_sources"]
    torch.save(ckpt, old / "ckpt.pt")
    with pytest.raises(ValueError, match=re.escape("lime_sources differs (checkpoint has 'all'")):
        train.main([f"--out_dir={old}", "--resume=True", "--lime_sources=first", "--device=cpu", "--max_iters=4"])
    assert train.main([f"--out_dir={old}", "--resume=True", "--device=cpu", "--max_iters=4"])["iter"] == 4


def test_train_frozen_routers_stay_bit_identical(tiny_data, tmp_path):
    """lime-frozen = --router_lr=0: through train.py's real loop (warmup + cosine schedule scaled to a peak lr of
    0, grad clipping, AdamW with the routers' weight decay 0) the routers end bit-identical to their init, though
    they got gradients all along and every other weight trained."""
    out = tmp_path / "frozen"
    train.main(tiny_data("--lime=True", "--n_layer=3", "--router_lr=0", "--max_iters=6", "--grad_clip=0.5",
                         f"--out_dir={out}"))
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    torch.manual_seed(ckpt["config"]["seed"])                                     # train.py's init, again
    init = GPT(GPTConfig(**ckpt["model_args"])).state_dict()
    names = [k for k in init if k.endswith("attn.router")]
    assert len(names) == 2
    for k in names:
        assert torch.equal(ckpt["model"][k].view(torch.int32), init[k].view(torch.int32)), k
    assert not torch.equal(ckpt["model"]["lm_head.weight"], init["lm_head.weight"])
    groups = ckpt["optimizer"]["param_groups"]
    assert groups[2]["peak_lr"] == groups[2]["lr"] == 0.0 and groups[2]["weight_decay"] == 0.0 and groups[0]["lr"] > 0
    state = ckpt["optimizer"]["state"]
    assert all(state[i]["exp_avg"].abs().sum() > 0 for i in groups[2]["params"])  # gradients did reach them


def test_train_hc_resume_is_exact(tiny_data, tmp_path):
    """Hyper-Connections through train.py: --hc_rate/--hc_dynamic reach the checkpoint, a resumed run repeats an
    uninterrupted one, and on resume they are fixed like --lime."""
    flags = tiny_data("--hc_rate=3", "--dropout=0.1", "--gradient_accumulation_steps=2", "--lr_decay_iters=8")
    train.main(flags + ["--max_iters=8", f"--out_dir={tmp_path / 'a'}"])
    train.main(flags + ["--max_iters=4", f"--out_dir={tmp_path / 'b'}"])
    model, ckpt = common.load_checkpoint(str(tmp_path / "b"))
    assert ckpt["model_args"]["hc_rate"] == 3 and ckpt["model_args"]["hc_dynamic"] is True
    assert model.transformer.h[1].hc_mlp.static_alpha.shape == (3, 4)
    for flag in ("--hc_rate=4", "--hc_dynamic=False", "--hc_rate=0"):
        with pytest.raises(ValueError, match=f"{flag[2:flag.index('=')]} differs"):
            train.main([f"--out_dir={tmp_path / 'b'}", "--resume=True", "--max_iters=8", "--device=cpu", flag])
    train.main([f"--out_dir={tmp_path / 'b'}", "--resume=True", "--max_iters=8", "--device=cpu"])
    a, b = same_records(tmp_path / "a", tmp_path / "b", [0, 2, 4, 6, 8])
    assert a[-1]["flops"] == 3 * model.flops_per_token(16) * 8 * 4 * 16 * 2
    _, end = common.load_checkpoint(str(tmp_path / "b"))
    assert not torch.equal(end["model"]["transformer.h.1.hc_mlp.static_alpha"],
                           ckpt["model"]["transformer.h.1.hc_mlp.static_alpha"])  # it trained HC's weights


def test_train_resumes_a_checkpoint_from_before_hc(tiny_data, tmp_path):
    """A checkpoint written before --hc_rate existed (no hc_* in its config and model_args) resumes as a model
    without HC; asking for HC on it is refused."""
    out = str(tmp_path / "old")
    train.main(tiny_data("--max_iters=4", f"--out_dir={out}"))
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    for d in (ckpt["config"], ckpt["model_args"]):
        del d["hc_rate"], d["hc_dynamic"]
    save_checkpoint(ckpt, out)
    with pytest.raises(ValueError, match="hc_rate differs .checkpoint has 0"):
        train.main([f"--out_dir={out}", "--resume=True", "--max_iters=6", "--device=cpu", "--hc_rate=2"])
    assert train.main([f"--out_dir={out}", "--resume=True", "--max_iters=6", "--device=cpu"])["iter"] == 6
    assert common.load_checkpoint(out)[0].config.hc_rate == 0


def test_train_hc_bad_flags(tiny_data, tmp_path):
    with pytest.raises(ValueError, match="--hc_rate must be at least 0"):
        train.main(tiny_data("--hc_rate=-1", f"--out_dir={tmp_path / 'a'}"))
    with pytest.raises(ValueError, match=r"--compare is compare.py's now.*python compare.py .*--hc_rate=4"):
        train.main(tiny_data("--compare", "--hc_rate=4", f"--out_dir={tmp_path / 'b'}"))
    with pytest.raises(ValueError, match="hc_rate=-1"):
        GPT(tiny_config(False, hc_rate=-1))
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_train_passes_over_data(tiny_data, tmp_path, capsys):
    """passes = max_iters x tokens per iteration / training tokens: in the run header, the log header and the
    comparison summary; more than 2 gets a warning (overfitting, not what depth does, would dominate)."""
    n_train = load_meta(str(tmp_path / "data" / "tiny_data"))["train_tokens"]
    for iters, accum in ((3, 1), (200, 2)):
        out = tmp_path / f"p{iters}"
        train.main(tiny_data(f"--max_iters={iters}", f"--gradient_accumulation_steps={accum}", f"--out_dir={out}"))
        passes = iters * 4 * 16 * accum / n_train  # batch_size 4 x block_size 16 tokens per micro-batch
        assert train.read_log(str(out / "log.jsonl"), header=True)["passes"] == pytest.approx(passes)
        printed = capsys.readouterr().out
        assert f"{iters} iters = {passes:.2f} passes over the {n_train:,} training tokens" in printed
        assert ("warning: " in printed) == (passes > 2)
    assert 3 * 64 / n_train < 2 < 200 * 128 / n_train  # (both branches ran)


def test_train_batches_depend_only_on_seed_and_iter():
    data = np.arange(1000, dtype=np.uint16)
    cfg = dict(seed=1, block_size=8, batch_size=3, gradient_accumulation_steps=2)
    a, b = train.train_batches(data, cfg, 5), train.train_batches(data, cfg, 5)
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    assert not torch.equal(a[0][0], train.train_batches(data, dict(cfg, seed=2), 5)[0][0])
    x, y = a[0]
    assert x.dtype == torch.int64 and x.shape == (3, 8) and torch.equal(x[:, 1:], y[:, :-1])
    v1, v2 = common.fixed_val_batches(data, 8, 3, 4), common.fixed_val_batches(data, 8, 3, 2)
    assert len(v1) == 4 and all(torch.equal(p[0], q[0]) for p, q in zip(v1, v2))


def test_train_lr_schedule():
    cfg = dict(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    assert train.get_lr(0, cfg) == pytest.approx(1 / 11) and train.get_lr(10, cfg) == pytest.approx(1.0)
    assert train.get_lr(60, cfg) == pytest.approx(0.55) and train.get_lr(110, cfg) == train.get_lr(500, cfg) == 0.1


def test_train_lr_linear_decay():
    cfg = dict(learning_rate=1.0, min_lr=0.0, warmup_iters=0, lr_decay_iters=100, lr_decay="linear")
    assert [train.get_lr(i, cfg) for i in (0, 25, 50, 100, 200)] == pytest.approx([1.0, 0.75, 0.5, 0.0, 0.0])


# row datasets (the arithmetic task)

@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    """A small arithmetic dataset (3 operands): (data_dir, meta)."""
    d = tmp_path_factory.mktemp("task") / "data"
    meta = prepare_data.prepare_arithmetic(str(d / "arith"), operands=3, train_size=300, val_size=30, test_size=20)
    return d, meta


def test_train_row_loss_mask(task_data):
    d, meta = task_data
    rows = np.array(prepare_data.load_rows(str(d / "arith"), "train", meta)[:4], dtype=np.int64)
    x, y = train.row_xy(rows, meta)
    assert x.shape == y.shape == (4, meta["row_length"] - 1) and torch.equal(x, torch.from_numpy(rows[:, :-1]))
    eq = list(rows[0]).index(meta["eq_id"])
    end = list(rows[0]).index(meta["end_id"])
    assert (y[0, :eq] == -1).all() and torch.equal(y[0, eq:end], torch.from_numpy(rows[0, eq + 1:end + 1]))
    assert (y[0, end:] == -1).all()  # padding: no loss
    torch.manual_seed(0)
    model = GPT(tiny_config(False, vocab_size=meta["vocab_size"], block_size=meta["row_length"] - 1))
    loss = lambda r: model(x, train.row_xy(r, meta)[1])[1].item()  # the same inputs, the targets of rows r
    for j in range(1, eq):  # a prompt token as a target (all but the "=", which marks where the solution starts)
        r = rows.copy()
        r[0, j] = (r[0, j] + 1) % meta["prime"]
        assert loss(r) == loss(rows)
    r = rows.copy()
    r[0, eq + 1] = (r[0, eq + 1] + 1) % meta["prime"]  # the solution's first token: changes the loss
    assert loss(r) != loss(rows)


def test_train_row_batches_are_epochs(task_data):
    d, meta = task_data
    data = train.Rows(prepare_data.load_rows(str(d / "arith"), "train", meta), meta)
    cfg = dict(seed=1, batch_size=7, gradient_accumulation_steps=2)
    a, b = train.train_batches(data, cfg, 5), train.train_batches(data, cfg, 5)  # a pure function of (seed, iter)
    assert len(a) == 2 and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    assert not torch.equal(a[0][0], train.train_batches(data, dict(cfg, seed=2), 5)[0][0])
    assert sorted(train.row_stream(300, 1, 0, 300).tolist()) == list(range(300))  # each epoch: every row once
    assert sorted(train.row_stream(300, 1, 290, 300).tolist()) == sorted(  # across an epoch boundary
        train.row_stream(300, 1, 290, 10).tolist() + train.row_stream(300, 1, 300, 290).tolist())
    assert train.row_stream(300, 1, 0, 300).tolist() != train.row_stream(300, 1, 300, 300).tolist()


class _ScriptedModel(torch.nn.Module):
    """Stands in for a GPT in answer_accuracy: 'generates' a hand-written continuation per prompt."""
    def __init__(self, meta, replies):
        super().__init__()
        self.w, self.meta, self.replies = torch.nn.Parameter(torch.zeros(1)), meta, replies

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        chars = self.meta["chars"]
        out = []
        for row in idx.tolist():
            reply = [chars.index(c) for c in self.replies[prepare_data.problem_text(row, self.meta["prime"])]]
            out.append(row + (reply + [self.meta["pad_id"]] * max_new_tokens)[:max_new_tokens])
        return torch.tensor(out)


def test_train_answer_accuracy_on_scripted_outputs(task_data):
    d, meta = task_data
    data = train.Rows(prepare_data.load_rows(str(d / "arith"), "val", meta), meta)
    replies, kinds = {}, []
    for i, row in enumerate(data.rows[:12]):
        text = prepare_data.problem_text(row, meta["prime"])
        prompt, solution = text[:text.index("=") + 1], text[text.index("=") + 1:].rstrip("_")
        answer = solution[-2]
        wrong = meta["chars"][(meta["chars"].index(answer) + 1) % meta["prime"]]
        kind = ["right", "right_skipping_steps", "wrong", "no_end", "garbage"][i % 5]
        replies[prompt] = dict(right=solution, right_skipping_steps=answer + ".", wrong=solution[:-2] + wrong + ".",
                               no_end=solution[:-1], garbage="+=" + answer + "+.")[kind]
        kinds.append(kind)
    acc = train.answer_accuracy(_ScriptedModel(meta, replies), train.Rows(data.rows[:12], meta), nullcontext())
    assert acc == pytest.approx(sum(k.startswith("right") for k in kinds) / 12)  # 5 of 12


def log(flops, val, train_loss=None):
    """Hand-made log records: eval points at the given FLOPs (iter = index)."""
    return [dict(iter=i, tokens=i, flops=f, val_loss=v, train_loss=(train_loss or v) + 0.1)
            for i, (f, v) in enumerate(zip(flops, val))]


def summary_of(seeds, runs):
    """What compare.report makes of {variant: [records of each seed]} (folders named as the variants)."""
    return dict(seeds=seeds, reference=next(iter(runs)), variants=[dict(name=v, dir=v) for v in runs],
                val_loss=compare.summarize(seeds, runs))


def test_compare_summary_crossing():
    base = log([0, 10, 20, 30], [4.0, 3.0, 2.5, 2.0])
    lime = log([0, 11, 22, 33], [4.0, 2.8, 1.9, 1.8])
    s = summary_of([7], {"baseline": [base], "lime": [lime]})
    p = s["val_loss"]["lime"]["per_seed"][0]
    assert s["val_loss"]["baseline"]["per_seed"][0]["val_loss"] == 2.0 and p["val_loss"] == 1.8
    assert p["flops_to_match"] == pytest.approx(11 + 11 * 0.8 / 0.9)  # linear between (11, 2.8), (22, 1.9)
    assert p["ratio"] == pytest.approx((11 + 11 * 0.8 / 0.9) / 30)
    assert ("FLOPs to first reach baseline's final val loss 2.0000, as a multiple of baseline's total FLOPs:\n"
            "  lime      0.69x (2.078e+01 FLOPs)") in "\n".join(compare.format_summary(s))
    never = summary_of([7], {"baseline": [base], "lime": [log([0, 11, 22, 33], [4.0, 3.5, 3.0, 2.5])]})
    assert never["val_loss"]["lime"]["per_seed"][0]["ratio"] is None
    assert never["val_loss"]["lime"]["mean_curve"]["ratio"] is None
    assert "  lime      never" in "\n".join(compare.format_summary(never))


def test_compare_multiseed_aggregation():
    bases = [log([0, 10, 20], [4.0, 3.0, 2.0]), log([0, 10, 20], [4.2, 3.2, 2.4])]
    limes = [log([0, 11, 22], [4.0, 2.0, 1.5]), log([0, 11, 22], [4.2, 3.0, 2.5])]
    flops, mean, lo, hi = compare.mean_band(bases, "val_loss")
    assert list(flops) == [0, 10, 20] and list(mean) == pytest.approx([4.1, 3.1, 2.2])
    assert list(lo) == [4.0, 3.0, 2.0] and list(hi) == [4.2, 3.2, 2.4]
    s = summary_of([1, 2], {"baseline": bases, "lime": limes})
    b, l = s["val_loss"]["baseline"], s["val_loss"]["lime"]
    assert b["mean"] == pytest.approx(2.2)
    assert b["std"] == pytest.approx(np.std([2.0, 2.4], ddof=1))
    assert l["mean"] == pytest.approx(2.0)
    assert l["per_seed"][0]["ratio"] == pytest.approx(11 / 20)  # seed 1: 2.0 reached at the 11 point
    assert l["per_seed"][1]["ratio"] is None  # seed 2: LIMe ends at 2.5 > 2.4
    # mean curves: LIMe mean (4.1, 2.5, 2.0) reaches 2.2 between 11 and 22: 11 + 11 * 0.3 / 0.5
    assert l["mean_curve"]["flops_to_match"] == pytest.approx(11 + 11 * 0.3 / 0.5)
    assert "lime      per seed: 1: 0.55x, 2: never" in "\n".join(compare.format_summary(s))


def test_compare_plot_from_logs(tmp_path):
    cfg = dict(train.PRESETS["cpu"], dataset="x", router_lr=1e-2, seed=1)
    for d, lg in [("baseline", log([0, 10, 20], [4.0, 3.0, 2.0])), ("lime", log([0, 11, 22], [4.0, 2.5, 1.9])),
                  ("baseline_seed2", log([0, 10, 20], [4.1, 3.1, 2.2])),
                  ("lime_seed2", log([0, 11, 22], [4.1, 2.4, 2.0]))]:
        os.makedirs(tmp_path / d)
        with open(tmp_path / d / "log.jsonl", "w") as f:
            f.write(json.dumps({"config": dict(cfg, seed=int(d[-1]) if d[-1].isdigit() else 1)}) + "\n")
            f.writelines(json.dumps(r) + "\n" for r in lg)
    s = compare.main([f"--plot={tmp_path}"])  # a folder as train.py --compare wrote it (no experiment.json)
    assert s["seeds"] == [1, 2]
    with open(tmp_path / "loss_vs_flops.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(tmp_path / "loss_vs_flops.png") > 10_000
    with open(tmp_path / "summary.json") as f:
        assert json.load(f)["val_loss"]["lime"]["per_seed"][1]["seed"] == 2


def write_logs(out, runs, seeds=(1,)):
    """Hand-made comparison folder: {run dir name: records} with a header each; seed from the name."""
    for d, lg in runs.items():
        os.makedirs(os.path.join(out, d), exist_ok=True)
        cfg = dict(train.PRESETS["cpu"], dataset="x", router_lr=1e-2, seed=int(d[-1]) if d[-1].isdigit() else seeds[0])
        with open(os.path.join(out, d, "log.jsonl"), "w") as f:
            f.write(json.dumps({"config": cfg}) + "\n")
            f.writelines(json.dumps(r) + "\n" for r in lg)


def test_compare_plot_compares_like_with_like(tmp_path, capsys):
    write_logs(tmp_path, {"baseline": log([0, 10, 20], [4.0, 3.0, 2.0]), "lime": log([0, 11, 22], [4.0, 2.5, 1.9])})
    assert compare.main([f"--plot={tmp_path}"])["iter"] == 2
    files = lambda: {f: open(tmp_path / f, "rb").read() for f in ("loss_vs_flops.png", "summary.json")}
    good = files()
    with open(tmp_path / "lime" / "log.jsonl") as f:
        lines = f.readlines()
    with open(tmp_path / "lime" / "log.jsonl", "w") as f:  # killed mid-write: its last record half there
        f.writelines(lines[:-1] + [lines[-1][:15]])
    with pytest.raises(ValueError, match=re.escape(
            f"not replacing {tmp_path}/summary.json and loss_vs_flops.png: they compare the runs at iter 2, further "
            f"than the logs now reach (baseline at iter 2, lime at iter 1)")):
        compare.main([f"--plot={tmp_path}"])
    assert files() == good
    os.remove(tmp_path / "summary.json")  # the way to plot them anyway: both at iter 1, not LIMe's 1 vs baseline's 2
    capsys.readouterr()
    s = compare.main([f"--plot={tmp_path}"])
    assert s["iter"] == 1 and s["val_loss"]["baseline"]["per_seed"][0]["val_loss"] == 3.0
    assert s["val_loss"]["lime"]["per_seed"][0]["val_loss"] == 2.5
    assert ("note: the runs end at different iterations (baseline at iter 2, lime at iter 1); comparing them all "
            "at iter 1") in capsys.readouterr().out
    with open(tmp_path / "lime" / "log.jsonl", "w") as f:  # only the initial evaluation left: nothing to compare
        f.writelines(lines[:2])
    with pytest.raises(ValueError, match=re.escape("no evaluation in common past iter 0 yet (baseline at iter 2, "
                                                   "lime at iter 0)")):
        compare.main([f"--plot={tmp_path}"])


def test_compare_plot_while_a_seed_trains(tmp_path, capsys):
    """experiment.json says which variants, folders and seeds make the comparison: --plot takes the seeds every
    variant has a log of (a note names the others), in its order, and leaves out folders it doesn't list."""
    write_logs(tmp_path, {"lime": log([0, 11, 22], [4.0, 2.5, 1.9]), "baseline": log([0, 10, 20], [4.0, 3.0, 2.0]),
                          "baseline_seed2": log([0, 10, 20], [4.1, 3.1, 2.2]),  # lime_seed2 not started yet
                          "lime_seed3": log([0, 10], [9.0, 9.0])})  # of another comparison: not in the plan
    with open(tmp_path / "experiment.json", "w") as f:
        json.dump(dict(variants=[dict(name="lime", dir="lime", flags=dict(lime=True)),
                                 dict(name="baseline", dir="baseline", flags=dict(lime=False))], seeds=[1, 2]), f)
    s = compare.main([f"--plot={tmp_path}"])
    assert s["seeds"] == [1] and s["reference"] == "lime" and list(s["val_loss"]) == ["lime", "baseline"]
    assert s["val_loss"]["baseline"]["per_seed"][0]["ratio"] is None  # (2.0 never reaches LIMe's 1.9)
    assert f"note: no log yet at {tmp_path / 'lime_seed2'}: comparing the seeds every variant has" in capsys.readouterr().out
    with open(tmp_path / "experiment.json", "w") as f:
        f.write('{"variants": [{"name": "lime", "dir": "../lime"}], "seeds": [1]}')
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'experiment.json'} is not a plan written by compare.py")):
        compare.main([f"--plot={tmp_path}"])


@pytest.mark.parametrize("damage, error", [
    ("summary not an object", "summary.json is not a summary written by compare.py; delete it"),
    ("summary of other seeds", "summary.json lists seeds 3, 4, but the runs in T are of seeds 1, 2: it belongs to "
                               "another comparison; delete it"),
    ("header line cut", None),  # plots: the summary says which seed the first runs are
])
def test_compare_plot_damaged_summary_or_header(tmp_path, damage, error):
    write_logs(tmp_path, {d: log([0, 10, 20], [4.0, 3.0, 2.0]) for d in ("baseline", "lime", "baseline_seed2",
                                                                         "lime_seed2")})
    summary = {"summary not an object": [1, 2], "summary of other seeds": dict(seeds=[3, 4]),
               "header line cut": dict(seeds=[1, 2], status="training")}[damage]
    with open(tmp_path / "summary.json", "w") as f:
        json.dump(summary, f)
    if damage == "header line cut":
        with open(tmp_path / "baseline" / "log.jsonl") as f:
            lines = f.readlines()
        with open(tmp_path / "baseline" / "log.jsonl", "w") as f:
            f.writelines([lines[0][:20] + "\n"] + lines[1:])
        assert compare.main([f"--plot={tmp_path}"])["seeds"] == [1, 2]
    else:
        with pytest.raises(ValueError, match=re.escape(error.replace("T", str(tmp_path)))):
            compare.main([f"--plot={tmp_path}"])


@pytest.mark.parametrize("write, old_tmp", [  # each writer, and the fixed temp name it used to write through
    ("ckpt.pt", "ckpt.pt.tmp"), ("log.jsonl", "log.jsonl.tmp"), ("loss_vs_flops.png", "loss_vs_flops.png.tmp.png"),
    ("accuracy_vs_flops.png", "accuracy_vs_flops.png.tmp.png"), ("tinyshakespeare.txt", "tinyshakespeare.txt.tmp")])
def test_train_temp_files_are_unique_and_exclusive(tmp_path, monkeypatch, write, old_tmp):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    d = tmp_path / "out"
    d.mkdir()
    os.symlink(victim, d / old_tmp)  # a link left (or planted) at the old name must not be written through
    if write == "ckpt.pt":
        save_checkpoint(dict(x=torch.zeros(3)), str(d))
    elif write == "log.jsonl":
        train.start_log(str(d / write), {"config": {}})
    elif write in ("loss_vs_flops.png", "accuracy_vs_flops.png"):
        runs = {"baseline": [log([0, 10, 20], [4.0, 3.0, 2.0])], "lime": [log([0, 11, 22], [4.0, 2.5, 1.9])]}
        for recs in runs.values():
            for r in recs[0]:
                r["accuracy"] = 1 / r["val_loss"]
        s = dict(summary_of([1], runs), accuracy=compare.summarize([1], runs, "accuracy"))
        compare.plot_compare(str(d / write), runs, s, key=write.split("_")[0].replace("loss", "val_loss"))
    else:
        monkeypatch.setattr(prepare_data, "download", lambda url, timeout=5: DATA_TEXT)
        prepare_data.quickstart_text(str(d))
    assert victim.read_text() == "precious" and os.path.getsize(d / write) > 0
    assert sorted(os.listdir(d)) == sorted([write, old_tmp])  # no temp file left behind
    with pytest.raises(ZeroDivisionError), prepare_data.atomic_file(str(d / write)) as f:
        f.write("half")
        1 / 0
    assert os.path.getsize(d / write) > 4  # a failed write keeps the old file, and leaves no temp file
    assert sorted(os.listdir(d)) == sorted([write, old_tmp])


def test_train_bad_input(tiny_data, tmp_path):
    with pytest.raises(FileNotFoundError, match="python prepare_data.py --input=YOUR_TEXT.txt --name=nope"):
        train.main(tiny_data("--dataset=nope", f"--out_dir={tmp_path / 'o'}"))
    with pytest.raises(ValueError, match="block_size=4096 is too large"):
        train.main(tiny_data("--block_size=4096", f"--out_dir={tmp_path / 'o'}"))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train.main(tiny_data("--resume=True", f"--out_dir={tmp_path / 'o'}"))
    train.main(tiny_data("--max_iters=2", f"--out_dir={tmp_path / 'o'}"))
    with pytest.raises(ValueError, match="n_layer differs"):
        train.main(tiny_data("--resume=True", "--n_layer=3", f"--out_dir={tmp_path / 'o'}"))
    with pytest.raises(ValueError, match="lime differs"):
        train.main(tiny_data("--resume=True", "--lime=True", f"--out_dir={tmp_path / 'o'}"))
    with pytest.raises(ValueError, match="--lime"):
        train.main(tiny_data("--lime=maybe"))
    prepare_data.prepare(TRAIN_TEXT * 2, str(tmp_path / "data" / "tiny_data"))  # same characters, other text
    with pytest.raises(ValueError, match=r"tiny_data is no longer the dataset .*ckpt.pt was trained on \(n_chars: "):
        train.main(tiny_data("--resume=True", f"--out_dir={tmp_path / 'o'}", "--max_iters=4"))


BAD_FLOAT_FLAGS = [("grad_clip", "nan"), ("min_lr", "nan"), ("weight_decay", "inf"), ("learning_rate", "nan"),
                   ("router_lr", "-inf"), ("dropout", "nan"), ("beta2", "nan")]


@pytest.mark.parametrize("flag, match", [
    ("--learning_rate=-1", "--learning_rate must be > 0, got -1.0"),  # blamed --min_lr (derived from it)
    ("--seed=-1", "--seed must be at least 0, got -1"),              # wrote a log first, then numpy's words
    ("--device=foo", "unknown --device=foo; use auto, cpu, cuda, cuda:N or mps"),
    ("--lime_kv=kq", "--lime_kv must be one of kv, k, v, got 'kq'"),
    ("--lime_sources=last", "--lime_sources must be one of all, first, previous, got 'last'"),
    ("--lime_sources=first", "--lime_sources=first changes LIMe's mix: add --lime=True"),  # a baseline, silently
] + [(f"--{k}={v}", f"--{k} must be a finite number, got {v}") for k, v in BAD_FLOAT_FLAGS])
def test_train_bad_flag_named_before_anything_is_written(tiny_data, tmp_path, flag, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        train.main(tiny_data(flag, "--max_iters=2", f"--out_dir={tmp_path / 'o'}"))
    assert not (tmp_path / "o").exists()


def test_train_refuses_to_replace_a_run(tiny_data, tmp_path):
    out = str(tmp_path / "o")
    train.main(tiny_data("--max_iters=4", f"--out_dir={out}"))
    files = lambda: {f: open(os.path.join(out, f), "rb").read() for f in ("ckpt.pt", "log.jsonl")}
    before = files()
    with pytest.raises(ValueError, match=re.escape(f"{out} already holds a run (ckpt.pt, log.jsonl); continue it "
                                                   f"with --resume=True, or train into a new --out_dir")):
        train.main(tiny_data("--max_iters=4", f"--out_dir={out}", "--lime=True"))
    assert files() == before
    # a run stopped before its first checkpoint: --resume can't continue it, and says how to start over
    os.remove(os.path.join(out, "ckpt.pt"))
    with pytest.raises(FileNotFoundError, match=f"stopped before its first checkpoint: to start over, delete {out}"):
        train.main(tiny_data("--resume=True", f"--out_dir={out}"))


@pytest.mark.parametrize("where, match", [
    ("file", "--out_dir=F is a file, not a folder"),
    ("under a file", r"can't write to --out_dir=F/run \(Not a directory\)"),
    ("read-only", r"can't write to --out_dir=D \(Permission denied\)"),
])
def test_train_unusable_out_dir(tiny_data, tmp_path, monkeypatch, where, match):
    f, d = tmp_path / "f", tmp_path / "d"
    f.write_text("not a folder")
    out = {"file": f, "under a file": f / "run", "read-only": d}[where]
    if where == "read-only":  # as a normal user finds it (tests may run as root, who can write anywhere)
        d.mkdir()
        def refuse(*a, dir=None, **k):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(common.tempfile, "TemporaryFile", refuse)
    with pytest.raises(ValueError, match=match.replace("F", re.escape(str(f))).replace("D", re.escape(str(d)))):
        train.main(tiny_data("--max_iters=2", f"--out_dir={out}"))
    assert sorted(os.listdir(tmp_path)) == (["d", "data", "f"] if where == "read-only" else ["data", "f"])
    assert f.read_text() == "not a folder" and (not d.exists() or os.listdir(d) == [])


BAD_CHECKPOINTS = [  # kind, what the error says (besides the file's path)
    ("truncated", "torch.load can't read it"), ("empty", "torch.load can't read it"),
    ("text", "torch.load can't read it"), ("foreign", "it has no 'model_args'"),
    ("missing keys", "it has no 'model_args'"), ("folder", "it is a folder"),
    ("wrong weights", "its weights don't fit its model_args")]


def damage_checkpoint(path, kind):
    """Replace the good checkpoint at path by a bad one of the given kind."""
    good = open(path, "rb").read()
    ckpt = torch.load(path, weights_only=True)
    os.remove(path)
    if kind == "folder":
        os.makedirs(path)
    elif kind in ("foreign", "missing keys", "wrong weights"):
        ckpt["model"].pop("transformer.wte.weight")
        torch.save({"foreign": [1, 2, 3], "missing keys": {k: v for k, v in ckpt.items() if k != "model_args"},
                    "wrong weights": ckpt}[kind], path)
    else:
        with open(path, "wb") as f:
            f.write({"truncated": good[:len(good) // 2], "empty": b"", "text": b"hello"}[kind])


def test_train_resume_from_bad_checkpoint(tiny_data, tmp_path):
    train.main(tiny_data("--max_iters=4", f"--out_dir={tmp_path / 'good'}"))
    for kind, match in BAD_CHECKPOINTS:
        out = tmp_path / kind.replace(" ", "_")
        shutil.copytree(tmp_path / "good", out)
        damage_checkpoint(str(out / "ckpt.pt"), kind)
        with pytest.raises(ValueError, match=re.escape(f"{out / 'ckpt.pt'}") + ".*" + re.escape(match)):
            train.main(tiny_data("--resume=True", "--max_iters=8", f"--out_dir={out}"))


def test_train_nan_loss_keeps_last_good_checkpoint(tiny_data, tmp_path, monkeypatch):
    forward, calls = GPT.forward, [0]

    def nan_after_6_steps(self, idx, targets=None, cache=None):
        logits, loss = forward(self, idx, targets, cache)
        if self.training:
            calls[0] += 1
            if calls[0] > 6:  # training steps 0..5 are fine, step 6 is NaN
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", nan_after_6_steps)
    out = str(tmp_path / "nan")
    # steps 1..6 of the log are fine, step 7 is the first NaN: counted from 1, as the log counts
    with pytest.raises(train.NonFiniteLoss, match="training loss is nan at iteration 7.*iter 4"):
        train.main(tiny_data("--max_iters=10", f"--out_dir={out}"))
    assert records(out)[-1]["iter"] == 6 and math.isfinite(records(out)[-1]["train_loss"])
    assert issubclass(train.NonFiniteLoss, ValueError)  # so __main__ prints one line and exits 1
    _, ckpt = common.load_checkpoint(out)
    assert ckpt["iter_num"] == 4 and all(torch.isfinite(t).all() for t in ckpt["model"].values())


def test_train_cli_error_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), f"--data_dir={tmp_path}", "--dataset=nope"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no dataset at") and "prepare_data.py" in lines[0]


def test_train_progress_reaches_a_pipe_while_running(tiny_data, tmp_path):
    """`python train.py ... > log` then `tail -f log`: stdout is line-buffered, so the header line is
    readable while the run is still going (block-buffered, it would arrive only at exit)."""
    err = open(tmp_path / "stderr", "w")  # (a file, not a pipe nobody reads; shown if the run fails)
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), *tiny_data(
        "--max_iters=400", "--eval_interval=400", "--log_interval=400", f"--out_dir={tmp_path / 'o'}")],
        stdout=subprocess.PIPE, stderr=err, text=True, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})  # (as a user's shell has it)
    try:
        first = p.stdout.readline()
        assert first.startswith("baseline: "), (tmp_path / "stderr").read_text()
        assert not os.path.exists(tmp_path / "o" / "ckpt.pt")  # (saved at iteration 400, the end)
    finally:
        p.kill()
        p.wait()
        err.close()


def test_compare_cli_os_error_is_one_line(tmp_path):
    write_logs(tmp_path, {"baseline": log([0, 10], [4.0, 3.0]), "lime": log([0, 11], [4.0, 2.9])})
    os.makedirs(tmp_path / "summary.json")  # any OSError (here: reading a folder) used to escape __main__
    r = subprocess.run([sys.executable, os.path.join(HERE, "compare.py"), f"--plot={tmp_path}"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: ") and f"Is a directory: '{tmp_path}/summary.json'" in r.stderr


def test_compare_two_seeds(tiny_data, tmp_path, monkeypatch):
    analyzed = []
    monkeypatch.setattr(compare, "run_analyze", lambda out_dir, device="auto": analyzed.append(out_dir))
    out = str(tmp_path / "cmp")
    s = compare.main(tiny_data("--seeds=2", "--max_iters=4", f"--out_dir={out}", "--seed=5"))
    assert sorted(os.listdir(out)) == ["baseline", "baseline_seed6", "experiment.json", "lime", "lime_seed6",
                                       "loss_vs_flops.png", "summary.json"]
    assert s["seeds"] == [5, 6] and [p["seed"] for p in s["val_loss"]["lime"]["per_seed"]] == [5, 6]
    assert analyzed == [out]
    for d, lime, seed in [("baseline", False, 5), ("lime", True, 5),
                          ("baseline_seed6", False, 6), ("lime_seed6", True, 6)]:
        _, ckpt = common.load_checkpoint(os.path.join(out, d))
        assert ckpt["config"]["lime"] == lime and ckpt["config"]["seed"] == seed and ckpt["iter_num"] == 4
    before = open(os.path.join(out, "lime", "log.jsonl")).read()
    summary = open(os.path.join(out, "summary.json")).read()
    with pytest.raises(ValueError, match=re.escape(f"{out} already holds a comparison (summary.json, loss_vs_flops"
                                                   f".png, baseline, lime, baseline_seed6, lime_seed6); continue it "
                                                   f"with --resume=True, or use a new --out_dir")):
        compare.main(tiny_data("--seeds=2", "--max_iters=4", f"--out_dir={out}", "--seed=5"))
    assert open(os.path.join(out, "summary.json")).read() == summary
    os.remove(os.path.join(out, "lime_seed6", "ckpt.pt"))  # as if killed before its first checkpoint: starts over
    losses = [r["train_loss"] for r in records(os.path.join(out, "lime_seed6"))[1:]]
    compare.main(tiny_data("--seeds=2", "--max_iters=4", f"--out_dir={out}", "--seed=5", "--resume"))
    assert open(os.path.join(out, "lime", "log.jsonl")).read().split("\n")[1:] == before.split("\n")[1:]
    assert [r["train_loss"] for r in records(os.path.join(out, "lime_seed6"))[1:]] == pytest.approx(losses)
    assert os.path.exists(os.path.join(out, "lime_seed6", "ckpt.pt"))


def test_compare_depth_sweep(tiny_data, tmp_path, monkeypatch, capsys):
    """--depths: a comparison per depth in OUT/depthL, resumable when half finished (finished depths kept
    as they are), and sweep.json's numbers are those of the runs' logs."""
    monkeypatch.setattr(compare, "run_analyze", lambda out_dir, device="auto": None)
    out = str(tmp_path / "sweep")
    flags = tiny_data("--max_iters=4", f"--out_dir={out}")
    compare.main(flags + ["--depths=1"])                                 # half of the sweep
    log1 = open(os.path.join(out, "depth1", "lime", "log.jsonl")).read()
    with pytest.raises(ValueError, match="already holds a comparison"):  # not without --resume
        compare.main(flags + ["--depths=1,2"])
    assert sorted(os.listdir(out)) == ["depth1", "loss_vs_depth.png", "sweep.json"]  # (nothing written)
    s = compare.main(flags + ["--depths=2,1", "--resume=True"])         # the rest
    assert sorted(os.listdir(out)) == ["depth1", "depth2", "loss_vs_depth.png", "sweep.json"]
    assert open(os.path.join(out, "depth1", "lime", "log.jsonl")).read().split("\n")[1:] == log1.split("\n")[1:]
    assert s["depths"] == [1, 2] and json.load(open(os.path.join(out, "sweep.json"))) == s
    for row in s["per_depth"]:
        for v in ("baseline", "lime"):
            d = os.path.join(out, f"depth{row['n_layer']}", v)
            last = [r for r in records(d) if "val_loss" in r][-1]
            assert row["variants"][v]["val_loss"] == [last["val_loss"]] and row["variants"][v]["flops"] == last["flops"]
            assert common.load_checkpoint(d)[0].config.n_layer == row["n_layer"]
    assert s["per_depth"][1]["variants"]["baseline"]["flops"] > s["per_depth"][0]["variants"]["baseline"]["flops"]
    printed = capsys.readouterr().out
    assert "lime at 1 layers" in printed and "of baseline at 2 layers" in printed
    assert compare.main([f"--plot={out}"]) == s                          # redrawn from the logs alone
    with pytest.raises(ValueError, match="--depths=4,x is not"):
        compare.main(flags + ["--depths=4,x"])


def torchrun(script, *args, nproc=2):
    """`python -m torch.distributed.run --standalone --nproc_per_node=nproc script args`: CPU, gloo, offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           script, *args], capture_output=True, text=True, env=env, timeout=300)


RANK0_FAILS = """# compare.py, except that rank 0 can't write lime_seed6's iter-6 checkpoint
import os, sys
sys.path.insert(0, {here!r})
import compare, train

def save_checkpoint(ckpt, out_dir):
    if out_dir.endswith("lime_seed6") and ckpt["iter_num"] == 6:
        raise OSError("injected: no space left on device")
    save(ckpt, out_dir)

if os.environ["RANK"] == "0":
    save, train.save_checkpoint = train.save_checkpoint, save_checkpoint
compare.main(sys.argv[1:])
"""


def test_compare_ddp_two_processes_match_one(tiny_data, tmp_path):
    """`compare.py --seeds=2` on 2 processes. Each step is 4 micro-batches (2 per rank: no_sync and the reused LIMe
    gradient buffer at work), dropout on (its masks are seeded per micro-batch).
    1st launch: rank 0 fails to write the last run's last checkpoint while rank 1 waits for it: the job must
    end with rank 0's error, not hang. 2nd launch: --resume (that run continues from its iter-4 checkpoint).
    Every run must log the same losses and end with the same weights as 1 process with the same global batch.
    Tolerance: the all-reduce adds the ranks' gradients in another order than one process accumulates them, a
    few float32 ulps (~1e-7 relative) that Adam carries into the weights; 1e-5 leaves ~100x room (seen ~1e-7)."""
    flags = tiny_data("--gradient_accumulation_steps=4", "--dropout=0.1", "--max_iters=6", "--seeds=2",
                      "--seed=5", f"--out_dir={tmp_path / 'two'}")
    (tmp_path / "rank0_fails.py").write_text(RANK0_FAILS.format(here=HERE))
    r = torchrun(str(tmp_path / "rank0_fails.py"), *flags)
    assert r.returncode != 0 and "injected: no space left on device" in r.stderr, r.stderr
    r = torchrun(os.path.join(HERE, "compare.py"), *flags, "--resume=True")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert r.stdout.count("resuming at iter 4") == 1 and r.stdout.count("nothing to do") == 3  # rank 1 prints nothing
    assert "per seed: 5: " in r.stdout and os.path.exists(tmp_path / "two" / "loss_vs_flops.png")
    for d, lime, seed in [("baseline", False, 5), ("lime", True, 5), ("baseline_seed6", False, 6),
                          ("lime_seed6", True, 6)]:
        one, two = str(tmp_path / "one" / d), str(tmp_path / "two" / d)
        train.main(tiny_data("--gradient_accumulation_steps=4", "--dropout=0.1", "--max_iters=6", f"--lime={lime}",
                             f"--seed={seed}", f"--out_dir={one}"))
        assert sorted(os.listdir(two)) == ["ckpt.pt", "log.jsonl"]
        a, b = records(one), records(two)
        assert [r["iter"] for r in b] == [0, 2, 4, 6]  # one writer: every record once
        for ra, rb in zip(a, b):
            assert (ra["tokens"], ra["flops"], ra["lr"]) == (rb["tokens"], rb["flops"], rb["lr"])  # global
            for k in ("train_loss", "val_loss"):
                assert (k in ra) == (k in rb) and abs(ra.get(k, 0) - rb.get(k, 0)) <= 1e-5, (ra, rb)
        (_, ca), (_, cb) = common.load_checkpoint(one), common.load_checkpoint(two)
        assert cb["iter_num"] == 6 and cb["config"]["lime"] == lime and cb["config"]["seed"] == seed
        assert max((ca["model"][k] - cb["model"][k]).abs().max().item() for k in ca["model"]) <= 1e-5
        assert train.read_log(os.path.join(two, "log.jsonl"), header=True)["world_size"] == 2


def test_train_ddp_batch_must_split_evenly(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "ddp_rank_world", lambda: (0, 2))  # as if under torchrun with 2 processes
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3 is not divisible by the 2 processes"):
        train.main(tiny_data("--gradient_accumulation_steps=3", f"--out_dir={tmp_path / 'o'}"))


def test_compare_task_end_to_end(task_data, tmp_path, monkeypatch, capsys):
    d, meta = task_data
    analyzed = []
    monkeypatch.setattr(compare, "run_analyze", lambda out_dir, device="auto": analyzed.append(out_dir))
    out = str(tmp_path / "cmp")
    s = compare.main([f"--data_dir={d}", "--dataset=arith", "--preset=arithmetic", "--seeds=2",
                      "--max_iters=4", "--eval_interval=2", "--log_interval=2", "--batch_size=8", "--eval_iters=2",
                      "--warmup_iters=1", "--device=cpu", f"--out_dir={out}"])
    assert sorted(os.listdir(out)) == ["accuracy_vs_flops.png", "baseline", "baseline_seed1338", "experiment.json",
                                       "lime", "lime_seed1338", "loss_vs_flops.png", "summary.json"]
    assert analyzed == [out]
    T = meta["row_length"] - 1
    for v in ("baseline", "lime"):
        model, ckpt = common.load_checkpoint(os.path.join(out, v))
        assert ckpt["config"]["block_size"] == T and ckpt["model_args"]["n_embd"] == 32  # the preset's shape
        recs = records(os.path.join(out, v))
        evals = [r for r in recs if "val_loss" in r]
        assert [r["iter"] for r in evals] == [0, 2, 4] and all(0 <= r["accuracy"] <= 1 for r in evals)
        assert all(r["flops"] == 3 * model.flops_per_token(T) * r["iter"] * 8 * T for r in recs)  # padding counted
        test = compare.read_test_accuracy(os.path.join(out, v, "log.jsonl"))
        assert test["test_problems"] == 20 and test["at_iter"] == 4 and 0 <= test["test_accuracy"] <= 1
    a = s["accuracy"]["lime"]
    assert [p["seed"] for p in a["per_seed"]] == [1337, 1338]
    assert a["test_accuracy_mean"] == pytest.approx(np.mean([p["test_accuracy"] for p in a["per_seed"]]))
    printed = capsys.readouterr().out
    assert "accuracy (greedy, final answer correct)" in printed and "test accuracy" in printed
    with pytest.raises(ValueError, match="rows of .* drop --block_size"):
        train.main([f"--data_dir={d}", "--dataset=arith", "--preset=arithmetic", "--block_size=16", "--max_iters=1",
                    f"--out_dir={tmp_path / 'x'}", "--device=cpu"])
    _, ckpt = common.load_checkpoint(os.path.join(out, "lime"))
    with pytest.raises(analyze.CantProbe, match="a task of problems, not text"):  # separability: a note, no counts
        analyze.val_text(ckpt)


def test_compare_three_variants_with_an_override(tiny_data, tmp_path, capsys):
    """A variant with overrides trains with them, in its own folder, fairly (same init, data and eval batches as
    the variant it derives from), shows in the summary, the figure and the analyses (every LIMe variant gets its
    router maps), and is redrawn by --plot from the logs alone."""
    out = tmp_path / "cmp"
    name, folder = "lime:router_lr=0.005,weight_decay=0.0", "lime_router_lr=0.005_weight_decay=0.0"
    s = compare.main(tiny_data("--max_iters=2", "--eval_interval=2", "--log_interval=1", f"--out_dir={out}",
                               "--variants=baseline,lime,lime:router_lr=5e-3,weight_decay=0"))
    assert s["reference"] == "baseline" and list(s["val_loss"]) == ["baseline", "lime", name]
    assert s["variants"][2] == dict(name=name, dir=folder)
    assert json.load(open(out / "experiment.json"))["variants"][2] == dict(
        name=name, dir=folder, flags=dict(lime=True, router_lr=5e-3, weight_decay=0.0))
    for d, router_lr, weight_decay in [("lime", 1e-2, 0.1), (folder, 5e-3, 0.0)]:
        _, ckpt = common.load_checkpoint(str(out / d))
        assert ckpt["config"]["lime"] and ckpt["config"]["router_lr"] == router_lr
        assert ckpt["config"]["weight_decay"] == weight_decay
    a, b, base = records(out / "lime"), records(out / folder), records(out / "baseline")
    assert a[0]["val_loss"] == b[0]["val_loss"] != base[0]["val_loss"]  # same init and eval batches (routers aside)
    assert a[1]["train_loss"] == b[1]["train_loss"]  # step 0: same init, same batch, before any update
    assert a[2]["val_loss"] != b[2]["val_loss"]  # then the overrides act
    printed = capsys.readouterr().out
    assert f"  {name}  " in printed and f"(folder {folder})" in printed
    analysis = json.load(open(out / "analysis.json"))
    assert list(analysis["routers"]) == ["lime", name] and list(analysis["value_entropy"]["mean"]) == list(s["val_loss"])
    for png in ["loss_vs_flops.png", "router_map.png", f"router_map_{folder}.png", f"router_heads_{folder}.png"]:
        with open(out / png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert compare.main([f"--plot={out}"]) == s


def test_compare_named_variants_build_their_models():
    """Each name of compare.py's table builds the model (and optimiser setting) it stands for: the paper's other
    baseline (hc, hc-static) and the LIMe ablations (lime-k, lime-v, lime-first, lime-previous, lime-frozen)."""
    expect = {"baseline": {}, "lime": dict(lime=True), "hc": dict(hc_rate=4), "hc-static": dict(hc_rate=4, hc_dynamic=False),
              "lime-k": dict(lime=True, lime_kv="k"), "lime-v": dict(lime=True, lime_kv="v"),
              "lime-first": dict(lime=True, lime_sources="first"),
              "lime-previous": dict(lime=True, lime_sources="previous"), "lime-frozen": dict(lime=True)}
    assert list(compare.VARIANTS) == list(expect)
    paper = dict(lime=False, lime_kv="kv", lime_sources="all", hc_rate=0, hc_dynamic=True)
    for v in compare.parse_variants(",".join(expect)):
        flags = {k: v.flags.get(k, default) for k, default in paper.items()}
        assert flags == {**paper, **expect[v.name]}, v.name
        assert v.flags.get("router_lr", 1e-2) == (0.0 if v.name == "lime-frozen" else 1e-2)
        GPT(tiny_config(flags.pop("lime"), **flags))  # a valid model


def test_compare_variants_parse():
    vs = compare.parse_variants("baseline,lime,lime:router_lr=1e-3,weight_decay=0,lime:n_embd=64:dropout=0.1")
    assert [(v.name, v.dir) for v in vs] == [
        ("baseline", "baseline"), ("lime", "lime"),
        ("lime:router_lr=0.001,weight_decay=0.0", "lime_router_lr=0.001_weight_decay=0.0"),
        ("lime:dropout=0.1,n_embd=64", "lime_dropout=0.1_n_embd=64")]
    assert vs[0].flags == {"lime": False} and vs[1].flags == {"lime": True}
    assert vs[2].flags == {"lime": True, "router_lr": 1e-3, "weight_decay": 0.0}
    assert vs[3].flags == {"lime": True, "n_embd": 64, "dropout": 0.1}
    assert compare.parse_variants("baseline:lime=yes")[0].flags == {"lime": True}  # an override wins over the table
    assert compare.VARIANT_FLAGS == ["beta1", "beta2", "dropout", "fused_mix", "grad_clip", "hc_dynamic", "hc_rate",
                                     "learning_rate", "lime", "lime_kv", "lime_sources", "n_embd", "n_head", "n_layer",
                                     "router_lr", "weight_decay"]
    for name, flags in compare.VARIANTS.items():  # the table sets only what a variant may set
        assert set(flags) <= set(compare.VARIANT_FLAGS) and re.fullmatch(r"[\w-]+", name)


@pytest.mark.parametrize("variants, match", [
    ("baseline,limes", "unknown variant 'limes'; known: baseline, lime"),
    ("baseline,lime:router_lr", "'router_lr' is not key=value"),
    ("baseline,lime:router_lr=", "'router_lr=' is not key=value"),
    ("baseline,lime:", "'' is not key=value"),
    ("baseline,lime:router_lr=fast", "router_lr takes a number, got 'fast'"),
    ("baseline,lime:lime=maybe", "lime takes True or False, got 'maybe'"),
    ("baseline,lime:n_layer=2.5", "n_layer takes an integer, got '2.5'"),
    ("baseline,lime:out_dir=x", "--out_dir is not a model or optimiser flag; a variant may set only beta1, beta2, "),
    ("baseline,lime:max_iters=10", "--max_iters is not a model or optimiser flag"),
    ("baseline,lime:colour=red", "'colour' is not a model or optimiser flag"),
    ("baseline,router_lr=1e-3", "unknown variant 'router_lr=1e-3'; overrides follow a variant's name and ':'"),
    ("lime:router_lr=1e-3,router_lr=2e-3", "router_lr is set twice"),
    ("baseline,lime,baseline", "baseline and baseline would share the folder baseline; list each variant once"),
    ("lime:router_lr=1e-3,lime:router_lr=0.001", "lime:router_lr=0.001 and lime:router_lr=0.001 would share the "
                                                 "folder lime_router_lr=0.001"),
    ("baseline,lime:router_lr=-1", "variant lime:router_lr=-1.0: --router_lr must be at least 0, got -1.0"),
])
def test_compare_bad_variants(tiny_data, tmp_path, variants, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        compare.main(tiny_data(f"--variants={variants}", f"--out_dir={tmp_path / 'o'}"))
    assert not (tmp_path / "o").exists()


def test_compare_cli_bad_variant_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(HERE, "compare.py"), "--variants=baseline,lime:out_dir=x"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: --variants=baseline,lime:out_dir=x: lime:out_dir=x: --out_dir is not a model")
    assert os.listdir(tmp_path) == []  # (not even out-compare/)


def test_compare_refuses_runs_made_with_other_settings(tiny_data, tmp_path, monkeypatch):
    """--resume on a folder whose runs were made with other settings than the variants now listed: an error
    naming the run and the setting, and nothing written or deleted (not even a log to start over)."""
    monkeypatch.setattr(compare, "run_analyze", lambda out_dir, device="auto": None)
    out = tmp_path / "cmp"
    compare.main(tiny_data("--max_iters=2", f"--out_dir={out}", "--variants=baseline"))
    os.makedirs(out / "lime")  # a baseline's log in lime/, as if renamed, stopped before its first checkpoint
    shutil.copy(out / "baseline" / "log.jsonl", out / "lime" / "log.jsonl")
    files = lambda: {str(p): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    before = files()
    for flags, match in [(["--variants=baseline,lime"], f"{out / 'lime'} holds a run with other settings than lime, "
                                                        f"seed 1337 (lime=False there, True now)"),
                         (["--variants=baseline", "--n_embd=16"], "seed 1337 (n_embd=32 there, 16 now)"),
                         (["--variants=baseline", "--seed=3"], "seed 3 (seed=1337 there, 3 now)")]:
        with pytest.raises(ValueError, match=re.escape(match)):
            compare.main(tiny_data("--max_iters=4", f"--out_dir={out}", "--resume=True", *flags))
        assert files() == before


def test_train_compare_flags_moved_to_compare_py(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--compare", "--seeds=2", "--out_dir=x y"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 1 and r.stdout == "" and os.listdir(tmp_path) == []
    assert r.stderr == ("error: --compare is compare.py's now (train.py trains one model); run: python compare.py "
                        "--seeds=2 '--out_dir=x y'\n")
    for argv, then in [(["--plot", "out-compare"], "python compare.py --plot out-compare"),
                       (["--depths=4,8", "--preset=deep"], "python compare.py --depths=4,8 --preset=deep"),
                       (["--analyze=o"], "python compare.py --analyze=o"), (["--variants=lime"], "--variants=lime")]:
        with pytest.raises(ValueError, match=re.escape(f"{argv[0].split('=')[0]} is compare.py's now") + ".*"
                           + re.escape(then)):
            train.main(argv)


# ----------------------------------------------------------------------------- issue 26: train.py / compare.py

@pytest.mark.parametrize("script, flag", [("train", "--out_dir="), ("train", "--dataset="), ("compare", "--out_dir="),
                                          ("compare", "--plot="), ("compare", "--analyze="), ("compare", "--depths=")])
def test_empty_flag_value_refused(tiny_data, tmp_path, monkeypatch, script, flag):
    """--out_dir= used to train into the current folder, --plot '' / --analyze '' to train, --depths= to not sweep."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"{flag[:-1]} is empty; give it a value (see python {script}.py")):
        {"train": train, "compare": compare}[script].main(tiny_data("--max_iters=2", flag))
    assert sorted(os.listdir(tmp_path)) == ["data"]


REFUSALS = [
    (["--n_embd=30", "--n_head=4"], "n_embd=30 is not divisible by n_head=4"),  # after out_dir was made
    (["--beta1=1.5"], "need 0 <= --beta1 < 1, got 1.5"),                       # was torch's "beta parameter at index 0"
    (["--beta2=-0.1"], "need 0 <= --beta2 < 1, got -0.1"),
    (["--n_embd=400000"], "training it needs at least"),                        # was an allocator traceback
    ([f"--seed={2**64}"], "--seed must be below 2**63"),                        # was "Overflow when unpacking long long"
    (["--dataset=nope"], "no dataset at"),                                      # compare.py: after experiment.json
]


@pytest.mark.parametrize("script, flags, match", [(s, f, m) for s in ("train", "compare") for f, m in REFUSALS
                                                  if s == "compare" or f != ["--dataset=nope"]])  # (train.py: done)
def test_config_refusal_writes_nothing(tiny_data, tmp_path, script, flags, match):
    out = tmp_path / "o"
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(match)):
        {"train": train, "compare": compare}[script].main(tiny_data("--max_iters=2", f"--out_dir={out}", *flags))
    assert not out.exists()


def test_compare_resume_with_nothing_to_resume_refused(tiny_data, tmp_path):
    out = tmp_path / "c"
    with pytest.raises(FileNotFoundError, match=re.escape(f"--resume: nothing to resume in {out} (none of its runs "
                                                          f"has a checkpoint or a log); drop --resume")):
        compare.main(tiny_data("--max_iters=2", f"--out_dir={out}", "--resume=True"))
    assert not out.exists()


@pytest.mark.parametrize("flags, match", [
    (["--plot=X", "--analyze=X"], "--plot and --analyze are two jobs: give one, then run the other"),
    (["--plot=X", "--lime=True"], "--plot uses no other flag: drop --lime"),
    (["--plot=X", "--preset=deep"], "--plot uses no other flag: drop --preset"),
    (["--analyze=X", "--seeds=3", "--device=cpu"], "--analyze uses only --device: drop --seeds (analyze.py's options"),
])
def test_compare_plot_and_analyze_refuse_flags_they_ignore(tmp_path, flags, match):
    write_logs(tmp_path, {"baseline": log([0, 10], [4.0, 3.0]), "lime": log([0, 11], [4.0, 2.9])})
    with pytest.raises(ValueError, match=re.escape(match)):
        compare.main([f.replace("X", str(tmp_path)) for f in flags])
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("what", ["run folder", "file"])
def test_compare_plot_on_a_run_folder_or_file(tmp_path, what):
    write_logs(tmp_path, {"run": log([0, 10], [4.0, 3.0])})
    target = tmp_path / "run" / ("log.jsonl" if what == "file" else "")
    with pytest.raises(ValueError, match=re.escape(f"{str(target).rstrip('/')} is " + (
            "a file" if what == "file" else "a single run's folder (train.py)") + ", not a comparison folder")):
        compare.main([f"--plot={target}"])
    assert os.listdir(tmp_path / "run") == ["log.jsonl"]


@pytest.mark.parametrize("plan", [True, False])  # with experiment.json, and a folder of train.py --compare
def test_compare_plot_keeps_the_summary_when_a_seed_is_gone(tmp_path, plan):
    write_logs(tmp_path, {d: log([0, 10, 20], [4.0, 3.0, 2.0]) for d in ("baseline", "lime", "baseline_seed2",
                                                                         "lime_seed2")})
    if plan:
        with open(tmp_path / "experiment.json", "w") as f:
            json.dump(dict(variants=[dict(name=v, dir=v, flags={}) for v in ("baseline", "lime")], seeds=[1, 2]), f)
    assert compare.main([f"--plot={tmp_path}"])["seeds"] == [1, 2]
    before = (tmp_path / "summary.json").read_bytes()
    shutil.rmtree(tmp_path / "baseline_seed2")
    shutil.rmtree(tmp_path / "lime_seed2")
    with pytest.raises(ValueError, match=re.escape(f"not replacing {tmp_path}/summary.json and its figures: they "
                                                   f"compare seeds 1, 2, but seed 2 has no logs here now")):
        compare.main([f"--plot={tmp_path}"])
    assert (tmp_path / "summary.json").read_bytes() == before


def test_compare_no_reach_claim_when_the_reference_never_improves(tmp_path, capsys):
    """Both variants at 0% accuracy: no "reaches it at 0.00x"; the real number of val problems is stated."""
    runs = {"baseline": log([0, 10, 20], [4.0, 3.0, 2.0]), "lime": log([0, 11, 22], [4.0, 2.0, 1.5])}
    for recs in runs.values():
        for r in recs:
            r["accuracy"] = 0.0
    write_logs(tmp_path, runs)
    for d in runs:  # the header says how many val problems the accuracy is measured on
        lines = (tmp_path / d / "log.jsonl").read_text().splitlines()
        head = dict(json.loads(lines[0]), val_problems=100)
        (tmp_path / d / "log.jsonl").write_text("\n".join([json.dumps(head)] + lines[1:]) + "\n")
    s = compare.main([f"--plot={tmp_path}"])
    assert s["accuracy"]["lime"]["mean_curve"]["ratio"] is None and s["val_problems"] == 100
    out = capsys.readouterr().out
    assert "baseline's final val accuracy 0.0% is no better than at the start: no FLOPs to reach it" in out
    assert "0.00x" not in out and "val = the first 100 val problems" in out and "500 val" not in out
    assert "lime      0.55x" in out  # (the val loss does improve: its claim stays)


RESUME_DAMAGE = [  # what is done to log.jsonl before --resume, and the note (or refusal) it gets
    ("deleted", "L is missing: the records of iters 0..4 are lost; the log goes on from iter 4"),
    ("emptied", "L is empty: the records of iters 0..4 are lost; the log goes on from iter 4"),
    ("cut mid-line", "L ends at iter 0, the checkpoint at iter 4: the records in between are lost"),
    ("garbage lines", "dropped 2 line(s) of L that are not log records"),
    ("another run's", "can't resume: L is another run's log (lime=True there, False here)"),
    ("another run's records", "can't resume: L is another run's log (its records count"),
]


def test_train_resume_says_what_the_log_lacks(tiny_data, tmp_path, capsys):
    good, other = str(tmp_path / "good"), str(tmp_path / "lime")
    train.main(tiny_data("--max_iters=4", f"--out_dir={good}"))
    train.main(tiny_data("--max_iters=4", f"--out_dir={other}", "--lime=True"))
    lines = open(os.path.join(good, "log.jsonl")).readlines()
    for damage, note in RESUME_DAMAGE:
        out = str(tmp_path / damage.replace(" ", "_"))
        shutil.copytree(good, out)
        L = os.path.join(out, "log.jsonl")
        text = {"deleted": None, "emptied": "", "cut mid-line": "".join(lines[:2]) + lines[2][:20],
                "garbage lines": "".join(lines[:2] + ["hello\n", "[1, 2]\n"] + lines[2:]),
                "another run's": open(os.path.join(other, "log.jsonl")).read(),
                "another run's records": "".join(open(os.path.join(other, "log.jsonl")).readlines()[1:])}[damage]
        os.remove(L)
        if text is not None:
            open(L, "w").write(text)
        capsys.readouterr()
        if damage.startswith("another"):
            with pytest.raises(ValueError, match=re.escape(note.replace("L", L))):
                train.main(tiny_data("--max_iters=6", f"--out_dir={out}", "--resume=True"))
            assert open(L).read() == text  # left as it was
            continue
        train.main(tiny_data("--max_iters=6", f"--out_dir={out}", "--resume=True"))
        assert f"note: {note.replace('L', L)}" in capsys.readouterr().out
        iters = [r["iter"] for r in records(out)]
        assert iters == {"deleted": [6], "emptied": [6], "cut mid-line": [0, 6]}.get(damage, [0, 2, 4, 6])


def test_train_resuming_a_finished_run_writes_nothing(tiny_data, tmp_path, capsys):
    out = tmp_path / "o"
    train.main(tiny_data("--max_iters=4", f"--out_dir={out}"))
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    assert train.main(tiny_data("--max_iters=4", f"--out_dir={out}", "--resume=True"))["iter"] == 4
    assert "already trained to iter 4 (max_iters=4); nothing to do" in capsys.readouterr().out
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before  # not even the log's header
    os.remove(out / "log.jsonl")
    train.main(tiny_data("--max_iters=4", f"--out_dir={out}", "--resume=True"))
    assert os.listdir(out) == ["ckpt.pt"]


class FullDiskFile:
    """A file whose writes fail with ENOSPC after the first n."""
    def __init__(self, f, n):
        self.f, self.n = f, n

    def write(self, s):
        self.n -= 1
        if self.n < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(s)

    def writelines(self, lines):
        for s in lines:
            self.write(s)

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.parametrize("where", ["log record", "log header", "summary.json", "loss_vs_flops.png"])
def test_full_disk_while_logging_or_plotting(tiny_data, tmp_path, monkeypatch, where):
    """One error line that says the disk is full and what was kept; nothing is damaged, and the run resumes."""
    out = str(tmp_path / "o")
    L = os.path.join(out, "log.jsonl")
    if where == "log record":  # records 0, 2 and 4 (then the checkpoint of iter 4), then 6 fails
        full = lambda p, mode="r", *a, **k: (FullDiskFile(open(p, mode, *a, **k), 3) if mode == "a"
                                             else open(p, mode, *a, **k))
        monkeypatch.setattr(train, "open", full, raising=False)
        with pytest.raises(prepare_data.DiskFullError, match=re.escape(
                f"the disk is full (No space left on device) while writing {L}; {L} holds the records before iter 6, "
                f"{out}/ckpt.pt the checkpoint of iter 4; free some space, then continue with --resume=True")):
            train.main(tiny_data("--max_iters=8", f"--out_dir={out}"))
        monkeypatch.undo()
        train.main(tiny_data("--max_iters=8", f"--out_dir={out}", "--resume=True"))
        assert [r["iter"] for r in records(out)] == [0, 2, 4, 6, 8]
        return
    real = prepare_data.atomic_file
    @contextlib.contextmanager
    def full(path, mode="w"):
        with real(path, mode) as f:
            yield FullDiskFile(f, 0) if path.endswith(where.replace("log header", "log.jsonl")) else f
    monkeypatch.setattr(common if where == "log header" else compare, "atomic_file", full)
    if where == "log header":
        with pytest.raises(prepare_data.DiskFullError, match=re.escape(f"while writing {L}; it is unchanged; free")):
            train.main(tiny_data("--max_iters=2", f"--out_dir={out}"))
        assert os.listdir(out) == []
        return
    write_logs(out, {"baseline": log([0, 10], [4.0, 3.0]), "lime": log([0, 11], [4.0, 2.9])})
    p = os.path.join(out, where)
    with pytest.raises(prepare_data.DiskFullError, match=re.escape(
            f"the disk is full (No space left on device) while writing {p}; it is unchanged, and the runs' checkpoints "
            f"and logs are complete; free some space, then redraw with: python compare.py --plot={out}")):
        compare.main([f"--plot={out}"])
    assert not os.path.exists(p) and not [f for f in os.listdir(out) if f.endswith(".tmp")]


@pytest.mark.parametrize("flags, warning", [
    (["--min_lr=0.1", "--learning_rate=0.01"], "warning: --min_lr=0.1 is above --learning_rate=0.01: the lr rises"),
    (["--lr_decay_iters=1", "--warmup_iters=3"], "warning: lr_decay_iters=1 is below --warmup_iters=3: the lr warms"),
])
@pytest.mark.parametrize("script", ["train", "compare"])
def test_schedule_that_cannot_be_meant_warns_once(tiny_data, tmp_path, monkeypatch, capsys, script, flags, warning):
    monkeypatch.setattr(compare, "run_analyze", lambda out_dir, device="auto": None)
    {"train": train, "compare": compare}[script].main(tiny_data("--max_iters=2", f"--out_dir={tmp_path / 'o'}", *flags))
    assert capsys.readouterr().out.count(warning) == 1


# ----------------------------------------------------------------------------- sample.py

SAMPLE_TEXT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me!\n" * 20


def make_ckpt(out_dir, data_dir, lime=True, block_size=32, **hc):
    """A tiny untrained GPT saved the way train.py saves one, with a char dataset's meta."""
    meta = prepare(SAMPLE_TEXT, data_dir, tokenizer="char")
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=meta["vocab_size"], block_size=block_size, n_layer=2, n_head=2, n_embd=16,
                       multiple_of=16, lime=lime, **hc)
    model = GPT(config)
    ckpt = dict(model_args=asdict(config), model=model.state_dict(),
                optimizer=model.configure_optimizers(0.1, 1e-3).state_dict(), iter_num=0, best_val_loss=9.9,
                config=dict(dataset=os.path.basename(data_dir), data_dir=os.path.dirname(data_dir),
                            block_size=block_size, batch_size=4, seed=0, lime=lime, eval_iters=2),
                meta=meta)
    save_checkpoint(ckpt, out_dir)
    return meta


@pytest.fixture
def ckpt_dir(tmp_path):
    out = str(tmp_path / "out")
    make_ckpt(out, str(tmp_path / "data" / "tiny"))
    return out


def run_main(capsys, *args):
    sample.main(list(args))
    out, err = capsys.readouterr()
    return out.split(sample.SEPARATOR + "\n")[:-1], err  # the samples, then stderr


def test_sample_decodes_with_requested_length(ckpt_dir, capsys):
    samples, err = run_main(capsys, f"--out_dir={ckpt_dir}", "--start=ROMEO:", "--num_samples=3",
                            "--max_new_tokens=50", "--device=cpu")
    assert len(samples) == 3
    for s in samples:
        s = s[:-1]  # print() added a newline
        assert s.startswith("ROMEO:") and len(s) == len("ROMEO:") + 50
        assert set(s) <= set(SAMPLE_TEXT)
    assert "tokens/s" in err and "tokens/s" not in "".join(samples)  # speed goes to stderr only


@pytest.mark.parametrize("lime", [False, True])
def test_sample_seed_reproducible(tmp_path, capsys, lime):
    out = str(tmp_path / "out")
    make_ckpt(out, str(tmp_path / "data" / "tiny"), lime=lime)
    args = [f"--out_dir={out}", "--start=JULIET:", "--num_samples=2", "--max_new_tokens=40", "--device=cpu"]
    a, _ = run_main(capsys, *args, "--seed=1")
    b, _ = run_main(capsys, *args, "--seed=1")
    c, _ = run_main(capsys, *args, "--seed=2")
    assert a == b and a != c


def test_sample_prompt_from_file_and_long_prompt(ckpt_dir, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(SAMPLE_TEXT[:100], encoding="utf-8")  # 100 chars > block_size=32
    samples, err = run_main(capsys, f"--out_dir={ckpt_dir}", f"--start=FILE:{prompt}", "--num_samples=1",
                            "--max_new_tokens=5", "--device=cpu")
    assert "keeping the last 32" in err
    assert samples[0][:-1].startswith(SAMPLE_TEXT[68:100]) and len(samples[0][:-1]) == 32 + 5


def test_sample_empty_prompt_starts_from_newline(ckpt_dir, capsys):
    samples, err = run_main(capsys, f"--out_dir={ckpt_dir}", "--start=", "--num_samples=1",
                            "--max_new_tokens=5", "--device=cpu")
    assert "empty prompt: starting from a newline" in err
    assert samples[0].startswith("\n") and len(samples[0][:-1]) == 1 + 5


def test_sample_unknown_characters_named(ckpt_dir):
    with pytest.raises(ValueError, match="prompt.*'Z'.*'é'"):
        sample.main([f"--out_dir={ckpt_dir}", "--start=ZéRO", "--device=cpu"])


def test_sample_hc_checkpoint_round_trip(tmp_path, capsys):
    """An HC checkpoint (plain types, loaded with weights_only=True) gives back the same logits; sample.py
    generates from it through the KV cache, and names the variant."""
    out = str(tmp_path / "out")
    make_ckpt(out, str(tmp_path / "data" / "tiny"), lime=False, hc_rate=4)
    model, ckpt = common.load_checkpoint(out)
    port_reference_hc(model, reference_hc_weights(model))
    save_checkpoint(dict(ckpt, model=model.state_dict()), out)
    loaded, _ = common.load_checkpoint(out)
    idx = torch.randint(0, model.config.vocab_size, (2, 20))
    assert torch.equal(loaded(idx)[0], model(idx)[0])
    assert loaded.config.hc_rate == 4 and loaded.config.hc_dynamic
    samples, err = run_main(capsys, f"--out_dir={out}", "--start=ROMEO:", "--num_samples=2", "--max_new_tokens=40",
                            "--device=cpu")
    assert len(samples) == 2 and all(len(s) == len("ROMEO:") + 40 + 1 for s in samples)
    assert f"{out}: HC-4, iter 0" in err
    names = [common.variant_name(GPTConfig(**kw)) for kw in (dict(), dict(lime=True), dict(hc_rate=2, hc_dynamic=False),
                                                           dict(lime=True, hc_rate=4))]
    assert names == ["baseline", "LIMe", "HC-2-static", "LIMe + HC-4"]
    assert common.variant_name(dict(lime=False)) == "baseline"  # model_args of a checkpoint from before HC


def test_sample_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"ckpt\.pt.*python train\.py"):
        sample.main([f"--out_dir={tmp_path / 'nothing'}", "--device=cpu"])
    make_ckpt(str(tmp_path / "cmp" / "lime"), str(tmp_path / "data"))  # a comparison folder: points to a run in it
    with pytest.raises(FileNotFoundError, match=re.escape(f"it is a comparison folder (compare.py): use one of its "
                                                          f"runs, e.g. {tmp_path / 'cmp' / 'lime'}")):
        sample.main([f"--out_dir={tmp_path / 'cmp'}", "--device=cpu"])


def test_sample_cli_errors_are_one_line(ckpt_dir, tmp_path):
    for args, expected in [([f"--out_dir={tmp_path / 'nothing'}"], "ckpt.pt"),
                           ([f"--out_dir={ckpt_dir}", "--start=Zebra"], "'Z'")]:
        r = subprocess.run([sys.executable, "sample.py", "--device=cpu", *args], cwd=HERE,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and r.stdout == ""
        assert r.stderr.startswith("error: ") and expected in r.stderr
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.parametrize("kind, match", BAD_CHECKPOINTS)
def test_sample_bad_checkpoint(ckpt_dir, kind, match):
    damage_checkpoint(os.path.join(ckpt_dir, "ckpt.pt"), kind)
    with pytest.raises(ValueError, match=re.escape(os.path.join(ckpt_dir, "ckpt.pt")) + ".*" + re.escape(match)):
        sample.main([f"--out_dir={ckpt_dir}", "--device=cpu"])


@pytest.mark.parametrize("flag", ["--temperature=nan", "--temperature=inf", "--temperature=-1"])
def test_sample_temperature_must_be_finite(ckpt_dir, flag):
    with pytest.raises(ValueError, match=f"a finite --temperature >= 0, got .* and {flag.split('=')[1]}"):
        sample.main([f"--out_dir={ckpt_dir}", "--device=cpu", "--max_new_tokens=3", flag])


def test_sample_bpe_tokenizer_and_padded_vocab(capsys):
    import tiktoken
    from prepare_data import get_tokenizer
    ranks = {bytes([i]): i for i in range(256)}  # a byte-level BPE made up here (gpt2's files need a download)
    ranks[b"sp"], ranks[b"spe"] = 256, 257
    enc = tiktoken.Encoding(name="tiny", pat_str=r"""\S+|\s+""", mergeable_ranks=ranks, special_tokens={})
    tok = get_tokenizer({"tokenizer": "tiktoken", "encoding": "tiny"}, encoding=enc)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=320, block_size=16, n_layer=2, n_head=2, n_embd=16, multiple_of=16,
                          lime=True)).eval()  # vocab padded past the tokenizer's 258
    ids = sample.encode_prompt(tok, "", 16)
    assert ids == enc.encode("\n") and "empty prompt: starting from a newline" in capsys.readouterr().err
    texts, dt = sample.sample(model, tok, sample.encode_prompt(tok, "speak " * 10, 16), num_samples=2,
                              max_new_tokens=30, seed=0)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts) and dt > 0
    assert "dropped" in capsys.readouterr().err  # ids >= 258 can't be decoded: dropped, and said so


def test_sample_task_checkpoint_solves_an_expression(task_data, tmp_path, capsys):
    d, meta = task_data
    out = str(tmp_path / "run")
    train.main([f"--data_dir={d}", "--dataset=arith", "--preset=arithmetic", "--max_iters=2", "--eval_interval=2",
                "--batch_size=4", "--eval_iters=1", "--warmup_iters=1", "--device=cpu", f"--out_dir={out}"])
    capsys.readouterr()
    solutions = sample.main([f"--out_dir={out}", "--start=(3+4)*5=", "--device=cpu"])
    printed, err = capsys.readouterr()
    (text, got), = solutions  # greedy, one solution by default
    assert printed == text + "\n" + sample.SEPARATOR + "\n" and text.startswith("(3+4)*5=")
    assert len(text) <= meta["row_length"] and "_" not in text
    assert "true answer 0:" in err and ("right" in err) == (got == 0)  # (3+4)*5 = 0*5 mod 7
    with pytest.raises(ValueError, match="not a well-formed expression"):
        sample.main([f"--out_dir={out}", "--start=3+45", "--device=cpu"])
    with pytest.raises(ValueError, match="too few"):
        sample.main([f"--out_dir={out}", "--start=" + "+".join("1" * 20), "--device=cpu"])


def make_task_ckpt(out_dir, task):
    """A tiny untrained GPT for a task dataset (small_task), saved the way train.py saves one."""
    d, meta = task
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=meta["vocab_size"], block_size=meta["row_length"] - 1, n_layer=1, n_head=2, n_embd=16,
                       multiple_of=16, lime=True)
    model = GPT(config)
    save_checkpoint(dict(model_args=asdict(config), model=model.state_dict(), iter_num=0, best_val_loss=9.9,
                         config=dict(dataset=os.path.basename(d), data_dir=os.path.dirname(d)), meta=meta), out_dir)


@pytest.mark.parametrize("expr", ["1/0=", "3/(4-4)", "(2/0)*0", "1+2/(3*0)=", "5/(6+1)"])
def test_sample_refuses_division_by_zero(small_task, tmp_path, expr):
    make_task_ckpt(str(tmp_path / "run"), small_task)
    with pytest.raises(ValueError, match=re.escape(f"{expr!r} divides by 0 (mod 7), so it has no answer; the task "
                                                   f"never holds such a problem")):
        sample.main([f"--out_dir={tmp_path / 'run'}", f"--start={expr}", "--device=cpu"])  # was: "true answer 0"


def test_sample_task_checkpoint_with_edited_meta_refused(small_task, tmp_path):
    out = str(tmp_path / "run")
    make_task_ckpt(out, (small_task[0], dict(small_task[1], prime=11)))
    with pytest.raises(ValueError, match=re.escape(f"{out}/ckpt.pt: its copy of the dataset's meta.json doesn't "
                                                   f"describe the task (its chars are not the 20 symbols")):
        sample.main([f"--out_dir={out}", "--start=1+2", "--device=cpu"])


@pytest.mark.parametrize("args, match", [
    (["--start=FILE:"], "--start=FILE: needs the prompt file's path after FILE:"),  # was: "prompt file not found: "
    (["--start=FILE:{tmp}"], "prompt file {tmp} is a folder"),                        # was: [Errno 21] Is a directory
    (["--seed=-1"], "--seed must be from 0 to 2**64 - 1, got -1"),
    (["--seed=99999999999999999999"], "--seed must be from 0 to 2**64 - 1"),        # was: Overflow when unpacking long long
    (["--out_dir={ckpt}/ckpt.pt"], "{ckpt}/ckpt.pt is a file; give the run's folder, the one that holds ckpt.pt: {ckpt}"),
])
def test_sample_bad_flags_named(ckpt_dir, tmp_path, capsys, args, match):
    fill = lambda t: t.format(tmp=tmp_path, ckpt=ckpt_dir)
    with pytest.raises(ValueError, match=re.escape(fill(match))):
        sample.main([f"--out_dir={ckpt_dir}", "--device=cpu", *map(fill, args)])
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("torch_error", [False, True])
@pytest.mark.parametrize("previous", [False, True])
def test_checkpoint_full_disk_keeps_the_previous_one(tmp_path, monkeypatch, torch_error, previous):
    """A full disk while saving: one error that says so and what was kept; the old checkpoint is intact."""
    out = str(tmp_path / "run")
    if previous:
        save_checkpoint({"iter_num": 1}, out)
    old = open(os.path.join(out, "ckpt.pt"), "rb").read() if previous else None
    def full_save(obj, f):
        f.write(b"PK\x03\x04 half a checkpoint")
        if not torch_error:
            raise OSError(errno.ENOSPC, "No space left on device")
        try:  # what torch.save really raises (see test_data_real_full_disk_is_recognised)
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(common.torch, "save", full_save)
    with pytest.raises(prepare_data.DiskFullError) as e:
        save_checkpoint({"iter_num": 2}, out)
    path = os.path.join(out, "ckpt.pt")
    kept = (f"{path} still holds the previous checkpoint, unchanged; free some space, then continue with "
            f"--resume=True" if previous else "no checkpoint was written; free some space and start again")
    assert str(e.value) == f"the disk is full (No space left on device) while writing {path}; {kept}"
    assert sorted(os.listdir(out)) == (["ckpt.pt"] if previous else [])  # no temp file left
    if previous:
        assert open(path, "rb").read() == old


def test_checkpoint_temp_file_left_by_a_kill_is_ignored_then_removed(tmp_path):
    out = str(tmp_path / "run")
    save_checkpoint({"model_args": {}, "model": {}, "iter_num": 1}, out)
    for name in (".ckpt.pt.k1ll3d.tmp", ".ckpt.pt.abcdef.tmp"):  # 0 bytes, and a partial one
        open(os.path.join(out, name), "wb").write(b"" if "k1" in name else b"PK\x03\x04")
    open(os.path.join(out, ".log.jsonl.x1.tmp"), "w").close()  # someone else's: left alone
    assert common.read_checkpoint(os.path.join(out, "ckpt.pt"))["iter_num"] == 1  # ignored when reading
    save_checkpoint({"model_args": {}, "model": {}, "iter_num": 2}, out)      # removed by the next save
    assert sorted(os.listdir(out)) == [".log.jsonl.x1.tmp", "ckpt.pt"]
    assert common.read_checkpoint(os.path.join(out, "ckpt.pt"))["iter_num"] == 2


@pytest.mark.parametrize("script, args", [("prepare_data.py", ["--input=t.txt"]), ("sample.py", []),
                                          ("analyze.py", [])])
def test_ctrl_c_is_one_line(tmp_path, script, args):
    """Ctrl-C: "interrupted", exit 130, no traceback (sample.py and analyze.py through common.run_main; bench.py has
    the same lines)."""
    (tmp_path / "t.txt").write_text(DATA_TEXT)
    r = run_script_patched(script, "import argparse\ndef _ki(*a, **k): raise KeyboardInterrupt\n"
                                   "argparse.ArgumentParser.parse_args = _ki", *args, cwd=tmp_path)
    assert r.returncode == 130 and r.stderr == "\ninterrupted\n" and r.stdout == ""


# ----------------------------------------------------------------------------- analyze.py: router maps and value entropy

ANALYZE_TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n" * 30


def tiny_gpt(lime, n_layer=3, n_head=2, vocab_size=40, block_size=16, **switches):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                         n_embd=8 * n_head, multiple_of=16, lime=lime, **switches))


def orthonormal_rows(n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d, n, generator=g, dtype=torch.float64))  # (d, n), orthonormal columns
    return Q.T                                                                      # (n, d)


@pytest.mark.parametrize("n, d, pad", [(1, 8, 0), (3, 8, 0), (8, 8, 0), (5, 16, 20)])
def test_analyze_entropy_of_orthonormal_rows_is_log_n(n, d, pad):
    Z = torch.cat([orthonormal_rows(n, d), torch.zeros(pad, d, dtype=torch.float64)])  # pad: T > d path
    assert float(renyi_entropy(Z)) == pytest.approx(math.log(n), abs=1e-9)
    assert float(renyi_entropy(Z, alpha=2.0)) == pytest.approx(math.log(n), abs=1e-9)  # flat spectrum: any alpha


def test_analyze_entropy_rank_one_is_zero():
    Z = torch.outer(torch.randn(12, dtype=torch.float64), torch.randn(7, dtype=torch.float64))
    assert abs(float(renyi_entropy(Z))) < 1e-9


def test_analyze_entropy_row_order_and_batching():
    Z = torch.randn(3, 20, 8, dtype=torch.float64)
    H = renyi_entropy(Z)
    assert H.shape == (3,)
    for b in range(3):
        assert float(renyi_entropy(Z[b][torch.randperm(20)])) == pytest.approx(float(H[b]), abs=1e-10)
        assert 0 < float(H[b]) < math.log(8)
    with pytest.raises(ValueError, match="all zeros"):
        renyi_entropy(torch.zeros(4, 4))


def test_analyze_standardize_over_batch():
    V = torch.randn(4, 10, 6) * torch.arange(1, 7) + 3
    V[..., 0] = 5.0                                  # a constant feature becomes 0, not nan
    Z = standardize(V)
    assert torch.allclose(Z.mean((0, 1)), torch.zeros(6, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(Z[..., 1:].std((0, 1), correction=0), torch.ones(5, dtype=torch.float64))
    assert (Z[..., 0] == 0).all()


def test_analyze_router_shares():
    model = tiny_gpt(lime=True, n_layer=4, n_head=3)
    S = router_shares(model)
    assert S.shape == (4, 4)
    assert torch.allclose(torch.tensor(S.sum(1)), torch.ones(4, dtype=torch.float64))
    assert (S >= 0).all() and (S[torch.triu_indices(4, 4, 1).unbind()] == 0).all()
    with torch.no_grad():                            # [0 ... 0 | I]: every layer reads only itself
        for block in model.transformer.h[1:]:
            W = block.attn.router
            W.zero_()
            W[:, -3:] = torch.eye(3)
    assert (router_shares(model) == torch.eye(4).numpy()).all()
    with pytest.raises(ValueError, match="baseline"):
        router_shares(tiny_gpt(lime=False))


def test_analyze_router_shares_by_hand():
    W1 = torch.tensor([[1.0, 0.0, 1.0, 0.0],       # head 0: half from layer 0, half from itself
                       [0.0, 2.0, 0.0, 0.0]])      # head 1: all from layer 0
    assert head_shares(W1).tolist() == [[0.5, 0.5], [1.0, 0.0]]
    assert router_shares([None, W1]).tolist() == [[1.0, 0.0], [0.75, 0.25]]


@pytest.mark.parametrize("sources, read", [("first", [[0], [0, 1], [0, 2], [0, 3]]),
                                           ("previous", [[0], [0, 1], [1, 2], [2, 3]])])
def test_analyze_router_shares_restricted_sources(sources, read):
    """Shares count the routers as the model uses them: the layers a layer doesn't read get exactly 0 even if
    the parameter holds something there, and each row still sums to 1; readable_sources marks what is read."""
    model = tiny_gpt(lime=True, n_layer=4, n_head=2, lime_sources=sources)
    randomize_routers(model)                                    # nonzero everywhere, unread columns too
    S = router_shares(model)
    assert np.allclose(S.sum(1), 1.0)
    R = analyze.readable_sources(4, sources)
    assert [list(np.flatnonzero(row)) for row in R] == read
    assert (S[~R] == 0).all() and (S[R][1:] > 0).all()
    expected = router_shares([None] + [W * torch.tensor(np.repeat(R[l, :l + 1], 2), dtype=W.dtype)
                                       for l, W in enumerate(routers(model), start=1)])
    assert np.allclose(S, expected, atol=1e-15)
    assert np.array_equal(router_shares([None] + routers(model), sources), S)  # a list of routers + their sources


def make_run(out_dir, data_dir, lime, **switches):
    """A tiny untrained GPT saved the way train.py saves one (no training needed for the figures)."""
    meta = prepare(ANALYZE_TEXT, data_dir, tokenizer="char") if not os.path.exists(data_dir) else \
        json.load(open(os.path.join(data_dir, "meta.json")))
    model = tiny_gpt(lime, vocab_size=meta["vocab_size"], **switches)
    ckpt = dict(model_args=asdict(model.config), model=model.state_dict(),
                optimizer=model.configure_optimizers(0.1, 1e-3).state_dict(), iter_num=0, best_val_loss=3.5,
                config=dict(dataset=os.path.basename(data_dir), data_dir=os.path.dirname(data_dir),
                            block_size=16, batch_size=4, seed=0, lime=lime, eval_iters=3),
                meta=meta)
    save_checkpoint(ckpt, out_dir)


def test_analyze_compare_writes_figures(tmp_path, capsys):
    out, data = tmp_path / "out", str(tmp_path / "data" / "tiny")
    make_run(str(out / "baseline"), data, lime=False)
    make_run(str(out / "lime"), data, lime=True)
    result = analyze.analyze_compare(str(out))
    printed = capsys.readouterr().out.splitlines()
    for name in ["router_map.png", "router_heads.png", "value_entropy.png"]:
        with open(out / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert sum(name in line for line in printed) == 1
    assert len(printed) == 3
    saved = json.load(open(out / "analysis.json"))
    assert list(saved["routers"]) == ["lime"]  # (the one LIMe run)
    assert saved["routers"]["lime"]["heads_layer"] == 2 and len(saved["routers"]["lime"]["shares"]) == 3
    for run in ["baseline", "lime"]:
        ent = result["value_entropy"]["per_layer"][run]
        assert len(ent) == 3 and all(0 < e <= math.log(16) + 1e-9 for e in ent)
    assert saved["runs"]["lime"]["sequences"] == 12  # eval_iters=3 fixed val batches of 4
    single = analyze.analyze_compare(str(out / "lime"))  # a single (non --compare) run folder works too
    (router,) = single["routers"].values()
    assert router["shares"] == saved["routers"]["lime"]["shares"] and os.path.getsize(out / "lime" / "router_map.png")


def test_analyze_router_maps_blank_unread_sources(tmp_path, monkeypatch):
    """A lime_sources="previous", lime_kv="k" run: the router map leaves the layers not read blank (and the upper
    triangle), the per-head map too; analysis.json says which setting and which cells are readable."""
    out, data = tmp_path / "out", str(tmp_path / "data" / "tiny")
    make_run(str(out / "lime"), data, lime=True, lime_kv="k", lime_sources="previous")
    masks = {}
    draw = analyze.plot_shares
    monkeypatch.setattr(analyze, "plot_shares", lambda M, path, *a, mask=None: (
        masks.__setitem__(os.path.basename(path), mask), draw(M, path, *a, mask=mask))[1])
    routers = analyze.analyze_compare(str(out / "lime"))["routers"]
    assert list(routers) == [os.path.normpath(out / "lime")]  # a single run folder: named by its path
    result = routers[os.path.normpath(out / "lime")]
    blank = [[False, True, True], [False, False, True], [True, False, False]]  # layer 2 doesn't read layer 0
    assert masks["router_map.png"].tolist() == blank
    assert masks["router_heads.png"].tolist() == [[True, False, False]] * 2   # layer 2, its 2 heads
    assert result["lime_sources"] == "previous" and result["lime_kv"] == "k"
    assert result["readable"] == [[not b for b in row] for row in blank] and result["shares"][2][0] == 0.0


def test_analyze_refuses_re_prepared_dataset(tmp_path):
    out, data = tmp_path / "out", str(tmp_path / "data" / "tiny")
    make_run(str(out / "baseline"), data, lime=False)
    make_run(str(out / "lime"), data, lime=True)
    prepare(ANALYZE_TEXT * 2, data)  # the same characters (so the same vocab), other text
    with pytest.raises(ValueError, match=re.escape(f"{data} is no longer the dataset {out / 'baseline' / 'ckpt.pt'} "
                                                   f"was trained on (n_chars: {len(ANALYZE_TEXT)} then, "
                                                   f"{2 * len(ANALYZE_TEXT)} now")):
        analyze.analyze_compare(str(out))
    assert sorted(os.listdir(out)) == ["baseline", "lime"]  # no figures drawn from the wrong data


@pytest.mark.parametrize("max_sequences", [0, -4])
def test_analyze_max_sequences_must_be_positive(tmp_path, max_sequences):
    make_run(str(tmp_path / "out" / "lime"), str(tmp_path / "data" / "tiny"), lime=True)
    with pytest.raises(ValueError, match=f"--max_sequences must be at least 1, got {max_sequences}"):
        analyze.main([str(tmp_path / "out"), f"--max_sequences={max_sequences}"])
    assert os.listdir(tmp_path / "out") == ["lime"]


def test_analyze_cli_error_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "analyze.py", str(tmp_path)], cwd=HERE, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "python compare.py" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0


def test_analyze_usage_calls_only_out_dir_required(capsys):
    with pytest.raises(SystemExit):
        analyze.main([])
    err = capsys.readouterr().err
    assert "the following arguments are required: out_dir\n" in err  # was: "out_dir, extra"


@pytest.mark.parametrize("args, error, match", [
    (["{out}", "--seed=-1"], ValueError, "--seed must be at least 0, got -1"),  # was: expected non-negative integer
    (["{out}/lime/ckpt.pt"], ValueError, "{out}/lime/ckpt.pt is a file; give the comparison's folder"),
    (["{out}", "{out}/nothing"], FileNotFoundError, "no checkpoint at {out}/nothing/ckpt.pt (an extra run dir"),
])
def test_analyze_bad_arguments_found_first(tmp_path, monkeypatch, args, error, match):
    out = str(tmp_path / "out")
    make_run(os.path.join(out, "lime"), str(tmp_path / "data" / "tiny"), lime=True)
    monkeypatch.setattr(analyze, "load_checkpoint", lambda *a: pytest.fail("should be refused before any work"))
    with pytest.raises(error, match=re.escape(match.format(out=out))):
        analyze.main([a.format(out=out) for a in args])
    assert os.listdir(out) == ["lime"]


def test_analyze_full_disk_says_what_was_kept(tmp_path, monkeypatch):
    out, data = tmp_path / "out", str(tmp_path / "data" / "tiny")
    make_run(str(out / "lime"), data, lime=True)
    savefig, saved = matplotlib.figure.Figure.savefig, []
    def full_after_one(fig, f, **kw):
        if saved:  # the first figure fits, the second doesn't
            raise OSError(errno.ENOSPC, "No space left on device")
        saved.append(savefig(fig, f, **kw))
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_after_one)
    with pytest.raises(prepare_data.DiskFullError, match=re.escape(
            f"the disk is full (No space left on device) while writing {out}/router_heads.png; it is unchanged, the "
            f"files written before it are complete; free some space and run analyze.py again")):
        analyze.analyze_compare(str(out))
    assert sorted(os.listdir(out)) == ["lime", "router_map.png"]


# ----------------------------------------------------------------------------- analyze.py: token separability

WORD_TEXT = "It is here; this is.\nis are island, is't was were? is"


def _word_encoding():
    # byte-level BPE made up here with GPT-2's habit of gluing the leading space to a word: " is", " are", ...
    ranks = {bytes([i]): i for i in range(256)}
    for m in [b" i", b" is", b" a", b" ar", b" are", b" w", b" wa", b" was", b" we", b" wer", b" were"]:
        ranks[m] = len(ranks)
    return tiktoken.Encoding(name="tinyw", pat_str=r""" ?\w+| ?[^\s\w]+|\s+""", mergeable_ranks=ranks,
                             special_tokens={})


def test_analyze_word_positions_char():
    tok = get_tokenizer({"tokenizer": "char", "chars": sorted(set(WORD_TEXT))})
    tokens = np.array(tok.encode(WORD_TEXT))
    # the last character of every whole-word "is": not in "this" or "island"; "is't" and the line start count
    assert analyze.word_positions(tokens, tok, "is").tolist() == [4, 18, 22, 37, 52]
    assert [analyze.word_positions(tokens, tok, w).tolist() for w in ["are", "was", "were"]] == [[26], [43], [48]]
    assert analyze.word_positions(tokens, tok, "Is").tolist() == []  # case-sensitive
    assert analyze.word_positions(tokens, tok, "zebra").tolist() == []  # not even in the vocabulary: none
    found = analyze.find_occurrences(tokens, tok, ["is", "are"], block_size=19)  # needs a full window: p >= 18
    assert found["is"].tolist() == [18, 22, 37, 52] and found["are"].tolist() == [26]


def test_analyze_word_positions_bpe():
    enc = _word_encoding()
    tok = get_tokenizer({"tokenizer": "tiktoken", "encoding": "tinyw"}, encoding=enc)
    tokens = np.array(tok.encode(WORD_TEXT))
    # " is" tokens: not " is"+"land", not "\nis" (no leading space: another token), the last token counts
    pos = analyze.word_positions(tokens, tok, "is")
    assert pos.tolist() == [2, 14, 26, 32] and {tok.decode([t]) for t in tokens[pos]} == {" is"}
    assert tok.decode([tokens[21]]) == "l" and tokens[20] == tokens[2]  # the " is" of " island" exists, dropped
    assert [analyze.word_positions(tokens, tok, w).tolist() for w in ["are", "was", "were"]] == [[19], [29], [30]]
    with pytest.raises(analyze.CantProbe, match="' here' is 5 BPE tokens"):
        analyze.word_positions(tokens, tok, "here")


def test_analyze_balanced_sample_and_folds_deterministic():
    found = {"a": np.arange(0, 100, 2), "b": np.arange(1, 61, 2), "c": 3 * np.arange(40) + 1000}  # 50, 30, 40
    pos, labels, n = analyze.balanced_sample(found, seed=3)
    assert n == 30 and np.bincount(labels).tolist() == [30, 30, 30] and len(pos) == 90
    for i, p in enumerate(found.values()):
        chosen = pos[labels == i]
        assert len(set(chosen)) == 30 and set(chosen) <= set(p) and (np.diff(chosen) > 0).all()
    again = analyze.balanced_sample(found, seed=3)
    assert (again[0] == pos).all() and (again[1] == labels).all()
    assert (analyze.balanced_sample(found, seed=4)[0] != pos).any()
    assert analyze.balanced_sample(found, seed=3, max_per_word=10)[2] == 10
    with pytest.raises(analyze.CantProbe, match=r"'b': 24, 'c': 40; at least 25 of each"):
        analyze.balanced_sample(dict(found, b=np.arange(24)), seed=3)

    labels = np.repeat(np.arange(3), [30, 30, 7])
    folds = analyze.stratified_folds(labels, 5, seed=3)
    assert (folds == analyze.stratified_folds(labels, 5, seed=3)).all()
    assert (folds != analyze.stratified_folds(labels, 5, seed=4)).any()
    for c, per_fold in [(0, [6] * 5), (1, [6] * 5), (2, [2, 2, 1, 1, 1])]:  # every class spread evenly
        assert np.bincount(folds[labels == c], minlength=5).tolist() == per_fold


def test_analyze_logistic_regression_converges():
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(2, 60, 10, generator=g, dtype=torch.float64), torch.arange(60) % 3
    train = torch.stack([torch.arange(60) < 40, torch.arange(60) >= 15])  # two problems, fitted together
    W, b = analyze.logistic_regression(X, y, train, 3, l2=1e-2)
    for p in range(2):                                   # each at the minimum of ITS penalised objective
        Wp, bp = W[p].clone().requires_grad_(), b[p].clone().requires_grad_()
        loss = (torch.nn.functional.cross_entropy(X[p][train[p]] @ Wp + bp, y[train[p]])
                + 0.5 * 1e-2 * (Wp ** 2).sum())
        gW, gb = torch.autograd.grad(loss, (Wp, bp))
        assert max(gW.abs().max(), gb.abs().max()) < 1e-5 and Wp.abs().max() > 0.1  # (not stuck at the zero start)


def test_analyze_cv_accuracy_separable_and_independent():
    g = torch.Generator().manual_seed(0)
    labels = np.repeat(np.arange(4), 100)                   # 4 balanced classes of 100
    folds = analyze.stratified_folds(labels, 5, seed=0)
    # separable: class c sits at 10 * e_c plus unit noise, far apart in 16 dims -> every fold is perfect
    X = 10 * torch.nn.functional.one_hot(torch.as_tensor(labels), 16).double() + torch.randn(400, 16, generator=g)
    assert analyze.cv_accuracy(X, labels, folds) == [1.0] * 5
    # independent of the labels: each of the 400 held-out predictions is right with probability 1/4, so the
    # mean accuracy is Binomial(400, 1/4) / 400, sd sqrt(1/4 * 3/4 / 400) = 0.022; 4 sd = 0.087
    acc = analyze.cv_accuracy(torch.randn(400, 16, generator=g, dtype=torch.float64), labels, folds)
    assert abs(np.mean(acc) - 0.25) < 0.087


SEP_TEXT = " ".join(np.random.default_rng(0).choice(["it is so.", "they are so.", "it was so.", "they were so."],
                                                    500).tolist())  # ~6 KB, ~125 of each word


def test_analyze_compare_separability(tmp_path, capsys):
    out, data = tmp_path / "out", str(tmp_path / "data" / "words")
    prepare(SEP_TEXT, data, tokenizer="char", val_fraction=0.5)
    make_run(str(out / "baseline"), data, lime=False)
    make_run(str(out / "lime"), data, lime=True)
    make_run(str(out / "hc"), data, lime=False, hc_rate=2)  # HC's hidden state: the sum of its streams
    result = analyze.analyze_compare(str(out), words=["is", "was", "were"], seed=1, extra=[str(out / "hc")])
    printed = capsys.readouterr().out
    with open(out / "separability.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "separability.png: last layer accuracy, values: baseline" in printed
    saved = json.load(open(out / "analysis.json"))["separability"]
    assert saved == json.loads(json.dumps(result["separability"])) and saved["skipped"] == {} and saved["seed"] == 1
    val = get_tokenizer(load_meta(data)).decode(load_tokens(data, "val"))
    assert sorted(saved["per_run"]) == sorted(["baseline", "lime", os.path.normpath(out / "hc")])
    for run in ["baseline", "lime", os.path.normpath(out / "hc")]:
        r = saved["per_run"][run]
        # every whole word in the val text, less those within the first block_size - 1 = 15 characters
        assert r["found"] == {w: sum(m.end() > 15 for m in re.finditer(rf"\b{w}\b", val)) for w in saved["words"]}
        assert r["per_word"] == min(r["found"].values()) >= analyze.MIN_PER_WORD
        for kind in ["values", "hidden"]:
            assert len(r[kind]["mean"]) == len(r[kind]["std"]) == 3
            assert all(0 <= m <= 1 for m in r[kind]["mean"]) and all(0 <= s <= 0.5 for s in r[kind]["std"])
        # known answer: layer 0's values see only the token at the word's last character (no router there),
        # "s" for is/was, "e" for were: "were" is always right, is/was are one point, so one of the two is
        # (2/3 exactly, up to rounding noise deciding the tie). The space after the word would give 1/3,
        # the character before it ("i", "a", "r") 1.0
        assert abs(r["values"]["mean"][0] - 2 / 3) < 0.1


def test_analyze_separability_too_rare(tmp_path, capsys):
    out, data = tmp_path / "out", str(tmp_path / "data" / "tiny")  # ANALYZE_TEXT has none of the words
    make_run(str(out / "lime"), data, lime=True)
    saved = analyze.analyze_compare(str(out / "lime"))["separability"]       # default words: a note, no figure
    assert "'is': 0" in saved["skipped"][os.path.normpath(str(out / "lime"))] and saved["per_run"] == {}
    assert "note: no token separability" in capsys.readouterr().err and not os.path.exists(out / "lime" / "separability.png")
    for bad in ["is", "is,is", "is,,are", "is,are you"]:
        with pytest.raises(ValueError, match="at least two distinct words"):
            analyze.parse_words(bad)
    r = subprocess.run([sys.executable, "analyze.py", str(out / "lime"), "--words=speak,hear"], cwd=HERE,  # explicit
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("error: token separability of ") and "'hear': 3;" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0


# ----------------------------------------------------------------------------- exercises/: the course kit

KIT = os.path.join(HERE, "exercises", "make_handout.py")
NEED_A_STUB = ["test_identity_routers_equal_baseline and kv-all", "test_causality", "test_parameter_count",
               "test_sample_decodes_with_requested_length", "test_markdown_links_resolve"]  # (or no stub at all)


def run_pytest(folder, select):
    """`python -m pytest tests.py -k select` in folder -> {test: (outcome, message, the exercises it grades)}."""
    r = subprocess.run([sys.executable, "-m", "pytest", "tests.py", "-q", "-p", "no:cacheprovider", "-k", select,
                        "--tb=native", f"--junitxml={folder / 'report.xml'}"],  # (native: pytest's own tracebacks
                       cwd=folder, capture_output=True, text=True, timeout=600)  # take seconds for 54 failures)
    import xml.etree.ElementTree as ET
    results = {}
    for case in ET.parse(folder / "report.xml").getroot().iter("testcase"):
        end = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        graded = {int(p.get("value")) for p in case.iter("property") if p.get("name") == "exercise"}  # conftest.py
        results[case.get("name")] = ("passed", "", graded) if end is None else (end.tag, end.get("message"), graded)
    assert results, r.stdout[-3000:] + r.stderr
    return results


@pytest.mark.skipif(not os.path.exists(KIT), reason="a course handout: the teacher's kit (exercises/) is not in it")
def test_course_handout(tmp_path):
    """exercises/make_handout.py OUT: on the handout exactly the tests of exercises 1-4 fail, each with its stub's
    NotImplementedError; the tests that only need a stubbed exercise skip naming it (in-process, in a fixture, in
    a train.py subprocess), the rest pass. With the reference code pasted back between the markers every file is
    the repository's again, and the tests pass. --exercises=3 stubs exercise 3 alone; a non-empty OUT, an unknown
    exercise: one error line, nothing written."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_handout", KIT)
    kit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kit)
    out = tmp_path / "handout"
    r = subprocess.run([sys.executable, KIT, str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("wrote "), r.stderr
    ours = [f for f in kit.repo_files(HERE) if not f.startswith("exercises" + os.sep)]
    theirs = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    assert theirs == sorted(ours + ["ASSIGNMENT.md"])
    assert markdown_link_errors(str(out), ["ASSIGNMENT.md"]) == []
    assert markdown_link_errors(HERE, ["exercises/ASSIGNMENT.md", "exercises/TEACHERS.md"]) == []
    code = (out / "lime.py").read_text()
    assert sorted(re.findall(r'raise NotImplementedError\("exercise (\d):', code)) == ["1", "2", "3", "4"]
    assert max(map(len, code.splitlines())) <= 120

    # the handout: the graded tests fail with their exercise's error, the rest pass or skip naming the exercise
    results = run_pytest(out, " or ".join(["ex1", "ex2", "ex3", "ex4", "test_train_progress_reaches_a_pipe"]
                                          + NEED_A_STUB))
    for name, (outcome, message, graded) in results.items():
        if graded:
            assert outcome == "failure" and any(f"NotImplementedError: exercise {n}:" in message for n in graded), name
        else:
            assert outcome == "passed" or outcome == "skipped" and message.startswith("needs exercise "), name
    assert {n for _, _, graded in results.values() for n in graded} == {1, 2, 3, 4}
    assert results["test_causality[True]"][1].startswith("needs exercise 2")                       # in the test
    assert results["test_sample_decodes_with_requested_length"][1].startswith("needs exercise 2")  # in a fixture
    assert results["test_train_progress_reaches_a_pipe_while_running"][1].startswith("needs exercise 4")  # script
    assert results["test_causality[False]"][0] == results["test_markdown_links_resolve"][0] == "passed"

    # the reference code pasted back: the repository's files again, and the tests pass
    for f in ours:
        ref, handout = open(os.path.join(HERE, f), "rb").read(), (out / f).read_bytes()
        if f.endswith(".py"):
            (out / f).write_text(kit.restore_text(handout.decode(), ref.decode()))
        elif f.endswith(".md"):  # (less the lines that link to the teacher's exercises/)
            ref = kit.relink(ref.decode(), os.path.dirname(f), os.path.dirname(f)).encode()
        assert (out / f).read_bytes() == ref, f
    results = run_pytest(out, " or ".join(["test_lime_mix_by_hand", "test_router_init", "test_kv_cache_is_baseline",
                                           "test_flops_match_flop_counter_every_switch and kv-all"] + NEED_A_STUB))
    assert {outcome for outcome, _, _ in results.values()} == {"passed"} and len(results) >= 10

    # a subset; the refusals
    kit.main([str(tmp_path / "three"), "--exercises=3"])
    code = (tmp_path / "three" / "lime.py").read_text()
    assert re.findall(r"exercise (\d)", code) == ["3", "3", "3"]             # opens, error, closes: 3 alone
    assert 'return torch.einsum("rj,...jd->...rd", W, stack)' in code         # exercise 1's code, no markers
    ref = open(os.path.join(HERE, "lime.py")).read()
    assert kit.same_outside_regions(code.replace("raise NotImplementedError", "pass  #"), ref)  # (a solution)
    assert not kit.same_outside_regions(code.replace("eps=1e-6", "eps=1e-5"), ref)
    text = (tmp_path / "three" / "ASSIGNMENT.md").read_text()
    assert "## Exercise 3" in text and "## Exercise 1" not in text
    r = subprocess.run([sys.executable, KIT, str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert "not empty" in r.stderr
    for bad in ("--exercises=7", "--exercises=1,x", "--exercises="):
        with pytest.raises(ValueError, match="is not a list of exercises"):
            kit.main([str(tmp_path / "bad"), bad])
    assert not os.path.exists(tmp_path / "bad")
