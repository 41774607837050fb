"""
The test suite: CPU, offline, a couple of minutes on 2 cores.

    python -m pytest tests.py -q
"""

import json
import math
import os
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import pytest
import tiktoken
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

torch.set_num_threads(1)  # tiny models: one thread is as fast, and immune to a busy machine's other work

import analyze
import common
import prepare_data
import sample
import train
from analyze import head_shares, renyi_entropy, router_shares, standardize
from lime import GPT, GPTConfig, lime_mix_reference
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


@pytest.mark.parametrize("L,block", [(1, 8), (2, 8), (4, 8), (7, 2), (7, 3), (9, 4)])
def test_fast_mix_matches_reference_formula(L, block):
    """The buffer-based mix (values and gradients of inputs and routers) against the plain formula."""
    torch.manual_seed(0)
    B, T, H, hd = 2, 5, 3, 4
    kvs = [torch.randn(B, T, 2, H, hd, dtype=torch.float64, requires_grad=True) for _ in range(L)]
    Ws = [None] + [torch.randn(H, (l + 1) * H, dtype=torch.float64, requires_grad=True)
                   for l in range(1, L)]
    from lime import KVStack, _LimeMix
    stack = KVStack(Ws[1:], block=block)
    fast = [_LimeMix.apply(kv, stack, l, *(Ws[1:] if l == 0 else ())) for l, kv in enumerate(kvs)]  # (k, v)
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


def test_reused_gradient_buffer_and_bf16_autocast():
    """Backward reuses its scratch gradient buffer from the previous step (KVStack.spare): gradients must
    not depend on it, also when the batch shape changes. Under bf16 autocast (the CUDA training path)
    the router gradients stay fp32 and close to the fp32 ones."""
    from lime import KVStack
    model = make(True, n_layer=9)
    randomize_routers(model)

    def grads(idx):
        model.zero_grad()
        model(idx, idx)[1].backward()
        return [W.grad.clone() for W in routers(model)]

    a, b = torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (3, 16))
    KVStack.spare = None
    fresh = grads(a)
    assert KVStack.spare is not None
    KVStack.spare.fill_(float("nan"))                # poison the buffer the next backward reuses
    assert all(torch.equal(x, y) for x, y in zip(grads(a), fresh))
    grads(b)                                         # another shape: a new buffer
    assert KVStack.spare.shape[0] == 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(a, a)[1]
    model.zero_grad()
    loss.backward()
    for W, g in zip(routers(model), fresh):
        assert W.grad.dtype == torch.float32
        assert (W.grad - g).norm() < 0.05 * g.norm()


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
    bench.main(["--depths=2", "--n_embd=16", "--n_head=2", "--block_size=8", "--batch_size=2",
                "--vocab_size=11", "--deep=False", "--warmup=0", "--repeats=1", "--rounds=1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("2 layers")]
    assert len(rows) == 1
    assert float(rows[0][8]) == pytest.approx(lime["flops"] / base["flops"], abs=1e-3)  # FLOP x column
    assert float(rows[0][9]) == pytest.approx(lime["act_bytes"] / base["act_bytes"], abs=1e-3)


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
        GPT(tiny_config(False, n_embd=30, n_head=4))
    with pytest.raises(ValueError, match="even"):
        GPT(tiny_config(False, n_embd=12, n_head=4))
    model = make(True)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="batch, time"):
        model(torch.zeros(8, dtype=torch.long))


# ----------------------------------------------------------------------------- prepare_data.py: corpora, tokenizers, dataset files

DATA_TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20

def _tiny_encoding(special_tokens=None):
    # a byte-level BPE made up here: the 256 single bytes plus two merges, no download
    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"sp"], ranks[b"spe"] = 256, 257
    return tiktoken.Encoding(name="tiny", pat_str=r"""\S+|\s+""", mergeable_ranks=ranks,
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

def test_data_gpt2_offline_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))
    def no_network(*a, **k):
        raise OSError("no network in tests")
    monkeypatch.setattr(prepare_data.socket, "create_connection", no_network)
    monkeypatch.setattr(prepare_data, "download", lambda *a, **k: pytest.fail("should fail before downloading"))
    with pytest.raises(ValueError, match="--tokenizer=char.*TIKTOKEN_CACHE_DIR"):
        prepare_data.main([f"--data_dir={tmp_path}", "--tokenizer=gpt2"])

