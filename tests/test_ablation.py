"""tools/ablation.py: the grids, real tiny train.py runs aggregated into the record, skipping
finished runs, the verdict rules on rows whose answer is known, and the split and width grids'
commands (--dry_run)."""
import json
import math
import os
import shlex

import numpy as np
import pytest

import data
from tools import ablation

TINY = ["--config", "tiny", "--lr", "3e-3", "--max_steps", "3", "--batch_size", "2", "--seq_len",
        "32", "--warmup", "1", "--eval_every", "3", "--eval_iters", "1", "--log_every", "1",
        "--seeds", "0", "--cpu_jobs", "2", "--gpus", ""]


def test_grid_is_the_issue_grid():
    jobs = ablation.grid([0, 1, 2])
    assert len(jobs) == len(set(jobs)) == 6 * 2 * 3 + 2  # 38 runs
    assert {(r, o) for r, o, s in jobs if r == "naive_fp4"} == {("naive_fp4", "adamw"),
                                                               ("naive_fp4", "root")}
    assert all(s == 0 for r, o, s in jobs if r == "naive_fp4")
    # seed by seed: a partial grid has every row
    assert [s for _, _, s in jobs] == sorted(s for _, _, s in jobs)
    pick = lambda pats: {ablation.run_name(*j) for j in jobs if ablation.selected(j, pats)}
    assert pick(["nvfp4_root"]) == {"nvfp4_root_s0", "nvfp4_root_s1", "nvfp4_root_s2"}
    assert pick(["nvfp4"]) == {f"nvfp4_{o}_s{s}" for o in ("adamw", "root")
                               for s in (0, 1, 2)}  # not nvfp4_46
    assert pick(["lora_*_adamw_s1"]) == {"lora_naive_adamw_s1", "lora_svd_adamw_s1"}
    args = ablation.parse_args(["--lr", "adamw=2e-3,root=4e-3", "--max_steps", "7"])
    assert ablation.train_command(args, "bf16", "root", 1)[-4:] == ["--max_steps", "7", "--lr",
                                                                    "0.004"]
    assert ablation.train_command(args, "lora_naive", "adamw", 1)[-4:] == ["--lr", "0.002",
                                                                           "--lora_lr", "0.002"]
    args = ablation.parse_args(["--lr", "1e-3", "--lora_lr_scale", "2"])
    assert ablation.train_command(args, "fullstack", "root", 0)[-2:] == ["--lora_lr", "0.002"]


def test_bad_input_is_one_line_exit_2(capsys):
    for argv in (["--seeds", "a"], ["--shard", "2/2"],
                 ["--rows", "nope", "--dry_run", "--lr", "1e-3"],
                 ["--lr", "root=1e-3"], ["--dry_run"], ["--lr", "adamw=x,root=1"],
                 ["--grid", "nope", "--lr", "1e-3"], ["--widths", "100", "--lr", "1e-3"]):
        with pytest.raises(SystemExit) as e:
            ablation.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("ablation.py: error:") and "\n" not in err


