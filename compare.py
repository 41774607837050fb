"""
Experiments: train several variants of the model on identical data, with several seeds and at several depths
if asked, then compare them: loss (and on a task, accuracy) against training FLOPs, a summary, figures, and the
paper's analyses (analyze.py). Every variant sees the same data order, eval batches and schedule, and starts
from the same initial weights wherever its model has the same weights.

    python prepare_data.py && python compare.py       # baseline, then LIMe: ~4 min on 2 CPU cores -> out-compare/
    python compare.py --variants=baseline,lime,lime:router_lr=1e-3 --seeds=3 --preset=deep --out_dir=out-deep
    python compare.py --preset=gpu --out_dir=out-gpu  # bigger model for one GPU
    python compare.py --preset=depth                  # depth sweep at 4, 8, 16 layers -> out-depth/depthL
    python compare.py --depths=4,8,16,32 --seeds=2 --out_dir=out-d2   # any depths, any preset's shape
    python compare.py --resume=True --out_dir=out-deep                 # continue a half-finished experiment
    python compare.py --plot=out-compare              # redraw the figures and the summary from the logs
    python compare.py --analyze=out-compare           # the analyses alone (= python analyze.py out-compare)
    python compare.py --preset=arithmetic             # the arithmetic task: accuracy vs FLOPs too
    torchrun --standalone --nproc_per_node=8 compare.py --preset=gpu --batch_size=4 --gradient_accumulation_steps=8

--variants: comma-separated; the first is the reference the others are measured against. A variant is a name
from VARIANTS, optionally followed by ':' and key=value overrides of model or optimiser flags (VARIANT_FLAGS),
separated by ',' or ':'. A piece with '=' belongs to the variant before it (no name has one), so
`--variants=baseline,lime:router_lr=1e-3,weight_decay=0,lime` is three variants, the second with two overrides.
Every train.py flag works here and applies to every variant, unless the variant sets it.

A comparison folder OUT holds OUT/<folder> (first seed) and OUT/<folder>_seed<S> (the others) per variant; a
variant's folder is its name, plus _key=value per override (lime:router_lr=1e-3 -> lime_router_lr=0.001).
OUT/experiment.json records the plan (variants, folders, seeds); OUT/summary.json, loss_vs_flops.png (on a
task also accuracy_vs_flops.png) the results; analysis.json and analyze.py's figures the analyses. A depth
sweep puts one comparison per depth in OUT/depthL, then OUT/sweep.json and OUT/loss_vs_depth.png.
"""

import argparse
import json
import os
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch.distributed as dist

import analyze
import train
from common import (check_fits, find_runs, make_out_dir, read_log, read_summary, run_dir, run_files, run_main,
                    setup_device, str2bool)
from lime import GPTConfig
from prepare_data import atomic_file, on_full_disk

VARIANTS = {  # name: the flags it sets, over the command line's. Names may hold letters, digits, '_' and '-'
    "baseline": dict(lime=False),  # a standard decoder
    "lime": dict(lime=True),       # LIMe: every layer reads a learned mix of all earlier layers' keys/values
    # the paper's other baseline: Hyper-Connections, 4 residual streams mixed by static + input-dependent weights
    "hc": dict(lime=False, hc_rate=4, hc_dynamic=True),
    "hc-static": dict(lime=False, hc_rate=4, hc_dynamic=False),  # ... by static weights only
    # LIMe taken apart: what is mixed, which layers are read, whether the routers learn
    "lime-k": dict(lime=True, lime_kv="k"),                 # keys mixed, values the layer's own
    "lime-v": dict(lime=True, lime_kv="v"),                 # values mixed, keys the layer's own
    "lime-first": dict(lime=True, lime_sources="first"),    # own heads + layer 0's (value-residual-like)
    "lime-previous": dict(lime=True, lime_sources="previous"),  # own heads + layer l-1's
    "lime-frozen": dict(lime=True, router_lr=0.0),          # routers kept at their init [noise | I]
}
# what a variant may set: the model's flags and the optimiser's. Not the data, the schedule, the seed, or how
# to run: those stay the same for every variant, so that the comparison is fair
VARIANT_FLAGS = sorted(({f.name for f in fields(GPTConfig)} & train.FLAG_NAMES) - {"block_size"}
                       | {"learning_rate", "router_lr", "weight_decay", "beta1", "beta2", "grad_clip"})

