"""`verify`'s page comparison: identical bytes, rounding-level noise, other content."""

from __future__ import annotations

import torch

from hf3fsctl.offline.verify import compare

HEAD_DIM = 64


def _page(seed: int, rows: int = 256) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows * HEAD_DIM, generator=generator) * 3


def _bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16).view(torch.uint8)


def test_equal_bytes_are_identical() -> None:
    page = _bytes(_page(0))
    assert compare(page, page.clone(), "bfloat16", HEAD_DIM)[0] == "identical"


def test_rounding_level_noise_is_other_numerics() -> None:
    values = _page(0)
    noisy = values * (1 + 4e-3 * torch.randn(values.shape, generator=torch.Generator()))
    verdict, rel, _, corr = compare(_bytes(noisy), _bytes(values), "bfloat16", HEAD_DIM)
    assert (verdict, rel < 0.05, corr > 0.99) == ("other_numerics", True, True)


def test_another_page_is_wrong() -> None:
    assert compare(_bytes(_page(1)), _bytes(_page(0)), "bfloat16", HEAD_DIM)[0] == "wrong"


def test_one_token_row_of_other_content_makes_the_page_wrong() -> None:
    values = _page(0)
    swapped = values.clone()
    swapped[:HEAD_DIM] = _page(1)[:HEAD_DIM]
    assert compare(_bytes(swapped), _bytes(values), "bfloat16", HEAD_DIM)[0] == "wrong"
