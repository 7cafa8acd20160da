"""
The ablation table and loss curves (paper Table 3, Fig. 6 / App. 13 style) from a directory of train.py runs.

    python tools/report.py runs/ --out README_results.md --plot loss_curves.png

Each run is a sub-directory written by `train.py --out_dir runs/<name>` (scripts/ablation.sh names them
toy_<recipe>_<optimizer>): metrics.jsonl (train rows {step, loss, ...}, eval rows {step, val_loss}) and, when
the run finished, summary.json. scripts/ablation.sh also leaves cmd.txt (the exact command), train.log and
exit_code, which this script uses for the "command" list and for runs that stopped early.

Columns (one row per recipe x optimizer):
  train loss   mean train loss over the last 10% of logged train rows (--tail_frac): one noisy step says little
  val loss     the last evaluation's val_loss
  gap          100 * (loss - bf16 loss) / bf16 loss, against the bf16 run with the SAME optimizer (the paper's
               "loss gap", Table 3) and the same setup (config and --compile, from summary.json / cmd.txt, so a
               runs/ directory may also hold the perf runs of several configs: a "setup" column then appears)
  tokens/s, x bf16, peak memory, optimizer bytes/param   from summary.json
  status       ok | diverged (a non-finite loss: train.py stops before the update, so the NaN shows up in the
               log / exit code rather than in metrics.jsonl) | collapsed (the tail loss rose more than
               COLLAPSE_NATS above the run's best loss averaged over the same window: App. 13's naive-FP4 failure without a NaN) |
               incomplete (no summary.json: killed by a timeout or still running) | failed (exit code != 0)
"""
import argparse
import json
import math
import os
import sys

RECIPE_ORDER = ("bf16", "nvfp4", "nvfp4_46", "lora_naive", "lora_svd", "fullstack", "naive_fp4")
OPTIMIZERS = ("adamw", "root")
COLLAPSE_NATS = 0.5  # a healthy run's tail sits within ~0.1 nat of its best (same-window) loss; 0.5 up: collapse
MIN_ROWS_FOR_COLLAPSE = 20  # fewer logged steps: too short to tell a collapse from early-training noise


def read_jsonl(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))  # json reads NaN / Infinity as floats
    return rows