def test_tiny_runs_aggregate_and_skip(tmp_path, capsys):
    runs, results = tmp_path / "runs", tmp_path / "results"
    argv = TINY + ["--rows", "bf16_adamw,nvfp4_adamw", "--runs", str(runs), "--results",
                   str(results)]
    ablation.main(argv)
    rows = json.loads((results / "summary.json").read_text())
    assert sorted((r["recipe"], r["optimizer"], r["seed"]) for r in rows) == [
        ("bf16", "adamw", 0), ("nvfp4", "adamw", 0)]
    for r in rows:
        assert {"recipe", "optimizer", "seed", "val_loss", "train_loss", "tokens", "params",
                "steps"} <= set(r)
        assert r["steps"] == 3 and r["tokens"] == 3 * 2 * 32 and r["params"] > 1e6
        assert r["status"] == "ok"
        lines = (runs / f"{r['recipe']}_adamw_s0" / "metrics.jsonl").read_text().split("\n")
        metrics = [json.loads(x) for x in lines if x]
        val = [m["val_loss"] for m in metrics if "val_loss" in m]
        assert r["val_loss"] == pytest.approx(val[-1])
        assert 0 < r["epochs"] < 1e-3
        assert r["tokens_per_param"] == pytest.approx(r["tokens"] / r["params"])
        run = json.loads((runs / f"{r['recipe']}_adamw_s0" / "summary.json").read_text())
        assert (r["numerics_id"], r["commit"]) == (run["numerics_id"], run["commit"])
        assert r["command"].startswith("train.py --recipe") and r["device"] == "cpu"
    table = (results / "table.md").read_text()
    bf16, nvfp4 = (next(r["val_loss"] for r in rows if r["recipe"] == k) for k in ("bf16", "nvfp4"))
    assert f"{100 * (nvfp4 - bf16) / bf16:+.2f}%" in table  # the gap column comes from the rows
    assert "| `nvfp4` | adamw | 1 |" in table and "## Verdicts" in table
    assert (results / "loss_curves.png").stat().st_size > 10_000

    # finished runs are skipped; --force reruns only the rows it names
    stamp = {k: (runs / f"{k}_adamw_s0" / "summary.json").stat().st_mtime_ns
             for k in ("bf16", "nvfp4")}
    capsys.readouterr()
    ablation.main(argv)
    assert "2 runs selected, 2 finished earlier (skipped)" in capsys.readouterr().out
    ablation.main(argv[:-4] + ["--rows", "nvfp4_adamw_s0", "--force", "--runs", str(runs),
                               "--results", str(results)])
    assert (runs / "bf16_adamw_s0" / "summary.json").stat().st_mtime_ns == stamp["bf16"]
    assert (runs / "nvfp4_adamw_s0" / "summary.json").stat().st_mtime_ns != stamp["nvfp4"]
    assert len(json.loads((results / "summary.json").read_text())) == 2

    # --merge: a record made over several calls keeps the rows whose run folders are elsewhere,
    # curves included (the plot draws them from the rows)
    before = {r["recipe"]: r for r in json.loads((results / "summary.json").read_text())}
    assert [s for s, _ in before["bf16"]["curve"]["train"]] == [1, 2, 3]
    assert before["bf16"]["curve"]["val"][-1][1] == pytest.approx(before["bf16"]["val_loss"])
    (runs / "bf16_adamw_s0").rename(tmp_path / "elsewhere")
    ablation.main(["--aggregate_only", "--merge", "--runs", str(runs), "--results", str(results)])
    merged = {r["recipe"]: r for r in json.loads((results / "summary.json").read_text())}
    assert merged == before
    ablation.main(["--aggregate_only", "--runs", str(runs), "--results", str(results)])
    assert [r["recipe"] for r in json.loads((results / "summary.json").read_text())] == ["nvfp4"]


def test_a_killed_run_continues_from_its_checkpoint(tmp_path, capsys):
    """A run the deadline killed (a checkpoint, no summary.json) is resumed, not restarted; one
    without a checkpoint, or under --force, starts over (train.py's resume is exact:
    tests/test_train.py::test_resume_is_exact)."""
    runs = tmp_path / "runs"
    argv = TINY + ["--rows", "bf16_adamw", "--runs", str(runs), "--dry_run"]
    ablation.main(argv)
    assert "--resume" not in capsys.readouterr().out
    (runs / "bf16_adamw_s0").mkdir(parents=True)
    (runs / "bf16_adamw_s0" / "ckpt.pt").write_bytes(b"")
    ablation.main(argv)
    command = next(line for line in capsys.readouterr().out.splitlines() if "train.py" in line)
    assert command.split()[-1] == "--resume" and "bf16_adamw_s0" in command
    ablation.main(argv + ["--force"])
    assert "--resume" not in capsys.readouterr().out