FLAGS = [f for f in train.FLAGS if f[0] not in ("out_dir", "resume", "preset")] + [
    ("resume", bool, False, "continue the experiment in out_dir: finished runs are kept, the others continue or "
                            "start"),
    ("out_dir", str, None, "experiment folder (default: out-compare; with --depths out-depth)"),
    ("variants", str, "baseline,lime", "the variants to train, the reference first; see above"),
    ("seeds", int, 1, "train each variant with seeds seed, seed+1, ..."),
    ("depths", str, None, "a depth sweep, e.g. 4,8,16: a comparison per n_layer into out_dir/depthL, then "
                          "out_dir/loss_vs_depth.png"),
    ("plot", str, None, "DIR: redraw DIR's figures and summary from the logs, no training"),
    ("analyze", str, None, "DIR: the analyses of a comparison folder (analyze.py), no training"),
    ("preset", str, "cpu", "cpu | gpu | deep | depth | depth-gpu | arithmetic | arithmetic-gpu: train.py's "
                           "PRESETS, and the sweeps here"),
]
PRESETS = {
    **train.PRESETS,
    # depth sweep on a CPU: the deep preset's width, schedule and tokens at 4, 8 and 16 layers
    "depth": dict(depths="4,8,16", n_head=4, n_embd=64, block_size=128, batch_size=32, max_iters=480,
                  eval_interval=40, eval_iters=10, log_interval=20, warmup_iters=50, learning_rate=2e-3),
    # the paper's deep shape (width 256, 8 heads) at 32, 64 and 128 layers, for one GPU: 65.5M tokens per run, so
    # it needs a corpus of >= 33M tokens (2 passes). 2.35e17 training FLOPs per seed for all six runs (GPT-2
    # vocab; the 128-layer LIMe alone 7.2e16). Estimated, not measured: ~15 min per seed on an H100 at 30% MFU
    "depth-gpu": dict(depths="32,64,128", n_head=8, n_embd=256, block_size=512, batch_size=32, max_iters=4000,
                      eval_interval=250, eval_iters=40, log_interval=50, warmup_iters=200, learning_rate=1e-3),
}
RESULTS = ("summary.json", "loss_vs_flops.png", "accuracy_vs_flops.png")
COLORS = ["tab:blue", "tab:red", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
          "tab:cyan", "tab:gray"]  # one per variant, in --variants order (then again)

# -----------------------------------------------------------------------------------------------------
# variants and the plan: which runs, with which config, into which folders


@dataclass
class Variant:
    name: str    # as the summary and the figures write it: "lime", or "lime:router_lr=0.001"
    dir: str     # its folder in OUT
    flags: dict  # the flags it sets: the table's, then the overrides


@dataclass
class Run:
    variant: Variant
    seed: int
    cfg: dict       # train.py's config of this run, resolved
    explicit: set   # what train() treats as given explicitly: the command line, the variant's flags, the seed


def parse_variants(s):
    """--variants text -> [Variant]. ValueError on an unknown name, a malformed override, an override of a
    flag a variant may not set, or two variants that would share a folder."""
    specs = []  # [name, [key=value, ...]]
    for piece in s.split(","):
        if "=" in piece.split(":")[0] and specs and specs[-1][1]:  # more overrides of the variant before
            specs[-1][1] += piece.split(":")
        else:
            specs.append([piece.split(":")[0], piece.split(":")[1:]])
    types = {name: typ for name, typ, _, _ in train.FLAGS}
    variants = []
    for name, texts in specs:
        where = f"--variants={s}: {':'.join([name] + texts)}"
        if name not in VARIANTS:
            hint = ("overrides follow a variant's name and ':', e.g. lime:router_lr=1e-3" if "=" in name else
                    f"known: {', '.join(VARIANTS)} (a new one goes into VARIANTS in compare.py)")
            raise ValueError(f"{where}: unknown variant {name!r}; {hint}")
        overrides = {}
        for text in texts:
            key, eq, value = text.partition("=")
            if not eq or not key or not value:
                raise ValueError(f"{where}: {text!r} is not key=value")
            if key not in VARIANT_FLAGS:
                raise ValueError(f"{where}: {'--' + key if key in types else repr(key)} is not a model or optimiser "
                                 f"flag; a variant may set only {', '.join(VARIANT_FLAGS)}")
            if key in overrides:
                raise ValueError(f"{where}: {key} is set twice")
            try:
                overrides[key] = str2bool(value) if types[key] is bool else types[key](value)
            except (ValueError, TypeError, argparse.ArgumentTypeError):
                kind = {bool: "True or False", int: "an integer"}.get(types[key], "a number")
                raise ValueError(f"{where}: {key} takes {kind}, got {value!r}") from None
        text = lambda v: repr(v) if isinstance(v, float) else str(v)  # repr: 1e-3 and 0.001 are one folder
        keys = sorted(overrides)
        folder = re.sub(r"[^\w.=+-]", "-", name + "".join(f"_{k}={text(overrides[k])}" for k in keys))
        label = name + (":" + ",".join(f"{k}={text(overrides[k])}" for k in keys) if keys else "")
        variants.append(Variant(label, folder, {**VARIANTS[name], **overrides}))
    folders = [v.dir for v in variants]
    for v in variants:
        if folders.count(v.dir) > 1:
            twins = " and ".join(w.name for w in variants if w.dir == v.dir)
            raise ValueError(f"--variants={s}: {twins} would share the folder {v.dir}; list each variant once")
    return variants


def parse_depths(s):
    try:
        depths = sorted({int(d) for d in s.split(",")})
    except ValueError:
        depths = []
    if not depths or depths[0] < 1:
        raise ValueError(f"--depths={s} is not a comma-separated list of layer counts >= 1, e.g. --depths=4,8,16")
    return depths


