"""Installs the top-level folders models/ and parallelize/ as dtrain.models and dtrain.parallelize.

pyproject.toml cannot express a remapped folder's subpackages, so each one is listed here with its folder
(setuptools resolves a nested package of a remapped parent inconsistently across versions).
"""

import os

from setuptools import find_packages, setup

MAPPED = {"models": "dtrain.models", "parallelize": "dtrain.parallelize"}

package_dir = {"dtrain": "dtrain"}
for folder, name in MAPPED.items():
    for sub in find_packages(include=[folder, folder + ".*"]):
        package_dir[name + sub[len(folder):]] = sub.replace(".", os.sep)

mapped_packages = [name for name in package_dir if name != "dtrain"]
setup(packages=find_packages(include=["dtrain", "dtrain.*"]) + mapped_packages, package_dir=package_dir)
