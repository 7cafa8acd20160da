"""docs/workshop.md runs as written, and says what it prints. The page is the single source:

- every code block of each exercise is run from the repository root, a python block as `python -`
  (as the page says to run them);
- every number the page states as a result (one with a decimal point, an exponent or a % sign, in
  the "What you should see" and "Change this" paragraphs; integers are inputs, and section, equation
  and figure numbers are skipped) must be among the numbers the blocks print, to the page's
  precision: the printed value rounded to the page's digits equals the page's number. So the page
  quotes digits only of what is deterministic on any CPU (seeded inputs through the quantizers);
  training runs and diverging iterations, whose digits differ between CPUs and thread counts, are
  held to properties (exercise 4's losses, exercise 5's Muon set) in the exercise's own test;
- every "Change this" names its edits as "replace `A` by `B`"; the test makes them, runs the changed
  blocks, and checks the numbers that paragraph states against what they print (and what the
  unchanged blocks print, which the paragraph compares with);
- each exercise's claims (which way a comparison goes) are checked on the printed numbers too.

When the code's numbers move on purpose, rerun the blocks (`python tests/test_workshop.py 2` prints
exercise 2's blocks and its changed blocks) and update the page."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "workshop.md")
NUMBER = re.compile(r"(?<![\w.§^])[-−]?\d+(?:\.\d+)?(?:e[-+]?\d+)?%?(?![\w])")
NOT_RESULTS = re.compile(r"(§|\b(?:Fig|Figs|eq|eqs|App|Table|Sec|step|steps|rank)\.? ?)$")


def exercises():
    """{number: {"blocks": [(language, code)], "see": text, "change": text, "figure": text}} from
    the '## N.' sections of the page."""
    text = open(DOC).read()
    parts = re.split(r"^## (\d)\. ", text, flags=re.M)
    found = {}
    for number, body in zip(parts[1::2], parts[2::2]):
        paragraph = lambda label: (re.search(rf"^\*{label}[^*]*\*(.*?)(?=\n\n|\Z)", body,
                                             re.M | re.S) or [None, ""])[1]
        found[int(number)] = {"blocks": re.findall(r"```(python|bash)\n(.*?)```", body, flags=re.S),
                              "see": paragraph("What you should see"),
                              "change": paragraph("Change this"),
                              "figure": "\n".join(re.findall(r"^!\[.*$", body, re.M))}
    return found


def run_blocks(blocks, out_dir):
    """Run each block as the page says, from the repository root (python blocks as `python -`, no
    PYTHONPATH); returns what they printed."""
    printed = []
    for language, code in blocks:
        # keep the checkout's out/ clean
        code = code.replace("out/workshop_", f"{out_dir}/workshop_")
        cmd = [sys.executable, "-"] if language == "python" else ["bash", "-ec", code]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
                                input=code if language == "python" else None)
        assert result.returncode == 0, f"block failed:\n{code}\n{result.stdout}\n{result.stderr}"
        printed.append(result.stdout)
    return "\n".join(printed)


def changed_blocks(exercise):
    """The blocks that the "Change this" edits touch, edited (each edit must apply)."""
    edits = re.findall(r"replace `([^`]+)` by\s+`([^`]*)`", exercise["change"])
    assert edits, f"'Change this' names no edit ('replace `A` by `B`'): {exercise['change']!r}"
    blocks = [list(b) for b in exercise["blocks"]]
    touched = set()
    for old, new in edits:
        hits = [i for i, (_, code) in enumerate(blocks) if old in code]
        assert hits, f"'Change this' replaces `{old}`, which no block of the exercise contains"
        for i in hits:
            blocks[i][1] = blocks[i][1].replace(old, new)
            touched.add(i)
    return [tuple(blocks[i]) for i in sorted(touched)]


def stated_numbers(text):
    """The results a paragraph states: numbers with a decimal point, an exponent or a %, outside
    `code` and not section / equation / figure / step numbers."""
    text = re.sub(r"`[^`]*`", " ", text)
    out = []
    for m in NUMBER.finditer(text):
        token = m.group(0).replace("−", "-")
        if NOT_RESULTS.search(text[max(0, m.start() - 8):m.start()]):
            continue
        if "." in token or "e" in token or token.endswith("%"):
            out.append(token)
    return out


def printed_numbers(output):
    return [float(m.group(0).rstrip("%")) for m in NUMBER.finditer(output)]


def same_to_precision(stated, value):
    """`value` rounded to the digits `stated` shows equals it (0.0188 vs 0.01876...: yes)."""
    s = stated.rstrip("%")
    if "e" in s:
        mantissa = s.split("e")[0]
        digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
        return float(f"{value:.{digits}e}") == float(s)
    digits = len(s.split(".")[1]) if "." in s else 0
    return float(f"{value:.{digits}f}") == float(s)


def check_stated(text, output, where):
    values = printed_numbers(output)
    missing = [s for s in stated_numbers(text) if not any(same_to_precision(s, v) for v in values)]
    assert not missing, (f"{where}: the page states {missing}, which the blocks do not print (to "
                         f"the page's digits). They printed:\n{output}")


def numbers(pattern, text):
    match = re.search(pattern, text)
    assert match, f"no {pattern!r} in:\n{text}"
    return [float(x) for x in match.groups()]


@pytest.fixture(scope="module")
def page():
    return exercises()


@pytest.fixture(scope="module")
def outputs(page, tmp_path_factory):
    """Each exercise's printed output and its changed run's, computed once per module."""
    cache = {}

    def get(number, changed=False):
        if (number, changed) not in cache:
            out_dir = tmp_path_factory.mktemp(f"ex{number}{'_changed' if changed else ''}")
            blocks = changed_blocks(page[number]) if changed else page[number]["blocks"]
            cache[number, changed] = run_blocks(blocks, out_dir)
        return cache[number, changed]
    return get


def test_the_page_says_how_to_run_a_block_and_which_digits_hold():
    intro = open(DOC).read().split("\n## ")[0]
    assert "from the repository root" in intro and "`python -`" in intro and "PYTHONPATH" in intro
    assert "differ between CPUs and thread counts" in intro


def test_six_exercises_each_with_code_results_a_change_and_its_figure(page):
    assert sorted(page) == [1, 2, 3, 4, 5, 6]
    for number, ex in page.items():
        assert ex["blocks"] and stated_numbers(ex["see"]), number
        assert stated_numbers(ex["change"]), f"exercise {number}: 'Change this' states no result"
        changed_blocks(ex)
    for number, fig in {2: "fig7", 3: "fig3", 4: "fig4a", 5: "fig4b", 6: "fig5"}.items():
        image = re.search(r"\]\(([^)]+)\)", page[number]["figure"]).group(1)
        assert fig in image and os.path.isfile(os.path.normpath(os.path.join(ROOT, "docs", image)))


def test_the_number_checks_can_fail():
    text = "0.0188 vs 0.0089 (74%), 3.1e-2; §3.3, eq. 2, Fig. 4a, step 5, 16 tokens, `1.5`"
    assert stated_numbers(text) == ["0.0188", "0.0089", "74%", "3.1e-2"]
    assert same_to_precision("0.0188", 0.01876) and not same_to_precision("0.0188", 0.0190)
    assert same_to_precision("3.1e-2", 0.0312) and same_to_precision("74%", 74.3)
    with pytest.raises(AssertionError, match=r"states \['0.0200'\]"):
        check_stated("rel. MSE 0.0200", "rel. MSE 0.0188", "test")


@pytest.mark.parametrize("number", [1, 2, 3, 4, 5, 6])
def test_the_page_states_what_the_blocks_print(page, outputs, number):
    check_stated(page[number]["see"], outputs(number), f"exercise {number}")


@pytest.mark.parametrize("number", [1, 2, 3, 4, 5, 6])
def test_each_change_prints_what_the_page_says(page, outputs, number):
    """Against the changed run's output, and the original's (the paragraph compares with it)."""
    check_stated(page[number]["change"], outputs(number, changed=True) + "\n" + outputs(number),
                 f"exercise {number}, 'Change this'")


def test_exercise1_format(outputs):
    out = outputs(1)
    assert "0.5635 bytes each" in out
    rtn, sr = numbers(r"rel\. MSE  RTN ([\d.]+)  SR ([\d.]+)", out)
    assert sr > rtn  # one SR draw is noisier than RTN ...
    bias_rtn, bias_sr = numbers(r"RTN ([\d.e+-]+)  SR \(mean of 400 draws\) ([\d.e+-]+)", out)
    assert bias_sr < bias_rtn / 5  # ... but unbiased: its mean over draws approaches x
    four = r"blocks mapped to 4: (\d+)%  rel\. MSE ([\d.]+) \(plain ([\d.]+)\)"
    share4, mse46, mse6 = numbers(four, out)
    assert 0 < share4 < 100 and mse46 < mse6
    share4_iid, mse46_iid, mse6_iid = numbers(four, outputs(1, changed=True))
    # every column alike: 4/6 picks 4 a little more often and gains a little more
    assert share4_iid > share4 and (mse6_iid - mse46_iid) / mse6_iid > (mse6 - mse46) / mse6


def test_exercise2_hadamard_cases_and_fig7(outputs):
    out = outputs(2)
    rows = dict((name.strip(), (float(a), float(b))) for name, a, b in re.findall(
        r"^(.+?): no rotation ([\d.]+)  random Hadamard ([\d.]+)$", out, re.M))
    iid, massive = rows["i.i.d."], rows["massive tokens x 1e+03"]
    beyond = rows["massive tokens x 3e+05"]
    assert abs(iid[1] - iid[0]) < 0.1 * iid[0]  # i.i.d.: the rotation changes nothing
    assert abs(massive[1] - massive[0]) < 0.1 * massive[0]  # realistic massive tokens: neither
    assert beyond[1] < beyond[0] / 2  # past E4M3's range the rotation helps
    rows = re.findall(r"N = +(\d+)  MSE ([\d.]+)  rel\. MSE ([\d.]+)", out)
    mse = [float(r[1]) for r in rows]
    rel = [float(r[2]) for r in rows]
    assert all(1.7 < b / a < 2.3 for a, b in zip(mse, mse[1:]))  # MSE ~ N
    assert max(rel) / min(rel) < 1.15  # relative MSE flat


def test_exercise3_lora_svd(outputs):
    out = outputs(3)
    reductions = [float(x) for x in re.findall(r"\((\d+)% less\)", out)]
    assert len(reductions) == 3 and 0 < reductions[0] < reductions[1] < reductions[2]
    before, after = numbers(r"before ([\d.]+)  after eqs\. 3-4 ([\d.e+-]+)", out)
    assert before > 0.3 and after < 1e-5
    init, drift, realigned = (numbers(rf"{k} ([\d.]+)", out)[0]
                              for k in ("after init", "after drift", "after realign"))
    assert init < drift and realigned < drift
    flat = [float(x) for x in re.findall(r"\((\d+)% less\)", outputs(3, changed=True))]
    assert max(flat) < reductions[1]  # a flat spectrum: the branch gains much less


def test_exercise4_optimizer_states(outputs):
    out = outputs(4)
    rows = re.findall(r"positive entries decoded to 0: +([\d.]+)%   rel\. error of sqrt\(v\): "
                      r"([\d.]+)", out)
    (zero_direct, err_direct), (zero_pipe, err_pipe) = [(float(z), float(e)) for z, e in rows]
    assert zero_direct > 30 and zero_pipe == 0 and err_pipe < 0.6 * err_direct
    losses = {s: [float(x) for x in line.split()] for s, line in
              re.findall(r"^optimizer states (\w+): losses ([\d. ]+)$", out, re.M)}
    assert set(losses) == {"fp32", "direct", "nvfp4"}  # the same BF16 model, three kinds of states
    # what holds on any CPU (the digits of these trajectories do not): direct NVFP4 states blow up
    # past 100 within six steps; fp32 states train; the §3.3 states stay within half a nat of them
    assert max(losses["direct"]) > 100
    for states in ("fp32", "nvfp4"):
        assert losses[states][-1] < losses[states][0] - 1 and max(losses[states]) < 12
    assert max(abs(a - b) for a, b in zip(losses["fp32"], losses["nvfp4"])) < 0.5


def test_exercise5_newton_schulz(outputs):
    out = outputs(5)
    muon, fitted = out.split("fitted for NVFP4")
    muon_max = [float(x) for x in re.findall(r"max ([\d.]+)", muon)]
    fitted_max = [float(x) for x in re.findall(r"max ([\d.]+)", fitted)]
    assert muon_max[-1] > 10 and fitted_max[-1] < 1.5 and len(fitted_max) == 5
    muon_fp32 = outputs(5, changed=True).split("fitted for NVFP4")[0]
    assert [float(x) for x in re.findall(r"max ([\d.]+)", muon_fp32)][-1] < 1.5


def attention_errors(out):
    return {m.group(1): {k: float(v) for k, v in re.findall(r"'(\w+)': ([\d.]+)", m.group(2))}
            for m in re.finditer(r"^(\w+) (\{.*\})$", out, flags=re.M)}


def test_exercise6_attention_policies(outputs):
    err, sharp = attention_errors(outputs(6)), attention_errors(outputs(6, changed=True))
    assert err["fp4_pv"]["o"] > err["fp4"]["o"]
    assert err["fp4_dov"]["dq"] > err["fp4"]["dq"] and err["fp4_dov"]["dk"] > err["fp4"]["dk"]
    assert err["fp4_all"]["dv"] > 1.5 * err["fp4"]["dv"]
    # sharper attention: every error grows, P.V adds relatively less, dO.V^T still the most
    assert all(sharp["fp4"][k] > 2 * err["fp4"][k] for k in ("o", "dq", "dk", "dv"))
    pv_extra = lambda e: e["fp4_pv"]["o"] / e["fp4"]["o"]
    assert pv_extra(sharp) < pv_extra(err) and sharp["fp4_dov"]["dq"] > 1.3 * sharp["fp4"]["dq"]


if __name__ == "__main__":  # python tests/test_workshop.py N: what exercise N's blocks print
    import tempfile
    number = int(sys.argv[1])
    ex = exercises()[number]
    with tempfile.TemporaryDirectory() as tmp:
        print(run_blocks(ex["blocks"], tmp))
        print("---- Change this ----")
        print(run_blocks(changed_blocks(ex), tmp))
