"""The opaque custom op every hook site calls, registered once per process.

``vllm_interp::read_site`` copies the rows planned for this step out of the residual stream into a
persistent per-layer buffer. The stream is given as vLLM carries it: either one tensor, or the deferred
``(hidden_states, residual)`` pair whose sum is the true stream. Rows are gathered first, so the op reads
only the planned rows and its output is a copy: the fused add+norm kernels that later update ``residual``
in place cannot change what was read.

Why an opaque op over persistent buffers: vLLM traces the model once and drops Dynamo guards, so Python
state read at trace time would be frozen into the graph. The op's body runs on every step instead, and the
tensors it touches are module buffers that the runner updates in place (``copy_``), which the compiled
graph sees as inputs. ``mutates_args`` on the output keeps Inductor from dropping the call.
"""

import torch

# Rows the runner planned for the current step. Host-side so that a step that reads nothing costs one
# early return per site; steps that read run the op body eagerly (CPU Inductor calls it as an extern).
_step_read_rows = 0


def set_step_read_rows(count: int) -> None:
    global _step_read_rows
    _step_read_rows = count


def _read_site(
    hidden: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor, out: torch.Tensor, hook: int
) -> None:
    # A CUDA-graph capture freezes this body, so captured graphs read every slot on each replay (the runner
    # keeps unplanned slots at row 0); eager steps read only the planned rows.
    capturing = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
    count = rows.shape[0] if capturing else _step_read_rows
    if count == 0:
        return
    index = rows[:count]
    width = hidden.shape[-1]
    picked = hidden.reshape(-1, width).index_select(0, index)
    if residual is not None:
        picked.add_(residual.reshape(-1, width).index_select(0, index))
    out[hook, :count].copy_(picked)


def _read_site_fake(
    hidden: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor, out: torch.Tensor, hook: int
) -> None:
    return None


def _register() -> None:
    if hasattr(torch.ops.vllm_interp, "read_site"):
        return
    lib = torch.library.Library("vllm_interp", "FRAGMENT")  # noqa: TOR901 - lives for the process
    lib.define("read_site(Tensor hidden, Tensor? residual, Tensor rows, Tensor(a!) out, int hook) -> ()")
    lib.impl("read_site", _read_site, "CompositeExplicitAutograd")
    torch.library.register_fake("vllm_interp::read_site", _read_site_fake, lib=lib)
    _LIBS.append(lib)


_LIBS: list[torch.library.Library] = []
_register()
read_site = torch.ops.vllm_interp.read_site
