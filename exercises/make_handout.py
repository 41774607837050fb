"""
Write a course handout: the student's copy of this repository, with each exercise's code replaced by a stub.

    python exercises/make_handout.py OUT                  # exercises 1-5 (1-4 write code, 5 is an experiment)
    python exercises/make_handout.py OUT --exercises=1,3  # only these; the other regions keep their code

In the repository an exercise's code sits between two marker comments, the only trace the kit leaves there:

    # >>> exercise N: name
    ...the reference code...
    # <<< exercise N

In OUT, between the markers of each exercise handed out: the hints of HINTS below, then
raise NotImplementedError("exercise N: <what to write>"), at the region's indentation. The markers of the
exercises not handed out are dropped and their code kept. Everything else is copied unchanged: the files git
tracks (without git, every file except .git, data/, out*/ and caches), less this folder, exercises/, which is
the teacher's (this script, TEACHERS.md). exercises/ASSIGNMENT.md becomes OUT/ASSIGNMENT.md, with the sections
of the exercises handed out; Markdown lines that link into exercises/ are left out (the README's link to the kit).
Grading is the test suite: python -m pytest tests.py -m ex1 (conftest.py: a test that needs another exercise
still to do is skipped, not failed). Standard library only.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = "exercises"  # the teacher's folder: not copied into a handout
OPEN = re.compile(r"^(\s*)# >>> exercise (\d+): (.+)$")
CLOSE = re.compile(r"^(\s*)# <<< exercise (\d+)$")
EXERCISES = (1, 2, 3, 4, 5)  # 5 is the experiment: no code region

# What a stub says, per exercise with code: the error's text, then the hint comments above it. The hints are
# here only, never in the reference code.
HINTS = {
    1: ("write lime_mix: W_l @ (the raw heads of layers 0..l)", """\
Exercise 1: LIMe's mix for one layer l >= 1 (the formula atop lime.py; the paper's definition of LIMe).
  kvs: l+1 tensors, the raw keys (or values) of layers 0..l, each (..., H, hd). The leading
       dims (batch, time, ...) are not mixed: the mix never crosses positions (causality).
  W:   W_l, (H, (l+1)*H). Column j is source head j in LAYER-MAJOR order: layer 0's heads
       0..H-1, then layer 1's, ..., then layer l's own heads (the last H columns).
  Return (..., H, hd), output head r = sum_j W[r, j] * (source head j):
       k~_l[t, r] = sum_j W_l[r, j] * k_stack[t, j]     (the same W_l mixes the values)
  No softmax, no normalisation. Two lines: stack the sources along the head axis
  (torch.cat), then one torch.einsum (or matmul) over j. PlainMix calls this, i.e. the model
  with fused_mix=False (train.py --lime=True --fused_mix=False); the tests compare it with a
  loop over heads and with the fast path (FusedMix)."""),
    2: ("init W_l: U(-b, b) where read, 0 elsewhere, own block I", """\
Exercise 2: initialise layer l's router W = W_l (l >= 1), in place (under no_grad).
  W: (H, (l+1)*H), H = W.shape[0]; its columns are the source heads of layers 0..l,
     layer-major; the last H columns are layer l's own heads.
  mask = source_mask(l, H, self.config.lime_sources): ((l+1)*H,) of 0/1, the columns
     layer l reads ("all": all; "first" / "previous": layer 0 / layer l-1, and its own).
  1. the columns read: U(-b, +b), b = sqrt(3 / fan_in), fan_in = the number of columns
     read (mask.sum()); U(-b, b) has variance b^2/3 = 1/fan_in (README: "What LIMe is")
  2. the columns not read: exactly 0
  3. the own block W[:, -H:]: the H x H identity (torch.eye).
     Why? See test_identity_routers_equal_baseline in tests.py.
  The RNG is forked around this loop: what you draw changes no other weight."""),
    3: ("the KV cache step: cache k, v; mask new vs past tokens", """\
