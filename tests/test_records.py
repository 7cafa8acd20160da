"""The records know their numerics, and the README quotes only current ones: every row of a
results/**/summary.json outside a historical/ folder carries a numerics_id and a commit, and its id is
what today's train.py computes for the row's command; the README's generated tables equal what
tools/readme_tables.py writes from the records, to the printed digits; and no number of a
historical record's rows appears in the README."""
import glob
import json
import os
import shlex

import pytest
import torch

import attention
import lora_svd
import nvfp4
import optim
import train
from tools import ablation, readme_tables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def records(historical):
    """[(path, rows)] of the train.py run records under results/ (summary.json: a list of rows,
    runs.json: {"runs": [...]}), inside or outside historical/ folders."""
    out = []
    for pattern in ("summary.json", "runs.json"):
        for path in glob.glob(os.path.join(ROOT, "results", "**", pattern), recursive=True):
            if (f"{os.sep}historical{os.sep}" in path) != historical:
                continue
            with open(path) as f:
                record = json.load(f)
            if isinstance(record, dict):  # {"runs": [...]}, or one run's own summary
                record = record.get("runs", [record])
            out.append((os.path.relpath(path, ROOT), record))
    return out


def command_numerics_id(command, device, monkeypatch):
    """The numerics_id today's train.py gives `command` ("train.py --flag ..."), run on `device`
    with one rank: its flags resolved as train.main resolves them, contracts fresh, --numerics
    applied."""
    argv = shlex.split(command)
    assert os.path.basename(argv[0]) == "train.py", command
    with monkeypatch.context() as m:
        m.setattr(nvfp4, "LINEAR", dict(nvfp4.LINEAR))
        m.setattr(optim, "CONTRACT", dict(optim.CONTRACT))
        m.setattr(lora_svd, "BRANCH", lora_svd.BRANCH)
        m.setattr(torch.cuda, "is_available", lambda: device == "cuda")  # its defaults there
        args = train.parse_args(argv[1:])
        train.resolve_args(args, 1)
        train.fill_schedule(args)
        return train.numerics_id(train.numerics(args, 1))


@pytest.mark.parametrize("path,rows", records(historical=False))
def test_current_records_match_todays_numerics(path, rows, monkeypatch):
    for row in rows:
        assert row.get("numerics_id") and row.get("commit") and row.get("command"), \
            f"{path}: a row without its numerics_id, commit or command ({row.get('command')})"
        assert command_numerics_id(row["command"], row["device"], monkeypatch) == \
            row["numerics_id"], f"{path}: {row['command']} was made with other numerics: move " \
            "the record under results/historical/ or rerun it"


def test_the_check_tells_a_fresh_record_from_another_numerics(tmp_path, monkeypatch):
    """A row tools/ablation.py aggregates from a real 2-step run passes; the same row fails once a
    scheme's version moves (what the 16-bit SR draws did to every older record)."""
    runs, results = tmp_path / "runs", tmp_path / "results"
    ablation.main(["--config", "tiny", "--lr", "3e-3", "--max_steps", "2", "--batch_size", "2",
                   "--seq_len", "32", "--warmup", "1", "--eval_every", "2", "--eval_iters", "1",
                   "--seeds", "0", "--gpus", "", "--rows", "nvfp4_adamw", "--runs", str(runs),
                   "--results", str(results)])
    row, = json.loads((results / "summary.json").read_text())
    assert command_numerics_id(row["command"], row["device"], monkeypatch) == row["numerics_id"]
    monkeypatch.setattr(nvfp4, "SR_SCHEME", "philox4x32-10/32bit/v1")
    assert command_numerics_id(row["command"], row["device"], monkeypatch) != row["numerics_id"]


