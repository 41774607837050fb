"""
A LLaMA-style GPT with one switch, `lime`.

  lime=False: a standard decoder. Every attention layer reads keys/values computed from its own input.
  lime=True:  LIMe (Layer-Integrated Memory, Gerasimov et al., arXiv 2502.09245). Every head of layer l
              reads a learned mix of the key/value heads of ALL layers 0..l:

                  k~_l[t, r] = sum_j W_l[r, j] * k_stack[t, j]     (same W_l for the values)

              where k_stack holds the raw heads of layers 0..l, layer-major, and W_l is (H, (l+1)*H).

Everything LIMe-specific is in the section "LIMe: the layer-integrated key/value mix" below: read lime_mix()
and PlainMix first (the formula as written), then FusedMix/_FusedMixFn (the same numbers, fast). The rest is the
usual LLaMA recipe: RMSNorm, RoPE (rotate-half), SwiGLU, no biases, tied embeddings. A second, independent
switch, `hc_rate`, gives Hyper-Connections (the paper's other baseline, n residual streams): see HyperConnection.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 50304   # number of tokens the embedding and LM head know
    block_size: int = 256     # longest sequence the model sees (RoPE tables are built this long)
    n_layer: int = 8          # number of transformer blocks
    n_head: int = 8           # attention heads per layer (keys/values have as many heads: no GQA)
    n_embd: int = 256         # model width D; head dim is n_embd // n_head and must be even (RoPE)
    multiple_of: int = 64     # SwiGLU hidden width = 8/3 * n_embd rounded up to a multiple of this
    dropout: float = 0.0      # dropout on attention weights and residual branches (0 = off)
    lime: bool = False        # the switch: True mixes K/V heads of all earlier layers (LIMe)
    fused_mix: bool = True    # LIMe's mix: False = the plain formula (PlainMix); True = same numbers, fast (FusedMix)
    lime_kv: str = "kv"       # LIMe mixes "kv" keys and values (the paper), "k" keys, "v" values (the other: own)
    lime_sources: str = "all" # layers mixed with l's own: "all" 0..l-1 (the paper), "first" 0, "previous" l-1
    rope_theta: float = 10000.0  # RoPE base frequency
    hc_rate: int = 0          # Hyper-Connections: 0 = off (one residual stream); n >= 1 = n streams (paper: 4)
    hc_dynamic: bool = True   # HC's weights: True = static + input-dependent (the paper's); False = static only

    @property
    def mlp_hidden(self):
        return self.multiple_of * math.ceil(8 * self.n_embd / 3 / self.multiple_of)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in at least float32 (never downcasts a float64 model)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_tables(head_dim, length, theta):
    """cos/sin tables of shape (length, head_dim) for the rotate-half layout."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)  # (length, hd/2)
    angles = torch.cat([angles, angles], dim=-1)                               # (length, hd)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate pairs (i, i + hd/2) of x: (B, H, T, hd) by position-dependent angles; cos/sin: (T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# ----------------------------------------------------------------------------------------------------
# LIMe: the layer-integrated key/value mix
#
# Each layer l computes raw keys and values kv_l from its own input, as usual. With LIMe, attention in
# layer l does not use kv_l directly but a per-head mix over the raw heads of layers 0..l:
#
#     mixed_l = W_l @ stack[0..l]      W_l: (H, (l+1)*H),  stack[0..l]: ((l+1)*H, everything else)
#
# i.e. for every position, every output head r is a weighted sum of source heads j, with the SAME weights for
# keys and values, no softmax and no mixing across time (so causality is untouched). Layer 0 has no router: it
# uses its own kv_0. lime_mix() is that formula; PlainMix runs it layer by layer (GPTConfig.fused_mix=False).
# Two switches take the method apart (the defaults are the paper): lime_kv mixes only the keys or only the values
# (the other is the layer's own), lime_sources lets W_l read only some layers (a fixed 0/1 mask on its columns).
#
# Stacked, the routers form one block-lower-triangular matrix M, (L*H, L*H), row block l = [W_l, 0] for
# l >= 1: the mixes are M @ raw, but raw_l exists only once layer l has run. The fast path (FusedMix + _FusedMixFn)
# computes exactly that, without the traps of the plain version (concatenate layers 0..l at each layer):
#   memory: autograd would keep every concatenation, O(L^2). Here the raw K/V of all layers live ONCE in a
#           buffer (B, n, L, H, T, hd) that the last layer saves for backward (n = 2 keys and values, or 1 with
#           lime_kv "k" or "v"). Seen as (n*B, L*H, T*hd), layers 0..l are its first (l+1)*H rows: a mix is a
#           batched matmul on a view, no copies.
#   time:   the mix is memory-bound, and layer by layer, layer l would reread all l+1 raw K/V. So layers
#           go in groups of `group`: when a group starts, the layers before it are final, and ONE matmul
#           reads them for the whole group (`partial`); each layer then adds its group's layers. Backward
#           does the same with M^T (the gradient of raw_m sums over its readers l >= m). The router
#           gradients need both buffers complete: every router is an input of layer 0's mix, whose
#           backward runs last and computes them all in a few big matmuls.
# ----------------------------------------------------------------------------------------------------