Exercise 3: the KV cache step. generate() feeds the new tokens only; `cache` (a KVCache)
holds what this layer's attention used for the tokens before them.
  k, v: (B, H, T, hd), this layer's keys and values of the T new tokens, as attention uses
        them: with LIMe already MIXED (W_l @ raw heads of layers 0..l), k rotated by RoPE.
  past = the number of tokens cached before this call (cache.k[self.layer] is None at first).
  k, v = cache.update(self.layer, k, v) appends them, returns all: (B, H, past + T, hd).
  Then T queries meet past + T keys. With past > 0, is_causal=True is wrong (SDPA aligns its
  causal mask to the top left): set causal = False and mask = a (T, past + T) bool tensor
  (on x.device), True where new token i (position past + i) may see key j: j <= past + i.
  With past == 0 keep causal = True, mask = None.
  Think: why is caching the MIXED k, v enough, and exact? (KVCache's docstring)"""),
    4: ("mix = the routers' forward FLOPs per token", """\
Exercise 4: `mix`, LIMe's routers in flops_per_token (forward, per token, 2 per multiply-add).
  Layer l >= 1 mixes with W_l (H, (l+1)*H): each of the H*hd numbers of a mixed tensor is a
  sum over (l+1)*H sources: 2*(l+1)*H*H*hd FLOPs per mixed tensor. Layer 0 has no router;
  without LIMe (c.lime False) mix = 0.
  Mixed: c.lime_kv, "kv" (keys and values), "k" or "v" (one of the two).
  A restricted c.lime_sources ("first", "previous") still multiplies all (l+1)*H columns
  (the unread ones are zeros): count them all, as FlopCounterMode does (docs/efficiency.md).
  Here: c (the GPTConfig), H (heads), hd (head dim)."""),
}


def regions(lines, path="?"):
    """[(n, name, indent, i, j)] for each marked region: lines[i] opens it, lines[j] closes it."""
    found, start = [], None
    for k, line in enumerate(lines):
        o, c = OPEN.match(line), CLOSE.match(line)
        if o and start is not None:
            raise ValueError(f"{path}:{k + 1}: exercise {o[2]} opens inside exercise {start[0]} (line {start[4] + 1})")
        if o:
            start = (int(o[2]), o[3], o[1], None, k)
        elif c:
            if start is None or int(c[2]) != start[0] or c[1] != start[2]:
                raise ValueError(f"{path}:{k + 1}: '# <<< exercise {c[2]}' closes no region opened at this indentation")
            found.append((start[0], start[1], start[2], start[4], k))
            start = None
    if start is not None:
        raise ValueError(f"{path}:{start[4] + 1}: exercise {start[0]} is never closed ('# <<< exercise {start[0]}')")
    return found


def stub_lines(n, name, indent):
    """The marked region of exercise n as a handout has it."""
    what, hints = HINTS[n]
    return ([f"{indent}# >>> exercise {n}: {name}\n"] + [f"{indent}# {h}".rstrip() + "\n" for h in hints.splitlines()]
            + [f'{indent}raise NotImplementedError("exercise {n}: {what}")\n', f"{indent}# <<< exercise {n}\n"])


def stub_text(text, chosen, path="?"):
    """text with the regions of the chosen exercises stubbed and the others' markers dropped."""
    lines = text.splitlines(keepends=True)
    out, k = [], 0
    for n, name, indent, i, j in regions(lines, path):
        out += lines[k:i]
        out += stub_lines(n, name, indent) if n in chosen else lines[i + 1:j]
        k = j + 1
    return "".join(out + lines[k:])


def restore_text(handout, reference, path="?"):
    """handout's marked regions with the reference's code pasted back between their markers (a teacher's check
    that a handout is the reference less the stubs; the tests use it)."""
    ref = reference.splitlines(keepends=True)
    code = {n: ref[i + 1:j] for n, _, _, i, j in regions(ref, path)}
    lines = handout.splitlines(keepends=True)
    out, k = [], 0
    for n, _, _, i, j in regions(lines, path):
        out += lines[k:i + 1] + code[n]
        k = j
    return "".join(out + lines[k:])


def same_outside_regions(text, reference):
    """True when text (a student's file) is reference but for the code between the markers it holds."""
    return stub_text(restore_text(text, reference), ()) == stub_text(reference, ())


def assignment_text(text, chosen):
    """exercises/ASSIGNMENT.md for the chosen exercises: its '## Exercise N' sections of the others left out."""
    sections = re.split(r"(?m)^(?=## )", text)
    keep = [s for s in sections if not (m := re.match(r"## Exercise (\d+)", s)) or int(m[1]) in chosen]
    return "".join(keep)


