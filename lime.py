"""
A LLaMA-style GPT with one switch, `lime`.

  lime=False: a standard decoder. Every attention layer reads keys/values computed from its own input.
  lime=True:  LIMe (Layer-Integrated Memory, Gerasimov et al., arXiv 2502.09245). Every head of layer l
              reads a learned mix of the key/value heads of ALL layers 0..l:

                  k~_l[t, r] = sum_j W_l[r, j] * k_stack[t, j]     (same W_l for the values)

              where k_stack holds the raw heads of layers 0..l, layer-major, and W_l is (H, (l+1)*H).

Everything LIMe-specific lives in the section "LIMe: the layer-integrated key/value mix" below.
The rest is the usual LLaMA recipe: RMSNorm, RoPE (rotate-half), SwiGLU, no biases, tied embeddings.
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
    rope_theta: float = 10000.0  # RoPE base frequency

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
# i.e. for every position, every output head r is a weighted sum of source heads j, with the SAME weights
# for keys and values, no softmax and no mixing across time (so causality is untouched). Layer 0 has
# no router: it uses its own kv_0. lime_mix_reference() below is that formula in a few lines.
#
# The fast path (KVStack + _LimeMix) computes exactly the same thing without the two traps of the
# naive version, where each layer concatenates the raw K/V of layers 0..l afresh:
#   memory: autograd would keep every concatenation, O(L^2) activations. Here the raw K/V of all
#           layers live ONCE in a preallocated buffer of shape (B, T, 2, hd, L, H): one row per
#           (position, key-or-value, channel) and one column per (layer, head). Layer l reads the first
#           (l+1)*H columns, an ordinary strided matrix: its mix (keys and values together) is ONE
#           matmul, (N, (l+1)*H) @ W_l^T, with no copies. (On our CPU, MKL ran the whole mix ~10% faster
#           in this layout than with heads as rows; see README, Efficiency.)
#   time:   backward visits layers in reverse, so when it reaches layer m the output gradients of all
#           layers l >= m (the ones that read layer m) are known. They are stored in a second buffer
#           `grad` (same layout), and the gradient of layer m's raw K/V is ONE matmul over its columns
#           (l >= m) instead of (L - m) small products accumulated one by one.
# Autograd sees the buffer once: the last layer saves it for backward (saved_tensors_hooks count it).
# ----------------------------------------------------------------------------------------------------

def lime_mix_reference(kvs, routers):
    """The formula, for tests. kvs: raw K or V of layers 0..l, each (B, T, H, hd); routers[l]: (H, (l+1)*H)
    (routers[0] is unused). Returns the mixed K or V of every layer, each (B, T, H, hd)."""
    out = [kvs[0]]
    for l in range(1, len(kvs)):
        stack = torch.cat(kvs[:l + 1], dim=2)                           # (B, T, (l+1)*H, hd)
        out.append(torch.einsum("rj,btjd->btrd", routers[l], stack))    # (B, T, H, hd)
    return out


def _thin_matmul(W, cols):
    """W @ cols^T -> (H, N), for W: (H, K) and cols: (N, K), the first or last K columns of a buffer row
    (N, L*H). The same product in two orientations: on our CPU, MKL ran narrow strided slices several
    times faster as W @ cols^T and (nearly) full-width ones as (cols @ W^T)^T; any BLAS gets it right."""
    narrow = 2 * cols.shape[1] <= cols.stride(0)
    return W @ cols.t() if narrow else (cols @ W.t()).t()


class KVStack:
    """Per-forward scratch space shared by the layers' mixes: the raw K/V buffer and, in backward, the
    buffer of output gradients. Holds no parameters; a new one is made for every forward pass."""

    def __init__(self, n_layer):
        self.n_layer = n_layer
        self.buf = None        # (B, T, 2, hd, L, H) raw keys/values of every layer, filled by forward
        self.grad = None       # (B, T, 2, hd, L, H) d loss / d mixed K/V of every layer, filled by backward
        self.routers = [None] * n_layer  # W_l as used in forward (in the compute dtype), for backward


class _LimeMix(torch.autograd.Function):
    """k, v of layer l = mix of the raw K/V of layers 0..l by W_l, via the shared buffer."""

    @staticmethod
    def forward(ctx, kv, router, stack, l):
        B, T, _, H, hd = kv.shape                                     # kv: (B, T, 2, H, hd)
        L = stack.n_layer
        if stack.buf is None:
            stack.buf = kv.new_empty(B, T, 2, hd, L, H)
        buf = stack.buf
        buf[..., l, :] = kv.transpose(3, 4)                           # (B, T, 2, hd, H)
        ctx.stack, ctx.l = stack, l
        if l == L - 1:
            ctx.save_for_backward(buf)  # the buffer is complete now: this is the one copy autograd keeps
            stack.buf = None
        src = buf.view(-1, L * H)[:, :(l + 1) * H]                    # (N, (l+1)*H), N = B*T*2*hd
        if router is None:                                            # layer 0 reads only itself
            mixed_t = src.t()
        else:
            W = router.to(kv.dtype)
            stack.routers[l] = W
            ctx.router_dtype = router.dtype
            mixed_t = _thin_matmul(W, src)                            # (H, N): one matmul, K and V
        k, v = mixed_t.view(H, B, T, 2, hd).permute(3, 1, 0, 2, 4).contiguous()  # 2 x (B, H, T, hd)
        return k, v

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dk, dv):
        stack, l, L = ctx.stack, ctx.l, ctx.stack.n_layer
        B, H, T, hd = dk.shape
        if l == L - 1:                                                # first layer visited by backward
            stack.buf = ctx.saved_tensors[0]
            stack.grad = torch.empty_like(stack.buf)
        buf, grad = stack.buf.view(-1, L * H), stack.grad.view(-1, L * H)  # (N, L*H)
        stack.grad[:, :, 0, :, l] = dk.permute(0, 2, 3, 1)            # (B, T, hd, H)
        stack.grad[:, :, 1, :, l] = dv.permute(0, 2, 3, 1)
        drouter = None
        if l > 0:                                                     # dW_l = grad_l^T @ buf[:, :(l+1)H]
            drouter = (grad[:, l * H:(l + 1) * H].t() @ buf[:, :(l + 1) * H]).to(ctx.router_dtype)
        # Gradient of this layer's raw K/V: every reader l' >= l used columns [l*H, (l+1)*H) of W_l'.
        # One matmul over the output gradients of all readers; layer 0 also reads itself unmixed.
        readers = range(max(l, 1), L)
        dkv_t = grad[:, :H].t() if l == 0 else None                   # (H, N)
        if len(readers):
            Wt = torch.cat([stack.routers[j][:, l * H:(l + 1) * H].t() for j in readers], dim=1)  # (H, n*H)
            prod = _thin_matmul(Wt, grad[:, readers.start * H:])                                  # (H, N)
            dkv_t = prod if dkv_t is None else dkv_t + prod
        if l == 0:
            stack.buf = stack.grad = None                             # done: free the scratch space
        return dkv_t.view(H, B, T, 2, hd).permute(1, 2, 3, 0, 4), drouter, None, None  # (B, T, 2, H, hd)


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
        # LIMe router W_l: (H, (l+1)*H), source heads in layer-major order. Layer 0 has none.
        # Filled by GPT._init_routers (uniform, own-layer block = identity).
        H = config.n_head
        self.router = nn.Parameter(torch.empty(H, (layer + 1) * H)) if config.lime and layer > 0 else None

    def forward(self, x, cos, sin, stack=None, cache=None):
        B, T, C = x.shape
        H, hd = self.n_head, C // self.n_head
        q, kv = self.c_attn(x).view(B, T, 3, H, hd).split([1, 2], dim=2)  # (B, T, 1|2, H, hd)
        q = q.squeeze(2).transpose(1, 2)                            # (B, H, T, hd)
        if stack is None:                                           # baseline: own keys/values
            k, v = kv.transpose(1, 3).unbind(2)                     # (B, H, T, hd)
        else:                                                       # LIMe: mix of layers 0..l
            k, v = _LimeMix.apply(kv, self.router, stack, self.layer)  # (B, H, T, hd)
        v = self.value_probe(v)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)     # RoPE after the mix
        mask, causal = None, True
        if cache is not None:
            past = 0 if cache.k[self.layer] is None else cache.k[self.layer].shape[2]
            k, v = cache.update(self.layer, k, v)                   # (B, H, past + T, hd)
            if past > 0:                                            # new tokens see all the past
                causal = False
                mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
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


class Block(nn.Module):

    def __init__(self, config, layer):
        super().__init__()
        self.ln_1 = RMSNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = RMSNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, stack=None, cache=None):
        x = x + self.attn(self.ln_1(x), cos, sin, stack, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}; "
                             "pick n_embd as a multiple of n_head")
        if (config.n_embd // config.n_head) % 2:
            raise ValueError(f"head dim n_embd/n_head={config.n_embd // config.n_head} is odd; RoPE needs "
                             "an even head dim (change n_embd or n_head)")
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
        """W_l ~ U(-sqrt(3/fan_in), +sqrt(3/fan_in)), fan_in = (l+1)*H, then its own-layer block = I.
        Drawn in a forked RNG, so every other weight (and whatever the caller draws next) is
        identical with and without LIMe for the same seed."""
        with torch.random.fork_rng(devices=[]):
            for block in self.transformer.h:
                W = block.attn.router
                if W is not None:
                    H, bound = W.shape[0], math.sqrt(3.0 / W.shape[1])
                    W.uniform_(-bound, bound)
                    W[:, -H:] = torch.eye(H)

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
        cos, sin = self.rope_cos[past:past + T], self.rope_sin[past:past + T]  # (T, hd)
        stack = KVStack(self.config.n_layer) if self.config.lime else None
        for block in self.transformer.h:
            x = block(x, cos.to(x.dtype), sin.to(x.dtype), stack, cache)
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
        causal flash kernel skips about half), and each LIMe mix: 2*(l+1)*H*H*hd for keys, same for values.
        Not counted: norms, RoPE, softmax, SiLU and other elementwise work. Training = 3x this."""
        c = self.config
        D, H, hd = c.n_embd, c.n_head, c.n_embd // c.n_head
        layer = 2 * D * 3 * D + 2 * D * D + 3 * 2 * D * c.mlp_hidden + 2 * 2 * T * D
        mix = sum(2 * 2 * (l + 1) * H * H * hd for l in range(1, c.n_layer)) if c.lime else 0
        return c.n_layer * layer + mix + 2 * D * c.vocab_size

    def configure_optimizers(self, weight_decay, learning_rate, betas=(0.9, 0.95), router_lr=1e-2,
                             device_type="cpu"):
        """AdamW with three groups: matrices (decayed), norm weights (not decayed) and the LIMe routers
        (own lr, no decay). Each group remembers its peak lr in "peak_lr" for the lr schedule."""
        params = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        routers = [p for n, p in params if n.endswith("attn.router")]
        decay = [p for n, p in params if p.dim() >= 2 and not n.endswith("attn.router")]
        no_decay = [p for n, p in params if p.dim() < 2]
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