def lime_mix(kvs, W):
    """The formula for one layer l >= 1. kvs: the raw keys (or values) of layers 0..l, each (..., H, hd);
    W: W_l, (H, (l+1)*H). Returns the mixed keys (or values), (..., H, hd)."""
    # >>> exercise 1: lime_mix
    stack = torch.cat(kvs, dim=-2)                          # (..., (l+1)*H, hd), layer-major source heads
    return torch.einsum("rj,...jd->...rd", W, stack)        # (..., H, hd): head r = sum_j W[r, j] * head j
    # <<< exercise 1


# The switches that take the method apart (lime_kv, lime_sources; the defaults are the paper's):
LIME_KV = {"kv": slice(0, 2), "k": slice(0, 1), "v": slice(1, 2)}  # lime_kv -> what is mixed of kv's (keys, values)
LIME_SOURCES = ("all", "first", "previous")                          # lime_sources


def source_mask(l, H, sources):
    """W_l's columns that lime_sources lets layer l read, ((l+1)*H,) of 0/1: its own heads and those of layers
    0..l-1 ("all"), layer 0 ("first") or layer l-1 ("previous")."""
    mask = torch.zeros(l + 1, H)                                    # (source layer, head)
    mask[list({"all": range(l + 1), "first": (0, l), "previous": (l - 1, l)}[sources])] = 1.0
    return mask.view(-1)                                            # ((l+1)*H,), layer-major like W_l's columns


def source_routers(routers, sources):
    """W_1 .. W_{L-1} as the mix uses them: times their source_mask, so the columns of the layers not read are
    exactly 0 and get zero gradient. The mix still multiplies by them (it pays for the full matmul)."""
    if sources == "all":
        return routers
    return [W * source_mask(l, W.shape[0], sources).to(W) for l, W in enumerate(routers, start=1)]


def keys_values(kv, lime_kv, mixed):
    """The k, v attention uses, each (B, H, T, hd): the mixed ones (in the order of lime_kv) for what lime_kv
    names, the layer's own raw ones (kv: (B, T, 2, H, hd)) for the rest."""
    own = dict(zip("kv", kv.permute(2, 0, 3, 1, 4).unbind(0)))      # "k", "v": (B, H, T, hd)
    own.update(zip(lime_kv, mixed))
    return own["k"], own["v"]


class PlainMix:
    """LIMe as written: keep every layer's raw K/V; layer l concatenates layers 0..l and mixes them with W_l.
    Autograd keeps each concatenation, O(L^2) activation memory, and does L^2/2 small products (FusedMix doesn't)."""

    def __init__(self, routers, lime_kv="kv"):
        self.routers = routers  # W_1 .. W_{L-1}: layer 0 has no router
        self.lime_kv = lime_kv  # what is mixed: "kv", "k" or "v"
        self.raw = []           # raw K/V (the part that is mixed) of the layers run so far, each (B, T, n, H, hd)

    def __call__(self, l, kv):
        """kv: layer l's raw keys/values (B, T, 2, H, hd) -> the k, v its attention uses, each (B, H, T, hd)."""
        self.raw.append(kv[:, :, LIME_KV[self.lime_kv]])                   # (B, T, n, H, hd), n = 2 or 1
        mixed = self.raw[-1] if l == 0 else lime_mix(self.raw, self.routers[l - 1])  # (B, T, n, H, hd)
        return keys_values(kv, self.lime_kv, mixed.permute(2, 0, 3, 1, 4).unbind(0))


