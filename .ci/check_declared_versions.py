"""The dependency bounds hpcpipe declares must accept the versions a CI lane runs.

Run in a lane's environment after installing hpcpipe: every requirement in hpcpipe's metadata
(pyproject's `dependencies`) is checked against the version of the module that is actually
imported, so a bound that is too high (e.g. mpi4py>=4 while the lane tests mpi4py 3.1) fails
CI instead of failing a cluster user's `pip install`. Imports are checked by module, not by pip
metadata: Debian's h5py, for one, registers no `h5py` distribution that pip could see.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

try:
    from packaging.requirements import Requirement
except ModuleNotFoundError:  # the lane's pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement


def main() -> int:
    failed = 0
    for text in importlib.metadata.requires("hpcpipe") or []:
        req = Requirement(text)
        if req.marker is not None:  # an extra's requirement, not a dependency
            continue
        module = importlib.import_module(req.name.replace("-", "_"))
        version = module.__version__
        ok = req.specifier.contains(version, prereleases=True)
        print(f"{req.name:12s} {version:10s} {'accepted by' if ok else 'REFUSED by'} {req}")
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
