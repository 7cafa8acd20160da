"""The house rules that an AST can check (docs: one hallway, downward):

    train.py -> model.py -> lora_svd.py / attention.py -> nvfp4.py -> kernels/
    optim.py -> nvfp4.py -> kernels/

kernels/ imports torch, triton, the standard library and other kernels/ files only; a module imports only
modules below it in the hallway; no import cycle. Imports inside functions count like the ones at the top."""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what each product module may import of the project (anything further down the hallway); data.py stands beside
# it, sample.py at the top with train.py
ALLOWED = {
    "nvfp4": {"kernels"},
    "lora_svd": {"nvfp4", "kernels"},
    "attention": {"nvfp4", "kernels"},
    "optim": {"nvfp4", "kernels"},
    "model": {"lora_svd", "attention", "nvfp4", "kernels"},
    "data": set(),
    "train": {"model", "lora_svd", "attention", "optim", "nvfp4", "kernels", "data"},
    "sample": {"train", "model", "lora_svd", "attention", "optim", "nvfp4", "kernels", "data"},
}
KERNELS_MAY_IMPORT = {"torch", "triton", "kernels"}


def tracked_python_files():
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    files = out.stdout.split() if out.returncode == 0 else [
        os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(ROOT) for f in fs if f.endswith(".py")]
    return sorted(f for f in files if os.path.exists(os.path.join(ROOT, f)))


def imports(path):
    """Every module name a file imports, at any depth of its AST (function-local imports included)."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read(), filename=path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            if node.module == "kernels":  # from kernels import nvfp4_quant
                names.update(f"kernels.{alias.name}" for alias in node.names)
    return names


def module_name(path):
    return path[:-3].replace("/", ".").removesuffix(".__init__")


PRODUCT = {module_name(f): f for f in tracked_python_files() if "/" not in f or f.startswith("kernels/")}
PROJECT_TOPS = {name.split(".")[0] for name in PRODUCT} | {"bench", "tools", "tests"}


def project_imports(path):
    return {name for name in imports(path) if name.split(".")[0] in PROJECT_TOPS}


@pytest.mark.parametrize("path", sorted(f for f in PRODUCT.values() if f.startswith("kernels/")))
def test_kernels_import_only_torch_triton_stdlib_and_kernels(path):
    bad = {name for name in imports(path)
           if name.split(".")[0] not in KERNELS_MAY_IMPORT and name.split(".")[0] not in sys.stdlib_module_names}
    assert not bad, f"{path} imports {sorted(bad)}: kernels/ takes tensors and constants, and imports nothing above it"


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_modules_import_only_down_the_hallway(module):
    if module not in PRODUCT:
        pytest.skip(f"{module}.py is not in this tree")
    tops = {name.split(".")[0] for name in project_imports(PRODUCT[module])} - {module}
    bad = tops - ALLOWED[module]
    assert not bad, f"{module}.py imports {sorted(bad)}; it may import only {sorted(ALLOWED[module]) or 'nothing'} " \
                    "of the project (train -> model -> lora_svd / attention -> nvfp4 -> kernels; optim -> nvfp4)"


def test_every_product_module_has_its_rule():
    assert {m for m in PRODUCT if not m.startswith("kernels")} <= set(ALLOWED)


def test_no_import_cycles():
    graph = {}
    for module, path in PRODUCT.items():
        deps = set()
        for name in project_imports(path):
            # "kernels.nvfp4_quant" -> that file; "kernels" alone -> the package; a top-level module -> itself
            while name and name not in PRODUCT:
                name = name.rpartition(".")[0]
            if name and name != module:
                deps.add(name)
        graph[module] = deps
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycle = stack[stack.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_check_sees_function_local_imports(tmp_path):
    """The checks must be able to fail: an import inside a function is found like one at the top."""
    src = "import torch\n\ndef f():\n    import nvfp4\n    from kernels import nvfp4_quant\n    return nvfp4\n"
    path = tmp_path / "k.py"
    path.write_text(src)
    assert {"nvfp4", "kernels", "kernels.nvfp4_quant", "torch"} <= imports(str(path))


def files_called(step):
    """The project files a call runs through, in order (sys.setprofile's call events in product code
    and kernels/ host code; Triton kernel bodies, run by the interpreter, excluded)."""
    files, project = [], {}  # project: a code file's path relative to ROOT, or None (not ours)

    def profile(frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if path not in project:  # once per file: this hook sees every torch and Triton call
            rel = os.path.relpath(path, ROOT) if path.startswith(ROOT) else "."
            ours = not rel.startswith((".", "tests" + os.sep))  # not .venv's, not the tests'
            project[path] = rel if ours else None
        rel = project[path]
        if rel is None:
            return
        f = frame
        while f is not None:
            if os.path.join("triton", "runtime", "interpreter") in f.f_code.co_filename:
                return
            f = f.f_back
        files.append(rel)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return files


def switches(files):
    return sum(a != b for a, b in zip(files, files[1:]))


def test_a_lora_svd_layer_reads_in_few_files(monkeypatch):
    """A reader follows a LoRA-SVD layer (256 -> 256, rank 32, 64 x 256 bf16 tokens) through few
    files: its reference forward is lora_svd.py then nvfp4.py (one switch), its kernel-route backward
    (host side) nvfp4.py down into kernels/ without climbing back and forth (at most 17 switches,
    the last back to nvfp4.py, where the layers reading one input keep the sum of their dX)."""
    import torch

    import lora_svd
    torch.manual_seed(0)
    layer = lora_svd.LoRASVDLinear(256, 256, 32)
    x = torch.randn(64, 256).bfloat16().requires_grad_()
    monkeypatch.setenv("NANOFP4_ROUTE", "reference")
    layer(x)
    forward = files_called(lambda: layer(x))
    assert switches(forward) == 1 and set(forward) == {"lora_svd.py", "nvfp4.py"}
    monkeypatch.setenv("NANOFP4_ROUTE", "kernels")
    layer(x).float().sum().backward()  # the kernels compile (interpreter: a no-op) outside the count
    y = layer(x).float().sum()
    backward = files_called(y.backward)
    assert backward[0] == "nvfp4.py" and switches(backward) <= 17, " -> ".join(backward)
    assert "lora_svd.py" not in backward  # the branch rides the direct layer's kernels
