"""
Turn a text corpus into data/<name>/{train.bin, val.bin, meta.json} for train.py.

    python prepare_data.py                                  # tiny Shakespeare, char-level -> data/quickstart/
    python prepare_data.py --input=my.txt                   # your own UTF-8 text -> data/my/
    python prepare_data.py --input a.txt b.txt --name=ab    # several files, concatenated (or --input=a.txt --input=b.txt)
    python prepare_data.py --input=my.txt --tokenizer=gpt2  # GPT-2 BPE: tiktoken's r50k_base (one file, fetched once)
    python prepare_data.py --task=arithmetic --operands=6   # synthetic task -> data/arithmetic6/ (see below)

With no network the default falls back to a corpus every Python ships with: the reference docs
in pydoc_data.topics (~465 KB of English prose), so the quick start works offline.

train.bin / val.bin are flat little-endian token ids (uint16 if the vocab fits, else uint32);
val is the last --val_fraction of the tokens. meta.json holds everything needed to decode them
(no pickle). train.py and sample.py use load_meta() and get_tokenizer() from here.

--task=arithmetic writes a row dataset instead: train/val/test.bin hold one problem per row, padded to
meta["row_length"] tokens ("layout": "rows" in meta.json, which also gives the pad, end and "=" ids);
see the arithmetic task section below for the format.
"""

import argparse
import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import socket
import sys
import tempfile
import threading
import urllib.request
import uuid

import numpy as np

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
DATASET_FILES = {"train.bin", "val.bin", "test.bin", "meta.json"}  # what a dataset folder may hold
# --tokenizer=gpt2 is tiktoken's r50k_base: GPT-2's 50,257 ranks, split pattern and <|endoftext|> in one 0.8 MB
# file, hash-checked and cached by tiktoken. Its "gpt2" encoding is the same BPE from two files (vocab.bpe +
# encoder.json); datasets made with it (or made before meta.json named the encoding) read back as r50k_base
GPT2_ENCODING = "r50k_base"
GPT2_ENCODINGS = {"gpt2", "r50k_base"}  # tiktoken names of GPT-2's BPE
GPT2_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
GPT2_CACHE_NAME = hashlib.sha1(GPT2_URL.encode()).hexdigest()  # the file name tiktoken caches it under

# -----------------------------------------------------------------------------
# writing files atomically (every script writes through this)

def _umask():
    umask = os.umask(0)  # the only way to read it is to set it
    os.umask(umask)
    return umask

@contextlib.contextmanager
def atomic_file(path, mode="w"):
    """`with atomic_file(path) as f:` writes a fresh temp file next to path (a unique name, created
    exclusively, so never through a symlink someone left there), renamed over path only when the block
    succeeds. path is always either the old file or the whole new one; the temp file never stays behind."""
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.",
                                   suffix=".tmp")
    except OSError as e:  # name the file we meant to write, not the temp name
        raise OSError(e.errno, e.strerror, path) from None
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        os.chmod(tmp, 0o666 & ~_umask())  # the permissions open() would have given it (mkstemp's are 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # no space left on the device; the user's disk quota is used up

def disk_full(e):
    """The OSError behind exception e that says the disk (or quota) is full, or None. Also looks at what e was
    raised from or while handling: torch.save reports a full disk as a RuntimeError ("enforce fail at
    inline_container.cc") raised while handling the OSError."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL_DISK_ERRNOS:
            return e
        e = e.__cause__ or e.__context__
    return None

class DiskFullError(OSError):
    """A write failed because the disk is full. str() is the whole message: what failed and what was kept."""
    def __str__(self):
        return self.strerror

@contextlib.contextmanager
def on_full_disk(path, kept):
    """`with on_full_disk(path, kept):` turns a write inside that fails because the disk is full (however the
    library reports it, see disk_full) into one DiskFullError: "the disk is full (...) while writing <path>;
    <kept>". kept says what the user still has and what to do, e.g. "the previous checkpoint is unchanged".
    Every other error passes through as it is."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        full = disk_full(e)
        if full is None:
            raise
        raise DiskFullError(full.errno, f"the disk is full ({os.strerror(full.errno)}) while writing {path}; "
                                        f"{kept}") from None

# -----------------------------------------------------------------------------
# tokenizers: everything is rebuilt from meta.json alone

class CharTokenizer:
    def __init__(self, chars):
        self.itos = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.vocab_size = len(self.itos)

    def encode(self, text):
        missing = [c for c in dict.fromkeys(text) if c not in self.stoi]  # unique, in order of appearance
        if missing:
            raise ValueError(f"text has characters not in the vocabulary: {', '.join(map(repr, missing))}")
        return [self.stoi[c] for c in text]

    def decode(self, ids):
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range for a vocab of {self.vocab_size}: {bad[:5]}")
        return "".join(self.itos[i] for i in ids)

class TiktokenTokenizer:
    def __init__(self, enc):
        self.enc = enc
        self.vocab_size = enc.n_vocab

    def encode(self, text):
        return self.enc.encode_ordinary(text)  # ordinary: "<|endoftext|>" in text is just text

    def decode(self, ids):
        return self.enc.decode([int(i) for i in ids])