class FusedMix:
    """LIMe's fast path: the same numbers as PlainMix through one buffer shared by every layer's mix during a
    forward and backward pass (GPTConfig.fused_mix=True)."""

    def __init__(self, routers, scratch, lime_kv="kv", group=6):
        self.routers = routers  # W_1 .. W_{L-1} (layer 0 has none), inputs of layer 0's mix
        self.n_layer = len(routers) + 1
        self.scratch = scratch  # the model's dict that keeps the last backward's `grad` buffer for reuse (CPU)
        self.lime_kv = lime_kv  # what is mixed: "kv" (n = 2 planes in the buffers below), "k" or "v" (n = 1)
        self.group = group      # layers per group: any value gives the same result; 4-8 ran alike here
        self.M = None           # (L*H, L*H) the routers as one block-lower-triangular matrix, detached
        self.buf = None         # (B, n, L, H, T, hd) raw keys/values of every layer, filled by forward
        self.grad = None        # (B, n, L, H, T, hd) d loss / d mixed K/V of every layer, filled by backward
        self.partial = None     # (n*B, group*H, T*hd) the current group's sums over the layers outside it

    def __call__(self, l, kv):
        """Same contract as PlainMix. Every router enters at layer 0, whose backward runs last (_FusedMixFn)."""
        mixed = _FusedMixFn.apply(kv[:, :, LIME_KV[self.lime_kv]], self, l, *(self.routers if l == 0 else ()))
        return keys_values(kv, self.lime_kv, mixed)


class _FusedMixFn(torch.autograd.Function):
    """k, v of layer l = W_l @ (raw K/V of layers 0..l), through the shared buffer."""

    @staticmethod
    def forward(ctx, kv, stack, l, *routers):  # routers: W_1 .. W_{L-1}, given to layer 0 only
        B, T, n, H, hd = kv.shape                                     # kv: (B, T, n, H, hd), n = 2 (k, v) or 1
        L, g = stack.n_layer, stack.group
        if l == 0:
            stack.buf = kv.new_empty(B, n, L, H, T, hd)
            stack.M = kv.new_zeros(L * H, L * H)
            for j, W in enumerate(routers, start=1):                  # (no grad is recorded in here)
                stack.M[j * H:(j + 1) * H, :(j + 1) * H] = W
        M, buf = stack.M, stack.buf
        buf[:, :, l] = kv.permute(0, 2, 3, 1, 4)                      # (B, n, H, T, hd)
        raw = buf.view(n * B, L * H, T * hd)                          # rows: (layer, head)
        ctx.stack, ctx.l = stack, l
        if l == L - 1:
            ctx.save_for_backward(buf)  # the buffer is complete now: this is the one copy autograd keeps
            stack.buf = None
        a = l - l % g                                                 # l's group starts at layer a
        if l == a and a > 0:                                          # layers < a, for the whole group
            stack.partial = M[a * H:(a + g) * H, :a * H] @ raw[:, :a * H]          # (n*B, g*H, T*hd)
        if l == 0:
            mixed = raw[:, :H].clone()                                # layer 0 reads only itself
        else:                                                         # W_l on the group's layers a..l
            mixed = M[l * H:(l + 1) * H, a * H:(l + 1) * H] @ raw[:, a * H:(l + 1) * H]  # (n*B, H, T*hd)
            if a > 0:
                mixed += stack.partial[:, (l - a) * H:(l - a + 1) * H]   # + W_l on the layers before a
        return mixed.view(B, n, H, T, hd).unbind(1)                   # k, v (or one): (B, H, T, hd)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *dmixed):                                       # d k, d v (or one): (B, H, T, hd)
        stack, l = ctx.stack, ctx.l
        L, g, M = stack.n_layer, stack.group, stack.M
        (B, H, T, hd), n = dmixed[0].shape, len(dmixed)
        if l == L - 1:                                                # first layer visited by backward
            stack.buf = ctx.saved_tensors[0]
            spare = stack.scratch.pop("grad", None)  # a fresh 100 MB+ CPU buffer costs page faults
            fits = spare is not None and spare.shape == stack.buf.shape and spare.dtype == stack.buf.dtype
            stack.grad = spare if fits and spare.device == stack.buf.device else torch.empty_like(stack.buf)
        for i, d in enumerate(dmixed):
            stack.grad[:, i, l] = d
        raw, grad = stack.buf.view(n * B, L * H, T * hd), stack.grad.view(n * B, L * H, T * hd)
        a = l - l % g
        b = min(a + g, L)                                             # l's group: layers a..b-1
        if l == b - 1 and b < L:                                      # readers >= b, for the whole group
            stack.partial = M[b * H:, a * H:b * H].t() @ grad[:, b * H:]           # (n*B, g*H, T*hd)
        # d raw_l = sum over readers j >= l of W_j[:, l's columns]^T @ grad_j; here the group's readers
        lo = max(l, 1)
        dkv = M[lo * H:b * H, l * H:(l + 1) * H].t() @ grad[:, lo * H:b * H]  # (n*B, H, T*hd)
        if b < L:
            dkv += stack.partial[:, (l - a) * H:(l - a + 1) * H]     # + the readers above the group
        if l == 0:
            dkv += grad[:, :H]                                        # layer 0 also reads itself
        dkv = dkv.view(B, n, H, T, hd).permute(0, 3, 1, 2, 4)         # (B, T, n, H, hd)
        if l > 0:
            return dkv, None, None
        # Layer 0 comes last: dW_j = sum over the batch of grad_j @ raw[0..j]^T for every router, i.e.
        # dM = grad @ raw^T on M's lower blocks, group by group: a few big matmuls, no wasted FLOPs.
        acc = torch.promote_types(M.dtype, torch.float32)
        dM = torch.zeros(M.shape, dtype=acc, device=M.device)
        for a in range(0, L, g):
            b = min(a + g, L)
            if a > 0:                                                 # the group's rows, earlier columns
                dM[a * H:b * H, :a * H] = (grad[:, a * H:b * H] @ raw[:, :a * H].mT).sum(0, dtype=acc)
            for j in range(max(a, 1), b):                             # inside the group: W_j's own part
                dM[j * H:(j + 1) * H, a * H:(j + 1) * H] = (
                    grad[:, j * H:(j + 1) * H] @ raw[:, a * H:(j + 1) * H].mT).sum(0, dtype=acc)
        if stack.grad.device.type == "cpu":  # (CUDA's caching allocator reuses memory by itself)
            stack.scratch["grad"] = stack.grad
        stack.buf = stack.grad = stack.partial = None                 # done: drop the scratch space
        return dkv, None, None, *[dM[j * H:(j + 1) * H, :(j + 1) * H].to(W.dtype)
                                  for j, W in enumerate(stack.routers, start=1)]


