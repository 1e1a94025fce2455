"""``python -m kvserve.runtime.native [-v]``: build the native kernels now and say where."""

import sys

from kvserve.runtime import native
from kvserve.runtime.native import quant_ops

ok = native.load(verbose="-v" in sys.argv)
print(f"native CPU kernels: {'ready in ' + str(native.build_dir()) if ok else native.reason()}")
quant_ok = quant_ops.load(verbose="-v" in sys.argv)
where = "ready in " + str(quant_ops.build_dir()) if quant_ok else quant_ops.reason()
print(f"quantized-weight kernels: {where}")
sys.exit(0 if ok and quant_ok else 1)