def gpt2_cache_file():
    """Where tiktoken caches r50k_base's file: TIKTOKEN_CACHE_DIR (else DATA_GYM_CACHE_DIR, else a temp
    folder) / sha1 of its URL, as tiktoken.load.read_file_cached does. None when caching is off ("")."""
    cache = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR",
                           os.path.join(tempfile.gettempdir(), "data-gym-cache")))
    return os.path.join(cache, GPT2_CACHE_NAME) if cache else None

def load_gpt2(offline_hint=None):
    """GPT-2's BPE as tiktoken's r50k_base, failing fast (ValueError) when its file can't be had.
    offline_hint: the message's advice up to "TIKTOKEN_CACHE_DIR" (default "Set"; prepare_data adds the char tokenizer)."""
    import tiktoken
    # tiktoken downloads with requests and no timeout, which can hang for minutes on a network
    # that drops packets. So: if its cache doesn't hold the file, first see whether the server
    # answers at all (3 s, DNS included; the probe runs in a thread because DNS ignores timeouts)
    cached = gpt2_cache_file() is not None and os.path.exists(gpt2_cache_file())  # (None: caching is off)
    reached = []
    def probe():
        try:
            socket.create_connection(("openaipublic.blob.core.windows.net", 443), timeout=3).close()
            reached.append(True)
        except OSError:
            pass
    if not cached:
        t = threading.Thread(target=probe, daemon=True)
        t.start()
        t.join(3.5)
    try:
        if not cached and not reached:
            raise OSError("not cached, and no connection to openaipublic.blob.core.windows.net")
        return tiktoken.get_encoding(GPT2_ENCODING)
    except Exception as e:
        why = " ".join(f"{type(e).__name__}: {e}".split())[:120]
        raise ValueError(f"tiktoken could not load GPT-2's BPE ({GPT2_ENCODING}), one 0.8 MB file it downloads "
                         f"once ({why}). {offline_hint or 'Set'} TIKTOKEN_CACHE_DIR to a folder that holds it: {GPT2_URL} "
                         f"saved as {GPT2_CACHE_NAME}") from None

def same_encoding(a, b):
    """Whether encoding names a and b tokenize alike: "gpt2" and "r50k_base" are one BPE in tiktoken."""
    return a == b or {a, b} <= GPT2_ENCODINGS

def get_tokenizer(meta, encoding=None):
    """An object with .encode(str) -> list[int], .decode(ids) -> str, .vocab_size, built from meta."""
    if meta["tokenizer"] == "char":
        return CharTokenizer(meta["chars"])
    name = meta.get("encoding", "gpt2")  # datasets made before meta.json said: tiktoken's "gpt2"
    if encoding is not None:
        if not same_encoding(encoding.name, name):
            raise ValueError(f"dataset was made with encoding {name!r}, not {encoding.name!r}")
        return TiktokenTokenizer(encoding)
    if meta["tokenizer"] == "gpt2":
        if name not in GPT2_ENCODINGS:
            raise ValueError(f"meta.json says tokenizer 'gpt2' but encoding {name!r} (expected {GPT2_ENCODING!r})")
        return TiktokenTokenizer(load_gpt2())  # "gpt2" too: the same ranks, pattern and <|endoftext|>
    raise ValueError(f"dataset uses the custom tiktoken encoding {name!r}: pass it as encoding=")

# -----------------------------------------------------------------------------
# corpus -> tokens -> files

def _write_bin(path, ids, dtype):
    # through a Python file: ndarray.tofile(path) reports a full disk as "N requested and 0 written", no errno
    with open(path, "wb") as f:
        f.write(np.ascontiguousarray(np.asarray(ids).astype(np.dtype(dtype).newbyteorder("<"))).data)

