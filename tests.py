"""
The test suite: CPU, offline, a couple of minutes on 2 cores.

    python -m pytest tests.py -q
"""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lime import GPT, GPTConfig, lime_mix_reference


def tiny(lime, **kw):
    cfg = dict(vocab_size=61, block_size=16, n_layer=4, n_head=4, n_embd=32, lime=lime)
    cfg.update(kw)
    return GPTConfig(**cfg)


def make(lime, seed=0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    return GPT(tiny(lime, **kw)).to(dtype)


def routers(model):
    return [b.attn.router for b in model.transformer.h if b.attn.router is not None]


def randomize_routers(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for W in routers(model):
            W.copy_(torch.randn(W.shape, generator=g, dtype=W.dtype) * 0.5)


# ----------------------------------------------------------------------------- lime.py: the method

def test_identity_routers_equal_baseline():
    base, lime = make(False, dtype=torch.float64), make(True, dtype=torch.float64)
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


def test_fast_mix_matches_reference_formula():
    """The buffer-based mix (values and gradients of inputs and routers) against the plain formula."""
    torch.manual_seed(0)
    L, B, T, H, hd = 4, 2, 5, 3, 4
    kvs = [torch.randn(B, T, 2, H, hd, dtype=torch.float64, requires_grad=True) for _ in range(L)]
    Ws = [None] + [torch.randn(H, (l + 1) * H, dtype=torch.float64, requires_grad=True)
                   for l in range(1, L)]
    from lime import KVStack, _LimeMix
    stack = KVStack(L)
    fast = [_LimeMix.apply(kv, W, stack, l) for l, (kv, W) in enumerate(zip(kvs, Ws))]  # k, v: (B, H, T, hd)
    fast = [torch.stack([k, v], dim=2).transpose(1, 3) for k, v in fast]                # (B, T, 2, H, hd)
    ref_k = lime_mix_reference([kv[:, :, 0] for kv in kvs], Ws)
    ref_v = lime_mix_reference([kv[:, :, 1] for kv in kvs], Ws)
    ref = [torch.stack([k, v], dim=2) for k, v in zip(ref_k, ref_v)]
    coef = [torch.randn_like(r) for r in ref]
    loss_fast = sum((f * c).sum() for f, c in zip(fast, coef))
    loss_ref = sum((r * c).sum() for r, c in zip(ref, coef))
    for f, r in zip(fast, ref):
        assert torch.allclose(f, r, atol=1e-12)
    leaves = kvs + Ws[1:]
    g_fast = torch.autograd.grad(loss_fast, leaves)
    g_ref = torch.autograd.grad(loss_ref, leaves)
    for a, b in zip(g_fast, g_ref):
        assert torch.allclose(a, b, atol=1e-12)


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
    one raw K/V buffer (2 * B * T * C floats) per layer."""
    from bench import saved_activation_bytes
    B, T, C = 2, 16, 32
    extra = []
    for L in (2, 4, 8):
        act = []
        for lime in (False, True):
            model = make(lime, n_layer=L)
            idx = torch.randint(0, 61, (B, T))
            act.append(saved_activation_bytes(lambda: model(idx, idx), list(model.parameters()))[0])
        extra.append(act[1] - act[0])
        assert 0 < act[1] - act[0] <= L * 2 * B * T * C * 4
    assert extra[2] - extra[1] == 2 * (extra[1] - extra[0])  # exactly linear in L


@pytest.mark.parametrize("lime", [False, True])
def test_kv_cache_generation_matches_uncached(lime):
    model = make(lime).eval()
    randomize_routers(model)
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


def test_kv_cache_is_baseline_sized():
    from lime import KVCache
    for lime in (False, True):
        model = make(lime).eval()
        cache = KVCache(model.config.n_layer)
        with torch.no_grad():
            model(torch.randint(0, 61, (2, 7)), cache=cache)
            model(torch.randint(0, 61, (2, 1)), cache=cache)
        assert len(cache) == 8
        assert all(k.shape == v.shape == (2, 4, 8, 8) for k, v in zip(cache.k, cache.v))


@pytest.mark.parametrize("lime", [False, True])
@pytest.mark.parametrize("shape", [dict(n_layer=3, n_head=4, n_embd=32, block_size=32, vocab_size=64),
                                   dict(n_layer=5, n_head=2, n_embd=48, block_size=24, vocab_size=100)])
def test_flops_match_flop_counter(lime, shape):
    """flops_per_token counts attention over the full T x T square, as the math SDPA kernel computes it
    (the fused CPU kernel reports 0 FLOPs to FlopCounterMode, so route attention through math)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(lime=lime, **shape))
    B, T = 2, shape["block_size"]
    idx = torch.randint(0, shape["vocab_size"], (B, T))
    expected = model.flops_per_token(T) * B * T
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd:
            model(idx, idx)
        with FlopCounterMode(display=False) as both:
            model(idx, idx)[1].backward()
    assert abs(fwd.get_total_flops() / expected - 1) < 0.01
    assert abs(both.get_total_flops() / (3 * expected) - 1) < 0.01


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
        GPT(tiny(False, n_embd=30, n_head=4))
    with pytest.raises(ValueError, match="even"):
        GPT(tiny(False, n_embd=12, n_head=4))
    model = make(True)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="batch, time"):
        model(torch.zeros(8, dtype=torch.long))