# ----------------------------------------------------------------------------------------------------
# The transformer
# ----------------------------------------------------------------------------------------------------

class KVCache:
    """Keys (after RoPE) and values that each layer's attention used, for the tokens seen so far.
    With LIMe these are the MIXED keys/values, so the cache is exactly as big as the baseline's."""

    def __init__(self, n_layer):
        self.k, self.v = [None] * n_layer, [None] * n_layer

    def __len__(self):
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def update(self, l, k, v):
        if self.k[l] is not None:
            k, v = torch.cat([self.k[l], k], dim=2), torch.cat([self.v[l], v], dim=2)  # (B, H, S, hd)
        self.k[l], self.v[l] = k, v
        return k, v


class CausalSelfAttention(nn.Module):

    def __init__(self, config, layer):
        super().__init__()
        self.layer, self.n_head, self.dropout = layer, config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)  # q, k, v projections
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.value_probe = nn.Identity()  # hook point: sees the values attention uses, (B, H, T, hd)
        # LIMe router W_l: (H, (l+1)*H), source heads layer-major; none at layer 0. See _init_routers.
        H = config.n_head
        self.router = nn.Parameter(torch.empty(H, (layer + 1) * H)) if config.lime and layer > 0 else None

    def forward(self, x, cos, sin, mixer=None, cache=None):
        B, T, C = x.shape
        H, hd = self.n_head, C // self.n_head
        q, kv = self.c_attn(x).view(B, T, 3, H, hd).split([1, 2], dim=2)  # (B, T, 1|2, H, hd)
        q = q.squeeze(2).transpose(1, 2)                            # (B, H, T, hd)
        if mixer is None:                                           # baseline: own keys/values
            k, v = kv.transpose(1, 3).unbind(2)                     # (B, H, T, hd)
        else:                                                       # LIMe: a mix of layers 0..l
            k, v = mixer(self.layer, kv)                            # (B, H, T, hd)
        v = self.value_probe(v)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)     # RoPE after the mix
        mask, causal = None, True
        if cache is not None:
            # >>> exercise 3: KV cache step
            past = 0 if cache.k[self.layer] is None else cache.k[self.layer].shape[2]
            k, v = cache.update(self.layer, k, v)                   # (B, H, past + T, hd)
            if past > 0:                                            # new tokens see all the past
                causal = False
                mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
            # <<< exercise 3
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, C)                      # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config):
        super().__init__()
        self.gate = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.up = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.down = nn.Linear(config.mlp_hidden, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.down(F.silu(self.gate(x)) * self.up(x)))