def test_a_diverged_run_is_a_finished_result(tmp_path, capsys):
    runs = tmp_path / "runs"
    argv = TINY + ["--rows", "bf16_root", "--train_args", "--lr 1e30", "--runs", str(runs),
                   "--results", str(tmp_path / "results")]
    ablation.main(argv)
    rows = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert [(r["recipe"], r["status"], r["val_loss"]) for r in rows] == [("bf16", "diverged", None)]
    header = json.loads((runs / "bf16_root_s0" / "metrics.jsonl").read_text().split("\n")[0])
    assert rows[0]["numerics_id"] == header["settings"]["numerics_id"]  # from the header
    capsys.readouterr()
    ablation.main(argv)
    assert "1 finished earlier (skipped)" in capsys.readouterr().out


def test_a_runs_losses_windows_collapse_and_record_merge(tmp_path):
    """The pieces collect_rows and aggregate rest on: train loss over windows of at least 5 logged
    steps (TAIL of a short run is one noisy batch); collapse once the final window is
    COLLAPSE_NATS above the run's best, or a finished run's val loss is not finite; --merge keeps
    each run once, its own folder's row first, a recorded collapse re-judged but a divergence
    kept; the corpus size from the shard's header; a paired difference's SE std / sqrt(n)."""
    assert ablation.window_means([float(v) for v in range(10)]) == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert ablation.window_means([1.0, 2.0, 3.0]) == [2.0]

    def row(seed, train, best, val, status="ok"):
        return {"recipe": "nvfp4", "optimizer": "adamw", "seed": seed, "val_loss": val,
                "train_loss": train, "best_train_loss": best, "status": status}
    rows = ablation.mark_collapsed([row(0, 3.9, 3.0, 3.9), row(1, 4.1, 3.0, 4.1),
                                    row(2, 3.0, 3.0, float("nan"))])
    assert [r["status"] for r in rows] == ["ok", "collapsed", "collapsed"]

    recorded = [row(0, 9.0, 3.0, 9.0, "collapsed"), row(1, None, None, None, "diverged"),
                row(2, 3.5, 3.5, 3.5, "ok")]
    (tmp_path / "summary.json").write_text(json.dumps(recorded))
    merged = ablation.with_recorded([row(2, 3.2, 3.2, 3.2)], tmp_path / "summary.json")
    assert [(r["seed"], r["status"], r["val_loss"]) for r in merged] == [
        (0, "ok", 9.0), (1, "diverged", None), (2, "ok", 3.2)]

    data.write_shard(str(tmp_path / "train.bin"), np.arange(1234, dtype=np.uint16))
    assert ablation.corpus_train_tokens(str(tmp_path)) == 1234
    mean, se, n = ablation.difference({0: 1.0, 1: 2.0, 2: 3.0}, {0: 0.0, 1: 0.0, 2: 0.0, 3: 5.0})
    assert (mean, n) == (2.0, 3) and se == pytest.approx(1 / math.sqrt(3))


def synthetic_rows(val):
    """val: {(recipe, optimizer): [val loss per seed]} -> rows as collect_rows makes them."""
    return ablation.mark_collapsed([
        {"recipe": r, "optimizer": o, "seed": s, "val_loss": v, "train_loss": v,
         "best_train_loss": v, "status": "ok" if v is not None else "diverged"}
        for (r, o), losses in val.items() for s, v in enumerate(losses)])


def verdict_of(rows, claim, optimizer):
    return next(v for c, o, v, _ in ablation.verdicts(rows)
                if c.startswith(claim) and o == optimizer)