def plan(cfg, explicit, variants, out_dir, **fixed):
    """The runs of one comparison into out_dir, in the order they train: seed by seed, every variant. A run's
    config is the command line's (cfg), then the variant's flags, then fixed (a sweep's n_layer), resolved
    once per variant (so a bad value fails here, before anything is written)."""
    base = {k: v for k, v in cfg.items() if k in train.FLAG_NAMES}
    seeds = [cfg["seed"] + i for i in range(cfg["seeds"])]
    configs = {}
    for v in variants:
        try:
            configs[v.dir] = train.resolve({**base, **v.flags, **fixed})
        except ValueError as e:
            raise ValueError(f"variant {v.name}: {e}") from None
    given = (set(explicit) & train.FLAG_NAMES) | set(fixed) | {"seed"}
    return [Run(v, seed, dict(configs[v.dir], seed=seed, out_dir=run_dir(out_dir, v.dir, i, seed)),
                given | set(v.flags)) for i, seed in enumerate(seeds) for v in variants]


def check_out_dir(out_dir, runs, resume):
    """Refuse, before anything is written: results or runs in out_dir without --resume (never replaced without
    being asked); with it, a run whose log says it was trained with other settings than its variant now has."""
    found = [f for f in RESULTS if os.path.exists(os.path.join(out_dir, f))] + \
        [os.path.basename(r.cfg["out_dir"]) for r in runs if run_files(r.cfg["out_dir"])]
    if found and not resume:
        raise ValueError(f"{out_dir} already holds a comparison ({', '.join(found)}); continue it with --resume=True, "
                         f"or use a new --out_dir (to start over, delete {out_dir} first)")
    for r in runs:
        path = os.path.join(r.cfg["out_dir"], "log.jsonl")
        old = (read_log(path, header=True) or {}).get("config", {}) if os.path.exists(path) else {}
        diff = [k for k in sorted(r.explicit) if (k in train.RESUME_FIXED or k in r.variant.flags) and k in old
                and r.cfg[k] is not None and old[k] != r.cfg[k]]
        if diff:
            raise ValueError(f"{r.cfg['out_dir']} holds a run with other settings than {r.variant.name}, seed {r.seed} "
                             f"(" + ", ".join(f"{k}={old[k]!r} there, {r.cfg[k]!r} now" for k in diff) + "); use a "
                             f"new --out_dir, or the --variants and flags it was made with")


# -----------------------------------------------------------------------------------------------------
# running an experiment


def run_experiment(cfg, explicit, variants):
    """Every variant, seed by seed (and depth by depth), on identical data order, init of the shared weights,
    eval batches and schedule; after each comparison its figures, summary and analyses. With --resume, runs
    with a checkpoint continue (finished ones are kept as they are) and the others start."""
    depths = parse_depths(cfg["depths"]) if cfg["depths"] else None
    top = cfg["out_dir"] or ("out-depth" if depths else "out-compare")
    if depths and any("n_layer" in v.flags for v in variants):
        raise ValueError("a depth sweep sets n_layer: no variant may set it too")
    experiments = [(os.path.join(top, f"depth{L}"), plan(cfg, explicit, variants, os.path.join(top, f"depth{L}"),
                                                         n_layer=L)) for L in depths] if depths else \
        [(top, plan(cfg, explicit, variants, top))]
    for k in sorted(set(explicit) & set.intersection(*(set(v.flags) for v in variants))):
        print(f"note: every variant sets --{k}; the flag is ignored")
    runs = [r for _, rs in experiments for r in rs]
    if cfg["resume"] and not any(run_files(r.cfg["out_dir"]) for r in runs):
        raise FileNotFoundError(f"--resume: nothing to resume in {top} (none of its runs has a checkpoint or a log); "
                                f"drop --resume to start the comparison")
    device = setup_device(cfg["device"], "float32")[0]
    for r in runs:  # the data and every model, checked before anything is written (the seeds share them)
        if r.seed == runs[0].seed and not os.path.exists(os.path.join(r.cfg["out_dir"], "ckpt.pt")):
            c, data = train.load_data(r.cfg, r.explicit)
            check_fits(train.model_config(c, data.meta), device)
    for w in dict.fromkeys(w for r in runs for w in train.schedule_warnings(r.cfg)):
        print(f"warning: {w}")
    master = train.ddp_rank_world()[0] == 0
    if master:  # under torchrun rank 0 alone looks and writes here (the others might see its writes, and refuse)
        for out_dir, runs in experiments:
            check_out_dir(out_dir, runs, cfg["resume"])
    summary = None
    for out_dir, runs in experiments:
        if depths:
            print(f"\n##### depth {runs[0].cfg['n_layer']}")
        seeds = sorted({r.seed for r in runs})
        if master:  # the plan: which variants, folders and seeds make this comparison
            make_out_dir(out_dir)
            with saving(os.path.join(out_dir, "experiment.json"), kept="nothing was trained by this command; free "
                        "some space and run it again") as f:
                json.dump(dict(variants=[asdict(v) for v in variants], seeds=seeds), f, indent=1)
        for r in runs:
            d = r.cfg["out_dir"]
            print(f"\n=== {r.variant.name}, seed {r.seed} ({seeds.index(r.seed) + 1}/{len(seeds)}) -> {d}")
            resume = cfg["resume"] and os.path.exists(os.path.join(d, "ckpt.pt"))
            if cfg["resume"] and not resume and os.path.exists(os.path.join(d, "log.jsonl")):
                print(f"note: {d} stopped before its first checkpoint; starting it over")
                if master:
                    os.remove(os.path.join(d, "log.jsonl"))
            train.train(dict(r.cfg, resume=resume), r.explicit, warn=False)
        if master:  # rank 0 alone plots, summarizes and analyzes
            print()
            summary = report(out_dir)
            run_analyze(out_dir, cfg["device"])
    if not master:
        return None
    return sweep_report(top) if depths else summary


