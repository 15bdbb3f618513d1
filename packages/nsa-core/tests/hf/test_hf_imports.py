"""transformers stays optional: no module of nsa_core outside nsa_core.hf imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import nsa_core

PACKAGE_ROOT = Path(nsa_core.__file__).parent
HF_ROOT = PACKAGE_ROOT / "hf"


def imported_names(path: Path) -> set[str]:
    """Every module an import statement of ``path`` names (in-function ones included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_only_nsa_core_hf_imports_transformers() -> None:
    outside = [p for p in PACKAGE_ROOT.rglob("*.py") if HF_ROOT not in p.parents]
    assert len(outside) > 10, "the walk found too few modules of nsa_core"
    for path in outside:
        hf = {
            n
            for n in imported_names(path)
            if n.split(".")[0] in ("transformers", "huggingface_hub", "accelerate")
            or n == "nsa_core.hf"
            or n.startswith("nsa_core.hf.")
        }
        assert not hf, f"{path.relative_to(PACKAGE_ROOT)} imports {sorted(hf)}"