def test_verdicts_follow_the_numbers():
    base = [3.00, 3.03, 2.97]  # bf16 seed std 0.03
    shift = lambda d: [b + d for b in base]  # a recipe that tracks bf16's seed noise, offset by d
    paper = {("bf16", "adamw"): base, ("nvfp4", "adamw"): shift(0.12),
             ("nvfp4_46", "adamw"): shift(0.06), ("lora_svd", "adamw"): shift(0.02),
             ("fullstack", "adamw"): shift(0.025), ("naive_fp4", "adamw"): [None]}
    rows = synthetic_rows(paper)
    for claim in ("gap resolvable", "nvfp4 gap > nvfp4_46 gap > lora_svd gap", "fullstack close",
                  "naive_fp4"):
        assert verdict_of(rows, claim, "adamw") == "confirmed", claim
    no_root_runs = verdict_of(rows, "gap resolvable", "root")
    assert no_root_runs == "not resolvable at this scale"

    swapped = {**paper, ("nvfp4_46", "adamw"): shift(0.15), ("fullstack", "adamw"): shift(0.3),
               ("naive_fp4", "adamw"): shift(0.01), ("nvfp4", "adamw"): shift(0.05)}
    rows = synthetic_rows(swapped)
    assert verdict_of(rows, "gap resolvable", "adamw") == "not confirmed"  # 0.05 < 3 x 0.03
    assert verdict_of(rows, "nvfp4 gap > nvfp4_46", "adamw") == "not confirmed"
    assert verdict_of(rows, "fullstack close", "adamw") == "not confirmed"
    assert verdict_of(rows, "naive_fp4", "adamw") == "not confirmed"

    blown_up = synthetic_rows({**paper, ("naive_fp4", "adamw"): [50.0]})  # finished, far above bf16
    assert verdict_of(blown_up, "naive_fp4", "adamw") == "confirmed"
    assert "| `naive_fp4` | adamw | 1 | 50.0000 ± n/a |" in ablation.table(blown_up)

    noisy = {**paper, ("nvfp4_46", "adamw"): [3.30, 2.90, 3.10]}  # per-seed gaps scatter by +-4
    verdict = verdict_of(synthetic_rows(noisy), "nvfp4 gap > nvfp4_46", "adamw")
    assert verdict == "not resolvable at this scale"


def test_gaps_pair_by_seed_verdicts_need_two_ses_and_collapse_is_judged_per_optimizer():
    """gaps() pairs each seed with bf16's same seed (its init and batches cancel: a recipe 1% over
    bf16 on every seed has a 1% gap on each, however far the seeds scatter); a paired difference
    resolves only beyond SIGNIFICANT_SES standard errors; a run collapses against bf16's val loss
    under its own optimizer."""
    base = {0: 3.0, 1: 3.3, 2: 3.6}
    rows = [{"recipe": recipe, "optimizer": "adamw", "seed": s, "val_loss": v * f}
            for recipe, f in (("bf16", 1.0), ("nvfp4", 1.01)) for s, v in base.items()]
    assert ablation.gaps(rows, "nvfp4", "adamw") == pytest.approx({0: 1.0, 1: 1.0, 2: 1.0})

    def at(ses):  # three differences, sample std 1 (SE 1/sqrt(3)), their mean ses SEs
        mean = ses / math.sqrt(3)
        return {0: mean - 1, 1: mean, 2: mean + 1}

    assert ablation.SIGNIFICANT_SES == 2.0
    assert ablation.verdict_of_difference(at(1.5), "costs")[0] == "within noise"
    assert ablation.verdict_of_difference(at(2.5), "costs")[0] == "costs"
    assert ablation.verdict_of_difference(at(-2.5), "costs")[0] == "not costs (the reverse)"
    # bf16 at 3.0 with AdamW, 5.0 with Root: a Root run 0.5 above Root's bf16 has not collapsed
    # (though 1.5 above the two's mean), one 1.5 above it has
    rows = [{"recipe": recipe, "optimizer": opt, "seed": 0, "val_loss": v, "train_loss": v,
             "best_train_loss": v, "status": "ok"}
            for recipe, opt, v in (("bf16", "adamw", 3.0), ("bf16", "root", 5.0),
                                   ("nvfp4", "root", 5.5), ("nvfp4", "root", 6.5))]
    assert [r["status"] for r in ablation.mark_collapsed(rows)[2:]] == ["ok", "collapsed"]