def run_analyze(out_dir, device="auto"):
    """The paper's analyses of a comparison folder (analyze.py): router maps of every LIMe variant, value
    entropy and token separability of every variant, each on its first seed's run."""
    try:
        return analyze.analyze_compare(out_dir, setup_device(device, "float32")[0])
    except (ValueError, OSError) as e:
        raise ValueError(f"the analysis failed: {e}; retry with: python analyze.py {out_dir}") from None


# -----------------------------------------------------------------------------------------------------
# comparing: small pure functions on log records (lists of dicts), then the summary and the figures


def mean_band(runs, key):
    """Seeds' logs -> (flops, mean, min, max) arrays of key over the iterations where every run has it
    (all seeds share the schedule). One run gives its own curve."""
    iters = sorted(set.intersection(*[{r["iter"] for r in recs if r.get(key) is not None} for recs in runs]))
    at = [{r["iter"]: r for r in recs} for recs in runs]
    flops = np.array([np.mean([a[i]["flops"] for a in at]) for i in iters], dtype=float)
    ys = np.array([[a[i][key] for i in iters] for a in at], dtype=float).reshape(len(runs), len(iters))
    return flops, ys.mean(0), ys.min(0), ys.max(0)


def flops_to_reach(flops, values, target):
    """FLOPs at which a curve first gets down to target, interpolating linearly between eval points; None
    if it never does."""
    for i in range(len(values)):
        if values[i] <= target:
            if i == 0:
                return float(flops[0])
            f0, v0 = flops[i - 1], values[i - 1]
            return float(f0 + (flops[i] - f0) * (v0 - target) / (v0 - values[i]))
    return None


def mean_std(values, name="mean"):
    """{name: mean, name's std: sample std (ddof=1; 0 for one value)}, e.g. {"mean", "std"}."""
    std = name.replace("mean", "std")
    return {name: float(np.mean(values)), std: float(np.std(values, ddof=1)) if len(values) > 1 else 0.0}


def summarize(seeds, runs, key="val_loss", tests=None):
    """runs: {variant: [log records of each seed]}, the reference first. Per variant and seed: the final key
    (val_loss, or accuracy on a task) and the FLOPs spent; for the others also the FLOPs at which they first
    reach the reference's final value (down to it for a loss, up to it for accuracy) and their ratio to the
    reference's total FLOPs (None: never). Then mean and std over seeds, and the same crossing on the mean
    curves. tests: {(variant, seed): test accuracy log record or None}, to add the test accuracies."""
    sign = -1 if key == "accuracy" else 1  # first reaching an accuracy = first getting down to its negative
    ref = next(iter(runs))

    def reach(recs, ref_recs):
        (f, y, _, _), (rf, ry, _, _) = mean_band(recs, key), mean_band(ref_recs, key)
        if sign * ry[-1] >= sign * ry[0]:  # the reference ended no better than it began (e.g. 0% accuracy)
            return dict(flops_to_match=None, ratio=None, no_target=True)
        match = flops_to_reach(f, sign * y, sign * ry[-1])
        return dict(flops_to_match=match, ratio=None if match is None else match / rf[-1])

    out = {}
    for v, rs in runs.items():
        per_seed = []
        for seed, recs, ref_recs in zip(seeds, rs, runs[ref]):
            f, y, _, _ = mean_band([recs], key)
            if not len(y):
                raise ValueError(f"seed {seed}: {v} has no {key} logged yet, nothing to compare")
            per_seed.append({"seed": seed, key: y[-1], "flops": f[-1]})
            if tests is not None:
                per_seed[-1]["test_accuracy"] = (tests.get((v, seed)) or {}).get("test_accuracy")
            if v != ref:
                per_seed[-1].update(reach([recs], [ref_recs]))
        out[v] = dict(per_seed=per_seed, flops=np.mean([p["flops"] for p in per_seed]),
                      **mean_std([p[key] for p in per_seed]))
        if tests is not None and None not in [p["test_accuracy"] for p in per_seed]:
            out[v].update(mean_std([p["test_accuracy"] for p in per_seed], "test_accuracy_mean"))
        if v != ref:
            out[v]["mean_curve"] = reach(rs, runs[ref])
    return json.loads(json.dumps(out, default=float))  # numpy numbers -> plain floats