# Hyper-Connections (HC; Zhu et al. 2024, arXiv 2409.19606; GPTConfig.hc_rate = n >= 1): the residual stream
# becomes n streams h (B, T, n, D), the token embedding in each at the start, summed at the end. Around attention
# and around the MLP, a hyper-connection replaces "x + f(norm(x))" by two steps (the functions next to Block):
#   width (read):   mix = alpha^T @ h, (n+1, D) per token; f reads LayerNorm(mix[0]), mix[1..n] carry on
#   depth (write):  stream i = beta_i * f(...) + mix[1 + i]
# alpha (n, n+1) starts as [e_{l mod n} | I], beta (n,) as ones; dynamic HC adds scale * tanh(LayerNorm(h) @ fn),
# zero at init (fn = 0). Names, shapes and init are the reference code's (src/lm/hc.py in corl-team/lime).

class HyperConnection(nn.Module):
    """The learned weights of one hyper-connection, around the sub-layer of block `layer`."""

    def __init__(self, config, layer):
        super().__init__()
        n, D = config.hc_rate, config.n_embd
        alpha = torch.cat([torch.zeros(n, 1), torch.eye(n)], dim=1)  # (n, n+1): [e_{l mod n} | I]
        alpha[layer % n, 0] = 1.0
        self.static_alpha = nn.Parameter(alpha)
        self.static_beta = nn.Parameter(torch.ones(n))
        self.dynamic = config.hc_dynamic
        if self.dynamic:
            self.dynamic_alpha_fn = nn.Parameter(torch.zeros(D, n + 1))
            self.dynamic_alpha_scale = nn.Parameter(torch.full((1,), 0.01))
            self.dynamic_beta_fn = nn.Parameter(torch.zeros(D))
            self.dynamic_beta_scale = nn.Parameter(torch.full((1,), 0.01))


def width_connection(hc, h):
    """Read from the streams h (B, T, n, D): the sub-layer's input (B, T, D), then for the write: carry, beta."""
    alpha, beta = hc.static_alpha, hc.static_beta                                       # (n, n+1), (n,)
    if hc.dynamic:                                                    # + a term that depends on each token's h
        hn = F.layer_norm(h, h.shape[-1:], eps=1e-5)                                     # (B, T, n, D)
        alpha = alpha + hc.dynamic_alpha_scale * torch.tanh(hn @ hc.dynamic_alpha_fn)    # (B, T, n, n+1)
        beta_in = (hn @ hc.dynamic_beta_fn.unsqueeze(-1)).squeeze(-1)                    # (B, T, n)
        beta = beta + hc.dynamic_beta_scale * torch.tanh(beta_in)                        # (B, T, n)
    with torch.autocast(h.device.type, enabled=False):  # the streams are the residual: no bf16 rounding
        mix = alpha.to(h.dtype).mT @ h                                                  # (B, T, n+1, D)
    return mix[..., 0, :].contiguous(), mix[..., 1:, :], beta  # (a copy: backward then keeps D floats, not n+1)


def depth_connection(out, carry, beta):
    """Write back: stream i = beta_i * out + carry_i. out: the sub-layer's output (B, T, D) -> (B, T, n, D)."""
    return beta.unsqueeze(-1) * out.unsqueeze(-2) + carry


