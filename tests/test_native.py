"""Native code built on first use: processes that start together build it once."""

import subprocess
import sys
import textwrap
from pathlib import Path

# A stand-in for the compiler: it notes that it ran, takes a second, then writes the "library".
FAKE_COMPILER = textwrap.dedent(
    """
    import sys, time
    with open(sys.argv[1], "a") as runs:
        runs.write("built\\n")
    time.sleep(1)
    open(sys.argv[2], "w").write("library")
    """
)

# One process: the library's path from build_once, with the cache in the directory named.
BUILDER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    os.environ["XDG_CACHE_HOME"] = sys.argv[1]
    from mlx_hybrid.native import build_once
    source, runs, compiler = (Path(sys.argv[1]) / name for name in ("source.c", "runs.txt", "compiler.py"))
    print(build_once("fake", [source], lambda out: [sys.executable, str(compiler), str(runs), str(out)]))
    """
)


def test_processes_started_together_build_once_and_share_the_library(tmp_path):
    (tmp_path / "source.c").write_text("int f(void) { return 1; }\n")
    (tmp_path / "compiler.py").write_text(FAKE_COMPILER)
    builders = [
        subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    paths = {builder.communicate(timeout=60)[0].strip() for builder in builders}
    assert all(builder.returncode == 0 for builder in builders)
    assert (tmp_path / "runs.txt").read_text() == "built\n"  # the others waited for the first's library
    (path,) = paths
    assert Path(path).read_text() == "library"