def format_summary(s):
    """The summary as printed lines: every variant's final values, then how many FLOPs each of the others
    needs to reach the reference's (val loss, and on a task accuracy)."""
    n, ref = len(s["seeds"]), s["reference"]
    folder = {v["name"]: v["dir"] for v in s["variants"]}
    w = max(map(len, folder))
    note = lambda v: f"  (folder {folder[v]})" if folder[v] != v else ""
    loss, pct = (lambda x: f"{x:.4f}"), (lambda x: f"{x:.1%}")
    pm = lambda st, fmt, k="": "?" if f"{k}mean" not in st else fmt(st[f"{k}mean"]) + (
        f" ± {fmt(st[f'{k}std'])}" if n > 1 else "")
    ratio = lambda r: "n/a" if r.get("no_target") else "never" if r["ratio"] is None else f"{r['ratio']:.2f}x"

    def reaching(sec, what, fmt):
        if len(sec) == 1:
            return []
        if all(st["mean_curve"].get("no_target") for st in list(sec.values())[1:]):
            return [f"{ref}'s final {what} {fmt(sec[ref]['mean'])} is no better than at the start: no FLOPs to "
                    f"reach it"]
        lines = [f"FLOPs to first reach {ref}'s final {what} {fmt(sec[ref]['mean'])}, as a multiple of {ref}'s total "
                 f"FLOPs" + (" (per seed, and on the mean curves):" if n > 1 else ":")]
        for v, st in list(sec.items())[1:]:
            if n > 1:
                per_seed = ", ".join(f"{p['seed']}: {ratio(p)}" for p in st["per_seed"])
                text = f"per seed: {per_seed}; mean curves: {ratio(st['mean_curve'])}"
            else:
                p = st["per_seed"][0]
                text = ratio(p) + (f" ({p['flops_to_match']:.3e} FLOPs)" if p["ratio"] is not None else "")
            lines.append(f"  {v:<{w}}  {text}")
        return lines

    passes = f", {s['passes']:.2f} passes over the training data" if s.get("passes") else ""
    lines = [f"final val loss, {n} seed{'s' if n > 1 else ''} ({', '.join(map(str, s['seeds']))}){passes}"
             + (", mean ± std:" if n > 1 else ":")]
    lines += [f"  {v:<{w}}  {pm(st, loss)}  after {st['flops']:.3e} FLOPs{note(v)}" for v, st in s["val_loss"].items()]
    lines += reaching(s["val_loss"], "val loss", loss) + ["  (linear interpolation between eval points)"]
    if "accuracy" in s:
        lines.append(f"accuracy (greedy, final answer correct){', mean ± std' if n > 1 else ''}: val = "
                     f"{problems(s)} val problems at the end, test = the whole test split")
        lines += [f"  {v:<{w}}  val {pm(st, pct)}  test {pm(st, pct, 'test_accuracy_')}{note(v)}"
                  for v, st in s["accuracy"].items()]
        lines += reaching(s["accuracy"], "val accuracy", pct)
    return lines


def problems(summary):
    """How many val problems the accuracy is measured on, in words (logs from before the header said so: at most)."""
    n = summary.get("val_problems")
    return f"the first {n}" if n else f"the first (up to) {train.ACCURACY_PROBLEMS}"


def read_test_accuracy(path, at_iter=None):
    """The last {"test_accuracy", ...} record of a log.jsonl (if at_iter is given: only one made at that
    iteration), or None."""
    with open(path) as f:
        recs = [json.loads(line) for line in f if '"test_accuracy"' in line]
    recs = [r for r in recs if at_iter is None or r["at_iter"] == at_iter]
    return recs[-1] if recs else None


def common_end(logs):
    """logs: {run dir: records} -> (the last iteration evaluated in every run, each run's last evaluated
    iteration as text). Runs cut short (still training, killed, a truncated log) are compared there."""
    evals = {d: {r["iter"] for r in recs if r.get("val_loss") is not None} for d, recs in logs.items()}
    ends = ", ".join(f"{os.path.basename(d)} at iter {max(e, default='none')}" for d, e in evals.items())
    at = max(set.intersection(*evals.values()), default=0)
    if at == 0:  # (iter 0 is the initial state: the same loss, no FLOPs spent)
        raise ValueError(f"the runs have no evaluation in common past iter 0 yet ({ends}): nothing to compare")
    return at, ends


def load_logs(out_dir):
    """-> (find_runs(out_dir), seeds, {variant: [run dir of each seed]}, {run dir: log records}) for the seeds
    every variant has a log of (the others are left out with a note: still to be trained)."""
    variants = find_runs(out_dir)
    if not variants and (os.path.isfile(out_dir) or run_files(out_dir)):  # (not: "make one there")
        what = "a file" if os.path.isfile(out_dir) else "a single run's folder (train.py)"
        raise ValueError(f"{out_dir} is {what}, not a comparison folder: give the folder compare.py made (it "
                         f"holds experiment.json and a folder per variant)")
    if not variants:
        raise FileNotFoundError(f"no comparison in {out_dir} (no experiment.json, no baseline/ or lime/); make one "
                                f"with: python compare.py --out_dir={out_dir}")
    log = lambda d: os.path.join(d, "log.jsonl")
    missing = [d for v in variants for _, d in v["runs"] if not os.path.exists(log(d))]
    seeds = [s for i, (s, _) in enumerate(variants[0]["runs"]) if all(v["runs"][i][1] not in missing for v in variants)]
    if not seeds:
        raise FileNotFoundError(f"no log at {log(missing[0])}; make the runs with: python compare.py --out_dir="
                                f"{out_dir} (--resume=True to continue them)")
    if missing:
        print(f"note: no log yet at {', '.join(missing)}: comparing the seeds every variant has")
    dirs = {v["name"]: [d for s, d in v["runs"] if s in seeds] for v in variants}
    return variants, seeds, dirs, {d: read_log(log(d)) for ds in dirs.values() for d in ds}