def test_grid_time_adds_startup_and_steps():
    rows = [{"recipe": r, "optimizer": o, "seed": s, "status": "ok", "tokens": 100, "steps": 10,
             "tokens_per_s": 10.0 * (2 if r == "bf16" else 1), "wall_s": 15.0}
            for r, o, s in ablation.grid([0])]
    startup, per_step = ablation.grid_time(rows)  # seeds 1, 2 are projected from seed 0's runs
    assert per_step == pytest.approx(38 - 6 * 0.5)  # 6 bf16 runs at 0.5 s a step, 32 others at 1 s
    assert startup == pytest.approx(6 * 10 + 32 * 5)
    assert ablation.grid_time([r for r in rows if r["recipe"] != "fullstack"]) is None


SPLIT = ["--grid", "split", "--config", "tiny", "--lr", "adamw=3e-3,root=6e-3", "--max_steps",
         "1000", "--dry_run"]


def test_split_grid_dry_run_prints_one_command_per_run(tmp_path, capsys):
    ablation.main(SPLIT + ["--runs", str(tmp_path / "runs")])
    out = capsys.readouterr().out.strip().splitlines()
    commands = [line for line in out if line.startswith("train.py")]
    assert len(commands) == (len(ablation.SPLIT_ROWS) + len(ablation.LEAVE_ONE_OUT_ROWS)) * 3 == 36
    assert "estimated" in out[-1] and "min of one H200" in out[-1]
    one = next(c for c in commands if "/lora_svd_momentum_nvfp4_root_s1 " in c)
    assert "--recipe fullstack --optimizer root --seed 1" in one and "--attn_policy bf16" in one
    assert one.count("--numerics") == 2 and f"--numerics {ablation.NS_FP32}" in one
    assert f"--numerics {ablation.ADAMW_FP32}" in one  # the momentum as shipped, the rest fp32
    states = next(c for c in commands if "/lora_svd_states_nvfp4_adamw_s0 " in c)
    assert "--recipe fullstack" in states and "--attn_policy bf16" in states and "--lr 0.003 " in states
    refs = [c for c in commands if "/lora_svd_root_s" in c or "/lora_svd_adamw_s" in c]
    assert len(refs) == 6 and not any("--numerics" in c for c in refs)  # plain lora_svd
    # leave one out: fullstack with only the named part back in high precision
    out1 = next(c for c in commands if "/fullstack_momentum_fp32_root_s2 " in c)
    assert "--recipe fullstack --optimizer root --seed 2" in out1 and "--attn_policy" not in out1
    assert out1.count("--numerics") == 1 and f"--numerics {ablation.MOMENTUM_FP32}" in out1
    attn = next(c for c in commands if "/fullstack_attn_bf16_root_s0 " in c)
    assert "--attn_policy bf16" in attn and "--numerics" not in attn
    capsys.readouterr()
    ablation.main(SPLIT + ["--runs", str(tmp_path / "runs"), "--rows", "fullstack"])
    out = [x for x in capsys.readouterr().out.splitlines() if x.startswith("train.py")]
    assert len(out) == 3 and all("--recipe fullstack" in c and "--numerics" not in c for c in out)
    assert all("/fullstack_root_s" in c for c in out)  # the row, not the rows named after it


