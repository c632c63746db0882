"""The two tiers: a small public core that imports nothing of the LM application."""

import ast
from pathlib import Path

import eqx_diloco
import eqx_diloco.lm

PACKAGE = Path(eqx_diloco.__file__).parent
# `python -m eqx_diloco.train` etc.: entry points of the application kept at short paths; their
# bodies run only as `__main__` (checked below), so importing them loads nothing.
ENTRY_POINTS = {"train.py", "launch.py", "plot.py", "prepare.py", "sample.py", "export.py", "evaluate.py"}
APPLICATION = ("eqx_diloco.lm", "models", "tyro", "rich", "matplotlib", "tensorboardX")


def _imports(tree: ast.AST, module: str) -> set[str]:
    """Absolute names of every module `tree` (the source of core `module`) imports, relative ones resolved."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.rsplit(".", node.level)[0]
                names.add(f"{base}.{node.module}" if node.module else base)
                names.update(f"{base}.{alias.name}" for alias in node.names if not node.module)
            else:
                names.add(node.module)
    return names


def test_the_core_imports_nothing_of_the_application_tier():
    offenders = {}
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name in ENTRY_POINTS:
            continue
        module = f"eqx_diloco.{path.stem}" if path.stem != "__init__" else "eqx_diloco"
        bad = {n for n in _imports(ast.parse(path.read_text()), module)
               if any(n == a or n.startswith(a + ".") for a in APPLICATION)}
        if bad:
            offenders[path.name] = sorted(bad)
    assert not offenders, offenders


def test_entry_points_do_nothing_when_imported():
    for name in ENTRY_POINTS:
        tree = ast.parse((PACKAGE / name).read_text())
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        assert len(body) == 1 and isinstance(body[0], ast.If), name
        assert ast.unparse(body[0].test) == "__name__ == '__main__'", name


def test_the_public_namespaces():
    assert len(eqx_diloco.__all__) <= 13
    for name in eqx_diloco.__all__:
        assert getattr(eqx_diloco, name) is not None
    for gone in ["Trainer", "Config", "OuterSync", "global_model", "make_inner_step"]:
        assert gone not in eqx_diloco.__all__ and not hasattr(eqx_diloco, gone)
    for name in ["Trainer", "Config", "DiLoCoConfig", "validate"]:
        assert name in eqx_diloco.lm.__all__ and getattr(eqx_diloco.lm, name) is not None

