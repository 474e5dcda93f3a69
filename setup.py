"""What pyproject.toml cannot say: the optional compiled key walk (tskv/core/_compiled.c).

`optional=True`: where it cannot be built (no C compiler, no Python headers), pip installs tskv
without it and the pure-Python modules, the reference, do the work (tskv/core/compiled.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tskv.core._compiled", ["tskv/core/_compiled.c"], optional=True)])