def test_split_takes_table3s_runs_where_the_commands_match(tmp_path, capsys):
    """The split's lora_svd and fullstack rows are Table 3's runs (results/ablation/summary.json)
    when their commands match but for --out_dir, --cuda_graphs and --resume: not trained again, and
    paired by seed with the parts; another grid length (other numbers) takes none of them."""
    table3 = ["--grid", "split", "--config", "tiny", "--max_steps", "1500", "--batch_size", "32",
              "--seq_len", "256", "--warmup", "50", "--eval_every", "250", "--eval_iters", "8",
              "--log_every", "50", "--lr", "adamw=3e-3,root=6e-3", "--seeds", "0,1,2,3,4",
              "--runs", str(tmp_path / "runs"), "--dry_run"]
    args = ablation.parse_args(table3)
    rows = ablation.table3_rows(args, [])
    assert sorted({(r["recipe"], r["optimizer"]) for r in rows}) == [
        ("fullstack", "root"), ("lora_svd", "adamw"), ("lora_svd", "root")]
    assert all(sorted(r["seed"] for r in rows if r["recipe"] == recipe and r["optimizer"] == opt)
               == [0, 1, 2, 3, 4] for recipe, opt in (("fullstack", "root"), ("lora_svd", "root")))
    assert any("--cuda_graphs" in r["command"] for r in rows)  # eager's bits: taken too
    ablation.main(table3 + ["--rows", "*_root_s*"])
    out = capsys.readouterr().out.splitlines()
    commands = [x for x in out if x.startswith("train.py")]
    assert len(commands) == (4 + 4) * 5 and not any("--recipe lora_svd --optimizer root" in c
                                                    and "--attn_policy" not in c for c in commands)
    assert not any("/fullstack_root_s" in c for c in commands)  # Table 3's
    assert ablation.table3_rows(ablation.parse_args(table3[:5] + ["1000"] + table3[6:]), []) == []
    a = shlex.split("train.py --recipe fullstack --seed 3 --out_dir x --lr 0.006")
    assert ablation.same_run(a, a[:5] + ["--out_dir", "y", "--lr", "0.006", "--cuda_graphs"])
    assert not ablation.same_run(a, a[:-1] + ["0.003"])


def test_width_grid_dry_run_keeps_tokens_per_non_embedding_parameter(tmp_path, capsys):
    ablation.main(["--grid", "width", "--config", "tiny", "--lr", "3e-3", "--max_steps", "768",
                   "--seq_len", "256", "--dry_run", "--runs", str(tmp_path / "runs")])
    commands = [x.split() for x in capsys.readouterr().out.splitlines() if x.startswith("train.py")]
    assert len(commands) == 3 * 3 * 3
    flag = lambda c, f: int(c[c.index(f) + 1])
    ratio = {}
    for c in commands:
        w = flag(c, "--n_embd")
        _, non_embedding, _ = ablation.width_shape(w)
        tokens = flag(c, "--max_steps") * flag(c, "--batch_size") * flag(c, "--grad_accum") * 256
        ratio[w] = tokens / non_embedding
        assert flag(c, "--batch_size") <= ablation.MAX_MICRO_BATCH
        assert flag(c, "--ffn_hidden") == 3 * w and flag(c, "--n_head") == w // 64
        if "lora_svd" in c:
            assert flag(c, "--lora_rank") == w // 4
    assert sorted(ratio) == [64, 128, 256]
    assert max(ratio.values()) / min(ratio.values()) < 1.1  # tokens per non-embedding parameter
    with pytest.raises(SystemExit):
        ablation.main(["--grid", "width", "--lr", "3e-3", "--batch_size", "8", "--dry_run"])


def test_width_shape_counts_the_models_non_embedding_parameters():
    import torch
    from model import GPT, config_from_name
    for width in (64, 128, 256):
        shape, non_embedding, embedding = ablation.width_shape(width)
        with torch.device("meta"):
            m = GPT(config_from_name("tiny", **shape))
        assert m.num_params() - m.wte.weight.numel() == non_embedding
        assert m.wte.weight.numel() == embedding
    tiny = config_from_name("tiny").__dict__
    assert ablation.width_shape(128)[0] == {k: tiny[k] for k in ("n_embd", "n_head", "n_kv_head",
                                                                 "ffn_hidden")}


