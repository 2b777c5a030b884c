"""Maps the top-level folders onto the ``hicache`` import namespace (DESIGN.md §2).

``cluster/`` is imported as ``hicache.cluster`` and so on; subpackages are discovered, so a new
folder with an ``__init__.py`` needs no edit here. Everything else lives in pyproject.toml.
"""

from setuptools import find_packages, setup

FOLDERS = {
    "hicache": "hicache",
    "hicache.cluster": "cluster",
    "hicache.workers": "workers",
    "hicache.storage": "storage",
    "hicache.kernels": "kernels",
}


def _packages() -> list[str]:
    packages = []
    for name, folder in FOLDERS.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(folder)]
    return packages


setup(packages=_packages(), package_dir=FOLDERS)
