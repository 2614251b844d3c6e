"""The GPU tests' set-up: without CUDA every module here is skipped unimported, so no engine (nor vLLM) starts."""

import pytest
import torch

CUDA = torch.cuda.is_available()


class _NeedsCuda(pytest.Item):
    """Stands for a module's tests without importing it; reported as one skipped ``gpu`` test."""

    def runtest(self) -> None:
        pytest.skip("needs CUDA")

    def reportinfo(self):
        return self.path, None, self.name


class _UnimportedModule(pytest.Module):
    def collect(self):
        item = _NeedsCuda.from_parent(self, name="needs_cuda")
        item.add_marker("gpu")
        return [item]


def pytest_pycollect_makemodule(module_path, parent):
    # CI runs `pytest tests` on CPU: these modules are not imported there, and count as skipped (not as
    # "no tests collected", which fails `pytest tests/gpu`).
    if not CUDA:
        return _UnimportedModule.from_parent(parent, path=module_path)
    return None


_NAMED_MODES = pytest.StashKey[set]()


@pytest.hookimpl(trylast=True)  # after `-k` and `-m` have deselected
def pytest_collection_modifyitems(config, items):
    # The parameters of the selected tests, among them the engine modes they compare (`-k graphs` names fewer).
    config.stash[_NAMED_MODES] = {value for item in items if hasattr(item, "callspec")
                                  for value in item.callspec.params.values() if isinstance(value, str)}


@pytest.fixture(scope="session")
def engines(tmp_path_factory, pytestconfig):
    # Imported here, not above: it imports vLLM, which collecting on a CPU machine must not pay for.
    from tests.gpu.modes import ONE_GPU_MODES, EngineModes

    # Only the one-GPU modes a selected test names start side by side: a narrow `-k` does not pay for all five.
    named = pytestconfig.stash.get(_NAMED_MODES, set())
    side_by_side = tuple(mode for mode in ONE_GPU_MODES if mode == "eager" or mode in named)
    return EngineModes(tmp_path_factory.mktemp("gpu"), side_by_side)
