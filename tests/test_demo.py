"""`vllm-interp demo` keeps vLLM's output in a log file: the redirection, checked in a child process (it moves
file descriptors 1 and 2, which pytest's capture also uses)."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from vllm_interp.demo import engine_output_to
    log = Path(sys.argv[1])
    with engine_output_to(log) as terminal:
        print("engine noise")
        os.write(2, b"warning from C++\\n")
        os.system("echo child process output")
        print("demo line", file=terminal)
        if len(sys.argv) > 2:
            raise SystemExit("failed on purpose")
    print("after")
""")


def test_engine_output_goes_to_the_log_and_the_demo_lines_to_the_terminal(tmp_path):
    log = tmp_path / "demo.log"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True, check=True)
    assert done.stdout == "demo line\nafter\n" and done.stderr == ""
    assert sorted(log.read_text().splitlines()) == ["child process output", "engine noise", "warning from C++"]


def test_a_failure_shows_the_log_tail(tmp_path):
    log = tmp_path / "demo.log"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(log), "fail"], capture_output=True, text=True)
    assert done.returncode == 1
    assert "the demo failed; the last lines of" in done.stdout and "child process output" in done.stdout
    assert "failed on purpose" in done.stderr
