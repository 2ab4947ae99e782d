"""One version number: CMakeLists.txt's project(tpfuse VERSION x.y.z) is what the library reports
(torch op tpfuse::version), what the package says (tpfuse.__version__) and what pyproject.toml's
regex metadata provider reads for the wheel."""

import os
import re
import sys
import unittest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

import tpfuse
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def cmake_version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as file:
        return re.search(r"project\(tpfuse\s+VERSION\s+([0-9.]+)", file.read()).group(1)


class Version(unittest.TestCase):
    def test_the_library_the_package_and_cmake_agree(self):
        self.assertEqual(torch.ops.tpfuse.version(), cmake_version())
        self.assertEqual(tpfuse.__version__, cmake_version())

    @unittest.skipIf(tomllib is None, "tomllib needs Python 3.11")
    def test_pyproject_takes_the_version_from_cmake(self):
        with open(os.path.join(ROOT, "pyproject.toml"), "rb") as file:
            pyproject = tomllib.load(file)
        self.assertIn("version", pyproject["project"]["dynamic"])
        self.assertNotIn("version", pyproject["project"])
        settings = pyproject["tool"]["scikit-build"]["metadata"]["version"]
        self.assertEqual(settings["provider"], "scikit_build_core.metadata.regex")
        self.assertEqual(settings["input"], "CMakeLists.txt")
        try:
            from scikit_build_core.metadata import regex
        except ImportError:  # the build requirement is not installed: apply the regex ourselves
            with open(os.path.join(ROOT, settings["input"])) as file:
                found = re.search(settings["regex"], file.read(), re.MULTILINE).group("value")
        else:
            rest = {k: v for k, v in settings.items() if k != "provider"}
            cwd = os.getcwd()
            os.chdir(ROOT)
            try:
                found = str(regex.dynamic_metadata("version", rest))
            finally:
                os.chdir(cwd)
        self.assertEqual(found, cmake_version())


if __name__ == "__main__":
    sys.exit(unittest.main())
