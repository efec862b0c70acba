"""A container's first process, inside its pod's network namespace
(`ip netns exec`, which also gives it a mount namespace of its own): bind the
pod's volumes at their mountPaths (read-only where asked), set the pod's
hostname in a UTS namespace of its own, then exec the
container's command with its environment.

Run as a script (`python podexec.py SPEC.json`), importing nothing of the
project, so it starts fast and whatever the working directory.
"""

import ctypes
import json
import os
import subprocess
import sys

CLONE_NEWUTS = 0x04000000


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    # A UTS namespace of its own: the pod's hostname, as in a pod.
    libc = ctypes.CDLL(None, use_errno=True)
    hostname = spec["hostname"].encode()
    if libc.unshare(CLONE_NEWUTS) != 0 or libc.sethostname(hostname, len(hostname)) != 0:
        raise OSError(ctypes.get_errno(), "unshare/sethostname")
    # Private propagation: nothing mounted here shows on the host.
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    for mount in sorted(spec["mounts"], key=lambda m: m["target"].count("/")):
        subprocess.run(["mount", "--bind", mount["source"], mount["target"]], check=True)
        if mount["readOnly"]:
            subprocess.run(["mount", "-o", "remount,bind,ro", mount["target"]], check=True)
    os.chdir(spec.get("workingDir") or "/")
    argv = spec["argv"]
    try:
        os.execvpe(argv[0], argv, spec["env"])
    except OSError as exc:
        print(f"devcluster: cannot run {argv[0]!r}: {exc}", file=sys.stderr, flush=True)
        sys.exit(127)


if __name__ == "__main__":
    main()