def read_text(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


def parse_name(name):
    """toy_<recipe>_<optimizer> -> (recipe, optimizer); recipes may contain underscores (nvfp4_46)."""
    parts = name.split("_")
    if len(parts) >= 3 and parts[-1] in OPTIMIZERS:
        return "_".join(parts[1:-1]), parts[-1]
    return name, "?"


def finite(x):
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def load_run(run_dir, tail_frac=0.1):
    """One run directory -> a dict of everything the table and the plot need."""
    name = os.path.basename(os.path.normpath(run_dir))
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    summary_path = os.path.join(run_dir, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else None
    recipe, optimizer = parse_name(name)
    cmd = read_text(os.path.join(run_dir, "cmd.txt"))
    config, compiled = name.split("_")[0], "--compile" in (cmd or "")
    if summary is not None:
        recipe, optimizer = summary.get("recipe", recipe), summary.get("optimizer", optimizer)
        config, compiled = summary.get("config", config), bool(summary.get("compile", compiled))
    train = sorted(((r["step"], r["loss"]) for r in rows if "loss" in r), key=lambda t: t[0])
    grad_norm = sorted(((r["step"], r["grad_norm"]) for r in rows if "grad_norm" in r), key=lambda t: t[0])
    val = sorted(((r["step"], r["val_loss"]) for r in rows if "val_loss" in r), key=lambda t: t[0])
    n_tail = max(1, math.ceil(tail_frac * len(train))) if train else 0
    tail = [loss for _, loss in train[-n_tail:]] if train else []
    train_loss = sum(tail) / len(tail) if tail else float("nan")
    val_loss = val[-1][1] if val else float("nan")

    exit_code = read_text(os.path.join(run_dir, "exit_code"))
    log = read_text(os.path.join(run_dir, "train.log")) or ""
    nonfinite_steps = [s for s, loss in train if not finite(loss)] + [s for s, v in val if not finite(v)]
    # the best loss at the same averaging as the tail (a window of n_tail rows), so that noise is not a collapse
    losses = [loss for _, loss in train if finite(loss)]
    windows = [sum(losses[i:i + n_tail]) / n_tail for i in range(len(losses) - n_tail + 1)] if n_tail else []
    best = min(windows, default=float("nan"))
    if nonfinite_steps or "non-finite loss" in log:
        first = min(nonfinite_steps) if nonfinite_steps else None
        last_step = train[-1][0] if train else 0
        status = f"diverged (step {first})" if first is not None else f"diverged (after step {last_step})"
    elif exit_code not in (None, "0"):
        status = "timeout" if exit_code == "124" else f"failed (exit {exit_code})"
    elif len(losses) >= MIN_ROWS_FOR_COLLAPSE and train_loss > best + COLLAPSE_NATS:
        status = "collapsed"
    elif summary is None:
        status = "incomplete"
    else:
        status = "ok"
    return {"name": name, "dir": run_dir, "recipe": recipe, "optimizer": optimizer, "config": config,
            "setup": config + (" +compile" if compiled else ""), "train": train, "val": val, "grad_norm": grad_norm,
            "steps": train[-1][0] if train else 0, "train_loss": train_loss, "val_loss": val_loss,
            "summary": summary, "status": status, "cmd": cmd}


def find_runs(root, tail_frac=0.1):
    if not os.path.isdir(root):
        raise ValueError(f"runs directory {root!r} does not exist")
    runs = [load_run(os.path.join(root, d), tail_frac) for d in sorted(os.listdir(root))
            if os.path.isfile(os.path.join(root, d, "metrics.jsonl"))]
    if not runs:
        raise ValueError(f"no run directories with a metrics.jsonl under {root!r}")

    def order(run):
        r = RECIPE_ORDER.index(run["recipe"]) if run["recipe"] in RECIPE_ORDER else len(RECIPE_ORDER)
        o = OPTIMIZERS.index(run["optimizer"]) if run["optimizer"] in OPTIMIZERS else len(OPTIMIZERS)
        return (run["setup"], o, r, run["name"])
    return sorted(runs, key=order)


def gap_percent(x, ref):
    return 100.0 * (x - ref) / ref if finite(x) and finite(ref) and ref != 0 else float("nan")


def add_gaps(runs):
    """Gap to the bf16 run of the same optimizer and setup (config, --compile): train and val loss, tokens/s."""
    base = {(r["setup"], r["optimizer"]): r for r in runs if r["recipe"] == "bf16"}
    for r in runs:
        # a run that stopped early (diverged, timeout, ...) has no comparable final loss: no gap
        b = base.get((r["setup"], r["optimizer"])) if r["status"] in ("ok", "collapsed") else None
        r["train_gap"] = gap_percent(r["train_loss"], b["train_loss"]) if b else float("nan")
        r["val_gap"] = gap_percent(r["val_loss"], b["val_loss"]) if b else float("nan")
        tps, btps = (r["summary"] or {}).get("tokens_per_s"), ((b or {}).get("summary") or {}).get("tokens_per_s")
        r["speed_ratio"] = tps / btps if finite(tps) and finite(btps) and btps > 0 else float("nan")
    return runs


def fmt(x, spec, suffix=""):
    return f"{x:{spec}}{suffix}" if finite(x) else "–"


def table_markdown(runs):
    setups = len({r["setup"] for r in runs}) > 1  # a config / --compile column only when runs differ in it
    head = (("| setup " if setups else "") + "| recipe | optimizer | steps | train loss | gap | val loss | val gap | "
            "tokens/s | × bf16 | peak mem (GiB) | opt. bytes/param | status |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        s = r["summary"] or {}
        mem = s.get("peak_mem_bytes")
        lines.append("| " + " | ".join(([r["setup"]] if setups else []) + [
            f"`{r['recipe']}`", r["optimizer"], str(r["steps"]),
            fmt(r["train_loss"], ".4f"), fmt(r["train_gap"], "+.2f", "%"),
            fmt(r["val_loss"], ".4f"), fmt(r["val_gap"], "+.2f", "%"),
            fmt(s.get("tokens_per_s"), ",.0f"), fmt(r["speed_ratio"], ".2f"),
            fmt(mem / 2**30 if finite(mem) else None, ".2f"), fmt(s.get("optimizer_bytes_per_param"), ".2f"),
            r["status"]]) + " |")
    return "\n".join(lines)


def write_markdown(runs, path, plot_path=None, tail_frac=0.1):
    out = ["# Toy-scale ablation (paper Table 3 / App. 13)", "",
           f"Train loss: mean over the last {tail_frac:.0%} of logged steps. Val loss: last evaluation. Gaps are "
           "relative to the `bf16` run with the same optimizer (and setup): 100·(loss − bf16)/bf16, only for runs "
           "that finished. Status `diverged`: a "
           f"non-finite loss stopped the run; `collapsed`: the tail loss rose > {COLLAPSE_NATS} nat above the "
           "run's best.", "", table_markdown(runs), ""]
    if plot_path:
        out += [f"![loss curves]({os.path.relpath(plot_path, os.path.dirname(os.path.abspath(path)) or '.')})", ""]
    cmds = [(r["name"], r["cmd"]) for r in runs if r["cmd"]]
    if cmds:
        out += ["Commands (seed in each line):", "", "```"] + [c for _, c in cmds] + ["```", ""]
    with open(path, "w") as f:
        f.write("\n".join(out))


def plot_curves(runs, path):
    """Top row: train loss, one panel per (setup, optimizer), one colour per recipe (Fig. 6 / App. 13 style),
    diverged or collapsed runs end in an x. Bottom row: the pre-clipping gradient norm (App. 12, Fig. 9)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = list(dict.fromkeys((r["setup"], r["optimizer"]) for r in runs))  # runs are sorted: setup, optimizer
    fig, axes = plt.subplots(2, len(panels), figsize=(6.5 * len(panels), 7.5), squeeze=False,
                             gridspec_kw={"height_ratios": (3, 2)})
    colors = {rec: plt.cm.tab10(i) for i, rec in enumerate(RECIPE_ORDER)}
    for ax, gax, (setup, opt) in zip(axes[0], axes[1], panels):
        for r in (r for r in runs if (r["setup"], r["optimizer"]) == (setup, opt)):
            gn = [(s, g) for s, g in r["grad_norm"] if finite(g)]
            if gn:
                gax.plot(*zip(*gn), color=colors.get(r["recipe"], "gray"), lw=0.8,
                         ls="--" if r["recipe"] == "naive_fp4" else "-")
            pts = [(s, loss) for s, loss in r["train"] if finite(loss)]
            label = r["recipe"] if r["status"] == "ok" else f"{r['recipe']} ({r['status']})"
            color = colors.get(r["recipe"], "gray")
            if pts:
                ax.plot(*zip(*pts), label=label, color=color, lw=1.2,
                        ls="--" if r["recipe"] == "naive_fp4" else "-")
                if r["status"].startswith(("diverged", "collapsed")):
                    ax.plot(*pts[-1], "x", color=color, ms=10, mew=2)
            vals = [(s, v) for s, v in r["val"] if finite(v)]
            if vals:
                ax.plot(*zip(*vals), "o", color=color, ms=3)
        ax.set_title(f"{setup}, optimizer {opt}  (lines: train, dots: val)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        losses = [loss for r in runs if (r["setup"], r["optimizer"]) == (setup, opt) for _, loss in r["train"]
                  if finite(loss)]
        if losses:  # the first steps (~10.8 nat) would squash the interesting part
            lo = min(losses)
            ax.set_ylim(lo - 0.1, min(max(losses), lo + 4.0) + 0.1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        gax.set_yscale("log")
        gax.set_xlabel("step")
        gax.set_ylabel("grad norm (before clipping)")
        gax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", help="directory holding one sub-directory per run")
    p.add_argument("--out", default="README_results.md", help="markdown file to write")
    p.add_argument("--plot", default="loss_curves.png", help="loss-curve PNG ('' to skip)")
    p.add_argument("--json", default=None, help="also write the table as JSON here")
    p.add_argument("--tail_frac", type=float, default=0.1, help="fraction of the last logged steps averaged")
    args = p.parse_args(argv)
    if not 0 < args.tail_frac <= 1:
        p.error(f"--tail_frac {args.tail_frac}: must be in (0, 1]")
    try:
        runs = add_gaps(find_runs(args.runs, args.tail_frac))
    except ValueError as e:
        p.error(str(e))
    if args.plot:
        plot_curves(runs, args.plot)
    write_markdown(runs, args.out, args.plot or None, args.tail_frac)
    if args.json:
        keep = ("name", "setup", "recipe", "optimizer", "steps", "train_loss", "val_loss", "train_gap", "val_gap",
                "speed_ratio", "status", "summary", "cmd")
        with open(args.json, "w") as f:
            json.dump([{k: r[k] for k in keep} for r in runs], f, indent=2)
    print(table_markdown(runs))
    print(f"-> {args.out}" + (f", {args.plot}" if args.plot else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
