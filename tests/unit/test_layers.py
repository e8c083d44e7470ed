"""The layer boundaries of DESIGN.md hold: the import contracts in pyproject.toml ([tool.importlinter]) are kept.

The linter runs in a child process: it finds the package to analyse on sys.path, and the forbidden-import
test points it at a stand-in `sessionserve` tree instead of the real one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "pyproject.toml"
_LINT = ("import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))")


def lint(cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the project's contracts against the `sessionserve` package importable from `cwd`."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([sys.executable, "-c", _LINT, str(CONFIG)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_layer_contracts_hold() -> None:
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " broken" in result.stdout and "0 broken" in result.stdout


def contract_modules() -> set[str]:
    """Every sessionserve module the contracts name."""
    section = CONFIG.read_text().split("[tool.importlinter]", 1)[1]
    return set(re.findall(r"sessionserve\.[\w.]+", section))


def stand_in_tree(root: Path, extra: dict[str, str]) -> Path:
    """A `sessionserve` package under `root` with an empty package per module the contracts name, plus
    `extra` (path inside the package -> source)."""
    package = root / "sessionserve"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in contract_modules():
        sub = package.joinpath(*name.split(".")[1:])
        sub.mkdir(parents=True, exist_ok=True)
        (sub / "__init__.py").write_text("")
    # The one import the contracts let the server make into the core (an unmatched exception is an error).
    base = {"core/session.py": "", "server/bridge/__init__.py": "from sessionserve.core import session\n"}
    for rel, source in {**base, **extra}.items():
        (package / rel).write_text(source)
    return root


def test_stand_in_tree_without_forbidden_imports_passes(tmp_path: Path) -> None:
    """The contracts accept the stand-in tree as it is, so a failure below is the added import's doing."""
    tree = stand_in_tree(tmp_path, {"core/engine.py": "from sessionserve.types import executor\n",
                                    "model/runner.py": "import sessionserve.cache\nimport sessionserve.types\n",
                                    "server/app.py": "from sessionserve.server import bridge\n",
                                    "router/ingress.py": "from sessionserve import server\n"})
    result = lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("path", "source", "chain"), [
    ("model/runner.py", "from sessionserve.core import engine\n", "sessionserve.model.runner -> sessionserve.core"),
    ("cache/mover.py", "import sessionserve.core\n", "sessionserve.cache.mover -> sessionserve.core"),
    ("config/knobs.py", "from sessionserve import core\n", "sessionserve.config.knobs -> sessionserve.core"),
    ("core/planner.py", "import sessionserve.model\n", "sessionserve.core.planner -> sessionserve.model"),
    ("server/routes.py", "import sessionserve.router\n", "sessionserve.server.routes -> sessionserve.router"),
    ("server/routes.py", "from sessionserve.core import session\n", "sessionserve.server.routes -> sessionserve.core"),
    ("router/ingress.py", "from sessionserve.server.bridge import x\n",
     "sessionserve.router.ingress -> sessionserve.server.bridge"),
])
def test_forbidden_import_is_caught(tmp_path: Path, path: str, source: str, chain: str) -> None:
    result = lint(stand_in_tree(tmp_path, {path: source}))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BROKEN" in result.stdout and chain in result.stdout, result.stdout