def report(out_dir):
    """Draw OUT/loss_vs_flops.png (on a task also accuracy_vs_flops.png), write OUT/summary.json and print
    the summary, from the logs alone. Runs that end at different iterations are all compared at the last one
    they all reached, and a summary that compares them further than that is never replaced (ValueError)."""
    variants, seeds, dirs, logs = load_logs(out_dir)
    at, ends = common_end(logs)
    cut = any(max(r["iter"] for r in recs) > at for recs in logs.values())
    if cut:
        print(f"note: the runs end at different iterations ({ends}); comparing them all at iter {at}, "
              f"the last one they all reached")
        logs = {d: [r for r in recs if r["iter"] <= at] for d, recs in logs.items()}
    runs = {v: [logs[d] for d in ds] for v, ds in dirs.items()}  # {variant: [records of each seed]}
    ref = variants[0]["name"]
    summary = dict(seeds=seeds, iter=at, reference=ref, variants=[dict(name=v["name"], dir=v["dir"]) for v in variants],
                   val_loss=summarize(seeds, runs, "val_loss"))
    old = read_summary(out_dir) or {}
    gone = [s for s in old.get("seeds", []) if s not in seeds]
    if gone:  # never a summary of fewer seeds
        raise ValueError(f"not replacing {out_dir}/summary.json and its figures: they compare seeds "
                         f"{', '.join(map(str, old['seeds']))}, but seed {', '.join(map(str, gone))} has no logs here "
                         f"now. Put those runs back (or finish them: python compare.py --resume=True --out_dir={out_dir} "
                         f"and the flags they were made with), or delete summary.json to plot seed "
                         f"{', '.join(map(str, seeds))} alone")
    if isinstance(old.get("iter"), int) and old["iter"] > at:  # never a worse-informed figure
        raise ValueError(f"not replacing {out_dir}/summary.json and loss_vs_flops.png: they compare the runs at "
                         f"iter {old['iter']}, further than the logs now reach ({ends}). Let the runs finish (python "
                         f"compare.py --resume=True --out_dir={out_dir} and the flags they were made with), or delete "
                         f"summary.json to plot them as they are")
    h, title = read_log(os.path.join(dirs[ref][0], "log.jsonl"), header=True), ""
    if h:
        c, summary["passes"], summary["val_problems"] = h["config"], h.get("passes"), h.get("val_problems")
        title = (f"{c['dataset']}: n_layer={c['n_layer']}, n_embd={c['n_embd']}, n_head={c['n_head']}, block_size="
                 f"{c['block_size']}, batch_size={c['batch_size']}, {c['max_iters']} iters, lr={c['learning_rate']:g}, "
                 f"router_lr={c['router_lr']:g} ({ref}'s); val loss on {c['eval_iters']} fixed batches")
    if cut:
        title += f"\ncompared at iter {at}, the last one all runs reached ({ends})"
    paths = [os.path.join(out_dir, "loss_vs_flops.png")]
    plot_compare(paths[0], runs, summary, title)
    if any("accuracy" in r for r in runs[ref][0]):  # a task: accuracy too
        tests = {(v, s): read_test_accuracy(os.path.join(d, "log.jsonl"), at)
                 for v, ds in dirs.items() for s, d in zip(seeds, ds)}
        summary["accuracy"] = summarize(seeds, runs, "accuracy", tests)
        paths.append(os.path.join(out_dir, "accuracy_vs_flops.png"))
        plot_compare(paths[1], runs, summary, title, key="accuracy")
    with saving(os.path.join(out_dir, "summary.json")) as f:
        json.dump(summary, f, indent=1)
    paths.append(os.path.join(out_dir, "summary.json"))
    print("\n".join(format_summary(summary)) + f"\nwrote {', '.join(paths[:-1])} and {paths[-1]}")
    return summary


def smooth(y, k=5):
    """Running mean over the last k points (for the noisy train loss)."""
    c = np.cumsum(np.insert(y, 0, 0.0))
    lo = np.maximum(np.arange(1, len(y) + 1) - k, 0)
    return (c[1:] - c[lo]) / (np.arange(1, len(y) + 1) - lo)


def pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    return plt


@contextmanager
def saving(path, mode="w", kept=None):
    """atomic_file(path, mode), a full disk as one error saying what is kept (see prepare_data.on_full_disk)."""
    kept = kept or (f"it is unchanged, and the runs' checkpoints and logs are complete; free some space, then "
                    f"redraw with: python compare.py --plot={os.path.dirname(path) or '.'}")
    with on_full_disk(path, kept), atomic_file(path, mode) as f:
        yield f


def save_figure(fig, path):
    try:
        with saving(path, "wb") as f:
            fig.savefig(f, format="png", dpi=110)
    finally:
        pyplot().close(fig)


