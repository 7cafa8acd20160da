"""The README and the records keep pointing at things that exist: every function of the README's reading path is
defined in the file it names, every relative link of the README, docs/ and results/ pages resolves, and the README
stays short enough to read (under 20,000 characters)."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_reading_path_names_are_defined_where_the_readme_says():
    readme = read("README.md")
    table = readme.split("## Read it")[1].split("\n\n")[2]  # the table after the section's first paragraph
    rows = [line for line in table.splitlines() if line.startswith("| ") and ".py` |" in line]
    assert len(rows) >= 10
    for line in rows:
        _paper, file_cell, where_cell = (cell.strip() for cell in line.strip("| ").split(" | "))
        path = file_cell.strip("`")
        source = read(path)
        for name in re.findall(r"`(\w+)`", where_cell):
            assert re.search(rf"^\s*(def|class) {name}\b|^{name} = ", source, re.M), f"{name} not in {path}"


def test_relative_links_resolve():
    pages = ["README.md"] + glob.glob("docs/*.md", root_dir=ROOT) + glob.glob("results/**/*.md", root_dir=ROOT,
                                                                               recursive=True)
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)", read(page)):
            if not target.startswith(("http://", "https://")):
                assert os.path.exists(os.path.join(ROOT, os.path.dirname(page), target)), f"{page} -> {target}"


def test_readme_is_self_contained():
    readme = read("README.md")   # (its length: tools/house_check.py reports it)
    assert "DESIGN.md" not in readme and "shared/paper" not in readme
