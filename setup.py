"""Build kvblocks' hot modules with Cython where a C compiler exists; pure Python where it does not.

Everything else about the package is in pyproject.toml. The modules compiled are those listed in
``kvblocks/native.py`` (``COMPILED_MODULES``), each from its own ``.py`` source unchanged. Nothing is compiled
when ``KVBLOCKS_PURE_PYTHON=1`` is set, when Cython is missing, or when the compiler fails: the install then
says so and goes on with the pure-Python package, which behaves the same (only slower). Each build records
its sources' digests in ``kvblocks/_native_build.json``, so that an extension whose source was edited since
(an editable install) is not used.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _load_native():  # type: ignore[no-untyped-def]
    """kvblocks/native.py, loaded on its own (it imports only the standard library; kvblocks' dependencies may
    be missing here): the module list, the switch and the digest the finder compares all come from it."""
    name = "_kvblocks_native_for_build"  # not kvblocks.native: it installs no import finder under this name
    spec = importlib.util.spec_from_file_location(name, ROOT / "kvblocks" / "native.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


native = _load_native()
MODULES: tuple[str, ...] = native.COMPILED_MODULES


def _source(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def _say(message: str) -> None:
    print(f"kvblocks: {message}", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """``build_ext`` that compiles the hot modules if it can and leaves them pure Python if it cannot."""

    def finalize_options(self) -> None:
        # cythonize here, not at import of setup.py: metadata commands (egg_info, dist_info) never compile
        self.distribution.ext_modules = _extensions()
        super().finalize_options()

    def run(self) -> None:
        if not self.extensions:
            return
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1  # one module per core
        if self.compiler is None or self.compiler == "unix":
            for ext in self.extensions:
                ext.extra_compile_args = [*ext.extra_compile_args, "-g0"]  # no debug info: half the compile time
        try:
            super().run()
        except Exception as failure:
            _say(f"could not compile the hot modules ({failure}); installing pure Python")
            return
        self._write_record()

    def _write_record(self) -> None:
        record = {"sources": {m: native.source_digest(_source(m)) for m in MODULES}}
        text = json.dumps(record, indent=1, sort_keys=True) + "\n"
        # beside the extensions: in the source tree (an editable install) or in the build's package folder
        target = (ROOT if self.inplace else Path(self.build_lib)) / "kvblocks" / native.BUILD_RECORD
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def _extensions() -> list:  # type: ignore[type-arg]
    if native.pure_python_requested():
        _say(f"{native.PURE_PYTHON_ENV} is set: installing pure Python (nothing compiled)")
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        _say("Cython is not installed: installing pure Python (nothing compiled)")
        return []
    _forget_stale_translations()
    try:
        return cythonize(
            _placeholders(),
            language_level=3,
            build_dir="build/cython",
            quiet=True,
            compiler_directives={
                # the Python semantics of the source, exactly: annotations are documentation, not C types
                "annotation_typing": False,
                "binding": True,
                "embedsignature": True,
            },
        )
    except Exception as failure:
        _say(f"Cython could not translate the hot modules ({failure}); installing pure Python")
        return []


def _forget_stale_translations() -> None:
    """Delete the generated C of each hot module whose source or declarations changed since the last in-place
    build (all of it when there is no record). Cython translates again only when a file it knows of is newer
    than its C, so a deleted ``.pxd`` would otherwise leave C translated with the declarations gone."""
    try:
        recorded = json.loads((ROOT / "kvblocks" / native.BUILD_RECORD).read_text())["sources"]
    except (OSError, ValueError, KeyError, TypeError):
        recorded = {}
    if not isinstance(recorded, dict):
        recorded = {}
    for module in MODULES:
        if recorded.get(module) != native.source_digest(_source(module)):
            ROOT.joinpath("build", "cython", *module.split(".")).with_suffix(".c").unlink(missing_ok=True)


def _placeholders() -> list:  # type: ignore[type-arg]
    """One entry per hot module, so that setuptools runs ``build_ext`` (which swaps in the real ones)."""
    from setuptools import Extension

    return [Extension(m, [str(_source(m).relative_to(ROOT))]) for m in MODULES]


# KVBLOCKS_PURE_PYTHON=1: no extension at all, so that a wheel built so is a pure one (py3-none-any)
setup(ext_modules=[] if native.pure_python_requested() else _placeholders(), cmdclass={"build_ext": OptionalBuildExt})
