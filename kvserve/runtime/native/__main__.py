"""``python -m kvserve.runtime.native [-v]``: build the native kernels now and say where."""

import sys

from kvserve.runtime import native

ok = native.load(verbose="-v" in sys.argv)
print(f"native CPU kernels: {'ready in ' + str(native.build_dir()) if ok else native.reason()}")
sys.exit(0 if ok else 1)
