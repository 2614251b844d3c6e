"""The site op's CUDA-graph kernel on a machine without a GPU: every variant compiles for Hopper (Triton's
frontend and its bundled ptxas), and Triton's interpreter runs it against the eager op in float32
(tests/models/site_kernel_cases.py; the interpreter rounds bfloat16 its own way, so bf16 is the GPU tests')."""

import itertools

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from triton.runtime.interpreter import InterpretedFunction

from tests.models.site_kernel_cases import (
    eager_steering_adds_the_indexed_rows,
    kernel_leaves_unnamed_rows_alone,
    kernel_matches_eager,
)
from vllm_interp.models import site_kernel

CPU = torch.device("cpu")
SWITCHES = ("HAS_RESIDUAL", "HIDDEN_IN_USE", "PATCH", "STEER", "READ")
POINTERS = {"steer_index_ptr": "*i64", "patch_index_ptr": "*i64", "read_slot_ptr": "*i64", "read_flag_ptr": "*i32"}


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setattr(site_kernel, "_site_kernel", InterpretedFunction(site_kernel._site_kernel.fn))


def test_every_variant_of_the_kernel_compiles_for_hopper():
    kernel = site_kernel._site_kernel
    names = kernel.arg_names
    signature = {name: "constexpr" if name.isupper() else POINTERS.get(name, "*bf16" if name.endswith("_ptr")
                                                                       else "i32") for name in names}
    for switches in itertools.product((False, True), repeat=len(SWITCHES)):
        constants = {**dict(zip(SWITCHES, switches, strict=True)), "BLOCK": 1024}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(names.index(name),): value for name, value in constants.items()})
        assert compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"], constants


@pytest.mark.parametrize(("pair", "hidden_in_use"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("width", [576, 2050])
def test_the_interpreted_kernel_writes_steers_and_reads_as_the_eager_op_does(interpreted, pair, hidden_in_use,
                                                                               width):
    kernel_matches_eager(CPU, torch.float32, pair, hidden_in_use, width)


def test_the_interpreted_kernel_leaves_rows_no_buffer_names_alone(interpreted):
    kernel_leaves_unnamed_rows_alone(CPU)


@pytest.mark.parametrize("width", [576, 2050])
def test_the_interpreted_eager_steering_adds_each_rows_table_row(interpreted, width):
    eager_steering_adds_the_indexed_rows(CPU, torch.float32, width)