def test_historical_records_are_not_current_and_not_quoted(monkeypatch):
    """A historical record is one today's code no longer reproduces (a row with today's numerics_id
    is misplaced there, e.g. a re-record merged into the old record's path), and the README quotes
    none of its val losses."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    old = records(historical=True)
    assert len(old) >= 5
    # a current run's own number may equal an old one (bf16 draws no SR: its runs reproduce): the
    # README quoting the current record is fine; blank those before looking for historical ones
    for _, rows in records(historical=False):
        for row in rows:
            if isinstance(row.get("val_loss"), float):
                readme = readme.replace(f"{row['val_loss']:.4f} (n=1)", "(current)")
    for path, rows in old:
        groups = {}  # each run's val loss, and each row's mean over seeds (what a table quotes)
        for row in rows:
            val = row.get("val_loss", row.get("summary", {}).get("final_val_loss"))
            if isinstance(val, float) and val == val:
                key = (row.get("recipe", row.get("row", row.get("name"))), row.get("optimizer"))
                groups.setdefault(key, []).append(val)
                assert f"{val:.4f}" not in readme, f"README quotes {path}: {val:.4f}"
            if row.get("numerics_id"):
                assert command_numerics_id(row["command"], row["device"], monkeypatch) != \
                    row["numerics_id"], f"{path} holds a record of today's numerics"
        for key, vals in groups.items():
            mean = f"{sum(vals) / len(vals):.4f}"
            assert mean not in readme, f"README quotes {path}'s {key}: {mean}"


def test_readme_tables_are_the_records():
    """README.md between its markers is what tools/readme_tables.py writes from the records now."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert readme_tables.render(readme) == readme, "run python tools/readme_tables.py"


def test_speed_ratios_do_not_round_up_to_a_goal_they_miss():
    """0.776 against a 0.78 goal prints three decimals; a ratio that meets its goal, or has none,
    prints two."""
    assert readme_tables.times(0.776, 0.78) == "0.776×"
    assert readme_tables.times(0.7801, 0.78) == "0.78×"
    assert readme_tables.times(0.7749, 0.78) == "0.77×"
    assert readme_tables.times(0.776) == "0.78×"


def test_table3_prints_the_records_digits():
    """The Table 3 block from a record: each cell is the rows' mean ± std and gap at the printed
    digits; a missing record says so."""
    val = {("bf16", "adamw"): [2.4, 2.5, 2.6], ("lora_svd", "adamw"): [2.5, 2.6, 2.75],
           ("bf16", "root"): [2.2, 2.3, 2.4], ("lora_svd", "root"): [2.3, 2.4, 2.5],
           ("naive_fp4", "adamw"): [9237.0]}
    rows = [{"recipe": r, "optimizer": o, "seed": s, "val_loss": v, "train_loss": v,
             "status": "collapsed" if r == "naive_fp4" else "ok", "config": "tiny",
             "params": 7.23e6, "steps": 1500, "tokens": 12288000, "epochs": 1.49,
             "device": "cuda", "commit": "abc"} for (r, o), vs in val.items()
            for s, v in enumerate(vs)]
    block = readme_tables.table3(rows)
    assert "| `bf16` | 2.5000 ± 0.1000 (n=3) | – | 2.3000 ± 0.1000 (n=3) | – |" in block
    gap = 100 * ((2.5 + 2.6 + 2.75) / 3 - 2.5) / 2.5
    assert (f"| `lora_svd` | 2.6167 ± 0.1258 (n=3) | {gap:+.2f}% | 2.4000 ± 0.1000 (n=3) | "
            "+4.35% |") in block
    assert "| `naive_fp4` | 9237.0000 (n=1): collapsed |" in block
    assert "13 runs (seeds 0, 1, 2), `tiny` (7.23M parameters, 1500 steps, 12.3M tokens" in block
    assert "Not recorded" in readme_tables.table3(None)
    assert "Root's split" not in block  # no split record: no line


def test_readme_split_line_is_the_split_record():
    """Root's split, from the split grid's rows: each part's cost over lora_svd paired by seed, and
    the interaction, what the parts' sum misses of fullstack's cost."""
    cost = {"lora_svd": 0.0, "lora_svd_attn_fp4": 1.0, "lora_svd_momentum_nvfp4": 2.0,
            "lora_svd_adamw_nvfp4": 0.0, "lora_svd_ns_nvfp4": 0.5, "fullstack": 4.0}
    rows = [{"row": row, "optimizer": "root", "seed": s, "val_loss": base * (1 + c / 100)}
            for row, c in cost.items() for s, base in enumerate([2.3, 2.4, 2.5])]
    rows[-1]["val_loss"] = 2.5 * 1.05  # seed 2's fullstack 5%: interactions 0.5, 0.5, 1.5
    line = readme_tables.split_line(rows)[-1]
    assert "(mean ± SE, n=3): FP4 attention +1.00 ± 0.00; NVFP4 momentum +2.00 ± 0.00;" in line
    assert "NVFP4 Newton–Schulz +0.50 ± 0.00; all (`fullstack`) +4.33 ± 0.33;" in line
    assert "interaction +0.83 ± 0.33 (" in line
    # a part short of a seed: each cell names its own n (the interaction needs every part's seed)
    short = [r for r in rows if (r["row"], r["seed"]) != ("lora_svd_ns_nvfp4", 2)]
    line = readme_tables.split_line(short)[-1]
    assert "(mean ± SE): FP4 attention +1.00 ± 0.00 (n=3);" in line
    assert "NVFP4 Newton–Schulz +0.50 ± 0.00 (n=2);" in line
    assert "interaction +0.50 ± 0.00 (n=2)" in line
    assert readme_tables.split_line(None) == []


