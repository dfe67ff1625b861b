"""Build hook: generate gRPC stubs from protos/ before packaging (they are not in git)."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).parent / "scripts"))


class BuildWithProtos(build_py):
    def run(self) -> None:
        import genprotos

        genprotos.generate()
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