def _write_dataset(out_dir, splits, meta):
    """Write out_dir/{<split>.bin for each split, meta.json} atomically. splits: {name: token ids}."""
    # write into a temp folder next to the target, meta.json last, then swap it in. A crash at any
    # point leaves either the old dataset or a temp folder load_meta never looks at.
    out_dir = os.path.normpath(out_dir)
    name, parent = os.path.basename(out_dir), os.path.dirname(out_dir) or "."
    if os.path.exists(out_dir) and not (os.path.isdir(out_dir) and set(os.listdir(out_dir)) <= DATASET_FILES):
        raise ValueError(f"{out_dir} exists and holds more than a dataset; won't replace it")
    if os.path.exists(out_dir) and not os.access(out_dir, os.W_OK | os.X_OK):  # we could swap it but not delete it
        raise PermissionError(f"{out_dir} is read-only, so it can't be replaced (nothing was changed); make it "
                              f"writable (chmod u+w {shlex.quote(out_dir)}) or prepare under another --name")
    os.makedirs(parent, exist_ok=True)
    kept = (f"{out_dir} is unchanged (it still holds the old dataset)" if os.path.exists(out_dir) else
            "no dataset was written") + "; free some space and run this again"
    old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:8]}")
    with on_full_disk(out_dir, kept):  # one clear error (the temp folder removed, as after any error)
        tmp = tempfile.mkdtemp(dir=parent, prefix=f".{name}.tmp-")  # unique, created exclusively
        try:
            os.chmod(tmp, 0o777 & ~_umask())  # the permissions makedirs would have given it (mkdtemp's are 0o700)
            for split, ids in splits.items():
                _write_bin(os.path.join(tmp, f"{split}.bin"), ids, meta["dtype"])
            with open(os.path.join(tmp, "meta.json"), "w") as f:  # one key per line, "chars" last
                f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in
                                            sorted(meta.items(), key=lambda kv: kv[0] == "chars")) + "\n}\n")
            if os.path.exists(out_dir):  # no atomic dir-over-dir rename on POSIX: move the old one aside
                os.rename(out_dir, old)
                try:
                    os.rename(tmp, out_dir)
                except BaseException:
                    os.rename(old, out_dir)  # put the old one back
                    raise
                try:  # the new dataset is in place: from here on, failing to clean up is not an error
                    shutil.rmtree(old)
                except OSError as e:
                    print(f"note: could not delete the old copy {old} ({e.strerror}); delete it yourself")
            else:
                os.rename(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already if the rename happened

def prepare(text, out_dir, tokenizer="char", val_fraction=0.1, source="text", encoding=None):
    """Tokenize text, write out_dir/{train.bin,val.bin,meta.json} atomically, return meta."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    if not text:
        raise ValueError("no text to prepare (empty corpus)")
    meta = {"tokenizer": tokenizer, "source": source, "n_chars": len(text)}
    if tokenizer == "char":
        # vocab = sorted set of characters; sorting code points is what sorted(set(text)) does
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        vocab = np.unique(cps)
        ids = np.searchsorted(vocab, cps)
        meta["chars"] = [chr(c) for c in vocab]
        meta["vocab_size"] = len(vocab)
        if len(vocab) < 2:  # (load_meta refuses such a dataset too)
            raise ValueError(f"the text has only one distinct character, {meta['chars'][0]!r}: there is nothing to "
                             f"predict; give it text with at least 2 different characters")
    elif tokenizer in ("gpt2", "tiktoken"):
        enc = encoding if encoding is not None else load_gpt2()
        ids = np.array(enc.encode_ordinary(text), dtype=np.int64)
        meta["tokenizer"] = "gpt2" if enc.name in GPT2_ENCODINGS else "tiktoken"  # "tiktoken": test-made encodings
        meta["encoding"] = enc.name  # which one made the dataset: readers load it by this name
        meta["vocab_size"] = enc.n_vocab
    else:
        raise ValueError(f"unknown tokenizer {tokenizer!r} (char or gpt2)")
    meta["dtype"] = "uint16" if meta["vocab_size"] <= 2**16 else "uint32"
    n_val = int(round(len(ids) * val_fraction))
    n_train = len(ids) - n_val
    if n_train < 2 or n_val < 2:
        raise ValueError(f"corpus too small: {len(ids)} tokens split into {n_train} train / {n_val} val "
                         f"(need at least 2 each); give it more text")
    meta["train_tokens"], meta["val_tokens"] = n_train, n_val

    _write_dataset(out_dir, {"train": ids[:n_train], "val": ids[n_train:]}, meta)
    return meta

# -----------------------------------------------------------------------------
# reading datasets back (train.py, sample.py)

def _prepare_cmd(data_dir):
    """The exact command that (re)creates the dataset at data_dir."""
    data_dir = os.path.normpath(data_dir)
    name, parent = os.path.basename(data_dir), os.path.dirname(data_dir)
    try:  # a task's meta.json says how it was made (its "source"), whatever its folder is called
        with open(os.path.join(data_dir, "meta.json")) as f:
            task = re.fullmatch(r"arithmetic task: (\d+) operands mod (\d+), seed (\d+)", json.load(f)["source"])
    except Exception:  # (no meta.json, not JSON, no source: not a task we can tell)
        task = None
    if name == "quickstart":
        cmd = "python prepare_data.py"
    elif name == "shakespeare_gpt2":
        cmd = f"python prepare_data.py --tokenizer=gpt2 --name={name}"
    elif re.fullmatch(r"arithmetic\d+(_p\d+)?", name):
        cmd = f"python prepare_data.py --task=arithmetic --operands={name[10:]}".replace("_p", " --prime=")
    elif task:
        cmd = (f"python prepare_data.py --task=arithmetic --operands={task[1]}" + (task[2] != "7") * f" --prime={task[2]}"
               + (task[3] != "1337") * f" --seed={task[3]}" + f" --name={shlex.quote(name)}")
    else:
        cmd = f"python prepare_data.py --input=YOUR_TEXT.txt --name={shlex.quote(name)}"
    return cmd if parent == "data" else f"{cmd} --data_dir={shlex.quote(parent or '.')}"

def load_meta(data_dir):
    """meta.json of a complete, consistent dataset; FileNotFoundError / ValueError otherwise. A row dataset
    (a task) must also have its test.bin, and a meta.json that is exactly what prepare_data.py writes for
    its task (see task_meta_problem)."""
    cmd = _prepare_cmd(data_dir)
    for f in ["", "meta.json", "train.bin", "val.bin"]:
        if not os.path.exists(os.path.join(data_dir, f)):
            what = f"no dataset at {data_dir}" if f == "" else f"dataset {data_dir} is incomplete (no {f})"
            raise FileNotFoundError(f"{what}; prepare it with: {cmd}")
    try:
        with open(os.path.join(data_dir, "meta.json")) as f:
            meta = json.load(f)
        itemsize = {"uint16": 2, "uint32": 4}[meta["dtype"]]
        V = meta["vocab_size"]
        if not (meta["tokenizer"] in ("char", "gpt2", "tiktoken") and isinstance(V, int) and 1 <= V <= 2**(8*itemsize)
                and (meta["tokenizer"] != "char" or len(meta["chars"]) == V)):
            raise ValueError("tokenizer/vocab_size/dtype/chars don't add up")
        rows = meta.get("layout") == "rows"
        counts = {s: meta[f"{s}_tokens"] for s in ("train", "val", "test")[:3 if rows else 2]}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{data_dir}/meta.json is malformed ({e!r}); re-run: {cmd}") from None
    if V < 2:  # found here, before training, not as a failing entropy analysis after it
        raise ValueError(f"{data_dir} has a vocabulary of one token ({meta.get('chars', ['?'])[0]!r}): there is "
                         f"nothing to predict; prepare it from text with at least 2 different characters")
    why = task_meta_problem(meta) if rows else None
    if why:
        raise ValueError(f"{data_dir}/meta.json doesn't match the task data it describes ({why}; was it edited?); "
                         f"re-run: {cmd}")
    for split, n in counts.items():
        path = os.path.join(data_dir, f"{split}.bin")
        if not os.path.exists(path):  # (test.bin: found now, not when the test accuracy is due after training)
            raise FileNotFoundError(f"dataset {data_dir} is incomplete (no {split}.bin); prepare it with: {cmd}")
        size = os.path.getsize(path)
        if not isinstance(n, int) or size != n * itemsize:
            raise ValueError(f"{data_dir}/{split}.bin has {size} bytes, meta.json says {n} tokens x "
                             f"{itemsize} bytes; re-run: {cmd}")
    return meta

def load_tokens(data_dir, split, meta=None):
    """Read-only memmap of train.bin or val.bin."""
    meta = meta or load_meta(data_dir)
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.dtype(meta["dtype"]).newbyteorder("<"), mode="r")
    top = int(data.max())  # one pass over the file: cheap at these sizes, and a wrong meta.json fails here, not
    if top >= meta["vocab_size"]:  # as an index error hours into training when a rare id is drawn
        raise ValueError(f"{data_dir}/{split}.bin holds token id {top}, but meta.json says vocab_size="
                         f"{meta['vocab_size']} (ids must be below it); re-run: {_prepare_cmd(data_dir)}")
    return data

def load_rows(data_dir, split, meta):
    """A row dataset's split (train, val or test) as a read-only (n_rows, row_length) memmap."""
    path = os.path.join(data_dir, f"{split}.bin")
    n, L = meta.get(f"{split}_rows"), meta["row_length"]
    if not os.path.exists(path) or not isinstance(n, int) or os.path.getsize(path) != n * L * 2:
        raise ValueError(f"{path} is missing or doesn't hold the {n} rows of {L} tokens meta.json says; "
                         f"re-run: {_prepare_cmd(data_dir)}")
    rows = np.memmap(path, dtype=np.dtype("uint16").newbyteorder("<"), mode="r", shape=(n, L))
    if n and int(rows.max()) >= meta["vocab_size"]:  # as load_tokens: a wrong meta.json fails here
        raise ValueError(f"{path} holds token id {int(rows.max())}, but meta.json says vocab_size="
                         f"{meta['vocab_size']}; re-run: {_prepare_cmd(data_dir)}")
    step = max(1, 2**24 // L)  # rows at a time: ~16M tokens
    bad = sum(int((~has_solution(rows[i:i + step], meta)).sum()) for i in range(0, n, step))
    if bad:  # no loss to learn or evaluate there: a val loss of nan, found before training rather than after
        raise ValueError(f"{path}: {bad:,} of its {n:,} rows have no solution tokens (no '=', or nothing but "
                         f"padding after the first one), so there is no loss to learn or measure on them; "
                         f"re-run: {_prepare_cmd(data_dir)}")
    return rows

def has_solution(rows, meta):
    """(n, row_length) rows -> (n,) bool: the row has a first "=" and a token that is not padding after it,
    i.e. at least one target that train.py's loss mask keeps."""
    rows = np.asarray(rows)
    is_eq = rows == meta["eq_id"]
    eq = is_eq.argmax(1)                                                  # (n,) first "=" (0 if there is none)
    after = np.arange(rows.shape[1])[None, :] > eq[:, None]              # (n, row_length)
    return is_eq.any(1) & ((rows != meta["pad_id"]) & after).any(1)

# -----------------------------------------------------------------------------
# the arithmetic task: expressions mod a prime p, each followed by its step-by-step solution
#
# A problem is one row of tokens, e.g. with p = 7 (the default):
#     (3+5)/(6+4*3-2*1)=1/(6+4*3-2*1)=1/(6+5-2*1)=1/(6+5-2)=1/(4-2)=1/2=4.____
# prompt = the expression and the first "=", then the solution: one operation per step, each step
# followed by "=", the answer, the end token ".", and padding "_" up to the row length.
# Numbers are single tokens whose id is their value (0..p-1, written 0-9 then A-Z: A = 10 for p > 10); a/b means
# a * b^(p-2) mod p, the inverse of b in the field, so it is defined whenever b != 0.

SYMBOLS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # how the numbers 0..35 are written
MAX_OPERANDS = 32           # rows grow with operands^2: 32 operands mod 7 make rows of ~1700 tokens
MAX_PROBLEMS = 1_000_000    # train + val + test; they are made in memory (~1 s per 1,000 at 32 operands)
PROGRESS_WORK = 10_000_000  # problems x operands^2 above which prepare_arithmetic prints its progress (~15 s)
OPS = "+-*/"
PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
END, PAD = ".", "_"
STEP_RULE = ("each step does one operation: inside the leftmost innermost pair of parentheses (the whole "
             "expression if there are none), the leftmost * or /, else the leftmost + or -; a pair of "
             "parentheses left around a single number is dropped in the same step")

def task_chars(p):
    """The vocabulary: the numbers 0..p-1 (token id = value), + - * / ( ) =, the end token, the pad token."""
    return list(SYMBOLS[:p]) + list(OPS + "()=") + [END, PAD]

def is_prime(p):
    return p >= 2 and all(p % d for d in range(2, p))

def apply_op(op, a, b, p):
    if op == "/":
        if b % p == 0:  # (Fermat's formula below would say 0: there is no such number)
            raise ZeroDivisionError(f"division by 0 mod {p}")
        return a * pow(b, p - 2, p) % p  # Fermat: b^(p-2) is b's inverse mod p (b != 0)
    return {"+": a + b, "-": a - b, "*": a * b}[op] % p

def task_meta_problem(meta):
    """What is wrong with a row dataset's meta.json, or None when it is exactly what prepare_arithmetic
    writes for its prime: the vocabulary, the pad/end/= ids and the row layout follow from the prime, so an
    edited prime or chars (which would make train.py and sample.py misread every problem) show here."""
    if meta.get("task") != "arithmetic":
        return f"task={meta.get('task')!r}, but the only task is 'arithmetic'"
    p = meta.get("prime")
    if not (isinstance(p, int) and p <= len(SYMBOLS) and is_prime(p)):
        return f"prime={p!r} is not a prime from 2 to {len(SYMBOLS)}"
    chars = task_chars(p)
    if meta.get("chars") != chars:
        return f"its chars are not the {len(chars)} symbols of the task mod {p}, {''.join(chars)!r}"
    for key, c in (("pad_id", PAD), ("end_id", END), ("eq_id", "=")):
        if meta.get(key) != chars.index(c):
            return f"{key}={meta.get(key)!r}, but {c!r} is token {chars.index(c)}"
    if meta.get("dtype") != "uint16":
        return f"dtype={meta.get('dtype')!r}, the task's rows are uint16"
    n, L = meta.get("operands"), meta.get("row_length")
    if not (isinstance(n, int) and 2 <= n <= MAX_OPERANDS and isinstance(L, int) and L >= n * n + n):
        return (f"operands={n!r} and row_length={L!r} can't be: a row holds the expression and its solution, "
                f"at least operands^2 + operands tokens")
    return None

def random_tree(n, p, rng):
    """A random expression tree with n operands: an int (leaf) or (op, left, right). The left subtree
    gets k operands, k uniform in 1..n-1; ops and operands uniform."""
    if n == 1:
        return int(rng.integers(p))
    k = int(rng.integers(1, n))
    return (OPS[int(rng.integers(4))], random_tree(k, p, rng), random_tree(n - k, p, rng))

def tree_value(node, p):
    """Value of a tree mod p, or None if it divides by 0 somewhere."""
    if isinstance(node, int):
        return node
    op, a, b = node
    a, b = tree_value(a, p), tree_value(b, p)
    if a is None or b is None or (op == "/" and b == 0):
        return None
    return apply_op(op, a, b, p)

def render(node):
    """Tree -> tokens (ints and one-char strings), with the parentheses the tree needs under the usual
    precedence and left-to-right evaluation: around a left child of lower precedence, and around a right
    child of lower or equal precedence (so a-(b+c) keeps them, and so does a+(b+c): the rendering parses
    back to the same tree)."""
    if isinstance(node, int):
        return [node]
    op, a, b = node
    left, right = render(a), render(b)
    if not isinstance(a, int) and PREC[a[0]] < PREC[op]:
        left = ["("] + left + [")"]
    if not isinstance(b, int) and PREC[b[0]] <= PREC[op]:
        right = ["("] + right + [")"]
    return left + [op] + right

def rewrite_once(toks, p):
    """One solution step (see STEP_RULE) on a well-formed token list with at least one operation."""
    close = next((i for i, t in enumerate(toks) if t == ")"), len(toks))  # the first ")" closes an innermost
    open_ = max((i for i in range(close) if toks[i] == "("), default=-1)  # pair; -1: no parentheses at all
    ops = range(open_ + 2, close, 2)  # the group toks[open_+1:close] is: number op number ... op number
    k = next((i for i in ops if toks[i] in ("*", "/")), None)
    k = k if k is not None else next(i for i in ops if toks[i] in ("+", "-"))
    value = apply_op(toks[k], toks[k - 1], toks[k + 1], p)
    if open_ >= 0 and close - open_ == 4:  # "(a op b)" -> "value", parentheses and all
        return toks[:open_] + [value] + toks[close + 1:]
    return toks[:k - 1] + [value] + toks[k + 2:]

def solve(toks, p):
    """The solution steps of an expression: [step 1, ..., [answer]], one operation each."""
    steps = []
    while len(toks) > 1:
        toks = rewrite_once(toks, p)
        steps.append(toks)
    return steps

def problem_tokens(expr, p):
    """Expression tokens -> the whole problem: expr = step 1 = ... = answer END (still without padding)."""
    out = list(expr)
    for step in solve(expr, p):
        out += ["="] + step
    return out + [END]

def encode_problem(toks, p):
    ids = {c: i for i, c in enumerate(task_chars(p))}
    return [t if isinstance(t, int) else ids[t] for t in toks]

def problem_text(ids, p):
    """Token ids -> the text of a problem (or of any part of one)."""
    chars = task_chars(p)
    return "".join(chars[int(i)] for i in ids)

def parse_expression(text, p):
    """A user's expression (e.g. "(3+4)*5", spaces allowed) -> tokens; ValueError if it isn't one."""
    chars = {c: i for i, c in enumerate(task_chars(p))}
    toks = []
    for c in text.replace(" ", "").upper():
        if c not in chars or c in (END, PAD, "="):
            raise ValueError(f"{c!r} is not part of an expression mod {p} (numbers are single symbols "
                             f"{SYMBOLS[0]}..{SYMBOLS[p - 1]}, operators + - * /, parentheses)")
        toks.append(chars[c] if chars[c] < p else c)
    # well-formed: numbers and operators alternate, parentheses balance and enclose a (sub)expression
    depth, want_number = 0, True
    for t in toks:
        if want_number and t == "(":
            depth += 1
        elif want_number and isinstance(t, int):
            want_number = False
        elif not want_number and t == ")" and depth > 0:
            depth -= 1
        elif not want_number and t in PREC:
            want_number = True
        else:
            raise ValueError(f"not a well-formed expression: {text!r} (e.g. two numbers in a row: one number "
                             f"is one symbol, {SYMBOLS[0]}..{SYMBOLS[p - 1]})")
    if want_number or depth or not toks:
        raise ValueError(f"not a well-formed expression: {text!r}")
    return toks

def task_answer(ids, meta):
    """The answer in a generated solution (token ids after the prompt): the single number between the
    last "=" and the first end token. None when there is no end token or that part isn't one number."""
    ids = [int(i) for i in ids]
    if meta["end_id"] not in ids:
        return None
    ids = ids[:ids.index(meta["end_id"])]
    last = ids[len(ids) - ids[::-1].index(meta["eq_id"]):] if meta["eq_id"] in ids else ids
    return last[0] if len(last) == 1 and last[0] < meta["prime"] else None

def count_expressions(n, p):
    """How many different expressions with n operands mod p there are at most (division by 0 not taken out):
    Catalan(n-1) tree shapes x 4^(n-1) operator choices x p^n numbers. Rendering is one-to-one (see render)."""
    return math.comb(2 * (n - 1), n - 1) // n * 4 ** (n - 1) * p ** n

def make_problems(n_problems, operands, p, rng, progress=False):
    """n_problems distinct random expressions (no division by 0 anywhere: such draws are redrawn). ValueError
    when they can't be had, with the fix: fewer problems, or (when most draws divide by 0: long expressions,
    small primes) fewer --operands or a larger prime, or (when most draws repeat) more --operands."""
    if n_problems > count_expressions(operands, p):  # no point drawing: there aren't that many
        raise ValueError(f"there are at most {count_expressions(operands, p):,} different expressions with "
                         f"{operands} operands mod {p}, and {n_problems:,} were asked for (train + val + test): ask "
                         f"for fewer problems, or use more --operands or a larger --prime")
    seen, problems, draws, by_zero = set(), [], 0, 0
    report = _progress("drawing problems", n_problems) if progress else lambda i: None
    while len(problems) < n_problems:
        draws += 1
        if draws > 20 * n_problems + 1000:
            found = (f"found only {len(problems):,} distinct expressions with {operands} operands mod {p} in "
                     f"{draws - 1:,} draws, {n_problems:,} asked for")
            if by_zero > (draws - 1) / 2:
                raise ValueError(f"{found}: {by_zero / (draws - 1):.0%} of the draws divide by 0 somewhere (the "
                                 f"more operands, the more divisions, each by 0 one time in {p}): use fewer "
                                 f"--operands or a larger --prime, or ask for fewer problems")
            raise ValueError(f"{found}: ask for fewer problems, or use more --operands or a larger --prime")
        tree = random_tree(operands, p, rng)
        if tree_value(tree, p) is None:
            by_zero += 1
            continue
        expr = tuple(render(tree))
        if expr in seen:
            continue
        seen.add(expr)
        problems.append(list(expr))
        report(len(problems))
    return problems

def _progress(what, n):
    """A function of i that prints "what: 30% (i of n)" each time i reaches another tenth of n."""
    marks = {n * k // 10: k for k in range(1, 11)}
    def report(i):
        if i in marks:
            print(f"{what}: {marks[i] * 10}% ({i:,} of {n:,})", flush=True)
    return report

def task_name(operands, prime):
    """The default dataset folder: arithmetic6 for 6 operands mod 7 (the default prime), arithmetic6_p11 mod 11."""
    return f"arithmetic{operands}" + ("" if prime == 7 else f"_p{prime}")

def prepare_arithmetic(out_dir, operands=6, prime=7, train_size=50000, val_size=1000, test_size=1000, seed=1337):
    """Write the arithmetic task to out_dir/{train,val,test}.bin + meta.json: one problem per row, padded
    to the longest problem. The splits are disjoint: distinct expressions, the first test_size drawn go to
    test, the next val_size to val, the rest to train. Prints progress when it will take a while."""
    if not (2 <= prime <= len(SYMBOLS) and is_prime(prime)):
        raise ValueError(f"--prime must be a prime between 2 and {len(SYMBOLS)}, got {prime}")
    if not 2 <= operands <= MAX_OPERANDS:
        raise ValueError(f"--operands must be from 2 to {MAX_OPERANDS}, got {operands} (rows grow with its square: "
                         f"{MAX_OPERANDS} operands make rows of ~1700 tokens)")
    if min(train_size, val_size, test_size) < 1:
        raise ValueError("--train_size, --val_size and --test_size must be at least 1")
    n = test_size + val_size + train_size
    if n > MAX_PROBLEMS:
        raise ValueError(f"--train_size + --val_size + --test_size is {n:,}, more than {MAX_PROBLEMS:,} problems "
                         f"(the task's data is made in memory); ask for fewer")
    if seed < 0:
        raise ValueError(f"--seed must be at least 0, got {seed}")
    rng = np.random.default_rng(seed)
    slow = n * operands ** 2 > PROGRESS_WORK  # ~1.5 us per unit here: the default 52,000 x 6^2 takes ~3 s
    exprs = make_problems(n, operands, prime, rng, progress=slow)
    report = _progress("solving them", n) if slow else lambda i: None
    rows = []
    for e in exprs:
        rows.append(encode_problem(problem_tokens(e, prime), prime))
        report(len(rows))
    chars = task_chars(prime)
    row_length = max(map(len, rows))
    pad = chars.index(PAD)
    ids = np.full((len(rows), row_length), pad, dtype=np.uint16)  # (n_problems, row_length)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    bounds = {"test": (0, test_size), "val": (test_size, test_size + val_size),
              "train": (test_size + val_size, len(rows))}
    meta = {"tokenizer": "char", "chars": chars, "vocab_size": len(chars), "dtype": "uint16",
            "source": f"arithmetic task: {operands} operands mod {prime}, seed {seed}",
            "task": "arithmetic", "operands": operands, "prime": prime, "seed": seed, "step_rule": STEP_RULE,
            "layout": "rows", "row_length": row_length, "pad_id": pad, "end_id": chars.index(END),
            "eq_id": chars.index("="), "loss_mask": "no loss on the prompt (up to and including the first '=') "
            "nor on padding: train.py's targets are -1 there"}
    for split, (a, b) in bounds.items():
        meta[f"{split}_rows"], meta[f"{split}_tokens"] = b - a, (b - a) * row_length
    _write_dataset(out_dir, {split: ids[a:b].ravel() for split, (a, b) in bounds.items()}, meta)
    return meta

# -----------------------------------------------------------------------------
# where the text comes from

def download(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8")

def quickstart_text(data_dir):
    """(text, source): tiny Shakespeare (downloaded once, cached in data_dir), else pydoc's docs."""
    cache = os.path.join(data_dir, "tinyshakespeare.txt")
    source = "tiny Shakespeare (karpathy/char-rnn data/tinyshakespeare/input.txt)"
    if os.path.exists(cache):
        with open(cache, encoding="utf-8") as f:
            return f.read(), source
    try:
        text = download(SHAKESPEARE_URL)
        if not text.startswith("First Citizen:"):  # e.g. a captive portal's login page
            raise ValueError("unexpected content")
    except Exception as e:
        import pydoc_data.topics
        print(f"could not download tiny Shakespeare ({type(e).__name__}: {e}); using Python's reference docs "
              f"(pydoc_data.topics) instead. Your own text: python prepare_data.py --input=YOUR_TEXT.txt")
        topics = pydoc_data.topics.topics
        return "".join(topics[k] for k in sorted(topics)), f"pydoc_data.topics (Python {sys.version.split()[0]})"
    try:  # keep a copy so the next run needs no network; not having one is fine too
        os.makedirs(data_dir, exist_ok=True)
        with atomic_file(cache) as f:
            f.write(text)
    except OSError:
        pass
    return text, source

def read_inputs(paths):
    """Concatenated UTF-8 text of the files, with errors that name the file (and byte offset)."""
    parts = []
    for p in paths:
        if os.path.isdir(p):
            raise ValueError(f"--input={p} is a folder; give the text file(s) in it, e.g. --input {p}/*.txt")
        if not os.path.exists(p):  # (not isfile: a pipe, e.g. --input=<(zcat text.gz), is fine to read)
            raise FileNotFoundError(f"input file not found: {p}")
        with open(p, "rb") as f:
            raw = f.read()
        try:
            parts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{p} is not valid UTF-8: {e.reason} at byte offset {e.start}") from None
    text = "".join(parts)
    if not text:
        raise ValueError(f"no text in {', '.join(paths)} (empty)")
    return text

TASK_DEFAULTS = dict(operands=6, prime=7, train_size=50000, val_size=1000, test_size=1000, seed=1337)
TEXT_DEFAULTS = dict(tokenizer="char", val_fraction=0.1)

def old_meta(out_dir):
    """The meta.json of the dataset at out_dir, or None if there is no usable one."""
    try:
        return load_meta(out_dir)
    except (ValueError, OSError):
        return None

def note_replaced(out_dir, before, meta):
    """Say so when the dataset just written replaced other data (before: old_meta from before writing)."""
    changed = [k for k in ("source", "n_chars", "tokenizer", "vocab_size") if before and before.get(k) != meta.get(k)]
    if changed:  # runs trained on the old data can't --resume or be analysed on this one (they'd refuse)
        was = ", ".join(f"{k}={before.get(k)!r}" for k in changed)
        print(f"note: replaced {out_dir}, which held other data ({was}); runs trained on that data can no longer "
              f"be resumed or analysed")

def main_task(args):
    if args.input:
        raise ValueError("--task makes its own data: drop --input")
    given = [f"--{k}" for k in TEXT_DEFAULTS if getattr(args, k) is not None]
    if given:
        raise ValueError(f"--task makes its own vocabulary and splits: drop {' and '.join(given)}")
    for k, v in TASK_DEFAULTS.items():
        setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    name = args.name if args.name is not None else task_name(args.operands, args.prime)
    if not name or name.startswith(".") or "/" in name or os.sep in name:
        raise ValueError(f"bad dataset name {name!r}: use a plain folder name, see --name")
    out_dir = os.path.join(args.data_dir, name)
    before = old_meta(out_dir)
    meta = prepare_arithmetic(out_dir, args.operands, args.prime, args.train_size, args.val_size, args.test_size,
                              args.seed)
    note_replaced(out_dir, before, meta)
    rows = load_rows(out_dir, "train", meta)
    print(f"{out_dir}: {meta['source']} | vocab {meta['vocab_size']} | rows of {meta['row_length']} tokens | "
          f"train {meta['train_rows']:,} / val {meta['val_rows']:,} / test {meta['test_rows']:,} problems\n"
          f"e.g. {problem_text(rows[0], meta['prime'])}")
    return meta

def main(argv=None):
    parser = argparse.ArgumentParser(description="corpus -> data/<name>/{train.bin,val.bin,meta.json}")
    parser.add_argument("--input", nargs="+", action="extend", metavar="FILE",
                        help="UTF-8 text file(s), concatenated (default: tiny Shakespeare)")
    parser.add_argument("--name", help="dataset folder name (default: quickstart, or the first input's stem)")
    parser.add_argument("--data_dir", default="data", help="root folder of the datasets")
    parser.add_argument("--tokenizer", choices=["char", "gpt2"], help="[char]")
    parser.add_argument("--val_fraction", type=float, help="last fraction of the tokens used for validation [0.1]")
    task = parser.add_argument_group("synthetic task (instead of a corpus)")
    task.add_argument("--task", choices=["arithmetic"], help="arithmetic: expressions mod a prime with "
                      "step-by-step solutions, one problem per row -> data/arithmetic<operands>/")
    task.add_argument("--operands", type=int, help=f"numbers per expression, 2..{MAX_OPERANDS} [6]")
    task.add_argument("--prime", type=int, help="the modulus p (numbers 0..p-1, one token each) [7]")
    task.add_argument("--train_size", type=int, help="training problems [50000]")
    task.add_argument("--val_size", type=int, help="validation problems (val loss, accuracy during training) [1000]")
    task.add_argument("--test_size", type=int, help="test problems (final accuracy) [1000]")
    task.add_argument("--seed", type=int, help="the same seed gives the same files [1337]")
    args = parser.parse_args(argv)
    if os.path.exists(args.data_dir) and not os.path.isdir(args.data_dir):
        raise ValueError(f"--data_dir={args.data_dir} is a file, not a folder; give the folder that holds (or will "
                         f"hold) the datasets")
    if args.task:
        return main_task(args)
    given = [f"--{k}" for k in TASK_DEFAULTS if getattr(args, k) is not None]
    if given:  # e.g. --operands=5 without --task: would silently prepare tiny Shakespeare
        raise ValueError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} for --task=arithmetic: add "
                         f"--task=arithmetic, or drop {'it' if len(given) == 1 else 'them'}")
    for k, v in TEXT_DEFAULTS.items():
        setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    name = args.name if args.name is not None else \
        os.path.splitext(os.path.basename(args.input[0]))[0] if args.input else "quickstart"
    if not name or name.startswith(".") or "/" in name or os.sep in name:
        raise ValueError(f"bad dataset name {name!r}: use a plain folder name, see --name")
    if not 0 < args.val_fraction < 1:
        raise ValueError(f"--val_fraction must be between 0 and 1, got {args.val_fraction}")
    encoding = load_gpt2("Use --tokenizer=char, or set") if args.tokenizer == "gpt2" else None  # fail fast, before any download

    if args.input:
        text, source = read_inputs(args.input), "files: " + ", ".join(args.input)
    else:
        text, source = quickstart_text(args.data_dir)
    out_dir = os.path.join(args.data_dir, name)
    before = old_meta(out_dir)
    meta = prepare(text, out_dir, args.tokenizer, args.val_fraction, source, encoding)
    note_replaced(out_dir, before, meta)
    print(f"{out_dir}: {source} | {meta['n_chars']:,} chars | vocab {meta['vocab_size']:,} ({meta['tokenizer']}"
          f"{': ' + meta['encoding'] if 'encoding' in meta else ''}) | "
          f"train {meta['train_tokens']:,} / val {meta['val_tokens']:,} tokens ({meta['dtype']})")
    return meta

if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # (a dataset is swapped in whole: interrupted, the old one is still there)
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