def relink(text, old_dir, new_dir):
    """Markdown text moved from old_dir to new_dir (both relative to the repository root): relative links
    re-pointed, and the lines that link into exercises/ (the teacher's) left out."""
    def target(link):  # the link's path from the root, or None for a web link or a bare anchor
        if re.match(r"[a-z]+:", link) or link.startswith("#"):
            return None
        return os.path.normpath(os.path.join(old_dir, link.partition("#")[0]))

    out = []
    for line in text.splitlines(keepends=True):
        links = re.findall(r"\]\(([^)\s]+)\)", line)
        if any((t := target(link)) and (t == KIT or t.startswith(KIT + os.sep)) for link in links):
            continue
        for link in links:
            t = target(link)
            if t is not None and old_dir != new_dir:
                path, _, anchor = link.partition("#")
                moved = os.path.relpath(t, new_dir or ".") + ("#" + anchor if anchor else "")
                line = line.replace(f"]({link})", f"]({moved})")
        out.append(line)
    return "".join(out)


def repo_files(root):
    """The files to copy, relative to root: git's tracked files, or without git a walk that skips what
    .gitignore ignores (.git, data/, out*/, caches)."""
    try:
        r = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True, timeout=60)
        if r.returncode == 0 and r.stdout:
            return sorted(f for f in r.stdout.decode().split("\0") if f and os.path.isfile(os.path.join(root, f)))
    except OSError:
        pass  # no git: walk
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in (".git", "data", "__pycache__", ".pytest_cache")
                   and not x.startswith("out")]
        files += [os.path.relpath(os.path.join(d, f), root) for f in names if not f.endswith((".pyc", ".tmp"))]
    return sorted(files)


def make_handout(out, chosen, root=ROOT):
    """Write the handout of exercises `chosen` into out (absent or empty); returns the files written."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{out} is a file; a handout goes into a new or empty folder")
    if os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"{out} is not empty; a handout goes into a new or empty folder (nothing was written)")
    files = [f for f in repo_files(root) if f.split(os.sep)[0] != KIT]
    with open(os.path.join(root, KIT, "ASSIGNMENT.md"), encoding="utf-8") as f:
        assignment = relink(assignment_text(f.read(), chosen), KIT, "")
    texts, marked = {}, set()
    for f in files:
        if f.endswith((".py", ".md")):
            with open(os.path.join(root, f), encoding="utf-8") as fh:
                text = fh.read()
            if f.endswith(".md"):
                texts[f] = relink(text, os.path.dirname(f), os.path.dirname(f))
            elif found := regions(text.splitlines(), f):
                marked |= {n for n, *_ in found}
                texts[f] = stub_text(text, chosen, f)
    if marked - set(HINTS):
        raise ValueError(f"a region marks exercise {min(marked - set(HINTS))}, which has no HINTS in {__file__}")
    missing = sorted(n for n in set(chosen) & set(HINTS) if n not in marked)
    if missing:
        raise ValueError(f"no marked region of exercise {', '.join(map(str, missing))} in {root}")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(os.path.abspath(out))}.", suffix=".tmp")
    try:  # build it next to out, then one rename: out is either untouched or the whole handout
        for f in files:
            dst = os.path.join(tmp, f)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if f in texts:
                with open(dst, "w", encoding="utf-8") as fh:
                    fh.write(texts[f])
                shutil.copymode(os.path.join(root, f), dst)
            else:
                shutil.copy2(os.path.join(root, f), dst)
        with open(os.path.join(tmp, "ASSIGNMENT.md"), "w", encoding="utf-8") as fh:
            fh.write(assignment)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # (mkdtemp's folder is 0o700)
        os.replace(tmp, out)           # (replaces an empty folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files + ["ASSIGNMENT.md"]


def parse_exercises(s):
    try:
        chosen = sorted({int(x) for x in s.split(",")})
    except ValueError:
        chosen = []
    if not chosen or not set(chosen) <= set(EXERCISES):
        raise ValueError(f"--exercises={s} is not a list of exercises from {EXERCISES[0]}-{EXERCISES[-1]}, e.g. 1,3")
    return chosen


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write a course handout of this repository into OUT.")
    parser.add_argument("out", metavar="OUT", help="a new or empty folder")
    parser.add_argument("--exercises", default=",".join(map(str, EXERCISES)),
                        help="the exercises to hand out, e.g. 1,3 (default: all, 1-5)")
    args = parser.parse_args(argv)
    chosen = parse_exercises(args.exercises)
    files = make_handout(args.out, chosen)
    code = [n for n in chosen if n in HINTS]
    print(f"wrote {len(files)} files to {args.out}: exercises {', '.join(map(str, chosen))} "
          f"({'stubs in ' + ', '.join(map(str, code)) if code else 'no code stubbed'}); start with "
          f"{os.path.join(args.out, 'ASSIGNMENT.md')}; grade with: python -m pytest tests.py "
          + (f"-m \"{' or '.join(f'ex{n}' for n in code)}\"" if code else "-q"))
    return files


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
