"""Loading the example scripts (examples/ is not a package) once per test session."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str, module_name: str | None = None) -> ModuleType:
    """``examples/<name>.py`` as a module, loaded once: every test file that uses it shares its classes."""
    module_name = module_name or name
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load examples/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses in the module resolve their own module by name
    spec.loader.exec_module(module)
    return module
