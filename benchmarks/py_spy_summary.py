"""Summarise py-spy's collapsed stacks (``--format raw``, as the serving benchmarks' ``--py-spy`` writes them).

    python -m benchmarks.py_spy_summary FILE [FILE ...] [--thread VLLM::EngineCore/MainThread] [--top 25]
        [--match vllm_interp]

Per file: the samples of each process's threads (a process named by its command's first words, a thread by its
name), then, for the threads whose ``process/thread`` label contains ``--thread``, the functions with the most
samples inclusive of their callees (a function counted once per sample however deep it recurs), only those whose
frame contains ``--match`` when given. Files side by side (a plain run and a feature run) give the columns of one
table, so that a function's share in each shows at once. With ``--idle`` sampling (the benchmarks' default) a
thread waiting for work is sampled too: its waiting frames are in the table like any other.
"""

import argparse
import re
from collections import Counter
from pathlib import Path

PROCESS = re.compile(r'^process \d+:"(.*)"$')
THREAD = re.compile(r"^thread \(\d+\): (.*)$")
FRAME = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")


def process_name(command: str) -> str:
    """A process's short name: vLLM's (``VLLM::EngineCore``) as is, else its module or script."""
    words = command.split()
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1]
    return words[0] if words[0].startswith("VLLM") or len(words) == 1 else Path(words[1]).name


def parse(path: Path) -> list[tuple[str, list[str], int]]:
    """``(process/thread, function frames outermost first, samples)`` per distinct stack."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        process, thread, functions = "?", "?", []
        for frame in stack.split(";"):
            if match := PROCESS.match(frame):
                process = process_name(match.group(1))
            elif match := THREAD.match(frame):
                thread = match.group(1)
            else:
                functions.append(frame)
        stacks.append((f"{process}/{thread}", functions, int(count)))
    return stacks


def function_of(frame: str) -> str:
    """``name (file)`` without the line, so that one function's lines count together."""
    match = FRAME.match(frame)
    return f"{match.group(1)} ({Path(match.group(2)).name})" if match else frame


def summarise(paths: list[Path], thread: str, top: int, match: str | None) -> str:
    parsed = [parse(path) for path in paths]
    names = [path.stem for path in paths]
    threads: list[Counter] = [Counter() for _ in paths]
    functions: list[Counter] = [Counter() for _ in paths]
    for i, stacks in enumerate(parsed):
        for label, frames, count in stacks:
            threads[i][label] += count
            if thread in label:
                # ``--match`` reads the whole frame (its file's path names the package), the table the short name.
                for name in {function_of(frame) for frame in frames if match is None or match in frame}:
                    functions[i][name] += count
    lines = ["| thread | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    busiest = sorted(set().union(*threads), key=lambda label: -max(c[label] for c in threads))[:top]
    lines += [f"| `{label}` | " + " | ".join(str(c[label]) for c in threads) + " |" for label in busiest]
    lines += ["", f"Functions of threads matching `{thread}`" + (f" (frames with `{match}`)" if match else "")
              + ", samples inclusive of callees:", "", "| function | " + " | ".join(names) + " |",
              "|---|" + "---|" * len(names)]
    ranked = sorted(set().union(*functions), key=lambda name: -max(c[name] for c in functions))[:top]
    lines += [f"| `{name}` | " + " | ".join(str(c[name]) for c in functions) + " |" for name in ranked]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--thread", default="VLLM::EngineCore/MainThread")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--match", default=None)
    args = parser.parse_args()
    print(summarise(args.files, args.thread, args.top, args.match))


if __name__ == "__main__":
    main()
