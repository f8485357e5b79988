"""The folders' boundaries: bench/ and tests/ share helpers only through the package the product ships
for testing (kvcached.testing), so neither imports the other, and the product imports neither."""

from __future__ import annotations

import ast
import os
import re
import tomllib

import setuptools

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = ("kvcached", "engine_client", "proto")
# Module names inside strings: ``python -m NAME`` arguments and ``python -c "from NAME import ..."``.
NAMED_IN_TEXT = re.compile(r"(?:^|\bfrom |\bimport )([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def python_files(root: str, folder: str):
    for directory, _, names in os.walk(os.path.join(root, folder)):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(directory, name)


def imported_modules(path: str) -> set[str]:
    """Every module the file imports, and every dotted name a string of it names as one (the
    ``-m`` argument of a child process, the imports of a ``python -c`` script), and every script
    whose path it joins from constant parts."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "join":
            # os.path.join(ROOT, "bench", "script.py"): a script run by its path
            parts = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
            if len(parts) >= 2 and parts[-1].endswith(".py"):
                modules.add(".".join(parts)[:-len(".py")])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            modules |= {match for line in node.value.splitlines()
                        for match in NAMED_IN_TEXT.findall(line.strip()) if "." in match}
    return modules


def crossings(folder: str, forbidden: tuple[str, ...], root: str = REPO_ROOT) -> list[str]:
    """Each import, by a file under root/folder, of a module of a top-level package in forbidden."""
    found = []
    for path in python_files(root, folder):
        for module in sorted(imported_modules(path)):
            if module.split(".")[0] in forbidden:
                found.append(f"{os.path.relpath(path, root)} imports {module}")
    return found


def test_bench_imports_nothing_of_tests():
    """No file under bench/ imports a module of tests/ (nor names one for a child process)."""
    assert crossings("bench", ("tests",)) == []


def test_tests_import_nothing_of_bench():
    """No file under tests/ imports a module of bench/ (nor names one for a child process)."""
    assert crossings("tests", ("bench",)) == []


def test_the_product_imports_neither_bench_nor_tests():
    """The installed packages, kvcached.testing included, import nothing of bench/ or tests/: they
    are not installed."""
    assert [crossing for package in PRODUCT for crossing in crossings(package, ("bench", "tests"))] == []


def test_the_scan_sees_an_import_of_the_other_folder(tmp_path):
    """The scan finds each form of crossing: an import, a from-import, a ``-m`` argument, a
    ``python -c`` script's import and a script's joined path (a scan that found nothing would pass
    the tests above)."""
    folder = tmp_path / "bench"
    folder.mkdir()
    (folder / "a.py").write_text("import tests.integration.x\n")
    (folder / "b.py").write_text("from tests.core import y\n")
    (folder / "c.py").write_text('ARGS = ["-m", "tests.remote.scenarios"]\n')
    (folder / "d.py").write_text('SCRIPT = "import sys; from tests.integration.z import f; f()"\n')
    (folder / "f.py").write_text('import os\nPATH = os.path.join(ROOT, "tests", "remote", "run.py")\n')
    (folder / "e.py").write_text("from kvcached.testing import daemon_proc\nDOC = 'tests pass'\n")
    assert crossings("bench", ("tests",), root=str(tmp_path)) == ["bench/a.py imports tests.integration.x", "bench/b.py imports tests.core",
                     "bench/c.py imports tests.remote.scenarios", "bench/d.py imports tests.integration.z",
                     "bench/f.py imports tests.remote.run"]


def test_the_testing_package_is_installed():
    """pyproject's package list takes in kvcached.testing and its subpackages, so that an installed
    product has what bench/ and tests/ import."""
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        find = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_packages(REPO_ROOT, include=find["include"])
    testing = {name for name in setuptools.find_packages(os.path.join(REPO_ROOT, "kvcached"))
               if name.split(".")[0] == "testing"}
    assert testing and {f"kvcached.{name}" for name in testing} <= set(packages)
    assert not any(name.split(".")[0] in ("bench", "tests") for name in packages)
