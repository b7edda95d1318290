"""Helpers shared by the tests: a comparator that explains itself and never lets NaN through."""

import torch

# (atol, rtol) per dtype for results computed in fp32 internally and returned in that dtype.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float | None = None, rtol: float | None = None,
                 what: str = "") -> None:
    """Fail with the worst element and its index; NaN or inf anywhere in either tensor fails."""
    if atol is None or rtol is None:
        atol_d, rtol_d = TOLERANCES.get(actual.dtype, TOLERANCES[torch.float32])
        atol = atol_d if atol is None else atol
        rtol = rtol_d if rtol is None else rtol
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    assert torch.isfinite(a).all(), f"{what}: actual has {(~torch.isfinite(a)).sum().item()} non-finite values"
    assert torch.isfinite(e).all(), f"{what}: expected has {(~torch.isfinite(e)).sum().item()} non-finite values"
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    bad = err > bound
    if bad.any():
        idx = torch.nonzero(bad)[0].tolist()
        worst = int(torch.argmax(err - bound))
        raise AssertionError(
            f"{what}: {bad.sum().item()}/{bad.numel()} elements off (atol={atol}, rtol={rtol}); "
            f"first at {idx}: {a[tuple(idx)].item():.6g} vs {e[tuple(idx)].item():.6g}; "
            f"max abs err {err.flatten()[worst].item():.3g}"
        )
