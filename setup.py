"""The wheel carries the repository's top-level deploy/ (the Helm chart and the Dockerfiles, for
`dflash-trt deploy` from a pip install) as dflash_trt/_deploy; everything else is in pyproject.toml.
An editable install reads deploy/ from the checkout (dflash_trt/paths.py deploy_path)."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            shutil.copytree(Path(__file__).parent / "deploy", Path(self.build_lib) / "dflash_trt" / "_deploy",
                            dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPy})