def test_data_cli_error_is_one_line(tmp_path):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prepare_data.py")
    r = subprocess.run([sys.executable, script, "--input=missing.txt"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []


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
    with pytest.raises(ValueError, match="distinct expressions"):  # 2 operands mod 3: only 33 expressions exist
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


def test_train_resume_is_exact(tiny_data, tmp_path):
    flags = tiny_data("--lime=True", "--dropout=0.1", "--gradient_accumulation_steps=2", "--lr_decay_iters=8")
    train.main(flags + ["--max_iters=8", f"--out_dir={tmp_path / 'a'}"])
    train.main(flags + ["--max_iters=4", f"--out_dir={tmp_path / 'b'}"])
    with open(tmp_path / "b" / "log.jsonl", "a") as f:  # a record past the checkpoint must be dropped
        f.write(json.dumps(dict(iter=5, tokens=0, flops=0, train_loss=9.0)) + "\n")
    train.main([f"--out_dir={tmp_path / 'b'}", "--resume=True", "--max_iters=8", "--device=cpu"])
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert [r["iter"] for r in a] == [r["iter"] for r in b] == [0, 2, 4, 6, 8]
    for ra, rb in zip(a, b):
        for k in ("train_loss", "val_loss", "lr", "flops"):
            assert (k in ra) == (k in rb)
            if k in ra:
                assert abs(ra[k] - rb[k]) <= 1e-6, (ra, rb)


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


def test_train_summary_crossing():
    base = log([0, 10, 20, 30], [4.0, 3.0, 2.5, 2.0])
    lime = log([0, 11, 22, 33], [4.0, 2.8, 1.9, 1.8])
    s = train.summarize([7], [base], [lime])
    p = s["per_seed"][0]
    assert p["baseline_val_loss"] == 2.0 and p["lime_val_loss"] == 1.8
    assert p["lime_flops_to_match"] == pytest.approx(11 + 11 * 0.8 / 0.9)  # linear between (11, 2.8), (22, 1.9)
    assert p["ratio"] == pytest.approx((11 + 11 * 0.8 / 0.9) / 30)
    assert "0.69x the baseline's total FLOPs" in "\n".join(train.format_summary(s))
    never = train.summarize([7], [base], [log([0, 11, 22, 33], [4.0, 3.5, 3.0, 2.5])])
    assert never["per_seed"][0]["ratio"] is None and never["mean_curve"]["ratio"] is None
    assert "never" in "\n".join(train.format_summary(never))


def test_train_multiseed_aggregation():
    bases = [log([0, 10, 20], [4.0, 3.0, 2.0]), log([0, 10, 20], [4.2, 3.2, 2.4])]
    limes = [log([0, 11, 22], [4.0, 2.0, 1.5]), log([0, 11, 22], [4.2, 3.0, 2.5])]
    flops, mean, lo, hi = train.mean_band(bases, "val_loss")
    assert list(flops) == [0, 10, 20] and list(mean) == pytest.approx([4.1, 3.1, 2.2])
    assert list(lo) == [4.0, 3.0, 2.0] and list(hi) == [4.2, 3.2, 2.4]
    s = train.summarize([1, 2], bases, limes)
    assert s["baseline"]["val_loss_mean"] == pytest.approx(2.2)
    assert s["baseline"]["val_loss_std"] == pytest.approx(np.std([2.0, 2.4], ddof=1))
    assert s["lime"]["val_loss_mean"] == pytest.approx(2.0)
    assert s["per_seed"][0]["ratio"] == pytest.approx(11 / 20)  # seed 1: 2.0 reached at the 11 point
    assert s["per_seed"][1]["ratio"] is None  # seed 2: LIMe ends at 2.5 > 2.4
    # mean curves: LIMe mean (4.1, 2.5, 2.0) reaches 2.2 between 11 and 22: 11 + 11 * 0.3 / 0.5
    assert s["mean_curve"]["lime_flops_to_match"] == pytest.approx(11 + 11 * 0.3 / 0.5)
    assert "1: 0.55x, 2: never" in "\n".join(train.format_summary(s))


def test_train_plot_from_logs(tmp_path):
    cfg = dict(train.PRESETS["cpu"], dataset="x", router_lr=1e-2, seed=1)
    for d, lg in [("baseline", log([0, 10, 20], [4.0, 3.0, 2.0])), ("lime", log([0, 11, 22], [4.0, 2.5, 1.9])),
                  ("baseline_seed2", log([0, 10, 20], [4.1, 3.1, 2.2])),
                  ("lime_seed2", log([0, 11, 22], [4.1, 2.4, 2.0]))]:
        os.makedirs(tmp_path / d)
        with open(tmp_path / d / "log.jsonl", "w") as f:
            f.write(json.dumps({"config": dict(cfg, seed=int(d[-1]) if d[-1].isdigit() else 1)}) + "\n")
            f.writelines(json.dumps(r) + "\n" for r in lg)
    s = train.main([f"--plot={tmp_path}"])
    assert s["seeds"] == [1, 2]
    with open(tmp_path / "loss_vs_flops.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(tmp_path / "loss_vs_flops.png") > 10_000
    with open(tmp_path / "summary.json") as f:
        assert json.load(f)["per_seed"][1]["seed"] == 2


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
    with pytest.raises(train.NonFiniteLoss, match="training loss is nan at iteration 6.*iter 4"):
        train.main(tiny_data("--max_iters=10", f"--out_dir={out}"))
    assert issubclass(train.NonFiniteLoss, ValueError)  # so __main__ prints one line and exits 1
    _, ckpt = common.load_checkpoint(out)
    assert ckpt["iter_num"] == 4 and all(torch.isfinite(t).all() for t in ckpt["model"].values())


def test_train_cli_error_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), f"--data_dir={tmp_path}", "--dataset=nope"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no dataset at") and "prepare_data.py" in lines[0]


def test_train_compare_two_seeds(tiny_data, tmp_path, monkeypatch):
    analyzed = []
    monkeypatch.setattr(train, "run_analyze", lambda out_dir, device="auto": analyzed.append(out_dir))
    out = str(tmp_path / "cmp")
    s = train.main(tiny_data("--compare", "--seeds=2", "--max_iters=4", f"--out_dir={out}", "--seed=5"))
    assert sorted(os.listdir(out)) == ["baseline", "baseline_seed6", "lime", "lime_seed6", "loss_vs_flops.png",
                                       "summary.json"]
    assert s["seeds"] == [5, 6] and [p["seed"] for p in s["per_seed"]] == [5, 6] and analyzed == [out]
    for d, lime, seed in [("baseline", False, 5), ("lime", True, 5),
                          ("baseline_seed6", False, 6), ("lime_seed6", True, 6)]:
        _, ckpt = common.load_checkpoint(os.path.join(out, d))
        assert ckpt["config"]["lime"] == lime and ckpt["config"]["seed"] == seed and ckpt["iter_num"] == 4
    before = open(os.path.join(out, "lime", "log.jsonl")).read()
    train.main(tiny_data("--compare", "--seeds=2", "--max_iters=4", f"--out_dir={out}", "--seed=5", "--resume"))
    assert open(os.path.join(out, "lime", "log.jsonl")).read().split("\n")[1:] == before.split("\n")[1:]


def test_train_task_compare_end_to_end(task_data, tmp_path, monkeypatch, capsys):
    d, meta = task_data
    analyzed = []
    monkeypatch.setattr(train, "run_analyze", lambda out_dir, device="auto": analyzed.append(out_dir))
    out = str(tmp_path / "cmp")
    s = train.main([f"--data_dir={d}", "--dataset=arith", "--compare", "--preset=arithmetic", "--seeds=2",
                    "--max_iters=4", "--eval_interval=2", "--log_interval=2", "--batch_size=8", "--eval_iters=2",
                    "--warmup_iters=1", "--device=cpu", f"--out_dir={out}"])
    assert sorted(os.listdir(out)) == ["accuracy_vs_flops.png", "baseline", "baseline_seed1338", "lime",
                                       "lime_seed1338", "loss_vs_flops.png", "summary.json"] and analyzed == [out]
    T = meta["row_length"] - 1
    for v in ("baseline", "lime"):
        model, ckpt = common.load_checkpoint(os.path.join(out, v))
        assert ckpt["config"]["block_size"] == T and ckpt["model_args"]["n_embd"] == 32  # the preset's shape
        recs = records(os.path.join(out, v))
        evals = [r for r in recs if "val_loss" in r]
        assert [r["iter"] for r in evals] == [0, 2, 4] and all(0 <= r["accuracy"] <= 1 for r in evals)
        assert all(r["flops"] == 3 * model.flops_per_token(T) * r["iter"] * 8 * T for r in recs)  # padding counted
        test = train.read_test_accuracy(os.path.join(out, v, "log.jsonl"))
        assert test["test_problems"] == 20 and test["at_iter"] == 4 and 0 <= test["test_accuracy"] <= 1
    a = s["accuracy"]
    assert [p["seed"] for p in a["per_seed"]] == [1337, 1338]
    assert a["lime_test_accuracy_mean"] == pytest.approx(np.mean([p["lime_test_accuracy"] for p in a["per_seed"]]))
    printed = capsys.readouterr().out
    assert "accuracy (greedy, final answer correct)" in printed and "test accuracy" in printed
    with pytest.raises(ValueError, match="rows of .* drop --block_size"):
        train.main([f"--data_dir={d}", "--dataset=arith", "--preset=arithmetic", "--block_size=16", "--max_iters=1",
                    f"--out_dir={tmp_path / 'x'}", "--device=cpu"])


# ----------------------------------------------------------------------------- sample.py

SAMPLE_TEXT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me!\n" * 20


def make_ckpt(out_dir, data_dir, lime=True, block_size=32):
    """A tiny untrained GPT saved the way train.py saves one, with a char dataset's meta."""
    meta = prepare(SAMPLE_TEXT, data_dir, tokenizer="char")
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=meta["vocab_size"], block_size=block_size, n_layer=2, n_head=2, n_embd=16,
                       multiple_of=16, lime=lime)
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


def test_sample_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"ckpt\.pt.*python train\.py"):
        sample.main([f"--out_dir={tmp_path / 'nothing'}", "--device=cpu"])


