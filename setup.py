"""Builds colibri-core's optional C extension (colibri_core.compute.cpu._kernels).

Everything else is in pyproject.toml. The extension needs a C compiler at install time;
when it cannot be built, colibri still works, with slower numpy dequantisation.
"""

import os
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

FLAGS = ["-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]


class BuildKernels(build_ext):
    def build_extensions(self):
        compiler = self.compiler
        for ext in self.extensions:
            ext.extra_compile_args = list(FLAGS)
            if self._has_openmp():
                ext.extra_compile_args.append("-fopenmp")
                ext.extra_link_args = ["-fopenmp"]
        super().build_extensions()

    def _has_openmp(self) -> bool:
        if sys.platform == "win32":
            return False
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "omp.c")
            with open(src, "w") as f:
                f.write("#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
            try:
                objects = self.compiler.compile([src], output_dir=tmp, extra_postargs=["-fopenmp"])
                self.compiler.link_executable(objects, os.path.join(tmp, "omp"), extra_postargs=["-fopenmp"])
            except Exception:
                return False
        return True


setup(
    ext_modules=[Extension("colibri_core.compute.cpu._kernels", ["colibri_core/compute/cpu/_kernels.c"], optional=True)],
    cmdclass={"build_ext": BuildKernels},
)