class Block(nn.Module):

    def __init__(self, config, layer):
        super().__init__()
        hc = config.hc_rate > 0  # HC: weight-free LayerNorms (eps 1e-5) in place of the RMSNorms
        norm = lambda: nn.LayerNorm(config.n_embd, elementwise_affine=False) if hc else RMSNorm(config.n_embd)
        self.ln_1 = norm()
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = norm()
        self.mlp = MLP(config)
        self.hc_attn = HyperConnection(config, layer) if hc else None  # around attention
        self.hc_mlp = HyperConnection(config, layer) if hc else None   # around the MLP

    def forward(self, x, cos, sin, mixer=None, cache=None):
        """x: the residual stream (B, T, C); with HC the n streams (B, T, n, C)."""
        if self.hc_attn is None:
            x = x + self.attn(self.ln_1(x), cos, sin, mixer, cache)
            return x + self.mlp(self.ln_2(x))
        u, carry, beta = width_connection(self.hc_attn, x)
        x = depth_connection(self.attn(self.ln_1(u), cos, sin, mixer, cache), carry, beta)
        u, carry, beta = width_connection(self.hc_mlp, x)
        return depth_connection(self.mlp(self.ln_2(u)), carry, beta)


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}; "
                             "pick n_embd as a multiple of n_head")
        if (config.n_embd // config.n_head) % 2:
            raise ValueError(f"head dim n_embd/n_head={config.n_embd // config.n_head} is odd; RoPE needs "
                             "an even head dim (change n_embd or n_head)")
        for name, allowed in (("lime_kv", LIME_KV), ("lime_sources", LIME_SOURCES)):
            value, paper = getattr(config, name), getattr(GPTConfig, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")
            if value != paper and not config.lime:
                raise ValueError(f"{name}={value!r} changes LIMe's mix, but lime=False: set lime=True")
        if config.hc_rate < 0:
            raise ValueError(f"hc_rate={config.hc_rate}: use 0 (no Hyper-Connections) or n >= 1 streams")
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, l) for l in range(config.n_layer)]),
            ln_f=RMSNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied embedding / LM head
        cos, sin = rope_tables(config.n_embd // config.n_head, config.block_size, config.rope_theta)
        self.register_buffer("rope_cos", cos.float(), persistent=False)  # (block_size, hd)
        self.register_buffer("rope_sin", sin.float(), persistent=False)  # (block_size, hd)
        self.kv_scratch = {}  # FusedMix's reusable backward buffer: this model's own, never shared
        # GPT-2 style init; residual projections scaled by 1/sqrt(2 * n_layer)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") or name.endswith("down.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        self._init_routers()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @torch.no_grad()
    def _init_routers(self):
        """W_l ~ U(-sqrt(3/fan_in), +sqrt(3/fan_in)), fan_in = the source heads layer l reads ((l+1)*H; 2*H with
        lime_sources "first" or "previous", whose other columns are 0), then its own-layer block = I.
        Drawn in a forked RNG, so every other weight (and whatever the caller draws next) is
        identical with and without LIMe for the same seed."""
        with torch.random.fork_rng(devices=[]):
            for l, block in enumerate(self.transformer.h):
                W = block.attn.router
                if W is not None:
                    # >>> exercise 2: router init
                    mask = source_mask(l, W.shape[0], self.config.lime_sources)  # ((l+1)*H,) 0/1
                    H, bound = W.shape[0], math.sqrt(3.0 / int(mask.sum()))
                    W.uniform_(-bound, bound)
                    W[:, mask == 0] = 0.0
                    W[:, -H:] = torch.eye(H)
                    # <<< exercise 2

    def get_num_params(self):
        """Number of parameters (the tied embedding / LM head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None, cache=None):
        """idx: (B, T) token ids -> logits (B, T, vocab_size) and, given targets (B, T), the mean
        cross-entropy (targets == -1 are ignored). With a KVCache, idx holds only the new tokens."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, time) token ids, got shape {tuple(idx.shape)}")
        B, T = idx.shape
        past = 0 if cache is None else len(cache)
        if past + T > self.config.block_size:
            raise ValueError(f"sequence of {past + T} tokens is longer than block_size="
                             f"{self.config.block_size}; crop it, e.g. idx[:, -block_size:]")
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}, "
                             f"got {tuple(targets.shape)}")
        x = self.transformer.drop(self.transformer.wte(idx))              # (B, T, C)
        if self.config.hc_rate:                                           # HC: the embedding in every stream
            x = x.unsqueeze(2).expand(B, T, self.config.hc_rate, x.shape[-1])  # (B, T, n, C)
        cos, sin = self.rope_cos[past:past + T], self.rope_sin[past:past + T]  # (T, hd)
        mixer = None  # LIMe: what each layer's attention reads its keys/values from (PlainMix or FusedMix)
        if self.config.lime:
            c = self.config
            routers = source_routers([b.attn.router for b in self.transformer.h[1:]], c.lime_sources)
            mixer = FusedMix(routers, self.kv_scratch, c.lime_kv) if c.fused_mix else PlainMix(routers, c.lime_kv)
        for block in self.transformer.h:
            x = block(x, cos.to(x.dtype), sin.to(x.dtype), mixer, cache)
        if self.config.hc_rate:
            x = x.sum(2)                                                  # (B, T, C): HC, the sum of the streams
        logits = self.lm_head(self.transformer.ln_f(x))                   # (B, T, vocab_size)
        loss = None
        if targets is not None:
            logits32 = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32
            loss = F.cross_entropy(logits32.view(B * T, -1), targets.reshape(B * T), ignore_index=-1)
        return logits, loss

    def flops_per_token(self, T):
        """Forward FLOPs per token of a length-T training sequence, 2 per multiply-add.
        Counted: every weight matmul (2*m*n; the tied LM head 2*D*V, the embedding lookup 0), attention's
        QK^T and AV over the FULL T x T square (what the math SDPA kernel and FlopCounterMode count; a
        causal flash kernel skips about half), each LIMe mix: 2*(l+1)*H*H*hd for keys, same for values (lime_kv
        "k" or "v": the one mixed; a restricted lime_sources still pays for all (l+1)*H columns: the mix multiplies
        the masked ones by their zeros), and in each of HC's 2 hyper-connections per block: alpha^T @ h,
        2*(n+1)*n*D, and if dynamic LayerNorm(h) @ fn for alpha and beta, 2*n*D*(n+1) + 2*n*D. Not counted: norms,
        RoPE, softmax, SiLU and other elementwise work (HC's beta * out write-back too). Training = 3x this."""
        c = self.config
        D, H, hd = c.n_embd, c.n_head, c.n_embd // c.n_head
        layer = 2 * D * 3 * D + 2 * D * D + 3 * 2 * D * c.mlp_hidden + 2 * 2 * T * D
        # >>> exercise 4: router FLOPs
        mix = sum(2 * len(c.lime_kv) * (l + 1) * H * H * hd for l in range(1, c.n_layer)) if c.lime else 0
        # <<< exercise 4
        n = c.hc_rate
        hc = 2 * (n + 1) * n * D + (2 * n * D * (n + 1) + 2 * n * D if c.hc_dynamic else 0)
        return c.n_layer * (layer + 2 * hc) + mix + 2 * D * c.vocab_size

    def configure_optimizers(self, weight_decay, learning_rate, betas=(0.9, 0.95), router_lr=1e-2,
                             device_type="cpu"):
        """AdamW with three groups: matrices and HC's dynamic weights and scales (decayed), norm weights and
        HC's static weights (not decayed), and the LIMe routers (own lr, no decay). Each group remembers its
        peak lr in "peak_lr" for the lr schedule."""
        params = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        routers = [p for n, p in params if n.endswith("attn.router")]
        decayed = lambda n, p: ".dynamic_" in n if ".hc_" in n else p.dim() >= 2  # HC's: any dim, as the reference
        decay = [p for n, p in params if decayed(n, p) and not n.endswith("attn.router")]
        no_decay = [p for n, p in params if not decayed(n, p)]
        groups = [dict(params=decay, weight_decay=weight_decay, lr=learning_rate),
                  dict(params=no_decay, weight_decay=0.0, lr=learning_rate)]
        if routers:
            groups.append(dict(params=routers, weight_decay=0.0, lr=router_lr))
        for g in groups:
            g["peak_lr"] = g["lr"]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Append max_new_tokens sampled tokens to idx (B, T), feeding the model one token at a time
        through a KV cache. temperature=0 means greedy. The model only ever sees the last block_size
        tokens: once the sequence is longer, the window slides and every key changes (RoPE positions,
        and with LIMe the mixed heads), so each step then recomputes the window, as uncached code does."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        cache = None
        for _ in range(max_new_tokens):
            if cache is not None and idx.size(1) <= self.config.block_size:
                logits, _ = self(idx[:, -1:], cache=cache)       # the cache holds all but the newest
            else:
                cache = KVCache(self.config.n_layer)
                logits, _ = self(idx[:, -self.config.block_size:], cache=cache)
            logits = logits[:, -1, :]                             # (B, vocab_size)
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