def test_split_and_width_verdicts_follow_the_numbers():
    rows = ablation.mark_collapsed([
        {"recipe": row, "optimizer": opt, "seed": s, "val_loss": v, "train_loss": v,
         "best_train_loss": v, "status": "ok"}
        for row, opt, vals in (("lora_svd", "root", [2.30, 2.26, 2.27]),
                               ("lora_svd_momentum_nvfp4", "root", [2.34, 2.30, 2.31]),
                               ("fullstack", "root", [2.301, 2.258, 2.272]))
        for s, v in enumerate(vals)])
    text = "\n".join(ablation.split_tables(rows))
    assert "| `lora_svd_momentum_nvfp4` | root |" in text and "| costs |" in text
    assert "**confirmed**" in text  # fullstack sits within 2 SE of lora_svd
    assert "Leave one out" not in text  # none of its rows has run
    # leave one out: fullstack's attention back in bf16 saves ~1% on every seed, the NS nothing
    loo = [{"recipe": row, "optimizer": "root", "seed": s, "val_loss": v, "status": "ok"}
           for row, f in (("fullstack_attn_bf16", [0.990, 0.991, 0.989]),
                          ("fullstack_ns_fp32", [1.001, 0.999, 1.000]))
           for s, v in enumerate(v0 * x for v0, x in zip([2.301, 2.258, 2.272], f))]
    text = "\n".join(ablation.split_tables(rows + loo))
    assert "| `fullstack_attn_bf16` | `--attn_policy bf16` | 3 | +1.01 ± 0.06% | costs |" in text
    assert ("| `fullstack_ns_fp32` | `optim.newton_schulz=fp32` | 3 | +0.00 ± 0.06% | "
            "within noise |") in text
    base = [3.0, 3.1, 2.9]
    grow = {64: 1.0, 128: 2.0, 256: 3.0}  # nvfp4_46's gap in % grows by 1 point per doubling
    rows = [{"recipe": f"{r}_w{w}", "optimizer": "adamw", "seed": s,
             "val_loss": b * (1 + f * g / 100), "status": "ok", "tokens": 1, "train_loss": 0,
             "best_train_loss": 0}
            for w, g in grow.items() for s, b in enumerate(base)
            for r, f in (("bf16", 0), ("nvfp4_46", 1), ("lora_svd", 0.5 + 0.01 * s))]
    text = "\n".join(ablation.width_tables(rows, [64, 128, 256]))
    assert "| the nvfp4_46 gap grows with width | **confirmed** | +1.00" in text
    assert "grows with width | **confirmed** | +0.49 ± 0.01" in text.split("\n")[-1]


SCALE = ["--grid", "scale", "--config", "tiny", "--lr", "adamw=3e-3,root=6e-3", "--dry_run"]


def test_scale_grid_trains_every_rung_to_the_same_tokens_per_parameter(tmp_path, capsys):
    """The ladder: bf16, lora_svd and fullstack with both optimizers at every rung, depth and
    width grown together, the same tokens per parameter (the model's own count), lr 128/width x
    --lr; its smallest rung is Table 3's tiny run."""
    import torch
    from model import GPT, config_from_name
    ablation.main(SCALE + ["--runs", str(tmp_path / "runs"), "--seeds", "0"])
    commands = [x.split() for x in capsys.readouterr().out.splitlines() if x.startswith("train.py")]
    assert len(commands) == len(ablation.SCALE_RUNGS) * 3 * 2
    flag = lambda c, f: c[c.index(f) + 1]
    ratio = {}
    for c in commands:
        shape = {k: int(flag(c, f"--{k}")) for k in ("n_layer", "n_embd", "n_head", "n_kv_head",
                                                        "ffn_hidden")}
        with torch.device("meta"):
            params = GPT(config_from_name("tiny", **shape)).num_params()
        assert params == ablation.scale_params(shape["n_layer"], shape["n_embd"])
        tokens = (int(flag(c, "--max_steps")) * int(flag(c, "--batch_size"))
                  * int(flag(c, "--grad_accum")) * int(flag(c, "--seq_len")))
        ratio[shape["n_embd"]] = tokens / params
        assert shape["n_embd"] // shape["n_head"] == 64 and shape["n_head"] % shape["n_kv_head"] == 0
        assert int(flag(c, "--batch_size")) <= ablation.MAX_MICRO_BATCH
        lr = {"adamw": 3e-3, "root": 6e-3}[flag(c, "--optimizer")] * 128 / shape["n_embd"]
        assert float(flag(c, "--lr")) == pytest.approx(lr, rel=1e-3)
    assert max(ratio.values()) / min(ratio.values()) < 1.05 and min(ratio.values()) >= 1.7
    assert len({n for n, _ in ablation.SCALE_RUNGS}) == len(ablation.SCALE_RUNGS)  # depth grows
    tiny = next(" ".join(c) for c in commands if "bf16_l4w128_adamw_s0" in " ".join(c))
    for part in ("--max_steps 1500", "--batch_size 32", "--seq_len 256", "--lr 0.003",
                 "--warmup 50"):  # Table 3's tiny run
        assert part in tiny


