"""docs/architecture.md's module inventory names every module of the four packages, and only those."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "stages", "storage", "planner")


def _inventory() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Module inventory", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+\.py)` \|", section, flags=re.M)


def test_the_module_inventory_lists_every_module_once():
    listed = _inventory()
    modules = sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                     if "__pycache__" not in p.parts)
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(set(modules) - set(listed)) == [], "modules missing from docs/architecture.md's inventory"
    assert sorted(set(listed) - set(modules)) == [], "the inventory lists modules that do not exist"
