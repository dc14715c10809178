"""A pydiff shader layer inside a PyTorch model, trained with torch.optim.

    python samples/torch_layer.py [--steps 300] [--plot torch_layer.png]

The model is torch.nn.Linear -> a Slang activation with a learnable slope per feature
(samples/torch_layer.slang, called with torch tensors: pydiff runs it on its tape and hands
torch the gradients) -> torch.nn.Linear, fitted to y = sin(3 x0) + x1^2 by torch.optim.Adam.
Before training, the layer's gradients are checked against the same activation written in
torch, in float64. Needs torch (pip install 'pydiff[torch]').
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import pydiff


class ShaderSwish(torch.nn.Module):
    """x * sigmoid(beta x) per feature, computed by a Slang function through pydiff."""

    def __init__(self, features: int):
        super().__init__()
        self.module = pydiff.load_module(Path(__file__).with_name("torch_layer.slang"))
        self.beta = torch.nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A torch tensor in, a torch tensor out; beta (features,) broadcasts over the batch.
        return self.module.swish(x, self.beta)


def make_model(hidden: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(2, hidden), ShaderSwish(hidden), torch.nn.Linear(hidden, 1)
    )


def check_layer_gradients(layer: ShaderSwish) -> float:
    """Largest difference between the layer's gradients and torch's own float64 ones."""
    x = torch.randn(8, layer.beta.numel(), requires_grad=True)
    upstream = torch.randn(8, layer.beta.numel())
    (layer(x) * upstream).sum().backward()
    x64 = x.detach().double().requires_grad_()
    beta64 = layer.beta.detach().double().requires_grad_()
    (x64 * torch.sigmoid(beta64 * x64) * upstream.double()).sum().backward()
    worst = max(
        (x.grad.double() - x64.grad).abs().max().item(),
        (layer.beta.grad.double() - beta64.grad).abs().max().item(),
    )
    layer.beta.grad = None
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--plot", default="torch_layer.png", help="PNG of the loss ('' to skip)")
    args = ap.parse_args()

    model = make_model()
    print(f"layer gradients vs torch float64: max difference {check_layer_gradients(model[1]):.2e}")
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(256, 2, generator=gen) * 2 - 1
    y = torch.sin(3 * x[:, :1]) + x[:, 1:] ** 2
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    losses = []
    try:
        from tqdm import trange
    except ImportError:
        trange = range
    for _ in trange(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"mse: first step {losses[0]:.4f}, last step {losses[-1]:.5f}")
    print(
        f"learned slopes beta: min {model[1].beta.min().item():.3f}, "
        f"max {model[1].beta.max().item():.3f}"
    )
    if args.plot:
        from plotting import save_line_plot

        save_line_plot(
            args.plot,
            [(range(1, len(losses) + 1), losses, "-", None)],
            xlabel="step",
            ylabel="mse",
            title="torch model with a pydiff layer",
        )


if __name__ == "__main__":
    main()
