"""Build of eagle3_ops: a pure-Python package plus, when nvcc is found, the CUDA extension
``eagle3_ops._C`` compiled from the sources listed in ``csrc/sources.txt`` (the same list
CMakeLists.txt reads).

Env: ``TORCH_CUDA_ARCH_LIST`` (default ``9.0a;12.0a``), ``EAGLE3_OPS_SKIP_CUDA=1`` (no extension),
``CUDA_HOME`` (the toolkit root; found from ``nvcc`` on PATH when unset), ``MAX_JOBS``.
"""
import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.egg_info import egg_info

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCHS = "9.0a;12.0a"


def log(msg: str) -> None:
    print(f"eagle3_ops build: {msg}", file=sys.stderr, flush=True)


def read_sources() -> list:
    lines = (ROOT / "csrc" / "sources.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def find_cuda_home():
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    # The nvcc on PATH may be a wrapper script that execs the real one.
    text = Path(nvcc).read_text(errors="ignore") if Path(nvcc).stat().st_size < 4096 else ""
    m = re.search(r"exec\s+(\S+)/bin/nvcc", text)
    return m.group(1) if m else str(Path(os.path.realpath(nvcc)).parent.parent)


def arch_macro(arch_list: str) -> str:
    # "9.0a;12.0a" -> "sm_90a,sm_120a" (stringized in csrc/bindings.cpp)
    return ",".join("sm_" + a.strip().replace(".", "").replace("+PTX", "") for a in arch_list.split(";") if a.strip())


def skip_cuda() -> bool:
    """EAGLE3_OPS_SKIP_CUDA, parsed as every eagle3_ops switch is (eagle3_ops/settings.py, loaded by
    path: the package cannot be imported before it is built); a bad value stops the build."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_eagle3_ops_build_settings", ROOT / "eagle3_ops" / "settings.py")
    settings = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = settings  # dataclasses look their module up
    spec.loader.exec_module(settings)
    try:
        return settings.get("EAGLE3_OPS_SKIP_CUDA")
    except settings.SettingError as e:
        sys.exit(f"eagle3_ops build: {e}")


class OwnMetadataWriters(egg_info):
    """setuptools' metadata step, running only setuptools' own metadata writers. setuptools imports
    the ``egg_info.writers`` entry point of every installed distribution here (SGLang pulls in
    ``kernels``, which has one), and ``make install`` installs SGLang while this package builds: a
    half-installed writer failed the build (CI: ``No module named 'kernels_data'``). This package's
    metadata needs none of them. Not covered (nothing in the environment registers them today; e.g.
    setuptools_scm would): ``setuptools.finalize_distribution_options`` hooks, loaded before any command,
    and ``setuptools.file_finders``, loaded by sdist's manifest code."""

    def run(self) -> None:
        import setuptools.command.egg_info as step

        every = getattr(step, "metadata", None)
        if every is None or not hasattr(every, "entry_points"):  # a setuptools that finds writers otherwise
            return super().run()

        class SetuptoolsWritersOnly:
            def __getattr__(self, name):
                return getattr(every, name)

            def entry_points(self, **selection):
                found = every.entry_points(**selection)
                if selection.get("group") != "egg_info.writers":
                    return found
                return [ep for ep in found if ep.module.partition(".")[0] == "setuptools"]

        step.metadata = SetuptoolsWritersOnly()
        try:
            super().run()
        finally:
            step.metadata = every


def cuda_extensions():
    if skip_cuda():
        log("EAGLE3_OPS_SKIP_CUDA=1: pure-Python package (triton + reference backends)")
        return [], {}
    cuda_home = find_cuda_home()
    if cuda_home is None or not Path(cuda_home, "bin", "nvcc").exists():
        log("no nvcc found: pure-Python package (triton + reference backends)")
        return [], {}
    os.environ["CUDA_HOME"] = cuda_home
    arch_list = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    import torch.utils.cpp_extension as cpp_ext
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    cpp_ext.CUDA_HOME = cuda_home
    # cuBLAS/cuSPARSE headers that torch's CUDA headers include ship in the nvidia wheels. They go
    # on CPATH (searched after every -I) so that the toolkit's own crt/ headers keep precedence.
    extra = []
    try:
        import nvidia

        extra = [str(Path(base, "cu13", "include")) for base in nvidia.__path__
                 if Path(base, "cu13", "include").is_dir()]
    except ImportError:
        pass
    if extra:
        os.environ["CPATH"] = os.pathsep.join([p for p in [os.environ.get("CPATH", "")] if p] + extra)
    archs = arch_macro(arch_list)
    log(f"CUDA_HOME={cuda_home}; compiling for TORCH_CUDA_ARCH_LIST={arch_list} ({archs})")
    define = [f"-DEAGLE3_OPS_ARCHS={archs}"]  # host compiler only: nvcc splits -D values at commas
    ext = CUDAExtension(
        name="eagle3_ops._C",
        sources=read_sources(),
        include_dirs=[str(ROOT / "csrc")],
        # -g0: Python's own flags carry -g, and debug info for the torch headers a .cpp parses doubled
        # the host files' compile time (a pybind11 host file took 67 s -> 31 s on a 2-core box); the kernels
        # keep -lineinfo.
        extra_compile_args={
            "cxx": ["-O3", "-g0"] + define,
            "nvcc": ["-O3", "-lineinfo", "--expt-relaxed-constexpr"],
        },
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


if __name__ == "__main__":  # setuptools runs setup.py as __main__; tests import read_sources()
    ext_modules, cmdclass = cuda_extensions()
    setup(ext_modules=ext_modules, cmdclass={"egg_info": OwnMetadataWriters, **cmdclass})
