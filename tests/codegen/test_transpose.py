"""The transposed byte copy (codegen/transpose.py): FP8 matrices of odd shapes, every byte moved (the
output starts as a fill byte no input holds at the checked positions), wrong arguments refused."""
import pytest
import torch

from fusion_compiler.codegen.transpose import transpose_bytes


@pytest.mark.parametrize("shape", [(1, 1), (37, 70), (64, 128), (129, 5)])
@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn, torch.uint8])
def test_transposed_copy_equals_torch(shape, dtype):
    x = (torch.randn(shape) * 100).to(dtype) if dtype.is_floating_point else torch.randint(0, 255, shape, dtype=dtype)
    out = torch.full(shape[::-1], 255, dtype=torch.uint8).view(dtype)  # 0xff: NaN in e5m2 and e4m3
    transpose_bytes(x, out)
    assert torch.equal(out.view(torch.uint8), x.view(torch.uint8).t())


def test_empty_and_wrong_arguments():
    x = torch.empty(0, 7, dtype=torch.float8_e5m2)
    assert transpose_bytes(x, torch.empty(7, 0, dtype=x.dtype)).shape == (7, 0)
    with pytest.raises(ValueError, match="1-byte"):
        transpose_bytes(torch.zeros(4, 4, dtype=torch.bfloat16), torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="wanted"):
        transpose_bytes(torch.zeros(4, 3, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8))