def test_scale_verdicts_follow_the_numbers():
    """A gap that halves with every doubling of the parameters narrows (and its slope is the
    drop per doubling); a flat one does not."""
    rungs = ablation.SCALE_RUNGS
    logs = {nw: math.log2(ablation.scale_params(*nw)) for nw in rungs}
    rows = []
    for s, base in enumerate([3.0, 3.1, 2.9]):
        for nw in rungs:
            n, w = nw
            shrinking = 4.0 - 1.0 * (logs[nw] - logs[rungs[0]]) + 0.05 * s  # -1 point per doubling
            for recipe, gap in (("bf16", 0.0), ("fullstack", shrinking), ("lora_svd", 2.0 + 0.03 * s)):
                for opt in ablation.OPTIMIZERS:
                    rows.append({"recipe": f"{recipe}_l{n}w{w}", "optimizer": opt, "seed": s,
                                 "val_loss": base * (1 + gap / 100), "epochs": 1.0})
    text = "\n".join(ablation.scale_tables(rows))
    full = next(line for line in text.splitlines() if line.startswith("| `fullstack` − `bf16`, adamw"))
    assert "**narrows**" in full and "-1.00 ± 0.00 points per doubling" in full
    flat = next(line for line in text.splitlines() if line.startswith("| `lora_svd` − `bf16`, root"))
    assert "narrows**" not in flat and "extrapolation" in flat


def test_scale_grid_runs_and_aggregates_on_a_cpu(tmp_path):
    """The smallest rung for real (one step each: tiny tokens per parameter), aggregated into
    table.md, summary.json and the gap plot."""
    ablation.main(["--grid", "scale", "--config", "tiny", "--lr", "3e-3", "--seeds", "0",
                   "--tokens_per_param", "1e-5", "--base_batch", "2", "--seq_len", "32",
                   "--rows", "bf16_l4w128_adamw,fullstack_l4w128_adamw", "--gpus", "",
                   "--eval_iters", "1", "--log_every", "1", "--cpu_jobs", "2",
                   "--runs", str(tmp_path / "runs"),
                   "--results", str(tmp_path / "results")])
    table = (tmp_path / "results" / "table.md").read_text()
    assert "| `fullstack` | adamw |" in table and (tmp_path / "results" / "gap_vs_params.png").exists()
    assert "One rung so far: no slope" in table and "does it narrow" not in table
    rows = json.load(open(tmp_path / "results" / "summary.json"))
    assert sorted(r["row"] for r in rows) == ["bf16_l4w128", "fullstack_l4w128"]


def test_the_deadline_starts_no_run_the_finished_ones_say_cannot_finish(monkeypatch, capsys):
    """A run starts only if the time left covers what this call's finished runs took (their
    median), and at least a minute: one started to be killed slows the runs beside it."""
    clock = [0.0]
    ran = []

    def fake_run(args, job, label, env, stop_at):  # each run takes 100 s of the clock
        ran.append(ablation.run_name(*job))
        clock[0] += 100
        return "ok", "done"

    monkeypatch.setattr(ablation.time, "time", lambda: clock[0])
    monkeypatch.setattr(ablation, "run_one", fake_run)
    args = ablation.parse_args(TINY + ["--cpu_jobs", "1", "--deadline", "220"])  # stops at 190 s
    jobs = [("bf16", "adamw", s) for s in range(3)]
    ablation.run_grid(args, jobs)
    # 190 s left: the first starts; 90 s left (over a minute, under the 100 s a run took): no more
    assert ran == ["bf16_adamw_s0"]
    assert capsys.readouterr().out.count("deadline: not starting") == 2