def plot_compare(path, runs, summary, title="", key="val_loss"):
    """Every variant against training FLOPs, one colour each, mean over seeds with a min-max band: val loss
    (bold, markers) and smoothed train loss (faint), the whole run on the left; on the right the second half
    zoomed (key=val_loss) or the val accuracy (key=accuracy). The reference's final value as a grey line, and
    where each other variant's mean curve reaches it as a vertical line in its colour. Written atomically."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    n, ref, sec = len(summary["seeds"]), summary["reference"], summary[key]
    right = [axes[1]] if key == "accuracy" else axes  # the axes that get the reference lines
    scale = 100 if key == "accuracy" else 1  # accuracy in %
    bands = []
    for (v, rs), color in zip(runs.items(), COLORS * len(runs)):
        (vf, vm, vlo, vhi), (tf, tm, _, _) = mean_band(rs, "val_loss"), mean_band(rs, "train_loss")
        for ax in axes if key == "val_loss" else axes[:1]:
            ax.plot(tf, smooth(tm), color=color, alpha=0.35, lw=1)
        for ax, k, (f, m, lo, hi) in [(axes[0], 1, (vf, vm, vlo, vhi)), (axes[1], scale, mean_band(rs, key))]:
            ax.plot(f, k * m, color=color, lw=2.2, marker="o", ms=4, label=v if ax is axes[0] else None)
            if n > 1:
                ax.fill_between(f, k * lo, k * hi, color=color, alpha=0.2, lw=0)
        bands.append((vf, vlo, vhi))
    what = "val loss" if key == "val_loss" else "accuracy"
    for ax in right:
        ax.axhline(scale * sec[ref]["mean"], color="gray", ls=":", lw=1.2, label=f"{ref}'s final {what}")
    never = []
    for (v, st), color in list(zip(sec.items(), COLORS * len(sec)))[1:]:
        match, ratio = st["mean_curve"]["flops_to_match"], st["mean_curve"]["ratio"]
        if match is None and not st["mean_curve"].get("no_target"):
            never.append(v)
        for ax in right if match is not None else []:
            ax.axvline(match, color=color, ls=":", lw=1.2, label=f"{v} reaches it: {ratio:.2f}x the FLOPs")
    for ax in axes:
        ax.set(xlabel="cumulative training FLOPs", ylabel="loss (nats/token)")
        ax.grid(alpha=0.3)
    mean_of = f" (mean of {n} seeds)" if n > 1 else ""
    never_text = f"\n(never reached by {', '.join(never)})" if never else ""
    if key == "val_loss":
        x1 = max(f[-1] for f, _, _ in bands)  # zoom: the second half, y range from the val curves there
        ys = np.concatenate([np.r_[lo[f >= x1 / 2], hi[f >= x1 / 2]] for f, lo, hi in bands])
        if len(ys):
            pad = 0.15 * (ys.max() - ys.min()) + 1e-3
            axes[1].set(xlim=(x1 / 2, x1 * 1.02), ylim=(ys.min() - pad, ys.max() + 2 * pad))
        axes[0].set_title("loss vs training FLOPs" + mean_of)
        axes[1].set_title("second half of training, zoomed" + never_text, fontsize=11)
    else:
        axes[0].set(ylabel="loss on the solution tokens (nats/token)", yscale="log",
                    title="loss vs training FLOPs" + (f" (mean of {n} seeds, log scale)" if n > 1 else " (log scale)"))
        axes[1].set(ylabel="accuracy (%)", title=f"accuracy vs training FLOPs: greedy solutions of\n"
                    f"{problems(summary)} val problems, final answer correct" + never_text)
        axes[1].title.set_fontsize(10)
    axes[0].legend(fontsize=9, loc="upper right", ncol=1 + (len(runs) > 4))  # one entry per variant, its colour
    axes[1].legend(fontsize=8, loc="best")                                     # the reference lines
    style = "bold with markers: val; faint: train (smoothed)" + ("; shaded: min-max over seeds" if n > 1 else "")
    fig.suptitle(f"{title}\n{style}" if title else style, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


# -----------------------------------------------------------------------------------------------------
# depth sweep: a comparison per depth in OUT/depthL, then final val loss against depth and FLOPs


def final_val(recs):
    """(iter, val loss, FLOPs) of a log's last evaluation."""
    r = [r for r in recs if r.get("val_loss") is not None][-1]
    return r["iter"], r["val_loss"], r["flops"]


