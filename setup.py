"""Build hetpipe: setup.py drives CMake (ninja) for the compiled core: the shared library
`libhetpipe_core.so` and the extension modules `hetpipe_core._C` and `hetpipe_core._mpi` that link it.

CMake options are passed through the environment variable CMAKE_ARGS, e.g.
    CMAKE_ARGS="-DHETPIPE_WITH_CUDA=OFF" pip install --no-build-isolation -e .
The defaults are HETPIPE_WITH_CUDA=AUTO (CUDA when nvcc is found), HETPIPE_WITH_MPI=AUTO (the MPI
extension `hetpipe_core._mpi` when an MPI library is found: the environment's own MPICH first) and a
Release build.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """An extension module built by CMake: its target is the module's last name (``_C``, ``_mpi``)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])
        self.target = name.rsplit(".", 1)[-1]


CORE_LIBRARY = "libhetpipe_core.so"


class CMakeBuild(build_ext):
    """Configures CMake once for all extensions, then builds each one's target; drops ``_mpi`` when
    CMake found no MPI (the core builds and imports without it).

    The core library is built beside the extensions (their run path is ``$ORIGIN``), so it travels
    wherever they do: into the wheel, and into the source tree for an editable install."""

    cmake_dir = None
    mpi_built = False

    def build_extension(self, ext: CMakeExtension) -> None:
        if self.cmake_dir is None:
            # Configured at the first extension, where setuptools has chosen the output folder.
            self.cmake_dir = self._configure(Path(self.get_ext_fullpath(ext.name)).parent.resolve())
            self.mpi_built = "HETPIPE_MPI_BUILT:INTERNAL=ON" in (self.cmake_dir / "CMakeCache.txt").read_text()
            if not self.mpi_built:
                self.extensions = [e for e in self.extensions if e.target != "_mpi"]   # not an output
        if ext.target == "_mpi" and not self.mpi_built:
            return
        subprocess.run(["cmake", "--build", ".", "--target", ext.target, "-j", str(os.cpu_count() or 2)],
                       cwd=self.cmake_dir, check=True)

    def _library_pair(self) -> tuple:
        """(where the build puts the core library, where an in-place build keeps it)."""
        inplace_ext, regular_ext = self._get_inplace_equivalent(self.get_finalized_command("build_py"),
                                                                self.extensions[0])
        return (os.path.join(os.path.dirname(regular_ext), CORE_LIBRARY),
                os.path.join(os.path.dirname(inplace_ext), CORE_LIBRARY))

    def copy_extensions_to_source(self) -> None:
        super().copy_extensions_to_source()
        regular, inplace = self._library_pair()
        self.copy_file(regular, inplace, level=self.verbose)

    def _get_output_mapping(self):
        yield from super()._get_output_mapping()
        if self.inplace:
            yield self._library_pair()

    def get_outputs(self) -> list:
        outputs = super().get_outputs()
        if not self.inplace:
            outputs.append(os.path.join(self.build_lib, "hetpipe_core", CORE_LIBRARY))
        return outputs

    def _configure(self, extdir: Path) -> Path:
        cfg = "Debug" if self.debug else "Release"
        cmake_args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}{os.sep}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            "-G", "Ninja",
        ]
        # The MPI that mpi4py loads in this environment (MPICH from PyPI installs its headers and
        # libmpi into the environment's prefix): hetpipe_core._mpi must link that very library.
        if (Path(sys.prefix) / "include" / "mpi.h").exists():
            cmake_args.append(f"-DMPI_HOME={sys.prefix}")
        cmake_args += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        build_temp = Path(self.build_temp) / "hetpipe_core"
        build_temp.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cmake", os.fspath(ROOT), *cmake_args], cwd=build_temp, check=True)
        return build_temp


setup(
    name="hetpipe",
    version="0.1.0",
    description="Pipelined model parallelism on heterogeneous GPU clusters with Wave Synchronous Parallel",
    packages=["hetpipe_core"] + find_packages("python"),
    package_dir={"hetpipe_core": "hetpipe_core", "": "python"},
    package_data={"hetpipe_core": ["py.typed", "*.pyi"], "hetpipe": ["data/**/*"]},
    ext_modules=[CMakeExtension("hetpipe_core._C"), CMakeExtension("hetpipe_core._mpi")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    install_requires=["numpy"],
    extras_require={
        "torch": ["torch>=2.3"],
        "jax": ["jax==0.10.2", "jaxlib==0.10.2"],
        "mpi": ["mpi4py"],
        "plot": ["matplotlib"],
        "test": ["pytest", "hypothesis", "scikit-learn"],
    },
    entry_points={"console_scripts": ["hetpipe=hetpipe.cli:main"]},
    zip_safe=False,
)
