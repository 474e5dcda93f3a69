"""What pyproject.toml cannot say: the optional compiled core (tskv/core/_compiled.c, which
includes a header per concern from tskv/core/_compiled_lib/).

`optional=True`: where it cannot be built (no C compiler, no Python headers), pip installs tskv
without it and the pure-Python modules, the reference, do the work (tskv/core/compiled.py).
"""

from glob import glob

from setuptools import Extension, setup

compiled = Extension(
    "tskv.core._compiled",
    ["tskv/core/_compiled.c"],
    depends=sorted(glob("tskv/core/_compiled_lib/*.h")),  # a header changed: built again
    optional=True,
)
setup(ext_modules=[compiled])
