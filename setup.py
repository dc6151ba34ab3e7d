"""Build hook: the tuner plugin compiled when the package is built, so that a node without a C
compiler still gets nccltune's per-size table (nccltune/tuner/build.py takes this copy first and
compiles on the node only when it is missing or does not fit).

Everything else about the package is in pyproject.toml. The plugin is C with no CUDA and no libnccl
dependency; one library exports every tuner ABI version nccltune supports (ncclTunerPlugin_v5 and
newer). With a compiler at hand the wheel carries nccltune/tuner/prebuilt/libnccl-tuner-nccltune.so
and its stamp (source digest and machine) and is tagged for this platform; without one the build
goes on, says so, and the wheel is the pure one it always was.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _tuner_build():  # type: ignore[no-untyped-def]
    """nccltune/tuner/build.py itself (standard library only), without importing the package,
    whose dependencies the build environment need not have."""
    spec = importlib.util.spec_from_file_location("_nccltune_tuner_build", HERE / "nccltune" / "tuner" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


class BuildPyWithTuner(build_py):
    """build_py, then the prebuilt tuner plugin into the build tree (never into the sources)."""

    built_plugin = False

    def run(self) -> None:
        super().run()
        tb = _tuner_build()
        source = HERE / "nccltune" / "tuner"
        out = Path(self.build_lib) / "nccltune" / "tuner" / tb.PREBUILT_DIR
        shutil.rmtree(out, ignore_errors=True)  # never a library left over from an earlier build
        if os.environ.get("NCCLTUNE_NO_PREBUILT_TUNER"):
            print("nccltune: NCCLTUNE_NO_PREBUILT_TUNER set: no prebuilt tuner plugin", file=sys.stderr)
            return
        compiler = tb.find_compiler(os.environ.get("CC"))
        if compiler is None:
            print("nccltune: no C compiler: the wheel carries no prebuilt tuner plugin (nodes compile it)",
                  file=sys.stderr)
            return
        out.mkdir(parents=True, exist_ok=True)
        library = out / tb.LIBRARY_NAME
        cmd = [compiler, *tb.BASE_FLAGS, "-o", str(library), str(source / tb.SOURCE_NAME), *tb.LINK_FLAGS]
        subprocess.run(cmd, check=True)
        (out / tb.STAMP_NAME).write_text(tb.stamp_text(source))
        BuildPyWithTuner.built_plugin = True


class PlatformWheel(bdist_wheel):
    """A wheel with the prebuilt library is for this platform (any Python 3: the library is not a
    Python extension)."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        if BuildPyWithTuner.built_plugin:
            self.root_is_pure = False
            plat = self.plat_name.replace("-", "_").replace(".", "_") if self.plat_name else plat
            return "py3", "none", plat
        return python, abi, plat


setup(cmdclass={"build_py": BuildPyWithTuner, "bdist_wheel": PlatformWheel})