def sweep_depths(out_dir):
    """The L of OUT's depthL folders, sorted."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return sorted(int(m[1]) for d in names if (m := re.fullmatch(r"depth(\d+)", d))
                  and os.path.isdir(os.path.join(out_dir, d)))


def sweep_report(out_dir):
    """OUT/sweep.json, OUT/loss_vs_depth.png and a printed summary, from the logs of OUT/depthL alone: per
    depth and variant, every seed's final val loss, their mean, min and max, and the training FLOPs."""
    depths = sweep_depths(out_dir)
    if not depths:
        raise FileNotFoundError(f"no depth runs in {out_dir} (expected {out_dir}/depthL); make them with: "
                                f"python compare.py --depths=4,8,16 --out_dir={out_dir}")
    rows = []
    for L in depths:
        _, seeds, dirs, logs = load_logs(os.path.join(out_dir, f"depth{L}"))
        row = dict(n_layer=L, seeds=seeds, variants={})
        for v, ds in dirs.items():
            ends = [final_val(logs[d]) for d in ds]
            losses = [e[1] for e in ends]
            row["variants"][v] = dict(iters=[e[0] for e in ends], val_loss=losses, mean=float(np.mean(losses)),
                                      min=min(losses), max=max(losses), flops=float(np.mean([e[2] for e in ends])))
        rows.append(row)
    ref = next(iter(rows[0]["variants"]))
    w = max(len(v) for r in rows for v in r["variants"])
    lines = [f"final val loss by depth, mean over seeds (min-max); {out_dir}"]
    for r in rows:
        vs = r["variants"]
        lines.append(f"  {r['n_layer']} layers, {len(r['seeds'])} seed{'s' if len(r['seeds']) > 1 else ''}:")
        lines += [f"    {v:<{w}}  {st['mean']:.4f} ({st['min']:.4f}-{st['max']:.4f})  {st['flops']:.2e} FLOPs"
                  + (f"  {st['mean'] - vs[ref]['mean']:+.4f} vs {ref}" if v != ref and ref in vs else "")
                  for v, st in vs.items()]
    by_depth = {r["n_layer"]: r["variants"] for r in rows}
    for L in depths:  # the paper's question: a variant at depth L against the reference at 2L
        b = by_depth.get(2 * L, {}).get(ref)
        for v, st in by_depth[L].items():
            if b and v != ref:
                lines.append(f"  {v} at {L} layers {st['mean']:.4f} with {st['flops'] / b['flops']:.2f}x the FLOPs of "
                             f"{ref} at {2 * L} layers {b['mean']:.4f}")
    summary = dict(depths=depths, reference=ref, per_depth=rows)
    with saving(os.path.join(out_dir, "sweep.json")) as f:
        json.dump(summary, f, indent=1)
    path = os.path.join(out_dir, "loss_vs_depth.png")
    plot_depths(path, rows)
    print("\n".join(lines) + f"\nwrote {path} and {os.path.join(out_dir, 'sweep.json')}")
    return summary


def plot_depths(path, rows):
    """Final val loss against depth (left) and against training FLOPs (right), every variant, mean with a
    min-max band over seeds; written atomically to path."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    names = list(dict.fromkeys(v for r in rows for v in r["variants"]))  # in order, each once
    for v, color in zip(names, COLORS * len(names)):
        at = [r for r in rows if v in r["variants"]]
        depth = [r["n_layer"] for r in at]
        mean, lo, hi, flops = ([r["variants"][v][k] for r in at] for k in ("mean", "min", "max", "flops"))
        for ax, x in zip(axes, (depth, flops)):
            ax.plot(x, mean, color=color, marker="o", lw=2, label=v)
            if any(len(r["seeds"]) > 1 for r in rows):
                ax.fill_between(x, lo, hi, color=color, alpha=0.2, lw=0, label=f"{v}, min-max over seeds")
        for L, f, m in zip(depth, flops, mean):
            axes[1].annotate(f"{L}", (f, m), textcoords="offset points", xytext=(4, 4), fontsize=8, color=color)
    depths = [r["n_layer"] for r in rows]
    axes[0].set(xscale="log", xlabel="layers", ylabel="final val loss (nats/token)", title="final val loss vs depth")
    axes[0].set_xticks(depths, [str(d) for d in depths])
    axes[0].minorticks_off()  # (log axis: only the depths are labelled)
    axes[1].set(xscale="log", xlabel="training FLOPs", ylabel="final val loss (nats/token)",
                title="final val loss vs training FLOPs (labels: layers)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None):
    cfg, explicit = train.get_config(argv, FLAGS, PRESETS, "compare.py", __doc__)
    mode = [k for k in ("plot", "analyze") if cfg[k] is not None]
    if len(mode) > 1:
        raise ValueError("--plot and --analyze are two jobs: give one, then run the other")
    unused = sorted(explicit - {"plot", "analyze", "device" if mode == ["analyze"] else "plot"} - (
        set(PRESETS[cfg["preset"]]) if "preset" in explicit else set()))
    if mode and unused:  # (they would be ignored: say so rather than seem to use them)
        raise ValueError(f"--{mode[0]} uses " + ("no other flag" if mode == ["plot"] else "only --device") + ": drop "
                         + ", ".join(f"--{k}" for k in unused) + (f" (analyze.py's options: python analyze.py "
                                                                  f"{cfg['analyze']} --help)" * (mode == ["analyze"])))
    if mode and int(os.environ.get("RANK", 0)) > 0:
        return None  # under torchrun, rank 0 alone redraws or analyzes
    if cfg["plot"]:  # a depth sweep's folder, or a comparison's
        return sweep_report(cfg["plot"]) if sweep_depths(cfg["plot"]) else report(cfg["plot"])
    if cfg["analyze"]:
        return run_analyze(cfg["analyze"], cfg["device"])
    if cfg["seeds"] < 1:
        raise ValueError(f"--seeds must be at least 1, got {cfg['seeds']}")
    variants = parse_variants(cfg["variants"])
    cfg["device"] = train.setup_ddp(cfg["device"])  # under torchrun: join the other processes, take our own GPU
    result = run_experiment(cfg, explicit, variants)
    if dist.is_initialized():  # (after an error, don't: torchrun stops the other processes)
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    run_main(main)