def test_sample_cli_errors_are_one_line(ckpt_dir, tmp_path):
    for args, expected in [([f"--out_dir={tmp_path / 'nothing'}"], "ckpt.pt"),
                           ([f"--out_dir={ckpt_dir}", "--start=Zebra"], "'Z'")]:
        r = subprocess.run([sys.executable, "sample.py", "--device=cpu", *args], cwd=HERE,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and r.stdout == ""
        assert r.stderr.startswith("error: ") and expected in r.stderr
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1


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


# ----------------------------------------------------------------------------- analyze.py: router maps and value entropy

ANALYZE_TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n" * 30


def tiny_gpt(lime, n_layer=3, n_head=2, vocab_size=40, block_size=16):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                         n_embd=8 * n_head, multiple_of=16, lime=lime))


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


def make_run(out_dir, data_dir, lime):
    """A tiny untrained GPT saved the way train.py saves one (no training needed for the figures)."""
    meta = prepare(ANALYZE_TEXT, data_dir, tokenizer="char") if not os.path.exists(data_dir) else \
        json.load(open(os.path.join(data_dir, "meta.json")))
    model = tiny_gpt(lime, vocab_size=meta["vocab_size"])
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
    assert saved["router"]["heads_layer"] == 2 and len(saved["router"]["shares"]) == 3
    for run in ["baseline", "lime"]:
        ent = result["value_entropy"]["per_layer"][run]
        assert len(ent) == 3 and all(0 < e <= math.log(16) + 1e-9 for e in ent)
    assert saved["runs"]["lime"]["sequences"] == 12  # eval_iters=3 fixed val batches of 4
    single = analyze.analyze_compare(str(out / "lime"))  # a single (non --compare) run folder works too
    assert single["router"]["shares"] == saved["router"]["shares"] and os.path.getsize(out / "lime" / "router_map.png")


def test_analyze_cli_error_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "analyze.py", str(tmp_path)], cwd=HERE, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "python train.py --compare" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0
