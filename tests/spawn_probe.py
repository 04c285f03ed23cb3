"""What tests/test_spawn.py runs both as ``python -m spawn_probe`` and forked by tests/spawn.py, to see
that the two processes look the same from inside and end the same way. ``spawn_probe WHAT [ARG]``."""
import json
import os
import sys
import time

what = sys.argv[1]
if what == "report":  # what a fresh process sees at start; exits with ARG
    print(json.dumps({"argv": [os.path.basename(sys.argv[0]), *sys.argv[1:]], "path0": sys.path[0],
                      "cwd": os.getcwd(), "name": __name__, "probe_var": os.environ.get("EAGLE3_OPS_PROBE"),
                      "stdin": sys.stdin.read(), "eagle3_ops_loaded": "eagle3_ops" in sys.modules}))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[2]))
elif what == "caches":  # where the preloaded libraries put their caches (read from the environment when used)
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from triton import knobs

    print(json.dumps({"triton": knobs.cache.dir, "inductor": cache_dir()}))
elif what == "raise":  # an uncaught exception: a traceback and status 1
    raise ValueError("the probe raised")
elif what == "unflushed":  # output still buffered at exit, for a closed stdout: the interpreter's own message
    print("x" * 100)
elif what == "sleep":
    time.sleep(float(sys.argv[2]))
