"""Does a change of the hook keep its results? The parameters after 40 steps on 3 ranks
(the DDP test model on the digits data), per hook configuration and transport, with the
gradpack installed here and with another build of it, compared bit for bit.

Build the other one from a commit and unpack it beside the installed one:

    git worktree add /tmp/base <commit>
    (cd /tmp/base/python && maturin build --release --out /tmp/basewheel)
    pip install --no-deps --target /tmp/basepkg /tmp/basewheel/*.whl
    python python/bench/same_bits.py --against /tmp/basepkg

Exits with 1 when a configuration differs. ``auto`` is left out: its choice follows the
clock, so two runs may choose differently.
"""

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")
CONFIGS = ["identity", "int8-allgather", "int8-ef-ring", "int8-ef-twoshot", "topk-ef",
           "topk-ef-model", "topk-ef-from-3", "sign-majority", "powersgd2", "int8-hier",
           "topk-ef-momentum", "topk-ef-model-momentum", "int8-ef-ring-momentum"]


def crcs(names, path=None):
    """``{config: crc of its parameters}`` from a child process (``path`` first on its
    import path: the other build)."""
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "import ddp_digits\n"
        "if __name__ == '__main__':\n"
        "    for r in ddp_digits.run(3, %r, [0], 40)[0]:\n"
        "        print(r['config'], r['params_crc'], r['identical'])\n" % (TESTS, names)
    )
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout
    got = {}
    for line in out.splitlines():
        name, crc, same = line.split()
        if same != "True":
            raise SystemExit(f"{name}: the ranks' parameters differ")
        got[name] = int(crc)
    return got


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True,
                    help="a directory holding the other build's gradpack package")
    ap.add_argument("--transports", default="tcp,pg,shm")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    a = ap.parse_args()
    names = [f"{c}@{t}" for c in a.configs.split(",") for t in a.transports.split(",")]
    here, there = crcs(names), crcs(names, a.against)
    bad = 0
    print(f"{'configuration':<24} {'this build':>12} {'the other':>12}")
    for n in names:
        same = here[n] == there[n]
        bad += not same
        print(f"{n:<24} {here[n]:>12} {there[n]:>12}  {'same' if same else 'DIFFERENT'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