def test_cost_is_the_measured_rate():
    """A 1b ablation row of 20B tokens at 41,080 tokens/s is 135 H200-hours (the issue's check)."""
    speed = {"rows": [{"section": "train", "config": "1b", "recipe": "fullstack",
                       "optimizer": "root", "compile": False, "tokens_per_s": 41080.0,
                       "mfu": 0.243, "measured": {"date": "2026-12-01"}}]}
    line = readme_tables.cost(speed).splitlines()[2]
    ratio = readme_tables.flops_per_token("3b") / readme_tables.flops_per_token("1b")
    assert 3.0 < ratio < 3.2
    main = 64e9 * ratio / 41080 / 3600
    assert line == (f"| `fullstack`/root (2026-12-01) | 41,080 | 24% | 135 H200-hours | "
                    f"{main:,.0f} H200-hours |")


def test_cost_takes_each_recipes_fastest_flags():
    """One line per recipe and optimizer, at its fastest measured flags, named by them."""
    row = {"section": "train", "config": "1b", "recipe": "fullstack", "optimizer": "adamw",
           "compile": False, "mfu": 0.25, "measured": {"date": "2026-12-04"}}
    speed = {"rows": [{**row, "tokens_per_s": 37000.0},
                      {**row, "tokens_per_s": 45000.0, "cuda_graphs": True},
                      {**row, "tokens_per_s": 44000.0, "compile": True}]}
    lines = readme_tables.cost(speed).splitlines()
    assert lines[2].startswith("| `fullstack`/adamw `--cuda_graphs` (2026-12-04) | 45,000 |")
    assert lines[3] == ""  # no other line for the same recipe and optimizer


def test_figures_print_the_records_digits():
    """The figure table's Fig. 3 cell is the record's range of reductions per rank, Fig. 4b's the
    fitted sets' range, at the printed digits."""
    record = json.load(open(os.path.join(ROOT, "results", "figures", "figures.json")))
    block = readme_tables.figures(record)
    rank32 = [r["reduction"] for r in record["fig3"]["random_init"] if r["rank"] == 32]
    assert f"−{100 * min(rank32):.0f}…−{100 * max(rank32):.0f}% at rank 32" in block
    roots = [r["nvfp4_root"] for r in record["fig4b"]["rows"]]
    assert f"fitted Root coefficients {min(roots):.2f}–{max(roots):.2f} polar error" in block


def test_readme_speed_shows_graphed_1b_rows_against_their_own_calls_bf16():
    """A 1b row with CUDA graphs joins the speed table only with a ratio taken in its own call
    (bench/end_to_end.add_ratios), against that call's bf16 rate; its goal counts."""
    record = json.load(open(os.path.join(ROOT, "results", "speed", "speed.json")))
    record["rows"] = [r for r in record["rows"] if not r["name"].endswith("_graphs")
                      or not r["name"].startswith("1b_")]  # the record's own graphed rows out
    before = readme_tables.speed(record)
    row = {"section": "train", "config": "1b", "recipe": "fullstack", "optimizer": "adamw",
           "compile": False, "cuda_graphs": True, "measured": {"date": "2026-12-05"}}
    record["rows"] += [{**row, "name": "1b_fullstack_adamw_graphs", "tokens_per_s": 55000.0,
                        "vs_bf16": 55 / 69, "bf16_tokens_per_s": 69000.0},
                       {**row, "name": "1b_fullstack_root_graphs", "optimizer": "root",
                        "tokens_per_s": 50000.0}]  # measured in a call without bf16: no ratio
    after = readme_tables.speed(record)
    assert "| … with `--cuda_graphs` | 55,000 tokens/s | `bf16` 69,000 | 0.80× | ≥ 0.78× |" in after
    assert "Root" not in after and after.count("\n") == before.count("\n") + 1
    met = lambda text: [int(n) for n in text.split("Goals met: ")[1].rstrip(".").split(" of ")]
    assert met(after) == [met(before)[0] + 1, met(before)[1] + 1]
